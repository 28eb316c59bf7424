"""Training data: samples of the consolidated hidden shards, packed into rows of a token budget.

What a step holds is a pure function of (split, token_budget, rows_per_step, seed, epoch):
each epoch shuffles the sample order with a generator seeded by (seed, epoch), packs samples
greedily in that order into rows of at most ``token_budget`` tokens, and groups
``rows_per_step`` rows into one global step. Under DDP rank r takes rows r, r+W, ... of each
step, so one process and W processes see the same global batch. A checkpoint stores only the
global step number; resuming replays nothing.

Rows are read lazily from the memory-mapped shard files by a background thread that keeps
``prefetch`` steps ready (:class:`StepStream`); the time the training loop spends waiting for it
is measured. :class:`DeviceBatches` moves each step's batch to the device, on a GPU while the
previous step's optimizer runs.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglenest.formats import shards

ROW_TENSORS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


@dataclass(frozen=True)
class SampleRef:
    shard: int
    start: int
    stop: int
    sample_id: str

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass
class Dataset:
    shard_paths: list[Path]
    samples: list[SampleRef]
    hidden_size: int
    layer_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.samples)


def open_split(index_path, split_path, split: str, expect: dict | None = None, keep=None) -> Dataset:
    """The samples of ``split`` ("train", "val", or "all": both) in index order, every shard
    header checked; with ``keep`` (a predicate on sample ids), only those it keeps."""
    index = json.loads(Path(index_path).read_text())
    parts = json.loads(Path(split_path).read_text())
    listed = parts["train"] + parts["val"] if split == "all" else parts[split]
    wanted = {sample_id for sample_id in listed if keep is None or keep(sample_id)}
    paths, samples = [], []
    hidden_size = layer_ids = None
    for number, entry in enumerate(index["shards"]):
        path = Path(entry["path"])
        # Shallow: the consolidate job verified checksums; here the header and shapes must fit.
        reader = shards.verify_shard(path, deep=False, expect=expect)
        if reader.kind != "hidden":
            raise shards.ShardError(path, f"kind {reader.kind!r}, expected a hidden shard")
        if reader.metadata["checksums"] != entry["checksums"]:
            raise shards.ShardError(path, "changed since consolidation (checksums differ from index.json)")
        hidden_size = reader.metadata["target_hidden_size"]
        layer_ids = reader.metadata["layer_ids"]
        paths.append(path)
        start = 0
        for sample_id, count in zip(reader.sample_ids, reader.token_counts):
            if sample_id in wanted:
                samples.append(SampleRef(len(paths) - 1, start, start + count, sample_id))
            start += count
    if not samples:
        raise ValueError(
            f"{split_path}: the {split!r} split has no samples in {index_path}"
            + (" that the sample filter keeps" if keep is not None else " (too few conversations for consolidate.val_fraction?)")
        )
    return Dataset(paths, samples, hidden_size, layer_ids)


def pack_rows(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Greedy packing in the given order: positions into rows of at most token_budget tokens."""
    rows, current, used = [], [], 0
    for position, length in enumerate(lengths):
        if length > token_budget:
            raise ValueError(
                f"a sample has {length} tokens, more than train.token_budget={token_budget}; "
                "raise the budget to at least data.max_len"
            )
        if used + length > token_budget and current:
            rows.append(current)
            current, used = [], 0
        current.append(position)
        used += length
    if current:
        rows.append(current)
    return rows


def epoch_steps(dataset: Dataset, token_budget: int, rows_per_step: int, seed: int, epoch: int, shuffle: bool = True):
    """Steps of one epoch: each a list of rows, each row a list of sample indices."""
    order = list(range(len(dataset.samples)))
    if shuffle:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(len(order), generator=generator).tolist()
    packed = pack_rows([dataset.samples[i].length for i in order], token_budget)
    rows = [[order[p] for p in row] for row in packed]
    return [rows[i : i + rows_per_step] for i in range(0, len(rows), rows_per_step)]


