"""Validation accuracy of saved drafters on a run's held-out conversations, both as ShareGPT
wrote them and as the target answered them, side by side, on any machine (two CPU cores do).

The held-out conversations are the ``val`` ids of a consolidated split.json (every run with the
same consolidate.seed, val_fraction and conversations holds out the same ones), the first
``--count`` in the hash order of benchmarks/heldout_eval_set.py. Each version becomes a run of
its own, made by the real workflow up to consolidate (``snakemake hidden_states``: ingest,
prepare, extraction with the configs' target, layer ids, max_len and storage dtype) with the
draft vocabulary of the first drafter (consolidate.draft_vocab_from); then every drafter is
scored on every sample of both runs with the training loop's validation (TTT positions 0 to
ttt_length - 1, the configs' train section).

    python benchmarks/heldout_validation.py --split docs/results/<run>/split.json \\
        --original results/<run>/data/conversations.jsonl \\
        --regenerated 'results/<run>/regenerated/<key>/shard-*.jsonl' \\
        --drafter run10=resources/drafters/<a> --drafter own-answers=resources/drafters/<b> \\
        --config config/h200-smollm2.yaml --config config/h200/own-answers.yaml \\
        --count 100 --device cpu --out benchmarks/results/heldout_validation_<date>.json

Prints one row per (drafter, answers) and writes them to ``--out`` as JSON.
"""
import argparse
import contextlib
import glob
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import heldout_eval_set  # noqa: E402

from eaglenest.layout import RunLayout  # noqa: E402
from eaglenest.node.recon.config import load_config  # noqa: E402
from eaglenest.stages import train  # noqa: E402

def run_overlay(name: str, conversations: Path, count: int, samples_per_shard: int, device: str,
                draft_vocab_from: str) -> dict:
    """The config overlay of one version's run: its conversations, the extraction on ``device``,
    the drafters' draft vocabulary, no regeneration."""
    return {
        "run": name,
        "data": {"sources": [{"name": "heldout", "path": str(conversations)}], "max_conversations": count,
                 "samples_per_shard": samples_per_shard},
        "regenerate": {"enabled": False},
        "extract": {"backend": "transformers", "device": device, "gpus_per_job": 0 if device == "cpu" else 1},
        "consolidate": {"draft_vocab_from": draft_vocab_from},
        "train": {"device": device, "init_from": None},
    }


