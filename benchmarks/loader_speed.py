"""How fast the training loader assembles a step's batch (eaglenest.training.batches.RowReader.batch):
random shards of a target's shape in a temporary directory (/dev/shm where it exists), the rows
of one epoch's steps packed and padded to the token budget as a GPU run pads them, in page-locked
memory where a GPU is visible (as the training loop makes them), timed batch by batch.

``--baseline DIR`` times another checkout's loader in the same run, step for step beside this
one's, and checks that both give the same batches: DIR/eaglenest/training/batches.py (in older
checkouts eaglenest/stages/loader.py) is loaded as a module of its own (the rest of eaglenest is
this checkout's).

    python benchmarks/loader_speed.py --out benchmarks/results/loader_speed_cpu.json
    python benchmarks/loader_speed.py --baseline <checkout of another commit> --out ...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import train_throughput  # noqa: E402
from eaglenest.training.batches import Dataset, RowReader, epoch_steps, open_split  # noqa: E402


def load_loader(checkout: Path):
    """Another checkout's training loader as a module of its own: eaglenest/training/batches.py,
    or eaglenest/stages/loader.py where the checkout predates eaglenest/training/."""
    name = "baseline_loader"
    path = checkout / "eaglenest" / "training" / "batches.py"
    if not path.exists():
        path = checkout / "eaglenest" / "stages" / "loader.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def make_dataset(root: Path, shape_name: str, args) -> Dataset:
    out, expect = train_throughput.write_consolidated(root, train_throughput.shape_of(shape_name, args), args)
    return open_split(out / "index.json", out / "split.json", "train", expect)


def same_batch(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(
        torch.equal(first[k], second[k]) if torch.is_tensor(first[k]) else first[k] == second[k] for k in first)


def measure(shape_name: str, args, workdir: Path, baseline) -> dict:
    dataset = make_dataset(workdir / shape_name, shape_name, args)
    steps = epoch_steps(dataset, args.token_budget, args.rows, seed=0, epoch=0)
    pin = torch.cuda.is_available()
    keep_fp8 = pin  # as the training loop reads fp8 shards for a GPU
    readers = {"eaglenest": RowReader(dataset, keep_fp8=keep_fp8)}
    if baseline is not None:
        readers["baseline"] = baseline.RowReader(dataset, keep_fp8=keep_fp8)
    seconds = {name: [] for name in readers}
    same = True
    for _ in range(args.repeats):
        for rows in steps:
            batches = {}
            for name, reader in readers.items():  # alternating, so both see the same cache and load
                began = time.perf_counter()
                batches[name] = reader.batch(rows, args.token_budget, args.rows, pin)
                seconds[name].append(time.perf_counter() - began)
            if baseline is not None:
                same = same and same_batch(batches["eaglenest"], batches["baseline"])
    tokens = args.rows * args.token_budget
    warm = len(steps)  # the first pass over the epoch touches the shards' pages first
    result = {"shape": shape_name, "rows": args.rows, "token_budget": args.token_budget, "sample_len": args.sample_len,
              "hidden_dtype": args.hidden_dtype, "pinned": pin, "batches_timed": len(seconds["eaglenest"][warm:]),
              "batch_bytes": sum(v.numel() * v.element_size() for v in batches["eaglenest"].values() if torch.is_tensor(v))}
    for name, times in seconds.items():
        median = statistics.median(times[warm:] or times)
        result[name] = {"median_ms": median * 1e3, "tokens_per_s": tokens / median}
    if baseline is not None:
        result["same_batches"] = same
        result["baseline_over_eaglenest"] = result["baseline"]["median_ms"] / result["eaglenest"]["median_ms"]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=sorted(train_throughput.SHAPES), help="repeatable; default smollm2")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--sample-len", type=int, default=1000, help="a sample's tokens (rows end in padding)")
    parser.add_argument("--hidden-dtype", choices=["bfloat16", "float8_e4m3"], default="bfloat16")
    parser.add_argument("--draft-vocab", type=int, help="the draft vocabulary (default: the shape's)")
    parser.add_argument("--steps", type=int, default=4, help="batches in the epoch")
    parser.add_argument("--samples-per-shard", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4, help="passes over the epoch; the first is not counted")
    parser.add_argument("--baseline", type=Path, help="another checkout, timed in the same run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    baseline = load_loader(args.baseline) if args.baseline else None
    report = {
        "command": " ".join(["benchmarks/loader_speed.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": {"platform": platform.platform(), "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
                 "cpus": os.cpu_count()},
        "results": [],
    }
    scratch = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=scratch) as workdir:
        for shape_name in args.shape or ["smollm2"]:
            result = measure(shape_name, args, Path(workdir), baseline)
            report["results"].append(result)
            line = (f"{shape_name}: {result['rows']} x {result['token_budget']} tokens, {result['batch_bytes'] / 1e6:.0f} MB "
                    f"a batch: eaglenest {result['eaglenest']['median_ms']:.1f} ms "
                    f"({result['eaglenest']['tokens_per_s']:,.0f} tokens/s)")
            if baseline is not None:
                line += (f", baseline {result['baseline']['median_ms']:.1f} ms: {result['baseline_over_eaglenest']:.2f}x, "
                         f"same batches: {result['same_batches']}")
            print(line, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