def rows_per_rank(rows_per_step: int, world_size: int) -> int:
    """The most rows one rank gets of a step (``rows[rank::world_size]``): what a padded batch holds."""
    return -(-rows_per_step // world_size)


class RowReader:
    """Slices of one split's shards, read through memory-mapped handles (eaglenest.formats.shards.RowSource).

    ``keep_fp8``: fp8 shards' hidden rows stay fp8 in the batch, with their scales as
    ``aux_hidden_scale`` / ``last_hidden_scale`` [B, T, groups], for the trainer to dequantize
    on the GPU (:func:`to_device`). Dequantizing 8 rows of 4,096 tokens on the CPU costs the
    loader about as long as the GPU takes for the whole step of the SmolLM2 drafter, in a
    thread beside the one that launches the step; fp8 also halves the bytes copied to the GPU.
    """

    def __init__(self, dataset: Dataset, keep_fp8: bool = False):
        self.dataset = dataset
        self.keep_fp8 = keep_fp8
        self._handles = {}

    def _handle(self, shard: int):
        if shard not in self._handles:
            self._handles[shard] = shards.RowSource(self.dataset.shard_paths[shard], keep_fp8=self.keep_fp8)
        return self._handles[shard]

    def read(self, ref: SampleRef) -> dict[str, torch.Tensor]:
        handle = self._handle(ref.shard)
        return handle.rows(ROW_TENSORS, ref.start, ref.stop)

    def batch(self, rows: list[list[int]], pad_to: int | None = None, pad_rows: int | None = None,
              pin_memory: bool = False) -> dict[str, torch.Tensor]:
        """Packed rows -> padded tensors [B, T(, width)]; segment_ids -1 and loss_mask 0 on padding.

        ``pad_to`` fixes T and ``pad_rows`` fixes B (empty rows appended), so that every step has
        one shape: a compiled step (FlexAttention on CUDA) would otherwise compile again for the
        short last step of each epoch and of validation. ``pin_memory``: the tensors are made in
        page-locked memory (for a GPU's asynchronous copy), not copied there afterwards: one
        pass over the rows fewer (235 MB a 4,096-token Kimi-shaped row).
        """
        length = pad_to or max(sum(self.dataset.samples[i].length for i in row) for row in rows)
        if pad_rows is not None and len(rows) > pad_rows:
            raise ValueError(f"{len(rows)} rows do not fit a batch padded to {pad_rows}")
        rows = list(rows) + [[]] * ((pad_rows or len(rows)) - len(rows))
        width = len(self.dataset.layer_ids) * self.dataset.hidden_size
        first = self.read(self.dataset.samples[rows[0][0]])
        hidden_dtype = first["aux_hidden"].dtype
        pinned = {"pin_memory": True} if pin_memory else {}
        out = {
            "input_ids": torch.zeros(len(rows), length, dtype=torch.int64, **pinned),
            "loss_mask": torch.zeros(len(rows), length, dtype=torch.bool, **pinned),
            "segment_ids": torch.full((len(rows), length), -1, dtype=torch.int64, **pinned),
            # Which sample of the split each token is (its index in dataset.samples), -1 on padding.
            "sample_index": torch.full((len(rows), length), -1, dtype=torch.int64, **pinned),
            "position_ids": torch.zeros(len(rows), length, dtype=torch.int64, **pinned),
            # Not zeroed as a whole: each row's samples are copied in, then its padding is zeroed
            # (one pass over the batch's largest tensors fewer).
            "aux_hidden": torch.empty(len(rows), length, width, dtype=hidden_dtype, **pinned),
            "last_hidden": torch.empty(len(rows), length, self.dataset.hidden_size, dtype=hidden_dtype, **pinned),
        }
        scale_names = [name for name in shards.SCALE_TENSORS.values() if name in first]
        for name in scale_names:  # padding decodes to 0 with any scale; 1 as quantize_rows uses
            out[name] = torch.ones(len(rows), length, first[name].shape[-1], dtype=first[name].dtype, **pinned)
        for b, row in enumerate(rows):
            at = 0
            for segment, sample in enumerate(row):
                ref = self.dataset.samples[sample]
                parts = self.read(ref)
                end = at + ref.length
                out["input_ids"][b, at:end] = parts["input_ids"].to(torch.int64)
                out["loss_mask"][b, at:end] = parts["loss_mask"].bool()
                out["segment_ids"][b, at:end] = segment
                out["sample_index"][b, at:end] = sample
                out["position_ids"][b, at:end] = torch.arange(ref.length)
                out["aux_hidden"][b, at:end] = parts["aux_hidden"]
                out["last_hidden"][b, at:end] = parts["last_hidden"]
                for name in scale_names:
                    out[name][b, at:end] = parts[name]
                at = end
            out["aux_hidden"][b, at:] = 0
            out["last_hidden"][b, at:] = 0
        out["tokens"] = torch.tensor(int((out["segment_ids"] >= 0).sum()))
        out["samples"] = tuple(sample for row in rows for sample in row)  # the same, on the host
        if pin_memory:
            out["tokens"] = out["tokens"].pin_memory()
        return out


class StepStream:
    """This rank's batches for global steps [start_step, total), prepared by a background thread.

    Iterating yields (global_step, epoch, batch or None when this rank has no row in the step).
    ``wait_seconds`` accumulates the time the consumer blocked on the queue.
    """

    def __init__(
        self,
        dataset: Dataset,
        token_budget: int,
        rows_per_step: int,
        seed: int,
        epochs: int,
        start_step: int = 0,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
        pad_to_budget: bool = False,
        pin_memory: bool = False,
        keep_fp8: bool = False,
    ):
        self.dataset = dataset
        self.token_budget = token_budget
        self.schedule = []  # (epoch, rows) per global step
        for epoch in range(epochs):
            for rows in epoch_steps(dataset, token_budget, rows_per_step, seed, epoch):
                self.schedule.append((epoch, rows))
        self.start_step = start_step
        self.rank, self.world_size = rank, world_size
        self.pad_to = token_budget if pad_to_budget else None
        self.pad_rows = rows_per_rank(rows_per_step, world_size) if pad_to_budget else None
        self.pin_memory = pin_memory
        self.keep_fp8 = keep_fp8
        self.wait_seconds = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread = None

    def __len__(self) -> int:
        return len(self.schedule)

    def _produce(self):
        reader = RowReader(self.dataset, keep_fp8=self.keep_fp8)
        try:
            for step in range(self.start_step, len(self.schedule)):
                epoch, rows = self.schedule[step]
                mine = rows[self.rank :: self.world_size]
                batch = reader.batch(mine, self.pad_to, self.pad_rows, self.pin_memory) if mine else None
                while not self._stop.is_set():
                    try:
                        self._queue.put((step, epoch, batch), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(None)
        except BaseException as exc:  # surface loader errors in the training loop
            self._queue.put(exc)

    def __iter__(self):
        self._thread = threading.Thread(target=self._produce, name="eaglenest-loader", daemon=True)
        self._thread.start()
        while True:
            began = time.perf_counter()
            item = self._queue.get()
            self.wait_seconds += time.perf_counter() - began
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self):
        self._stop.set()


def hidden_dtype_on(device: torch.device) -> torch.dtype:
    """The dtype hidden states are fed in: bf16 on a GPU (autocast), float32 on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32



def to_device(batch, device, hidden_dtype):
    """The batch on ``device``, hidden rows in ``hidden_dtype``; fp8 rows kept by the loader
    (``*_scale`` beside them) are dequantized here, on the device."""
    if batch is None:
        return None
    moved = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    for name in ("aux_hidden", "last_hidden"):
        scale = moved.pop(shards.SCALE_TENSORS[name], None)
        if scale is not None:
            values = moved[name]
            flat = shards.dequantize_rows(values.flatten(0, 1), scale.flatten(0, 1), hidden_dtype)
            moved[name] = flat.view(*values.shape)
        else:
            moved[name] = moved[name].to(hidden_dtype)
    return moved


class DeviceBatches:
    """Iterate (step, epoch, batch on the device or None, the batch's tokens) over a StepStream.

    On a GPU, ``prefetch()`` (called by the step once its backward pass is queued) takes the
    next batch from the stream and starts its copy to the device, and its fp8 dequantisation,
    on a stream of its own: the copy (4.5 ms of a 4,096-token Kimi-shaped step on an H200,
    benchmarks/train_step_anatomy.py) then runs beside the step's clipping and optimizer instead
    of before its next forward pass. The step waits for the copy on the device, not the host.
    On a CPU ``prefetch()`` takes the next batch as well, and moves it at once. When nothing
    was prefetched, the batch is moved as the step begins."""

    _END = object()  # prefetch() found the stream ended

    def __init__(self, stream, device: torch.device, hidden_dtype: torch.dtype):
        self.batches = iter(stream)
        self.device, self.hidden_dtype = device, hidden_dtype
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.upcoming = None  # (step, epoch, host batch, device batch, copied event or None) or _END

    def prefetch(self) -> None:
        if self.upcoming is not None:
            return
        item = next(self.batches, None)
        if item is None:
            self.upcoming = self._END
            return
        step, epoch, batch = item
        if self.copy_stream is None:
            self.upcoming = (step, epoch, batch, to_device(batch, self.device, self.hidden_dtype), None)
            return
        # Allocated now, with the step's backward pass queued: the allocator has the step's
        # activations back, so the next batch does not add to the step's peak. Its buffers
        # belong to the copy stream and are marked below for the stream of the step that reads them.
        with torch.cuda.stream(self.copy_stream):
            moved = to_device(batch, self.device, self.hidden_dtype)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        self.upcoming = (step, epoch, batch, moved, copied)

    def __iter__(self):
        return self

    def __next__(self):
        upcoming, self.upcoming = self.upcoming, None
        if upcoming is self._END:
            raise StopIteration
        if upcoming is None:
            step, epoch, batch = next(self.batches)
            moved = to_device(batch, self.device, self.hidden_dtype)
        else:
            step, epoch, batch, moved, copied = upcoming
            if copied is not None and moved is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(copied)
                for value in moved.values():
                    if torch.is_tensor(value):  # the batch's host entries (its ``samples``) stay as they are
                        value.record_stream(current)
        return step, epoch, moved, float(batch["tokens"]) if batch is not None else 0.0
