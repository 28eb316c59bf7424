"""CPU smoke of the training benchmark: both steps run, the table and the JSON carry the ratio."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_train_throughput_times_eaglenest_and_the_eager_ceiling_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--shape", "smollm2", "--device", "cpu",
         "--ttt-length", "2", "--token-budget", "128", "--sample-len", "128", "--rows", "1", "--steps", "2",
         "--warmup", "1", "--threads", "1", "--samples-per-shard", "1", "--ceiling", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [("ceiling" in r.get("step", "")) for r in runs] == [False, True], runs
    assert all(r["tokens_per_s"] > 0 and "error" not in r for r in runs)
    assert runs[1]["eaglenest_over_ceiling"] > 0
    assert "x ceiling" in result.stdout
