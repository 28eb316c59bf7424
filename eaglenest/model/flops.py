"""What a drafter costs: forward FLOPs of a drafting step per token and its parameter count."""

from __future__ import annotations

from torch import nn

from eaglenest.model.drafter import DrafterConfig


def flops_per_token_step(config: DrafterConfig, context: int = 0) -> dict[str, float]:
    """Forward matmul FLOPs of one drafting step per token (fc counted separately, once)."""
    h, hd = config.hidden_size, config.head_dim
    q = config.num_attention_heads * hd
    kv = config.num_key_value_heads * hd
    return {
        "fc": 2 * 3 * config.target_hidden_size * h,
        "attention_proj": 2 * (2 * h) * (q + 2 * kv) + 2 * q * h,
        "attention_scores": 4 * q * context,
        "mlp": 2 * 3 * h * config.intermediate_size,
        "lm_head": 2 * h * config.draft_vocab_size,
    }


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
