"""The drafter's attention over the real context in training: the training-time-test cache
(TTTCache) and the causal attention of each step's queries over step 0's keys of their own
packed sample, by FlexAttention's block-sparse kernel (a GPU) or dense math (the CPU), with
the log-sum-exp that merges it with the diagonal keys (eaglenest.model.kernels)."""

from __future__ import annotations

import torch

ATTENTION_BACKENDS = ("dense", "flex")


def default_attention_backend(device: torch.device) -> str:
    """FlexAttention where it trains (CUDA); dense math elsewhere (its CPU kernel has no backward)."""
    return "flex" if torch.device(device).type == "cuda" else "dense"


class TTTCache:
    """Keys/values of earlier training-time-test steps and the step-0 mask.

    ``context_*`` are step 0's keys/values (the real context); ``draft_*`` hold one entry per
    later step, each attended to only by the query at the same position. ``backend`` picks how
    the context part is computed ("auto": :func:`default_attention_backend` of the keys' device).
    """

    def __init__(self, backend: str = "auto"):
        if backend not in ("auto", *ATTENTION_BACKENDS):
            raise ValueError(f"attention backend {backend!r}: expected auto or one of {ATTENTION_BACKENDS}")
        self.backend = backend
        self.context_k = self.context_v = self.context_mask = None
        self.draft_k: list[torch.Tensor] = []
        self.draft_v: list[torch.Tensor] = []

    @property
    def steps(self) -> int:
        return 0 if self.context_k is None else 1 + len(self.draft_k)

    def copy(self) -> "TTTCache":
        """A cache holding the same tensors in lists of its own: a step run on it leaves this
        one as it was (training recomputes a step on a copy of the cache the step first saw)."""
        twin = TTTCache(self.backend)
        twin.context_k, twin.context_v, twin.context_mask = self.context_k, self.context_v, self.context_mask
        twin.draft_k, twin.draft_v = list(self.draft_k), list(self.draft_v)
        return twin

    def adopt(self, other: "TTTCache") -> None:
        """Take ``other``'s state (a copy this cache made, one step further on)."""
        self.backend = other.backend
        self.context_k, self.context_v, self.context_mask = other.context_k, other.context_v, other.context_mask
        self.draft_k, self.draft_v = other.draft_k, other.draft_v

    def start(self, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor) -> None:
        """Keep step 0's keys/values and build the context mask once for every later step."""
        if self.backend == "auto":
            self.backend = default_attention_backend(k.device)
        self.context_k, self.context_v = k, v
        if self.backend == "flex":
            self.context_mask = segment_block_mask(segment_ids)
        else:
            self.context_mask = causal_segment_mask(segment_ids)

    def attend_context(self, q: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of ``q`` over the step-0 keys of its own segment: (out, log-sum-exp
        of the scaled scores, float32 [B, heads, T])."""
        if self.backend == "flex":
            return flex_context_attention(q, self.context_k, self.context_v, self.context_mask)
        return dense_context_attention(q, self.context_k, self.context_v, self.context_mask, group)


def causal_segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: query t sees key s <= t of the same segment (padding sees padding)."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & same)[:, None]


def segment_block_mask(segment_ids: torch.Tensor):
    """The mask of :func:`causal_segment_mask` as a FlexAttention block mask: only the
    [128 x 128] blocks that hold an allowed pair are visited, so memory is linear in T."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_segment_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (segment_ids[b, q_idx] == segment_ids[b, kv_idx])

    batch, length = segment_ids.shape
    return create_block_mask(same_segment_causal, batch, None, length, length, device=segment_ids.device,
                             _compile=segment_ids.is_cuda)


_compiled_flex = None


def flex_context_attention(q, k, v, block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention with the log-sum-exp; compiled on a GPU (eager flex is a reference
    implementation that materialises the scores and, on the CPU, has no backward)."""
    global _compiled_flex
    from torch.nn.attention import flex_attention as flex_module

    kernel = flex_module.flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_module.flex_attention, dynamic=False)
        kernel = _compiled_flex
    enable_gqa = q.shape[1] != k.shape[1]
    if hasattr(flex_module, "AuxRequest"):
        out, aux = kernel(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa,
                          return_aux=flex_module.AuxRequest(lse=True))
        return out, aux.lse
    return kernel(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, return_lse=True)


def dense_context_attention(q, k, v, mask, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as :func:`flex_context_attention` with an explicit [T, T] score matrix."""
    scores = torch.matmul(q, repeat_kv(k, group).transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None]).to(q.dtype)
    return torch.matmul(weights, repeat_kv(v, group)), lse



def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``group`` query heads."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)

