"""Shard headers without torch: parse and check what a shard file says about itself.

Part of the shard format (eaglenest/formats/shards.py documents it and re-exports all of this).
Kept free of torch so that `eaglenest recon` checks 10,000 shard headers in well under two
seconds: importing torch alone takes about two.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Mapping

FORMAT = "eaglenest-shard"
FORMAT_VERSION = 1
PREPARED_TENSORS = ("input_ids", "loss_mask", "offsets")
HIDDEN_TENSORS = PREPARED_TENSORS + ("aux_hidden", "last_hidden")
FP8_DTYPE = "float8_e4m3"
SCALE_TENSORS = {"aux_hidden": "aux_hidden_scale", "last_hidden": "last_hidden_scale"}
SAFETENSORS_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1, "F8_E4M3": 1}
METADATA_KEY = "eaglenest"


class ShardError(Exception):
    """A shard file is missing, unreadable, inconsistent or corrupt."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


def read_safetensors_header(path: str | os.PathLike) -> tuple[int, dict, dict, int]:
    """Any safetensors file's header, read without its tensor data: (header length, tensor
    infos, raw ``__metadata__``, file size). Raises ShardError when it cannot be parsed."""
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
    return header_len, header, raw_meta, size


def check_data_size(path: str | os.PathLike, header_len: int, infos: dict, size: int) -> None:
    """The file holds exactly the bytes its header describes (else truncated or padded)."""
    data_len = max((info["data_offsets"][1] for info in infos.values()), default=0)
    if 8 + header_len + data_len != size:
        raise ShardError(Path(path), f"size {size} != header + data {8 + header_len + data_len} (truncated or padded)")


def read_header(path: str | os.PathLike) -> tuple[dict, dict]:
    """Parse the safetensors header only: (tensor infos, decoded metadata). Reads no tensor data."""
    path = Path(path)
    header_len, header, raw_meta, size = read_safetensors_header(path)
    try:
        meta = json.loads(raw_meta[METADATA_KEY])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise ShardError(path, "not an eaglenest shard (no eaglenest metadata)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ShardError(path, "not an eaglenest shard (format key missing)")
    check_data_size(path, header_len, header, size)
    for info in header.values():
        info["file_offset"] = 8 + header_len + info["data_offsets"][0]
    return header, meta


def verify_header(path: str | os.PathLike, expect: Mapping | None = None) -> tuple[dict, dict]:
    """The shallow check: header, format version, expected tensors, their shapes and byte
    ranges, and the ``expect`` metadata. Returns (tensor infos, metadata) or raises ShardError."""
    infos, meta = read_header(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ShardError(path, f"format_version {meta.get('format_version')} != {FORMAT_VERSION}")
    names = HIDDEN_TENSORS if meta.get("kind") == "hidden" else PREPARED_TENSORS
    if meta.get("kind") == "hidden" and meta.get("dtype") == FP8_DTYPE:
        names = names + tuple(SCALE_TENSORS.values())
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
        if meta.get("dtype") == FP8_DTYPE:
            shapes["aux_hidden_scale"] = [total, len(meta["layer_ids"])]
            shapes["last_hidden_scale"] = [total, 1]
    for name, shape in shapes.items():
        info = infos[name]
        if info["shape"] != shape:
            raise ShardError(path, f"{name} shape {info['shape']} != {shape}")
        nbytes = math.prod(info["shape"]) * SAFETENSORS_DTYPE_BYTES.get(info["dtype"], 0)
        if info["data_offsets"][1] - info["data_offsets"][0] != nbytes:
            raise ShardError(path, f"{name} byte range does not match its shape and dtype")
    return infos, meta
