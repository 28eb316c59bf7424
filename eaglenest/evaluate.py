"""Evaluate: acceptance length tau, per-position acceptance and speedup of a drafter.

One evaluation = one eval set x one drafting configuration (eaglenest.speculate.Drafting),
run as ``evaluate.prompt_chunks`` jobs over contiguous slices of the prompts. For each
prompt a job runs plain greedy decoding with the target alone and speculative decoding with
the drafter, interleaved on the same machine so that the timing comparison is fair, checks
that greedy speculative decoding reproduced the target's tokens exactly, and writes its
per-prompt traces; the merge step turns the chunks into metrics.json. The summary step
gathers every metrics.json into a table, PNG plots and a headline line.

Eval sets (held out from training by construction: the drafter trains on ShareGPT):
- ``mt_bench``: fastchat's MT-bench question.jsonl (80 questions, 8 categories). The first
  turn of each question; questions are taken round-robin over categories so that a few
  prompts already span writing, roleplay, reasoning, math, coding, ...
- ``humaneval``: HumanEval.jsonl.gz (164 Python problems); the function signature and
  docstring are the user turn, with a one-line instruction.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import time
from pathlib import Path

from eaglenest import atomic

log = logging.getLogger(__name__)

EVAL_SETS = ("mt_bench", "humaneval")
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


# ---- eval sets --------------------------------------------------------------------------------


def read_mt_bench(path: str | os.PathLike) -> list[dict]:
    questions = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    by_category: dict[str, list[dict]] = {}
    for question in questions:
        by_category.setdefault(question["category"], []).append(question)
    # Round-robin over categories (in order of first appearance).
    ordered, queues = [], [list(q) for q in by_category.values()]
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return [
        {"id": f"mt_bench/{q['question_id']}", "category": q["category"],
         "messages": [{"role": "user", "content": q["turns"][0]}]}
        for q in ordered
    ]


def read_humaneval(path: str | os.PathLike) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return [
        {"id": p["task_id"], "category": "code",
         "messages": [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"])}]}
        for p in problems
    ]


def load_prompts(eval_set: str, path: str | os.PathLike, count: int | None) -> list[dict]:
    """The first ``count`` prompts of the set, or all of them when ``count`` is None."""
    readers = {"mt_bench": read_mt_bench, "humaneval": read_humaneval}
    if eval_set not in readers:
        raise ValueError(f"unknown eval set {eval_set!r}; known: {sorted(readers)}")
    prompts = readers[eval_set](path)
    if count is None:
        return prompts
    if count > len(prompts):
        raise ValueError(f"{eval_set} has {len(prompts)} prompts, {count} asked for")
    return prompts[:count]


# ---- one job: a slice of one set's prompts with one drafting configuration -------------------


def prompt_slice(count: int, chunk: int, chunks: int) -> slice:
    """Contiguous slice ``chunk`` of ``chunks`` near-equal slices of ``count`` prompts.

    Chunks let the prompts of one set and drafting configuration run as parallel jobs (one
    transformers target decodes one prompt at a time); the merge keeps prompt order.
    """
    if not 0 <= chunk < chunks:
        raise ValueError(f"chunk {chunk} outside 0..{chunks - 1}")
    return slice(chunk * count // chunks, (chunk + 1) * count // chunks)


def evaluate_drafting(
    target_path: str | os.PathLike,
    drafter_path: str | os.PathLike,
    eval_set: str,
    prompts_path: str | os.PathLike,
    drafting: dict,
    part_path: str | os.PathLike,
    num_prompts: int | None,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    target_name: str = "",
    device: str = "auto",
    threads: int = 2,
    dtype: str = "float32",
    chunk: int = 0,
    chunks: int = 1,
) -> dict:
    """Decode chunk ``chunk`` of ``chunks`` of the set's prompts; write its per-prompt traces.

    ``merge_parts`` turns the parts of every chunk into the job's metrics.json.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglenest import drafter as drafter_lib
    from eaglenest import speculate
    from eaglenest.extract import pick_device
    from eaglenest.prepare import prompt_ids

    torch.set_num_threads(threads)
    device = pick_device(device)
    config = speculate.Drafting.from_dict(drafting)
    every_prompt = load_prompts(eval_set, prompts_path, num_prompts)
    span = prompt_slice(len(every_prompt), chunk, chunks)
    prompts = every_prompt[span]
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"evaluate dtype {dtype!r}: float32 or bfloat16")
    part = {
        "eval_set": eval_set,
        "drafting": {"name": config.name, "steps": config.steps, "topk": config.topk, "tokens": config.tokens},
        "chunk": [chunk, chunks],
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "device": device,
        "dtype": dtype,
        "threads": threads,
        "target": target_name or str(target_path),
        "drafter": str(drafter_path),
        "per_prompt": [],
    }
    if not prompts:  # more chunks than prompts
        atomic.write_json(part_path, part)
        return part
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    # float32 by default: in bf16 the tree-verification forward and the target's own one-token
    # decode round differently, near-ties flip, and greedy outputs part (the H200 run of
    # 2026-11-29 saw it in half of the prompts), so the lossless check could not tell a bug
    # from rounding. A 135M-parameter target costs nothing more in float32.
    torch_dtype = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch_dtype, attn_implementation="sdpa")
    target = target.to(device).eval()
    drafter = drafter_lib.Eagle3Drafter.from_checkpoint(drafter_path).to(device, torch_dtype).eval()
    decoder = speculate.SpeculativeDecoder(target, drafter)
    generator = torch.Generator().manual_seed(seed)  # sampling runs on the CPU (speculate)
    log.info("%s x %s: prompts %d-%d of %d (chunk %d of %d), %d new tokens, temperature %s, %s on %s with %d threads",
             eval_set, config.name, span.start + 1, span.stop, len(every_prompt), chunk + 1, chunks, max_new_tokens, temperature, dtype, device, threads)

    # Warm up both paths so that one-time costs (allocations, kernel selection) time neither.
    warm = prompt_ids(tokenizer, prompts[0]["messages"])
    speculate.target_decode(target, warm, 4, sorted(decoder.eos_token_ids))
    decoder.generate(warm, config, 4, temperature, generator)

    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt["messages"])
        plain = speculate.target_decode(target, ids, max_new_tokens, sorted(decoder.eos_token_ids))
        result = decoder.generate(ids, config, max_new_tokens, temperature, generator)
        lossless = result.tokens == plain.tokens if temperature == 0 else None
        if lossless is False:
            log.error("%s: speculative tokens differ from the target's greedy tokens", prompt["id"])
        part["per_prompt"].append({
            "id": prompt["id"], "category": prompt["category"], "prompt_tokens": len(ids),
            "new_tokens": len(result.tokens), "cycles": result.cycles, "accepted": result.accepted,
            "draft_depths": result.draft_depths,
            "seconds": result.seconds, "target_tokens": len(plain.tokens), "target_seconds": plain.seconds,
            "lossless": lossless,
        })
        log.info("%s: %d tokens in %d cycles, %.2fs (target alone %.2fs)%s", prompt["id"], len(result.tokens),
                 result.cycles, result.seconds, plain.seconds, "" if lossless is not False else " MISMATCH")
    atomic.write_json(part_path, part)
    return part


