"""τ per eval set and drafting setting for one or more evaluated runs, with bootstrap errors,
and paired differences between runs evaluated on the same prompts.

    python benchmarks/tau_table.py OUT.json results/<run>/evaluate [results/<run2>/evaluate ...]

τ of a job is its total tokens over its total cycles (metrics.json). Its standard error comes
from resampling prompts (2,000 bootstrap draws, seed 0). With two or more runs, the difference
of each later run from the first is resampled over the same prompts together (paired), which
removes the prompt-to-prompt spread that both runs share.
"""
import json
import sys
from pathlib import Path

import numpy as np

DRAWS = 2000


def per_prompt(metrics: dict) -> dict[str, tuple[int, int]]:
    """prompt id -> (tokens from cycles, cycles)."""
    return {p["id"]: (sum(p["accepted"]) + p["cycles"], p["cycles"]) for p in metrics["per_prompt"]}


def tau(tokens: np.ndarray, cycles: np.ndarray) -> float:
    return float(tokens.sum() / cycles.sum())


def main(out: str, *evaluate_dirs: str) -> None:
    runs = [Path(d) for d in evaluate_dirs]
    names = [d.parent.name for d in runs]
    rng = np.random.default_rng(0)
    rows = []
    for metrics_path in sorted(runs[0].glob("*/*/metrics.json")):
        eval_set, drafting = metrics_path.parts[-3], metrics_path.parts[-2]
        jobs = [json.loads((run / eval_set / drafting / "metrics.json").read_text()) for run in runs
                if (run / eval_set / drafting / "metrics.json").exists()]
        if len(jobs) != len(runs):
            continue
        traces = [per_prompt(job) for job in jobs]
        ids = sorted(set.intersection(*(set(t) for t in traces)))
        arrays = [(np.array([t[i][0] for i in ids]), np.array([t[i][1] for i in ids])) for t in traces]
        draws = rng.integers(0, len(ids), size=(DRAWS, len(ids)))
        boot = [np.array([tau(tok[d], cyc[d]) for d in draws]) for tok, cyc in arrays]
        row = {"eval_set": eval_set, "drafting": drafting, "prompts": len(ids), "runs": {}}
        for name, job, (tok, cyc), b in zip(names, jobs, arrays, boot):
            row["runs"][name] = {"tau": tau(tok, cyc), "se": float(b.std()), "device": job["device"],
                                 "method": job.get("method", "decode"),
                                 "acceptance_by_position": job["acceptance_by_position"]}
        for name, b in zip(names[1:], boot[1:]):
            diff = b - boot[0]
            row["runs"][name]["minus_first"] = {"mean": row["runs"][name]["tau"] - row["runs"][names[0]]["tau"],
                                                "se": float(diff.std()),
                                                "ci95": [float(np.quantile(diff, 0.025)), float(np.quantile(diff, 0.975))]}
        rows.append(row)
    Path(out).write_text(json.dumps({"runs": names, "rows": rows}, indent=1) + "\n")
    header = ["set", "drafting", "prompts"] + [f"tau {n}" for n in names] + [f"{n} - {names[0]} (95% CI)" for n in names[1:]]
    print("\t".join(header))
    for row in rows:
        cells = [row["eval_set"], row["drafting"], str(row["prompts"])]
        cells += [f"{row['runs'][n]['tau']:.3f} ± {row['runs'][n]['se']:.3f}" for n in names]
        for n in names[1:]:
            d = row["runs"][n]["minus_first"]
            cells.append(f"{d['mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")
        print("\t".join(cells))


if __name__ == "__main__":
    main(*sys.argv[1:])
