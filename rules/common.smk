# Helpers and input functions for every rule; rule files hold rules only.
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


def prepared_path(*parts):
    return run_path("prepared", plan.prepared_key(config), *parts)


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
        run_path("export", "export_report.json"),
        *evaluation_targets(),
    ]


def evaluation_path(*parts):
    return run_path("evaluate", *parts)


def eval_set_path(eval_set):
    """Where the fetch_eval_* rules unpack each eval set's prompts."""
    names = {"mt_bench": "mt_bench_question.jsonl", "humaneval": "HumanEval.jsonl.gz"}
    return str(Path("resources") / "eval" / names[eval_set])


def drafting_configs():
    """Drafting configuration name (steps<k>-topk<k>-tokens<n>) -> its settings."""
    from eaglenest.speculate import Drafting

    configs = {}
    for values in config["evaluate"]["drafting"]:
        drafting = Drafting.from_dict(values)
        configs[drafting.name] = {
            "steps": drafting.steps,
            "topk": drafting.topk,
            "tokens": drafting.tokens,
        }
    return configs


def evaluation_drafter():
    """The drafter to evaluate: evaluate.drafter when set, else the one this run trains."""
    return config["evaluate"].get("drafter") or run_path("train", "drafter")


def evaluation_metrics():
    return expand(
        evaluation_path("{eval_set}", "{drafting}", "metrics.json"),
        eval_set=config["evaluate"]["sets"],
        drafting=list(drafting_configs()),
    )


def evaluation_targets():
    if not config["evaluate"]["enabled"]:
        return []
    return [evaluation_path("summary.json"), evaluation_path("summary.tsv")]


onsuccess:
    summary = Path(evaluation_path("summary.json"))
    if config["evaluate"]["enabled"] and summary.exists():
        headline = json.loads(summary.read_text())["headline"]
        print(
            f"eaglenest: {headline}\nreport: snakemake --report report.html",
            file=sys.stderr,
        )


PLAN = plan.plan(config, prepared_path("prepare_report.json"))
print(plan.describe(config, PLAN), file=sys.stderr)
