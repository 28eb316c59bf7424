"""Evaluate: acceptance length tau, per-position acceptance and speedup of a drafter.

One evaluation = one eval set x one drafting configuration (eaglenest.model.speculate.Drafting),
run as ``evaluate.prompt_chunks`` jobs over contiguous slices of the prompts. For each
prompt a job runs plain greedy decoding with the target alone and speculative decoding with
the drafter, interleaved on the same machine so that the timing comparison is fair, checks
that greedy speculative decoding reproduced the target's tokens exactly, and writes its
per-prompt traces; the merge step turns the chunks into metrics.json. The summary step
gathers every metrics.json into a table, PNG plots and a headline line.

``evaluate.method: replay`` (greedy only) measures the same tau without running speculative
decoding: a reference job per chunk decodes the target's greedy output once (shared by every
drafting configuration), and each drafting job replays the decoder's cycles on it with one
teacher-forced target forward per prompt (eaglenest.model.replay), ``evaluate.replay_batch``
prompts in lockstep. It gives the decoder's exact cycles (tests compare them) at a fraction of
the cost, and no speedup: nothing is decoded speculatively.

Eval sets (held out from training by construction: the drafter trains on ShareGPT):
- ``mt_bench``: fastchat's MT-bench question.jsonl (80 questions, 8 categories). The first
  turn of each question; questions are taken round-robin over categories so that a few
  prompts already span writing, roleplay, reasoning, math, coding, ...
- ``humaneval``: HumanEval.jsonl.gz (164 Python problems); the function signature and
  docstring are the user turn, with a one-line instruction.
- any other name: the user's own chats or a held-out slice of the run's data, read into a
  prompts file by eaglenest.stages.eval_sets.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path

from eaglenest.formats import atomic
from eaglenest.stages import eval_sets

log = logging.getLogger(__name__)

EVAL_SETS = eval_sets.BUILTIN_SETS
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
    """The first ``count`` prompts of the set, or all of them when ``count`` is None.

    ``path``: a built-in set's file, or the prompts.jsonl that rule evaluate_prompts wrote for
    any other set (eaglenest.stages.eval_sets)."""
    readers = {"mt_bench": read_mt_bench, "humaneval": read_humaneval}
    prompts = readers.get(eval_set, eval_sets.read_prompts)(path)
    if count is None:
        return prompts
    if count > len(prompts):
        hint = "" if eval_set in readers else " (its entry in evaluate.sets may set num_prompts, null = all)"
        raise ValueError(f"{eval_set} has {len(prompts)} prompts, {count} asked for{hint}")
    return prompts[:count]


# ---- one job: a slice of one set's prompts with one drafting configuration -------------------


def chunk_prompts(eval_set: str, path, num_prompts: int | None, chunk: int, chunks: int) -> tuple[list[dict], slice]:
    """Every prompt of the evaluation and the slice of them that chunk ``chunk`` takes."""
    every_prompt = load_prompts(eval_set, path, num_prompts)
    return every_prompt, prompt_slice(len(every_prompt), chunk, chunks)


def prompt_slice(count: int, chunk: int, chunks: int) -> slice:
    """Contiguous slice ``chunk`` of ``chunks`` near-equal slices of ``count`` prompts.

    Chunks let the prompts of one set and drafting configuration run as parallel jobs (one
    transformers target decodes one prompt at a time); the merge keeps prompt order.
    """
    if not 0 <= chunk < chunks:
        raise ValueError(f"chunk {chunk} outside 0..{chunks - 1}")
    return slice(chunk * count // chunks, (chunk + 1) * count // chunks)


METHODS = ("decode", "replay")


def _load_models(target_path, drafter_path, device: str, threads: int, dtype: str):
    """(tokenizer, target, drafter or None, device) in the evaluation dtype.

    ``drafter_path``: a saved drafter directory, a training checkpoint, or an SGLang/vLLM
    export (whose embedding is the target's).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglenest.stages import export
    from eaglenest.target_model.runtime import pick_device

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"evaluate dtype {dtype!r}: float32 or bfloat16")
    torch.set_num_threads(threads)
    device = pick_device(device)
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    # float32 by default: in bf16 the tree-verification forward and the target's own one-token
    # decode round differently, near-ties flip, and greedy outputs part (the H200 run of
    # 2026-11-29 saw it in half of the prompts), so the lossless check could not tell a bug
    # from rounding. A 135M-parameter target costs nothing more in float32.
    torch_dtype = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch_dtype, attn_implementation="sdpa")
    target = target.to(device).eval()
    drafter = None
    if drafter_path is not None:
        drafter = export.load_any_drafter(drafter_path, target_path).to(device, torch_dtype).eval()
    return tokenizer, target, drafter, device


