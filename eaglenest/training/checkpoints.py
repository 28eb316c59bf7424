"""Training checkpoints: writing them, their checksums, the RNG states, which one to resume.

A checkpoint (atomic, rotated) holds the trainable weights, optimizer, scheduler, RNG states
and the global step, which fixes the data position; a killed run resumes from the newest one
and ends with the same weights (bitwise on CPU). Each checkpoint's sha256 is recorded in
``checksums.json`` beside it; resume skips, by name, any checkpoint whose bytes do not match.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path

import torch

from eaglenest.formats import atomic

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "eaglenest-train-checkpoint"
# Checkpoint file name -> sha256 of its bytes, recorded before the checkpoint appears under its
# name. torch.load neither checks the zip's CRCs nor names the file when it fails: resume checks these.
CHECKSUMS_NAME = "checksums.json"


def checkpoint_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("step-*.pt"))


class _CheckpointStream:
    """The file torch.save writes to: hashes what it writes and keeps the OSError of a failed
    write, which torch's zip writer would replace by "unexpected pos ..." (a full disk unnamed)."""

    def __init__(self, handle):
        self.handle, self.sha256, self.error = handle, hashlib.sha256(), None

    def _keep_error(self, call, *args):
        try:
            return call(*args)
        except OSError as err:
            self.error = err
            raise

    def write(self, data) -> int:
        written = self._keep_error(self.handle.write, data)
        self.sha256.update(data)
        return written

    def flush(self) -> None:
        self._keep_error(self.handle.flush)


def read_checksums(directory: Path) -> dict[str, str]:
    try:
        recorded = json.loads((directory / CHECKSUMS_NAME).read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        log.warning("%s is unreadable: no checkpoint in %s can be verified", directory / CHECKSUMS_NAME, directory)
        return {}
    return recorded if isinstance(recorded, dict) else {}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(directory: Path, state: dict, keep: int) -> Path:
    path = directory / f"step-{state['step']:08d}.pt"
    recorded = {name: digest for name, digest in read_checksums(directory).items() if (directory / name).exists()}
    with atomic.atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            stream = _CheckpointStream(handle)
            try:
                torch.save(state, stream)
            except RuntimeError as err:
                if stream.error is None:
                    raise
                raise stream.error from err  # ENOSPC: atomic turns it into DiskFullError naming the file
        # Recorded before the checkpoint appears, so every step-*.pt on disk has a checksum.
        recorded[path.name] = stream.sha256.hexdigest()
        atomic.write_json(directory / CHECKSUMS_NAME, recorded)
    for old in checkpoint_paths(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def checkpoint_problem(path: Path, recorded: dict[str, str]) -> str | None:
    """Why ``path`` must not be resumed from, or None when its bytes are the ones written."""
    expected = recorded.get(path.name)
    if expected is None:
        return f"no checksum recorded for it in {CHECKSUMS_NAME} (written by an older eaglenest, or the file was replaced)"
    actual = file_sha256(path)
    if actual != expected:
        return f"corrupt: sha256 {actual[:16]}... != {expected[:16]}... recorded when it was written"
    return None


def load_latest_checkpoint(directory: Path, expected_fingerprint: str) -> dict | None:
    recorded = read_checksums(directory)
    for path in reversed(checkpoint_paths(directory)):
        problem = checkpoint_problem(path, recorded)
        if problem:
            # An older checkpoint (or step 0) gives the same weights, only later.
            log.warning("not resuming from checkpoint %s: %s; trying an older one", path, problem)
            continue
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: not an eaglenest training checkpoint")
        if state["fingerprint"] != expected_fingerprint:
            raise ValueError(
                f"{path} was written by a run with other training settings or data "
                f"(fingerprint {state['fingerprint']} != {expected_fingerprint}); remove {directory} "
                "to start over, or restore the settings to resume"
            )
        log.info("resuming from %s (step %d)", path, state["step"])
        return state
    return None


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
