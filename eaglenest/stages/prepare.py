"""Prepare: tokenize conversations with the target's chat template, mask, truncate, shard.

Loss mask: 1 exactly on the tokens of each assistant turn's rendered text (its content
and the template's end-of-turn marker); the assistant header, system and user turns are 0.
Templates without ``{% generation %}`` markers (SmolLM2's ChatML has none) give an all-zero
``return_assistant_tokens_mask``, so the spans are found from character offsets: for an
assistant turn k, the text of ``messages[:k]`` rendered with the generation prompt is a
prefix of the full conversation, and ``messages[:k+1]`` ends where the turn ends.

Sharding: ``shard_of(sample_id, num_shards)`` hashes the stable sample id only, so a
sample's shard never depends on order, batch size, GPU count or what else is in the source.

Originals beside regenerated answers (``regenerate.mix_original``): a shard then holds each
conversation twice, the target's answers under its sample id and the original answers under
``<sample id>@original``; both were picked by the id before the suffix, and consolidate splits
by it too (``ingest.base_sample_id``), so a conversation's two versions never sit on both sides of
the train/validation split. Originals instead of regenerated answers for a share of the
conversations (``regenerate.original_share``): each conversation once, as the target answered
it or, when picked, as ``<sample id>@original``: a mixed set of the regenerated set's size.
"""

from __future__ import annotations

import collections
import hashlib
import os
from pathlib import Path

from eaglenest.formats import atomic, shards
from eaglenest.stages.ingest import ORIGINAL_SUFFIX, read_conversations


class TemplateError(ValueError):
    pass


