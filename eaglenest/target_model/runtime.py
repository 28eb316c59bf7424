"""The target-model runtime: load a target, capture its aux hidden states, batch samples.

Used by extraction (eaglenest.stages.extract), regeneration, speculative decoding and the
evaluation. Forward pre-hooks on the aux decoder layers capture their inputs (HF
convention: ``hidden_states[i]`` of ``output_hidden_states=True`` is the input of decoder
layer i, index 0 = embeddings), and the base model's output is the final post-norm hidden
state; the lm_head is never run and no other layer is kept.

Two ways to lay samples out in a forward:

``packed`` (the default wherever the model supports it)
    Consecutive samples of the shard concatenated into one row of at most
    ``tokens_per_batch`` tokens, positions restarting at 0 per sample, and an attention
    that never crosses a sample boundary (:func:`packed_attention`: varlen flash attention
    on CUDA, one causal attention per sample elsewhere). No padding is computed, and each
    row's output is a contiguous token range of the shard, so it streams straight into
    the shard file.
``padded``
    Samples sorted by length and right-padded into batches of at most
    ``tokens_per_batch`` padded tokens. Right padding needs no attention mask: with
    causal attention a real token never attends to the pads after it.

:func:`hidden_state_rows` yields a shard's states a piece at a time (what extraction
streams); :func:`capture_hidden_states` keeps the whole shard in memory (the stand-in
server and the tests).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Iterator

import torch

log = logging.getLogger(__name__)


def decoder_layers(model) -> torch.nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return base.layers


class AuxCapture:
    """Pre-hooks that keep the inputs of the chosen decoder layers for one forward."""

    def __init__(self, model, layer_ids: list[int]):
        self.layer_ids = layer_ids
        self.captured: dict[int, torch.Tensor] = {}
        layers = decoder_layers(model)
        self.handles = [layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True) for i in layer_ids]

    def _hook(self, layer_id: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.captured[layer_id] = hidden.detach()

        return hook

    def take(self) -> torch.Tensor:
        """The captured inputs concatenated in layer_ids order: [batch, seq, A*H]."""
        out = torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)
        self.captured.clear()
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def length_batches(lengths: list[int], tokens_per_batch: int, max_rows: int | None = None, extra_per_row: int = 0) -> list[list[int]]:
    """Sample indices grouped by length (longest first), padded size <= tokens_per_batch.

    ``extra_per_row``: tokens each row grows by (generation's new tokens); ``max_rows`` caps
    the rows of a batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        rows = len(current) + 1
        if current and ((longest + extra_per_row) * rows > tokens_per_batch or (max_rows is not None and rows > max_rows)):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def load_target_config(target_path: str | os.PathLike):
    """The target's text-model config (config.json only, no weights)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(target_path)).get_text_config()


def load_target(target_path: str | os.PathLike, device: str, compute_dtype: str):
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=dtype)
    return model.to(device).eval()


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


PACKED_ATTENTION = "eaglenest_packed"
LAYOUTS = ("auto", "packed", "padded")


@dataclass
class PackedSegments:
    """Where the samples of one packed row start and end (passed to the attention)."""

    bounds: list[tuple[int, int]]
    max_len: int
    cu_seqlens: torch.Tensor | None = None  # int32 on the device, for the varlen kernel


_VARLEN_FAILED: list[str] = []


@functools.lru_cache(maxsize=1)
def _varlen_kernel():
    """torch's varlen flash attention and how to ask it for causal attention, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    # torch 2.10 takes is_causal; later versions a window, (-1, 0) meaning causal.
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention within each sample of a packed row (transformers attention interface).

    query [1, heads, T, D], key/value [1, kv_heads, T, D] -> ([1, T, heads, D], None).
    """
    segments: PackedSegments = kwargs["packed_segments"]
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("packed extraction does not handle sliding-window layers; use layout padded")
    heads, kv_heads = query.shape[1], key.shape[1]
    kernel = _varlen_kernel() if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) else None
    if kernel is not None and segments.cu_seqlens is not None and not _VARLEN_FAILED:
        varlen_attn, causal, native_gqa = kernel
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        gqa = {}
        if heads != kv_heads:
            if native_gqa:
                gqa = {"enable_gqa": True}
            else:
                k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        cu = segments.cu_seqlens
        try:
            out = varlen_attn(q, k, v, cu, cu, segments.max_len, segments.max_len, scale=scaling, **causal, **gqa)
            return out.unsqueeze(0), None
        except (RuntimeError, TypeError, NotImplementedError) as error:
            # Same result, slower: one attention call per sample. Said once, in the job log.
            log.warning("varlen flash attention unavailable (%s); attending one sample at a time", error)
            _VARLEN_FAILED.append(str(error))
    # Elsewhere (CPU, fp32): the same attention one sample at a time, with the kernel the
    # padded layout uses, so a sample's result does not depend on its neighbours.
    sdpa = torch.nn.functional.scaled_dot_product_attention
    parts = [
        sdpa(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=heads != kv_heads)
        for a, b in segments.bounds
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _register_packed_attention() -> None:
    # No mask function is registered on purpose: transformers then builds no mask at all
    # (and skips scanning position ids for packed sequences, a device sync per forward).
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def supports_packing(model) -> bool:
    """Packed rows need the transformers attention interface and full (non-windowed) attention."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or []
    return (
        bool(getattr(model, "_supports_attention_backend", False))
        and not any("sliding" in str(kind) for kind in layer_types)
        and getattr(config, "attn_logit_softcapping", None) is None
    )


def resolve_layout(model, layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "auto":
        return "packed" if supports_packing(model) else "padded"
    if layout == "packed" and not supports_packing(model):
        raise ValueError(f"{type(model).__name__} cannot run packed rows; use layout padded")
    return layout


def packed_batches(lengths: list[int], tokens_per_batch: int) -> list[range]:
    """Consecutive samples, at most tokens_per_batch tokens a row (a longer sample alone)."""
    batches, first, tokens = [], 0, 0
    for index, length in enumerate(lengths):
        if index > first and tokens + length > tokens_per_batch:
            batches.append(range(first, index))
            first, tokens = index, 0
        tokens += length
    if first < len(lengths):
        batches.append(range(first, len(lengths)))
    return batches


@contextlib.contextmanager
def attention_implementation(model, name: str):
    previous = model.config._attn_implementation
    if name == PACKED_ATTENTION:
        _register_packed_attention()
    if name != previous:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if name != previous:
            model.set_attn_implementation(previous)


def base_model(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def packed_inputs(lengths: list[int], first_token: int, input_ids: torch.Tensor, device) -> tuple:
    """One packed row: (ids [1, n], position ids [1, n], segments), moved to ``device``."""
    ends = list(itertools.accumulate(lengths))
    starts = [0] + ends[:-1]
    ids = input_ids[first_token : first_token + ends[-1]].to(torch.long)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = torch.tensor([0] + ends, dtype=torch.int32)
    non_blocking = device.type == "cuda"
    if non_blocking:
        ids, positions, cu_seqlens = ids.pin_memory(), positions.pin_memory(), cu_seqlens.pin_memory()
    segments = PackedSegments(list(zip(starts, ends)), max(lengths), cu_seqlens.to(device, non_blocking=non_blocking))
    return ids.to(device, non_blocking=non_blocking)[None], positions.to(device, non_blocking=non_blocking)[None], segments


def _forward_packed(base, capture: AuxCapture, ids, positions, segments) -> tuple[torch.Tensor, torch.Tensor]:
    last = base(input_ids=ids, position_ids=positions, use_cache=False, packed_segments=segments).last_hidden_state
    return capture.take()[0], last[0]


@torch.inference_mode()
def hidden_state_rows(
    model, input_ids, token_counts, offsets, layer_ids, tokens_per_batch, layout="padded"
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The target's states over concatenated samples, a piece at a time: (first token, aux [n, A*H], last [n, H]).

    packed: one piece per packed row, in token order, on the model's device (the fast path
    converts them there). padded: one piece per sample, in batch order, in the compute
    dtype on the host (each batch comes back in one copy).
    """
    device = next(model.parameters()).device
    layout = resolve_layout(model, layout)
    capture = AuxCapture(model, layer_ids)
    base = base_model(model)
    try:
        if layout == "packed":
            with attention_implementation(model, PACKED_ATTENTION):
                for batch in packed_batches(token_counts, tokens_per_batch):
                    start = int(offsets[batch.start])
                    lengths = [token_counts[i] for i in batch]
                    yield (start, *_forward_packed(base, capture, *packed_inputs(lengths, start, input_ids, device)))
            return
        for batch in length_batches(token_counts, tokens_per_batch):
            width = token_counts[batch[0]]
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for row, index in enumerate(batch):
                start, end = int(offsets[index]), int(offsets[index + 1])
                ids[row, : end - start] = input_ids[start:end]
            last = base(input_ids=ids.to(device), use_cache=False).last_hidden_state
            aux, last = capture.take().to("cpu"), last.to("cpu")
            for row, index in enumerate(batch):
                yield int(offsets[index]), aux[row, : token_counts[index]], last[row, : token_counts[index]]
    finally:
        capture.remove()


@torch.inference_mode()
def capture_hidden_states(
    model, input_ids, token_counts, offsets, layer_ids, storage_dtype, tokens_per_batch, progress=None, layout="padded"
):
    """Run the model over the concatenated samples; return (aux [T, A*H], last [T, H]).

    The simple driver: the whole shard in memory, each piece copied back before the next starts.
    """
    hidden = model.config.hidden_size
    total = int(offsets[-1])
    aux_out = torch.empty(total, len(layer_ids) * hidden, dtype=storage_dtype)
    last_out = torch.empty(total, hidden, dtype=storage_dtype)
    rows = hidden_state_rows(model, input_ids, token_counts, offsets, layer_ids, tokens_per_batch, layout)
    with contextlib.closing(rows):
        for start, aux, last in rows:
            end = start + aux.shape[0]
            aux_out[start:end] = aux.to("cpu", storage_dtype)
            last_out[start:end] = last.to("cpu", storage_dtype)
            if progress is not None:
                progress.update(end - start)
    return aux_out, last_out
