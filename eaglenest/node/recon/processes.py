"""The processes of the machine (from /proc): which are ours, which are Snakemake, its locks."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import time
from pathlib import Path

from eaglenest.node.recon.status import BLOCK, OK, WARN
from eaglenest.node.recon.workflow import incomplete_markers


def read_proc_text(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read().decode(errors="replace")
    except OSError:
        return None


def _boot_time() -> float:
    for line in (read_proc_text("/proc/stat") or "").splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def list_processes(proc: str = "/proc") -> dict[int, dict]:
    """pid -> {cmdline, ppid, cwd, started} for every process this user may read."""
    ticks = os.sysconf("SC_CLK_TCK")
    boot = _boot_time()
    processes = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        pid = int(entry)
        raw = read_proc_text(f"{proc}/{pid}/cmdline")
        stat = read_proc_text(f"{proc}/{pid}/stat")
        if raw is None or stat is None:
            continue
        # Fields after the ")" that ends the command name: state ppid ... starttime (22nd).
        fields = stat.rsplit(")", 1)[-1].split()
        try:
            cwd = os.readlink(f"{proc}/{pid}/cwd")
        except OSError:
            cwd = None
        processes[pid] = {
            "pid": pid,
            "cmdline": [part for part in raw.split("\0") if part],
            "ppid": int(fields[1]) if len(fields) > 1 else 0,
            "cwd": cwd,
            "started": boot + int(fields[19]) / ticks if len(fields) > 19 else None,
        }
    return processes


def process_kind(cmdline: list[str] | str) -> str:
    """What a process is, from its command line (SGLang/vLLM workers rename themselves)."""
    text = (" ".join(cmdline) if isinstance(cmdline, list) else cmdline).lower()
    if "eaglenest" in text and ("sglang" in text or " serve" in text):
        return "eaglenest-sglang"
    if "sglang" in text:
        return "sglang"
    if "vllm" in text:
        return "vllm"
    if "eaglenest" in text and "train" in text or re.search(r"\.snakemake/scripts/\S*train", text):
        return "eaglenest-train"
    if "extract_shard" in text or "eaglenest" in text and "extract" in text:
        return "eaglenest-extract"
    if is_snakemake(cmdline if isinstance(cmdline, list) else shlex.split(cmdline)):
        return "snakemake"
    return "unknown"


KIND_LABELS = {
    "eaglenest-sglang": "patched SGLang (eaglenest)",
    "sglang": "plain SGLang",
    "vllm": "vLLM",
    "eaglenest-train": "eaglenest training",
    "eaglenest-extract": "eaglenest extraction",
    "snakemake": "Snakemake",
    "unknown": "unknown",
}


OURS = {"eaglenest-sglang", "eaglenest-train", "eaglenest-extract"}


def kind_with_parents(pid: int, processes: dict[int, dict]) -> str:
    """A process's kind; workers spawned by our SGLang launcher inherit its kind."""
    info = processes.get(pid)
    if info is None:
        return "unknown"
    kind = process_kind(info["cmdline"])
    seen, parent = {pid}, info["ppid"]
    while parent in processes and parent not in seen and kind in ("sglang", "unknown"):
        if process_kind(processes[parent]["cmdline"]) == "eaglenest-sglang":
            return "eaglenest-sglang"
        seen.add(parent)
        parent = processes[parent]["ppid"]
    return kind


def is_snakemake(cmdline: list[str]) -> bool:
    """The snakemake command itself, not the job scripts it runs from .snakemake/scripts."""
    names = [os.path.basename(part) for part in cmdline[:2]]
    if "snakemake" in names:
        return True
    return any(a == "-m" and b == "snakemake" for a, b in zip(cmdline, cmdline[1:]))


def snakemake_directory(info: dict) -> Path | None:
    """The working directory a snakemake process works on (--directory/-d, else its cwd)."""
    cmdline = info["cmdline"]
    for i, part in enumerate(cmdline):
        if part in ("--directory", "-d") and i + 1 < len(cmdline):
            value = Path(cmdline[i + 1])
            return value if value.is_absolute() or info["cwd"] is None else Path(info["cwd"]) / value
        if part.startswith("--directory="):
            value = Path(part.split("=", 1)[1])
            return value if value.is_absolute() or info["cwd"] is None else Path(info["cwd"]) / value
    return Path(info["cwd"]) if info["cwd"] else None


def describe_process(pid: int, processes: dict[int, dict]) -> dict:
    info = processes.get(pid, {})
    started = info.get("started")
    kind = kind_with_parents(pid, processes) if info else "unknown"
    return {
        "pid": pid,
        "kind": kind,
        "kind_label": KIND_LABELS[kind],
        "cmdline": " ".join(info.get("cmdline", [])) or None,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else None,
    }


def check_snakemake(workdir: Path, processes: dict[int, dict]) -> dict:
    locks_dir = workdir / ".snakemake" / "locks"
    locks = sorted(str(p.relative_to(workdir)) for p in locks_dir.glob("*.lock")) if locks_dir.is_dir() else []
    markers = incomplete_markers(workdir)
    resolved = workdir.resolve()
    alive = []
    for pid, info in processes.items():
        if pid == os.getpid() or not is_snakemake(info["cmdline"]):
            continue
        directory = snakemake_directory(info)
        with contextlib.suppress(OSError):
            if directory is not None and directory.resolve() == resolved:
                alive.append(describe_process(pid, processes))
    steps = []
    existing_marked = [m["path"] for m in markers if m["exists"]]
    if alive:
        status = BLOCK
        pids = ", ".join(str(p["pid"]) for p in alive)
        summary = f"snakemake alive on this directory (pid {pids}); {len(locks)} lock file(s)"
        steps.append({"command": None,
                      "why": f"snakemake pid {pids} is still running here: wait for it, or stop it with kill -INT {alive[0]['pid']}"})
    elif locks:
        status = BLOCK
        summary = f"{len(locks)} stale lock file(s), no snakemake process alive: --unlock is safe"
        steps.append({"command": "snakemake --unlock", "why": f"{len(locks)} stale lock(s), no snakemake process alive",
                      "safe_fix": locks})
    else:
        status = OK
        summary = "no locks"
    if markers:
        summary += f"; {len(markers)} incomplete marker(s)"
    if existing_marked:
        summary += f" ({len(existing_marked)} on existing files: --rerun-incomplete)"
        status = WARN if status == OK else status
    return {"status": status, "summary": summary, "locks": locks, "incomplete": markers,
            "rerun_incomplete": bool(existing_marked), "snakemake_alive": alive, "steps": steps}