def metrics_from_parts(parts: list[dict]) -> dict:
    """One job's metrics from the parts of all its chunks, in chunk order.

    Every figure is recomputed from the per-prompt traces, so N chunks give the same tau and
    acceptance as one job would; tokens/s add up each chunk's own seconds.
    """
    from eaglenest import speculate

    if not parts:
        raise ValueError("no evaluation parts to merge")
    parts = sorted(parts, key=lambda part: part["chunk"][0])
    first = parts[0]
    chunks = first["chunk"][1]
    if [part["chunk"] for part in parts] != [[i, chunks] for i in range(chunks)]:
        raise ValueError(f"parts hold chunks {[part['chunk'] for part in parts]}, expected 0..{chunks - 1} of {chunks}")
    for key in ("eval_set", "drafting", "max_new_tokens", "temperature", "dtype", "target", "drafter"):
        values = {json.dumps(part[key], sort_keys=True) for part in parts}
        if len(values) > 1:
            raise ValueError(f"parts disagree on {key}: {sorted(values)}")
    per_prompt = [prompt for part in parts for prompt in part["per_prompt"]]
    if not per_prompt:
        raise ValueError(f"{first['eval_set']} x {first['drafting']['name']}: no prompts were evaluated")
    accepted = [a for p in per_prompt for a in p["accepted"]]
    depths = [d for p in per_prompt for d in p["draft_depths"]]
    stats = speculate.acceptance_stats(accepted, depths)
    spec_tokens_per_second = sum(p["new_tokens"] for p in per_prompt) / sum(p["seconds"] for p in per_prompt)
    target_tokens_per_second = sum(p["target_tokens"] for p in per_prompt) / sum(p["target_seconds"] for p in per_prompt)
    greedy = first["temperature"] == 0
    return {
        "eval_set": first["eval_set"],
        "drafting": first["drafting"],
        **stats,
        "prompts": len(per_prompt),
        "chunks": chunks,
        "max_new_tokens": first["max_new_tokens"],
        "temperature": first["temperature"],
        "lossless": all(p["lossless"] for p in per_prompt) if greedy else None,
        "mismatched_prompts": [p["id"] for p in per_prompt if p["lossless"] is False],
        "speculative_tokens_per_second": spec_tokens_per_second,
        "target_tokens_per_second": target_tokens_per_second,
        "speedup": spec_tokens_per_second / target_tokens_per_second,
        "device": first["device"],
        "dtype": first["dtype"],
        "threads": first["threads"],
        "target": first["target"],
        "drafter": first["drafter"],
        "per_prompt": per_prompt,
    }


