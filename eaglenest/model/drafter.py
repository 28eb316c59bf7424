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
j-th drafted token sits at inference (the caller passes ``position_ids + j``; eaglenest.stages.train
does).

Attention never builds a [T, T] matrix in training: the causal context part runs in a
block-sparse kernel (FlexAttention on a GPU) or a dense fallback (CPU), returning its
log-sum-exp; the j diagonal keys are per-position dot products; the two parts are merged
exactly through their log-sum-exps.

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
from eaglenest.formats.shards import SAFETENSORS_DTYPE_NAMES, tensor_sha256

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# Key of a saved drafter's config.json: {tensor name: sha256 of its bytes in model.safetensors}.
CHECKSUMS_KEY = "eaglenest_tensor_sha256"


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


# Values a norm or the MLP's gate handles at once outside its matmuls (2^24: 64 MiB for a
# float32 temporary): 2,340 rows of a Kimi-shaped drafter's H 7,168 (910 of its MLP's 18,432),
# 29,127 of SmolLM2's H 576, so a small model's step, bound by kernel launches, is cut into a
# couple of chunks at most. A module constant, which torch.compile reads as one (compiled, only
# the merge of the diagonal keys runs in chunks: _elementwise_chunks).
CHUNK_ELEMENTS = 1 << 24


