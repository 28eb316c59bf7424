"""Draft vocabulary: the target tokens the drafter can propose (EAGLE-3 convention).

``t2d`` is a bool mask over the target vocabulary; ``d2t[i]`` is the offset such that
draft token i is target token ``i + d2t[i]``. The draft vocab holds the
``draft_vocab_size`` most frequent loss-masked target tokens (ties broken by lower
token id); if fewer distinct tokens were seen, the lowest unseen ids fill it. Ids are
kept in ascending target order so d2t is non-decreasing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglenest.formats import atomic


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From per-target-token counts [V] to (d2t int64 [D], t2d bool [V])."""
    vocab_size = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in (0, {vocab_size}]")
    ids = torch.arange(vocab_size)
    # Stable sort on -count keeps lower ids first among equal counts.
    order = ids[torch.argsort(-token_counts.to(torch.int64), stable=True)]
    chosen = torch.sort(order[:draft_vocab_size]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(draft_vocab_size)
    return d2t, t2d


def read_draft_vocab_of(source: str | os.PathLike, target_vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of an earlier run, to keep its draft vocabulary (consolidate.draft_vocab_from):
    a run's ``consolidated/draft_vocab.safetensors``, a drafter export's ``model.safetensors``
    or the export's directory. Checked against this run's sizes and for consistency."""
    from safetensors import safe_open

    path = Path(source) / "model.safetensors" if Path(source).is_dir() else Path(source)
    if not path.exists():
        raise FileNotFoundError(f"consolidate.draft_vocab_from {source}: no {path.name} there")
    with safe_open(str(path), framework="pt") as handle:
        missing = {"d2t", "t2d"} - set(handle.keys())
        if missing:
            raise ValueError(f"consolidate.draft_vocab_from {path}: holds no {' or '.join(sorted(missing))}")
        d2t, t2d = handle.get_tensor("d2t").to(torch.int64), handle.get_tensor("t2d").to(torch.bool)
    if t2d.numel() != target_vocab_size or d2t.numel() != draft_vocab_size:
        raise ValueError(f"consolidate.draft_vocab_from {path}: a draft vocabulary of {d2t.numel()} over {t2d.numel()} "
                         f"target tokens, this run has {draft_vocab_size} over {target_vocab_size}")
    if not torch.equal(torch.nonzero(t2d).flatten(), draft_to_target(d2t)):
        raise ValueError(f"consolidate.draft_vocab_from {path}: d2t and t2d do not name the same target tokens")
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(d2t.numel()) + d2t


def save_draft_vocab(path: str | os.PathLike, d2t, t2d, token_counts, meta: dict) -> None:
    tensors = {"d2t": d2t.contiguous(), "t2d": t2d.contiguous(), "token_counts": token_counts.contiguous()}
    # One metadata entry holding sorted JSON: safetensors writes several entries in a random
    # order, and the file must come out bitwise identical on every rerun.
    meta = {"eaglenest": json.dumps(meta, sort_keys=True, separators=(",", ":"))}
    atomic.write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def load_draft_vocab(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return load_file(str(path))
