"""Where training runs: the device, the processes (one, or one per GPU under torchrun with
DDP) and starting them.

Under torchrun each process reads its rank from the environment and joins the process group
(NCCL on GPUs, gloo on CPUs). A rank's loss is scaled so that DDP's gradient average equals
the single-process gradient of the same global batch (eaglenest.training.loop).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from eaglenest.formats import atomic

log = logging.getLogger(__name__)


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={name!r} but no CUDA device is visible")
    return torch.device(name)


@dataclass(frozen=True)
class Processes:
    """This process's place among the training processes, and its device."""

    rank: int
    local_rank: int
    world_size: int
    distributed: bool
    device: torch.device


def join_processes(device_name: str) -> Processes:
    """This process's rank and device; under torchrun (WORLD_SIZE > 1) it joins the process group."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if distributed and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world_size = dist.get_world_size() if distributed else 1
    return Processes(rank, local_rank, world_size, distributed, device)


def run_under_torchrun(module: str, arguments: dict, processes: int) -> None:
    """Run ``python -m module <arguments file>`` in ``processes`` processes under torchrun; the
    arguments (but the log stream) are written to launch.json in ``arguments["checkpoint_dir"]``."""
    checkpoint_dir = Path(arguments["checkpoint_dir"])
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    args_file = checkpoint_dir / "launch.json"
    atomic.write_json(args_file, {k: v for k, v in arguments.items() if k != "log_stream"})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", module, str(args_file)]
    log.info("launching %s", " ".join(command))
    stream = arguments.get("log_stream")
    result = subprocess.run(command, stdout=stream or None, stderr=subprocess.STDOUT if stream else None)
    if result.returncode != 0:
        raise RuntimeError(f"torchrun exited with {result.returncode}; see the log above")