def merge_parts(part_paths: list[str | os.PathLike], metrics_path: str | os.PathLike) -> dict:
    metrics = metrics_from_parts([json.loads(Path(p).read_text()) for p in part_paths])
    atomic.write_json(metrics_path, metrics)
    log.info("%s x %s: tau %.3f over %d prompts, acceptance by position %s, speedup %.2fx, lossless %s",
             metrics["eval_set"], metrics["drafting"]["name"], metrics["tau"], metrics["prompts"],
             [None if a is None else round(a, 3) for a in metrics["acceptance_by_position"]], metrics["speedup"],
             metrics["lossless"])
    return metrics


# ---- summary, plots, headline -----------------------------------------------------------------


def summary_rows(metrics: list[dict]) -> list[dict]:
    rows = []
    for m in metrics:
        rows.append({
            "eval_set": m["eval_set"], "drafting": m["drafting"]["name"], "prompts": m["prompts"],
            "tau": m["tau"], "cycles": m["cycles"],
            "acceptance_by_position": m["acceptance_by_position"],
            "speedup": m["speedup"], "speculative_tokens_per_second": m["speculative_tokens_per_second"],
            "target_tokens_per_second": m["target_tokens_per_second"], "lossless": m["lossless"],
        })
    return rows


def format_table(rows: list[dict]) -> str:
    header = ["eval_set", "drafting", "prompts", "tau", "acceptance_by_position", "speedup",
              "spec_tok_per_s", "target_tok_per_s", "lossless"]
    lines = ["\t".join(header)]
    for r in rows:
        acceptance = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        lines.append("\t".join([
            r["eval_set"], r["drafting"], str(r["prompts"]), f"{r['tau']:.3f}", acceptance, f"{r['speedup']:.2f}",
            f"{r['speculative_tokens_per_second']:.1f}", f"{r['target_tokens_per_second']:.1f}", str(r["lossless"]),
        ]))
    return "\n".join(lines) + "\n"


def headline(summary: dict) -> str:
    """One line: tau per eval set for the first drafting configuration (the headline one)."""
    first = summary["rows"][0]["drafting"]
    parts = [f"{r['eval_set']} {r['tau']:.2f}" for r in summary["rows"] if r["drafting"] == first]
    speedups = [f"{r['speedup']:.2f}x" for r in summary["rows"] if r["drafting"] == first]
    return f"tau ({first}): {', '.join(parts)}; speedup vs the target alone: {', '.join(speedups)}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a node or in CI
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> None:
    atomic.write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))