def build_run(directory: Path, configs: list[str], cores: int, log_path: Path) -> dict:
    """Run the workflow in ``directory`` up to consolidate for one version (its overlay last in
    ``configs``); returns the run's config as the Snakefile saw it."""
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(directory),
               "--cores", str(cores), "--configfile", *configs, "--", "hidden_states"]
    with open(log_path, "w") as log:
        subprocess.run(command, cwd=directory, stdout=log, stderr=subprocess.STDOUT, check=True)
    return load_config(directory, configs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", type=Path, required=True, help="a consolidated split.json: its val ids are held out")
    parser.add_argument("--original", type=Path, required=True, help="the ingested conversations.jsonl")
    parser.add_argument("--regenerated", required=True, help="the regenerated shards, a glob (quote it)")
    parser.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH",
                        help="repeatable; the first one's draft vocabulary is the runs'")
    parser.add_argument("--config", action="append", default=[], help="repeatable: the configs of the drafters' run")
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--offset", type=int, default=0,
                        help="skip that many first (another set of the same held-out conversations, e.g. the next 50)")
    parser.add_argument("--samples-per-shard", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows-per-step", type=int, default=1,
                        help="rows of train.token_budget scored at once (the configs' fill a GPU; one row of "
                             "data.max_len tokens keeps a CPU's memory at a few GB); each sample is scored alone "
                             "in its row whatever the packing")
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--directory", type=Path, default=REPO,
                        help="the workflow's working directory (results/ and logs/ of both runs go there)")
    parser.add_argument("--work", type=Path, default=None,
                        help="the conversation files, overlays and logs (default DIRECTORY/results/heldout-validation)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    drafters = {name: str(Path(path).resolve()) for name, path in (item.split("=", 1) for item in args.drafter)}
    regenerated = sorted(Path(p).resolve() for p in glob.glob(args.regenerated))
    if not regenerated:
        parser.error(f"--regenerated {args.regenerated!r} matches no file")
    args.split, args.original, args.out = args.split.resolve(), args.original.resolve(), args.out.resolve()
    args.directory = args.directory.resolve()
    args.config = [str(Path(config).resolve()) for config in args.config]
    args.work = (args.work or args.directory / "results" / "heldout-validation").resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    # The consolidated indexes name their shards relative to the workflow's directory.
    with contextlib.chdir(args.directory):
        return validate_both(args, drafters, regenerated)


def validate_both(args, drafters: dict[str, str], regenerated: list[Path]) -> int:
    """Both versions made into runs, every drafter scored on both; the table to ``args.out``."""
    sources = {"sharegpt": [args.original], "target": regenerated}  # ShareGPT's answers; the target's (regenerated)
    held_out = {version: heldout_eval_set.heldout(args.split, paths, args.offset + args.count)[args.offset:]
                for version, paths in sources.items()}
    ids = {version: [row["id"] for row in rows] for version, rows in held_out.items()}
    if ids["sharegpt"] != ids["target"]:
        raise SystemExit("the original and regenerated files do not hold the same held-out conversations")
    rows, timings = [], {}
    for version, conversations in held_out.items():
        path = args.work / f"{version}.jsonl"
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in conversations))
        # A run of its own per set of conversations: its hidden shards are extracted once and
        # never taken for another set's (the workflow does not re-extract a shard whose
        # prepared input changed; consolidate refuses it as stale).
        digest = hashlib.sha256("\n".join(ids[version]).encode()).hexdigest()[:10]
        overlay = run_overlay(f"heldout-validation-{version}-{digest}", path, len(conversations), args.samples_per_shard,
                              args.device, next(iter(drafters.values())))
        overlay_path = args.work / f"{overlay['run']}.yaml"
        overlay_path.write_text(yaml.safe_dump(overlay, sort_keys=False))
        started = time.monotonic()
        config = build_run(args.directory, [*args.config, str(overlay_path)], args.cores,
                           args.work / f"{version}.snakemake.log")
        timings[f"{version}_data_s"] = round(time.monotonic() - started, 1)
        for row in score_drafters(config, args.directory, drafters, args.rows_per_step, version, timings):
            rows.append({**row, "conversations": len(conversations)})
    table = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
             "device": args.device, "split": str(args.split), "offset": args.offset, "count": args.count,
             "configs": args.config,
             "rows_per_step": args.rows_per_step,
             "conversation_ids": ids["sharegpt"], "seconds": timings, "rows": rows}
    args.out.write_text(json.dumps(table, indent=1))
    print(f"-> {args.out}")
    return 0


def score_drafters(config: dict, directory: Path, drafters: dict[str, str], rows_per_step: int, answers: str,
                   timings: dict, by_confidence: bool = False, confidence_edges=None) -> list[dict]:
    """Every drafter scored on every sample of a run the workflow made (``config``, as
    :func:`build_run` returns it): a row per drafter, printed as it comes; each one's seconds
    into ``timings`` as ``<answers>_<name>_s``."""
    layout = RunLayout(config, directory)
    consolidated = [layout.consolidated(name) for name in ("index.json", "draft_vocab.safetensors", "split.json")]
    settings = {**config["train"], "rows_per_step": rows_per_step, "token_budget": config["data"]["max_len"]}
    rows = []
    for name, drafter in drafters.items():
        started = time.monotonic()
        result = train.validate_drafter(drafter, *consolidated, directory / config["target"]["path"], settings,
                                        split="all", by_confidence=by_confidence, confidence_edges=confidence_edges)
        timings[f"{answers}_{name}_s"] = round(time.monotonic() - started, 1)
        rows.append({"drafter": name, "path": drafter, "answers": answers, "run": config["run"], **result})
        print_row(rows[-1])
    return rows


def print_row(row: dict) -> None:
    acc = " ".join(f"{a:.3f}" for a in row["acc"])
    print(f"{row['drafter']:<14} {row['answers']:<9} positions {row['positions'][0]:>7}  acc by TTT step: {acc}",
          flush=True)
    if "by_confidence" in row:
        binned = row["by_confidence"]
        for (low, high), share, acc, sure in zip(binned["bins"], binned["share"][0], binned["acc"][0],
                                                 binned["mean_sureness"][0]):
            shown = "-" if acc is None else f"{acc:.3f}"
            mean = "" if sure is None else f" (mean {sure:.3f})"
            print(f"    target's top-token probability {low:.2f}-{high:.2f}{mean}: {share:6.1%} of positions, "
                  f"acc at step 0 {shown}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
