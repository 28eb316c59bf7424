"""Validation accuracy of one drafter trained across warm-started runs, against epochs seen.

Each run's training curve (training_curve.json or .json.gz) starts at step 0 under its own
warmup and cosine; this puts the runs end to end, epoch by epoch, and draws the learning rate
under them, so that a flattening caused by a decayed learning rate is told apart from a plateau.

    python benchmarks/plot_warm_start_chain.py OUT.png RUN_DIR [RUN_DIR ...]
e.g. docs/results/h200-2026-12-01-run8 docs/results/h200-2026-12-01-run9 docs/results/h200-2026-12-02-run10
(the order of the chain). Prints the validation table it plots.
"""
import gzip
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

POSITIONS = (0, 3, 6)


def read_curve(run_dir: Path) -> dict:
    plain = run_dir / "training_curve.json"
    if plain.exists():
        return json.loads(plain.read_text())
    with gzip.open(run_dir / "training_curve.json.gz", "rt") as handle:
        return json.load(handle)


def chain(run_dirs: list[Path]) -> tuple[list[dict], list[tuple[float, float]], list[float]]:
    """Validation points and (epoch, lr) points on one epoch axis, and where each run starts."""
    points, rates, starts = [], [], []
    offset = 0.0
    for run_dir in run_dirs:
        curve = read_curve(run_dir)
        summary = curve["summary"]
        steps_per_epoch = summary["steps"] / (1 + max(record["epoch"] for record in curve["train"]))  # epochs count from 0
        starts.append(offset)
        for record in curve["val"]:
            points.append({"run": run_dir.name, "epoch": offset + record["step"] / steps_per_epoch,
                           "acc": record["acc"]})
        rates += [(offset + record["step"] / steps_per_epoch, record["lr"]) for record in curve["train"]]
        offset += summary["steps"] / steps_per_epoch
    return points, rates, starts


def main(out: str, *run_dirs: str) -> None:
    points, rates, starts = chain([Path(run_dir) for run_dir in run_dirs])
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(7.5, 5.2), sharex=True, height_ratios=[3, 1])
    for position in POSITIONS:
        ax.plot([p["epoch"] for p in points], [p["acc"][position] for p in points], marker="o", markersize=3,
                label=f"TTT position {position}")
    for start in starts[1:]:
        ax.axvline(start, color="grey", linewidth=0.8, linestyle=":")
        ax_lr.axvline(start, color="grey", linewidth=0.8, linestyle=":")
    ax.set_ylabel("validation accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax_lr.plot([epoch for epoch, _ in rates], [lr for _, lr in rates], color="black", linewidth=1)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("epochs seen (dotted: a warm start under a new schedule)")
    ax_lr.grid(alpha=0.3)
    fig.suptitle(" -> ".join(Path(run_dir).name for run_dir in run_dirs), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print("run\tepoch\t" + "\t".join(f"acc{position}" for position in POSITIONS))
    for p in points:
        print(f"{p['run']}\t{p['epoch']:.2f}\t" + "\t".join(f"{p['acc'][position]:.4f}" for position in POSITIONS))


if __name__ == "__main__":
    main(*sys.argv[1:])
