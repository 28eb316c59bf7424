"""py-spy on a server's processes while a load runs, and where each thread's time went.

``record`` starts ``py-spy record`` (raw collapsed stacks, every thread, idle samples kept,
without pausing the target) on each process for some seconds; ``finish`` waits for them and
summarizes each file: per thread its share of the samples, its heaviest leaf frames (where the
time is spent) and its heaviest frames counted inclusively (each frame once per sample,
wherever it is on the stack: a function with its callees, e.g. SGLang's
``process_batch_result`` and what it calls). Nothing is recorded where py-spy is not
installed (on a node without a package index it comes with envs/workflow-node-wheels.txt,
as a binary in the install's ``bin/``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path


def py_spy() -> str | None:
    """py-spy's path: on PATH, beside this Python (a virtual environment's ``bin/``), or in the
    ``bin/`` of a ``--target`` install on the Python path."""
    found = shutil.which("py-spy")
    if found:
        return found
    places = [Path(sys.executable).parent] + [Path(entry or ".") / "bin" for entry in sys.path]
    for place in places:
        candidate = place / "py-spy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def record(processes: dict[str, int], seconds: float, out_dir: Path, rate: int = 250) -> list:
    """py-spy on each ``{role: pid}`` for ``seconds``: [(role, raw file, py-spy process)];
    empty when py-spy is not installed."""
    spy = py_spy()
    if spy is None:
        print("py-spy not found: no profile of the server's processes", file=sys.stderr)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    running = []
    for role, pid in processes.items():
        path = out_dir / (re.sub(r"[^A-Za-z0-9._-]+", "-", role) + ".txt")  # e.g. sglang-scheduler.txt
        command = [spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
                   "--format", "raw", "--threads", "--idle", "--nonblocking", "--output", str(path)]
        running.append((role, path, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    return running


def summarize(path: Path, top: int = 20) -> dict:
    """A py-spy raw profile (``thread;frame;...;leaf count`` lines) per thread: its share of
    all samples, its ``top`` leaf frames and its ``top`` frames counted inclusively, each as a
    share of the thread's samples."""
    threads, leaves, inclusive, total = Counter(), {}, {}, 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread, count = frames[0], int(count)
        total += count
        threads[thread] += count
        leaves.setdefault(thread, Counter())[frames[-1]] += count
        for frame in set(frames[1:]):  # once per sample, however deep it recurses
            inclusive.setdefault(thread, Counter())[frame] += count
    return {"samples": total, "threads": [
        {"thread": thread, "share": round(samples / max(total, 1), 3),
         "top": [[frame, round(n / samples, 3)] for frame, n in leaves[thread].most_common(top)],
         "inclusive": [[frame, round(n / samples, 3)] for frame, n in inclusive.get(thread, Counter()).most_common(top)]}
        for thread, samples in threads.most_common(8)]}


def finish(running: list, timeout_s: float = 120) -> dict:
    """Wait for each py-spy and summarize its file: {role: summary or {"error": ...}}."""
    result = {}
    for role, path, process in running:
        try:
            _, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            err = b"timed out"
        result[role] = summarize(path) if path.exists() else {"error": err.decode(errors="replace")[-500:]}
    return result
