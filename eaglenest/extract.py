"""Extract: run the target over one prepared shard and store its hidden states.

Transformers backend. Forward pre-hooks on the aux decoder layers capture their inputs
(HF convention: ``hidden_states[i]`` of ``output_hidden_states=True`` is the input of
decoder layer i, index 0 = embeddings), and the base model's output is the final
post-norm hidden state; the lm_head is never run and no other layer is kept.

Samples are sorted by length and packed into right-padded batches of at most
``tokens_per_batch`` padded tokens. Right padding needs no attention mask: with causal
attention a real token never attends to the pads after it, so its states are exact.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch

from eaglenest import atomic, shards

log = logging.getLogger(__name__)


class InsufficientDiskError(RuntimeError):
    pass


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's aux layers in HF convention: low, middle and high."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_layer_ids(layer_ids, num_layers: int) -> list[int]:
    ids = default_layer_ids(num_layers) if layer_ids in (None, "default") else [int(i) for i in layer_ids]
    for i in ids:
        if not 0 <= i < num_layers:
            raise ValueError(f"aux layer id {i} outside [0, {num_layers}) (HF convention: input of layer i)")
    return ids


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


def length_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Sample indices grouped by length (longest first), padded size <= tokens_per_batch."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        if current and longest * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def load_target(target_path: str | os.PathLike, device: str, compute_dtype: str):
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=dtype)
    return model.to(device).eval()


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


@torch.inference_mode()
def capture_hidden_states(model, input_ids, token_counts, offsets, layer_ids, storage_dtype, tokens_per_batch, progress=None):
    """Run the model over the concatenated samples; return (aux [T, A*H], last [T, H])."""
    device = next(model.parameters()).device
    hidden = model.config.hidden_size
    total = int(offsets[-1])
    aux_out = torch.empty(total, len(layer_ids) * hidden, dtype=storage_dtype)
    last_out = torch.empty(total, hidden, dtype=storage_dtype)
    capture = AuxCapture(model, layer_ids)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    try:
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
) -> dict:
    """Make one hidden shard from one prepared shard; returns throughput numbers."""
    from tqdm import tqdm

    prepared_path, hidden_path = Path(prepared_path), Path(hidden_path)
    hidden_path.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(hidden_path.parent)
    prepared = shards.verify_shard(prepared_path, deep=True)
    device = pick_device(device)
    compute_dtype = compute_dtype or ("float32" if device == "cpu" else "bfloat16")
    started = time.perf_counter()
    model = load_target(target_path, device, compute_dtype)
    if expected_shape is not None and expected_shape != (model.config.num_hidden_layers, model.config.hidden_size):
        raise ValueError(
            f"config says the target has (num_layers, hidden_size)={expected_shape}, the model at "
            f"{target_path} has {(model.config.num_hidden_layers, model.config.hidden_size)}"
        )
    layer_ids = resolve_layer_ids(layer_ids, model.config.num_hidden_layers)
    hidden = model.config.hidden_size
    bytes_per_token = shards.hidden_bytes_per_token(hidden, len(layer_ids), dtype)
    if check_disk:
        log.info("preflight: %s", preflight(hidden_path, prepared_path, bytes_per_token, disk_reserve_bytes))
    loaded = time.perf_counter()
    tensors = prepared.tensors(shards.PREPARED_TENSORS)
    counts = prepared.token_counts
    progress = tqdm(total=sum(counts), unit="tok", unit_scale=True, desc=hidden_path.name, file=log_stream, mininterval=5)
    aux, last = capture_hidden_states(
        model, tensors["input_ids"], counts, tensors["offsets"], layer_ids,
        shards.STORAGE_DTYPES[dtype], tokens_per_batch, progress,
    )
    progress.close()
    computed = time.perf_counter()
    meta = {"target": target_name, "target_hidden_size": hidden, "layer_ids": layer_ids, "dtype": dtype}
    shards.write_hidden_shard(hidden_path, prepared, aux, last, meta)
    written = time.perf_counter()
    tokens = sum(counts)
    stats = {
        "shard": hidden_path.name,
        "samples": len(counts),
        "tokens": tokens,
        "bytes_per_token": bytes_per_token,
        "bytes": hidden_path.stat().st_size,
        "device": device,
        "load_s": round(loaded - started, 3),
        "forward_s": round(computed - loaded, 3),
        "write_s": round(written - computed, 3),
        "tokens_per_s": round(tokens / max(computed - loaded, 1e-9), 1),
    }
    log.info("extracted %s", stats)
    return stats
