"""The drafter's shape for targets whose attention is not Llama's (MLA: DeepSeek-V3, Kimi-K2.5)."""

import warnings

import pytest
from transformers import DeepseekV3Config

from eaglenest.model import drafter


def tiny_deepseek_v3() -> dict:
    """config.json of a tiny DeepseekV3 target (MLA + MoE) as transformers writes it."""
    return DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, kv_lora_rank=16, q_lora_rank=32, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, vocab_size=320,
    ).to_dict()


def test_mla_target_gives_a_full_width_attention_and_warns_without_an_override():
    target = tiny_deepseek_v3()
    assert target["head_dim"] == 8  # the rotary part only: what the drafter must not take
    with pytest.warns(UserWarning, match=r"MLA target .*hidden_size // num_attention_heads = 64 // 4"):
        config = drafter.DrafterConfig.from_target_config(target, 32, [1, 2, 3])
    assert (config.num_attention_heads, config.head_dim) == (4, 16)
    assert config.num_attention_heads * config.head_dim == config.hidden_size


def test_mla_target_with_an_explicit_shape_takes_it_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = drafter.DrafterConfig.from_target_config(
            {"text_config": tiny_deepseek_v3()}, 32, [1, 2, 3], num_attention_heads=2, num_key_value_heads=1, head_dim=32
        )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 1, 32)
