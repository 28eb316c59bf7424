"""GPU slot pool: which GPU of the node a job runs on.

Snakemake counts ``gpu`` resources (``--resources gpu=8`` runs at most 8 GPU jobs at
once) but never says which device a job should use, so eight jobs would all land on
GPU 0. Each job therefore takes a slot: an exclusive ``flock`` on one lock file per
device (``gpu-<id>.lock`` in a node-wide directory), held for the job's lifetime, and
runs with ``CUDA_VISIBLE_DEVICES`` set to the ids it holds. The kernel drops a flock
when its holder dies, SIGKILL and OOM kills included, so a killed job never leaves a
GPU marked busy; no lock file is ever deleted, which keeps the scheme free of races.

Device ids are strings as ``CUDA_VISIBLE_DEVICES`` takes them ("0", "3", or a UUID).
The pool is the parent's ``CUDA_VISIBLE_DEVICES`` when set (a scheduler's allocation),
else every GPU the driver lists. Pick a slot before anything initializes CUDA: the
CUDA runtime reads ``CUDA_VISIBLE_DEVICES`` once, at its first call.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

LOCK_DIR_ENV = "EAGLENEST_GPU_LOCK_DIR"


class NoFreeSlotError(TimeoutError):
    """No slot became free within the timeout."""


def default_lock_dir() -> Path:
    """Node-wide, so that two workflow runs on one node share the pool.

    Inside a Slurm allocation the pool is that allocation's: Slurm renumbers the GPUs
    it hands each job from 0, so two allocations' "GPU 0" are different devices.
    """
    if os.environ.get(LOCK_DIR_ENV):
        return Path(os.environ[LOCK_DIR_ENV])
    slurm_job = os.environ.get("SLURM_JOB_ID")
    name = f"eaglenest-gpu-slots-slurm-{slurm_job}" if slurm_job else "eaglenest-gpu-slots"
    return Path(tempfile.gettempdir()) / name


def node_devices() -> list[str]:
    """Device ids of this node without initializing CUDA in this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return [str(i) for i in range(len(list(proc.iterdir())))]
    try:
        listing = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


@dataclass
class Slots:
    """GPU slots held by this process until :meth:`release` (or its death)."""

    devices: list[str]
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(self.devices)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the last descriptor drops the flock
        self._fds.clear()


def _lock_path(lock_dir: Path, device: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in device)
    return lock_dir / f"gpu-{safe}.lock"


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    # Who holds it, for a person reading the lock directory; the flock is what counts.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(), 0)
    return fd


def acquire(
    count: int = 1,
    devices: list[str] | None = None,
    lock_dir: str | os.PathLike | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.2,
) -> Slots:
    """Hold ``count`` free devices of ``devices`` (default: :func:`node_devices`).

    Waits until enough are free at once. A partial set is given back before waiting,
    so two jobs that each need two GPUs never deadlock holding one each.
    """
    devices = list(devices) if devices is not None else node_devices()
    if count < 1:
        raise ValueError("count must be >= 1")
    if count > len(devices):
        raise ValueError(f"asked for {count} GPU slot(s) but the pool has {len(devices)}: {devices}")
    lock_dir = Path(lock_dir) if lock_dir is not None else default_lock_dir()
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        held = Slots([])
        for device in devices:
            fd = _try_lock(_lock_path(lock_dir, device))
            if fd is not None:
                held.devices.append(device)
                held._fds.append(fd)
                if len(held.devices) == count:
                    return held
        held.release()
        if deadline is not None and time.monotonic() >= deadline:
            raise NoFreeSlotError(f"no {count} free GPU slot(s) among {devices} in {lock_dir} after {timeout_s} s")
        time.sleep(poll_s)


@contextlib.contextmanager
def gpu_slots(count: int = 1, devices: list[str] | None = None, lock_dir=None, timeout_s: float | None = None) -> Iterator[Slots]:
    """Hold slots and export them as ``CUDA_VISIBLE_DEVICES`` for the block."""
    slots = acquire(count, devices, lock_dir, timeout_s)
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = slots.cuda_visible_devices
    try:
        yield slots
    finally:
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous
        slots.release()


def job_slots(count: int, in_process: bool):
    """A job's slots when it runs its model in process; none for a client of a server (which holds them)."""
    return gpu_slots(count) if count > 0 and in_process else contextlib.nullcontext()


def main(argv: list[str] | None = None) -> int:
    """``python -m eaglenest.node.gpu_slots [--gpus N] [--devices 0,1] -- command ...``: run a command on held slots."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--devices", default=None, help="comma-separated pool (default: this node's GPUs)")
    parser.add_argument("--lock-dir", default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    devices = args.devices.split(",") if args.devices else None
    with gpu_slots(args.gpus, devices, args.lock_dir, args.timeout):
        return subprocess.run(command).returncode


if __name__ == "__main__":
    raise SystemExit(main())
