"""τ per eval set and drafting setting for one or more evaluated runs, with bootstrap errors,
and paired differences between runs evaluated on the same prompts.

    python benchmarks/tau_table.py [--by-category] [--without-loops] OUT.json results/<run>/evaluate [results/<run2>/evaluate ...]

τ of a job is its total tokens over its total cycles (metrics.json). Its standard error comes
from resampling prompts (2,000 bootstrap draws, seed 0). With two or more runs, the difference
of each later run from the first is resampled over the same prompts together (paired), which
removes the prompt-to-prompt spread that both runs share.

A job whose chunks did not all run (no metrics.json) is read from the chunks it has, merged
with eaglenest.stages.evaluate.metrics_from_parts; the row then says how many chunks and prompts it
covers, and the paired differences use the prompts that every run has.

``--by-category`` gives a row per prompt category as well (MT-bench's writing, roleplay,
reasoning, math, coding, extraction, STEM, humanities; ``category`` in each prompt's record),
each with its own bootstrap over that category's prompts. ``--without-loops`` gives a row of
the prompts whose reference (the first run's ``<set>/reference/chunks``) does not fall into a loop
of three copies (eaglenest.stages.regenerate.cut_loop, as regeneration cuts answers), whose
repeated text a drafter predicts easily: τ on ordinary text.
"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DRAWS = 2000


def read_job(job_dir: Path) -> dict | None:
    """metrics.json, or the merge of the chunks there are (``chunks_merged`` says how many)."""
    if (job_dir / "metrics.json").exists():
        return json.loads((job_dir / "metrics.json").read_text())
    parts = sorted((json.loads(p.read_text()) for p in job_dir.glob("chunks/*.json")), key=lambda part: part["chunk"][0])
    if not parts:
        return None
    from eaglenest.model.speculate import acceptance_stats

    # metrics_from_parts refuses a job with chunks missing (right for the workflow); here the
    # table says which chunks it read.
    per_prompt = [prompt for part in parts for prompt in part["per_prompt"]]
    stats = acceptance_stats([a for p in per_prompt for a in p["accepted"]],
                             [d for p in per_prompt for d in p["draft_depths"]])
    return {**stats, "per_prompt": per_prompt, "method": parts[0].get("method", "decode"), "dtype": parts[0]["dtype"],
            "device": "+".join(sorted({part["device"] for part in parts})),
            "chunks_merged": [len(parts), parts[0]["chunk"][1]]}


LOOP_COPIES = 3


def looping_prompts(set_dir: Path) -> set[str]:
    """Ids of the prompts whose reference answer ends in a loop of LOOP_COPIES copies."""
    from eaglenest.stages.regenerate import cut_loop

    chunks = sorted(set_dir.glob("reference/chunks/*.json"))
    if not chunks:
        raise SystemExit(f"--without-loops: no reference chunks in {set_dir}/reference/chunks")
    return {p["id"] for chunk in chunks for p in json.loads(chunk.read_text())["per_prompt"]
            if cut_loop(p["tokens"], LOOP_COPIES)[1]}


def per_prompt(metrics: dict) -> dict[str, tuple[int, int]]:
    """prompt id -> (tokens from cycles, cycles)."""
    return {p["id"]: (sum(p["accepted"]) + p["cycles"], p["cycles"]) for p in metrics["per_prompt"]}


def tau(tokens: np.ndarray, cycles: np.ndarray) -> float:
    return float(tokens.sum() / cycles.sum())


def paired_row(names, jobs, traces, ids, rng) -> dict:
    """τ of each run over ``ids`` with its bootstrap error, and each later run's paired difference."""
    arrays = [(np.array([t[i][0] for i in ids]), np.array([t[i][1] for i in ids])) for t in traces]
    draws = rng.integers(0, len(ids), size=(DRAWS, len(ids)))
    boot = [np.array([tau(tok[d], cyc[d]) for d in draws]) for tok, cyc in arrays]
    row = {"prompts": len(ids), "runs": {}}
    for name, job, (tok, cyc), b in zip(names, jobs, arrays, boot):
        row["runs"][name] = {"tau": tau(tok, cyc), "se": float(b.std()), "device": job["device"],
                             "method": job.get("method", "decode"), "dtype": job.get("dtype"),
                             "acceptance_by_position": job["acceptance_by_position"]}
        if "chunks_merged" in job:
            row["runs"][name]["chunks_merged"] = job["chunks_merged"]
    for name, b in zip(names[1:], boot[1:]):
        diff = b - boot[0]
        row["runs"][name]["minus_first"] = {"mean": row["runs"][name]["tau"] - row["runs"][names[0]]["tau"],
                                            "se": float(diff.std()),
                                            "ci95": [float(np.quantile(diff, 0.025)), float(np.quantile(diff, 0.975))]}
    return row


def main(*args: str) -> None:
    by_category = "--by-category" in args
    without_loops = "--without-loops" in args
    out, *evaluate_dirs = [a for a in args if a not in ("--by-category", "--without-loops")]
    runs = [Path(d) for d in evaluate_dirs]
    names = [d.parent.name for d in runs]
    rng = np.random.default_rng(0)
    rows = []
    looping: dict[str, set[str]] = {}  # eval set -> ids of the prompts whose reference loops
    for job_dir in sorted(d for d in runs[0].glob("*/steps*") if d.is_dir()):
        eval_set, drafting = job_dir.parts[-2], job_dir.parts[-1]
        jobs = [job for job in (read_job(run / eval_set / drafting) for run in runs) if job is not None]
        if len(jobs) != len(runs):
            continue
        traces = [per_prompt(job) for job in jobs]
        ids = sorted(set.intersection(*(set(t) for t in traces)))
        if not ids:  # partial jobs that share no prompt
            continue
        rows.append({"eval_set": eval_set, "drafting": drafting, **paired_row(names, jobs, traces, ids, rng)})
        if without_loops:
            if eval_set not in looping:  # one read of a set's references for all its jobs
                looping[eval_set] = looping_prompts(runs[0] / eval_set)
            rows.append({"eval_set": eval_set, "drafting": drafting, "category": "no loop",
                         **paired_row(names, jobs, traces, [i for i in ids if i not in looping[eval_set]], rng)})
        categories = {p["id"]: p.get("category") for p in jobs[0]["per_prompt"]}
        for category in sorted({categories[i] for i in ids if categories[i]}) if by_category else []:
            subset = [i for i in ids if categories[i] == category]
            rows.append({"eval_set": eval_set, "drafting": drafting, "category": category,
                         **paired_row(names, jobs, traces, subset, rng)})
    Path(out).write_text(json.dumps({"runs": names, "rows": rows}, indent=1) + "\n")
    header = ["set", "drafting", "category", "prompts"] + [f"tau {n}" for n in names] + [f"{n} - {names[0]} (95% CI)" for n in names[1:]]
    print("\t".join(header))
    for row in rows:
        cells = [row["eval_set"], row["drafting"], row.get("category", "all"), str(row["prompts"])]
        cells += [f"{row['runs'][n]['tau']:.3f} ± {row['runs'][n]['se']:.3f}"
                  + (" ({} of {} chunks)".format(*row["runs"][n]["chunks_merged"]) if "chunks_merged" in row["runs"][n] else "")
                  for n in names]
        for n in names[1:]:
            d = row["runs"][n]["minus_first"]
            cells.append(f"{d['mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")
        print("\t".join(cells))


if __name__ == "__main__":
    main(*sys.argv[1:])
