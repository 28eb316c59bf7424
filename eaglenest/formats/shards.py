"""The shard file format: the one place that writes, reads and verifies shard files.

Two kinds of shard, both single safetensors files written atomically:

``prepared`` (results/<run>/prepared/shard-NNNNN.safetensors)
    input_ids  int32 [T]     token ids of all samples, concatenated
    loss_mask  uint8 [T]     1 on assistant tokens (what the drafter learns)
    offsets    int64 [n+1]   sample i is rows offsets[i]:offsets[i+1]

``hidden`` (results/<run>/hidden/shard-NNNNN.safetensors): the above, plus
    aux_hidden  [T, A*H]  inputs of the aux decoder layers, concatenated in layer_ids order
    last_hidden [T, H]    the target's final post-norm hidden state
    (dtype from the ``dtype`` header, bfloat16 by default)

    With ``dtype: float8_e4m3`` (opt-in, half the bytes) the two are stored as e4m3 with
    one float32 scale per row and layer, value = e4m3 * scale (see :func:`quantize_rows`):
    aux_hidden_scale  float32 [T, A]
    last_hidden_scale float32 [T, 1]
    Readers call :func:`dequantize` (or :meth:`ShardReader.hidden_tensors`) and never
    see the difference.

Header parsing and the shallow (header-only) check live in eaglenest/formats/shard_header.py,
which needs no torch; this module re-exports them. Header metadata: one safetensors
``__metadata__`` entry, ``"eaglenest"``, holding a JSON
object with sorted keys (one entry, because safetensors writes several in a random order
and shard files must be bitwise reproducible): format="eaglenest-shard", format_version,
kind, shard_id, sample_ids, token_counts,
checksums (sha256 of each tensor's raw bytes), and for hidden shards target,
target_hidden_size, layer_ids, dtype. Layer ids are in HF convention:
hidden_states[i] of a transformers forward is the input of decoder layer i.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglenest import plan
from eaglenest.formats import atomic
from eaglenest.layout import shard_name  # noqa: F401  (shards are named by the results layout)
from eaglenest.formats.shard_header import (  # noqa: F401  (the header API is part of this module's)
    FORMAT,
    FORMAT_VERSION,
    FP8_DTYPE,
    HIDDEN_TENSORS,
    METADATA_KEY,
    PREPARED_TENSORS,
    SAFETENSORS_DTYPE_BYTES,
    SCALE_TENSORS,
    ShardError,
    read_header,
    verify_header,
)

STORAGE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3": torch.float8_e4m3fn,
}
# Largest finite e4m3fn value: a row's absolute maximum maps to it.
FP8_MAX = 448.0
SAFETENSORS_DTYPE_NAMES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
    torch.int64: "I64", torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
}
HASH_CHUNK = 16 << 20


def hidden_bytes_per_token(hidden_size: int, num_aux_layers: int, dtype: str) -> int:
    """Bytes one token costs in a hidden shard (aux + last hidden state, scales, ids, mask).

    The planner (eaglenest.plan) owns the arithmetic so that `snakemake -n` can count
    bytes without torch; the shard writers and the disk preflight use the same numbers.
    """
    return plan.bytes_per_token(hidden_size, num_aux_layers, dtype)


# Rows a CPU quantises at a time (benchmarks: 2x the whole answer at once, one thread).
CPU_QUANTIZE_ROWS = 128


def quantize_rows(rows: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, G*H] -> (e4m3 [T, G*H], float32 scales [T, G]): one scale per row and group.

    A group is one layer's hidden state: layers differ in magnitude by orders, so a
    shared scale would crush the small ones. Works on any device; all arithmetic is
    float32, so a rerun on the same device gives the same bytes.
    """
    tokens, width = rows.shape
    if rows.device.type == "cpu" and tokens > CPU_QUANTIZE_ROWS:
        # On a CPU the float32 temporaries of a whole answer spill the caches: row blocks that
        # stay in them quantise twice as fast (a server's rows, converted by its client), and
        # every row's bytes are the same.
        parts = [quantize_rows(rows[start:start + CPU_QUANTIZE_ROWS], groups) for start in range(0, tokens, CPU_QUANTIZE_ROWS)]
        return torch.cat([q for q, _ in parts]), torch.cat([scale for _, scale in parts])
    grouped = rows.reshape(tokens, groups, width // groups).float()
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    # An all-zero row keeps scale 1 (any value decodes to 0); never divide by zero.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (grouped / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.reshape(tokens, width), scale.reshape(tokens, groups)


def dequantize_rows(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: e4m3 * scale, in ``dtype``."""
    tokens, width = quantized.shape
    groups = scale.shape[-1]
    values = quantized.reshape(tokens, groups, width // groups).float() * scale.float().reshape(tokens, groups, 1)
    return values.reshape(tokens, width).to(dtype)


def dequantize(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Tensors of (rows of) a hidden shard with aux/last hidden as plain floating point.

    A no-op for bf16/fp16/fp32 shards; for fp8 shards it folds the scales in and drops
    them. Every reader of hidden states goes through this (or ShardReader.hidden_tensors).
    """
    out = dict(tensors)
    for name, scale_name in SCALE_TENSORS.items():
        if scale_name in out:
            out[name] = dequantize_rows(out[name], out.pop(scale_name), dtype)
    return out


def tensor_sha256(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).hexdigest()


def _encode_metadata(meta: Mapping) -> dict[str, str]:
    return {METADATA_KEY: json.dumps(dict(meta), sort_keys=True, separators=(",", ":"))}


def _write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: Mapping) -> None:
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    header = dict(meta)
    header.update(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        checksums={name: tensor_sha256(tensor) for name, tensor in tensors.items()},
    )
    atomic.write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata=_encode_metadata(header)))


