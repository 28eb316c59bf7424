# Helpers and input functions for every rule; rule files hold rules only.
import json
import re
import shlex
import sys
from pathlib import Path

from snakemake.utils import validate

from eaglenest import layout, plan, settings
from eaglenest.model.draft_tree import Drafting
from eaglenest.sglang import SERVICE_STARTING_SHELL
from eaglenest.stages import eval_sets

validate(config, schema="../config/schema.yaml")

# Every path under results/<run>/ and logs/<run>/ comes from eaglenest.layout, which recon
# and the test harnesses read too.
LAYOUT = layout.RunLayout(config)
RUN_DIR = LAYOUT.run_dir
# extract.hidden_dir: results/<run>/hidden becomes a link to it, before any rule names a shard.
plan.link_hidden_dir(RUN_DIR, config["extract"]["hidden_dir"], config["run"])
LAYER_IDS = plan.layer_ids(config)
NUM_SHARDS = plan.num_shards(config)
SHARD_IDS = [f"{i:05d}" for i in range(NUM_SHARDS)]


wildcard_constraints:
    shard=r"\d{5}",
    block=r"\d{5}",


def run_path(*parts):
    return LAYOUT.run_path(*parts)


def log_path(*parts):
    return LAYOUT.log_path(*parts)


def benchmark_path(*parts):
    # Under logs/<run>/benchmarks: measurements of this run's jobs, not project source.
    return LAYOUT.benchmark_path(*parts)


def prepared_path(*parts):
    return LAYOUT.prepared_path(*parts)


def prepared_shards():
    return expand(prepared_path("shard-{shard}.safetensors"), shard=SHARD_IDS)


def regenerated_path(*parts):
    return LAYOUT.regenerated_path(*parts)


def prepare_conversations(wildcards):
    """What a shard's prepare job tokenizes: the shard's regenerated conversations when
    regeneration is on (the same sharding), else all ingested conversations."""
    if plan.regeneration(config):
        return [regenerated_path(f"shard-{wildcards.shard}.jsonl")]
    return [LAYOUT.conversations()]


def prepare_originals(wildcards):
    """The ingested conversations, whose original answers a shard keeps beside the
    regenerated ones (regenerate.mix_original) or instead of them for a share of the
    conversations (regenerate.original_share), or none."""
    regenerate = config["regenerate"]
    if plan.regeneration(config) and (
        regenerate["mix_original"] or regenerate["original_share"]
    ):
        return [LAYOUT.conversations()]
    return []


if config["regenerate"]["mix_original"] and config["regenerate"]["original_share"]:
    raise ValueError(
        "regenerate.mix_original keeps every conversation's original answers beside the "
        "target's; regenerate.original_share keeps them instead of the target's for a share "
        "of the conversations: set one of them"
    )


def regeneration_targets():
    if plan.regeneration(config):
        return [regenerated_path("regenerate_report.json")]
    return []


def draft_vocab_source():
    """The file an earlier run's draft vocabulary is read from (consolidate.draft_vocab_from),
    as an input, so that a changed one makes consolidate run again (a param would rerun every
    consolidate made before the option existed); or none. The job reads it from there.
    """
    source = config["consolidate"]["draft_vocab_from"]
    if not source:
        return []
    return [
        (
            source
            if Path(source).suffix == ".safetensors"
            else str(Path(source) / "model.safetensors")
        )
    ]


def hidden_shards():
    return [LAYOUT.hidden_shard(shard) for shard in SHARD_IDS]


# extract.backend sglang with extract.sglang.start_server: the shards are cut into blocks
# of shards_per_server, and each block is extracted through a server of its own (rule
# sglang_server), a service in one group with the block's shard jobs (docs/cluster.md).
SERVER_PER_BLOCK = (
    config["extract"]["backend"] == "sglang"
    and config["extract"]["sglang"]["start_server"]
)
SGLANG_GROUP = "sglang_node" if SERVER_PER_BLOCK else None
if SERVER_PER_BLOCK and config["extract"]["gpus_per_job"]:
    raise ValueError(
        "extract.gpus_per_job is for shard jobs that hold GPUs themselves; with "
        "extract.sglang.start_server the block's server holds target.tensor_parallel GPUs "
        "and its shard jobs none: remove extract.gpus_per_job, or set "
        "extract.sglang.start_server: false for a server started by hand"
    )


def shard_block(shard):
    """The block of a shard: which server extracts it."""
    return f"{int(shard) // config['extract']['sglang']['shards_per_server']:05d}"


