"""Are two evaluations on the same references? One drafter replayed on a run's references
against the traces recorded when it was replayed on another run's: on identical references
(the target's greedy tokens and the prompts), replay is deterministic, so every prompt's
trace (accepted tokens and draft depths per cycle) comes out the same.

    python benchmarks/same_references.py --replayed results/<run>/evaluate \\
        --recorded docs/results/<earlier run>/evaluate --what "..." --out check.json

Exits non-zero when any prompt's trace differs (or a job is missing on either side).
"""
import argparse
import json
import sys
from datetime import date
from pathlib import Path


def compare(replayed: Path, recorded: Path) -> list[dict]:
    rows = []
    for job in sorted(recorded.glob("*/steps*/metrics.json")):
        eval_set, drafting = job.parts[-3], job.parts[-2]
        other = replayed / eval_set / drafting / "metrics.json"
        if not other.exists():
            rows.append({"eval_set": eval_set, "drafting": drafting, "missing": str(other)})
            continue
        a, b = json.loads(other.read_text()), json.loads(job.read_text())
        traces = {p["id"]: (p["accepted"], p["draft_depths"]) for p in a["per_prompt"]}
        identical = sum(traces.get(p["id"]) == (p["accepted"], p["draft_depths"]) for p in b["per_prompt"])
        rows.append({"eval_set": eval_set, "drafting": drafting, "prompts": len(b["per_prompt"]),
                     "traces_identical": identical, "tau_replayed": a["tau"], "tau_recorded": b["tau"]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replayed", type=Path, required=True, help="the evaluate/ folder of the replay on the new references")
    parser.add_argument("--recorded", type=Path, required=True, help="the evaluate/ folder of the same drafter's earlier replay")
    parser.add_argument("--what", default="", help="a line on what was replayed where")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = compare(args.replayed, args.recorded)
    args.out.write_text(json.dumps({"what": args.what, "date": date.today().isoformat(), "rows": rows}, indent=1) + "\n")
    print("| eval set | drafting | prompts | traces identical | τ replayed | τ recorded |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['eval_set']} | {r['drafting']} | {r.get('prompts', '-')} | {r.get('traces_identical', 'missing')} "
              f"| {r.get('tau_replayed', '-')} | {r.get('tau_recorded', '-')} |")
    same = bool(rows) and all("missing" not in r and r["traces_identical"] == r["prompts"] for r in rows)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
