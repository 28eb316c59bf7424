"""Prepare: tokenize conversations with the target's chat template, mask, truncate, shard.

Loss mask: 1 exactly on the tokens of each assistant turn's rendered text (its content
and the template's end-of-turn marker); the assistant header, system and user turns are 0.
Templates without ``{% generation %}`` markers (SmolLM2's ChatML has none) give an all-zero
``return_assistant_tokens_mask``, so the spans are found from character offsets: for an
assistant turn k, the text of ``messages[:k]`` rendered with the generation prompt is a
prefix of the full conversation, and ``messages[:k+1]`` ends where the turn ends.

Sharding: ``shard_of(sample_id, num_shards)`` hashes the stable sample id only, so a
sample's shard never depends on order, batch size, GPU count or what else is in the source.
"""

from __future__ import annotations

import collections
import hashlib
import os
from pathlib import Path

from eaglenest import atomic, shards
from eaglenest.ingest import read_conversations


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


def prepare(
    conversations_paths: str | os.PathLike | list,
    target_path: str | os.PathLike,
    output_paths: list[str],
    report_path: str | os.PathLike,
    max_len: int,
    target_name: str,
) -> dict:
    """Tokenize every conversation and write one prepared shard per output path.

    ``output_paths[i]`` is shard i; the number of paths is the number of shards.
    ``conversations_paths``: the ingested conversations, or the regenerated shards.
    """
    if isinstance(conversations_paths, (str, os.PathLike)):
        conversations_paths = [conversations_paths]
    tokenizer = load_tokenizer(target_path)
    num_shards = len(output_paths)
    buckets: list[list[dict]] = [[] for _ in range(num_shards)]
    dropped: collections.Counter = collections.Counter()
    truncated = 0
    conversations = (c for path in conversations_paths for c in read_conversations(path))
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
        sample = {"sample_id": conversation["sample_id"], "input_ids": input_ids, "loss_mask": loss_mask}
        buckets[shard_of(sample["sample_id"], num_shards)].append(sample)
    per_shard = []
    meta = {"target": target_name, "max_len": max_len, "num_shards": num_shards}
    for shard_id, (path, samples) in enumerate(zip(output_paths, buckets)):
        samples.sort(key=lambda s: s["sample_id"])
        shards.write_prepared_shard(path, shard_id, samples, meta)
        per_shard.append(
            {
                "shard_id": shard_id,
                "samples": len(samples),
                "tokens": sum(len(s["input_ids"]) for s in samples),
                "loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
            }
        )
    report = {
        "target": target_name,
        "max_len": max_len,
        "num_shards": num_shards,
        "samples": sum(s["samples"] for s in per_shard),
        "tokens": sum(s["tokens"] for s in per_shard),
        "loss_tokens": sum(s["loss_tokens"] for s in per_shard),
        "truncated_to_max_len": truncated,
        "dropped": dict(sorted(dropped.items())),
        "shards": per_shard,
    }
    atomic.write_json(report_path, report)
    return report


def shard_paths(directory: str | os.PathLike, num_shards: int) -> list[Path]:
    return [Path(directory) / shards.shard_name(i) for i in range(num_shards)]