def plot_acceptance_by_position(rows: list[dict], path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for r in rows:
        rates = r["acceptance_by_position"]
        points = [(i + 1, a) for i, a in enumerate(rates) if a is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{r['eval_set']} {r['drafting']}")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(position i accepted | i-1 accepted)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Acceptance by draft position")
    _save(fig, path)
    plt.close(fig)


def plot_tau(rows: list[dict], path) -> None:
    plt = _pyplot()
    sets = list(dict.fromkeys(r["eval_set"] for r in rows))
    configs = list(dict.fromkeys(r["drafting"] for r in rows))
    width = 0.8 / max(len(configs), 1)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for c, config in enumerate(configs):
        values = [next((r["tau"] for r in rows if r["eval_set"] == s and r["drafting"] == config), 0.0) for s in sets]
        bars = ax.bar([i + c * width for i in range(len(sets))], values, width, label=config)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(sets))], sets)
    ax.set_ylabel("tau (tokens per verification cycle)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.legend(fontsize=7)
    ax.set_title("Acceptance length tau per eval set")
    _save(fig, path)
    plt.close(fig)


def plot_training_curve(curve: dict | None, path) -> None:
    plt = _pyplot()
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(9, 3.6))
    if not curve or not curve.get("train"):
        for ax in (loss_ax, acc_ax):
            ax.axis("off")
        loss_ax.text(0.5, 0.5, "no training curve: this drafter was not trained by this run",
                     ha="center", va="center", transform=fig.transFigure)
    else:
        train = curve["train"]
        steps = [r["step"] for r in train]
        loss_ax.plot(steps, [r["loss"] for r in train], lw=1)
        loss_ax.set_xlabel("step")
        loss_ax.set_ylabel("TTT loss (train)")
        loss_ax.grid(alpha=0.3)
        positions = len(train[0]["acc"])
        for j in range(positions):
            line, = acc_ax.plot(steps, [r["acc"][j] for r in train], lw=0.8, alpha=0.6, label=f"TTT step {j}")
            val = [(v["step"], v["acc"][j]) for v in curve.get("val", [])]
            if val:
                acc_ax.plot(*zip(*val), marker="o", ls="none", color=line.get_color())
        acc_ax.set_xlabel("step")
        acc_ax.set_ylabel("top-1 accuracy (lines train, dots val)")
        acc_ax.set_ylim(0, 1)
        acc_ax.grid(alpha=0.3)
        acc_ax.legend(fontsize=6)
    fig.suptitle("Drafter training")
    _save(fig, path)
    plt.close(fig)


def summarize(
    metrics_paths: list[str],
    drafter_path: str | os.PathLike,
    table_path,
    summary_path,
    acceptance_plot,
    tau_plot,
    training_plot,
) -> dict:
    metrics = [json.loads(Path(p).read_text()) for p in metrics_paths]
    rows = summary_rows(metrics)
    curve_path = Path(drafter_path) / "training_curve.json"
    curve = json.loads(curve_path.read_text()) if curve_path.exists() else None
    summary = {"rows": rows, "lossless": all(r["lossless"] is not False for r in rows),
               "training_summary": (curve or {}).get("summary")}
    summary["headline"] = headline(summary)
    atomic.write_text(table_path, format_table(rows))
    plot_acceptance_by_position(rows, acceptance_plot)
    plot_tau(rows, tau_plot)
    plot_training_curve(curve, training_plot)
    atomic.write_json(summary_path, summary)
    log.info("%s", summary["headline"])
    return summary


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="print the headline of an evaluation summary")
    parser.add_argument("summary", help="results/<run>/evaluate/summary.json")
    args = parser.parse_args(argv)
    summary = json.loads(Path(args.summary).read_text())
    print(summary["headline"])
    print(f"table: {Path(args.summary).with_name('summary.tsv')}; report: snakemake --report report.html")
    if not summary["lossless"]:
        print("WARNING: greedy speculative decoding differed from the target's own output; see the table")


if __name__ == "__main__":
    main()