def shard_of(sample_id: str, num_shards: int) -> int:
    digest = hashlib.sha256(sample_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % num_shards


def load_tokenizer(target_path: str | os.PathLike):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    if not tokenizer.is_fast:
        raise TemplateError("a fast tokenizer is needed for character offsets")
    if not tokenizer.chat_template:
        raise TemplateError(f"{target_path} has no chat template")
    return tokenizer


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the rendered chat with the assistant turn opened, as a server sees it."""
    return tokenizer(render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the character span of every assistant turn in it."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:k], add_generation_prompt=True)
        through = render(tokenizer, messages[: k + 1], add_generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise TemplateError("chat template output is not prefix-stable across turns")
        # Trailing newlines after the end-of-turn marker are template glue, not generated.
        spans.append((len(before), len(through.rstrip())))
    return full, spans


def tokenize_with_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for start, end in encoded["offset_mapping"]:
        inside = any(start < span_end and end > span_start for span_start, span_end in spans)
        mask.append(1 if inside else 0)
    return list(encoded["input_ids"]), mask


def shard_conversations(conversations_paths, shard_id: int, num_shards: int) -> list[dict]:
    """The conversations of ``shard_id`` (by the hash of their sample id) in the given files."""
    if isinstance(conversations_paths, (str, os.PathLike)):
        conversations_paths = [conversations_paths]
    return [
        conversation
        for path in conversations_paths
        for conversation in read_conversations(path)
        if shard_of(conversation["sample_id"], num_shards) == shard_id
    ]


def takes_original(sample_id: str, share: float, seed: int) -> bool:
    """Whether a conversation keeps its original answers (``regenerate.original_share``): by
    a hash of its id and the seed, salted apart from the validation split's (consolidate's
    ``in_validation``), so both sides of the split get the same share."""
    digest = hashlib.sha256(f"original-share:{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def tokenize_samples(tokenizer, conversations, max_len: int) -> tuple[list[dict], dict]:
    """Samples of the conversations (sorted by id) and the counts of what was cut or dropped."""
    samples = []
    dropped: collections.Counter = collections.Counter()
    truncated = 0
    for conversation in conversations:
        try:
            input_ids, loss_mask = tokenize_with_mask(tokenizer, conversation["messages"])
        except TemplateError:
            dropped["template_not_prefix_stable"] += 1
            continue
        if len(input_ids) > max_len:
            truncated += 1
            input_ids, loss_mask = input_ids[:max_len], loss_mask[:max_len]
        if not any(loss_mask):
            dropped["no_assistant_tokens_within_max_len"] += 1
            continue
        samples.append({"sample_id": conversation["sample_id"], "input_ids": input_ids, "loss_mask": loss_mask})
    samples.sort(key=lambda s: s["sample_id"])
    return samples, {"truncated_to_max_len": truncated, "dropped": dict(sorted(dropped.items()))}


def write_shard(path, shard_id: int, num_shards: int, samples: list[dict], counts: dict, max_len: int,
                target_name: str) -> None:
    # What was cut or dropped travels in the shard's own header (PREPARE_COUNTS_KEY), so the
    # stage's report is a sum over the shards and each shard job stays on its own.
    meta = {"target": target_name, "max_len": max_len, "num_shards": num_shards, shards.PREPARE_COUNTS_KEY: counts}
    shards.write_prepared_shard(path, shard_id, samples, meta)


def prepare_shard(
    conversations_paths: str | os.PathLike | list,
    target_path: str | os.PathLike,
    output_path: str | os.PathLike,
    shard_id: int,
    num_shards: int,
    max_len: int,
    target_name: str,
    originals_paths: list | None = None,
    original_share: float = 0.0,
    share_seed: int = 0,
) -> dict:
    """Tokenize the conversations of one shard and write its prepared shard (rule prepare).

    ``conversations_paths``: the ingested conversations (all shards; this one's are picked
    by the hash of their ids), or this shard's regenerated conversations.
    ``originals_paths``: the ingested conversations, whose original answers this shard also
    keeps, as ``<sample id>@original``: beside the regenerated ones
    (``regenerate.mix_original``), or, with ``original_share`` > 0, instead of them for the
    conversations that ``takes_original`` picks (``regenerate.original_share``).
    """
    tokenizer = load_tokenizer(target_path)
    conversations = shard_conversations(conversations_paths, shard_id, num_shards)
    originals = shard_conversations(originals_paths, shard_id, num_shards) if originals_paths else []
    as_original = [dict(c, sample_id=c["sample_id"] + ORIGINAL_SUFFIX) for c in originals]
    if original_share > 0:
        if not originals_paths:
            raise ValueError("original_share needs the ingested conversations (originals_paths) to take answers from")
        by_id = {c["sample_id"]: c for c in as_original}
        # A conversation the regeneration dropped stays dropped; one it kept swaps when picked.
        conversations = [by_id.get(c["sample_id"] + ORIGINAL_SUFFIX, c)
                         if takes_original(c["sample_id"], original_share, share_seed) else c for c in conversations]
    else:
        conversations += as_original
    samples, counts = tokenize_samples(tokenizer, conversations, max_len)
    if originals_paths:
        counts["original_samples"] = sum(s["sample_id"].endswith(ORIGINAL_SUFFIX) for s in samples)
    write_shard(output_path, shard_id, num_shards, samples, counts, max_len, target_name)
    return {"shard_id": shard_id, "samples": len(samples), "tokens": sum(len(s["input_ids"]) for s in samples), **counts}


def prepare(
    conversations_paths: str | os.PathLike | list,
    target_path: str | os.PathLike,
    output_paths: list[str],
    report_path: str | os.PathLike,
    max_len: int,
    target_name: str,
) -> dict:
    """Every shard in one process (tests, tools): the same shards as one prepare_shard per
    path, and the report of summarize. ``output_paths[i]`` is shard i."""
    if isinstance(conversations_paths, (str, os.PathLike)):
        conversations_paths = [conversations_paths]
    tokenizer = load_tokenizer(target_path)
    num_shards = len(output_paths)
    buckets: list[list[dict]] = [[] for _ in range(num_shards)]
    for conversation in (c for path in conversations_paths for c in read_conversations(path)):
        buckets[shard_of(conversation["sample_id"], num_shards)].append(conversation)
    for shard_id, (path, conversations) in enumerate(zip(output_paths, buckets)):
        samples, counts = tokenize_samples(tokenizer, conversations, max_len)
        write_shard(path, shard_id, num_shards, samples, counts, max_len, target_name)
    return summarize(output_paths, report_path)


def summarize(prepared_paths: list, report_path: str | os.PathLike) -> dict:
    """The stage's report from the prepared shards' headers alone (rule prepare_report).

    Shards written before prepare ran per shard carry no counts of what was cut or dropped:
    they are listed in ``shards_without_drop_counts`` and left out of those two totals.
    """
    per_shard, truncated, dropped, uncounted = [], 0, collections.Counter(), []
    originals = None  # samples of original answers kept beside regenerated ones, if any
    meta = {}
    for path in prepared_paths:
        _, meta = shards.read_header(path)
        counts = meta.get(shards.PREPARE_COUNTS_KEY)
        if counts is None:
            uncounted.append(meta["shard_id"])
        else:
            truncated += counts["truncated_to_max_len"]
            dropped.update(counts["dropped"])
            if "original_samples" in counts:
                originals = (originals or 0) + counts["original_samples"]
        per_shard.append(
            {
                "shard_id": meta["shard_id"],
                "samples": len(meta["sample_ids"]),
                "tokens": sum(meta["token_counts"]),
                "loss_tokens": sum(meta["loss_token_counts"]),
            }
        )
    report = {
        "target": meta.get("target"),
        "max_len": meta.get("max_len"),
        "num_shards": len(per_shard),
        "samples": sum(s["samples"] for s in per_shard),
        "tokens": sum(s["tokens"] for s in per_shard),
        "loss_tokens": sum(s["loss_tokens"] for s in per_shard),
        "truncated_to_max_len": truncated,
        "dropped": dict(sorted(dropped.items())),
        "shards": per_shard,
    }
    if originals is not None:
        report["original_samples"] = originals
    if uncounted:
        report["shards_without_drop_counts"] = uncounted
    atomic.write_json(report_path, report)
    return report


def shard_paths(directory: str | os.PathLike, num_shards: int) -> list[Path]:
    return [Path(directory) / shards.shard_name(i) for i in range(num_shards)]
