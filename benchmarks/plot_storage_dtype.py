"""Validation accuracy per TTT position over training, fp8 against bf16 hidden states.

    python benchmarks/plot_storage_dtype.py docs/results/h200-2026-11-29
reads training_curve-1k-{fp8,bf16}.json there and writes storage_dtype_val_acc.png beside them.
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(directory: str) -> None:
    directory = Path(directory)
    fig, ax = plt.subplots(figsize=(7, 4))
    for dtype, style in (("fp8", "-"), ("bf16", "--")):
        curve = json.loads((directory / f"training_curve-1k-{dtype}.json").read_text())
        steps = [point["step"] for point in curve["val"]]
        for position, color in ((0, "tab:blue"), (3, "tab:orange"), (6, "tab:green")):
            ax.plot(steps, [point["acc"][position] for point in curve["val"]], style, color=color,
                    label=f"{dtype} states, TTT position {position}")
    ax.set_xlabel("training step (up to 4 rows of 4,096 tokens)")
    ax.set_ylabel("validation accuracy (draft = target argmax)")
    ax.set_title("SmolLM2 drafter, 1K ShareGPT conversations, H200, 2026-11-29")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "storage_dtype_val_acc.png", dpi=110)
    for dtype in ("fp8", "bf16"):
        summary = json.loads((directory / f"training_summary-1k-{dtype}.json").read_text())
        print(dtype, " ".join(f"{a:.4f}" for a in summary["final_val_acc"]))


if __name__ == "__main__":
    main(sys.argv[1])
