"""Validation accuracy against training tokens: the full set and the two 1K-conversation arms
(original and regenerated answers) of an H200 run.

    python benchmarks/plot_h200_run.py docs/results/h200-2026-11-29/run3
reads the training_curve-<name>.json files there (names below) and writes
val_acc_by_tokens.png beside them.
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CURVES = {
    "full": "full set (16,213 samples), 1 epoch",
    "full-partial": "full set (16,213 samples), 1 epoch stopped at 64 %",
    "1k-original": "1K subset, original answers, 3 epochs",
    "1k-regenerated": "1K subset, regenerated answers, 3 epochs",
}


def tokens_per_step(curve: dict) -> float:
    """Mean training tokens per optimizer step of the run the curve belongs to."""
    if "summary" in curve:  # a finished run: its own totals
        summary = curve["summary"]
        return summary["tokens_this_invocation"] / (summary["steps"] - summary["resumed_from_step"])
    return curve["train_tokens_per_epoch"] / curve["steps_per_epoch"]


def main(directory: str) -> None:
    directory = Path(directory)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colors = {"full": "tab:blue", "full-partial": "tab:blue", "1k-original": "tab:orange", "1k-regenerated": "tab:green"}
    for name, label in CURVES.items():
        path = directory / f"training_curve-{name}.json"
        if not path.exists():
            continue
        curve = json.loads(path.read_text())
        per_step = tokens_per_step(curve)
        tokens = [point["step"] * per_step / 1e6 for point in curve["val"]]
        for position, style in ((0, "-"), (6, "--")):
            ax.plot(tokens, [point["acc"][position] for point in curve["val"]], style, marker=".",
                    color=colors[name], label=f"{label}, TTT pos {position}")
        last = curve["val"][-1]
        print(f"{name:15s} step {last['step']:5d}  {tokens[-1]:6.2f}M tokens  "
              + " ".join(f"{a:.4f}" for a in last["acc"]))
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("validation accuracy (draft = target argmax)")
    ax.set_title("SmolLM2-135M drafter, TTT 7, fp8 states, one H200, 2026-11-29", fontsize=9)
    ax.legend(fontsize=6.5)
    fig.tight_layout()
    fig.savefig(directory / "val_acc_by_tokens.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1])
