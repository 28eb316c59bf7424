"""How long `eaglenest recon` takes on a run directory of many finished shards (header mode).

    python benchmarks/recon_speed.py --shards 10000 --out benchmarks/results/recon_speed.json

Builds a run with N small hidden shards (real headers written by eaglenest.formats.shards, a few
tokens each), then times the whole command in a fresh process, three times, and prints the
table. Goal: under 2 s for 10,000 shards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def build(workdir: Path, shards_count: int) -> Path:
    from eaglenest import plan
    from eaglenest.formats import shards

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["run"] = "recon-speed"
    config["data"].update(max_conversations=shards_count, samples_per_shard=1)
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    (workdir / "config").mkdir()
    (workdir / "config" / "config.yaml").write_text((REPO / "config" / "config.yaml").read_text())
    (workdir / "config" / "schema.yaml").write_text((REPO / "config" / "schema.yaml").read_text())
    prepared_dir = workdir / "results" / "recon-speed" / "prepared" / plan.prepared_key(config)
    hidden_dir = workdir / "results" / "recon-speed" / "hidden"
    hidden = config["target"]["hidden_size"]
    meta = {"target": config["target"]["name"], "target_hidden_size": hidden, "layer_ids": plan.layer_ids(config), "dtype": "bfloat16"}
    for shard_id in range(shards_count):
        name = shards.shard_name(shard_id)
        rows = [{"sample_id": f"s:{shard_id}", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}]
        shards.write_prepared_shard(prepared_dir / name, shard_id, rows, {"target": meta["target"]})
        prepared = shards.ShardReader.open(prepared_dir / name)
        shards.write_hidden_shard(hidden_dir / name, prepared, torch.zeros(4, 3 * hidden, dtype=torch.bfloat16),
                                  torch.zeros(4, hidden, dtype=torch.bfloat16), meta)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="recon-speed-") as tmp:
        workdir = Path(tmp)
        started = time.perf_counter()
        configfile = build(workdir, args.shards)
        built_s = time.perf_counter() - started
        walls = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            result = subprocess.run(
                [sys.executable, "-m", "eaglenest.cli", "recon", "--json", "--configfile", str(configfile)],
                cwd=workdir, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            walls.append(time.perf_counter() - began)
        report = json.loads(result.stdout)
    workflow = report.get("sections", report).get("workflow", {}) if isinstance(report, dict) else {}
    row = {
        "shards": args.shards,
        "recon_wall_s_median": round(statistics.median(walls), 3),
        "recon_wall_s_all": [round(w, 3) for w in walls],
        "build_s": round(built_s, 1),
        "workflow_summary": workflow.get("summary"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, torch {torch.__version__}",
        "load_average": os.getloadavg(),
    }
    print(f"{'shards':>8} {'recon wall (median)':>20} {'runs':>24}")
    print(f"{row['shards']:>8} {row['recon_wall_s_median']:>19.2f}s {str(row['recon_wall_s_all']):>24}")
    print(f"workflow section: {row['workflow_summary']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
