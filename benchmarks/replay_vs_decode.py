"""Real speculative decoding against the replayed cycles of an evaluated run, prompt by prompt.

    python benchmarks/replay_vs_decode.py results/h200-smollm2 OUT.json [PROMPTS_PER_SET]

Decodes the first prompts of chunk 0 of each eval set with the run's drafter (CPU, float32,
one thread), at each chain setting the run replayed, and compares every cycle's accepted
count and draft depth with the replay's chunk files (which may come from another machine).
"""
import json
import sys
import time
from pathlib import Path

import torch

from eaglenest.stages import evaluate
from eaglenest.model import speculate
from eaglenest.stages.prepare import prompt_ids

TARGET = "resources/models/SmolLM2-135M-Instruct"
PROMPTS = {"mt_bench": "resources/eval/mt_bench_question.jsonl", "humaneval": "resources/eval/HumanEval.jsonl.gz"}


def main(run_dir: str, out: str, count: str = "5") -> None:
    torch.set_num_threads(1)
    run = Path(run_dir)
    tokenizer, target, drafter, _ = evaluate._load_models(TARGET, run / "train" / "drafter", "cpu", 1, "float32")
    decoder = speculate.SpeculativeDecoder(target, drafter)
    rows = []
    for eval_set, path in PROMPTS.items():
        prompts = evaluate.load_prompts(eval_set, path, None)[: int(count)]
        for chunk in sorted((run / "evaluate" / eval_set).glob("steps*-topk1-*/chunks/0.json")):
            part = json.loads(chunk.read_text())
            drafting = speculate.Drafting.from_dict(part["drafting"])
            for prompt, replayed in zip(prompts, part["per_prompt"]):
                assert prompt["id"] == replayed["id"], (prompt["id"], replayed["id"])
                began = time.perf_counter()
                decoded = decoder.generate(prompt_ids(tokenizer, prompt["messages"]), drafting, part["max_new_tokens"])
                rows.append({
                    "id": prompt["id"], "drafting": drafting.name, "cycles": decoded.cycles,
                    "identical": (decoded.accepted, decoded.draft_depths) == (replayed["accepted"], replayed["draft_depths"]),
                    "decoded_tau": (sum(decoded.accepted) + decoded.cycles) / decoded.cycles,
                    "replayed_tau": (sum(replayed["accepted"]) + replayed["cycles"]) / replayed["cycles"],
                    "decode_seconds": time.perf_counter() - began, "replay_device": part["device"],
                })
                row = rows[-1]
                print(f"{row['id']:<16}{row['drafting']:<22}cycles {row['cycles']:4d}  tau {row['decoded_tau']:.3f} "
                      f"decoded, {row['replayed_tau']:.3f} replayed on {row['replay_device']}  identical {row['identical']}",
                      flush=True)
    Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{sum(r['identical'] for r in rows)} of {len(rows)} prompt x setting traces identical, "
          f"{sum(r['cycles'] for r in rows)} cycles")


if __name__ == "__main__":
    main(*sys.argv[1:])
