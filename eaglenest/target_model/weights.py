"""The target's token embedding, output head and final norm, read from its safetensors files
without building the target (a single model.safetensors or a sharded index)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from eaglenest.formats.shards import SAFETENSORS_DTYPE_NAMES

WEIGHTS_NAME = "model.safetensors"


def _weight_files(target_path: Path) -> dict[str, Path]:
    """tensor name -> file, for a single model.safetensors or a sharded index."""
    index = target_path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_path / file for name, file in weight_map.items()}
    single = target_path / WEIGHTS_NAME
    if not single.exists():
        raise FileNotFoundError(f"{target_path}: neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as handle:
        return {name: single for name in handle.keys()}


def _find(files: dict[str, Path], suffix: str) -> str | None:
    # Wrappers prefix names (model., language_model.model., ...): take the shortest match.
    matches = sorted((n for n in files if n == suffix or n.endswith("." + suffix)), key=len)
    return matches[0] if matches else None


def target_embedding_dtype(target_path: str | os.PathLike) -> torch.dtype | None:
    """The dtype the target's token embedding is stored in (read from the file header), or None."""
    files = _weight_files(Path(target_path))
    name = _find(files, "embed_tokens.weight")
    if name is None:
        return None
    with safe_open(files[name], framework="pt") as handle:
        stored = handle.get_slice(name).get_dtype()
    return next((dtype for dtype, label in SAFETENSORS_DTYPE_NAMES.items() if label == stored), None)


def load_target_rows(target_path: str | os.PathLike, which: str, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The target's token embedding (``which="embed"``), output head (``"lm_head"``) or final
    norm weight (``"norm"``) as fp32.

    A tied target has no lm_head tensor; its embedding is the head. ``rows`` (bool mask or
    ascending indices) selects rows.
    """
    target_path = Path(target_path)
    files = _weight_files(target_path)
    embed = _find(files, "embed_tokens.weight")
    if which == "norm":
        name = _find(files, "norm.weight")
    else:
        name = embed if which == "embed" else (_find(files, "lm_head.weight") or embed)
    if name is None:
        raise KeyError(f"{target_path}: no {which} weight (looked for *lm_head.weight, *embed_tokens.weight)")
    with safe_open(files[name], framework="pt") as handle:
        if rows is None:
            return handle.get_tensor(name).float()
        index = rows.nonzero().squeeze(-1) if rows.dtype == torch.bool else rows.to(torch.int64)
        sliced = handle.get_slice(name)
        # Read runs of consecutive rows: a 163,840-row head is never loaded whole for a 32K subset.
        breaks = (torch.nonzero(index[1:] != index[:-1] + 1).squeeze(-1) + 1).tolist()
        starts = [0] + breaks
        ends = breaks + [index.numel()]
        runs = [sliced[int(index[a]) : int(index[b - 1]) + 1] for a, b in zip(starts, ends)]
        return torch.cat(runs).float()
