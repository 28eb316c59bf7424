"""The elementwise part of one loss chunk (eaglenest.training.draft_loss.soft_ce_chunk: the soft
cross-entropy, the top-1 hits and the gradient of a [rows, draft vocab] block of logits), alone:
eagerly, compiled as train.compile compiled it before (one dot product over the whole block),
and compiled as it compiles it now (row by row, draft_loss.soft_ce_chunk_per_row).

Each variant's time a call, and its bandwidth at the least traffic a chunk needs (read the bf16
logits and target logits, write the bf16 gradient: 6 bytes a value); each compiled variant
against the eager one: the same hits, the loss and the gradient within rounding. A training step
calls the chunk (its positions / train.loss_chunk_rows, rounded up) times for each TTT step.

    python benchmarks/loss_chunk.py --out benchmarks/results/loss_chunk_h200.json
    python benchmarks/loss_chunk.py --device cpu --shape 64x300 --out /tmp/loss_chunk.json   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest.training import draft_loss  # noqa: E402

# rows x draft vocabulary: a chunk of the SmolLM2 goal's step (8 x 4,096 tokens in chunks of
# 8,192 rows, vocabulary 8,192), of the SmolLM2 real run's (32,000), and a Kimi-shaped 1 x 4,096 step.
GPU_SHAPES = ["8192x8192", "8192x32000", "4096x32000"]
VARIANTS = {
    "eager": lambda: draft_loss.soft_ce_chunk,
    "compiled, one dot product (before)": lambda: torch.compile(draft_loss.soft_ce_chunk, dynamic=True),
    "compiled, row by row (now)": lambda: torch.compile(draft_loss.soft_ce_chunk_per_row, dynamic=True),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(chunk, inputs, device: torch.device, warmup: int, calls: int) -> float:
    """Seconds a call, after ``warmup`` calls."""
    for _ in range(warmup):
        chunk(*inputs, True)
    synchronize(device)
    began = time.perf_counter()
    for _ in range(calls):
        chunk(*inputs, True)
    synchronize(device)
    return (time.perf_counter() - began) / calls


def measure(shape: str, device: torch.device, warmup: int, calls: int) -> dict:
    rows, vocab = (int(n) for n in shape.split("x"))
    generator = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=generator, device=device) * 3).to(torch.bfloat16)
    target = (torch.randn(rows, vocab, generator=generator, device=device) * 3).to(torch.bfloat16)
    target_ids = target.float().argmax(-1)
    inputs = (logits, target, target_ids)
    reference = draft_loss.soft_ce_chunk(*inputs, True)
    result = {"rows": rows, "vocab": vocab, "variants": {}}
    least_bytes = 6 * rows * vocab
    for name, make in VARIANTS.items():
        chunk = make()
        synchronize(device)
        began = time.perf_counter()
        total, hits, grad = chunk(*inputs, True)  # a compiled variant compiles here
        synchronize(device)
        first_call = time.perf_counter() - began
        seconds = time_calls(chunk, inputs, device, warmup, calls)
        result["variants"][name] = {
            "ms_per_call": seconds * 1e3, "first_call_s": first_call,
            "gb_per_s_at_least_traffic": least_bytes / seconds / 1e9,
            "same_hits": int(hits) == int(reference[1]),
            "loss_rel_diff": abs(float(total) - float(reference[0])) / abs(float(reference[0])),
            "grad_max_abs_diff": float((grad.float() - reference[2].float()).abs().max()),
        }
    eager = result["variants"]["eager"]["ms_per_call"]
    for run in result["variants"].values():
        run["speedup_over_eager"] = eager / run["ms_per_call"]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--shape", action="append", help="ROWSxVOCAB, repeatable (default: three GPU chunks)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    shapes = args.shape or GPU_SHAPES
    report = {
        "command": " ".join(["benchmarks/loss_chunk.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": {"platform": platform.platform(), "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "results": [],
    }
    print(f"{'rows x vocab':>14} {'variant':<36} {'ms/call':>9} {'GB/s':>7} {'x eager':>8} {'first s':>8} "
          f"{'hits':>5} {'loss rel':>9} {'grad diff':>9}")
    for shape in shapes:
        result = measure(shape, device, args.warmup, args.calls)
        report["results"].append(result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # each shape as soon as it is measured
        for name, run in result["variants"].items():
            print(f"{shape:>14} {name:<36} {run['ms_per_call']:9.3f} {run['gb_per_s_at_least_traffic']:7.0f} "
                  f"{run['speedup_over_eager']:8.2f} {run['first_call_s']:8.1f} {str(run['same_hits']):>5} "
                  f"{run['loss_rel_diff']:9.1e} {run['grad_max_abs_diff']:9.1e}", flush=True)


if __name__ == "__main__":
    main()