def _row_chunks(rows: int, width: int) -> list[slice]:
    """Slices of ``rows`` rows of ``width`` values, CHUNK_ELEMENTS values a slice at most."""
    step = max(1, CHUNK_ELEMENTS // width)
    return [slice(start, start + step) for start in range(0, rows, step)]


def _elementwise_chunks(rows: int, width: int) -> list[slice]:
    """:func:`_row_chunks` for work that is elementwise or reduces along a row (the norms, the
    gate): one slice under torch.compile, whose fused kernels keep no float32 temporaries, so
    chunks would only repeat kernels in the graph (and its compile)."""
    return [slice(0, rows)] if torch.compiler.is_compiling() else _row_chunks(rows, width)


class _RMSNorm(torch.autograd.Function):
    """weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), x32 = x in float32, keeping only
    x and the inverse RMS for the backward pass. Autograd's graph of the same expression keeps
    a float32 copy of x and the normalised x too, 6 bytes a value: 1.3 GiB per norm at 32,768
    tokens of a Kimi-shaped drafter (H 7,168), four norms per TTT step
    (benchmarks/train_memory.py). The forward pass is those ops exactly, a chunk of rows at a
    time (CHUNK_ELEMENTS values: its float32 temporaries are a chunk's); the backward pass
    recomputes x32 and the normalised x, a chunk at a time too, and forms the gradient in
    closed form."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        size = x.shape[-1]
        rows_x = x.reshape(-1, size)
        # Under autocast, the output in autocast's dtype: the cast each projection reading it
        # would make, made once, so they keep one half-precision copy for the backward pass
        # instead of one each (q/k/v_proj three, gate/up_proj two: 2.6 GiB a TTT step at
        # 32,768 tokens of a Kimi-shaped drafter). The values are the same; the gradient comes
        # back in that dtype and is widened a chunk at a time, never as a whole float32 [T, H].
        out_dtype = (torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type)
                     else torch.promote_types(weight.dtype, x.dtype))
        out = torch.empty(rows_x.shape, dtype=out_dtype, device=x.device)
        inv_rms = torch.empty(rows_x.shape[0], 1, dtype=torch.float32, device=x.device)
        # Row by row the same ops: chunks of rows keep the float32 temporaries a chunk's.
        for part in _elementwise_chunks(rows_x.shape[0], size):
            x32 = rows_x[part].float()
            inv_rms[part] = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            out[part] = weight * (x32 * inv_rms[part]).to(x.dtype)
        ctx.save_for_backward(x, weight, inv_rms)
        return out.view(*x.shape[:-1], size)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, inv_rms = ctx.saved_tensors
        want_x, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        size = x.shape[-1]
        rows_x, rows_g = x.reshape(-1, size), grad_out.reshape(-1, size)
        grad_x = torch.empty_like(rows_x) if want_x else None
        grad_weight = torch.zeros(size, dtype=torch.float32, device=x.device) if want_weight else None
        for part in _elementwise_chunks(rows_x.shape[0], size):
            x32, r, g = rows_x[part].float(), inv_rms[part], rows_g[part].float()
            if want_weight:
                grad_weight += (g * (x32 * r).to(x.dtype)).sum(0)
            if want_x:
                # Through the cast to x's dtype, as autograd goes; then d(x32 * r)/dx32 with
                # r = (mean(x32^2) + eps)^-1/2: r g - r^3 x32 mean(g x32).
                g_normed = (g * weight).to(x.dtype).float()
                grad_x[part] = r * g_normed - x32 * r.pow(3) * (g_normed * x32).mean(-1, keepdim=True)
        return (None if grad_x is None else grad_x.view_as(x),
                None if grad_weight is None else grad_weight.to(weight.dtype), None)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as Llama does: bf16 squares lose the small components.
        return _RMSNorm.apply(x, self.weight, self.eps)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    angles = position_ids.float()[..., None] * inv_freq  # [B, T, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


ATTENTION_BACKENDS = ("dense", "flex")


def default_attention_backend(device: torch.device) -> str:
    """FlexAttention where it trains (CUDA); dense math elsewhere (its CPU kernel has no backward)."""
    return "flex" if torch.device(device).type == "cuda" else "dense"


class TTTCache:
    """Keys/values of earlier training-time-test steps and the step-0 mask.

    ``context_*`` are step 0's keys/values (the real context); ``draft_*`` hold one entry per
    later step, each attended to only by the query at the same position. ``backend`` picks how
    the context part is computed ("auto": :func:`default_attention_backend` of the keys' device).
    """

    def __init__(self, backend: str = "auto"):
        if backend not in ("auto", *ATTENTION_BACKENDS):
            raise ValueError(f"attention backend {backend!r}: expected auto or one of {ATTENTION_BACKENDS}")
        self.backend = backend
        self.context_k = self.context_v = self.context_mask = None
        self.draft_k: list[torch.Tensor] = []
        self.draft_v: list[torch.Tensor] = []

    @property
    def steps(self) -> int:
        return 0 if self.context_k is None else 1 + len(self.draft_k)

    def copy(self) -> "TTTCache":
        """A cache holding the same tensors in lists of its own: a step run on it leaves this
        one as it was (training recomputes a step on a copy of the cache the step first saw)."""
        twin = TTTCache(self.backend)
        twin.context_k, twin.context_v, twin.context_mask = self.context_k, self.context_v, self.context_mask
        twin.draft_k, twin.draft_v = list(self.draft_k), list(self.draft_v)
        return twin

    def adopt(self, other: "TTTCache") -> None:
        """Take ``other``'s state (a copy this cache made, one step further on)."""
        self.backend = other.backend
        self.context_k, self.context_v, self.context_mask = other.context_k, other.context_v, other.context_mask
        self.draft_k, self.draft_v = other.draft_k, other.draft_v

    def start(self, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor) -> None:
        """Keep step 0's keys/values and build the context mask once for every later step."""
        if self.backend == "auto":
            self.backend = default_attention_backend(k.device)
        self.context_k, self.context_v = k, v
        if self.backend == "flex":
            self.context_mask = segment_block_mask(segment_ids)
        else:
            self.context_mask = causal_segment_mask(segment_ids)

    def attend_context(self, q: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of ``q`` over the step-0 keys of its own segment: (out, log-sum-exp
        of the scaled scores, float32 [B, heads, T])."""
        if self.backend == "flex":
            return flex_context_attention(q, self.context_k, self.context_v, self.context_mask)
        return dense_context_attention(q, self.context_k, self.context_v, self.context_mask, group)


def causal_segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: query t sees key s <= t of the same segment (padding sees padding)."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & same)[:, None]


def segment_block_mask(segment_ids: torch.Tensor):
    """The mask of :func:`causal_segment_mask` as a FlexAttention block mask: only the
    [128 x 128] blocks that hold an allowed pair are visited, so memory is linear in T."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_segment_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (segment_ids[b, q_idx] == segment_ids[b, kv_idx])

    batch, length = segment_ids.shape
    return create_block_mask(same_segment_causal, batch, None, length, length, device=segment_ids.device,
                             _compile=segment_ids.is_cuda)


_compiled_flex = None


def flex_context_attention(q, k, v, block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention with the log-sum-exp; compiled on a GPU (eager flex is a reference
    implementation that materialises the scores and, on the CPU, has no backward)."""
    global _compiled_flex
    from torch.nn.attention import flex_attention as flex_module

    kernel = flex_module.flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_module.flex_attention, dynamic=False)
        kernel = _compiled_flex
    enable_gqa = q.shape[1] != k.shape[1]
    if hasattr(flex_module, "AuxRequest"):
        out, aux = kernel(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa,
                          return_aux=flex_module.AuxRequest(lse=True))
        return out, aux.lse
    return kernel(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, return_lse=True)


def dense_context_attention(q, k, v, mask, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as :func:`flex_context_attention` with an explicit [T, T] score matrix."""
    scores = torch.matmul(q, _repeat_kv(k, group).transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None]).to(q.dtype)
    return torch.matmul(weights, _repeat_kv(v, group)), lse


def merge_diagonal_keys_autograd(context_out, context_lse, q, draft_k, draft_v, group: int) -> torch.Tensor:
    """Softmax attention over [context keys ; one diagonal key per draft step], exactly, from
    the context part's output and log-sum-exp and the diagonal scores (dot products at each
    query's own position): no [T, j*T] matrix that would be almost all masked. Autograd's graph
    of these ops keeps float32 copies of q and the context output (1.75 GiB per TTT step at 32,768
    tokens of a Kimi-shaped drafter); :func:`merge_diagonal_keys` computes the same output and
    forms the gradient itself. This one is its reference in the tests.

    The query heads are grouped under their key/value head, so the diagonal keys and values are
    read as they are: repeated per query head in float32, each would be a [heads, T, head_dim]
    copy kept for the backward pass (j keys and j values at step j; for the Kimi-shaped drafter,
    most of the step's attention memory, benchmarks/train_memory.py)."""
    batch, heads, length, dim = q.shape
    scale = dim**-0.5
    q32 = q.float().view(batch, heads // group, group, length, dim)
    # Broadcast over the group: the products are temporaries, autograd keeps q32 and each small k.
    diagonal = torch.stack([(q32 * k.float().unsqueeze(2)).sum(-1) for k in draft_k], dim=-1)
    diagonal = diagonal.flatten(1, 2) * scale
    # Any common shift is exact; the max keeps exp() in range. No gradient flows through it.
    shift = torch.maximum(context_lse, diagonal.amax(-1)).detach()
    context_weight = torch.exp(context_lse - shift)
    diagonal_weight = torch.exp(diagonal - shift[..., None])
    total = context_weight + diagonal_weight.sum(-1)
    out = context_out.float() * (context_weight / total)[..., None]
    shares = (diagonal_weight / total[..., None]).view(batch, heads // group, group, length, len(draft_v))
    for i, v in enumerate(draft_v):
        out = out + (shares[..., i, None] * v.float().unsqueeze(2)).reshape(batch, heads, length, dim)
    return out.to(q.dtype)


def _by_position(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, heads, t, ...] with the query heads grouped under their key/value head -> float32
    [B, kv heads, t, group, ...]: each position's query group as the rows of a small matrix."""
    batch, heads, length = x.shape[:3]
    return x.float().view(batch, heads // group, group, length, *x.shape[3:]).transpose(2, 3)


def _by_head(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_by_position`'s layout: [B, kv heads, t, group, ...] -> [B, heads, t, ...]."""
    batch, kv_heads, length, group = x.shape[:4]
    return x.transpose(2, 3).reshape(batch, kv_heads * group, length, *x.shape[4:])


def _merge_shares(q32, lse32, k32, scale: float):
    """Softmax weights of [context ; diagonal keys] at each position and query head: (context
    share [B, KV, t, G], diagonal shares [B, KV, t, G, j]). The diagonal scores are one small
    product per position, [G, d] x [d, j]."""
    return _softmax_shares(lse32, torch.matmul(q32, k32.transpose(-1, -2)) * scale)


def _softmax_shares(context_lse, diagonal):
    """(context share, diagonal shares) of a softmax over [context ; diagonal keys], from the
    context part's log-sum-exp [...] and the diagonal scores [..., j]."""
    # Any common shift is exact; the max keeps exp() in range.
    shift = torch.maximum(context_lse, diagonal.amax(-1))
    context_weight = torch.exp(context_lse - shift)
    diagonal_weight = torch.exp(diagonal - shift.unsqueeze(-1))
    total = context_weight + diagonal_weight.sum(-1)
    return context_weight / total, diagonal_weight / total.unsqueeze(-1)


def _merge_chunk(part: slice, context_lse, q, draft_k, draft_v, group: int):
    """What both passes of the merge read of one chunk of positions: (q32 [B, KV, t, G, d], the
    stacked keys and values k32, v32 [B, KV, t, j, d], the context share, the diagonal shares),
    in float32."""
    q32 = _by_position(q[:, :, part], group)
    k32 = torch.stack([k[:, :, part] for k in draft_k], dim=-2).float()
    v32 = torch.stack([v[:, :, part] for v in draft_v], dim=-2).float()
    context_share, shares = _merge_shares(q32, _by_position(context_lse[:, :, part], group), k32, q.shape[-1] ** -0.5)
    return q32, k32, v32, context_share, shares


class _MergeDiagonalKeys(torch.autograd.Function):
    """merge_diagonal_keys_autograd's output, for all heads at once and a chunk of positions at
    a time (CHUNK_ELEMENTS values of [B, heads, t, head_dim]: the float32 temporaries are a
    chunk's); the backward pass recomputes the shares from the inputs it keeps (which the
    context attention and the cache keep anyway) and forms the gradient in closed form.

    With a = softmax over [context lse ; diagonal scores] and values [context out ; v_i], the
    output is sum a_x value_x; a logit's gradient is a_x (g . value_x - g . out), where
    g . out = a_context (g . context out) + sum_i a_i (g . v_i). The per-position sums over the
    j diagonal keys and the query group are small matrix products ([G, d] x [d, j] and the
    like), so a chunk costs a few dozen operators whatever the number of heads, each large
    enough to fill a GPU. Run a key/value head at a time, the backward pass of the last TTT
    step's merge alone took about 1,900 operators for a Kimi-shaped drafter, each over a few MB
    (docs/performance.md)."""

    @staticmethod
    def forward(ctx, context_out, context_lse, q, group, *draft):
        steps = len(draft) // 2
        ctx.group = group
        ctx.save_for_backward(context_out, context_lse, q, *draft)
        batch, heads, length, dim = q.shape
        out = torch.empty_like(q)
        # float32 inside, under autocast too: the small products are not to run in half precision.
        with torch.autocast(q.device.type, enabled=False):
            for part in _row_chunks(length, batch * heads * dim):
                _, _, v32, context_share, shares = _merge_chunk(part, context_lse, q, draft[:steps], draft[steps:], group)
                merged = _by_position(context_out[:, :, part], group) * context_share.unsqueeze(-1)
                out[:, :, part] = _by_head(merged + torch.matmul(shares, v32))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        context_out, context_lse, q, *draft = ctx.saved_tensors
        steps, group = len(draft) // 2, ctx.group
        draft_k, draft_v = draft[:steps], draft[steps:]
        batch, heads, length, dim = q.shape
        scale = dim**-0.5
        grad_context = torch.empty_like(context_out)
        grad_lse = torch.empty_like(context_lse)
        grad_q = torch.empty_like(q)
        grad_k = [torch.empty_like(k) for k in draft_k]
        grad_v = [torch.empty_like(v) for v in draft_v]
        with torch.autocast(q.device.type, enabled=False):
            for part in _row_chunks(length, batch * heads * dim):
                q32, k32, v32, context_share, shares = _merge_chunk(part, context_lse, q, draft_k, draft_v, group)
                context32 = _by_position(context_out[:, :, part], group)
                g = _by_position(grad_out[:, :, part], group)
                g_context = (g * context32).sum(-1)  # [B, KV, t, G]
                g_values = torch.matmul(g, v32.transpose(-1, -2))  # [B, KV, t, G, j]
                g_out = context_share * g_context + (shares * g_values).sum(-1)
                grad_context[:, :, part] = _by_head(g * context_share.unsqueeze(-1))
                grad_lse[:, :, part] = _by_head(context_share * (g_context - g_out))
                grad_score = shares * (g_values - g_out.unsqueeze(-1)) * scale
                grad_q[:, :, part] = _by_head(torch.matmul(grad_score, k32))
                grad_keys = torch.matmul(grad_score.transpose(-1, -2), q32)  # [B, KV, t, j, d]: summed over the group
                grad_values = torch.matmul(shares.transpose(-1, -2), g)
                for i in range(steps):
                    grad_k[i][:, :, part] = grad_keys[..., i, :]
                    grad_v[i][:, :, part] = grad_values[..., i, :]
        return (grad_context, grad_lse, grad_q, None, *grad_k, *grad_v)


def _position_major(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, heads, t, ...] -> float32 [B, t, kv heads, group, ...] (a view where the projections
    made x, whose memory is position-major)."""
    return x.transpose(1, 2).float().unflatten(2, (-1, group))


def _head_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_position_major`: [B, t, kv heads, group, ...] -> [B, heads, t, ...] in ``dtype``."""
    return x.flatten(2, 3).to(dtype).transpose(1, 2)


def _fused_inputs(context_lse, q, draft, group: int):
    """What both passes of the fused merge read, in float32: (queries [B, t, KV, G, d], the keys
    and the values, j each, [B, t, KV, d], context share [B, t, KV, G], diagonal shares
    [B, t, KV, G, j]). The diagonal scores are elementwise products summed over the head
    dimension, one key at a time (:func:`_merge_shares` takes them as small matrix products)."""
    steps = len(draft) // 2
    queries = _position_major(q, group)
    keys = [k.transpose(1, 2).float() for k in draft[:steps]]
    values = [v.transpose(1, 2).float() for v in draft[steps:]]
    diagonal = torch.stack([(queries * key.unsqueeze(3)).sum(-1) for key in keys], dim=-1) * q.shape[-1] ** -0.5
    return (queries, keys, values, *_softmax_shares(_position_major(context_lse, group), diagonal))


class _FusedMergeDiagonalKeys(torch.autograd.Function):
    """_MergeDiagonalKeys' output and gradient, written for torch.compile: whole tensors,
    elementwise ops and sums only (no matrix products, which the compiler leaves as separate
    kernels reading float32 copies), so inductor fuses each pass into a few kernels that read
    the bf16 inputs once and keep no float32 temporaries. On a GPU it runs compiled
    (:func:`merge_diagonal_keys`): eagerly, each op would be a kernel of its own. The same
    inputs are kept for the backward pass."""

    @staticmethod
    def forward(ctx, context_out, context_lse, q, group, *draft):
        ctx.group = group
        ctx.save_for_backward(context_out, context_lse, q, *draft)
        # float32 inside, under autocast too (as _MergeDiagonalKeys).
        with torch.autocast(q.device.type, enabled=False):
            _, _, values, context_share, shares = _fused_inputs(context_lse, q, draft, group)
            out = _position_major(context_out, group) * context_share.unsqueeze(-1)
            for i, value in enumerate(values):
                out = out + shares[..., i, None] * value.unsqueeze(3)
            return _head_major(out, q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        context_out, context_lse, q, *draft = ctx.saved_tensors
        steps, group = len(draft) // 2, ctx.group
        scale = q.shape[-1] ** -0.5
        with torch.autocast(q.device.type, enabled=False):
            queries, keys, values, context_share, shares = _fused_inputs(context_lse, q, draft, group)
            g = _position_major(grad_out, group)
            g_context = (g * _position_major(context_out, group)).sum(-1)  # [B, t, KV, G]
            g_values = torch.stack([(g * value.unsqueeze(3)).sum(-1) for value in values], dim=-1)  # [B, t, KV, G, j]
            g_out = context_share * g_context + (shares * g_values).sum(-1)
            grad_score = shares * (g_values - g_out.unsqueeze(-1)) * scale
            grad_q = sum(grad_score[..., i, None] * key.unsqueeze(3) for i, key in enumerate(keys))
            # Each key and value serves the G query heads of its group: their sums.
            grad_k = [_head_major((grad_score[..., i, None] * queries).sum(3, keepdim=True), k.dtype)
                      for i, k in enumerate(draft[:steps])]
            grad_v = [_head_major((shares[..., i, None] * g).sum(3, keepdim=True), v.dtype)
                      for i, v in enumerate(draft[steps:])]
            return (_head_major(g * context_share.unsqueeze(-1), context_out.dtype),
                    _head_major(context_share * (g_context - g_out), context_lse.dtype),
                    _head_major(grad_q, q.dtype), None, *grad_k, *grad_v)


def _fused_merge(context_out, context_lse, q, draft_k, draft_v, group: int) -> torch.Tensor:
    return _FusedMergeDiagonalKeys.apply(context_out, context_lse, q, group, *draft_k, *draft_v)


def allow_compiled_graphs(count: int) -> None:
    """Let torch.compile keep at least ``count`` graphs of one function (dynamo's default is 8;
    past its limit a function runs eagerly). The drafter's compiled code has a graph per TTT
    step or number of diagonal keys, per dtype and per gradient need."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, count)


_compiled_merge = None


def _merge_kernel(q: torch.Tensor):
    """How the merge runs when it needs its gradient: the fused merge as is while torch.compile
    traces the layer (train.compile), compiled on its own on a GPU (one graph per number of
    diagonal keys, forward and backward), and as :class:`_MergeDiagonalKeys` elsewhere (None),
    whose chunked matrix products suit an eager CPU."""
    global _compiled_merge
    if torch.compiler.is_compiling():
        return _fused_merge
    if q.is_cuda:
        if _compiled_merge is None:
            # A graph per number of diagonal keys (1 to ttt_length - 1), per dtype and per
            # gradient need: more than dynamo's default of 8 graphs a function, past which it
            # would run the merge eagerly, an op a kernel.
            allow_compiled_graphs(64)
            _compiled_merge = torch.compile(_fused_merge, dynamic=False)
        return _compiled_merge
    return None


def merge_diagonal_keys(context_out, context_lse, q, draft_k, draft_v, group: int) -> torch.Tensor:
    """Softmax attention over [context keys ; one diagonal key per draft step], exactly
    (:func:`merge_diagonal_keys_autograd`), keeping for the backward pass only what the context
    attention and the cache keep already."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (context_out, context_lse, q, *draft_k, *draft_v)):
        kernel = _merge_kernel(q)
        if kernel is not None:
            return kernel(context_out, context_lse, q, list(draft_k), list(draft_v), group)
        return _MergeDiagonalKeys.apply(context_out, context_lse, q, group, *draft_k, *draft_v)
    return merge_diagonal_keys_autograd(context_out, context_lse, q, draft_k, draft_v, group)


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
            out = F.scaled_dot_product_attention(q, _repeat_kv(k, group), _repeat_kv(v, group), attn_mask=mask)
        elif cache.steps == 0:
            cache.start(k, v, segment_ids)
            out, _ = cache.attend_context(q, group)
        else:
            cache.draft_k.append(k)
            cache.draft_v.append(v)
            context_out, context_lse = cache.attend_context(q, group)
            out = merge_diagonal_keys(context_out, context_lse, q, cache.draft_k, cache.draft_v, group)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``group`` query heads."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        # gate and up are this call's own: nothing else reads them (their gradients may take their place).
        return self.down_proj(_SwiGLU.apply(self.gate_proj(x), self.up_proj(x), True))


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up only: autograd would keep silu(gate) too, a
    [T, intermediate] tensor (1.1 GiB a TTT step at 32,768 tokens of a Kimi-shaped drafter).
    The backward pass recomputes silu(gate) and runs the ops autograd runs (the product's
    gradients, aten.silu_backward), a chunk of rows at a time: the same gradients (bit for bit
    in bf16; in float32 a chunk's vectorised tail may round a last bit otherwise)."""

    @staticmethod
    def forward(ctx, gate, up, private: bool = False):
        ctx.private = private
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        width = gate.shape[-1]
        rows_gate, rows_up, rows_grad = gate.reshape(-1, width), up.reshape(-1, width), grad_out.reshape(-1, width)
        # ``private`` (the caller's word that nothing else reads gate and up): eagerly, each
        # gradient takes the place of the input it belongs to, chunk by chunk, since this backward
        # is their last read (2 x 1.1 GiB fewer at the MLP's backward, the peak of a recomputed
        # Kimi-shaped step). A second backward through the same graph is refused by autograd's
        # version check. Compiled, or not private: fresh tensors.
        in_place = ctx.private and not torch.compiler.is_compiling() and gate.is_contiguous() and up.is_contiguous()
        grad_gate = (rows_gate if in_place else torch.empty_like(rows_gate)) if ctx.needs_input_grad[0] else None
        grad_up = (rows_up if in_place else torch.empty_like(rows_up)) if ctx.needs_input_grad[1] else None
        # Elementwise, so chunks of rows give the same values; the temporaries are a chunk's.
        # In this order, each chunk's gate and up are read before their gradients replace them.
        for part in _elementwise_chunks(rows_gate.shape[0], width):
            through_up = rows_grad[part] * rows_up[part] if grad_gate is not None else None
            if grad_up is not None:
                grad_up[part] = rows_grad[part] * F.silu(rows_gate[part])
            if grad_gate is not None:
                grad_gate[part] = torch.ops.aten.silu_backward(through_up, rows_gate[part])
        return (None if grad_gate is None else grad_gate.view_as(gate),
                None if grad_up is None else grad_up.view_as(up), None)


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


# ---- the target's embedding and lm_head, read without building the target ---------------------


def _weight_files(target_path: Path) -> dict[str, Path]:
    """tensor name -> file, for a single model.safetensors or a sharded index."""
    index = target_path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_path / file for name, file in weight_map.items()}
    single = target_path / WEIGHTS_NAME
    if not single.exists():
        raise FileNotFoundError(f"{target_path}: neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as handle:
        return {name: single for name in handle.keys()}


def _find(files: dict[str, Path], suffix: str) -> str | None:
    # Wrappers prefix names (model., language_model.model., ...): take the shortest match.
    matches = sorted((n for n in files if n == suffix or n.endswith("." + suffix)), key=len)
    return matches[0] if matches else None


def target_embedding_dtype(target_path: str | os.PathLike) -> torch.dtype | None:
    """The dtype the target's token embedding is stored in (read from the file header), or None."""
    files = _weight_files(Path(target_path))
    name = _find(files, "embed_tokens.weight")
    if name is None:
        return None
    with safe_open(files[name], framework="pt") as handle:
        stored = handle.get_slice(name).get_dtype()
    return next((dtype for dtype, label in SAFETENSORS_DTYPE_NAMES.items() if label == stored), None)


def load_target_rows(target_path: str | os.PathLike, which: str, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The target's token embedding (``which="embed"``), output head (``"lm_head"``) or final
    norm weight (``"norm"``) as fp32.

    A tied target has no lm_head tensor; its embedding is the head. ``rows`` (bool mask or
    ascending indices) selects rows.
    """
    target_path = Path(target_path)
    files = _weight_files(target_path)
    embed = _find(files, "embed_tokens.weight")
    if which == "norm":
        name = _find(files, "norm.weight")
    else:
        name = embed if which == "embed" else (_find(files, "lm_head.weight") or embed)
    if name is None:
        raise KeyError(f"{target_path}: no {which} weight (looked for *lm_head.weight, *embed_tokens.weight)")
    with safe_open(files[name], framework="pt") as handle:
        if rows is None:
            return handle.get_tensor(name).float()
        index = rows.nonzero().squeeze(-1) if rows.dtype == torch.bool else rows.to(torch.int64)
        sliced = handle.get_slice(name)
        # Read runs of consecutive rows: a 163,840-row head is never loaded whole for a 32K subset.
        breaks = (torch.nonzero(index[1:] != index[:-1] + 1).squeeze(-1) + 1).tolist()
        starts = [0] + breaks
        ends = breaks + [index.numel()]
        runs = [sliced[int(index[a]) : int(index[b - 1]) + 1] for a, b in zip(starts, ends)]
        return torch.cat(runs).float()


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


def flops_per_token_step(config: DrafterConfig, context: int = 0) -> dict[str, float]:
    """Forward matmul FLOPs of one drafting step per token (fc counted separately, once)."""
    h, hd = config.hidden_size, config.head_dim
    q = config.num_attention_heads * hd
    kv = config.num_key_value_heads * hd
    return {
        "fc": 2 * 3 * config.target_hidden_size * h,
        "attention_proj": 2 * (2 * h) * (q + 2 * kv) + 2 * q * h,
        "attention_scores": 4 * q * context,
        "mlp": 2 * 3 * h * config.intermediate_size,
        "lm_head": 2 * h * config.draft_vocab_size,
    }


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
