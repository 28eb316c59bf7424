"""The GPUs (nvidia-smi): who holds each, and whether the workflow can have them."""

from __future__ import annotations

import shutil
import subprocess
from typing import Callable

from eaglenest.node.recon.processes import describe_process, KIND_LABELS, OURS, process_kind
from eaglenest.node.recon.status import BLOCK, NA, OK, WARN


# A GPU holding more than this much memory counts as held by its process.
HELD_MEMORY_MIB = 1024
NVIDIA_SMI_GPU_QUERY = "index,uuid,name,memory.used,memory.total,utilization.gpu"
NVIDIA_SMI_APPS_QUERY = "gpu_uuid,pid,process_name,used_memory"


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]" (MIG, some drivers)


def parse_gpu_query(text: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-gpu=<NVIDIA_SMI_GPU_QUERY> --format=csv,noheader,nounits``."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 6:
            raise ValueError(f"unexpected nvidia-smi --query-gpu line: {line!r}")
        index, uuid, name, used, total, utilisation = fields
        gpus.append(
            {
                "index": int(index),
                "uuid": uuid,
                "name": name,
                "memory_used_mib": _number(used),
                "memory_total_mib": _number(total),
                "utilization_pct": _number(utilisation),
            }
        )
    return gpus


def parse_apps_query(text: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-compute-apps=<NVIDIA_SMI_APPS_QUERY> --format=csv,noheader,nounits``."""
    apps = []
    for line in text.splitlines():
        if not line.strip() or line.strip().lower().startswith("no running"):
            continue
        # The process name may itself hold commas; uuid, pid and memory do not.
        uuid, pid, rest = (part.strip() for part in line.split(",", 2))
        name, used = (part.strip() for part in rest.rsplit(",", 1))
        apps.append({"gpu_uuid": uuid, "pid": int(pid), "process_name": name, "used_memory_mib": _number(used)})
    return apps


def run_nvidia_smi(args: list[str]) -> str:
    result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    if result.returncode != 0:
        raise RuntimeError((result.stderr or result.stdout).strip() or f"nvidia-smi exited {result.returncode}")
    return result.stdout


def gpu_report(gpus: list[dict], apps: list[dict], processes: dict[int, dict], gpus_needed: bool) -> dict:
    """Per GPU: memory, utilisation, holders; flags idle holders and foreign processes."""
    by_uuid = {gpu["uuid"]: dict(gpu, processes=[], idle_holder=False) for gpu in gpus}
    holders: dict[int, dict] = {}
    for app in apps:
        gpu = by_uuid.get(app["gpu_uuid"])
        if gpu is None:
            continue
        described = describe_process(app["pid"], processes)
        if described["cmdline"] is None:
            described["cmdline"] = app["process_name"]
            described["kind"] = process_kind(app["process_name"])
            described["kind_label"] = KIND_LABELS[described["kind"]]
        gpu["processes"].append(dict(described, used_memory_mib=app["used_memory_mib"]))
        holder = holders.setdefault(app["pid"], dict(described, gpus=[], used_memory_mib=0.0))
        holder["gpus"].append(gpu["index"])
        holder["used_memory_mib"] += app["used_memory_mib"] or 0.0
    for gpu in by_uuid.values():
        used = gpu["memory_used_mib"] or 0
        gpu["idle_holder"] = used > HELD_MEMORY_MIB and gpu["utilization_pct"] == 0
    rows = sorted(by_uuid.values(), key=lambda g: g["index"])
    idle = [g["index"] for g in rows if g["idle_holder"]]
    foreign = [h for h in holders.values() if h["kind"] not in OURS and h["used_memory_mib"] > HELD_MEMORY_MIB]
    steps, status = [], OK
    for holder in foreign:
        what = f"{holder['kind_label']} on {len(holder['gpus'])} GPU(s), {holder['used_memory_mib'] / 1024:.1f} GiB"
        if gpus_needed:
            status = BLOCK
            steps.append({"command": f"kill {holder['pid']}", "why": f"stop pid {holder['pid']} ({what}): the GPUs are needed"})
        else:
            status = WARN if status == OK else status
    if idle and status == OK:
        status = WARN
    parts = [f"{len(rows)} GPU(s)"]
    if idle:
        parts.append(f"memory held at 0 % utilisation on GPU {','.join(map(str, idle))}")
    for holder in holders.values():
        parts.append(f"pid {holder['pid']} {holder['kind_label']} on GPU {','.join(map(str, holder['gpus']))}")
    if not holders:
        parts.append("no processes")
    return {
        "status": status,
        "summary": "; ".join(parts),
        "gpus": rows,
        "holders": list(holders.values()),
        "foreign_holders": [h["pid"] for h in foreign],
        "steps": steps,
    }


def check_gpus(processes: dict[int, dict], gpus_needed: bool, run: Callable[[list[str]], str] = run_nvidia_smi) -> dict:
    if shutil.which("nvidia-smi") is None and run is run_nvidia_smi:
        return {"status": NA, "summary": "no nvidia-smi on this machine: no GPU visible", "gpus": [], "steps": []}
    try:
        gpus = parse_gpu_query(run([f"--query-gpu={NVIDIA_SMI_GPU_QUERY}", "--format=csv,noheader,nounits"]))
        apps = parse_apps_query(run([f"--query-compute-apps={NVIDIA_SMI_APPS_QUERY}", "--format=csv,noheader,nounits"]))
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as err:
        return {"status": NA, "summary": f"nvidia-smi failed: {err}", "gpus": [], "steps": []}
    return gpu_report(gpus, apps, processes, gpus_needed)