def decode_reference(
    target_path: str | os.PathLike,
    eval_set: str,
    prompts_path: str | os.PathLike,
    part_path: str | os.PathLike,
    num_prompts: int | None,
    max_new_tokens: int,
    lookahead: int,
    target_name: str = "",
    device: str = "auto",
    threads: int = 2,
    dtype: str = "float32",
    chunk: int = 0,
    chunks: int = 1,
) -> dict:
    """The target's greedy output for chunk ``chunk`` of the set's prompts, ``lookahead``
    tokens past each stop (what ``evaluate.method: replay`` replays every drafter on)."""
    from eaglenest.model import speculate
    from eaglenest.stages.prepare import prompt_ids

    every_prompt, span = chunk_prompts(eval_set, prompts_path, num_prompts, chunk, chunks)
    tokenizer, target, _, device = _load_models(target_path, None, device, threads, dtype)
    eos = speculate.target_eos_ids(target)
    part = {
        "eval_set": eval_set, "chunk": [chunk, chunks], "max_new_tokens": max_new_tokens, "lookahead": lookahead,
        "device": device, "dtype": dtype, "threads": threads, "target": target_name or str(target_path),
        "eos_token_ids": eos, "per_prompt": [],
    }
    log.info("%s reference: prompts %d-%d of %d (chunk %d of %d), %d new tokens + %d lookahead, %s on %s",
             eval_set, span.start + 1, span.stop, len(every_prompt), chunk + 1, chunks, max_new_tokens, lookahead,
             dtype, device)
    for prompt in every_prompt[span]:
        ids = prompt_ids(tokenizer, prompt["messages"])
        plain = speculate.target_decode(target, ids, max_new_tokens, eos, lookahead=lookahead)
        part["per_prompt"].append({
            "id": prompt["id"], "category": prompt["category"], "prompt_tokens": len(ids), "tokens": plain.tokens,
            "output_length": speculate.output_length(plain.tokens, max_new_tokens, eos), "seconds": plain.seconds,
        })
        log.info("%s: %d tokens in %.2fs", prompt["id"], part["per_prompt"][-1]["output_length"], plain.seconds)
    atomic.write_json(part_path, part)
    return part


