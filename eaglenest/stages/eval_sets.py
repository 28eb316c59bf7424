"""Eval sets beside the built-in ones: the user's own chats, or a held-out slice of the run's data.

``evaluate.sets`` lists built-in names (``mt_bench``, ``humaneval``: eaglenest.stages.evaluate
reads their files) and entries of two more kinds:

- ``{name, path}``: a file of chats in a format ingest reads (OpenAI ``messages`` or ShareGPT
  ``conversations``, JSONL or a ShareGPT JSON array), read with ingest's own readers and
  checks, so bad input gets what ingest gives it: each bad record is counted by reason and
  skipped, the others are read.
- ``{name, split: val, seed}``: the run's own validation conversations (consolidate's
  split.json, held out from training), in an order fixed by ``seed``: tau on the training
  distribution.

The prompt of a chat is every turn before its last assistant turn (all of its turns when it has
none): a multi-turn chat keeps its earlier turns as context, and the assistant turn the drafter
is measured on is the target's own answer to the same context. Rule evaluate_prompts writes a
set's prompts (``prompts.jsonl``: ``{"id", "category", "messages"}`` per line, ``id`` =
``<set>/<record id or content hash>``) and its report (``prompt_report.json``, ingest's counts
by reason) under results/<run>/evaluate/<set>/; the evaluation jobs then read the prompts like
any set's and render them with the target's chat template, as MT-bench's first turns are.

Torch-free: the workflow's planning imports it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from eaglenest.formats import atomic
from eaglenest.stages import ingest

log = logging.getLogger(__name__)

BUILTIN_SETS = ("mt_bench", "humaneval")
# A leading assistant turn (a greeting) is no part of a prompt: drop it, as ingest does by default.
LEADING_ASSISTANT = "drop_turn"


class EmptyEvalSet(ValueError):
    """A set without a single usable prompt: the job stops, naming the file and why."""


# ---- config entries ---------------------------------------------------------------------------


def set_name(entry: str | dict) -> str:
    return entry if isinstance(entry, str) else entry["name"]


def set_names(entries: list) -> list[str]:
    """The names of evaluate.sets in order; a name given twice (or a user set named like a
    built-in one) is refused, since each set owns results/<run>/evaluate/<name>/."""
    names = [set_name(entry) for entry in entries]
    for entry in entries:
        if isinstance(entry, dict) and entry["name"] in BUILTIN_SETS:
            raise ValueError(f"evaluate.sets: {entry['name']!r} is a built-in set's name; name yours otherwise")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"evaluate.sets: each set needs a name of its own; given more than once: {', '.join(twice)}")
    return names


def user_sets(entries: list) -> dict[str, dict]:
    """Name -> entry of every set that is not built in."""
    return {entry["name"]: entry for entry in entries if isinstance(entry, dict)}


def num_prompts(entries: list, eval_set: str, default: int | None) -> int | None:
    """How many prompts of ``eval_set`` are evaluated: the entry's own ``num_prompts`` when it
    has one (null = all of them), else evaluate.num_prompts."""
    entry = user_sets(entries).get(eval_set, {})
    return entry["num_prompts"] if "num_prompts" in entry else default


# ---- prompts ----------------------------------------------------------------------------------


def prompt_turns(messages: list[dict]) -> list[dict]:
    """Every turn before the last assistant turn; all turns when there is no assistant turn."""
    last = max((i for i, message in enumerate(messages) if message["role"] == "assistant"), default=len(messages))
    return messages[:last]


def _why_empty(report: ingest.IngestReport) -> str:
    if not report.records_read:
        cut = any(note.get("truncated") for note in report.files)
        return "the file holds no complete record" if cut else "the file holds no record"
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(report.rejected.items()))
    return f"all {report.records_read} records rejected ({reasons})"


def _write(name: str, prompts: list[dict], report: ingest.IngestReport, prompts_path, report_path, source: str) -> None:
    if not prompts:
        raise EmptyEvalSet(f"eval set {name!r}: no usable prompt in {source}: {_why_empty(report)}")
    atomic.write_text(prompts_path, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    atomic.write_json(report_path, {"eval_set": name, **report.to_json()})
    log.info("eval set %s: %d prompts from %s; rejected %s", name, len(prompts), source, dict(report.rejected))


def read_chats(
    name: str, path: str | os.PathLike, prompts_path: str | os.PathLike, report_path: str | os.PathLike
) -> ingest.IngestReport:
    """The prompts of a file of chats (``{name, path}`` sets), with ingest's report of what
    was rejected and why. Raises EmptyEvalSet when no record gives a prompt."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"eval set {name!r}: {path} not found")
    report = ingest.IngestReport()
    note: dict = {"name": name, "path": str(path), "records": 0}
    report.files.append(note)
    prompts, seen = [], ingest.SeenRecords()
    for record in ingest.iter_source_records(path, note):
        note["records"] += 1
        report.records_read += 1
        try:
            record_id, messages, repairs = ingest.normalise(record, LEADING_ASSISTANT, require_assistant=False)
        except ingest.BadRecord as bad:
            report.rejected[bad.reason] += 1
            continue
        turns = prompt_turns(messages)
        content_key = ingest.content_hash(turns)
        prompt_id = f"{name}/{record_id if record_id is not None else content_key}"
        # Ids name a prompt in every trace and reference; two records with one prompt measure it twice.
        if seen.repeat(report, prompt_id, content_key):
            continue
        seen.add(prompt_id, content_key)
        report.repaired.update(repairs)
        report.kept += 1
        prompts.append({"id": prompt_id, "category": name, "messages": turns})
    _write(name, prompts, report, prompts_path, report_path, str(path))
    return report


