"""Validation accuracy of a saved drafter on a run's validation split, eager (no train.compile).

    python benchmarks/validate_drafter.py --run results/h200-smollm2 --drafter <dir> \\
        --target resources/models/SmolLM2-135M-Instruct --config config/h200-smollm2.yaml ... --out v.json

The settings (ttt_length, token_budget, rows_per_step, device) are the merged configs' train
section, so the split is read in the same steps as the training run's validation.
"""
import argparse
import json
import sys
from pathlib import Path

import yaml

from eaglenest.stages import train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="results/<run>: its consolidated/ is read")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--config", action="append", default=[], help="repeatable, merged in order (train section)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    settings = {}
    for path in args.config:
        settings.update((yaml.safe_load(Path(path).read_text()) or {}).get("train", {}))
    keep = set(train.DEFAULTS)
    settings = {key: value for key, value in settings.items() if key in keep}
    consolidated = args.run / "consolidated"
    result = train.validate_drafter(args.drafter, consolidated / "index.json", consolidated / "draft_vocab.safetensors",
                                    consolidated / "split.json", args.target, settings)
    result = {"drafter": args.drafter, "configs": args.config, **result}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"acc": [round(a, 4) for a in result["acc"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
