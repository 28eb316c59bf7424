"""The drafter's custom autograd functions: its norms, the merge of the diagonal keys (beside
its plain form, the reference the tests hold it to) and the MLP's gate.

Autograd's graph of a norm, of the merge or of the gate keeps float32 copies and intermediate
results for the backward pass; these functions keep only their inputs (or what other layers
keep anyway), recompute the rest in the backward pass and form the gradient in closed form, a
chunk of rows at a time (CHUNK_ELEMENTS). The savings at a Kimi-shaped drafter's scale are in
benchmarks/train_memory.py and docs/performance/training-step.md.

    rms_norm                       Llama's RMSNorm, keeping x and the inverse RMS only
    merge_diagonal_keys            softmax over [context ; diagonal keys] from the context's
                                   log-sum-exp; merge_diagonal_keys_autograd is the plain form,
                                   fused_merge the form torch.compile fuses (run on a GPU)
    swiglu                         silu(gate) * up, keeping gate and up only
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Values a norm or the MLP's gate handles at once outside its matmuls (2^24: 64 MiB for a
# float32 temporary): 2,340 rows of a Kimi-shaped drafter's H 7,168 (910 of its MLP's 18,432),
# 29,127 of SmolLM2's H 576, so a small model's step, bound by kernel launches, is cut into a
# couple of chunks at most. A module constant, which torch.compile reads as one (compiled, only
# the merge of the diagonal keys runs in chunks: _elementwise_chunks).
CHUNK_ELEMENTS = 1 << 24


def _row_chunks(rows: int, width: int) -> list[slice]:
    """Slices of ``rows`` rows of ``width`` values, CHUNK_ELEMENTS values a slice at most."""
    step = max(1, CHUNK_ELEMENTS // width)
    return [slice(start, start + step) for start in range(0, rows, step)]


def _elementwise_chunks(rows: int, width: int) -> list[slice]:
    """:func:`_row_chunks` for work that is elementwise or reduces along a row (the norms, the
    gate): one slice under torch.compile, whose fused kernels keep no float32 temporaries, so
    chunks would only repeat kernels in the graph (and its compile)."""
    return [slice(0, rows)] if torch.compiler.is_compiling() else _row_chunks(rows, width)


class _RMSNorm(torch.autograd.Function):
    """weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), x32 = x in float32, keeping only
    x and the inverse RMS for the backward pass. Autograd's graph of the same expression keeps
    a float32 copy of x and the normalised x too, 6 bytes a value: 1.3 GiB per norm at 32,768
    tokens of a Kimi-shaped drafter (H 7,168), four norms per TTT step
    (benchmarks/train_memory.py). The forward pass is those ops exactly, a chunk of rows at a
    time (CHUNK_ELEMENTS values: its float32 temporaries are a chunk's); the backward pass
    recomputes x32 and the normalised x, a chunk at a time too, and forms the gradient in
    closed form."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        size = x.shape[-1]
        rows_x = x.reshape(-1, size)
        # Under autocast, the output in autocast's dtype: the cast each projection reading it
        # would make, made once, so they keep one half-precision copy for the backward pass
        # instead of one each (q/k/v_proj three, gate/up_proj two: 2.6 GiB a TTT step at
        # 32,768 tokens of a Kimi-shaped drafter). The values are the same; the gradient comes
        # back in that dtype and is widened a chunk at a time, never as a whole float32 [T, H].
        out_dtype = (torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type)
                     else torch.promote_types(weight.dtype, x.dtype))
        out = torch.empty(rows_x.shape, dtype=out_dtype, device=x.device)
        inv_rms = torch.empty(rows_x.shape[0], 1, dtype=torch.float32, device=x.device)
        # Row by row the same ops: chunks of rows keep the float32 temporaries a chunk's.
        for part in _elementwise_chunks(rows_x.shape[0], size):
            x32 = rows_x[part].float()
            inv_rms[part] = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            out[part] = weight * (x32 * inv_rms[part]).to(x.dtype)
        ctx.save_for_backward(x, weight, inv_rms)
        return out.view(*x.shape[:-1], size)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, inv_rms = ctx.saved_tensors
        want_x, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        size = x.shape[-1]
        rows_x, rows_g = x.reshape(-1, size), grad_out.reshape(-1, size)
        grad_x = torch.empty_like(rows_x) if want_x else None
        grad_weight = torch.zeros(size, dtype=torch.float32, device=x.device) if want_weight else None
        for part in _elementwise_chunks(rows_x.shape[0], size):
            x32, r, g = rows_x[part].float(), inv_rms[part], rows_g[part].float()
            if want_weight:
                grad_weight += (g * (x32 * r).to(x.dtype)).sum(0)
            if want_x:
                # Through the cast to x's dtype, as autograd goes; then d(x32 * r)/dx32 with
                # r = (mean(x32^2) + eps)^-1/2: r g - r^3 x32 mean(g x32).
                g_normed = (g * weight).to(x.dtype).float()
                grad_x[part] = r * g_normed - x32 * r.pow(3) * (g_normed * x32).mean(-1, keepdim=True)
        return (None if grad_x is None else grad_x.view_as(x),
                None if grad_weight is None else grad_weight.to(weight.dtype), None)



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype) (:class:`_RMSNorm`)."""
    return _RMSNorm.apply(x, weight, eps)


def merge_diagonal_keys_autograd(context_out, context_lse, q, draft_k, draft_v, group: int) -> torch.Tensor:
    """Softmax attention over [context keys ; one diagonal key per draft step], exactly, from
    the context part's output and log-sum-exp and the diagonal scores (dot products at each
    query's own position): no [T, j*T] matrix that would be almost all masked. Autograd's graph
    of these ops keeps float32 copies of q and the context output (1.75 GiB per TTT step at 32,768
    tokens of a Kimi-shaped drafter); :func:`merge_diagonal_keys` computes the same output and
    forms the gradient itself. This one is its reference in the tests.

    The query heads are grouped under their key/value head, so the diagonal keys and values are
    read as they are: repeated per query head in float32, each would be a [heads, T, head_dim]
    copy kept for the backward pass (j keys and j values at step j; for the Kimi-shaped drafter,
    most of the step's attention memory, benchmarks/train_memory.py)."""
    batch, heads, length, dim = q.shape
    scale = dim**-0.5
    q32 = q.float().view(batch, heads // group, group, length, dim)
    # Broadcast over the group: the products are temporaries, autograd keeps q32 and each small k.
    diagonal = torch.stack([(q32 * k.float().unsqueeze(2)).sum(-1) for k in draft_k], dim=-1)
    diagonal = diagonal.flatten(1, 2) * scale
    # Any common shift is exact; the max keeps exp() in range. No gradient flows through it.
    shift = torch.maximum(context_lse, diagonal.amax(-1)).detach()
    context_weight = torch.exp(context_lse - shift)
    diagonal_weight = torch.exp(diagonal - shift[..., None])
    total = context_weight + diagonal_weight.sum(-1)
    out = context_out.float() * (context_weight / total)[..., None]
    shares = (diagonal_weight / total[..., None]).view(batch, heads // group, group, length, len(draft_v))
    for i, v in enumerate(draft_v):
        out = out + (shares[..., i, None] * v.float().unsqueeze(2)).reshape(batch, heads, length, dim)
    return out.to(q.dtype)


def _by_position(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, heads, t, ...] with the query heads grouped under their key/value head -> float32
    [B, kv heads, t, group, ...]: each position's query group as the rows of a small matrix."""
    batch, heads, length = x.shape[:3]
    return x.float().view(batch, heads // group, group, length, *x.shape[3:]).transpose(2, 3)


def _by_head(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_by_position`'s layout: [B, kv heads, t, group, ...] -> [B, heads, t, ...]."""
    batch, kv_heads, length, group = x.shape[:4]
    return x.transpose(2, 3).reshape(batch, kv_heads * group, length, *x.shape[4:])


def _merge_shares(q32, lse32, k32, scale: float):
    """Softmax weights of [context ; diagonal keys] at each position and query head: (context
    share [B, KV, t, G], diagonal shares [B, KV, t, G, j]). The diagonal scores are one small
    product per position, [G, d] x [d, j]."""
    return _softmax_shares(lse32, torch.matmul(q32, k32.transpose(-1, -2)) * scale)


def _softmax_shares(context_lse, diagonal):
    """(context share, diagonal shares) of a softmax over [context ; diagonal keys], from the
    context part's log-sum-exp [...] and the diagonal scores [..., j]."""
    # Any common shift is exact; the max keeps exp() in range.
    shift = torch.maximum(context_lse, diagonal.amax(-1))
    context_weight = torch.exp(context_lse - shift)
    diagonal_weight = torch.exp(diagonal - shift.unsqueeze(-1))
    total = context_weight + diagonal_weight.sum(-1)
    return context_weight / total, diagonal_weight / total.unsqueeze(-1)


def _merge_chunk(part: slice, context_lse, q, draft_k, draft_v, group: int):
    """What both passes of the merge read of one chunk of positions: (q32 [B, KV, t, G, d], the
    stacked keys and values k32, v32 [B, KV, t, j, d], the context share, the diagonal shares),
    in float32."""
    q32 = _by_position(q[:, :, part], group)
    k32 = torch.stack([k[:, :, part] for k in draft_k], dim=-2).float()
    v32 = torch.stack([v[:, :, part] for v in draft_v], dim=-2).float()
    context_share, shares = _merge_shares(q32, _by_position(context_lse[:, :, part], group), k32, q.shape[-1] ** -0.5)
    return q32, k32, v32, context_share, shares


class _MergeDiagonalKeys(torch.autograd.Function):
    """merge_diagonal_keys_autograd's output, for all heads at once and a chunk of positions at
    a time (CHUNK_ELEMENTS values of [B, heads, t, head_dim]: the float32 temporaries are a
    chunk's); the backward pass recomputes the shares from the inputs it keeps (which the
    context attention and the cache keep anyway) and forms the gradient in closed form.

    With a = softmax over [context lse ; diagonal scores] and values [context out ; v_i], the
    output is sum a_x value_x; a logit's gradient is a_x (g . value_x - g . out), where
    g . out = a_context (g . context out) + sum_i a_i (g . v_i). The per-position sums over the
    j diagonal keys and the query group are small matrix products ([G, d] x [d, j] and the
    like), so a chunk costs a few dozen operators whatever the number of heads, each large
    enough to fill a GPU. Run a key/value head at a time, the backward pass of the last TTT
    step's merge alone took about 1,900 operators for a Kimi-shaped drafter, each over a few MB
    (docs/performance.md)."""

    @staticmethod
    def forward(ctx, context_out, context_lse, q, group, *draft):
        steps = len(draft) // 2
        ctx.group = group
        ctx.save_for_backward(context_out, context_lse, q, *draft)
        batch, heads, length, dim = q.shape
        out = torch.empty_like(q)
        # float32 inside, under autocast too: the small products are not to run in half precision.
        with torch.autocast(q.device.type, enabled=False):
            for part in _row_chunks(length, batch * heads * dim):
                _, _, v32, context_share, shares = _merge_chunk(part, context_lse, q, draft[:steps], draft[steps:], group)
                merged = _by_position(context_out[:, :, part], group) * context_share.unsqueeze(-1)
                out[:, :, part] = _by_head(merged + torch.matmul(shares, v32))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        context_out, context_lse, q, *draft = ctx.saved_tensors
        steps, group = len(draft) // 2, ctx.group
        draft_k, draft_v = draft[:steps], draft[steps:]
        batch, heads, length, dim = q.shape
        scale = dim**-0.5
        grad_context = torch.empty_like(context_out)
        grad_lse = torch.empty_like(context_lse)
        grad_q = torch.empty_like(q)
        grad_k = [torch.empty_like(k) for k in draft_k]
        grad_v = [torch.empty_like(v) for v in draft_v]
        with torch.autocast(q.device.type, enabled=False):
            for part in _row_chunks(length, batch * heads * dim):
                q32, k32, v32, context_share, shares = _merge_chunk(part, context_lse, q, draft_k, draft_v, group)
                context32 = _by_position(context_out[:, :, part], group)
                g = _by_position(grad_out[:, :, part], group)
                g_context = (g * context32).sum(-1)  # [B, KV, t, G]
                g_values = torch.matmul(g, v32.transpose(-1, -2))  # [B, KV, t, G, j]
                g_out = context_share * g_context + (shares * g_values).sum(-1)
                grad_context[:, :, part] = _by_head(g * context_share.unsqueeze(-1))
                grad_lse[:, :, part] = _by_head(context_share * (g_context - g_out))
                grad_score = shares * (g_values - g_out.unsqueeze(-1)) * scale
                grad_q[:, :, part] = _by_head(torch.matmul(grad_score, k32))
                grad_keys = torch.matmul(grad_score.transpose(-1, -2), q32)  # [B, KV, t, j, d]: summed over the group
                grad_values = torch.matmul(shares.transpose(-1, -2), g)
                for i in range(steps):
                    grad_k[i][:, :, part] = grad_keys[..., i, :]
                    grad_v[i][:, :, part] = grad_values[..., i, :]
        return (grad_context, grad_lse, grad_q, None, *grad_k, *grad_v)


def _position_major(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, heads, t, ...] -> float32 [B, t, kv heads, group, ...] (a view where the projections
    made x, whose memory is position-major)."""
    return x.transpose(1, 2).float().unflatten(2, (-1, group))


def _head_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_position_major`: [B, t, kv heads, group, ...] -> [B, heads, t, ...] in ``dtype``."""
    return x.flatten(2, 3).to(dtype).transpose(1, 2)


def _fused_inputs(context_lse, q, draft, group: int):
    """What both passes of the fused merge read, in float32: (queries [B, t, KV, G, d], the keys
    and the values, j each, [B, t, KV, d], context share [B, t, KV, G], diagonal shares
    [B, t, KV, G, j]). The diagonal scores are elementwise products summed over the head
    dimension, one key at a time (:func:`_merge_shares` takes them as small matrix products)."""
    steps = len(draft) // 2
    queries = _position_major(q, group)
    keys = [k.transpose(1, 2).float() for k in draft[:steps]]
    values = [v.transpose(1, 2).float() for v in draft[steps:]]
    diagonal = torch.stack([(queries * key.unsqueeze(3)).sum(-1) for key in keys], dim=-1) * q.shape[-1] ** -0.5
    return (queries, keys, values, *_softmax_shares(_position_major(context_lse, group), diagonal))


class _FusedMergeDiagonalKeys(torch.autograd.Function):
    """_MergeDiagonalKeys' output and gradient, written for torch.compile: whole tensors,
    elementwise ops and sums only (no matrix products, which the compiler leaves as separate
    kernels reading float32 copies), so inductor fuses each pass into a few kernels that read
    the bf16 inputs once and keep no float32 temporaries. On a GPU it runs compiled
    (:func:`merge_diagonal_keys`): eagerly, each op would be a kernel of its own. The same
    inputs are kept for the backward pass."""

    @staticmethod
    def forward(ctx, context_out, context_lse, q, group, *draft):
        ctx.group = group
        ctx.save_for_backward(context_out, context_lse, q, *draft)
        # float32 inside, under autocast too (as _MergeDiagonalKeys).
        with torch.autocast(q.device.type, enabled=False):
            _, _, values, context_share, shares = _fused_inputs(context_lse, q, draft, group)
            out = _position_major(context_out, group) * context_share.unsqueeze(-1)
            for i, value in enumerate(values):
                out = out + shares[..., i, None] * value.unsqueeze(3)
            return _head_major(out, q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        context_out, context_lse, q, *draft = ctx.saved_tensors
        steps, group = len(draft) // 2, ctx.group
        scale = q.shape[-1] ** -0.5
        with torch.autocast(q.device.type, enabled=False):
            queries, keys, values, context_share, shares = _fused_inputs(context_lse, q, draft, group)
            g = _position_major(grad_out, group)
            g_context = (g * _position_major(context_out, group)).sum(-1)  # [B, t, KV, G]
            g_values = torch.stack([(g * value.unsqueeze(3)).sum(-1) for value in values], dim=-1)  # [B, t, KV, G, j]
            g_out = context_share * g_context + (shares * g_values).sum(-1)
            grad_score = shares * (g_values - g_out.unsqueeze(-1)) * scale
            grad_q = sum(grad_score[..., i, None] * key.unsqueeze(3) for i, key in enumerate(keys))
            # Each key and value serves the G query heads of its group: their sums.
            grad_k = [_head_major((grad_score[..., i, None] * queries).sum(3, keepdim=True), k.dtype)
                      for i, k in enumerate(draft[:steps])]
            grad_v = [_head_major((shares[..., i, None] * g).sum(3, keepdim=True), v.dtype)
                      for i, v in enumerate(draft[steps:])]
            return (_head_major(g * context_share.unsqueeze(-1), context_out.dtype),
                    _head_major(context_share * (g_context - g_out), context_lse.dtype),
                    _head_major(grad_q, q.dtype), None, *grad_k, *grad_v)


def fused_merge(context_out, context_lse, q, draft_k, draft_v, group: int) -> torch.Tensor:
    return _FusedMergeDiagonalKeys.apply(context_out, context_lse, q, group, *draft_k, *draft_v)


def allow_compiled_graphs(count: int) -> None:
    """Let torch.compile keep at least ``count`` graphs of one function (dynamo's default is 8;
    past its limit a function runs eagerly). The drafter's compiled code has a graph per TTT
    step or number of diagonal keys, per dtype and per gradient need."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, count)


_compiled_merge = None


def _merge_kernel(q: torch.Tensor):
    """How the merge runs when it needs its gradient: the fused merge as is while torch.compile
    traces the layer (train.compile), compiled on its own on a GPU (one graph per number of
    diagonal keys, forward and backward), and as :class:`_MergeDiagonalKeys` elsewhere (None),
    whose chunked matrix products suit an eager CPU."""
    global _compiled_merge
    if torch.compiler.is_compiling():
        return fused_merge
    if q.is_cuda:
        if _compiled_merge is None:
            # A graph per number of diagonal keys (1 to ttt_length - 1), per dtype and per
            # gradient need: more than dynamo's default of 8 graphs a function, past which it
            # would run the merge eagerly, an op a kernel.
            allow_compiled_graphs(64)
            _compiled_merge = torch.compile(fused_merge, dynamic=False)
        return _compiled_merge
    return None


def merge_diagonal_keys(context_out, context_lse, q, draft_k, draft_v, group: int) -> torch.Tensor:
    """Softmax attention over [context keys ; one diagonal key per draft step], exactly
    (:func:`merge_diagonal_keys_autograd`), keeping for the backward pass only what the context
    attention and the cache keep already."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (context_out, context_lse, q, *draft_k, *draft_v)):
        kernel = _merge_kernel(q)
        if kernel is not None:
            return kernel(context_out, context_lse, q, list(draft_k), list(draft_v), group)
        return _MergeDiagonalKeys.apply(context_out, context_lse, q, group, *draft_k, *draft_v)
    return merge_diagonal_keys_autograd(context_out, context_lse, q, draft_k, draft_v, group)



class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up only: autograd would keep silu(gate) too, a
    [T, intermediate] tensor (1.1 GiB a TTT step at 32,768 tokens of a Kimi-shaped drafter).
    The backward pass recomputes silu(gate) and runs the ops autograd runs (the product's
    gradients, aten.silu_backward), a chunk of rows at a time: the same gradients (bit for bit
    in bf16; in float32 a chunk's vectorised tail may round a last bit otherwise)."""

    @staticmethod
    def forward(ctx, gate, up, private: bool = False):
        ctx.private = private
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        width = gate.shape[-1]
        rows_gate, rows_up, rows_grad = gate.reshape(-1, width), up.reshape(-1, width), grad_out.reshape(-1, width)
        # ``private`` (the caller's word that nothing else reads gate and up): eagerly, each
        # gradient takes the place of the input it belongs to, chunk by chunk, since this backward
        # is their last read (2 x 1.1 GiB fewer at the MLP's backward, the peak of a recomputed
        # Kimi-shaped step). A second backward through the same graph is refused by autograd's
        # version check. Compiled, or not private: fresh tensors.
        in_place = ctx.private and not torch.compiler.is_compiling() and gate.is_contiguous() and up.is_contiguous()
        grad_gate = (rows_gate if in_place else torch.empty_like(rows_gate)) if ctx.needs_input_grad[0] else None
        grad_up = (rows_up if in_place else torch.empty_like(rows_up)) if ctx.needs_input_grad[1] else None
        # Elementwise, so chunks of rows give the same values; the temporaries are a chunk's.
        # In this order, each chunk's gate and up are read before their gradients replace them.
        for part in _elementwise_chunks(rows_gate.shape[0], width):
            through_up = rows_grad[part] * rows_up[part] if grad_gate is not None else None
            if grad_up is not None:
                grad_up[part] = rows_grad[part] * F.silu(rows_gate[part])
            if grad_gate is not None:
                grad_gate[part] = torch.ops.aten.silu_backward(through_up, rows_gate[part])
        return (None if grad_gate is None else grad_gate.view_as(gate),
                None if grad_up is None else grad_up.view_as(up), None)



def swiglu(gate: torch.Tensor, up: torch.Tensor, private: bool = False) -> torch.Tensor:
    """silu(gate) * up (:class:`_SwiGLU`); ``private``: nothing else reads gate and up, so
    their gradients may take their place."""
    return _SwiGLU.apply(gate, up, private)
