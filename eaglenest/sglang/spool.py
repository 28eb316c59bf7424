"""Spool files: how the patched SGLang server hands one request's hidden states to its client.

One file per request, ``<spool_dir>/<rid>.safetensors``, in safetensors' layout (any
safetensors reader opens it):

- ``input_ids`` int64 ``[n]``: the prompt the server computed;
- either ``aux_hidden`` ``[n, A*H]`` and ``last_hidden`` ``[n, H]`` (sglang 0.5.23, the
  stand-in), or ``hidden`` ``[n, (A+1)*H]``, the aux layers and then the final post-norm
  state packed per row as sglang 0.5.14's logits processor stores them (the client splits it);
  for an fp8 run (0.5.14) ``hidden`` is uint8 ``[n, (A+1)*H + 4*(A+1)]``: each layer's e4m3
  row, then its float32 scales, quantised by the server (``patch.quantized_rows``; no
  ``finite`` then: the client checks the scales and the bytes);
- metadata ``rid`` and ``finite`` (``"1"`` when every value is finite, checked by the server
  where the rows already are, so the client does not read them twice; :func:`write_request`).

A file appears whole or not at all (temp name, then rename). A request whose rows could not
be written leaves ``<rid>.error`` (the reason, as text) instead, so that its client fails
with the reason instead of waiting. The server writes them on background threads
(:class:`SpoolWriter`) while its scheduler goes on; the client waits for each file
(:func:`wait_for_spooled`).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The safetensors dtype names of what a server or the stand-in may spool (uint8: rows the
# server quantised for an fp8 run, eaglenest.sglang.patch.quantized_rows).
_DTYPE_NAMES = {
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "int64": "I64", "int32": "I32", "uint8": "U8",
}
_RID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
ERROR_SUFFIX = ".error"


class SpoolError(RuntimeError):
    """A spool file is missing, late, unreadable, or the server reported it could not write it."""


def spool_path(spool_dir: str | os.PathLike, rid: str) -> Path:
    """The spool file of request ``rid``; request ids are file names, so they are checked."""
    if not isinstance(rid, str) or not _RID.match(rid):
        raise ValueError(f"request id {rid!r} is not usable as a spool file name ([A-Za-z0-9._-], 1-200 chars)")
    return Path(spool_dir) / f"{rid}.safetensors"


def error_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name.removesuffix(".safetensors") + ERROR_SUFFIX)


def _raw_bytes(tensor):
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def write_request(path: str | os.PathLike, tensors: dict, metadata: dict, ready=None) -> None:
    """One request's spool file, once ``ready`` (the device-to-host copy's event) has fired:
    its rows on the host, ``finite`` ("1" or "0") checked where they are, except for rows the
    server quantised (uint8), whose client checks the scales and bytes."""
    import torch

    from eaglenest.formats import shards

    if ready is not None:
        ready.synchronize()
    tensors = {name: tensor.detach().to("cpu") for name, tensor in tensors.items()}
    rows = [tensor for name, tensor in tensors.items() if name != "input_ids"]
    if not any(row.dtype == torch.uint8 for row in rows):
        metadata = {**metadata, "finite": "1" if all(shards.all_finite(row) for row in rows) else "0"}
    write_spool_file(path, tensors, metadata)


def write_spool_file(path: str | os.PathLike, tensors: dict, metadata: dict) -> None:
    """Write ``tensors`` (host tensors) as one safetensors file: temp name, then rename.

    The rows go from the caller's (pinned) memory to the file in one copy each: no
    serialised bytes object in between."""
    path = Path(path)
    infos, start, raws = {}, 0, []
    for name, tensor in tensors.items():
        raw = _raw_bytes(tensor)
        dtype = _DTYPE_NAMES[str(tensor.dtype).removeprefix("torch.")]
        infos[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [start, start + raw.nbytes]}
        start += raw.nbytes
        raws.append(raw)
    body = {"__metadata__": {key: str(value) for key, value in metadata.items()}, **infos}
    header = json.dumps(body, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(len(header).to_bytes(8, "little"))
        handle.write(header)
        for raw in raws:
            handle.write(memoryview(raw))
    os.replace(tmp, path)


def read_spool_file(path: str | os.PathLike) -> tuple[dict, dict]:
    """(tensors, metadata) of one spool file, each tensor read straight into its own memory."""
    import numpy
    import torch

    torch_dtypes = {name: getattr(torch, key) for key, name in _DTYPE_NAMES.items()}
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_len))
        metadata = header.pop("__metadata__", {}) or {}
        tensors = {}
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            first, last = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=torch_dtypes[info["dtype"]])
            raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else numpy.empty(0, numpy.uint8)
            handle.seek(8 + header_len + first)
            if handle.readinto(memoryview(raw)) != last - first:
                raise SpoolError(f"{path}: tensor {name} is cut short")
            tensors[name] = tensor
    return tensors, metadata


def wait_for_spooled(path: str | os.PathLike, timeout_s: float) -> Path:
    """Wait until the server has written ``path`` (or reported why it could not)."""
    path, failed = Path(path), error_path(path)
    deadline, pause = time.monotonic() + timeout_s, 0.0005
    while True:
        if path.exists():
            return path
        if failed.exists():
            reason = failed.read_text(errors="replace")
            failed.unlink(missing_ok=True)
            raise SpoolError(f"the server could not write {path.name}: {reason}")
        if time.monotonic() > deadline:
            raise SpoolError(f"{path} did not appear within {timeout_s:.0f} s of the server's answer")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


class SpoolWriter:
    """Background threads that write spool files once their rows have reached host memory.

    ``submit`` returns at once: the scheduler that calls it goes on with the next batch
    while the rows are copied (an asynchronous device-to-host copy whose ``ready`` event
    the job waits for), checked for non-finite values and written."""

    def __init__(self, threads: int = 4):
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="eaglenest-spool")
        self.lock = threading.Lock()
        self.pending = 0

    def submit(self, path: Path, tensors: dict, metadata: dict, ready=None):
        with self.lock:
            self.pending += 1
        return self.pool.submit(self._write, Path(path), tensors, dict(metadata), ready)

    def _write(self, path: Path, tensors: dict, metadata: dict, ready) -> None:
        try:
            write_request(path, tensors, metadata, ready)
        except BaseException as exc:  # the client must learn it, not wait for a file
            try:
                error_path(path).write_text(f"{type(exc).__name__}: {exc}")
            except OSError:
                pass
            raise
        finally:
            with self.lock:
                self.pending -= 1

    def flush(self) -> None:
        """Wait for every submitted file (tests, shutdown)."""
        while True:
            with self.lock:
                if self.pending == 0:
                    return
            time.sleep(0.001)
