"""The target's distribution over the draft vocab, the soft labels of the drafter's loss.

The consolidated shards keep the target's last hidden state, not its logits: a step computes
the logits over the draft vocab from it with the target's lm_head (:class:`TargetHead`), and
whether the target's full-vocabulary argmax is a draft token (a position counts only then).
:class:`InDraftCache` keeps that test per token from a sample's first step on.
"""

from __future__ import annotations

import torch

from eaglenest.target_model.weights import load_target_rows


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

    def __init__(self, target_path, t2d: torch.Tensor, device, dtype, chunk_elements: int = 1 << 26,
                 temperature: float = 1.0):
        full = load_target_rows(target_path, "lm_head")
        if full.shape[0] != t2d.numel():
            raise ValueError(f"target lm_head has {full.shape[0]} rows, draft vocab t2d covers {t2d.numel()}")
        t2d = t2d.bool()
        draft, other = t2d.nonzero().squeeze(-1), (~t2d).nonzero().squeeze(-1)
        self.draft_columns, self.other_columns = draft.to(device), other.to(device)
        # One tensor, draft rows first: the two blocks are views of it (no second copy of the head).
        rows = torch.cat([full[draft], full[other]]).to(device=device, dtype=dtype)
        self.draft_rows, self.other_rows = rows[: draft.numel()], rows[draft.numel():]
        self.chunk_rows = max(1, chunk_elements // full.shape[0])
        # train.target_temperature: the labels' logits divided by it, after the in-draft test
        # (which compares raw logits); argmax, and so the hits, are unchanged
        self.temperature = temperature

    @torch.no_grad()
    def __call__(self, last_hidden: torch.Tensor, in_draft: torch.Tensor | None = None):
        """last_hidden [N, H] -> (draft-vocab logits [N, D] in the head's dtype, divided by the
        temperature, in_draft [N] bool)."""
        x = last_hidden.to(self.draft_rows.dtype)
        logits = x @ self.draft_rows.T  # all rows at once: the [N, D] result is kept anyway
        if in_draft is None:
            in_draft = torch.cat([self._argmax_is_draft(draft, chunk) for draft, chunk
                                  in zip(logits.split(self.chunk_rows), x.split(self.chunk_rows))])
        if self.temperature != 1.0:
            logits = logits / self.temperature
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
