"""Validation accuracy of a saved drafter on a run's validation split, eager (no train.compile).

    python benchmarks/validate_drafter.py --run results/h200-smollm2 --drafter <dir> \\
        --target resources/models/SmolLM2-135M-Instruct --config config/h200-smollm2.yaml ... --out v.json

``--samples original`` / ``others`` scores a part of the split: in a regenerate.mix_original
run it holds both versions of each held-out conversation (the original answers as
``<id>@original``), and the split is drawn by conversation with consolidate.seed, so every run
with the same seed, val_fraction and conversations held out the same ones: any of their
drafters can be scored on held-out ShareGPT (original) and on the target's held-out answers
(others) of the mixed run.

The settings (ttt_length, token_budget, rows_per_step, device) are the train section of the
config as the workflow builds it (config/config.yaml, then each --config, schema defaults:
eaglenest.node.recon.config.load_config), so the split is read in the same steps as the training
run's validation.
"""
import argparse
import json
import sys
from pathlib import Path

from eaglenest.node.recon.config import load_config
from eaglenest.stages import train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="results/<run>: its consolidated/ is read")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--config", action="append", default=[], help="repeatable: the run's --configfile files, in order")
    parser.add_argument("--samples", choices=sorted(train.SAMPLE_FILTERS), default="all",
                        help="original: only the <id>@original samples of a regenerate.mix_original run (held-out "
                             "ShareGPT); others: every other sample (the target's held-out answers)")
    parser.add_argument("--split-part", choices=("val", "train", "all"), default="val",
                        help="all: every sample of the run (a run of held-out conversations only)")
    parser.add_argument("--device", help="instead of the configs' train.device (cpu, cuda)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    settings = load_config(".", args.config)["train"]
    if args.device:
        settings["device"] = args.device
    consolidated = args.run / "consolidated"
    result = train.validate_drafter(args.drafter, consolidated / "index.json", consolidated / "draft_vocab.safetensors",
                                    consolidated / "split.json", args.target, settings, samples=args.samples,
                                    split=args.split_part)
    result = {"drafter": args.drafter, "configs": args.config, "samples": args.samples, "split_part": args.split_part,
              **result}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"acc": [round(a, 4) for a in result["acc"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