def _offsets(token_counts: list[int]) -> torch.Tensor:
    offsets = torch.zeros(len(token_counts) + 1, dtype=torch.int64)
    if token_counts:
        offsets[1:] = torch.cumsum(torch.tensor(token_counts, dtype=torch.int64), 0)
    return offsets


# Header key of a prepared shard: samples its prepare job truncated to max_len or dropped.
PREPARE_COUNTS_KEY = "prepare_counts"


def write_prepared_shard(
    path: str | os.PathLike,
    shard_id: int,
    samples: list[dict],
    meta: Mapping,
) -> None:
    """``samples``: dicts with sample_id, input_ids (list[int]), loss_mask (list[int])."""
    counts = [len(s["input_ids"]) for s in samples]
    flat_ids = [t for s in samples for t in s["input_ids"]]
    flat_mask = [m for s in samples for m in s["loss_mask"]]
    tensors = {
        "input_ids": torch.tensor(flat_ids, dtype=torch.int32),
        "loss_mask": torch.tensor(flat_mask, dtype=torch.uint8),
        "offsets": _offsets(counts),
    }
    header = dict(meta)
    header.update(
        kind="prepared",
        shard_id=shard_id,
        sample_ids=[s["sample_id"] for s in samples],
        token_counts=counts,
        loss_token_counts=[int(sum(s["loss_mask"])) for s in samples],
    )
    _write(path, tensors, header)


def _hidden_header(prepared: "ShardReader", meta: Mapping) -> dict:
    # prepare's counts describe the prepare job, not the states: hidden shards stay the same
    # bytes whether their prepared shard carries them or not.
    skipped = ("kind", "checksums", "format", "format_version", PREPARE_COUNTS_KEY)
    header = {k: v for k, v in prepared.metadata.items() if k not in skipped}
    header.update(meta)
    header["kind"] = "hidden"
    return header


