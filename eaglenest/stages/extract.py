"""Extract: run the target over one prepared shard and store its hidden states.

Transformers backend: the target runs in this process (eaglenest.target_model.runtime). The
per-shard steps (storage dtype, disk preflight, fp8 quantisation, atomic write) are
eaglenest.stages.shard_driver's, shared with the SGLang backend; :class:`TransformersBackend`
only answers the hidden states. Packed rows come back on the device in token order, so
the driver converts them there and streams them to disk while the next rows are computed
(pinned host buffers, a side stream, the shard written on background threads); padded
samples come back on the host and are gathered first. Both layouts give the bytes of the
simple driver, :func:`eaglenest.target_model.runtime.capture_hidden_states` plus the one-shot
writer (tests hold this in fp32 on CPU). See docs/performance.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

from eaglenest.stages import shard_driver
from eaglenest.formats import shards
from eaglenest.target_model.runtime import (
    hidden_state_rows, load_target, load_target_config, packed_batches, pick_device, resolve_layout,
)

log = logging.getLogger(__name__)


class TransformersBackend:
    """The target run in this process with transformers: shard_driver's hidden-state backend.

    ``model``: an already loaded target (benchmarks), instead of loading ``target_path``.
    """

    def __init__(self, target_path, device="auto", compute_dtype=None, tokens_per_batch=8192, expected_shape=None,
                 layout="auto", model=None):
        self.target_path, self.requested_device, self.compute_dtype = target_path, device, compute_dtype
        self.tokens_per_batch, self.expected_shape, self.layout, self.model = tokens_per_batch, expected_shape, layout, model

    def target_shape(self) -> tuple[int, int]:
        # From config.json alone: a job the disk preflight refuses must not first pay for
        # loading the weights (minutes for a large target).
        config = self.model.config if self.model is not None else load_target_config(self.target_path)
        shape = (config.num_hidden_layers, config.hidden_size)
        if self.expected_shape is not None and tuple(self.expected_shape) != shape:
            raise ValueError(
                f"config says the target has (num_layers, hidden_size)={self.expected_shape}, the model at "
                f"{self.target_path} has {shape}"
            )
        return shape

    def start(self, layer_ids: list[int]) -> None:
        if self.model is None:
            device = pick_device(self.requested_device)
            compute_dtype = self.compute_dtype or ("float32" if device == "cpu" else "bfloat16")
            self.model = load_target(self.target_path, device, compute_dtype)
        self.device = next(self.model.parameters()).device
        self.layout = resolve_layout(self.model, self.layout)
        # Packed rows are consecutive token ranges: they stream to disk as they come.
        self.in_token_order = self.layout == "packed"

    def largest_answer(self, prepared: shards.ShardReader) -> int:
        counts = prepared.token_counts
        if self.layout == "packed":
            return max((sum(counts[i] for i in batch) for batch in packed_batches(counts, self.tokens_per_batch)), default=0)
        return max(counts, default=0)

    def hidden_states(self, prepared: shards.ShardReader, layer_ids: list[int]) -> Iterator[shard_driver.StateRows]:
        tensors = prepared.tensors(shards.PREPARED_TENSORS)
        rows = hidden_state_rows(
            self.model, tensors["input_ids"], prepared.token_counts, tensors["offsets"], layer_ids, self.tokens_per_batch, self.layout
        )
        with contextlib.closing(rows):
            for start, aux, last in rows:
                yield shard_driver.StateRows(start, aux, last)


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
    backend = TransformersBackend(target_path, device, compute_dtype, tokens_per_batch, expected_shape, layout, model)
    result = shard_driver.extract_hidden_shard(
        prepared_path, hidden_path, backend, target_name, layer_ids, dtype, check_disk, disk_reserve_bytes, log_stream
    )
    stats = {
        "shard": os.path.basename(hidden_path),
        "samples": result.samples,
        "tokens": result.tokens,
        "bytes_per_token": result.bytes_per_token,
        "bytes": result.bytes,
        "device": str(backend.device),
        "layout": backend.layout,
        "load_s": round(result.start_s, 3),
        "forward_s": round(result.compute_s, 3),
        "write_s": round(result.write_s, 3),
        # End to end: prepared rows in, published shard file out (fsynced).
        "tokens_per_s": round(result.tokens / max(result.compute_s + result.write_s, 1e-9), 1),
        **result.pipeline,
    }
    log.info("extracted %s", stats)
    return stats