def held_out_order(sample_ids: list[str], seed: int) -> list[str]:
    """The sample ids in an order fixed by ``seed`` alone (not by the file's order)."""
    return sorted(sample_ids, key=lambda sample_id: hashlib.sha256(f"{seed}:{sample_id}".encode()).digest())


def read_held_out(
    name: str,
    conversations_path: str | os.PathLike,
    split_path: str | os.PathLike,
    prompts_path: str | os.PathLike,
    report_path: str | os.PathLike,
    split: str = "val",
    seed: int = 0,
) -> ingest.IngestReport:
    """The prompts of the run's ``split`` conversations (``{name, split}`` sets): ingest's
    conversations whose sample ids consolidate put in that split, in held_out_order."""
    # Once per conversation: a run that keeps original answers beside regenerated ones holds
    # each held-out conversation twice (ingest.ORIGINAL_SUFFIX); the prompts are the same.
    sample_ids = list(dict.fromkeys(ingest.base_sample_id(i) for i in json.loads(Path(split_path).read_text())[split]))
    if not sample_ids:
        raise EmptyEvalSet(f"eval set {name!r}: the {split!r} split of {split_path} is empty "
                           f"(raise consolidate.val_fraction or data.max_conversations)")
    wanted = set(sample_ids)
    conversations = {c["sample_id"]: c["messages"] for c in ingest.read_conversations(conversations_path)
                     if c["sample_id"] in wanted}
    report = ingest.IngestReport()
    report.files.append({"name": name, "path": str(split_path), "split": split, "seed": seed,
                         "conversations": str(conversations_path), "records": len(sample_ids)})
    report.records_read = len(sample_ids)
    prompts = []
    for sample_id in held_out_order(sample_ids, seed):
        if sample_id not in conversations:
            report.rejected["not_in_conversations"] += 1
            continue
        turns = prompt_turns(conversations[sample_id])
        if not any(turn["role"] == "user" for turn in turns):
            report.rejected["no_user_turn"] += 1
            continue
        report.kept += 1
        prompts.append({"id": f"{name}/{sample_id}", "category": name, "messages": turns})
    _write(name, prompts, report, prompts_path, report_path, f"the {split!r} split of {split_path}")
    return report


def prepare_set(
    entry: dict,
    prompts_path: str | os.PathLike,
    report_path: str | os.PathLike,
    conversations_path: str | os.PathLike | None = None,
    split_path: str | os.PathLike | None = None,
) -> ingest.IngestReport:
    """A user set's prompts and report, from its evaluate.sets entry."""
    if "split" in entry:
        return read_held_out(entry["name"], conversations_path, split_path, prompts_path, report_path,
                             entry["split"], entry["seed"])
    return read_chats(entry["name"], entry["path"], prompts_path, report_path)


def read_prompts(path: str | os.PathLike) -> list[dict]:
    """A set's prompts as prepare_set wrote them."""
    prompts = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    for prompt in prompts:
        if not {"id", "category", "messages"} <= set(prompt):
            raise ValueError(f"{path} is not an eval set's prompts.jsonl (a line lacks id, category or messages)")
    return prompts