def block_server(wildcards):
    """A shard job's server as a named input, or none. Flagged service(), Snakemake records
    it as "<service>" for the input rerun trigger, not by path: a shard that moves to
    another block (a changed shards_per_server) is not extracted again."""
    if not SERVER_PER_BLOCK:
        return {}
    block = shard_block(wildcards.shard)
    return {"server": service(LAYOUT.server_record(block))}


def extract_gpus():
    # A client of its block's server holds no GPU: the server job holds them.
    return 0 if SERVER_PER_BLOCK else config["extract"]["gpus_per_job"]


# regenerate.backend openai with regenerate.start_server: one SGLang server, started by the
# workflow in serve mode, answers every regenerate job (rule regenerate_server); a service
# in one group with them, like an extraction block's.
REGENERATE_SERVER = (
    plan.regeneration(config)
    and config["regenerate"]["backend"] == "openai"
    and config["regenerate"]["start_server"]
)
REGENERATE_GROUP = "regenerate_node" if REGENERATE_SERVER else None
SYNTHESIZE_GROUP = "synthesize_node" if REGENERATE_SERVER else None


def regenerate_server(wildcards):
    """A regenerate job's server as a named input, or none (see block_server)."""
    if not REGENERATE_SERVER:
        return {}
    return {"server": service(LAYOUT.regenerate_server_record())}


def synthesize_server(wildcards):
    """A synthesize job's server (rule synthesize_server), as regenerate_server's."""
    if not REGENERATE_SERVER:
        return {}
    return {"server": service(LAYOUT.synthesize_server_record())}


def regenerate_threads():
    # A client of the server mostly waits on it (see extract_threads).
    return 0 if REGENERATE_SERVER else config["regenerate"]["threads"]


def regenerate_gpus():
    # The server job holds the GPUs its clients use.
    return 0 if REGENERATE_SERVER else config["regenerate"]["gpus_per_job"]


# Rules sglang_server, regenerate_server and evaluate_server: the launcher as a service.
# The service file first names the shell (SERVICE_STARTING_SHELL says why). exec:
# Snakemake's SIGTERM must reach the launcher, which stops the server. PYTHONPATH: the
# sglang env does not install eaglenest (envs/sglang.yaml).
LAUNCHER_SHELL = (
    SERVICE_STARTING_SHELL + " && "
    "PYTHONPATH={params.repo:q}${{PYTHONPATH:+:$PYTHONPATH}} "
    "exec {params.python:q} -m eaglenest.sglang.launch --mode {params.mode} --service-file {output:q} "
    "--state-dir {params.state_dir:q} --config-json {params.config_json:q} "
    "> {log.launcher:q} 2>&1"
)
# Rule evaluate_server: the same, with the setting's EAGLE-3 flags (none for the plain server).
EVAL_LAUNCHER_SHELL = LAUNCHER_SHELL.replace(
    "> {log.launcher:q}", "{params.speculation} > {log.launcher:q}"
)


def extract_threads():
    # A client of its block's server mostly waits on it. Snakemake adds up the threads of
    # a service and all its consumers and refuses a group above --cores, even in a dry
    # run (which plans with one core): clients that count none keep a block plannable.
    return 0 if SERVER_PER_BLOCK else config["extract"]["threads"]


def server_launch_config():
    """The part of the run's config the launcher reads, as JSON for its command line."""
    return json.dumps({key: config[key] for key in ("run", "target", "extract")})


def untracked_param(value):
    """A param that never reruns its job (for rule sglang_server, the shards its server served).

    Snakemake records params for the params rerun trigger, except those computed from the
    output ("derived"). A server job that Snakemake finds changed must run again, and so
    must every consumer of its service: a new interpreter path or timeout must not."""
    return lambda wildcards, output: value


def server_state_dir(wildcards, output):
    # Of the output too, like untracked_param: where the logs go is no reason to rerun.
    if "setting" in wildcards.keys():
        return log_path("sglang", "evaluate", wildcards.setting)
    if "block" not in wildcards.keys():  # regenerate or synthesize: its record's name
        return log_path("sglang", Path(output[0]).stem)
    return log_path("sglang", f"block-{wildcards.block}")


def launcher_python():
    """The launcher's interpreter: the rule's conda env under --software-deployment-method
    conda, else the one running Snakemake (the interpreter script: rules get)."""
    from snakemake.settings.types import DeploymentMethod

    if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method:
        return "python"
    return sys.executable


def embedded_target_dir():
    return str(layout.EMBEDDED_TARGET_DIR)


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
        LAYOUT.source_path(source)
        for source in config["data"]["sources"]
        if source.get("embedded")
        or source.get("synthesize")
        or Path(source["path"]).exists()
    ]


def ingest_sources():
    """data.sources as ingest reads them: a synthesized source with its file's path."""
    return [
        dict(source, path=LAYOUT.source_path(source))
        for source in config["data"]["sources"]
    ]


