"""One hidden shard from one prepared shard: the steps every extraction backend shares.

A backend only answers "the hidden states of these tokens of the shard": the transformers
runtime (eaglenest.stages.extract) and the patched SGLang server (eaglenest.sglang.client). What
defines the shard file happens here, once, so the backends cannot drift apart: the storage
dtype checked before any work, the prepared shard verified, layer ids resolved against the
target's shape, the disk preflight, the conversion to the storage dtype (fp8 quantised per
token and layer, on the device that computed the states), the finite check, and the atomic
write with its header and checksums.

Answers stream into :class:`eaglenest.formats.shards.HiddenShardWriter` while the backend
computes the next ones (through pinned host buffers when they are on a GPU). Answers that
come in any order (a server's concurrent requests) wait in memory only until the rows
before them are in, then stream the same way. Every path gives the same bytes for
the same rows (tests hold this).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import torch

from eaglenest.formats import atomic, shards
from eaglenest.target_model import layer_ids as layer_id_convention

log = logging.getLogger(__name__)


class InsufficientDiskError(RuntimeError):
    pass


@dataclass
class StateRows:
    """Hidden states of consecutive tokens of the shard, from token ``first_token`` on.

    Any floating dtype, on any device: the driver converts them where they are.
    """

    first_token: int
    aux: torch.Tensor  # [n, A*H], aux layers concatenated in layer-id order
    last: torch.Tensor  # [n, H], the final post-norm hidden state
    finite: bool | None = None  # None: the driver checks; a server that checked where the rows were says so
    # The rows already as to_storage makes them, where a backend converts on its own threads.
    stored: dict[str, torch.Tensor] | None = None


class HiddenStateBackend(Protocol):
    """What computes hidden states. Layer ids are in HF convention on this side of the
    protocol; a backend that speaks another convention translates at its own edge."""

    def target_shape(self) -> tuple[int, int]:
        """(num_layers, hidden_size), cheaply: the disk preflight runs before :meth:`start`."""

    def start(self, layer_ids: list[int]) -> None:
        """The expensive or remote part (load the weights, ask the server who it is)."""

    @property
    def device(self) -> torch.device:
        """Where answers live (after :meth:`start`)."""

    @property
    def in_token_order(self) -> bool:
        """Whether answers come in token order, each starting where the previous ended."""

    def largest_answer(self, prepared: shards.ShardReader) -> int:
        """The most tokens one answer holds (sizes the pinned host buffers)."""

    def hidden_states(self, prepared: shards.ShardReader, layer_ids: list[int]) -> Iterator[StateRows]:
        """Every token of the shard exactly once."""


@dataclass
class ShardResult:
    """What the driver measured; each backend reports its own selection of these."""

    samples: int
    tokens: int
    bytes_per_token: int
    bytes: int
    layer_ids: list[int]
    start_s: float  # target shape, preflight and the backend's start
    compute_s: float  # until the last answer is in
    write_s: float  # until the shard is published (fsynced)
    pipeline: dict = field(default_factory=dict)  # streaming numbers (in-order answers only)


def check_storage_dtype(dtype: str) -> None:
    # Checked first: a typo must not cost a model load or a shard's worth of requests.
    if dtype not in shards.STORAGE_DTYPES:
        raise ValueError(f"extract.dtype {dtype!r} is not a storage dtype; choose one of {sorted(shards.STORAGE_DTYPES)}")


def to_storage(aux: torch.Tensor, last: torch.Tensor, dtype: str, num_aux_layers: int) -> dict[str, torch.Tensor]:
    """The rows as the shard stores them, computed where they are (on the GPU in the fast path)."""
    if dtype == shards.FP8_DTYPE:
        aux_q, aux_scale = shards.quantize_rows(aux, num_aux_layers)
        last_q, last_scale = shards.quantize_rows(last, 1)
        return {"aux_hidden": aux_q, "last_hidden": last_q, "aux_hidden_scale": aux_scale, "last_hidden_scale": last_scale}
    storage = shards.STORAGE_DTYPES[dtype]
    return {"aux_hidden": aux.to(storage), "last_hidden": last.to(storage)}


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


class _StreamedShard:
    """A shard's stored rows written while the backend computes the next ones.

    At most ``depth`` answers are in flight between the backend and the disk: when the
    disk is slower, the driver waits for it (reported as ``wait_for_disk_s``); otherwise
    it never does.
    """

    def __init__(self, hidden_path: Path, prepared: shards.ShardReader, meta: dict, staging_rows: int | None, depth: int = 3):
        self.writer = shards.HiddenShardWriter(hidden_path, prepared, meta)
        self.depth, self.answers, self.waited = depth, 0, 0.0
        self.in_flight: list[list] = [[] for _ in range(depth)]
        self.staging, setup_started = None, time.perf_counter()
        if staging_rows:
            hidden, groups = meta["target_hidden_size"], len(meta["layer_ids"])
            probe = to_storage(torch.zeros(1, groups * hidden), torch.zeros(1, hidden), meta["dtype"], groups)
            self.staging = _HostStaging({n: (t.shape[1], t.dtype) for n, t in probe.items()}, staging_rows, depth)
        self.setup_s = time.perf_counter() - setup_started

    def put(self, first_token: int, rows: dict[str, torch.Tensor]) -> None:
        if first_token != self.writer.rows_written:
            raise ValueError(f"{self.writer.path}: rows from token {first_token} arrived, token {self.writer.rows_written} was next")
        slot = self.answers % self.depth
        # Bounded queue: reuse a slot's buffers only once the writer has them on disk.
        wait_started = time.perf_counter()
        for future in self.in_flight[slot]:
            future.result()
        self.waited += time.perf_counter() - wait_started
        if self.staging is not None:
            host, copied = self.staging.copy(slot, rows)
            self.in_flight[slot] = self.writer.append_rows(host, ready=copied.synchronize)
        else:
            self.in_flight[slot] = self.writer.append_rows(rows)
        self.answers += 1

    def close(self) -> None:
        self.writer.close()

    def abort(self, exc: BaseException) -> None:
        self.writer.abort(exc)  # removes the partial file; ENOSPC comes back as DiskFullError

    def stats(self) -> dict:
        return {"batches": self.answers, "wait_for_disk_s": round(self.waited, 3), "pinned_setup_s": round(self.setup_s, 3)}


class _ReorderedShard:
    """Answers in any order, streamed in token order: an answer waits only for the rows
    before it, so the disk works while the server computes (a server's requests finish
    nearly in the order they were sent)."""

    def __init__(self, streamed: _StreamedShard):
        self.streamed, self.waiting, self.most_waiting = streamed, {}, 0

    def put(self, first_token: int, rows: dict[str, torch.Tensor]) -> None:
        self.waiting[first_token] = rows
        self.most_waiting = max(self.most_waiting, len(self.waiting))
        while self.streamed.writer.rows_written in self.waiting:
            self.streamed.put(self.streamed.writer.rows_written, self.waiting.pop(self.streamed.writer.rows_written))

    def close(self) -> None:
        if self.waiting:
            raise ValueError(f"{self.streamed.writer.path}: rows from tokens {sorted(self.waiting)} never became contiguous")
        self.streamed.close()

    def abort(self, exc: BaseException) -> None:
        self.streamed.abort(exc)

    def stats(self) -> dict:
        return {**self.streamed.stats(), "most_answers_waiting": self.most_waiting}


def extract_hidden_shard(
    prepared_path: str | os.PathLike,
    hidden_path: str | os.PathLike,
    backend: HiddenStateBackend,
    target_name: str,
    layer_ids,
    dtype: str,
    check_disk: bool = True,
    disk_reserve_bytes: int = 0,
    log_stream=None,
) -> ShardResult:
    """Make the hidden shard of one prepared shard with ``backend``; nothing is written unless all of it is."""
    from tqdm import tqdm

    check_storage_dtype(dtype)
    prepared_path, hidden_path = Path(prepared_path), Path(hidden_path)
    hidden_path.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(hidden_path.parent, hidden_path.name)
    prepared = shards.verify_shard(prepared_path, deep=True)
    started = time.perf_counter()
    num_layers, hidden = backend.target_shape()
    layer_ids = layer_id_convention.resolve(layer_ids, num_layers)
    bytes_per_token = shards.hidden_bytes_per_token(hidden, len(layer_ids), dtype)
    if check_disk:  # before the backend starts: a refused shard costs no model load, no request
        log.info("preflight: %s", preflight(hidden_path, prepared_path, bytes_per_token, disk_reserve_bytes))
    backend.start(layer_ids)
    ready = time.perf_counter()
    meta = {"target": target_name, "target_hidden_size": hidden, "layer_ids": layer_ids, "dtype": dtype}
    on_cuda = backend.device.type == "cuda"
    finite = torch.ones((), dtype=torch.bool, device=backend.device)
    busy_events, shard = [], None
    progress = tqdm(total=prepared.num_tokens, unit="tok", unit_scale=True, desc=hidden_path.name, file=log_stream, mininterval=5)
    try:
        if backend.in_token_order:
            shard = _StreamedShard(hidden_path, prepared, meta, backend.largest_answer(prepared) if on_cuda else None)
        else:
            shard = _ReorderedShard(_StreamedShard(hidden_path, prepared, meta, None))
        with contextlib.closing(backend.hidden_states(prepared, layer_ids)) as answers:
            while True:
                if on_cuda:
                    busy_started = torch.cuda.Event(enable_timing=True)
                    busy_started.record()
                rows = next(answers, None)
                if rows is None:
                    break
                if rows.finite is None:
                    finite &= torch.isfinite(rows.aux).all() & torch.isfinite(rows.last).all()
                elif not rows.finite:
                    finite &= False
                stored = rows.stored if rows.stored is not None else to_storage(rows.aux, rows.last, dtype, len(layer_ids))
                if on_cuda:
                    busy_ended = torch.cuda.Event(enable_timing=True)
                    busy_ended.record()
                    busy_events.append((busy_started, busy_ended))
                shard.put(rows.first_token, stored)
                progress.update(rows.aux.shape[0])
        if not bool(finite):
            raise ValueError(f"{hidden_path}: the target produced non-finite hidden states; nothing was written")
        computed = time.perf_counter()
        shard.close()
    except BaseException as exc:
        if shard is not None:
            shard.abort(exc)
        raise
    finally:
        progress.close()
    written = time.perf_counter()
    pipeline = shard.stats() if isinstance(shard, (_StreamedShard, _ReorderedShard)) else {}
    if busy_events and pipeline:
        torch.cuda.synchronize()
        pipeline["gpu_busy_s"] = round(sum(a.elapsed_time(b) for a, b in busy_events) / 1000, 3)
    return ShardResult(
        samples=len(prepared.token_counts),
        tokens=prepared.num_tokens,
        bytes_per_token=bytes_per_token,
        bytes=hidden_path.stat().st_size,
        layer_ids=layer_ids,
        start_s=ready - started,
        compute_s=computed - ready,
        write_s=written - computed,
        pipeline=pipeline,
    )
