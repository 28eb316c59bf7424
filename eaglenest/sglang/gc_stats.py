"""How long Python's garbage collector holds an SGLang process, written to a file.

A sampling profiler (py-spy) sees the frame that allocated when a collection started, not
the collection, so a scheduler whose step is slower than its server's ceiling cannot tell
from a profile whether the collector is part of the gap. With ``EAGLENEST_GC_STATS`` set to
a folder, every process that loads the eaglenest plugin (the HTTP process and each scheduler)
counts its collections through ``gc.callbacks`` (two clock reads each) and appends a line
to ``<folder>/gc-<pid>.jsonl`` every few seconds from a thread of its own, the totals so far:

    {"time" (epoch s), "pid", "role" (the process title SGLang set), "wall_s" (since the
     plugin loaded), "thresholds", "frozen" (objects gc.freeze() moved out of reach),
     "generations": {"0": {"collections", "seconds", "max_s", "collected"}, "1": ..., "2": ...},
     "seconds", "fraction" (of wall_s)}

``summarize`` turns two lines of each file into the share of a time window (a load, not the
model's loading) that each process spent collecting. Nothing is changed in how it collects.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from pathlib import Path

GC_STATS_ENV = "EAGLENEST_GC_STATS"


class CollectorClock:
    """Time spent in each generation's collections, from gc.callbacks' start/stop pairs."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.loaded = clock()
        self._started: float | None = None
        self.generations = {g: {"collections": 0, "seconds": 0.0, "max_s": 0.0, "collected": 0} for g in (0, 1, 2)}

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self.clock()
            return
        if self._started is None:  # installed mid-collection
            return
        seconds = self.clock() - self._started
        self._started = None
        entry = self.generations[info.get("generation", 2)]
        entry["collections"] += 1
        entry["seconds"] += seconds
        entry["max_s"] = max(entry["max_s"], seconds)
        entry["collected"] += info.get("collected", 0)

    def snapshot(self) -> dict:
        wall = self.clock() - self.loaded
        seconds = sum(entry["seconds"] for entry in self.generations.values())
        return {
            "time": round(time.time(), 3),
            "pid": os.getpid(),
            "role": process_title(),
            "wall_s": round(wall, 3),
            "thresholds": list(gc.get_threshold()),
            "frozen": gc.get_freeze_count(),
            "generations": {str(g): {**entry, "seconds": round(entry["seconds"], 6), "max_s": round(entry["max_s"], 6)}
                            for g, entry in self.generations.items()},
            "seconds": round(seconds, 6),
            "fraction": round(seconds / wall, 6) if wall > 0 else 0.0,
        }


def process_title() -> str:
    """The title SGLang gave this process (setproctitle rewrites the command line)."""
    try:
        raw = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        raw = b""
    return raw.split(b"\0")[0].decode(errors="replace").strip() or "python"


def write_snapshot(clock: CollectorClock, folder: Path) -> Path:
    path = folder / f"gc-{os.getpid()}.jsonl"
    with open(path, "a") as out:  # one short line per write: a reader sees whole lines or none
        out.write(json.dumps(clock.snapshot()) + "\n")
    return path


def start(folder: str | os.PathLike, every_s: float = 5.0) -> CollectorClock:
    """Count this process's collections and write them to ``folder`` every ``every_s`` seconds."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    clock = CollectorClock()
    gc.callbacks.append(clock.callback)

    def keep_writing() -> None:
        while True:
            time.sleep(every_s)
            try:
                write_snapshot(clock, folder)
            except OSError:
                return  # the folder went away: the measurement is over

    threading.Thread(target=keep_writing, name="eaglenest-gc-stats", daemon=True).start()
    return clock


def start_from_env(environ=os.environ) -> CollectorClock | None:
    folder = environ.get(GC_STATS_ENV)
    return start(folder) if folder else None


def read_snapshots(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def summarize(folder: str | os.PathLike, since: float | None = None, until: float | None = None) -> list[dict]:
    """One row per process in ``folder``: its time in the collector between the first
    snapshot at or after ``since`` and the last at or before ``until`` (epoch seconds)."""
    rows = []
    for path in sorted(Path(folder).glob("gc-*.jsonl")):
        snapshots = [s for s in read_snapshots(path)
                     if (since is None or s["time"] >= since) and (until is None or s["time"] <= until)]
        if len(snapshots) < 2:
            continue
        first, last = snapshots[0], snapshots[-1]
        wall = last["wall_s"] - first["wall_s"]
        per_gen = {g: {k: last["generations"][g][k] - first["generations"][g][k] for k in ("collections", "seconds")}
                   for g in ("0", "1", "2")}
        seconds = last["seconds"] - first["seconds"]
        gen2 = per_gen["2"]
        rows.append({
            "role": last["role"], "pid": last["pid"], "window_s": round(wall, 3),
            "gc_seconds": round(seconds, 6), "gc_fraction": round(seconds / wall, 6) if wall > 0 else 0.0,
            "collections": [per_gen[g]["collections"] for g in ("0", "1", "2")],
            "collections_per_s": [round(per_gen[g]["collections"] / wall, 2) if wall > 0 else 0.0 for g in ("0", "1", "2")],
            "gen2_mean_ms": round(1000 * gen2["seconds"] / gen2["collections"], 3) if gen2["collections"] else 0.0,
            "max_ms_since_load": round(1000 * max(last["generations"][g]["max_s"] for g in ("0", "1", "2")), 3),
            "thresholds": last["thresholds"], "frozen": last["frozen"],
        })
    return rows
