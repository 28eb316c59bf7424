"""The collector's time in a server process: counted from gc.callbacks, written as lines,
summed over a window."""

import gc
import json
import os
import subprocess
import sys

from eaglenest.sglang import gc_stats


def test_clock_counts_real_collections_by_generation():
    clock = gc_stats.CollectorClock()
    gc.callbacks.append(clock.callback)
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        gc.callbacks.remove(clock.callback)
    gens = clock.generations
    assert gens[0]["collections"] >= 1 and gens[2]["collections"] >= 2
    assert gens[2]["seconds"] > 0 and gens[2]["max_s"] <= gens[2]["seconds"]
    snapshot = clock.snapshot()
    assert snapshot["pid"] == os.getpid() and snapshot["thresholds"] == list(gc.get_threshold())
    assert snapshot["seconds"] >= gens[2]["seconds"] - 1e-6
    assert 0 < snapshot["fraction"] < 1


def test_a_stop_without_its_start_is_ignored():
    clock = gc_stats.CollectorClock()
    clock.callback("stop", {"generation": 2, "collected": 5})
    assert clock.generations[2]["collections"] == 0


def test_summary_is_the_difference_over_the_window(tmp_path):
    ticks = iter([0.0, 1.0, 1.002, 10.0, 11.0, 11.5, 20.0])  # loaded, start, stop, snapshot, start, stop, snapshot
    clock = gc_stats.CollectorClock(clock=lambda: next(ticks))
    clock.callback("start", {"generation": 2})
    clock.callback("stop", {"generation": 2, "collected": 3})
    first = clock.snapshot() | {"time": 100.0}
    clock.callback("start", {"generation": 2})
    clock.callback("stop", {"generation": 2, "collected": 1})
    last = clock.snapshot() | {"time": 110.0}
    (tmp_path / "gc-1.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(last) + "\n{\"time\": 12")  # a torn last line
    whole, = gc_stats.summarize(tmp_path)
    assert whole["collections"] == [0, 0, 1] and abs(whole["gc_seconds"] - 0.5) < 1e-9
    assert abs(whole["gc_fraction"] - 0.05) < 1e-6 and whole["gen2_mean_ms"] == 500.0
    assert gc_stats.summarize(tmp_path, since=105.0) == []  # one snapshot in the window: no rate


def test_a_process_with_the_variable_writes_its_lines(tmp_path):
    """A real interpreter started as the plugin starts it; its file grows while it runs."""
    code = ("import gc, time; from eaglenest.sglang import gc_stats; gc_stats.start(%r, every_s=0.2)\n"
            "end = time.time() + 1.2\n"
            "while time.time() < end:\n"
            "    junk = [[[] for _ in range(50)] for _ in range(200)]\n") % str(tmp_path)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": os.getcwd()})
    path, = tmp_path.glob("gc-*.jsonl")
    snapshots = gc_stats.read_snapshots(path)
    assert len(snapshots) >= 3
    assert snapshots[-1]["generations"]["0"]["collections"] > snapshots[0]["generations"]["0"]["collections"]
    row, = gc_stats.summarize(tmp_path)
    assert row["collections"][0] > 0 and row["role"]


def test_without_the_variable_nothing_starts():
    assert gc_stats.start_from_env({}) is None
