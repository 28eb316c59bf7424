"""One TTT step's loss: the drafter's head over the draft vocabulary, the soft cross-entropy
against the target's distribution, and the top-1 hits, in one pass that also forms the gradient.

The head's logits and the target's probabilities are [positions, draft vocab] blocks (27,500 x
32,000 float32 is 3.5 GB for a SmolLM2 step on an H200); every elementwise pass over them costs
memory bandwidth, not FLOPs. Autograd's path reads and writes such blocks many times: the
forward pass, a recomputation of the logits for the backward pass (or keeping them), and the
backward pass's softmaxes. Here the gradient of the loss with respect to the logits,
softmax(z) - p, is formed in the same pass that computes the loss, chunk by chunk, and turned
at once into the gradients of the head's input and weight. Those two small tensors are all the
backward pass keeps; it only scales them by the loss's upstream gradient (a scalar, the step's
weight in the objective), which is exact because the loss is linear in its upstream scale.

On a GPU with ``compiled=True`` (the training step's default, TTTObjective in
eaglenest.training.objective) the elementwise part of a chunk runs compiled: a few fused
kernels that read a row's block together.
"""

from __future__ import annotations

import torch


def soft_ce_chunk(logits: torch.Tensor, target_logits: torch.Tensor, target_ids: torch.Tensor, with_grad: bool,
                  per_row: bool = False, row_weights: torch.Tensor | None = None):
    """(sum over rows of -sum_k p_k log softmax(z)_k in float32, top-1 hits (argmax z ==
    ``target_ids``), d/dz of that sum in ``logits``' dtype or None), for z = ``logits`` and
    p = softmax(``target_logits``), both [rows, vocab].

    sum_k p_k (lse(z) - z_k) = lse(z) - p . z since the p_k of a row sum to one; the gradient
    softmax(z) - p overwrites the float32 copy of z in place. Hits and the gradient's cast are
    read from the same pass, so a compiled chunk reads each [rows, vocab] block a few times and
    writes the gradient once, in the dtype the head's products take it in.

    ``per_row`` (the compiled chunk) sums p . z row by row, as the other reductions go, so the
    compiler fuses them into the kernels that read a row; one dot product over the whole block
    made it split that reduction into kernels of their own. On an H200 (benchmarks/loss_chunk.py)
    an 8,192 x 32,000 chunk took 4.85 ms that way and takes 1.89 ms row by row (7.20 ms eagerly).
    Eagerly the one dot product needs no [rows, vocab] temporary.

    ``row_weights`` [rows] (train.short_context_weight): the sum weighs each row's CE by its
    weight. The gradient returned stays unweighted (the caller scales the head's [rows, H]
    products by the weights, not this [rows, vocab] block)."""
    z = logits.float()
    # z is logits widened exactly: the same argmax, ties included.
    hits = (z.argmax(-1) == target_ids).sum()
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(target_logits.float(), dim=-1)
    if row_weights is not None:
        total = ((lse - (p * z).sum(-1)) * row_weights).sum()
    elif per_row:
        total = (lse - (p * z).sum(-1)).sum()
    else:
        total = lse.sum() - torch.dot(p.flatten(), z.flatten())
    if not with_grad:
        return total, hits, None
    return total, hits, z.sub_(lse.unsqueeze(-1)).exp_().sub_(p).to(logits.dtype)


def soft_ce_chunk_per_row(logits, target_logits, target_ids, with_grad, row_weights=None):
    """soft_ce_chunk with its reductions row by row: the function compiled for a GPU."""
    return soft_ce_chunk(logits, target_logits, target_ids, with_grad, per_row=True, row_weights=row_weights)


_compiled_chunk = None


def _chunk_function(compiled: bool):
    global _compiled_chunk
    if not compiled:
        return soft_ce_chunk
    if _compiled_chunk is None:
        # Each step's number of counted positions differs: one kernel for every row count.
        _compiled_chunk = torch.compile(soft_ce_chunk_per_row, dynamic=True)
    return _compiled_chunk


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype the head's product runs in: autocast's on a GPU under autocast, else the input's."""
    if tensor.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return tensor.dtype


