"""Replay one prompt at a time against prompts in lockstep (evaluate.replay_batch), on the
references of an evaluated run, and check every trace against that run's chunk files.

    python benchmarks/replay_speed.py RUN_EVALUATE_DIR DRAFTER OUT.json [--chunk 0] [--batches 1,32]
        [--sets mt_bench,humaneval] [--threads 1] [--device cpu]

For each eval set and each drafting setting the run replayed, runs chunk ``--chunk``'s
prompts once per batch size (float32, the run's references), times each pass, and compares
each prompt's cycles (accepted counts and draft depths) with the run's own traces and with
batch 1's. Prints a table; the JSON has every pass.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from eaglenest.model import replay, speculate
from eaglenest.stages import evaluate
from eaglenest.stages.prepare import prompt_ids

TARGET = "resources/models/SmolLM2-135M-Instruct"
PROMPTS = {"mt_bench": "resources/eval/mt_bench_question.jsonl", "humaneval": "resources/eval/HumanEval.jsonl.gz"}


def traces(results) -> list[tuple]:
    return [(r.accepted, r.draft_depths) for r in results]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("evaluate_dir", type=Path)
    parser.add_argument("drafter", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--sets", default="mt_bench,humaneval")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    tokenizer, target, drafter, device = evaluate._load_models(TARGET, args.drafter, args.device, args.threads,
                                                               "float32")
    eos = speculate.target_eos_ids(target)
    rows = []
    for eval_set in args.sets.split(","):
        reference = json.loads((args.evaluate_dir / eval_set / "reference" / "chunks" / f"{args.chunk}.json").read_text())
        prompts = {p["id"]: p for p in evaluate.load_prompts(eval_set, PROMPTS[eval_set], None)}
        ids = [prompt_ids(tokenizer, prompts[p["id"]]["messages"]) for p in reference["per_prompt"]]
        tokens = [p["tokens"] for p in reference["per_prompt"]]
        for part_path in sorted((args.evaluate_dir / eval_set).glob(f"steps*/chunks/{args.chunk}.json")):
            part = json.loads(part_path.read_text())
            drafting = speculate.Drafting.from_dict(part["drafting"])
            theirs = [(p["accepted"], p["draft_depths"]) for p in part["per_prompt"]]
            first = None
            for batch in batches:
                began = time.perf_counter()
                results = replay.replay_many(target, drafter, ids, tokens, drafting, part["max_new_tokens"], eos,
                                             batch=batch)
                seconds = time.perf_counter() - began
                mine = traces(results)
                first = first or mine
                rows.append({
                    "eval_set": eval_set, "drafting": drafting.name, "prompts": len(ids), "batch": batch,
                    "seconds": seconds, "cycles": sum(len(r.accepted) for r in results),
                    "prompts_as_the_run": sum(a == b for a, b in zip(mine, theirs)),
                    "prompts_as_batch_1": sum(a == b for a, b in zip(mine, first)),
                    "tau": sum(sum(r.accepted) + len(r.accepted) for r in results)
                    / sum(len(r.accepted) for r in results),
                    "run_tau": sum(sum(a) + len(a) for a, _ in theirs) / sum(len(a) for a, _ in theirs),
                })
                row = rows[-1]
                base = next(r for r in rows if r["eval_set"] == eval_set and r["drafting"] == drafting.name)
                print(f"{eval_set:<10}{drafting.name:<24}batch {batch:3d}  {seconds:7.1f} s  "
                      f"x{base['seconds'] / seconds:5.2f}  tau {row['tau']:.3f} (run {row['run_tau']:.3f})  "
                      f"as the run {row['prompts_as_the_run']}/{len(ids)}  as batch 1 {row['prompts_as_batch_1']}/{len(ids)}",
                      flush=True)
    total = {b: sum(r["seconds"] for r in rows if r["batch"] == b) for b in batches}
    print("all settings: " + ", ".join(f"batch {b} {s:.1f} s (x{total[batches[0]] / s:.2f})" for b, s in total.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python benchmarks/replay_speed.py " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"), "device": device, "threads": args.threads,
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "drafter": str(args.drafter), "chunk": args.chunk, "rows": rows, "total_seconds": total,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
