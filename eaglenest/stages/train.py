"""Train an EAGLE-3 drafter on consolidated hidden shards, with training-time test (TTT).

One global step: read packed rows (eaglenest.stages.loader), compute the target's distribution over
the draft vocab from the stored last hidden state, unroll the drafter ``ttt_length`` steps
(eaglenest.model.drafter's TTT mask), and minimise sum_j decay**j * CE_j, where CE_j is the soft
cross-entropy of step j averaged over the positions that count in the whole global batch.

Alignment, per packed sample with tokens x_0..x_{n-1}: step j at position t reads token
x_{t+1+j} and predicts x_{t+2+j}; its target is softmax(lm_head_t2d(last_hidden[t+1+j])). The
position counts when x_{t+2+j} is in the same sample, carries loss mask 1 (an assistant token)
and the target's full-vocab argmax at t+1+j lies in the draft vocab.

Runs as one process (CPU or one GPU) or under torchrun with DDP; a rank's loss is scaled so
that DDP's gradient average equals the single-process gradient of the same global batch.
Checkpoints (atomic, rotated) hold the trainable weights, optimizer, scheduler, RNG states and
the global step, which fixes the data position; a killed run resumes from the newest one and
ends with the same weights (bitwise on CPU). Each checkpoint's sha256 is recorded in
``checksums.json`` beside it; resume skips, by name, any checkpoint whose bytes do not match.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from eaglenest.formats import atomic, shards, vocab
from eaglenest.stages import draft_loss, loader
from eaglenest.model import drafter as drafter_lib
from eaglenest import settings as settings_lib

log = logging.getLogger("eaglenest.stages.train")

# Every train setting and its default: config/schema.yaml, section train (the one source).
DEFAULTS = settings_lib.defaults("train")
# Keys that decide the weights a run ends with (the checkpoint fingerprint); rule
# train_drafter passes the same keys as params.
CONTENT_KEYS = settings_lib.TRAIN_CONTENT_KEYS
CHECKPOINT_FORMAT = "eaglenest-train-checkpoint"
# What the objective computes beyond the settings: a change of convention (TTT step j moved
# from step 0's rotary positions to t + j) must neither resume an old checkpoint nor keep an
# old drafter. rules/train.smk passes the same string as a param (tests keep them equal), so
# Snakemake retrains when it changes.
OBJECTIVE = "ttt-rotary-t+j"
# Checkpoint file name -> sha256 of its bytes, recorded before the checkpoint appears under its
# name. torch.load neither checks the zip's CRCs nor names the file when it fails: resume checks these.
CHECKSUMS_NAME = "checksums.json"


# ---- the target's distribution over the draft vocab ----------------------------------------------


class TargetHead:
    """The target's lm_head, for soft labels over the draft vocab and the in-draft-vocab test.

    The head's rows are kept in two blocks, the draft vocabulary's (in draft-id order) and the
    rest. The draft block's product, one over all rows (its [N, D] result is what the step
    keeps), gives the soft labels' logits; the rest's product, ``chunk_rows`` rows at a time and
    compared with it, gives the in-draft test: whether the full-vocabulary argmax (its first
    maximal logit in target-id order, as ``argmax`` picks it) is a draft token. Given the test
    already (``in_draft``: a later epoch's step, :class:`InDraftCache`), only the draft block's
    product runs: a fifth of the FLOPs for Kimi-K2.5 (32,000 of 163,840 rows). All in the
    head's dtype, never in float32.
    """

    def __init__(self, target_path, t2d: torch.Tensor, device, dtype, chunk_elements: int = 1 << 26):
        full = drafter_lib.load_target_rows(target_path, "lm_head")
        if full.shape[0] != t2d.numel():
            raise ValueError(f"target lm_head has {full.shape[0]} rows, draft vocab t2d covers {t2d.numel()}")
        t2d = t2d.bool()
        draft, other = t2d.nonzero().squeeze(-1), (~t2d).nonzero().squeeze(-1)
        self.draft_columns, self.other_columns = draft.to(device), other.to(device)
        # One tensor, draft rows first: the two blocks are views of it (no second copy of the head).
        rows = torch.cat([full[draft], full[other]]).to(device=device, dtype=dtype)
        self.draft_rows, self.other_rows = rows[: draft.numel()], rows[draft.numel():]
        self.chunk_rows = max(1, chunk_elements // full.shape[0])

    @torch.no_grad()
    def __call__(self, last_hidden: torch.Tensor, in_draft: torch.Tensor | None = None):
        """last_hidden [N, H] -> (draft-vocab logits [N, D] in the head's dtype, in_draft [N] bool)."""
        x = last_hidden.to(self.draft_rows.dtype)
        logits = x @ self.draft_rows.T  # all rows at once: the [N, D] result is kept anyway
        if in_draft is None:
            in_draft = torch.cat([self._argmax_is_draft(draft, chunk) for draft, chunk
                                  in zip(logits.split(self.chunk_rows), x.split(self.chunk_rows))])
        return logits, in_draft

    def _argmax_is_draft(self, draft_logits: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        if self.other_rows.shape[0] == 0:  # the draft vocabulary is the whole vocabulary
            return torch.ones(chunk.shape[0], dtype=torch.bool, device=chunk.device)
        draft_max, draft_at = draft_logits.max(-1)
        other_max, other_at = (chunk @ self.other_rows.T).max(-1)
        # A tie goes to the smaller target id, as the full-vocabulary argmax's first maximum.
        tie_to_draft = self.draft_columns[draft_at] < self.other_columns[other_at]
        return (draft_max > other_max) | ((draft_max == other_max) & tie_to_draft)


class InDraftCache:
    """The target's in-draft test for every token of the training split, on the device, kept
    from the first step that computed it for a sample: from then on the sample's steps run
    only the target head's draft-vocabulary product (TargetHead). A batch takes it when every
    sample in it is known (a host-side set: no wait for the device); what a batch computes is
    written back without a synchronisation (padding writes to a spare last slot). Not kept in
    checkpoints: a resumed run computes it again as it meets the samples. One byte a token
    (16,000 conversations of 1,450 tokens: 23 MB)."""

    def __init__(self, dataset, device):
        lengths = torch.tensor([sample.length for sample in dataset.samples], dtype=torch.int64)
        self.starts = (torch.cumsum(lengths, 0) - lengths).to(device)
        self.spare = int(lengths.sum())
        self.bits = torch.zeros(self.spare + 1, dtype=torch.bool, device=device)
        self.known: set[int] = set()

    def _slots(self, batch: dict) -> torch.Tensor:
        index = batch["sample_index"]
        return torch.where(index >= 0, self.starts[index.clamp(min=0)] + batch["position_ids"], self.spare)

    def lookup(self, batch: dict) -> torch.Tensor | None:
        """The batch's in-draft test [B, T] (False on padding), or None while a sample in it is new."""
        if not self.known.issuperset(batch["samples"]):
            return None
        return self.bits[self._slots(batch)] & (batch["sample_index"] >= 0)

    def store(self, batch: dict, in_draft: torch.Tensor) -> None:
        self.bits[self._slots(batch)] = in_draft
        self.known.update(batch["samples"])


def shift_left(x: torch.Tensor, by: int, fill) -> torch.Tensor:
    """x[:, t + by] at t, ``fill`` past the end of the row."""
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out


def step_positions(batch: dict, in_draft: torch.Tensor, ttt_length: int) -> list[torch.Tensor]:
    """For each TTT step j, the flat [B*T] indices t whose prediction of x_{t+2+j} counts.

    The step's one host synchronisation: every step's indices come from one ``nonzero``.
    """
    seg, mask = batch["segment_ids"], batch["loss_mask"]
    valid = []
    for j in range(ttt_length):
        same = (shift_left(seg, 2 + j, -2) == seg) & (seg >= 0)
        valid.append((same & shift_left(mask, 2 + j, False) & shift_left(in_draft, 1 + j, False)).flatten())
    flat = torch.stack(valid).flatten().nonzero().squeeze(-1)
    per_row = seg.numel()
    counts = torch.bincount(flat // per_row, minlength=ttt_length).tolist()
    return [rows - j * per_row for j, rows in enumerate(flat.split(counts))]


class TTTObjective(nn.Module):
    """Wraps the drafter so that DDP sees the whole unroll as one forward."""

    def __init__(self, model: drafter_lib.Eagle3Drafter, ttt_length: int,
                 loss_chunk_rows: int = DEFAULTS["loss_chunk_rows"],
                 attention_backend: str = DEFAULTS["attention"],
                 recompute_steps: bool = DEFAULTS["recompute_steps"],
                 compile_loss: bool = True):
        super().__init__()
        self.drafter = model
        self.ttt_length = ttt_length
        # A step's loss runs loss_chunk_rows positions at a time (eaglenest.stages.draft_loss): one
        # chunk's [positions, draft vocab] float32 block exists at a time.
        self.loss_chunk_rows = loss_chunk_rows
        self.attention_backend = attention_backend
        self.recompute_steps = recompute_steps
        # On a GPU the loss chunk's elementwise part runs compiled whatever train.compile says, as
        # the merge of the diagonal keys does: 3.7x the eager chunk at 4,096 x 32,000 on an H200
        # (benchmarks/loss_chunk.py). False keeps it eager.
        self.compile_loss = compile_loss

    def step_loss(self, normed_rows, target_logits, target_ids):
        """(sum of soft CE, top-1 hits) over the rows, as device tensors."""
        return draft_loss.head_soft_cross_entropy(normed_rows, self.drafter.lm_head.weight, target_logits,
                                                  target_ids, self.loss_chunk_rows, self.compile_loss)

    def unroll(self, batch):
        """Yield (j, normed [B, T, H]) per TTT step. Step j at position t reads x_{t+1+j} and sits
        at rotary position t + j, where the drafter puts its j-th drafted token when it drafts
        (eaglenest.model.speculate, SGLang); its attention follows drafter.TTTCache."""
        ids, seg, pos = batch["input_ids"], batch["segment_ids"], batch["position_ids"]
        hidden = batch["aux_hidden"]
        cache = drafter_lib.TTTCache(self.attention_backend)
        for j in range(self.ttt_length):
            # Token x_{t+1+j}; across a sample boundary the id is irrelevant (never counted), use 0.
            step_ids = torch.where(shift_left(seg, 1 + j, -2) == seg, shift_left(ids, 1 + j, 0), 0)
            if self.recompute_steps and torch.is_grad_enabled():
                normed, hidden = self._recomputed_step(step_ids, hidden, pos + j, cache, seg)
            else:
                normed, hidden = self.drafter.backbone(step_ids, hidden, pos + j, cache, seg)
            yield j, normed

    def _recomputed_step(self, step_ids, hidden, positions, cache, seg):
        """One step whose activations are recomputed in the backward pass instead of kept
        (train.recompute_steps: memory of one step's activations, not of all seven). The step
        runs on a copy of the cache; the recomputation runs on another copy of the cache as this
        step saw it, so it sees neither later steps' keys nor adds its own twice. The keys it
        adds reach later steps through the copy the forward pass kept."""
        seen = cache.copy()
        ran = []

        def step(step_ids, hidden, positions):
            scratch = seen.copy()
            ran.append(scratch)
            return self.drafter.backbone(step_ids, hidden, positions, scratch, seg)

        normed, hidden = torch.utils.checkpoint.checkpoint(step, step_ids, hidden, positions, use_reentrant=False)
        cache.adopt(ran[0])
        return normed, hidden

    def forward(self, batch, target_logits, positions, step_weights=None):
        """Per step: (sum of soft CE, number of positions, top-1 hits) over this rank's rows;
        CE and hits are device tensors (read at log time, not in the step).

        With ``step_weights`` ([ttt_length], each step's weight in the loss): (loss, those
        results), loss = sum_j step_weights[j] x CE_j, its head-weight gradient formed in the
        forward pass into one buffer for all steps (draft_loss.SharedHeadGradient); the CEs
        returned are then detached."""
        if batch is None:  # a rank with no row this step still joins DDP's reduction
            zero = sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
            if step_weights is None:
                return [(zero, 0, zero.detach())] * self.ttt_length
            return zero, [(zero.detach(), 0, zero.detach())] * self.ttt_length
        shared = None
        if step_weights is not None and torch.is_grad_enabled() and self.drafter.lm_head.weight.requires_grad:
            shared = draft_loss.SharedHeadGradient(self.drafter.lm_head.weight)
        target_ids = target_logits.argmax(-1)
        results, terms = [], []
        for j, normed in self.unroll(batch):
            rows = positions[j]
            counted = (normed.flatten(0, 1)[rows], target_logits[rows + 1 + j], target_ids[rows + 1 + j])
            if rows.numel() == 0:
                ce, hits = normed.sum() * 0.0, normed.new_zeros((), dtype=torch.int64)
            elif shared is not None:
                ce, hits = shared.step(*counted, self.loss_chunk_rows, step_weights[j], self.compile_loss)
            else:
                ce, hits = self.step_loss(*counted)
            results.append((ce, rows.numel(), hits))
            if step_weights is not None:
                terms.append(step_weights[j] * ce)
        if step_weights is None:
            return results
        loss = shared.loss(terms) if shared is not None else sum(terms)
        return loss, [(ce.detach(), count, hits) for ce, count, hits in results]


# ---- setup -----------------------------------------------------------------------------------------


def fingerprint(settings: dict, index_path, start_weights: str | None = None) -> str:
    """The run's identity: its content settings, objective, shards and, for a warm start, the
    digest of the weights it starts from (``start_weights``), not their path."""
    index = json.loads(Path(index_path).read_text())
    content = {key: settings[key] for key in CONTENT_KEYS if key != "init_from"}
    content["objective"] = OBJECTIVE
    content["shards"] = [entry["checksums"] for entry in index["shards"]]
    if start_weights is not None:
        content["start_weights"] = start_weights
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


# Fields a warm start's drafter must share with the drafter this run builds.
_SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                 "vocab_size", "draft_vocab_size", "target_hidden_size", "aux_layer_ids", "rope_theta")


def warm_start(model: drafter_lib.Eagle3Drafter, source, target_path) -> str:
    """Copy the trainable weights of the drafter at ``source`` (train output, checkpoint file or
    export: eaglenest.stages.export.load_any_drafter) into ``model``; return their digest.

    The source must be this run's drafter in all but its weights: same shape, aux layers and
    draft vocabulary (d2t and t2d), else a ValueError names what differs and nothing is copied.
    The embedding stays the target's (frozen, and an export may not carry it)."""
    from eaglenest.stages import export  # export imports the drafter model, not train

    start = export.load_any_drafter(source, target_path)
    differ = [f"{name} {getattr(start.config, name)} != {getattr(model.config, name)}"
              for name in _SHAPE_FIELDS if getattr(start.config, name) != getattr(model.config, name)]
    if not differ and not same_draft_vocab(start, {"d2t": model.d2t, "t2d": model.t2d}):
        differ.append("d2t/t2d (the draft vocabulary) differs")
    if differ:
        raise ValueError(f"train.init_from {source}: not this run's drafter shape: {'; '.join(differ)}")
    weights = {name: t for name, t in start.trainable_state_dict().items() if name not in ("d2t", "t2d")}
    digest = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        digest.update(name.encode())
        digest.update(shards.tensor_sha256(tensor.float()).encode())
    model.load_state_dict(weights, strict=False)  # the embedding and the vocabulary buffers stay this run's
    log.info("warm start from %s (weights %s)", source, digest.hexdigest()[:16])
    return digest.hexdigest()


def same_draft_vocab(drafter: drafter_lib.Eagle3Drafter, draft_vocab: dict) -> bool:
    """Whether the drafter's draft vocabulary (its d2t and t2d buffers) is ``draft_vocab``'s."""
    return all(torch.equal(getattr(drafter, name).cpu(), draft_vocab[name].cpu().to(getattr(drafter, name).dtype))
               for name in ("d2t", "t2d"))


def most_frequent_draft_id(draft_vocab: dict) -> int:
    """The draft id of the most frequent token: validation's chance level guesses it every time."""
    return int(draft_vocab["token_counts"][draft_vocab["t2d"]].argmax())


def compile_drafter(model: drafter_lib.Eagle3Drafter) -> None:
    """train.compile: the drafter's layer and its final norm, each step's elementwise work fused
    around the products (the loss's chunk is compiled in eaglenest.stages.draft_loss)."""
    # One graph per TTT step (each attends to one more diagonal key) and per batch shape.
    drafter_lib.allow_compiled_graphs(64)
    model.midlayer.compile(dynamic=False)
    model.norm.compile(dynamic=False)


def hidden_dtype_on(device: torch.device) -> torch.dtype:
    """The dtype hidden states are fed in: bf16 on a GPU (autocast), float32 on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={name!r} but no CUDA device is visible")
    return torch.device(name)


def cosine_schedule(warmup_steps: int, total_steps: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


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


def to_device(batch, device, hidden_dtype):
    """The batch on ``device``, hidden rows in ``hidden_dtype``; fp8 rows kept by the loader
    (``*_scale`` beside them) are dequantized here, on the device."""
    if batch is None:
        return None
    moved = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    for name in ("aux_hidden", "last_hidden"):
        scale = moved.pop(shards.SCALE_TENSORS[name], None)
        if scale is not None:
            values = moved[name]
            flat = shards.dequantize_rows(values.flatten(0, 1), scale.flatten(0, 1), hidden_dtype)
            moved[name] = flat.view(*values.shape)
        else:
            moved[name] = moved[name].to(hidden_dtype)
    return moved


def train_step(objective, head: TargetHead, batch: dict | None, local_tokens: float, decay_weights: list[float],
               trainable: list[torch.Tensor], optimizer, max_grad_norm: float, autocast, mark=None,
               after_backward=None, in_draft_cache: InDraftCache | None = None):
    """One optimizer step on a batch already on the device (None: a rank with no row this step):
    the target's soft labels, the counted positions, the TTT unroll's loss, backward, gradient
    clipping, the optimizer. ``objective`` is the TTTObjective or its DDP wrapper.
    Returns (per-step results, the global counts [positions per TTT step, tokens] as a device
    tensor, the gradient norm). ``mark(phase)`` is called as each phase is queued ("target head",
    "forward", "backward", "clip", "optimizer", "end"): benchmarks/train_step_anatomy.py times
    the phases from it. ``after_backward()`` runs once the backward pass is queued
    (DeviceBatches.prefetch: the next batch's copy then runs beside clipping and the optimizer,
    after the step's memory peak). ``in_draft_cache`` keeps the target's in-draft test of the
    samples seen (their later steps run the target head's draft block only)."""
    mark = mark or (lambda phase: None)
    length = len(decay_weights)
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    device = next(p.device for p in trainable)
    mark("target head")
    if batch is not None:
        # The target's last hidden states serve the soft labels only: gone before the
        # drafter's forward pass (0.44 GiB a step of 32,768 tokens at H 7,168).
        known = in_draft_cache.lookup(batch) if in_draft_cache is not None else None
        target_logits, in_draft = head(batch.pop("last_hidden").flatten(0, 1),
                                       None if known is None else known.flatten())
        in_draft = in_draft.view_as(batch["input_ids"])
        if in_draft_cache is not None and known is None:
            in_draft_cache.store(batch, in_draft)
        positions = step_positions(batch, in_draft, length)
        local_counts = [float(p.numel()) for p in positions] + [local_tokens]
    else:
        target_logits, positions = None, None
        local_counts = [0.0] * (length + 1)
    global_counts = torch.tensor(local_counts, dtype=torch.float64).to(device, non_blocking=True)
    if distributed:
        dist.all_reduce(global_counts)
    # Normalise by the global count so that DDP's mean over ranks is the global-batch loss.
    step_weights = torch.stack([w * world_size / global_counts[j].clamp(min=1.0)
                                for j, w in enumerate(decay_weights)])
    mark("forward")
    with autocast:
        loss, results = objective(batch, target_logits, positions, step_weights)
    mark("backward")
    loss.backward()
    if after_backward is not None:
        after_backward()
    mark("clip")
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
    mark("optimizer")
    optimizer.step()
    # Free the gradients now, not before the next backward pass: kept, they would sit through
    # the next forward pass, at its peak (3.6 GiB for the Kimi-shaped drafter,
    # benchmarks/train_memory.py).
    optimizer.zero_grad(set_to_none=True)
    mark("end")
    return results, global_counts, grad_norm


class DeviceBatches:
    """Iterate (step, epoch, batch on the device or None, the batch's tokens) over a StepStream.

    On a GPU, ``prefetch()`` (called by the step once its backward pass is queued) takes the
    next batch from the stream and starts its copy to the device, and its fp8 dequantisation,
    on a stream of its own: the copy (4.5 ms of a 4,096-token Kimi-shaped step on an H200,
    benchmarks/train_step_anatomy.py) then runs beside the step's clipping and optimizer instead
    of before its next forward pass. The step waits for the copy on the device, not the host.
    On a CPU ``prefetch()`` takes the next batch as well, and moves it at once. When nothing
    was prefetched, the batch is moved as the step begins."""

    _END = object()  # prefetch() found the stream ended

    def __init__(self, stream, device: torch.device, hidden_dtype: torch.dtype):
        self.batches = iter(stream)
        self.device, self.hidden_dtype = device, hidden_dtype
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.upcoming = None  # (step, epoch, host batch, device batch, copied event or None) or _END

    def prefetch(self) -> None:
        if self.upcoming is not None:
            return
        item = next(self.batches, None)
        if item is None:
            self.upcoming = self._END
            return
        step, epoch, batch = item
        if self.copy_stream is None:
            self.upcoming = (step, epoch, batch, to_device(batch, self.device, self.hidden_dtype), None)
            return
        # Allocated now, with the step's backward pass queued: the allocator has the step's
        # activations back, so the next batch does not add to the step's peak. Its buffers
        # belong to the copy stream and are marked below for the stream of the step that reads them.
        with torch.cuda.stream(self.copy_stream):
            moved = to_device(batch, self.device, self.hidden_dtype)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        self.upcoming = (step, epoch, batch, moved, copied)

    def __iter__(self):
        return self

    def __next__(self):
        upcoming, self.upcoming = self.upcoming, None
        if upcoming is self._END:
            raise StopIteration
        if upcoming is None:
            step, epoch, batch = next(self.batches)
            moved = to_device(batch, self.device, self.hidden_dtype)
        else:
            step, epoch, batch, moved, copied = upcoming
            if copied is not None and moved is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(copied)
                for value in moved.values():
                    if torch.is_tensor(value):  # the batch's host entries (its ``samples``) stay as they are
                        value.record_stream(current)
        return step, epoch, moved, float(batch["tokens"]) if batch is not None else 0.0


# ---- validation ---------------------------------------------------------------------------------------


@torch.no_grad()
def validate(objective: TTTObjective, head: TargetHead, dataset, settings, device, hidden_dtype, top_draft_id,
             rank=0, world_size=1) -> dict:
    """Per TTT step: mean soft CE, top-1 accuracy, and the accuracy of always guessing the most
    frequent draft token (the chance level to beat), over the positions that count."""
    length = settings["ttt_length"]
    steps = loader.epoch_steps(dataset, settings["token_budget"], settings["rows_per_step"], 0, 0, shuffle=False)
    reader = loader.RowReader(dataset, keep_fp8=device.type == "cuda")
    # [ce, count, hits, chance] per step, summed on the device and read once at the end.
    sums = torch.zeros(length, 4, dtype=torch.float64, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    pad_to = settings["token_budget"] if device.type == "cuda" else None
    pad_rows = loader.rows_per_rank(settings["rows_per_step"], world_size) if device.type == "cuda" else None
    for rows in steps:
        mine = rows[rank::world_size]
        if not mine:
            continue
        batch = to_device(reader.batch(mine, pad_to=pad_to, pad_rows=pad_rows), device, hidden_dtype)
        target_logits, in_draft = head(batch["last_hidden"].flatten(0, 1))
        positions = step_positions(batch, in_draft.view_as(batch["input_ids"]), length)
        with autocast:
            results = objective(batch, target_logits, positions)
        target_ids = target_logits.argmax(-1)
        for j, (ce, count, hits) in enumerate(results):
            chance = (target_ids[positions[j] + 1 + j] == top_draft_id).sum()
            sums[j] += torch.stack([torch.as_tensor(ce, dtype=torch.float64, device=device),
                                    torch.tensor(float(count), dtype=torch.float64, device=device),
                                    hits.to(torch.float64), chance.to(torch.float64)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    sums = sums.tolist()
    counts = [sums[j][1] for j in range(length)]
    return {
        "loss": [sums[j][0] / max(counts[j], 1) for j in range(length)],
        "acc": [sums[j][2] / max(counts[j], 1) for j in range(length)],
        "chance_acc": [sums[j][3] / max(counts[j], 1) for j in range(length)],
        "positions": [int(c) for c in counts],
    }


def validate_drafter(drafter_path, index_path, draft_vocab_path, split_path, target_path, settings: dict | None = None,
                     expect: dict | None = None) -> dict:
    """``validate`` of any saved drafter (train output, checkpoint file or export) on a run's
    validation split, in eager mode: what the training curve's validation measured, recomputed
    outside the training process (e.g. to check a compiled run's figures)."""
    from eaglenest.stages import export

    settings = settings_lib.section(settings, "train")
    device = resolve_device(settings["device"], 0)
    hidden_dtype = hidden_dtype_on(device)
    val_set = loader.open_split(index_path, split_path, "val", expect)
    draft_vocab = vocab.load_draft_vocab(draft_vocab_path)
    top_draft_id = most_frequent_draft_id(draft_vocab)
    model = export.load_any_drafter(drafter_path, target_path)
    if not same_draft_vocab(model, draft_vocab):
        raise ValueError(f"{drafter_path}: its draft vocabulary is not the run's ({draft_vocab_path})")
    model = model.to(device).eval()
    head = TargetHead(target_path, draft_vocab["t2d"], device, hidden_dtype)
    objective = TTTObjective(model, settings["ttt_length"], settings["loss_chunk_rows"], settings["attention"])
    return validate(objective, head, val_set, settings, device, hidden_dtype, top_draft_id)


# ---- the loop ----------------------------------------------------------------------------------------------


def train(*args, **kwargs) -> dict:
    """Train (or resume) a drafter; see :func:`_train` for the arguments.

    Process-wide torch settings (threads, deterministic algorithms) are restored afterwards.
    """
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return _train(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(
    index_path,
    draft_vocab_path,
    split_path,
    target_path,
    out_dir,
    checkpoint_dir,
    settings: dict | None = None,
    target_name: str = "",
    expect: dict | None = None,
    log_stream=None,
    summary_path=None,
    stop_after_steps: int | None = None,
) -> dict:
    """Train (or resume) and write out_dir/{model.safetensors, config.json, training_curve.json}
    and, when given, ``summary_path`` (the curve's summary: throughput, final val accuracy).

    ``stop_after_steps`` ends the process's work after that many steps of this invocation
    without writing the final drafter (tests use it to make an interrupted run).
    """
    settings = settings_lib.section(settings, "train")  # the schema's defaults; unknown keys raise
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(settings["device"], local_rank)
    if distributed and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world_size = dist.get_world_size() if distributed else 1
    if settings["rows_per_step"] % world_size and rank == 0:
        log.warning("rows_per_step %d is not a multiple of %d processes: some ranks idle on some steps",
                    settings["rows_per_step"], world_size)
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    torch.set_num_threads(settings["threads"])
    if device.type == "cpu" and settings["deterministic"]:
        torch.use_deterministic_algorithms(True)
    hidden_dtype = hidden_dtype_on(device)

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if rank == 0:
        atomic.remove_stale_temps(checkpoint_dir)
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    train_set = loader.open_split(index_path, split_path, "train", expect)
    val_set = loader.open_split(index_path, split_path, "val", expect)
    draft_vocab = vocab.load_draft_vocab(draft_vocab_path)
    top_draft_id = most_frequent_draft_id(draft_vocab)

    model = drafter_lib.build_drafter(
        target_path, draft_vocab, train_set.layer_ids, target_name=target_name, seed=settings["seed"],
        init_head_from_target=settings["init_head_from_target"], **settings["drafter"],
    )
    if model.config.target_hidden_size != train_set.hidden_size:
        raise ValueError(f"target hidden size {model.config.target_hidden_size} != shards' {train_set.hidden_size}")
    start_weights = warm_start(model, settings["init_from"], target_path) if settings["init_from"] else None
    run_fingerprint = fingerprint(settings, index_path, start_weights)
    model.to(device)
    head = TargetHead(target_path, draft_vocab["t2d"], device, hidden_dtype)
    objective = TTTObjective(model, settings["ttt_length"], settings["loss_chunk_rows"], settings["attention"],
                             settings["recompute_steps"])
    if settings["compile"] and device.type == "cuda":
        compile_drafter(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings["lr"], betas=(0.9, 0.95),
                                  weight_decay=settings["weight_decay"], fused=device.type == "cuda")
    stream = loader.StepStream(
        train_set, settings["token_budget"], settings["rows_per_step"], settings["seed"], settings["epochs"],
        rank=rank, world_size=world_size, prefetch=settings["prefetch"],
        pad_to_budget=device.type == "cuda", pin_memory=device.type == "cuda", keep_fp8=device.type == "cuda",
    )
    total_steps = len(stream)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_schedule(settings["warmup_steps"], total_steps, settings["min_lr_ratio"])
    )
    curve = {"train": [], "val": []}
    start_step = 0
    state = load_latest_checkpoint(checkpoint_dir, run_fingerprint)
    if state is not None:
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        curve = state["curve"]
        start_step = state["step"]
    stream.start_step = start_step
    ddp = objective
    if distributed:
        ddp = nn.parallel.DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)

    def checkpoint(step: int):
        if rank == 0:
            save_checkpoint(checkpoint_dir, {
                "format": CHECKPOINT_FORMAT, "fingerprint": run_fingerprint, "step": step,
                "epoch": stream.schedule[min(step, total_steps - 1)][0] if total_steps else 0,
                "model": {k: v.cpu() for k, v in model.trainable_state_dict().items()},
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state(),
                "curve": curve, "drafter_config": model.config.to_dict(), "target_path": str(target_path),
                "settings": settings,
            }, settings["keep_checkpoints"])
        if distributed:
            dist.barrier()

    def run_validation(step: int):
        model.eval()
        result = validate(objective, head, val_set, settings, device, hidden_dtype, top_draft_id, rank, world_size)
        model.train()
        curve["val"].append({"step": step, **result})
        log.info("val step %d: acc per TTT position %s (chance %s)", step,
                 [round(a, 4) for a in result["acc"]], [round(a, 4) for a in result["chance_acc"]])
        return result

    from tqdm import tqdm

    progress = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=log_stream or sys.stderr,
                    disable=rank != 0, mininterval=5.0, dynamic_ncols=False)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    length = settings["ttt_length"]
    decay_weights = [settings["decay"] ** j for j in range(length)]
    loop_began = time.perf_counter()
    tokens_seen, steps_done = 0, 0
    # Steps whose statistics are still on the device: (record so far, [ce x L, hits x L, counts x L,
    # tokens, grad norm]). Read in one copy at log, validation and checkpoint time, so that the
    # step itself never waits for the device beyond the counted positions.
    pending: list[tuple[dict, torch.Tensor]] = []

    def flush_records() -> None:
        nonlocal tokens_seen
        if not pending:
            return
        stacked = torch.stack([stats for _, stats in pending])
        if distributed:  # ce and hits are per rank; counts and the gradient norm are global already
            per_rank = stacked[:, : 2 * length].contiguous()
            dist.all_reduce(per_rank)
            stacked[:, : 2 * length] = per_rank
        for (record, _), values in zip(pending, stacked.tolist()):
            counts = values[2 * length : 3 * length]
            record.update({
                "grad_norm": values[-1],
                "loss": sum(w * values[j] / max(counts[j], 1) for j, w in enumerate(decay_weights)),
                "acc": [values[length + j] / max(counts[j], 1) for j in range(length)],
                "positions": [int(c) for c in counts], "tokens": int(values[3 * length]),
            })
            curve["train"].append(record)
            tokens_seen += record["tokens"]
        last = pending[-1][0]
        progress.set_postfix(loss=f"{last['loss']:.3f}", acc0=f"{last['acc'][0]:.3f}", refresh=False)
        log.info("step %d/%d epoch %d loss %.4f acc %s lr %.2e grad %.3f", last["step"], total_steps, last["epoch"],
                 last["loss"], [round(a, 3) for a in last["acc"]], last["lr"], last["grad_norm"])
        pending.clear()

    log.info("training %d steps (%d train samples, %d tokens; %d val samples) on %s x%d from step %d",
             total_steps, len(train_set.samples), train_set.num_tokens, len(val_set.samples), device, world_size,
             start_step)
    model.train()
    try:
        waited_before = 0.0
        step_ended = time.perf_counter()
        batches = DeviceBatches(stream, device, hidden_dtype)
        in_draft_cache = InDraftCache(train_set, device)
        for step, epoch, batch, local_tokens in batches:
            results, global_counts, grad_norm = train_step(ddp, head, batch, local_tokens, decay_weights, trainable,
                                                           optimizer, settings["max_grad_norm"], autocast,
                                                           after_backward=batches.prefetch, in_draft_cache=in_draft_cache)
            scheduler.step()
            stats = torch.cat([
                torch.stack([torch.as_tensor(ce, device=device).detach().to(torch.float64) for ce, _, _ in results]),
                torch.stack([torch.as_tensor(h, device=device).to(torch.float64) for _, _, h in results]),
                global_counts, grad_norm.detach().to(torch.float64).reshape(1),
            ])
            now = time.perf_counter()
            # The loader's wait since the last step ended: at the top of this step, or where the
            # next batch was fetched early (DeviceBatches.prefetch).
            waited, waited_before = stream.wait_seconds - waited_before, stream.wait_seconds
            pending.append(({"step": step + 1, "epoch": epoch, "lr": scheduler.get_last_lr()[0],
                             "seconds": now - step_ended - waited, "data_wait_seconds": waited}, stats))
            step_ended = now
            steps_done += 1
            progress.update(1)
            validating = settings["val_every"] and (step + 1) % settings["val_every"] == 0 and step + 1 < total_steps
            checkpointing = (step + 1) % settings["checkpoint_every"] == 0 or step + 1 == total_steps
            stopping = stop_after_steps is not None and steps_done >= stop_after_steps
            if (step + 1) % settings["log_every"] == 0 or validating or checkpointing or stopping:
                flush_records()
            if validating:
                run_validation(step + 1)
            if checkpointing:
                checkpoint(step + 1)
            if stopping:
                return {"stopped_at": step + 1}
    finally:
        stream.close()
        progress.close()
    loop_seconds = time.perf_counter() - loop_began

    final_val = run_validation(total_steps) if (not curve["val"] or curve["val"][-1]["step"] != total_steps) \
        else curve["val"][-1]
    summary = {
        "steps": total_steps, "resumed_from_step": start_step, "processes": world_size, "device": str(device),
        "tokens_this_invocation": tokens_seen,
        "tokens_per_second": tokens_seen / loop_seconds if loop_seconds and steps_done else None,
        "data_wait_fraction": stream.wait_seconds / loop_seconds if loop_seconds and steps_done else None,
        "final_val_acc": final_val["acc"], "final_val_chance_acc": final_val["chance_acc"],
        "final_val_loss": final_val["loss"], "final_val_positions": final_val["positions"],
        "ttt_length": settings["ttt_length"], "train_tokens_per_epoch": train_set.num_tokens,
        "fingerprint": run_fingerprint,
        # This rank's most allocated at once (rank 0 writes the summary), since the process began
        # or the caller last reset the peak.
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    curve["summary"] = summary
    log.info("done: %s", json.dumps(summary))
    if rank == 0:
        model.save(out_dir, extra_config={"architectures": ["Eagle3Drafter"], "layer_ids_convention": "hf"})
        atomic.write_json(out_dir / "training_curve.json", curve)
        if summary_path:
            atomic.write_json(summary_path, summary)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def launch(arguments: dict, processes: int = 1) -> None:
    """Run ``train(**arguments)``; with processes > 1 under torchrun (DDP), one per GPU or CPU worker."""
    if processes <= 1:
        train(**arguments)
        return
    checkpoint_dir = Path(arguments["checkpoint_dir"])
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    args_file = checkpoint_dir / "launch.json"
    atomic.write_json(args_file, {k: v for k, v in arguments.items() if k != "log_stream"})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", "eaglenest.stages.train", str(args_file)]
    log.info("launching %s", " ".join(command))
    stream = arguments.get("log_stream")
    result = subprocess.run(command, stdout=stream or None, stderr=subprocess.STDOUT if stream else None)
    if result.returncode != 0:
        raise RuntimeError(f"torchrun exited with {result.returncode}; see the log above")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="eaglenest drafter training worker (one torchrun rank)")
    parser.add_argument("arguments", help="JSON file with the arguments of eaglenest.stages.train.train")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(**json.loads(Path(args.arguments).read_text()))


if __name__ == "__main__":
    main()