def write_hidden_shard(
    path: str | os.PathLike,
    prepared: "ShardReader",
    aux_hidden: torch.Tensor,
    last_hidden: torch.Tensor,
    meta: Mapping,
    aux_hidden_scale: torch.Tensor | None = None,
    last_hidden_scale: torch.Tensor | None = None,
) -> None:
    """Write the hidden shard for ``prepared``: its ids/mask/offsets plus the captured states.

    fp8 shards (``meta["dtype"] == "float8_e4m3"``) pass e4m3 tensors and their scales.
    """
    header = _hidden_header(prepared, meta)
    tensors = {name: prepared.tensor(name) for name in PREPARED_TENSORS}
    tensors["aux_hidden"] = aux_hidden
    tensors["last_hidden"] = last_hidden
    if (header.get("dtype") == FP8_DTYPE) != (aux_hidden_scale is not None and last_hidden_scale is not None):
        raise ValueError("scales go with dtype float8_e4m3, and only with it")
    if aux_hidden_scale is not None:
        tensors["aux_hidden_scale"] = aux_hidden_scale
        tensors["last_hidden_scale"] = last_hidden_scale
    _write(path, tensors, header)


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing these pages to disk now (Linux), without waiting.

    Otherwise a large shard sits in the page cache until the final fsync, and the whole
    disk write happens after the last forward instead of alongside the forwards.
    """
    function = _sync_file_range()
    if function is not None and length:
        function(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; a failure only costs overlap


def _data_order(dtypes: Mapping[str, torch.dtype]) -> list[str]:
    """The order in which safetensors lays tensors out, asked of safetensors itself.

    It sorts by dtype, then name, independent of shapes: one-element stand-ins show it.
    """
    from safetensors.torch import save

    raw = save({name: torch.zeros(1, dtype=dtype) for name, dtype in dtypes.items()})
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda name: header[name]["data_offsets"][0])


class HiddenShardWriter:
    """Write a hidden shard while its rows are still being computed (the fast extract path).

    The file is byte-identical to :func:`write_hidden_shard` for the same tensors (a test
    holds this): the layout is safetensors', the header is written last, once the per-tensor
    sha256 sums are known (they have a fixed length, so the header's size is known from the
    start). Rows must arrive in token order. Disk writes and each tensor's hashing run on
    their own threads, so a write never waits for a hash and neither waits for the caller;
    :meth:`append_rows` returns futures that complete when the caller's buffers may be
    reused. Written to a temp name and published atomically by :meth:`close`.
    """

    def __init__(self, path, prepared: "ShardReader", meta: Mapping):
        from concurrent.futures import ThreadPoolExecutor

        self.path = Path(path)
        self.header = _hidden_header(prepared, meta)
        hidden = self.header["target_hidden_size"]
        aux_groups = len(self.header["layer_ids"])
        total = prepared.num_tokens
        storage = STORAGE_DTYPES[self.header["dtype"]]
        prepared_tensors = {name: prepared.tensor(name).contiguous() for name in PREPARED_TENSORS}
        specs = {name: (t.dtype, list(t.shape)) for name, t in prepared_tensors.items()}
        specs["aux_hidden"] = (storage, [total, aux_groups * hidden])
        specs["last_hidden"] = (storage, [total, hidden])
        self.row_tensors = ["aux_hidden", "last_hidden"]
        if self.header["dtype"] == FP8_DTYPE:
            specs["aux_hidden_scale"] = (torch.float32, [total, aux_groups])
            specs["last_hidden_scale"] = (torch.float32, [total, 1])
            self.row_tensors += ["aux_hidden_scale", "last_hidden_scale"]
        self.infos, start = {}, 0
        for name in _data_order({name: spec[0] for name, spec in specs.items()}):
            dtype, shape = specs[name]
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self.infos[name] = {"dtype": SAFETENSORS_DTYPE_NAMES[dtype], "shape": shape, "data_offsets": [start, start + nbytes]}
            start += nbytes
        self.row_bytes = {name: self.infos[name]["data_offsets"][1] - self.infos[name]["data_offsets"][0] for name in self.row_tensors}
        self.rows_written = 0
        self.total_rows = total
        self._digests = {name: hashlib.sha256() for name in specs}
        self._header_len = len(self._header_bytes())
        self._atomic = atomic.atomic_path(self.path)
        tmp = self._atomic.__enter__()
        self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        # One writer and one hasher per tensor: each stays sequential within its own file
        # region and checksum, and none waits for another.
        self._disk = {name: ThreadPoolExecutor(1, thread_name_prefix=f"shard-disk-{name}") for name in specs}
        self._hashers = {name: ThreadPoolExecutor(1, thread_name_prefix=f"shard-hash-{name}") for name in specs}
        self._pending = []
        self._finished = False
        try:
            os.pwrite(self._fd, b"\0" * (8 + self._header_len), 0)
            for name, tensor in prepared_tensors.items():
                self._submit(name, tensor, 0)
        except BaseException as exc:
            self.abort(exc)
            raise

    def _header_bytes(self) -> bytes:
        header = dict(self.header)
        header.update(
            format=FORMAT,
            format_version=FORMAT_VERSION,
            checksums={name: digest.hexdigest() for name, digest in self._digests.items()},
        )
        # safetensors' own encoding: metadata first, then tensors in data order, no spaces,
        # padded with spaces to a multiple of 8 bytes.
        body = {"__metadata__": _encode_metadata(header)}
        body.update(self.infos)
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        return text + b" " * (-len(text) % 8)

    def _submit(self, name: str, tensor: torch.Tensor, first_byte: int, ready=None) -> list:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        offset = 8 + self._header_len + self.infos[name]["data_offsets"][0] + first_byte

        def write():
            if ready is not None:
                ready()
            view = memoryview(raw)
            done = 0
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
            _start_writeback(self._fd, offset, len(view))

        def digest():
            if ready is not None:
                ready()
            self._digests[name].update(memoryview(raw))

        futures = [self._disk[name].submit(write), self._hashers[name].submit(digest)]
        self._pending.extend(futures)
        return futures

    def append_rows(self, rows: Mapping[str, torch.Tensor], ready=None) -> list:
        """Queue the next rows (CPU tensors: aux_hidden, last_hidden [+ their scales]).

        ``ready``, if given, is called on the writer threads before the bytes are read
        (e.g. to wait for an asynchronous device-to-host copy into ``rows``).
        """
        self._raise_failures()
        count = rows["aux_hidden"].shape[0]
        if self.rows_written + count > self.total_rows:
            raise ValueError(f"{self.path}: more rows than the shard's {self.total_rows} tokens")
        futures = []
        for name in self.row_tensors:
            per_row = self.row_bytes[name] // self.total_rows
            futures += self._submit(name, rows[name], self.rows_written * per_row, ready)
        self.rows_written += count
        return futures

    def _raise_failures(self) -> None:
        still_running = []
        for future in self._pending:
            if not future.done():
                still_running.append(future)
            elif future.exception() is not None:
                raise future.exception()
        self._pending = still_running

    def _shutdown(self) -> None:
        for executor in (*self._disk.values(), *self._hashers.values()):
            executor.shutdown(wait=True)

    def close(self) -> None:
        """Wait for all writes, write the header, fsync and publish the file."""
        try:
            self._shutdown()
            self._raise_failures()
            if self.rows_written != self.total_rows:
                raise ValueError(f"{self.path}: {self.rows_written} rows written, the shard has {self.total_rows}")
            header = self._header_bytes()
            if len(header) != self._header_len:
                raise AssertionError("shard header changed size while streaming")
            os.pwrite(self._fd, struct.pack("<Q", len(header)) + header, 0)
            os.close(self._fd)
            self._fd = None
        except BaseException as exc:
            self.abort(exc)
            raise
        self._finished = True
        self._atomic.__exit__(None, None, None)

    def abort(self, exc: BaseException | None = None) -> None:
        """Remove the partial file. An ENOSPC ``exc`` comes back as atomic.DiskFullError."""
        if self._finished:
            return
        self._finished = True
        self._shutdown()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        error = exc if exc is not None else RuntimeError("shard write aborted")
        self._atomic.__exit__(type(error), error, error.__traceback__)


@dataclass
class ShardReader:
    """Lazy, memory-mapped access to one shard; tensors are read on demand."""

    path: Path
    infos: dict
    metadata: dict

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ShardReader":
        infos, meta = read_header(path)
        return cls(Path(path), infos, meta)

    @property
    def kind(self) -> str:
        return self.metadata["kind"]

    @property
    def sample_ids(self) -> list[str]:
        return self.metadata["sample_ids"]

    @property
    def token_counts(self) -> list[int]:
        return self.metadata["token_counts"]

    @property
    def num_tokens(self) -> int:
        return sum(self.token_counts)

    def tensor(self, name: str) -> torch.Tensor:
        with safe_open(self.path, framework="pt") as handle:
            return handle.get_tensor(name)

    def tensors(self, names=None) -> dict[str, torch.Tensor]:
        with safe_open(self.path, framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in (names or handle.keys())}

    def hidden_tensors(self, start: int = 0, stop: int | None = None, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Rows [start, stop) of aux_hidden and last_hidden as floating point, whatever the storage dtype."""
        names = [n for n in ("aux_hidden", "last_hidden", *SCALE_TENSORS.values()) if n in self.infos]
        with safe_open(self.path, framework="pt") as handle:
            rows = {name: handle.get_slice(name)[start:stop] for name in names}
        out = dequantize(rows, dtype)
        return {name: out[name].to(dtype) for name in ("aux_hidden", "last_hidden")}


