# Helpers and input functions for every rule; rule files hold rules only.
import hashlib
import json
import sys
from pathlib import Path

from snakemake.utils import validate

from eaglenest import plan

validate(config, schema="../config/schema.yaml")

RUN_DIR = Path("results") / config["run"]
LAYER_IDS = plan.layer_ids(config)
NUM_SHARDS = plan.num_shards(config)
SHARD_IDS = [f"{i:05d}" for i in range(NUM_SHARDS)]


wildcard_constraints:
    shard=r"\d{5}",


def run_path(*parts):
    return str(RUN_DIR.joinpath(*parts))


def log_path(*parts):
    return str(Path("logs") / config["run"] / Path(*parts))


def benchmark_path(*parts):
    return str(Path("benchmarks") / "jobs" / config["run"] / Path(*parts))


def prepared_key():
    """Short hash of everything that decides what prepare writes (sample selection, target).

    Prepared shards live under prepared/<key>/: a change of these settings makes new
    paths, so the extraction of every shard is planned again, while a prepare job that
    reruns without a content change (a touched source, a deleted prepared shard) rewrites
    the same paths, which extraction reads as ancient() and so ignores.
    """
    settings = dict(sample_selection(), target=config["target"]["name"])
    blob = json.dumps(settings, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def prepared_path(*parts):
    return run_path("prepared", prepared_key(), *parts)


def prepared_shards():
    return expand(prepared_path("shard-{shard}.safetensors"), shard=SHARD_IDS)


def hidden_shards():
    return expand(run_path("hidden", "shard-{shard}.safetensors"), shard=SHARD_IDS)


def embedded_target_dir():
    return str(Path("resources") / "models" / "SmolLM2-135M-Instruct")


def target_model_input():
    """The model directory as an input only when the workflow makes it.

    ancient(): re-converting the same weights must not re-extract terabytes; the
    target's identity (target.name) is a param of every content-defining rule instead.
    """
    if config["target"].get("embedded"):
        return ancient(config["target"]["path"])
    return []


def source_inputs():
    """Source files as inputs. A source the user brings and has not put in place yet is
    left out so that `snakemake -n` can still plan the run; ingest then names it."""
    return [
        source["path"]
        for source in config["data"]["sources"]
        if source.get("embedded") or Path(source["path"]).exists()
    ]


def embedded_sources():
    return [s for s in config["data"]["sources"] if s.get("embedded") == "sharegpt"]


def sample_selection():
    """Every setting that decides which samples (and tokens) land in which shard.

    Source names, not paths: moving the data to another disk changes no shard.
    """
    data = config["data"]
    return {
        "sources": [s["name"] for s in data["sources"]],
        "max_conversations": data["max_conversations"],
        "samples_per_shard": data["samples_per_shard"],
        "leading_assistant": data["leading_assistant"],
        "max_len": data["max_len"],
    }


# Training settings that decide the drafter's weights (eaglenest.train.CONTENT_KEYS): a
# change reruns training; the other train keys only change speed or bookkeeping.
TRAIN_CONTENT_KEYS = [
    "ttt_length", "decay", "epochs", "token_budget", "rows_per_step", "lr", "min_lr_ratio",
    "warmup_steps", "weight_decay", "max_grad_norm", "seed", "init_head_from_target", "drafter",
]


def all_targets():
    # Hidden shards are targets themselves: a deleted or lost shard is rebuilt alone
    # even when everything downstream of it still exists.
    return hidden_shards() + [
        run_path("data", "ingest_report.json"),
        prepared_path("prepare_report.json"),
        run_path("consolidated", "index.json"),
        run_path("consolidated", "draft_vocab.safetensors"),
        run_path("consolidated", "split.json"),
        run_path("train", "drafter"),
        run_path("train", "training_summary.json"),
    ]


PLAN = plan.plan(config, prepared_path("prepare_report.json"))
print(plan.describe(config, PLAN), file=sys.stderr)