class HeadSoftCrossEntropy(torch.autograd.Function):
    """(sum of soft CE, top-1 hits) of ``normed @ weight.T`` against ``target_logits``.

    normed [N, H], weight [D, H] (the drafter's lm_head), target_logits [N, D] (the target's
    draft-vocabulary logits), target_ids [N] (their argmax). Rows go ``chunk_rows`` at a time,
    so no more than one chunk's [chunk_rows, D] float32 block exists. The gradient of the
    weight is accumulated in float32 over the chunks. ``row_weights`` [N] (or None) weighs each
    row's CE in the sum, and so its gradient; the hits are counted unweighted."""

    @staticmethod
    def forward(ctx, normed, weight, target_logits, target_ids, chunk_rows: int, compiled: bool,
                shared_weight_grad=None, scale=None, row_weights=None):
        ctx.normed_dtype, ctx.weight_dtype = normed.dtype, weight.dtype
        want_input, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # A shared float32 buffer takes this step's weight gradient, times its loss weight ``scale``,
        # in place of a [D, H] float32 gradient of its own (SharedHeadGradient).
        shared = shared_weight_grad is not None
        with_grad = want_input or want_weight or shared
        compute = _compute_dtype(normed)
        x, w = normed.to(compute), weight.to(compute)
        chunk = _chunk_function(compiled and normed.is_cuda)
        total = normed.new_zeros((), dtype=torch.float32)
        hits = torch.zeros((), dtype=torch.int64, device=normed.device)
        grad_input = torch.empty_like(x) if want_input else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, x.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            part_weights = None if row_weights is None else row_weights[part]
            part_total, part_hits, grad_logits = chunk(x[part] @ w.T, target_logits[part], target_ids[part], with_grad,
                                                       row_weights=part_weights)
            total += part_total
            hits += part_hits
            if with_grad:
                # d(sum r_i CE_i)/dz_i = r_i (softmax(z_i) - p_i): the weights scale the rows of the
                # products' [rows, H] operands, not the [rows, vocab] gradient block.
                scaled = None if part_weights is None else part_weights.unsqueeze(-1).to(x.dtype)
                inputs = x[part] if scaled is None else x[part] * scaled
                if want_input:
                    grad_input[part] = grad_logits @ w if scaled is None else (grad_logits @ w) * scaled
                if want_weight:
                    grad_weight += grad_logits.T @ inputs
                if shared:
                    shared_weight_grad.addcmul_(grad_logits.T @ inputs, scale)
        ctx.save_for_backward(grad_input, grad_weight)
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, _grad_hits):
        grad_input, grad_weight = ctx.saved_tensors
        scaled_input = None if grad_input is None else (grad_input * grad_total).to(ctx.normed_dtype)
        scaled_weight = None if grad_weight is None else (grad_weight * grad_total).to(ctx.weight_dtype)
        return scaled_input, scaled_weight, None, None, None, None, None, None, None


def head_soft_cross_entropy(normed, weight, target_logits, target_ids, chunk_rows: int, compiled: bool = False,
                            row_weights=None):
    """(sum of soft CE, each row's times its ``row_weights`` entry if given, as a float32 tensor
    with a gradient; top-1 hits as an int64 tensor)."""
    return HeadSoftCrossEntropy.apply(normed, weight, target_logits, target_ids, chunk_rows, compiled, None, None,
                                      row_weights)


class _AttachHeadGradient(torch.autograd.Function):
    """A zero that hands ``buffer`` (the loss's gradient of the head weight, accumulated in the
    forward pass) to the weight in the backward pass, times the upstream gradient. The buffer is
    scaled in place and handed over, not copied (0.85 GiB for a Kimi-shaped drafter's head), so
    this backward runs once: a graph kept with retain_graph would hand over nothing the second
    time, and says so."""

    @staticmethod
    def forward(ctx, weight, buffer):
        ctx.weight_dtype = weight.dtype
        ctx.buffer = buffer
        return buffer.new_zeros(())

    @staticmethod
    def backward(ctx, grad_zero):
        buffer, ctx.buffer = ctx.buffer, None
        if buffer is None:
            raise RuntimeError("the head's shared gradient was handed over already: backward through this loss runs once")
        return buffer.mul_(grad_zero).to(ctx.weight_dtype), None


class SharedHeadGradient:
    """The soft CE of several TTT steps through one head, with one float32 [D, H] gradient buffer
    for the head's weight instead of one per step (7 x 0.85 GiB for a Kimi-shaped drafter's 32K
    draft vocabulary, all alive at the backward pass's peak: benchmarks/train_memory.py).

    Each step's loss weight must be known in the forward pass: ``step(…, scale)`` adds
    ``scale`` x that step's weight gradient to the buffer and returns the step's CE, whose own
    gradient reaches only the head's input. ``loss(terms)`` is sum(scale x CE) plus a zero
    that carries the buffer to the weight: the gradients equal autograd's through
    ``head_soft_cross_entropy`` per step (float32 rounding aside), for any upstream gradient
    of that loss."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.buffer = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

    def step(self, normed, target_logits, target_ids, chunk_rows: int, scale: torch.Tensor, compiled: bool = False,
             row_weights=None):
        """(sum of soft CE, weighted by ``row_weights`` if given, with a gradient to ``normed``
        only; top-1 hits)."""
        scale = scale.to(device=self.buffer.device, dtype=torch.float32)
        return HeadSoftCrossEntropy.apply(normed, self.weight.detach(), target_logits, target_ids, chunk_rows,
                                          compiled, self.buffer, scale, row_weights)

    def loss(self, terms) -> torch.Tensor:
        """sum of ``terms`` (each a step's scale x CE) plus the zero that carries the weight's
        gradient; the buffer now belongs to that loss."""
        buffer, self.buffer = self.buffer, None
        return sum(terms) + _AttachHeadGradient.apply(self.weight, buffer)
