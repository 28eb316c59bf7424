"""The training-time-test (TTT) objective: unroll the drafter ``ttt_length`` steps and sum
each step's soft cross-entropy against the target's distribution.

Alignment, per packed sample with tokens x_0..x_{n-1}: step j at position t reads token
x_{t+1+j} and predicts x_{t+2+j}; its target is softmax(lm_head_t2d(last_hidden[t+1+j]))
(eaglenest.training.target_head). The position counts when x_{t+2+j} is in the same sample,
carries loss mask 1 (an assistant token) and the target's full-vocab argmax at t+1+j lies in
the draft vocab (:func:`step_positions`).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from eaglenest import settings as settings_lib
from eaglenest.model import drafter as drafter_lib
from eaglenest.model import kernels
from eaglenest.model.context_attention import TTTCache
from eaglenest.training import draft_loss

# The train settings' defaults (config/schema.yaml), for TTTObjective's arguments.
DEFAULTS = settings_lib.defaults("train")
# What the objective computes beyond the settings: a change of convention (TTT step j moved
# from step 0's rotary positions to t + j) must neither resume an old checkpoint nor keep an
# old drafter. rules/train.smk passes the same string as a param (tests keep them equal), so
# Snakemake retrains when it changes.
OBJECTIVE = "ttt-rotary-t+j"


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
        # A step's loss runs loss_chunk_rows positions at a time (eaglenest.training.draft_loss): one
        # chunk's [positions, draft vocab] float32 block exists at a time.
        self.loss_chunk_rows = loss_chunk_rows
        self.attention_backend = attention_backend
        self.recompute_steps = recompute_steps
        # On a GPU the loss chunk's elementwise part runs compiled whatever train.compile says, as
        # the merge of the diagonal keys does: 3.7x the eager chunk at 4,096 x 32,000 on an H200
        # (benchmarks/loss_chunk.py). False keeps it eager.
        self.compile_loss = compile_loss

    def step_loss(self, normed_rows, target_logits, target_ids, row_weights=None):
        """(sum of soft CE, each row's times its ``row_weights`` entry if given; top-1 hits) over
        the rows, as device tensors."""
        return draft_loss.head_soft_cross_entropy(normed_rows, self.drafter.lm_head.weight, target_logits,
                                                  target_ids, self.loss_chunk_rows, self.compile_loss, row_weights)

    def unroll(self, batch):
        """Yield (j, normed [B, T, H]) per TTT step. Step j at position t reads x_{t+1+j} and sits
        at rotary position t + j, where the drafter puts its j-th drafted token when it drafts
        (eaglenest.model.speculate, SGLang); its attention follows TTTCache."""
        ids, seg, pos = batch["input_ids"], batch["segment_ids"], batch["position_ids"]
        hidden = batch["aux_hidden"]
        cache = TTTCache(self.attention_backend)
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

    def forward(self, batch, target_logits, positions, step_weights=None, position_weights=None):
        """Per step: (sum of soft CE, number of positions, top-1 hits) over this rank's rows;
        CE and hits are device tensors (read at log time, not in the step).

        With ``step_weights`` ([ttt_length], each step's weight in the loss): (loss, those
        results), loss = sum_j step_weights[j] x CE_j, its head-weight gradient formed in the
        forward pass into one buffer for all steps (draft_loss.SharedHeadGradient); the CEs
        returned are then detached. ``position_weights`` (per step, one weight per counted
        position, or None) weighs each position's CE in its step's sum (train.short_context_weight)."""
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
            row_weights = None if position_weights is None else position_weights[j]
            if rows.numel() == 0:
                ce, hits = normed.sum() * 0.0, normed.new_zeros((), dtype=torch.int64)
            elif shared is not None:
                ce, hits = shared.step(*counted, self.loss_chunk_rows, step_weights[j], self.compile_loss, row_weights)
            else:
                ce, hits = self.step_loss(*counted, row_weights)
            results.append((ce, rows.numel(), hits))
            if step_weights is not None:
                terms.append(step_weights[j] * ce)
        if step_weights is None:
            return results
        loss = shared.loss(terms) if shared is not None else sum(terms)
        return loss, [(ce.detach(), count, hits) for ce, count, hits in results]


def compile_drafter(model: drafter_lib.Eagle3Drafter) -> None:
    """train.compile: the drafter's layer and its final norm, each step's elementwise work fused
    around the products (the loss's chunk is compiled in eaglenest.training.draft_loss)."""
    # One graph per TTT step (each attends to one more diagonal key) and per batch shape.
    kernels.allow_compiled_graphs(64)
    model.midlayer.compile(dynamic=False)
    model.norm.compile(dynamic=False)
