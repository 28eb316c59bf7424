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

Header metadata: one safetensors ``__metadata__`` entry, ``"eaglenest"``, holding a JSON
object with sorted keys (one entry, because safetensors writes several in a random order
and shard files must be bitwise reproducible): format="eaglenest-shard", format_version,
kind, shard_id, sample_ids, token_counts,
checksums (sha256 of each tensor's raw bytes), and for hidden shards target,
target_hidden_size, layer_ids, dtype. Layer ids are in HF convention:
hidden_states[i] of a transformers forward is the input of decoder layer i.
"""

from __future__ import annotations

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

from eaglenest import atomic

FORMAT = "eaglenest-shard"
FORMAT_VERSION = 1
PREPARED_TENSORS = ("input_ids", "loss_mask", "offsets")
HIDDEN_TENSORS = PREPARED_TENSORS + ("aux_hidden", "last_hidden")
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAFETENSORS_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1}
# Bytes per token besides the hidden states: int32 id + uint8 mask.
TOKEN_OVERHEAD_BYTES = 5
HASH_CHUNK = 16 << 20


class ShardError(Exception):
    """A shard file is missing, unreadable, inconsistent or corrupt."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.safetensors"


def hidden_bytes_per_token(hidden_size: int, num_aux_layers: int, dtype: str) -> int:
    """Bytes one token costs in a hidden shard (aux + last hidden state, ids, mask)."""
    element = torch.empty((), dtype=STORAGE_DTYPES[dtype]).element_size()
    return (num_aux_layers + 1) * hidden_size * element + TOKEN_OVERHEAD_BYTES


def _tensor_sha256(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).hexdigest()


METADATA_KEY = "eaglenest"


def _encode_metadata(meta: Mapping) -> dict[str, str]:
    return {METADATA_KEY: json.dumps(dict(meta), sort_keys=True, separators=(",", ":"))}


def _write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: Mapping) -> None:
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    header = dict(meta)
    header.update(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        checksums={name: _tensor_sha256(tensor) for name, tensor in tensors.items()},
    )
    atomic.write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata=_encode_metadata(header)))


def _offsets(token_counts: list[int]) -> torch.Tensor:
    offsets = torch.zeros(len(token_counts) + 1, dtype=torch.int64)
    if token_counts:
        offsets[1:] = torch.cumsum(torch.tensor(token_counts, dtype=torch.int64), 0)
    return offsets


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


def write_hidden_shard(
    path: str | os.PathLike,
    prepared: "ShardReader",
    aux_hidden: torch.Tensor,
    last_hidden: torch.Tensor,
    meta: Mapping,
) -> None:
    """Write the hidden shard for ``prepared``: its ids/mask/offsets plus the captured states."""
    header = {k: v for k, v in prepared.metadata.items() if k not in ("kind", "checksums", "format", "format_version")}
    header.update(meta)
    header["kind"] = "hidden"
    tensors = {name: prepared.tensor(name) for name in PREPARED_TENSORS}
    tensors["aux_hidden"] = aux_hidden
    tensors["last_hidden"] = last_hidden
    _write(path, tensors, header)


def read_header(path: str | os.PathLike) -> tuple[dict, dict]:
    """Parse the safetensors header only: (tensor infos, decoded metadata). Reads no tensor data."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ShardError(path, "file shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, 512 << 20):
                raise ShardError(path, "header length points past the end of the file (truncated?)")
            header = json.loads(handle.read(header_len))
    except FileNotFoundError:
        raise ShardError(path, "missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ShardError(path, "header is not valid JSON") from None
    raw_meta = header.pop("__metadata__", None) or {}
    try:
        meta = json.loads(raw_meta[METADATA_KEY])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise ShardError(path, "not an eaglenest shard (no eaglenest metadata)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ShardError(path, "not an eaglenest shard (format key missing)")
    data_len = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + header_len + data_len != size:
        raise ShardError(path, f"size {size} != header + data {8 + header_len + data_len} (truncated or padded)")
    for info in header.values():
        info["file_offset"] = 8 + header_len + info["data_offsets"][0]
    return header, meta


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


def verify_shard(path: str | os.PathLike, deep: bool = True, expect: Mapping | None = None) -> ShardReader:
    """Check a shard and return a reader, or raise ShardError saying what is wrong.

    Shallow: header, format version, expected tensors and their shapes, sizes, and the
    ``expect`` metadata (e.g. target, layer_ids, dtype). Deep: also every tensor's sha256,
    offsets consistent with token counts, and all hidden values finite.
    """
    reader = ShardReader.open(path)
    meta, infos = reader.metadata, reader.infos
    if meta.get("format_version") != FORMAT_VERSION:
        raise ShardError(path, f"format_version {meta.get('format_version')} != {FORMAT_VERSION}")
    names = HIDDEN_TENSORS if meta.get("kind") == "hidden" else PREPARED_TENSORS
    missing = [name for name in names if name not in infos]
    if missing:
        raise ShardError(path, f"missing tensors {missing}")
    for key, value in (expect or {}).items():
        if meta.get(key) != value:
            raise ShardError(path, f"header {key}={meta.get(key)!r}, expected {value!r}")
    counts = meta.get("token_counts", [])
    total = sum(counts)
    if len(counts) != len(meta.get("sample_ids", [])):
        raise ShardError(path, "token_counts and sample_ids differ in length")
    shapes = {"input_ids": [total], "loss_mask": [total], "offsets": [len(counts) + 1]}
    if meta.get("kind") == "hidden":
        hidden = meta["target_hidden_size"]
        shapes["aux_hidden"] = [total, len(meta["layer_ids"]) * hidden]
        shapes["last_hidden"] = [total, hidden]
    for name, shape in shapes.items():
        info = infos[name]
        if info["shape"] != shape:
            raise ShardError(path, f"{name} shape {info['shape']} != {shape}")
        nbytes = math.prod(info["shape"]) * SAFETENSORS_DTYPE_BYTES.get(info["dtype"], 0)
        if info["data_offsets"][1] - info["data_offsets"][0] != nbytes:
            raise ShardError(path, f"{name} byte range does not match its shape and dtype")
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
    if tensors["offsets"].tolist() != _offsets(counts).tolist():
        raise ShardError(path, "offsets do not match token_counts")
    for name in ("aux_hidden", "last_hidden"):
        if name in tensors and not bool(torch.isfinite(tensors[name]).all()):
            raise ShardError(path, f"{name} has non-finite values")
    return reader