class RowSource:
    """Row slices of one shard through a handle kept open (memory-mapped) for many reads.

    Hidden rows come back as floating point whatever the storage dtype: fp8 rows are
    dequantized with their per-row scales, so readers never see the storage format. With
    ``keep_fp8`` they come back as stored, with their scales beside them (``*_scale``), for a
    reader that dequantizes on the GPU (:func:`dequantize` there gives the same values).
    """

    def __init__(self, path: str | os.PathLike, hidden_dtype: torch.dtype = torch.bfloat16, keep_fp8: bool = False):
        self.path = Path(path)
        self.hidden_dtype = hidden_dtype
        self.keep_fp8 = keep_fp8
        self._handle = safe_open(self.path, framework="pt")
        self._names = set(self._handle.keys())

    def rows(self, names, start: int, stop: int) -> dict[str, torch.Tensor]:
        wanted = list(names) + [SCALE_TENSORS[n] for n in names if SCALE_TENSORS.get(n) in self._names]
        out = {name: self._handle.get_slice(name)[start:stop] for name in wanted}
        if self.keep_fp8 or len(wanted) == len(names):
            return out
        return dequantize(out, self.hidden_dtype)


def verify_shard(path: str | os.PathLike, deep: bool = True, expect: Mapping | None = None) -> ShardReader:
    """Check a shard and return a reader, or raise ShardError saying what is wrong.

    Shallow: header, format version, expected tensors and their shapes, sizes, and the
    ``expect`` metadata (e.g. target, layer_ids, dtype). Deep: also every tensor's sha256,
    offsets consistent with token counts, and all hidden values finite.
    """
    infos, meta = verify_header(path, expect)
    reader = ShardReader(Path(path), infos, meta)
    names = HIDDEN_TENSORS if meta.get("kind") == "hidden" else PREPARED_TENSORS
    if meta.get("kind") == "hidden" and meta.get("dtype") == FP8_DTYPE:
        names = names + tuple(SCALE_TENSORS.values())
    if not deep:
        return reader
    checksums = meta.get("checksums", {})
    with open(path, "rb") as handle:
        for name in names:
            info = infos[name]
            handle.seek(info["file_offset"])
            remaining = info["data_offsets"][1] - info["data_offsets"][0]
            digest = hashlib.sha256()
            while remaining:
                chunk = handle.read(min(HASH_CHUNK, remaining))
                if not chunk:
                    raise ShardError(path, f"{name} truncated")
                digest.update(chunk)
                remaining -= len(chunk)
            if digest.hexdigest() != checksums.get(name):
                raise ShardError(path, f"checksum mismatch in {name} (file corrupted)")
    tensors = reader.tensors()
    if tensors["offsets"].tolist() != _offsets(meta.get("token_counts", [])).tolist():
        raise ShardError(path, "offsets do not match token_counts")
    for name in ("aux_hidden", "last_hidden", *SCALE_TENSORS.values()):
        if name in tensors and not all_finite(tensors[name]):
            raise ShardError(path, f"{name} has non-finite values")
    return reader


def all_finite(tensor: torch.Tensor, rows_per_chunk: int = 65536) -> bool:
    """True when no value is NaN or infinite, in bounded memory (row chunks).

    e4m3fn has no infinity and one NaN pattern per sign (0x7F, 0xFF): checked on the raw
    bytes, since widening a multi-GB fp8 shard to float32 costs 4x its size and minutes.
    """
    for start in range(0, max(tensor.shape[0], 1), rows_per_chunk):
        chunk = tensor[start:start + rows_per_chunk]
        if chunk.dtype == torch.float8_e4m3fn:
            # One counting pass over the bytes: 3x faster than masking and comparing.
            byte_counts = torch.bincount(chunk.reshape(-1).view(torch.uint8), minlength=256)
            if int(byte_counts[0x7F]) or int(byte_counts[0xFF]):
                return False
        elif chunk.numel():
            # NaN and infinities reach the extremes: one reduction pass, 8x faster than
            # isfinite over every value for bf16 on a CPU.
            low, high = torch.aminmax(chunk)
            if not bool(torch.isfinite(low) & torch.isfinite(high)):
                return False
    return True
