"""The EAGLE-3 drafter: one Llama decoder layer over the target's fused hidden states.

Layout and tensor names follow SGLang's ``LlamaForCausalLMEagle3`` so that a state_dict
exports by renaming nothing:

    embed_tokens.weight            [V, H]      frozen copy of the target's token embedding
    fc.weight                      [H, 3*Ht]   fuses the three aux hidden states of the target
    midlayer.input_layernorm       RMSNorm(H)  on the token embedding
    midlayer.hidden_norm           RMSNorm(H)  on the fused (or fed-back) hidden state
    midlayer.self_attn.{q,k,v}_proj  2H -> heads * head_dim   (input: [embedding ; hidden])
    midlayer.self_attn.o_proj        heads * head_dim -> H
    midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj   (SwiGLU)
    norm.weight                    RMSNorm(H)  before the head
    lm_head.weight                 [D, H]      logits over the draft vocabulary
    buffers d2t int64 [D], t2d bool [V]        draft id i is target id i + d2t[i]

Forward (one drafting step, the signature the exporter's round trip uses)::

    logits, hidden_out = drafter(input_ids, hidden, position_ids=None, cache=None, segment_ids=None)

    input_ids    int64 [B, T]   token x_{t+1} at position t (the token after the one whose
                                target features are in ``hidden``)
    hidden       [B, T, 3*Ht]   aux hidden states of the target (layer_ids order), fused by fc;
                 or [B, T, H]   the ``hidden_out`` of the previous drafting step (no fc)
    position_ids int64 [B, T]   rotary positions; default arange(T)
    cache        TTTCache|None  None: one causal pass. A TTTCache: training-time test; the
                                first call fills it with this step's keys/values, later calls
                                attend to those (causal) plus their own diagonal (see below)
    segment_ids  int64 [B, T]   packed samples: attention never crosses a segment; -1 = padding
    returns      logits [B, T, D] over the draft vocab, hidden_out [B, T, H] (pre-norm, fed back)

Training-time test mask (EAGLE-3): step 0 is ordinary causal attention over the real
context. Step j > 0 at position t stands for the j-th drafted token after t: it attends to the
step-0 keys at positions <= t of its own sample (the verified context) and to the keys that
steps 1..j made at position t (its own drafted ancestors) -- what the drafter sees at depth j
of a draft tree in SGLang. Step j's queries and keys rotate at position t + j, where the
j-th drafted token sits at inference (the caller passes ``position_ids + j``;
eaglenest.training.objective does).

Attention never builds a [T, T] matrix in training: the causal context part runs in a
block-sparse kernel (FlexAttention on a GPU) or a dense fallback (CPU), returning its
log-sum-exp (eaglenest.model.context_attention); the j diagonal keys are per-position dot
products; the two parts are merged exactly through their log-sum-exps
(eaglenest.model.kernels, with the norms' and the MLP gate's autograd functions).

Layer ids (HF convention: hidden_states[i] of a transformers forward is the input of decoder
layer i) are kept in the config; translating them for a serving backend is the exporter's job.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from eaglenest.formats import atomic
from eaglenest.formats.shards import tensor_sha256
from eaglenest.model import kernels
from eaglenest.model.context_attention import TTTCache, causal_segment_mask, repeat_kv
from eaglenest.target_model.weights import load_target_rows, target_embedding_dtype

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# Key of a saved drafter's config.json: {tensor name: sha256 of its bytes in model.safetensors}.
CHECKSUMS_KEY = "eaglenest_tensor_sha256"


@dataclass
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    target_name: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_target_config(
        cls,
        target_config: str | os.PathLike | dict,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        target_name: str = "",
        **overrides,
    ) -> "DrafterConfig":
        """Sizes from a target's config.json (a path, its directory, or the parsed dict).

        Multimodal wrappers (Kimi-K2.5) keep the language model under ``text_config``.
        ``overrides`` replace any field (e.g. fewer heads than an MLA target has).

        MLA targets (DeepSeek-V3, Kimi-K2.5: ``kv_lora_rank``, ``qk_rope_head_dim``) have no
        Llama head to copy: their config's ``head_dim`` is the rotary part of a query/key
        only, which would make the drafter's attention a
        fraction of its width. The drafter, a Llama layer, takes hidden_size //
        num_attention_heads instead, as SGLang's Llama attention does for a draft config
        without ``head_dim``; a warning asks for an explicit shape (train.drafter).
        """
        import warnings

        if not isinstance(target_config, dict):
            path = Path(target_config)
            path = path / CONFIG_NAME if path.is_dir() else path
            target_config = json.loads(path.read_text())
        cfg = target_config.get("text_config") or target_config
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        mla = "kv_lora_rank" in cfg or "qk_rope_head_dim" in cfg
        if mla and not {"num_attention_heads", "head_dim"} <= set(overrides):
            warnings.warn(
                f"MLA target ({cfg.get('model_type', 'unknown type')}): its head_dim "
                f"{cfg.get('head_dim')} is the rotary part of MLA's query/key, so the drafter's "
                f"attention is sized hidden_size // num_attention_heads = {hidden} // {heads}; set "
                "train.drafter.num_attention_heads, num_key_value_heads and head_dim to choose "
                "(SpecForge's DeepSeek-V3 drafter: 56, 8 and 128 at hidden 7168)",
                stacklevel=2,
            )
        values = dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=hidden // heads if mla else cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=hidden,
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            target_name=target_name,
        )
        values.update(overrides)
        # Never shorter than the target: the drafter sees the same positions.
        values["max_position_embeddings"] = max(values["max_position_embeddings"], cfg.get("max_position_embeddings", 0))
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "DrafterConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown drafter config keys {unknown}")
        return cls(**values)



class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as Llama does: bf16 squares lose the small components.
        return kernels.rms_norm(x, self.weight, self.eps)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    angles = position_ids.float()[..., None] * inv_freq  # [B, T, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin



class Attention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        if self.heads % self.kv_heads:
            raise ValueError(f"num_attention_heads {self.heads} not a multiple of num_key_value_heads {self.kv_heads}")
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, position_ids, segment_ids, cache: TTTCache | None):
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(position_ids, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        group = self.heads // self.kv_heads
        if cache is None:
            mask = causal_segment_mask(segment_ids)
            out = F.scaled_dot_product_attention(q, repeat_kv(k, group), repeat_kv(v, group), attn_mask=mask)
        elif cache.steps == 0:
            cache.start(k, v, segment_ids)
            out, _ = cache.attend_context(q, group)
        else:
            cache.draft_k.append(k)
            cache.draft_v.append(v)
            context_out, context_lse = cache.attend_context(q, group)
            out = kernels.merge_diagonal_keys(context_out, context_lse, q, cache.draft_k, cache.draft_v, group)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))




class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        # gate and up are this call's own: nothing else reads them (their gradients may take their place).
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x), private=True))



class MidLayer(nn.Module):
    """The one decoder layer; attention reads [norm(embedding) ; norm(hidden)]."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, embeds, hidden, position_ids, segment_ids, cache):
        # SGLang's convention: the residual is the hidden state *before* hidden_norm.
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = residual + self.self_attn(x, position_ids, segment_ids, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, hidden, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything except the frozen embedding (which is the target's and large)."""
        return {name: t for name, t in self.state_dict().items() if name != "embed_tokens.weight"}

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.numel() != self.config.draft_vocab_size or t2d.numel() != self.config.vocab_size:
            raise ValueError(
                f"draft vocab d2t[{d2t.numel()}]/t2d[{t2d.numel()}] does not match the config "
                f"(draft_vocab_size {self.config.draft_vocab_size}, vocab_size {self.config.vocab_size})"
            )
        if int(t2d.sum()) != d2t.numel():
            raise ValueError(f"t2d marks {int(t2d.sum())} tokens but d2t has {d2t.numel()}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def backbone(self, input_ids, hidden, position_ids=None, cache=None, segment_ids=None):
        """One drafting step without the head: (normed hidden for logits, pre-norm hidden to feed back)."""
        batch, length = input_ids.shape
        if hidden.shape[-1] == 3 * self.config.target_hidden_size:
            hidden = self.fc(hidden)
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"hidden has width {hidden.shape[-1]}; expected 3*{self.config.target_hidden_size} "
                f"(aux hidden states) or {self.config.hidden_size} (fed back)"
            )
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
        if segment_ids is None:
            segment_ids = torch.zeros(batch, length, dtype=torch.int64, device=input_ids.device)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        out = self.midlayer(embeds, hidden, position_ids, segment_ids, cache)
        return self.norm(out), out

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed)

    def forward(self, input_ids, hidden, position_ids=None, cache=None, segment_ids=None):
        normed, hidden_out = self.backbone(input_ids, hidden, position_ids, cache, segment_ids)
        return self.compute_logits(normed), hidden_out

    # ---- files -------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike, extra_config: dict | None = None) -> None:
        """model.safetensors (all tensors, SGLang names, fp32) + config.json with each
        tensor's sha256, both atomic. The checksums live in config.json because safetensors
        writes several header entries in a random order: the same weights must give the
        same bytes."""
        directory = Path(directory)
        tensors = {name: t.detach().cpu().contiguous() for name, t in self.state_dict().items()}
        checksums = {name: tensor_sha256(t) for name, t in sorted(tensors.items())}
        atomic.write_with(directory / WEIGHTS_NAME, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
        atomic.write_json(directory / CONFIG_NAME, {**self.config.to_dict(), **(extra_config or {}), CHECKSUMS_KEY: checksums})

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, map_location="cpu") -> "Eagle3Drafter":
        """Load a saved drafter directory (``save``) or a training checkpoint file (.pt)."""
        path = Path(path)
        if path.is_dir():
            values = json.loads((path / CONFIG_NAME).read_text())
            known = {f.name for f in fields(DrafterConfig)}
            model = cls(DrafterConfig.from_dict({k: v for k, v in values.items() if k in known}))
            problem = weights_problem(path)
            if problem:
                raise DrafterFileError(
                    f"{path / WEIGHTS_NAME}: {problem}. Remove {path} and rerun: training resumes "
                    "from its last checkpoint and writes it again."
                )
            state = load_file(str(path / WEIGHTS_NAME), device=str(map_location))
            model.load_state_dict(state, strict=True)
            return model
        checkpoint = torch.load(path, map_location=map_location, weights_only=False)
        model = cls(DrafterConfig.from_dict(checkpoint["drafter_config"]))
        missing, unexpected = model.load_state_dict(checkpoint["model"], strict=False)
        if unexpected or set(missing) - {"embed_tokens.weight"}:
            raise ValueError(f"{path}: checkpoint does not fit the drafter (missing {missing}, unexpected {unexpected})")
        model.embed_tokens.weight.data.copy_(load_target_rows(checkpoint["target_path"], "embed"))
        return model


def build_drafter(
    target_path: str | os.PathLike,
    draft_vocab: dict[str, torch.Tensor],
    aux_layer_ids: list[int],
    target_name: str = "",
    seed: int = 0,
    init_head_from_target: bool = True,
    **overrides,
) -> Eagle3Drafter:
    """A fresh drafter for a target: sizes from its config, embedding copied, draft vocab set.

    With ``init_head_from_target`` the head starts as the target's lm_head rows of the draft
    vocab and the final norm as the target's: the drafter imitates the target's last hidden
    state, so the target's own way from that state to logits is a good start.
    """
    d2t, t2d = draft_vocab["d2t"], draft_vocab["t2d"]
    config = DrafterConfig.from_target_config(
        target_path, draft_vocab_size=d2t.numel(), aux_layer_ids=aux_layer_ids, target_name=target_name, **overrides
    )
    torch.manual_seed(seed)
    model = Eagle3Drafter(config)
    model.set_draft_vocab(d2t, t2d)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(load_target_rows(target_path, "embed"))
        # The embedding is frozen: kept in the target's own half precision it holds the same
        # values in half the memory (Kimi-K2.5's bf16 163,840 x 7,168: 2.2 GiB saved on the GPU).
        stored = target_embedding_dtype(target_path)
        if stored in (torch.bfloat16, torch.float16):
            model.embed_tokens.to(stored)
        if init_head_from_target:
            model.lm_head.weight.copy_(load_target_rows(target_path, "lm_head", t2d))
            model.norm.weight.copy_(load_target_rows(target_path, "norm"))
    return model


# ---- saved drafters --------------------------------------------------------------------------


class DrafterFileError(ValueError):
    """A saved drafter that fails its checksums (or cannot be read at all)."""


def weights_problem(directory: str | os.PathLike) -> str | None:
    """Why a saved drafter's weights cannot be trusted, or None. Drafters saved before
    checksums were recorded are accepted (nothing to check them against)."""
    directory = Path(directory)
    try:
        recorded = json.loads((directory / CONFIG_NAME).read_text()).get(CHECKSUMS_KEY)
    except (OSError, ValueError) as error:
        return f"{CONFIG_NAME} unreadable ({type(error).__name__}: {error})"
    if recorded is None:
        return None
    try:
        with safe_open(str(directory / WEIGHTS_NAME), framework="pt") as handle:
            if sorted(recorded) != sorted(handle.keys()):
                return "tensor names differ from the recorded ones"
            for name in sorted(recorded):
                if tensor_sha256(handle.get_tensor(name)) != recorded[name]:
                    return f"checksum mismatch in {name} (file corrupted)"
    except Exception as error:  # noqa: BLE001 - OSError, or safetensors' own error for a bad header
        return f"unreadable ({type(error).__name__}: {error})"
    return None
