"""Export a trained drafter for the two serving engines, and read the exports back.

Two formats, one set of weights:

* SGLang (``LlamaForCausalLMEagle3``): a Llama ``config.json`` with ``draft_vocab_size``,
  ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``, and a
  ``model.safetensors`` with the drafter's own names (``fc.weight``, ``midlayer.*``,
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``), which SGLang's ``load_weights``
  maps onto its fused ``qkv_proj``/``gate_up_proj`` (``midlayer`` is its legacy name for
  ``layers.0``).
* vLLM, through the speculators format: ``speculators_model_type: eagle3``, a
  ``transformer_layer_config`` (a Llama config of one layer), ``speculators_config`` with
  the verifier's name and architectures, and tensors named ``layers.0.*``.

Layer ids. eaglenest keeps aux layer ids in HF convention (id i is the input of decoder
layer i, ``hidden_states[i]``). vLLM reads ``eagle_aux_hidden_state_layer_ids`` in that
convention. SGLang hands the ids to the target's ``set_eagle3_layers_to_capture``, which
rewrites them per model class; ``eaglenest.target_model.layer_ids.hf_to_sglang`` does the inverse, so
the SGLang config carries the ids SGLang needs to capture exactly our layers. Both
exports also record the HF ids under ``eaglenest`` so the convention is never guessed.

Token embedding. The drafter's embedding is a frozen copy of the target's, and both
engines give the drafter the target's embedding when the checkpoint has none (SGLang
always overwrites it with the target's; vLLM shares the target's when the checkpoint
holds no ``embed_tokens``). So exports leave it out by default (Kimi-K2.5: 2.3 GB of
bf16 saved); ``include_embed_tokens`` keeps it for consumers that want a self-contained
checkpoint.

Residual convention. Our first layer keeps the *un-normed* fused hidden state as the
residual (SGLang's only behaviour). vLLM's speculators reader defaults
``norm_before_residual`` to true when the key is missing, so the vLLM export always writes
it, set to false.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglenest.formats import atomic
from eaglenest.target_model import layer_ids
from eaglenest.model.drafter import DrafterConfig, Eagle3Drafter
from eaglenest.target_model.weights import load_target_rows

log = logging.getLogger(__name__)

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
EXPORT_FORMAT_VERSION = 1

# Names of the drafter's tensors; the SGLang export uses them unchanged.
_MIDLAYER = "midlayer."
_VLLM_LAYER = "layers.0."
_EMBED = "embed_tokens.weight"
# Tensors every export must carry (embed_tokens is optional, see the module docstring).
REQUIRED_TENSORS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


def _check_state_dict(state_dict: dict[str, torch.Tensor]) -> None:
    missing = [name for name in REQUIRED_TENSORS if name not in state_dict]
    if missing:
        raise ValueError(f"drafter state_dict lacks {missing}; is this an eaglenest EAGLE-3 drafter?")
    unknown = sorted(set(state_dict) - set(REQUIRED_TENSORS) - {_EMBED})
    if unknown:
        raise ValueError(f"drafter state_dict has tensors no export format knows: {unknown}")


def _weights(state_dict: dict[str, torch.Tensor], dtype: torch.dtype, include_embed_tokens: bool):
    """Float tensors cast to the export dtype; d2t/t2d keep their integer/bool types."""
    out = {}
    for name, tensor in state_dict.items():
        if name == _EMBED and not include_embed_tokens:
            continue
        tensor = tensor.detach().to("cpu")
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous()
    return out


def _llama_layer_config(shape: dict, dtype: torch.dtype) -> dict:
    """The Llama config of the drafter's single decoder layer, as both engines read it."""
    return {
        "model_type": "llama",
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "head_dim": shape["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": shape["rms_norm_eps"],
        "max_position_embeddings": shape["max_position_embeddings"],
        # Both spellings: transformers 5 (and SGLang 0.5.23) read rope_parameters,
        # older readers rope_theta.
        "rope_theta": shape["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": shape["rope_theta"]},
        "vocab_size": shape["vocab_size"],
        "attention_bias": False,
        "mlp_bias": False,
        # SGLang uses the embedding as lm_head when this is true; ours is a separate
        # [draft_vocab, H] head.
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _provenance(shape: dict, target: dict) -> dict:
    return {
        "format_version": EXPORT_FORMAT_VERSION,
        "aux_layer_ids_hf": list(shape["aux_layer_ids"]),
        "layer_id_convention": "HF: id i is hidden_states[i], the input of decoder layer i",
        "target_name": target["name"],
        "target_architecture": target["architecture"],
    }


def sglang_config(shape: dict, target: dict, dtype: torch.dtype) -> dict:
    """config.json for SGLang's LlamaForCausalLMEagle3."""
    config = _llama_layer_config(shape, dtype)
    config.update(
        architectures=[SGLANG_ARCHITECTURE],
        draft_vocab_size=shape["draft_vocab_size"],
        target_hidden_size=shape["target_hidden_size"],
        eagle_config={
            "use_aux_hidden_state": True,
            # SGLang passes these to the *target's* set_eagle3_layers_to_capture, which
            # rewrites them per model class: translate so it captures our HF layers.
            "eagle_aux_hidden_state_layer_ids": layer_ids.hf_to_sglang(
                shape["aux_layer_ids"], target["architecture"]
            ),
        },
        eaglenest=_provenance(shape, target),
    )
    return config


def vllm_config(shape: dict, target: dict, dtype: torch.dtype, speculative_tokens: int) -> dict:
    """config.json in the speculators format that vLLM reads."""
    if shape["target_hidden_size"] != shape["hidden_size"]:
        # speculators sizes fc as num_aux * hidden_size and checks the verifier's hidden
        # size against the drafter's; vLLM itself would accept it, speculators would not.
        log.warning("target_hidden_size %s != hidden_size %s: speculators cannot load this export",
                    shape["target_hidden_size"], shape["hidden_size"])
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target["name_or_path"], "architectures": [target["architecture"]]},
        },
        "transformer_layer_config": _llama_layer_config(shape, dtype),
        "draft_vocab_size": shape["draft_vocab_size"],
        "target_hidden_size": shape["target_hidden_size"],
        # vLLM captures the input of each listed layer: HF convention, no translation.
        "eagle_aux_hidden_state_layer_ids": list(shape["aux_layer_ids"]),
        # Written explicitly: vLLM's reader defaults a missing key to true, which is not ours.
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eaglenest": _provenance(shape, target),
    }


