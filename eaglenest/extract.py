"""Extract: run the target over one prepared shard and store its hidden states.

Transformers backend. Forward pre-hooks on the aux decoder layers capture their inputs
(HF convention: ``hidden_states[i]`` of ``output_hidden_states=True`` is the input of
decoder layer i, index 0 = embeddings), and the base model's output is the final
post-norm hidden state; the lm_head is never run and no other layer is kept.

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

Two drivers over the same forward: :func:`capture_hidden_states`, the simple one
(synchronous, whole shard in memory), and :func:`stream_hidden_states`, the fast one
(device-side conversion to the storage dtype, asynchronous copies into pinned host
buffers on a side stream, and the shard written by :class:`eaglenest.shards.HiddenShardWriter`
on background threads while the GPU computes the next rows). For the same layout they
give the same bytes (tests hold this in fp32 on CPU). See docs/performance.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglenest import atomic, shards
from eaglenest import layer_ids as layer_id_convention

log = logging.getLogger(__name__)


class InsufficientDiskError(RuntimeError):
    pass


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


def _base_model(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def _packed_inputs(lengths: list[int], first_token: int, input_ids: torch.Tensor, device) -> tuple:
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
def capture_hidden_states(
    model, input_ids, token_counts, offsets, layer_ids, storage_dtype, tokens_per_batch, progress=None, layout="padded"
):
    """Run the model over the concatenated samples; return (aux [T, A*H], last [T, H]).

    The simple driver: one batch at a time, each copied back before the next starts.
    """
    device = next(model.parameters()).device
    hidden = model.config.hidden_size
    total = int(offsets[-1])
    aux_out = torch.empty(total, len(layer_ids) * hidden, dtype=storage_dtype)
    last_out = torch.empty(total, hidden, dtype=storage_dtype)
    layout = resolve_layout(model, layout)
    capture = AuxCapture(model, layer_ids)
    base = _base_model(model)
    try:
        if layout == "packed":
            with attention_implementation(model, PACKED_ATTENTION):
                for batch in packed_batches(token_counts, tokens_per_batch):
                    start, end = int(offsets[batch.start]), int(offsets[batch.stop])
                    lengths = [token_counts[i] for i in batch]
                    aux, last = _forward_packed(base, capture, *_packed_inputs(lengths, start, input_ids, device))
                    aux_out[start:end] = aux.to("cpu", storage_dtype)
                    last_out[start:end] = last.to("cpu", storage_dtype)
                    if progress is not None:
                        progress.update(end - start)
            return aux_out, last_out
        for batch in length_batches(token_counts, tokens_per_batch):
            width = token_counts[batch[0]]
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for row, index in enumerate(batch):
                start, end = int(offsets[index]), int(offsets[index + 1])
                ids[row, : end - start] = input_ids[start:end]
            last = base(input_ids=ids.to(device), use_cache=False).last_hidden_state
            aux = capture.take()
            aux, last = aux.to("cpu", storage_dtype), last.to("cpu", storage_dtype)
            for row, index in enumerate(batch):
                start, end = int(offsets[index]), int(offsets[index + 1])
                aux_out[start:end] = aux[row, : end - start]
                last_out[start:end] = last[row, : end - start]
            if progress is not None:
                progress.update(sum(token_counts[i] for i in batch))
    finally:
        capture.remove()
    return aux_out, last_out


def to_storage(aux: torch.Tensor, last: torch.Tensor, dtype: str, num_aux_layers: int) -> dict[str, torch.Tensor]:
    """The rows as the shard stores them, computed where they are (on the GPU in the fast path)."""
    if dtype == shards.FP8_DTYPE:
        aux_q, aux_scale = shards.quantize_rows(aux, num_aux_layers)
        last_q, last_scale = shards.quantize_rows(last, 1)
        return {"aux_hidden": aux_q, "last_hidden": last_q, "aux_hidden_scale": aux_scale, "last_hidden_scale": last_scale}
    storage = shards.STORAGE_DTYPES[dtype]
    return {"aux_hidden": aux.to(storage), "last_hidden": last.to(storage)}


class StorageRows:
    """A shard's aux and last hidden rows as the shard stores them, filled a sample at a time
    (the SGLang backend's answers arrive that way). fp8 rows are quantised as they arrive:
    the scales are per row, so that equals quantising the whole shard at once."""

    def __init__(self, tokens: int, hidden_size: int, num_aux_layers: int, dtype: str):
        storage = shards.STORAGE_DTYPES[dtype]
        self.dtype, self.num_aux_layers = dtype, num_aux_layers
        self.tensors = {
            "aux_hidden": torch.empty(tokens, num_aux_layers * hidden_size, dtype=storage),
            "last_hidden": torch.empty(tokens, hidden_size, dtype=storage),
        }
        if dtype == shards.FP8_DTYPE:
            self.tensors["aux_hidden_scale"] = torch.empty(tokens, num_aux_layers, dtype=torch.float32)
            self.tensors["last_hidden_scale"] = torch.empty(tokens, 1, dtype=torch.float32)

    def put(self, start: int, end: int, aux: torch.Tensor, last: torch.Tensor) -> None:
        for name, rows in to_storage(aux, last, self.dtype, self.num_aux_layers).items():
            self.tensors[name][start:end] = rows

    def write(self, hidden_path, prepared, meta: dict) -> None:
        scales = {name: self.tensors[name] for name in shards.SCALE_TENSORS.values() if name in self.tensors}
        shards.write_hidden_shard(hidden_path, prepared, self.tensors["aux_hidden"], self.tensors["last_hidden"], meta, **scales)


class _HostStaging:
    """Pinned host buffers that device rows are copied into on a side stream (CUDA only)."""

    def __init__(self, shapes: dict[str, tuple[int, torch.dtype]], max_rows: int, depth: int):
        self.slots = [
            {name: torch.empty(max_rows, width, dtype=dtype, pin_memory=True) for name, (width, dtype) in shapes.items()}
            for _ in range(depth)
        ]
        self.copy_stream = torch.cuda.Stream()

    def copy(self, slot: int, rows: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        host = {}
        with torch.cuda.stream(self.copy_stream):
            for name, tensor in rows.items():
                host[name] = self.slots[slot][name][: tensor.shape[0]]
                host[name].copy_(tensor, non_blocking=True)
                # The compute stream may reuse this memory only after the copy has read it.
                tensor.record_stream(self.copy_stream)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        return host, done


@torch.inference_mode()
def stream_hidden_states(
    model,
    prepared: shards.ShardReader,
    writer: shards.HiddenShardWriter,
    layer_ids: list[int],
    dtype: str,
    tokens_per_batch: int,
    progress=None,
    depth: int = 3,
) -> dict:
    """The fast driver: packed rows, written by ``writer`` while the next rows are computed.

    At most ``depth`` batches are in flight between the GPU and the disk: when the disk
    is slower than the GPU, the GPU waits for it (time reported as ``wait_for_disk_s``);
    otherwise it never does. Returns timing numbers.
    """
    device = next(model.parameters()).device
    on_cuda = device.type == "cuda"
    counts = prepared.token_counts
    input_ids = prepared.tensor("input_ids")
    hidden, groups = model.config.hidden_size, len(layer_ids)
    batches = packed_batches(counts, tokens_per_batch)
    capture = AuxCapture(model, layer_ids)
    base = _base_model(model)
    staging, setup_started = None, time.perf_counter()
    if on_cuda and batches:
        max_rows = max(sum(counts[i] for i in batch) for batch in batches)
        probe = to_storage(torch.zeros(1, groups * hidden), torch.zeros(1, hidden), dtype, groups)
        staging = _HostStaging({n: (t.shape[1], t.dtype) for n, t in probe.items()}, max_rows, depth)
    setup_s = time.perf_counter() - setup_started
    in_flight: list[list] = [[] for _ in range(depth)]
    finite = torch.ones((), dtype=torch.bool, device=device)
    busy_events, waited, first_token = [], 0.0, 0
    try:
        with attention_implementation(model, PACKED_ATTENTION):
            for number, batch in enumerate(batches):
                lengths = [counts[i] for i in batch]
                inputs = _packed_inputs(lengths, first_token, input_ids, device)
                slot = number % depth
                # Bounded queue: reuse a slot's buffers only once the writer has them on disk.
                wait_started = time.perf_counter()
                for future in in_flight[slot]:
                    future.result()
                waited += time.perf_counter() - wait_started
                if on_cuda:
                    started = torch.cuda.Event(enable_timing=True)
                    started.record()
                aux, last = _forward_packed(base, capture, *inputs)
                finite &= torch.isfinite(aux).all() & torch.isfinite(last).all()
                rows = to_storage(aux, last, dtype, groups)
                if on_cuda:
                    ended = torch.cuda.Event(enable_timing=True)
                    ended.record()
                    busy_events.append((started, ended))
                    host, copied = staging.copy(slot, rows)
                    in_flight[slot] = writer.append_rows(host, ready=copied.synchronize)
                else:
                    in_flight[slot] = writer.append_rows(rows)
                first_token += sum(lengths)
                if progress is not None:
                    progress.update(sum(lengths))
        if not bool(finite):
            raise ValueError(f"{writer.path}: the target produced non-finite hidden states; nothing was written")
    finally:
        capture.remove()
    stats = {"batches": len(batches), "wait_for_disk_s": round(waited, 3), "pinned_setup_s": round(setup_s, 3)}
    if busy_events:
        torch.cuda.synchronize()
        stats["gpu_busy_s"] = round(sum(a.elapsed_time(b) for a, b in busy_events) / 1000, 3)
    return stats


def preflight(hidden_path: Path, prepared_path: Path, bytes_per_token: int, reserve_bytes: int) -> dict:
    """Refuse to start when the shards still missing cannot fit on the output disk.

    "Missing" = every prepared shard next to ``prepared_path`` whose hidden shard does
    not exist yet, this one included; sizes come from the prepared headers' token counts.
    """
    needed_tokens = 0
    missing = 0
    for prepared in sorted(prepared_path.parent.glob("shard-*.safetensors")):
        if (hidden_path.parent / prepared.name).exists():
            continue
        _, meta = shards.read_header(prepared)
        needed_tokens += sum(meta["token_counts"])
        missing += 1
    needed = needed_tokens * bytes_per_token
    free = shutil.disk_usage(hidden_path.parent).free
    if needed + reserve_bytes > free:
        raise InsufficientDiskError(
            f"disk preflight: the {missing} missing hidden shards need {needed:,} bytes "
            f"({needed_tokens:,} tokens x {bytes_per_token:,} B/token) plus a reserve of "
            f"{reserve_bytes:,} bytes, but {hidden_path.parent} has {free:,} bytes free. "
            f"Free space or point results to a larger disk, then rerun."
        )
    return {"missing_shards": missing, "needed_bytes": needed, "free_bytes": free}


def extract_shard(
    prepared_path: str | os.PathLike,
    hidden_path: str | os.PathLike,
    target_path: str | os.PathLike,
    target_name: str,
    layer_ids,
    dtype: str = "bfloat16",
    device: str = "auto",
    compute_dtype: str | None = None,
    tokens_per_batch: int = 8192,
    check_disk: bool = True,
    disk_reserve_bytes: int = 0,
    expected_shape: tuple[int, int] | None = None,
    log_stream=None,
    layout: str = "auto",
    model=None,
) -> dict:
    """Make one hidden shard from one prepared shard; returns throughput numbers.

    ``layout`` auto takes the fast path (packed rows streamed to disk) when the model
    supports packing, else the simple padded one; both only change speed, never what a
    shard means. ``model``: an already loaded target (benchmarks), instead of loading
    ``target_path``.
    """
    from tqdm import tqdm

    prepared_path, hidden_path = Path(prepared_path), Path(hidden_path)
    hidden_path.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(hidden_path.parent, hidden_path.name)
    prepared = shards.verify_shard(prepared_path, deep=True)
    started = time.perf_counter()
    # The shape from config.json alone: a job the disk preflight refuses must not first pay
    # for loading the weights (minutes for a large target).
    target_config = model.config if model is not None else load_target_config(target_path)
    if expected_shape is not None and expected_shape != (target_config.num_hidden_layers, target_config.hidden_size):
        raise ValueError(
            f"config says the target has (num_layers, hidden_size)={expected_shape}, the model at "
            f"{target_path} has {(target_config.num_hidden_layers, target_config.hidden_size)}"
        )
    layer_ids = layer_id_convention.resolve(layer_ids, target_config.num_hidden_layers)
    hidden = target_config.hidden_size
    bytes_per_token = shards.hidden_bytes_per_token(hidden, len(layer_ids), dtype)
    if check_disk:
        log.info("preflight: %s", preflight(hidden_path, prepared_path, bytes_per_token, disk_reserve_bytes))
    if model is None:
        device = pick_device(device)
        compute_dtype = compute_dtype or ("float32" if device == "cpu" else "bfloat16")
        model = load_target(target_path, device, compute_dtype)
    device = str(next(model.parameters()).device)
    layout = resolve_layout(model, layout)
    loaded = time.perf_counter()
    counts = prepared.token_counts
    meta = {"target": target_name, "target_hidden_size": hidden, "layer_ids": layer_ids, "dtype": dtype}
    progress = tqdm(total=sum(counts), unit="tok", unit_scale=True, desc=hidden_path.name, file=log_stream, mininterval=5)
    pipeline = {}
    if layout == "packed":
        writer = shards.HiddenShardWriter(hidden_path, prepared, meta)
        try:
            pipeline = stream_hidden_states(model, prepared, writer, layer_ids, dtype, tokens_per_batch, progress)
            computed = time.perf_counter()
            writer.close()
        except BaseException as exc:
            writer.abort(exc)  # removes the partial file; ENOSPC comes back as DiskFullError
            raise
    else:
        tensors = prepared.tensors(shards.PREPARED_TENSORS)
        compute_storage = next(model.parameters()).dtype if dtype == shards.FP8_DTYPE else shards.STORAGE_DTYPES[dtype]
        aux, last = capture_hidden_states(
            model, tensors["input_ids"], counts, tensors["offsets"], layer_ids, compute_storage, tokens_per_batch, progress, layout
        )
        computed = time.perf_counter()
        rows = to_storage(aux, last, dtype, len(layer_ids))
        scales = {name: rows[name] for name in shards.SCALE_TENSORS.values() if name in rows}
        shards.write_hidden_shard(hidden_path, prepared, rows["aux_hidden"], rows["last_hidden"], meta, **scales)
    progress.close()
    written = time.perf_counter()
    tokens = sum(counts)
    stats = {
        "shard": hidden_path.name,
        "samples": len(counts),
        "tokens": tokens,
        "bytes_per_token": bytes_per_token,
        "bytes": hidden_path.stat().st_size,
        "device": device,
        "layout": layout,
        "load_s": round(loaded - started, 3),
        "forward_s": round(computed - loaded, 3),
        "write_s": round(written - computed, 3),
        # End to end: prepared rows in, published shard file out (fsynced).
        "tokens_per_s": round(tokens / max(written - loaded, 1e-9), 1),
        **pipeline,
    }
    log.info("extracted %s", stats)
    return stats
