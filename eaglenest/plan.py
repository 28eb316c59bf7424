"""Planning numbers for a config, cheap enough to compute when the workflow is parsed.

Nothing here imports torch or needs the model: ``snakemake -n`` on a laptop can plan
a production run (shard count, tokens, bytes of hidden states) before anything exists.
Token counts come from the prepare report once prepare has run, and from the config's
``est_tokens_per_conversation`` before that.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from eaglenest.target_model import layer_ids as layer_id_convention

STORAGE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 1}
# Bytes per token besides the hidden states: int32 token id + uint8 loss mask.
TOKEN_OVERHEAD_BYTES = 5


def layer_ids(config: dict) -> list[int]:
    """The run's aux layer ids in HF convention, checked (eaglenest.target_model.layer_ids.resolve)."""
    return layer_id_convention.resolve(config["extract"].get("layer_ids", "default"), config["target"]["num_layers"])


def sample_selection(config: dict) -> dict:
    """Every setting that decides which samples (and tokens) land in which shard.

    Source names, not paths: moving the data to another disk changes no shard.
    """
    data = config["data"]
    return {
        # a synthesized source's prompts are decided by its settings, so they are part of it
        "sources": [{"name": s["name"], "synthesize": dict(s["synthesize"])} if s.get("synthesize") else s["name"]
                    for s in data["sources"]],
        "max_conversations": data["max_conversations"],
        "samples_per_shard": data["samples_per_shard"],
        "leading_assistant": data.get("leading_assistant", "drop_turn"),
        "max_len": data["max_len"],
    }


# Regeneration settings that change the answers (the rest only change how fast).
REGENERATION_CONTENT = ("backend", "temperature", "top_p", "max_new_tokens", "seed", "on_failure", "model", "repetition_stop")


def regeneration(config: dict) -> dict | None:
    """The settings that decide the regenerated answers, or None when regeneration is off."""
    section = config.get("regenerate") or {}
    if not section.get("enabled", False):
        return None
    chosen = {k: section[k] for k in REGENERATION_CONTENT if k in section}
    if not chosen.get("repetition_stop"):  # off: the key of every run made before it existed
        chosen.pop("repetition_stop", None)
    return dict(chosen, target=config["target"]["name"], max_len=config["data"]["max_len"])


def regeneration_key(config: dict) -> str:
    """Short hash naming the directory of regenerated shards (results/<run>/regenerated/<key>/)."""
    settings = dict(regeneration(config) or {}, selection=sample_selection(config))
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def prepared_key(config: dict) -> str:
    """Short hash of everything that decides what prepare writes (sample selection, target).

    Prepared shards live under results/<run>/prepared/<key>/: a change of these settings
    makes new paths, so the extraction of every shard is planned again, while a prepare
    job that reruns without a content change (a touched source, a deleted prepared shard)
    rewrites the same paths, which extraction reads as ancient() and so ignores
    (docs/reruns.md).
    """
    settings = dict(sample_selection(config), target=config["target"]["name"])
    if regeneration(config):  # absent when off, so runs without regeneration keep their key
        settings["regenerate"] = regeneration(config)
        if config["regenerate"].get("mix_original"):  # the original answers beside them
            settings["mix_original"] = True
        if config["regenerate"].get("original_share"):  # or instead of them, for a share
            settings["original_share"] = config["regenerate"]["original_share"]
    blob = json.dumps(settings, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def num_shards(config: dict) -> int:
    data = config["data"]
    return math.ceil(data["max_conversations"] / data["samples_per_shard"])


def bytes_per_token(hidden_size: int, num_aux_layers: int, dtype: str) -> int:
    # fp8 shards also store one float32 scale per token and layer (eaglenest.formats.shards).
    scales = (num_aux_layers + 1) * 4 if dtype == "float8_e4m3" else 0
    return (num_aux_layers + 1) * hidden_size * STORAGE_DTYPE_BYTES[dtype] + scales + TOKEN_OVERHEAD_BYTES


def plan(config: dict, prepare_report: str | Path | None = None) -> dict:
    shards = num_shards(config)
    per_token = bytes_per_token(config["target"]["hidden_size"], len(layer_ids(config)), config["extract"]["dtype"])
    report = Path(prepare_report) if prepare_report else None
    if report is not None and report.exists():
        tokens = json.loads(report.read_text())["tokens"]
        source = "counted by prepare"
    else:
        data = config["data"]
        per_conversation = min(data.get("est_tokens_per_conversation", 600), data["max_len"])
        tokens = data["max_conversations"] * per_conversation
        source = "estimated from est_tokens_per_conversation"
    return {
        "num_shards": shards,
        "tokens": tokens,
        "tokens_source": source,
        "bytes_per_token": per_token,
        "hidden_bytes": tokens * per_token,
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError


def describe(config: dict, numbers: dict) -> str:
    return (
        f"eaglenest plan for run '{config['run']}' (target {config['target']['name']}): "
        f"{numbers['num_shards']} shards, {numbers['tokens']:,} tokens ({numbers['tokens_source']}), "
        f"{numbers['bytes_per_token']:,} B/token -> {human_bytes(numbers['hidden_bytes'])} of hidden states"
    )


# Left in a configured hidden-state directory: names the run it belongs to, and keeps the
# directory from ever being empty. Snakemake (9.27) removes the empty directory of a missing
# output after a run with os.removedirs, which fails with NotADirectoryError on a link.
HIDDEN_DIR_MARKER = ".eaglenest-hidden-states"


class HiddenDirError(ValueError):
    pass


def link_hidden_dir(run_dir: str | os.PathLike, configured: str | os.PathLike | None, run: str) -> Path:
    """Make ``run_dir/hidden`` lead to the hidden states' directory and return that directory.

    ``configured`` (extract.hidden_dir) None: run_dir/hidden itself. Else run_dir/hidden
    becomes a link to it; the shard paths every rule and Snakemake's records use stay the
    same, so shards moved there are not made again. Shards still in a real run_dir/hidden
    are never moved or deleted here: the error says how to move them.
    """
    link = Path(run_dir) / "hidden"
    if configured is None:
        target = link.resolve() if link.is_symlink() else link
    else:
        target = Path(configured).absolute()
        if link.is_symlink():
            if link.resolve() != target.resolve():
                raise HiddenDirError(
                    f"{link} links to {os.readlink(link)}, extract.hidden_dir says {configured}: "
                    f"move the shards there, then `rm {link}` (the link only) and rerun"
                )
        elif link.exists():
            if any(link.iterdir()):
                raise HiddenDirError(
                    f"extract.hidden_dir is {configured}, but {link} holds hidden shards: move them with "
                    f"`mkdir -p {configured} && mv {link}/* {configured}/ && rmdir {link}`, then rerun "
                    "(moved shards are not made again)"
                )
            link.rmdir()
        target.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target, target_is_directory=True)
    if link.is_symlink():
        marker = target / HIDDEN_DIR_MARKER
        if target.is_dir() and not marker.exists():
            marker.write_text(f"hidden states of eaglenest run {run} ({link.absolute()})\n")
    return target