def synthesized_source(wildcards):
    """The data.sources entry rule synthesize_prompts writes (by its name)."""
    for source in config["data"]["sources"]:
        if source["name"] == wildcards.source and source.get("synthesize"):
            return source
    raise ValueError(
        f"no synthesized source named {wildcards.source!r} in data.sources"
    )


def check_synthesized_sources():
    """A synthesized source has prompts only: without regeneration nothing answers them."""
    names = [s["name"] for s in config["data"]["sources"] if s.get("synthesize")]
    if names and not config["regenerate"]["enabled"]:
        raise ValueError(
            f"data.sources {', '.join(names)}: synthesized prompts are answered by the "
            "regenerate stage; set regenerate.enabled: true"
        )


check_synthesized_sources()


def embedded_sources():
    return [s for s in config["data"]["sources"] if s.get("embedded") == "sharegpt"]


def all_targets():
    # Hidden shards are targets themselves: a deleted or lost shard is rebuilt alone
    # even when everything downstream of it still exists.
    return hidden_shards() + [
        LAYOUT.ingest_report(),
        *regeneration_targets(),
        LAYOUT.prepare_report(),
        *LAYOUT.consolidated_files(),
        LAYOUT.drafter_dir(),
        LAYOUT.training_summary(),
        LAYOUT.export_report(),
        *evaluation_targets(),
    ]


def evaluation_path(*parts):
    return LAYOUT.evaluation_path(*parts)


# evaluate.sets: built-in names and the user's own sets ({name, path} or {name, split}).
EVAL_SETS = eval_sets.set_names(config["evaluate"]["sets"])
USER_EVAL_SETS = eval_sets.user_sets(config["evaluate"]["sets"])


def eval_set_path(eval_set):
    """A set's prompts: where a fetch_eval_* rule unpacks a built-in set, or the prompts
    that rule evaluate_prompts reads from a user set."""
    if eval_set in USER_EVAL_SETS:
        return eval_prompts_path(eval_set)
    return layout.eval_set_path(eval_set)


def eval_prompts_path(eval_set):
    return LAYOUT.eval_prompts(eval_set)


def eval_prompt_report_path(eval_set):
    return LAYOUT.eval_prompt_report(eval_set)


def eval_set_pattern(names=None):
    """A wildcard constraint that matches exactly the names of evaluate.sets (or ``names``)."""
    names = EVAL_SETS if names is None else names
    # An empty alternation would match the empty name: match nothing instead.
    return "|".join(re.escape(name) for name in names) or "(?!)"


def user_eval_set_pattern():
    return eval_set_pattern(list(USER_EVAL_SETS))


def user_eval_set(wildcards):
    """The evaluate.sets entry of a user set (params of rule evaluate_prompts)."""
    return USER_EVAL_SETS[wildcards.eval_set]


def user_eval_set_inputs(wildcards):
    """What a user set's prompts are read from: its chats file, or (split sets) the run's
    conversations and consolidate's split. A chats file that is not in place yet is left
    out, so that `snakemake -n` can still plan the run; the job then names it."""
    entry = USER_EVAL_SETS[wildcards.eval_set]
    if "split" in entry:
        return {
            "conversations": LAYOUT.conversations(),
            "split": LAYOUT.consolidated("split.json"),
        }
    return {"chats": entry["path"]} if Path(entry["path"]).exists() else {}


def eval_set_num_prompts(wildcards):
    return eval_sets.num_prompts(
        config["evaluate"]["sets"],
        wildcards.eval_set,
        config["evaluate"]["num_prompts"],
    )


def drafting_configs():
    """Drafting configuration name (steps<k>-topk<k>-tokens<n>) -> its settings."""
    configs = {}
    for values in config["evaluate"]["drafting"]:
        drafting = Drafting.from_dict(values)
        configs[drafting.name] = {
            "steps": drafting.steps,
            "topk": drafting.topk,
            "tokens": drafting.tokens,
        }
    return configs


def train_start_input():
    """The drafter a warm start begins from (train.init_from), as an input: a changed file reruns training."""
    start = config["train"].get("init_from")
    return [start] if start else []


def evaluation_drafter():
    """The drafter to evaluate: evaluate.drafter when set, else the one this run trains."""
    return config["evaluate"].get("drafter") or LAYOUT.drafter_dir()


def evaluation_part_path(eval_set, drafting, chunk):
    return evaluation_path(eval_set, drafting, "chunks", f"{chunk}.json")


def evaluation_reference_path(eval_set, chunk):
    return evaluation_path(eval_set, "reference", "chunks", f"{chunk}.json")


