"""Crash-safe file writes: temp name in the same directory, fsync, os.replace.

A reader never sees a half-written file. A killed writer leaves only a
``*.tmp-*`` file that :func:`remove_stale_temps` (called at the start of every
writer job) deletes. A full disk removes the partial file and raises
:class:`DiskFullError` with the path and the free space.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

TMP_MARKER = ".tmp-"


class DiskFullError(OSError):
    """Raised when a write hit ENOSPC; the partial file is already removed."""


def temp_path_for(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARKER}{os.getpid()}")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding ``path``: the disk a full-disk message names."""
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _is_enospc(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # safetensors reports I/O errors as its own exception type with the OS text.
    return "No space left on device" in str(exc) or "os error 28" in str(exc)


def umask() -> int:
    """The process's umask, read from /proc where it can be without setting it."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path next to ``path``; on success fsync it and rename it into place.

    The file gets the mode a plain ``open`` gives (0666 less the umask) whatever its writer
    chose: a file from safetensors 0.8.0's ``save_file`` is 0600 under any umask (measured), so
    shards, checkpoints and exports were unreadable to any other user of the node (a server run
    under its own account)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(final)
    try:
        yield tmp
        with contextlib.suppress(OSError):  # a filesystem without modes keeps the file as written
            os.chmod(tmp, 0o666 & ~umask())
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if _is_enospc(exc):
            free = shutil.disk_usage(final.parent).free
            raise DiskFullError(
                errno.ENOSPC,
                f"disk full while writing {final} ({free:,} bytes free on the filesystem "
                f"mounted at {mount_point(final.parent)}); the partial file was removed. Free space, then rerun.",
            ) from exc
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_with(path: str | os.PathLike, writer: Callable[[Path], None]) -> None:
    """Call ``writer(tmp_path)`` and atomically publish what it wrote."""
    with atomic_path(path) as tmp:
        writer(tmp)


def remove_stale_temps(directory: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Delete temp files left by killed writers; returns what was removed.

    With ``name``, only the temps of that one output: a job owns its output path, but
    other jobs write their own temps into the same directory at the same time.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for leftover in directory.glob(f"{name or '*'}{TMP_MARKER}*"):
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()
            removed.append(leftover)
    return removed