def sglang_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(weights)


def vllm_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.replace(_MIDLAYER, _VLLM_LAYER, 1) if name.startswith(_MIDLAYER) else name: t
            for name, t in weights.items()}


def _write_export(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    # config.json last: a directory with a config.json is a finished export.
    atomic.write_text(out_dir / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_sglang_export(out_dir, state_dict, shape: dict, target: dict, *,
                        dtype: torch.dtype = torch.bfloat16, include_embed_tokens: bool = False) -> Path:
    _check_state_dict(state_dict)
    out_dir = Path(out_dir)
    weights = _weights(state_dict, dtype, include_embed_tokens)
    _write_export(out_dir, sglang_config(shape, target, dtype), sglang_tensors(weights))
    return out_dir


def write_vllm_export(out_dir, state_dict, shape: dict, target: dict, *,
                      dtype: torch.dtype = torch.bfloat16, include_embed_tokens: bool = False,
                      speculative_tokens: int = 3) -> Path:
    _check_state_dict(state_dict)
    out_dir = Path(out_dir)
    weights = _weights(state_dict, dtype, include_embed_tokens)
    _write_export(out_dir, vllm_config(shape, target, dtype, speculative_tokens), vllm_tensors(weights))
    return out_dir


# ---------------------------------------------------------------- reading exports back


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def read_export(export_dir, target_dir=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, state_dict in the drafter's own names) from either export format.

    The embedding comes from ``target_dir`` when the export left it out.
    """
    export_dir = Path(export_dir)
    config_path = export_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{export_dir} is not a finished export (no config.json)")
    config = json.loads(config_path.read_text())
    tensors = _read_safetensors(export_dir / "model.safetensors")
    if config.get("speculators_model_type") == "eagle3":
        tensors = {name.replace(_VLLM_LAYER, _MIDLAYER, 1) if name.startswith(_VLLM_LAYER) else name: t
                   for name, t in tensors.items()}
    elif config.get("architectures") != [SGLANG_ARCHITECTURE]:
        raise ValueError(f"{config_path} is neither a speculators eagle3 nor a {SGLANG_ARCHITECTURE} config")
    if _EMBED not in tensors:
        if target_dir is None:
            raise ValueError(f"{export_dir} holds no embed_tokens; pass the target directory to take it from")
        tensors[_EMBED] = load_target_rows(target_dir, "embed")
    _check_state_dict(tensors)
    return config, tensors


def drafter_config_from_export(config: dict) -> DrafterConfig:
    """The DrafterConfig an export describes (either format)."""
    layer = config.get("transformer_layer_config", config)
    provenance = config.get("eaglenest")
    if provenance is None:
        raise ValueError("export config has no 'eaglenest' block: not written by eaglenest, layer ids unknown")
    return DrafterConfig(
        hidden_size=layer["hidden_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer["head_dim"],
        intermediate_size=layer["intermediate_size"],
        vocab_size=layer["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config["target_hidden_size"],
        aux_layer_ids=list(provenance["aux_layer_ids_hf"]),
        rms_norm_eps=layer["rms_norm_eps"],
        rope_theta=layer["rope_parameters"]["rope_theta"],
        max_position_embeddings=layer["max_position_embeddings"],
        target_name=provenance["target_name"],
    )


def drafter_from_export(export_dir, target_dir=None) -> Eagle3Drafter:
    """Load an SGLang or vLLM export back into an fp32 Eagle3Drafter."""
    config, tensors = read_export(export_dir, target_dir)
    model = Eagle3Drafter(drafter_config_from_export(config))
    model.load_state_dict({name: t.to(model.state_dict()[name].dtype) for name, t in tensors.items()}, strict=True)
    return model


def load_any_drafter(drafter_dir, target_dir=None) -> Eagle3Drafter:
    """A drafter as eaglenest writes one: the train stage's output directory (model.save), a
    training checkpoint file, or an SGLang/vLLM export, told apart by the export's ``eaglenest``
    provenance block. In float32."""
    if Path(drafter_dir).is_file():
        return Eagle3Drafter.from_checkpoint(drafter_dir)
    config_path = Path(drafter_dir) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{drafter_dir} is not a drafter directory (no config.json)")
    if "eaglenest" in json.loads(config_path.read_text()):
        return drafter_from_export(drafter_dir, target_dir)
    return Eagle3Drafter.from_checkpoint(drafter_dir)


def add_embed_tokens(export_dir, target_dir, out_dir=None) -> Path:
    """An export (either format) with the target's embedding written into it, in the export's
    dtype, for consumers that do not take the target's (EAGLE's reference code, docs/export.md):
    ``config.json`` and every other tensor exactly as they were. Into ``out_dir``, or in place
    (the safetensors file replaced atomically)."""
    export_dir = Path(export_dir)
    out_dir = Path(out_dir) if out_dir is not None else export_dir
    config_text = (export_dir / "config.json").read_text()
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        if _EMBED in f.keys():
            raise ValueError(f"{export_dir} already holds {_EMBED}")
    config, state_dict = read_export(export_dir, target_dir)  # checks the export, takes the target's
    layer = config.get("transformer_layer_config", config)
    embed = state_dict[_EMBED]
    if tuple(embed.shape) != (layer["vocab_size"], layer["hidden_size"]):
        raise ValueError(f"{target_dir}'s embedding is {tuple(embed.shape)}, the export's config wants "
                         f"({layer['vocab_size']}, {layer['hidden_size']}): another target?")
    state_dict[_EMBED] = embed.to(state_dict["fc.weight"].dtype).contiguous()
    # Back to the export's own tensor names (read_export gave the drafter's).
    named = vllm_tensors if config.get("speculators_model_type") == "eagle3" else sglang_tensors
    expected = named(state_dict)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(expected, str(tmp), metadata={"format": "pt"})
    if out_dir != export_dir:  # config.json last: a directory with one is a finished export
        atomic.write_text(out_dir / "config.json", config_text)
    _check_written(out_dir, expected)
    log.info("%s: %s %s from %s written", out_dir, _EMBED, tuple(embed.shape), target_dir)
    return out_dir


def target_identity(target_dir, target_name: str, verifier_name_or_path: str | None = None) -> dict:
    """Name, architecture and the verifier path a vLLM export names, from the target's config.json."""
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    architectures = target_config.get("architectures") or []
    if not architectures:
        raise ValueError(f"{target_dir}/config.json names no architectures; cannot pick SGLang's layer-id convention")
    return {
        "name": target_name,
        "architecture": architectures[0],
        "name_or_path": verifier_name_or_path or str(target_dir),
    }


def _check_written(export_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    """Read the export back and compare every tensor bit for bit with what was meant."""
    written = _read_safetensors(export_dir / "model.safetensors")
    if set(written) != set(expected):
        raise RuntimeError(f"{export_dir}: tensors {sorted(set(written) ^ set(expected))} differ in name")
    for name, tensor in expected.items():
        if written[name].dtype != tensor.dtype or not torch.equal(written[name], tensor):
            raise RuntimeError(f"{export_dir}: tensor {name} does not read back as written")


# "auto" writes the embedding when it is at most this large in the export's dtype: such an
# export loads in every consumer as it is (SmolLM2: 57 MB in bf16). A larger one (Kimi-K2.5:
# 163,840 x 7,168, 2.35 GB in bf16) is left to the engines, which take the target's.
AUTO_EMBED_LIMIT_BYTES = 256 << 20


def resolve_include_embed_tokens(setting, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> bool:
    if setting == "auto":
        return vocab_size * hidden_size * torch.finfo(dtype).bits // 8 <= AUTO_EMBED_LIMIT_BYTES
    if not isinstance(setting, bool):
        raise ValueError(f"include_embed_tokens must be true, false or auto, got {setting!r}")
    return setting


def consumers(include_embed_tokens: bool) -> dict[str, str]:
    """Which consumer loads the export as it is, and what each needs (docs/export.md)."""
    eagle = ("loads as it is (every tensor by name, the embedding included)" if include_embed_tokens else
             "needs include_embed_tokens: true: EAGLE's loader copies the target's embedding only for a config "
             "without target_hidden_size and loads the rest with strict=False, so a missing embedding stays random")
    return {
        "sglang": "loads as it is" + ("" if include_embed_tokens else "; takes the target's embedding (none in the export)"),
        "vllm": "loads as it is" + ("" if include_embed_tokens else "; shares the target's embedding (none in the export)"),
        "eagle_reference": eagle,
    }


def export_drafter(
    drafter_dir,
    target_dir,
    target_name: str,
    sglang_dir,
    vllm_dir,
    report_path,
    *,
    dtype: str = "bfloat16",
    include_embed_tokens: bool | str = "auto",
    verifier_name_or_path: str | None = None,
    speculative_tokens: int = 3,
) -> dict:
    """Both exports of a trained drafter directory, each read back and checked, and a report.

    ``include_embed_tokens``: true, false, or "auto" (:data:`AUTO_EMBED_LIMIT_BYTES`)."""
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"export dtype must be bfloat16, float16 or float32, got {dtype!r}")
    drafter = Eagle3Drafter.from_checkpoint(drafter_dir)
    shape = drafter.config.to_dict()
    include_embed_tokens = resolve_include_embed_tokens(include_embed_tokens, shape["vocab_size"],
                                                        shape["hidden_size"], torch_dtype)
    target = target_identity(target_dir, target_name, verifier_name_or_path)
    state_dict = drafter.state_dict()
    weights = _weights(state_dict, torch_dtype, include_embed_tokens)

    sglang_dir = write_sglang_export(sglang_dir, state_dict, shape, target, dtype=torch_dtype,
                                     include_embed_tokens=include_embed_tokens)
    _check_written(sglang_dir, sglang_tensors(weights))
    vllm_dir = write_vllm_export(vllm_dir, state_dict, shape, target, dtype=torch_dtype,
                                 include_embed_tokens=include_embed_tokens, speculative_tokens=speculative_tokens)
    _check_written(vllm_dir, vllm_tensors(weights))

    sglang_ids = json.loads((sglang_dir / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    report = {
        "target": target,
        "dtype": dtype,
        "include_embed_tokens": include_embed_tokens,
        "consumers": consumers(include_embed_tokens),
        "aux_layer_ids_hf": list(shape["aux_layer_ids"]),
        "sglang": {
            "dir": str(sglang_dir),
            "eagle_aux_hidden_state_layer_ids": sglang_ids,
            "captures_hf_layers": layer_ids.sglang_captured_layers(sglang_ids, target["architecture"]),
            "bytes": (sglang_dir / "model.safetensors").stat().st_size,
        },
        "vllm": {
            "dir": str(vllm_dir),
            "eagle_aux_hidden_state_layer_ids": list(shape["aux_layer_ids"]),
            "bytes": (vllm_dir / "model.safetensors").stat().st_size,
        },
        "parameters": sum(t.numel() for t in weights.values() if t.is_floating_point()),
    }
    atomic.write_json(report_path, report)
    log.info("exported %s: SGLang %s (ids %s), vLLM %s", drafter_dir, sglang_dir, sglang_ids, vllm_dir)
    return report