def read_reference(path: str | os.PathLike, eval_set: str, chunk: int, chunks: int, max_new_tokens: int,
                   lookahead: int, dtype: str) -> dict:
    """A reference part, checked against the job that replays it."""
    reference = json.loads(Path(path).read_text())
    expected = {"eval_set": eval_set, "chunk": [chunk, chunks], "max_new_tokens": max_new_tokens, "dtype": dtype}
    found = {key: reference.get(key) for key in expected}
    if found != expected:
        raise ValueError(f"{path} was decoded for {found}, this job replays {expected}: remove it and rerun")
    if reference["lookahead"] < lookahead:
        raise ValueError(f"{path} looks {reference['lookahead']} tokens ahead, a {lookahead}-step draft needs "
                         f"{lookahead}: remove it and rerun")
    return reference


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
    method: str = "decode",
    reference_path: str | os.PathLike | None = None,
    replay_batch: int = 32,
) -> dict:
    """Decode (or replay) chunk ``chunk`` of ``chunks`` of the set's prompts; write its
    per-prompt traces. ``merge_parts`` turns the parts of every chunk into metrics.json."""
    import torch

    from eaglenest.model import replay, speculate
    from eaglenest.stages.prepare import prompt_ids

    if method not in METHODS:
        raise ValueError(f"evaluate method {method!r}: one of {METHODS}")
    if method == "replay" and (temperature != 0 or reference_path is None):
        raise ValueError("evaluate method 'replay' replays greedy decoding: it needs temperature 0 and a reference")
    config = speculate.Drafting.from_dict(drafting)
    every_prompt, span = chunk_prompts(eval_set, prompts_path, num_prompts, chunk, chunks)
    prompts = every_prompt[span]
    reference = None
    if method == "replay":
        reference = read_reference(reference_path, eval_set, chunk, chunks, max_new_tokens, config.steps, dtype)
        if [p["id"] for p in reference["per_prompt"]] != [p["id"] for p in prompts]:
            raise ValueError(f"{reference_path} holds other prompts than chunk {chunk} of {chunks}: remove it and rerun")
    part = {
        "eval_set": eval_set,
        "drafting": {"name": config.name, "steps": config.steps, "topk": config.topk, "tokens": config.tokens},
        "chunk": [chunk, chunks],
        "method": method,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "device": device,
        "dtype": dtype,
        "threads": threads,
        **({"replay_batch": replay_batch} if method == "replay" else {}),
        "target": target_name or str(target_path),
        "drafter": str(drafter_path),
        "per_prompt": [],
    }
    if not prompts:  # more chunks than prompts
        atomic.write_json(part_path, part)
        return part
    tokenizer, target, drafter, device = _load_models(target_path, drafter_path, device, threads, dtype)
    part["device"] = device
    decoder = speculate.SpeculativeDecoder(target, drafter)
    eos = sorted(decoder.eos_token_ids)
    generator = torch.Generator().manual_seed(seed)  # sampling runs on the CPU (speculate)
    log.info("%s x %s (%s): prompts %d-%d of %d (chunk %d of %d), %d new tokens, temperature %s, %s on %s with %d threads",
             eval_set, config.name, method, span.start + 1, span.stop, len(every_prompt), chunk + 1, chunks,
             max_new_tokens, temperature, dtype, device, threads)

    if method == "decode":
        # Warm up both paths so that one-time costs (allocations, kernel selection) time neither.
        warm = prompt_ids(tokenizer, prompts[0]["messages"])
        speculate.target_decode(target, warm, 4, eos)
        decoder.generate(warm, config, 4, temperature, generator)

    prompt_tokens = [prompt_ids(tokenizer, prompt["messages"]) for prompt in prompts]
    if method == "replay":
        references = [plain["tokens"] for plain in reference["per_prompt"]]
        replays = replay.replay_many(target, drafter, prompt_tokens, references, config, max_new_tokens, eos,
                                     batch=replay_batch)
    for index, (prompt, ids) in enumerate(zip(prompts, prompt_tokens)):
        if method == "replay":
            plain = reference["per_prompt"][index]
            result = replays[index]
            plain = speculate.Generation(tokens=plain["tokens"][: plain["output_length"]], seconds=plain["seconds"])
            # The replay outputs the reference by construction; what can part is one
            # teacher-forced forward's argmax from the reference (a rounding near-tie).
            lossless, checked = None, {"reference_consistent": result.reference_consistent}
        else:
            plain = speculate.target_decode(target, ids, max_new_tokens, eos)
            result = decoder.generate(ids, config, max_new_tokens, temperature, generator)
            lossless, checked = (result.tokens == plain.tokens if temperature == 0 else None), {}
        if lossless is False:
            log.error("%s: speculative tokens differ from the target's greedy tokens", prompt["id"])
        part["per_prompt"].append({
            "id": prompt["id"], "category": prompt["category"], "prompt_tokens": len(ids),
            "new_tokens": len(result.tokens), "cycles": result.cycles, "accepted": result.accepted,
            "draft_depths": result.draft_depths,
            "seconds": result.seconds, "target_tokens": len(plain.tokens), "target_seconds": plain.seconds,
            "lossless": lossless, **checked,
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
    from eaglenest.model import speculate

    if not parts:
        raise ValueError("no evaluation parts to merge")
    parts = sorted(parts, key=lambda part: part["chunk"][0])
    first = parts[0]
    chunks = first["chunk"][1]
    if [part["chunk"] for part in parts] != [[i, chunks] for i in range(chunks)]:
        raise ValueError(f"parts hold chunks {[part['chunk'] for part in parts]}, expected 0..{chunks - 1} of {chunks}")
    for key in ("eval_set", "drafting", "method", "max_new_tokens", "temperature", "dtype", "target", "drafter"):
        values = {json.dumps(part.get(key), sort_keys=True) for part in parts}
        if len(values) > 1:
            raise ValueError(f"parts disagree on {key}: {sorted(values)}")
    per_prompt = [prompt for part in parts for prompt in part["per_prompt"]]
    if not per_prompt:
        raise ValueError(f"{first['eval_set']} x {first['drafting']['name']}: no prompts were evaluated")
    accepted = [a for p in per_prompt for a in p["accepted"]]
    depths = [d for p in per_prompt for d in p["draft_depths"]]
    stats = speculate.acceptance_stats(accepted, depths)
    method = first.get("method", "decode")
    target_tokens_per_second = sum(p["target_tokens"] for p in per_prompt) / sum(p["target_seconds"] for p in per_prompt)
    # A replay decodes nothing speculatively: it has a tau but no speed.
    spec_tokens_per_second = (sum(p["new_tokens"] for p in per_prompt) / sum(p["seconds"] for p in per_prompt)
                              if method == "decode" else None)
    greedy = first["temperature"] == 0
    replay = method == "replay"
    return {
        "eval_set": first["eval_set"],
        "drafting": first["drafting"],
        **stats,
        "prompts": len(per_prompt),
        "chunks": chunks,
        "method": method,
        "max_new_tokens": first["max_new_tokens"],
        "temperature": first["temperature"],
        "lossless": all(p["lossless"] for p in per_prompt) if greedy and not replay else None,
        "mismatched_prompts": [p["id"] for p in per_prompt if p["lossless"] is False],
        "reference_inconsistent_prompts": [p["id"] for p in per_prompt if p.get("reference_consistent") is False],
        "speculative_tokens_per_second": spec_tokens_per_second,
        "target_tokens_per_second": target_tokens_per_second,
        "speedup": None if spec_tokens_per_second is None else spec_tokens_per_second / target_tokens_per_second,
        # Chunks may run on different machines (a GPU node and a CPU box): name every device.
        "device": "+".join(sorted({part["device"] for part in parts})),
        "dtype": first["dtype"],
        "threads": first["threads"],
        "target": first["target"],
        "drafter": first["drafter"],
        "per_prompt": per_prompt,
    }


def merge_parts(part_paths: list[str | os.PathLike], metrics_path: str | os.PathLike) -> dict:
    parts = [json.loads(Path(p).read_text()) for p in part_paths]
    if any(part.get("backend") == "sglang" for part in parts):  # a setting's server and the plain one
        from eaglenest.stages import evaluate_server

        return evaluate_server.merge_server_parts(parts, metrics_path)
    metrics = metrics_from_parts(parts)
    atomic.write_json(metrics_path, metrics)
    log.info("%s x %s (%s): tau %.3f over %d prompts, acceptance by position %s, speedup %s, lossless %s",
             metrics["eval_set"], metrics["drafting"]["name"], metrics["method"], metrics["tau"], metrics["prompts"],
             [None if a is None else round(a, 3) for a in metrics["acceptance_by_position"]],
             _times(metrics["speedup"]), metrics["lossless"])
    return metrics


# ---- summary, plots, headline -----------------------------------------------------------------


def _times(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_rows(metrics: list[dict]) -> list[dict]:
    rows = []
    for m in metrics:
        rows.append({
            "eval_set": m["eval_set"], "drafting": m["drafting"]["name"], "method": m.get("method", "decode"),
            "prompts": m["prompts"],
            "tau": m["tau"], "cycles": m["cycles"],
            "acceptance_by_position": m["acceptance_by_position"],
            "speedup": m["speedup"], "speculative_tokens_per_second": m["speculative_tokens_per_second"],
            "target_tokens_per_second": m["target_tokens_per_second"], "lossless": m["lossless"],
            # Backend sglang: the server's figures at each concurrency (the first is the headline).
            "backend": m.get("backend", "transformers"), "concurrency": m.get("concurrency"),
            "server_accept_length": m.get("server_accept_length"), "by_concurrency": m.get("by_concurrency", []),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    # Columns after lossless came with the SGLang backend; readers of the first ten are unchanged.
    header = ["eval_set", "drafting", "method", "prompts", "tau", "acceptance_by_position", "speedup",
              "spec_tok_per_s", "target_tok_per_s", "lossless", "backend", "concurrency", "server_accept_length",
              "speedup_by_concurrency"]
    lines = ["\t".join(header)]
    for r in rows:
        acceptance = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        by_concurrency = " ".join(f"{c['concurrency']}:{_number(c['speedup'], 2)}" for c in r.get("by_concurrency", []))
        lines.append("\t".join([
            r["eval_set"], r["drafting"], r["method"], str(r["prompts"]), _number(r["tau"], 3), acceptance,
            _number(r["speedup"], 2), _number(r["speculative_tokens_per_second"]),
            _number(r["target_tokens_per_second"]), str(r["lossless"]), r.get("backend", "transformers"),
            "-" if r.get("concurrency") is None else str(r["concurrency"]),
            _number(r.get("server_accept_length"), 3), by_concurrency or "-",
        ]))
    return "\n".join(lines) + "\n"


def headline(summary: dict) -> str:
    """One line: tau per eval set for the first drafting configuration (the headline one)."""
    first = summary["rows"][0]["drafting"]
    parts = [f"{r['eval_set']} {r['tau']:.2f}" for r in summary["rows"] if r["drafting"] == first]
    speedups = [_times(r["speedup"]) for r in summary["rows"] if r["drafting"] == first]
    if all(r["speedup"] is None for r in summary["rows"]):
        return f"tau ({first}, replayed on the target's greedy output): {', '.join(parts)}"
    rows = [r for r in summary["rows"] if r["drafting"] == first]
    if rows[0].get("backend") == "sglang":
        concurrency = rows[0].get("concurrency")
        baseline = f"the plain SGLang server at concurrency {concurrency}"
    else:
        baseline = "the target alone"
    return f"tau ({first}): {', '.join(parts)}; speedup vs {baseline}: {', '.join(speedups)}"


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
