"""Consolidate: verify every hidden shard, index them, build the draft vocab and the split.

Outputs (results/<run>/consolidated/):
  index.json         shards with samples, tokens, loss tokens and bytes; totals
  draft_vocab.safetensors   d2t, t2d, token_counts (see eaglenest.formats.vocab)
  split.json         {"train": [sample ids], "val": [sample ids]}, by hash of sample id

A corrupt or inconsistent shard fails the job with every bad shard named and the
command that rebuilds only those shards.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eaglenest.formats import atomic, shards, vocab
from eaglenest.stages.ingest import base_sample_id


class ConsolidationError(RuntimeError):
    pass


def in_validation(sample_id: str, val_fraction: float, seed: int) -> bool:
    """By the conversation's id: an original copy (``<id>@original``) goes where its
    regenerated version goes, and a run without copies splits as before."""
    digest = hashlib.sha256(f"{seed}:{base_sample_id(sample_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def consolidate(
    hidden_paths: list[str],
    prepared_paths: list[str],
    index_path: str | os.PathLike,
    vocab_path: str | os.PathLike,
    split_path: str | os.PathLike,
    target_vocab_size: int,
    draft_vocab_size: int,
    expect: dict,
    val_fraction: float = 0.05,
    seed: int = 0,
    threads: int = 1,
    draft_vocab_from: str | None = None,
) -> dict:
    bad = []
    entries = []
    counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    split = {"train": [], "val": []}
    def check(pair):
        hidden_path, prepared_path = pair
        try:
            reader = shards.verify_shard(hidden_path, deep=True, expect=expect)
            prepared = shards.ShardReader.open(prepared_path)
            if reader.sample_ids != prepared.sample_ids or reader.token_counts != prepared.token_counts:
                raise shards.ShardError(hidden_path, f"samples differ from {prepared_path} (stale shard)")
            tensors = reader.tensors(["input_ids", "loss_mask"])
            if not torch.equal(tensors["input_ids"], prepared.tensor("input_ids")):
                raise shards.ShardError(hidden_path, f"token ids differ from {prepared_path} (stale shard)")
        except shards.ShardError as err:
            return err, None, None
        return None, reader, tensors

    # Deep checks read every byte (52 GB for 22M fp8 tokens): shards are checked side by
    # side (hashing and torch release the GIL), results are taken in shard order.
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        checked = list(pool.map(check, zip(hidden_paths, prepared_paths)))
    for hidden_path, (error, reader, tensors) in zip(hidden_paths, checked):
        if error is not None:
            bad.append(error)
            continue
        ids = tensors["input_ids"].to(torch.int64)
        if ids.numel() and int(ids.max()) >= target_vocab_size:
            bad.append(shards.ShardError(hidden_path, "token id outside the target vocabulary"))
            continue
        masked = ids[tensors["loss_mask"].bool()]
        counts += torch.bincount(masked, minlength=target_vocab_size)
        for sample_id in reader.sample_ids:
            split["val" if in_validation(sample_id, val_fraction, seed) else "train"].append(sample_id)
        entries.append(
            {
                "shard": Path(hidden_path).name,
                "path": str(hidden_path),
                "samples": len(reader.sample_ids),
                "tokens": reader.num_tokens,
                "loss_tokens": int(masked.numel()),
                "bytes": Path(hidden_path).stat().st_size,
                "checksums": reader.metadata["checksums"],
            }
        )
    if bad:
        listing = "\n".join(f"  {err.path}: {err.reason}" for err in bad)
        paths = " ".join(str(err.path) for err in bad)
        raise ConsolidationError(
            f"{len(bad)} hidden shard(s) failed verification:\n{listing}\n"
            f"Rebuild only these with: rm {paths} && snakemake --cores all"
        )
    if draft_vocab_from:  # an earlier run's, kept (e.g. for a warm start on other data)
        d2t, t2d = vocab.read_draft_vocab_of(draft_vocab_from, target_vocab_size, draft_vocab_size)
    else:
        d2t, t2d = vocab.build_draft_vocab(counts, draft_vocab_size)
    seen = int((counts > 0).sum())
    meta = {"draft_vocab_size": draft_vocab_size, "target_vocab_size": target_vocab_size, "distinct_tokens_seen": seen}
    if draft_vocab_from:
        meta["from"] = str(draft_vocab_from)
    vocab.save_draft_vocab(vocab_path, d2t, t2d, counts, meta)
    covered = int(counts[t2d].sum())
    index = {
        "format_version": shards.FORMAT_VERSION,
        **{key: expect[key] for key in sorted(expect)},
        "shards": entries,
        "totals": {
            "shards": len(entries),
            "samples": sum(e["samples"] for e in entries),
            "tokens": sum(e["tokens"] for e in entries),
            "loss_tokens": sum(e["loss_tokens"] for e in entries),
            "bytes": sum(e["bytes"] for e in entries),
        },
        "draft_vocab": {
            "size": draft_vocab_size,
            "distinct_loss_tokens_seen": seen,
            "loss_token_coverage": round(covered / max(int(counts.sum()), 1), 6),
            **({"from": str(draft_vocab_from)} if draft_vocab_from else {}),
        },
        "split": {"train": len(split["train"]), "val": len(split["val"]), "val_fraction": val_fraction, "seed": seed},
    }
    atomic.write_json(split_path, split)
    atomic.write_json(index_path, index)
    return index