def evaluation_reference(wildcards):
    """The target's greedy output a replay job replays (evaluate.method replay), else nothing."""
    if config["evaluate"]["method"] != "replay":
        return []
    return evaluation_reference_path(wildcards.eval_set, wildcards.chunk)


def reference_lookahead():
    """Tokens the reference decodes past each stop: the deepest draft can be accepted there."""
    return max(drafting["steps"] for drafting in drafting_configs().values())


# evaluate.backend sglang: SGLang fixes the drafting setting at launch, so one server per
# setting of evaluate.drafting serves it with the run's SGLang export as its EAGLE-3 draft
# model, and one plain server the baseline (rule evaluate_server); each is a service grouped
# with its evaluation jobs, one per eval set (rule evaluate_sglang). A rerun starts servers
# only for settings with an eval set left to measure.
EVAL_SERVERS = config["evaluate"]["backend"] == "sglang"
EVAL_SERVER_STARTED = EVAL_SERVERS and config["evaluate"]["sglang"]["start_server"]
EVAL_SERVER_GROUP = "evaluate_node" if EVAL_SERVER_STARTED else None
PLAIN_SERVER = "plain"
if EVAL_SERVERS and config["evaluate"]["temperature"] != 0:
    raise ValueError(
        "evaluate.backend sglang measures greedy decoding (lossless against the plain server): "
        "set evaluate.temperature: 0"
    )


def eval_server_settings():
    """The evaluation servers: the plain one and one per drafting setting."""
    return [PLAIN_SERVER, *drafting_configs()]


if EVAL_SERVERS and not EVAL_SERVER_STARTED:
    missing_urls = [
        name
        for name in eval_server_settings()
        if not config["evaluate"]["sglang"]["urls"].get(name)
    ]
    if missing_urls:
        raise ValueError(
            "evaluate.sglang.start_server is false, so evaluate.sglang.urls must name the server "
            f"started by hand for every setting; missing: {', '.join(missing_urls)}"
        )


def eval_server_setting_pattern():
    return "|".join(re.escape(name) for name in eval_server_settings())


def evaluation_export():
    """The SGLang export the evaluation servers draft with: evaluate.drafter when set (an
    SGLang export), else the one this run's export stage writes."""
    return config["evaluate"].get("drafter") or LAYOUT.export_path("sglang")


def evaluation_server_part_path(eval_set, setting):
    return evaluation_path(eval_set, setting, "server.json")


def evaluation_server_input(wildcards):
    """An evaluation job's server as a named input (see block_server), or none."""
    if not EVAL_SERVER_STARTED:
        return {}
    return {"server": service(LAYOUT.evaluate_server_record(wildcards.setting))}


def evaluation_server_url(wildcards):
    """evaluate.sglang.start_server false: the URL of the server started by hand."""
    if EVAL_SERVER_STARTED:
        return None
    return config["evaluate"]["sglang"]["urls"].get(wildcards.setting)


def evaluation_server_drafter(wildcards):
    """What a setting's server drafts with, as an input: none for the plain one."""
    if wildcards.setting == PLAIN_SERVER:
        return {}
    return {"drafter": evaluation_export()}


def evaluation_server_drafting(wildcards):
    return drafting_configs().get(wildcards.setting)


def evaluation_server_speculation(wildcards, input, output):
    """The launcher's speculative flags for rule evaluate_server, derived from the output, so untracked."""
    if wildcards.setting == PLAIN_SERVER:
        return ""
    drafting = json.dumps(drafting_configs()[wildcards.setting])
    extra = json.dumps(config["evaluate"]["sglang"]["extra_args"])
    return (
        f"--drafting-json {shlex.quote(drafting)} --draft-model {shlex.quote(input.drafter)} "
        f"--draft-extra-args-json {shlex.quote(extra)}"
    )


def evaluation_parts(wildcards):
    """What one eval set x drafting configuration's metrics are merged from: its chunk files
    (evaluate.prompt_chunks), or with backend sglang its server's file and the plain server's.
    """
    if EVAL_SERVERS:
        return [
            evaluation_server_part_path(wildcards.eval_set, wildcards.drafting),
            evaluation_server_part_path(wildcards.eval_set, PLAIN_SERVER),
        ]
    return [
        evaluation_part_path(wildcards.eval_set, wildcards.drafting, chunk)
        for chunk in range(config["evaluate"]["prompt_chunks"])
    ]


def evaluation_metrics():
    return expand(
        evaluation_path("{eval_set}", "{drafting}", "metrics.json"),
        eval_set=EVAL_SETS,
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


PLAN = plan.plan(config, LAYOUT.prepare_report())
print(plan.describe(config, PLAN), file=sys.stderr)
