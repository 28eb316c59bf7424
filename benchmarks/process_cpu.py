"""The cores each part of a regeneration keeps busy, from /proc: SGLang's processes (HTTP,
scheduler, detokenizer), the workflow's clients, a ceiling's client; the busiest thread of
each, and how long it waited for a core (benchmarks/sglang_regenerate.py ``cpu``)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path


def cpu_role(cmdline: list[str]) -> str | None:
    """Which part of a regeneration a process is, from its command line (SGLang's scheduler
    and detokenizer rename themselves ``sglang::...``); None for anything else."""
    from eaglenest.node.recon.processes import is_snakemake

    text = " ".join(cmdline)
    if cmdline and cmdline[0].startswith("sglang::"):
        return re.sub(r"_TP\d+.*$", "", cmdline[0].split()[0])
    if "sglang.launch_server" in text:
        return "sglang HTTP server + tokenizer manager"
    if "sglang_regenerate.py ceiling" in text:
        return "ceiling client"
    if "regenerate" in text and ".snakemake/scripts" in text:
        return "regenerate jobs (the workflow's clients)"
    if "eaglenest.sglang.launch" in text:
        return "eaglenest launcher"
    if is_snakemake(cmdline):
        return "snakemake"
    return None


def _cpu_ticks(proc: Path, pid: int) -> tuple[int, dict[int, tuple[int, str, int]]]:
    """(the process's user+system clock ticks, {thread id: (its ticks, its name, the
    nanoseconds it has waited runnable for a core)})."""
    def ticks(stat_path: Path) -> int:
        fields = stat_path.read_text().rsplit(")", 1)[-1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)

    def waited_ns(task: Path) -> int:
        try:  # schedstat: time on a CPU, time waiting on a run queue, time slices (ns, ns, count)
            return int((task / "schedstat").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    threads = {}
    for task in (proc / str(pid) / "task").iterdir():
        try:
            threads[int(task.name)] = (ticks(task / "stat"), (task / "comm").read_text().strip(), waited_ns(task))
        except (OSError, ValueError, IndexError):
            continue
    return ticks(proc / str(pid) / "stat"), threads


def sample_cpu(seconds: float, proc: Path = Path("/proc")) -> dict:
    """Cores each part of a regeneration keeps busy over ``seconds`` (from /proc), with the
    busiest thread of each part: a part whose busiest thread nears one core is held by its
    Python main thread, whatever the machine's other cores do. ``busiest_thread_waiting``: the
    share of the time that thread was runnable but waited for a core (``schedstat``), so a
    thread slowed by the machine's other threads shows apart from one with too much to do."""
    from eaglenest.node.recon.processes import list_processes

    def snapshot() -> dict:
        processes, found = list_processes(str(proc)), {}
        for pid, info in processes.items():
            role = cpu_role(info["cmdline"])
            parent = info["ppid"]
            while role is None and parent in processes:  # a worker SGLang spawned, unnamed
                parent_role = cpu_role(processes[parent]["cmdline"])
                if parent_role and parent_role.startswith("sglang"):
                    role = "sglang (other processes)"
                parent = processes[parent]["ppid"]
            if role is None:
                continue
            try:
                found[pid] = (role, *_cpu_ticks(proc, pid))
            except (OSError, ValueError, IndexError):
                continue
        return found

    def machine_busy_ticks() -> tuple[int, int]:
        fields = [int(value) for value in (proc / "stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4], sum(fields)  # all but idle and iowait, all

    ticks_per_s = os.sysconf("SC_CLK_TCK")
    busy_before, total_before = machine_busy_ticks()
    before, started = snapshot(), time.monotonic()
    time.sleep(seconds)
    after, elapsed = snapshot(), time.monotonic() - started
    busy_after, total_after = machine_busy_ticks()
    groups: dict[str, dict] = {}
    for pid, (role, total, threads) in after.items():
        _, total_then, threads_then = before.get(pid, (role, 0, {}))
        group = groups.setdefault(role, {"role": role, "processes": 0, "cores": 0.0, "busiest_thread_cores": 0.0,
                                         "busiest_thread": None, "busiest_thread_waiting": 0.0})
        group["processes"] += 1
        group["cores"] += (total - total_then) / ticks_per_s / elapsed
        for tid, (thread_ticks, name, waited) in threads.items():
            ticks_then, _, waited_then = threads_then.get(tid, (0, name, 0))
            cores = (thread_ticks - ticks_then) / ticks_per_s / elapsed
            if cores > group["busiest_thread_cores"]:
                group["busiest_thread_cores"], group["busiest_thread"] = cores, name
                group["busiest_thread_waiting"] = (waited - waited_then) / 1e9 / elapsed
    rows = sorted(groups.values(), key=lambda group: -group["cores"])
    for row in rows:
        for key in ("cores", "busiest_thread_cores", "busiest_thread_waiting"):
            row[key] = round(row[key], 2)
    cpus = os.cpu_count() or 1
    return {"seconds": round(elapsed, 1), "machine_cpus": cpus,
            "machine_busy_cores": round(cpus * (busy_after - busy_before) / max(1, total_after - total_before), 2),
            "parts": rows}


def sglang_processes(proc: Path = Path("/proc")) -> dict[str, int]:
    """{role: pid} of the SGLang server's own processes running now (HTTP, scheduler,
    detokenizer; ``cpu_role``'s names), the first of each role."""
    from eaglenest.node.recon.processes import list_processes

    found: dict[str, int] = {}
    for pid, info in sorted(list_processes(str(proc)).items()):
        role = cpu_role(info["cmdline"])
        if role and role.startswith("sglang"):
            found.setdefault(role, pid)
    return found
