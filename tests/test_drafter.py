"""The EAGLE-3 drafter: SGLang names and shapes, the training-time-test mask, packing, files."""

import json

import pytest
import torch
import torch.nn.functional as F

from eaglenest.model import context_attention, drafter, kernels
from eaglenest.formats import vocab


def tiny_config(**overrides) -> drafter.DrafterConfig:
    values = dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=50, draft_vocab_size=20, target_hidden_size=32, aux_layer_ids=[1, 2, 3],
    )
    values.update(overrides)
    return drafter.DrafterConfig(**values)


def tiny_drafter(seed=0, **overrides) -> drafter.Eagle3Drafter:
    torch.manual_seed(seed)
    model = drafter.Eagle3Drafter(tiny_config(**overrides))
    counts = torch.arange(50).flip(0)
    model.set_draft_vocab(*vocab.build_draft_vocab(counts, 20))
    with torch.no_grad():  # non-trivial norms so that a wrong norm placement changes outputs
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def test_state_dict_uses_sglang_llama_eagle3_names_and_shapes():
    model = tiny_drafter()
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    h, q, kv = 32, 4 * 8, 2 * 8
    assert shapes == {
        "embed_tokens.weight": (50, h),
        "fc.weight": (h, 3 * h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (48, h),
        "midlayer.mlp.up_proj.weight": (48, h),
        "midlayer.mlp.down_proj.weight": (h, 48),
        "norm.weight": (h,),
        "lm_head.weight": (20, h),
        "d2t": (20,),
        "t2d": (50,),
    }
    assert not model.embed_tokens.weight.requires_grad


def test_config_from_target_takes_sizes_and_never_shortens_positions(tiny_llama):
    config = drafter.DrafterConfig.from_target_config(tiny_llama, draft_vocab_size=64, aux_layer_ids=[2, 3, 3],
                                                      max_position_embeddings=16)
    target = json.loads((tiny_llama / "config.json").read_text())
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (64, 4, 2)
    assert config.intermediate_size == target["intermediate_size"]
    assert config.vocab_size == target["vocab_size"]
    assert config.max_position_embeddings == target["max_position_embeddings"]
    wrapped = drafter.DrafterConfig.from_target_config({"text_config": target}, 64, [2, 3, 3])
    assert wrapped.hidden_size == 64


def test_fc_applies_to_aux_hidden_and_fed_back_hidden_skips_it():
    model = tiny_drafter()
    ids = torch.randint(0, 50, (1, 6))
    aux = torch.randn(1, 6, 96)
    logits, hidden = model(ids, aux)
    assert logits.shape == (1, 6, 20) and hidden.shape == (1, 6, 32)
    again, _ = model(ids, model.fc(aux))
    torch.testing.assert_close(logits, again)
    with pytest.raises(ValueError, match="expected 3\\*32"):
        model(ids, torch.randn(1, 6, 40))


def reference_ttt(model, ids_per_step, aux, segment_ids=None):
    """Independent TTT: every step attends over [step-0 keys, keys of steps 1..j] through an
    explicit dense mask (causal block within a segment + one diagonal per draft step), computed
    naively; step j rotates its queries and keys at position t + j."""
    cfg = model.config
    layer = model.midlayer
    attn = layer.self_attn
    T = aux.shape[1]
    segment_ids = torch.zeros(1, T, dtype=torch.long) if segment_ids is None else segment_ids
    starts = [0] + [t for t in range(1, T) if segment_ids[0, t] != segment_ids[0, t - 1]]
    pos = torch.tensor([t - max(s for s in starts if s <= t) for t in range(T)])[None]
    hidden = model.fc(aux)
    keys, values, outputs = [], [], []
    for j, ids in enumerate(ids_per_step):
        cos, sin = drafter.rotary_cos_sin(pos + j, cfg.head_dim, cfg.rope_theta, aux.dtype)
        residual = hidden
        x = torch.cat([layer.input_layernorm(model.embed_tokens(ids)), layer.hidden_norm(hidden)], -1)
        q = attn.q_proj(x).view(1, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q, k = drafter.apply_rotary(q, cos, sin), drafter.apply_rotary(k, cos, sin)
        keys.append(k.repeat_interleave(2, 1))
        values.append(v.repeat_interleave(2, 1))
        mask = torch.zeros(T, T * (j + 1), dtype=torch.bool)
        for t in range(T):
            for s in range(t + 1):
                mask[t, s] = bool(segment_ids[0, s] == segment_ids[0, t])  # verified context, causal
            for i in range(1, j + 1):
                mask[t, i * T + t] = True  # own drafted ancestors
        scores = q @ torch.cat(keys, 2).transpose(-1, -2) / cfg.head_dim**0.5
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out = (weights @ torch.cat(values, 2)).transpose(1, 2).reshape(1, T, -1)
        residual = residual + attn.o_proj(out)
        hidden = residual + layer.mlp(layer.post_attention_layernorm(residual))
        outputs.append(model.lm_head(model.norm(hidden)))
    return outputs


def run_ttt(model, ids_per_step, aux, segment_ids, positions, backend):
    cache, hidden, outputs = context_attention.TTTCache(backend), aux, []
    for j, ids in enumerate(ids_per_step):
        logits, hidden = model(ids, hidden, positions + j, cache, segment_ids)
        outputs.append(logits)
    return outputs, cache


def packed_case(seed=0, lengths=(5, 3, 6)):
    generator = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    aux = torch.randn(1, T, 96, generator=generator)
    ids_per_step = [torch.randint(0, 50, (1, T), generator=generator) for _ in range(4)]
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return aux, ids_per_step, segments, positions


def test_ttt_steps_follow_the_eagle3_mask_and_positions():
    model = tiny_drafter()
    aux, ids_per_step, segments, positions = packed_case()
    expected = reference_ttt(model, ids_per_step, aux, segments)
    outputs, cache = run_ttt(model, ids_per_step, aux, segments, positions, "dense")
    for j, logits in enumerate(outputs):
        torch.testing.assert_close(logits, expected[j], rtol=1e-4, atol=1e-5, msg=f"TTT step {j}")
    assert cache.steps == 4


def test_ttt_gradients_equal_the_dense_mask_reference():
    """The merge of the context part (through its log-sum-exp) with the diagonal keys is exact
    in the backward pass too: every weight's gradient equals the naive dense-mask one."""
    aux, ids_per_step, segments, positions = packed_case(seed=1)
    weights = torch.randn(len(ids_per_step), 14, 20, generator=torch.Generator().manual_seed(2))
    grads = []
    for use_reference in (True, False):
        model = tiny_drafter(seed=4)
        aux_leaf = aux.clone().requires_grad_(True)
        if use_reference:
            outputs = reference_ttt(model, ids_per_step, aux_leaf, segments)
        else:
            outputs, _ = run_ttt(model, ids_per_step, aux_leaf, segments, positions, "dense")
        sum((w * out[0]).sum() for w, out in zip(weights, outputs)).backward()
        grads.append({"aux": aux_leaf.grad, **{n: p.grad for n, p in model.named_parameters() if p.requires_grad}})
    reference, ours = grads
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.integration
def test_flex_and_dense_context_attention_agree():
    """The GPU path (FlexAttention block mask + log-sum-exp) against the dense one. The CPU
    flex kernel runs forward only, so this checks the mask and the merge; the gradients of the
    compiled GPU kernel are checked by benchmarks/train_throughput.py --check on the GPU."""
    model = tiny_drafter(seed=5)
    aux, ids_per_step, segments, positions = packed_case(seed=3, lengths=(70, 9, 49))
    with torch.no_grad():
        dense, _ = run_ttt(model, ids_per_step, aux, segments, positions, "dense")
        flex, cache = run_ttt(model, ids_per_step, aux, segments, positions, "flex")
    assert cache.backend == "flex"
    for j in range(len(ids_per_step)):
        torch.testing.assert_close(flex[j], dense[j], rtol=1e-4, atol=1e-5, msg=f"TTT step {j}")


def test_packed_samples_never_attend_across_samples():
    model = tiny_drafter()
    aux, ids, segments, positions = packed_case(seed=6)
    packed, _ = run_ttt(model, ids, aux, segments, positions, "dense")
    at = 0
    for n in (5, 3, 6):
        alone, _ = run_ttt(model, [i[:, at : at + n] for i in ids], aux[:, at : at + n], None,
                           torch.arange(n)[None], "dense")
        for j in range(len(ids)):
            torch.testing.assert_close(alone[j], packed[j][:, at : at + n], rtol=1e-4, atol=1e-5)
        at += n


def test_save_and_load_give_identical_logits(tmp_path):
    model = tiny_drafter(seed=3)
    model.save(tmp_path / "drafter")
    model.save(tmp_path / "again")
    for name in (drafter.WEIGHTS_NAME, "config.json"):  # same weights, same bytes
        assert (tmp_path / "drafter" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    loaded = drafter.Eagle3Drafter.from_checkpoint(tmp_path / "drafter")
    ids, aux = torch.randint(0, 50, (2, 5)), torch.randn(2, 5, 96)
    assert torch.equal(model(ids, aux)[0], loaded(ids, aux)[0])
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["draft_vocab_size"] == 20


def test_build_drafter_copies_embedding_head_rows_and_norm_from_target(tiny_llama):
    from safetensors.torch import load_file

    weights = load_file(str(tiny_llama / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    counts = torch.randint(0, 100, (embed.shape[0],))
    d2t, t2d = vocab.build_draft_vocab(counts, 64)
    model = drafter.build_drafter(tiny_llama, {"d2t": d2t, "t2d": t2d}, [2, 3, 3])
    assert torch.equal(model.embed_tokens.weight, embed.float())
    # tied target: its head is the embedding; the draft head is its draft-vocab rows
    assert torch.equal(model.lm_head.weight, embed[vocab.draft_to_target(d2t)].float())
    assert torch.equal(model.norm.weight, weights["model.norm.weight"].float())
    assert torch.equal(model.draft_to_target(torch.arange(64)), vocab.draft_to_target(d2t))


def test_a_bf16_target_gives_a_bf16_embedding_with_the_same_values_and_logits(tiny_llama, tmp_path):
    """The frozen embedding stays in the half precision the target stores it in (half the GPU
    memory); its values, and so the drafter's logits, are those of a float32 copy."""
    import shutil

    from safetensors.torch import load_file, save_file

    half = tmp_path / "bf16-target"
    shutil.copytree(tiny_llama, half)
    weights = load_file(str(tiny_llama / "model.safetensors"))
    save_file({name: t.bfloat16() for name, t in weights.items()}, str(half / "model.safetensors"))
    counts = torch.randint(0, 100, (weights["model.embed_tokens.weight"].shape[0],))
    d2t, t2d = vocab.build_draft_vocab(counts, 64)
    model = drafter.build_drafter(half, {"d2t": d2t, "t2d": t2d}, [2, 3, 3])
    assert drafter.build_drafter(tiny_llama, {"d2t": d2t, "t2d": t2d}, [2, 3, 3]).embed_tokens.weight.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and not model.embed_tokens.weight.requires_grad
    assert torch.equal(model.embed_tokens.weight, weights["model.embed_tokens.weight"].bfloat16())
    widened = drafter.build_drafter(half, {"d2t": d2t, "t2d": t2d}, [2, 3, 3])
    widened.embed_tokens.float()
    ids = torch.randint(0, counts.numel(), (2, 7))
    aux = torch.randn(2, 7, 3 * model.config.target_hidden_size)
    assert torch.equal(model(ids, aux)[0], widened(ids, aux)[0])


@pytest.mark.parametrize("rows", [4096, 5])  # one chunk; 11 chunks, the last short
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_autograd_through_its_expression(dtype, rows, monkeypatch):
    """drafter.RMSNorm keeps x and the inverse RMS only; judged against autograd through the
    plain expression (which keeps float32 copies): the same output bit for bit, and the same
    gradients within float32 rounding."""
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", rows * 64)
    torch.manual_seed(0)
    x = (torch.randn(3, 17, 64) * torch.linspace(0.1, 4.0, 64)).to(dtype).requires_grad_(True)
    weight = (1.0 + 0.1 * torch.randn(64)).requires_grad_(True)
    grad_out = torch.randn(3, 17, 64)
    norm = drafter.RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(weight)
    out = norm(x)
    x32 = x.float()  # once, as the module had it: both uses' gradients meet in float32
    reference = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert out.dtype == reference.dtype and torch.equal(out, reference)
    grad_x, grad_w = torch.autograd.grad(out, (x, norm.weight), grad_out)
    ref_x, ref_w = torch.autograd.grad(reference, (x, weight), grad_out)
    assert grad_x.dtype == dtype and grad_w.dtype == torch.float32
    torch.testing.assert_close(grad_x.float(), ref_x.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-5, atol=1e-5)


def test_rms_norm_under_autocast_gives_the_cast_its_consumers_made():
    """Under autocast the norm's output comes in autocast's dtype: the cast each projection
    would have made of the float32 output, made once. Same values and gradients as the plain
    expression followed by that cast."""
    torch.manual_seed(3)
    x = torch.randn(2, 9, 32).to(torch.bfloat16).requires_grad_(True)
    weight = (1.0 + 0.1 * torch.randn(32)).requires_grad_(True)
    grad_out = torch.randn(2, 9, 32).to(torch.bfloat16)
    norm = drafter.RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
        x32 = x.float()
        reference = (weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, reference)
    grads = torch.autograd.grad(out, (x, norm.weight), grad_out)
    expected = torch.autograd.grad(reference, (x, weight), grad_out)
    torch.testing.assert_close(grads[0].float(), expected[0].float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], expected[1], rtol=1e-5, atol=1e-5)


MERGES = {
    # The CPU's: all heads at once, a chunk of positions at a time, small matrix products.
    "chunked": lambda: kernels.merge_diagonal_keys,
    # The GPU's (compiled there) and train.compile's: whole tensors, elementwise ops and sums.
    "fused": lambda: kernels.fused_merge,
}


@pytest.mark.integration
@pytest.mark.parametrize("merge", sorted(MERGES))
@pytest.mark.parametrize("chunk_positions", [11, 4])  # one chunk; three, the last short
@pytest.mark.parametrize("steps", [1, 3, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_of_diagonal_keys_equals_autograd_through_its_ops(dtype, steps, chunk_positions, merge, monkeypatch):
    """kernels.merge_diagonal_keys forms its own gradient: on a CPU all heads at once and a
    chunk of positions at a time, its per-position sums as small matrix products; on a GPU by
    the fused merge, compiled. Each is judged against autograd through the plain ops
    (merge_diagonal_keys_autograd): output and every input's gradient within float32 rounding
    (in bf16: a bf16 step at most, for few values)."""
    check_merge_against_autograd(MERGES[merge](), dtype, steps, chunk_positions, monkeypatch)


@pytest.mark.integration
def test_fused_merge_compiled_equals_autograd_through_its_ops(monkeypatch):
    """The fused merge as torch.compile builds it (inductor, here on the CPU; on a GPU it always
    runs so): the same output and gradients as the reference."""
    torch._dynamo.reset()
    check_merge_against_autograd(torch.compile(kernels.fused_merge, dynamic=False), torch.float32, 3, 11, monkeypatch)


def check_merge_against_autograd(merge, dtype, steps, chunk_positions, monkeypatch):
    batch, kv_heads, group, length, dim = 2, 2, 3, 11, 16
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", batch * kv_heads * group * dim * chunk_positions)
    torch.manual_seed(1)
    leaves = {
        "context_out": torch.randn(batch, kv_heads * group, length, dim),
        "context_lse": torch.randn(batch, kv_heads * group, length) * 3,
        "q": torch.randn(batch, kv_heads * group, length, dim) * 2,
        **{f"k{i}": torch.randn(batch, kv_heads, length, dim) * 2 for i in range(steps)},
        **{f"v{i}": torch.randn(batch, kv_heads, length, dim) for i in range(steps)},
    }
    leaves = {name: (t if name == "context_lse" else t.to(dtype)).requires_grad_(True) for name, t in leaves.items()}
    grad_out = torch.randn(batch, kv_heads * group, length, dim)

    def run(merge):
        keys = [leaves[f"k{i}"] for i in range(steps)]
        values = [leaves[f"v{i}"] for i in range(steps)]
        out = merge(leaves["context_out"], leaves["context_lse"], leaves["q"], keys, values, group)
        return out, torch.autograd.grad(out, list(leaves.values()), grad_out.to(out.dtype))

    out, grads = run(merge)
    reference, reference_grads = run(kernels.merge_diagonal_keys_autograd)
    assert out.dtype == dtype
    for name, got, expected in [("out", out, reference), *zip(leaves, grads, reference_grads)]:
        assert got.dtype == expected.dtype, name
        if expected.dtype == torch.float32:  # context_lse stays float32 in both cases
            atol = 1e-6 * float(expected.abs().max())
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
            assert float((got - expected).norm()) <= 1e-6 * float(expected.norm()), name
        else:  # float32 values that differ in their last bits, rounded to bf16: one bf16 step apart at most
            torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-3,
                                       msg=lambda m, name=name: f"{name}: {m}")
            assert (got != expected).float().mean() < 0.1, name


def test_merge_of_diagonal_keys_runs_as_many_operators_for_any_number_of_heads():
    """The merge's operators do not grow with the heads (they did, a key/value head at a time:
    about 1,900 operators in the backward pass of a Kimi-shaped drafter's last TTT step, each
    too small to fill a GPU); the j diagonal keys add a handful each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.operators = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.operators += func.namespace == "aten" and not func.is_view
            return func(*args, **(kwargs or {}))

    def operators(kv_heads: int, steps: int) -> int:
        group, length, dim = 7, 5, 8
        inputs = [torch.randn(1, kv_heads * group, length, dim, requires_grad=True),
                  torch.randn(1, kv_heads * group, length, requires_grad=True),
                  torch.randn(1, kv_heads * group, length, dim, requires_grad=True),
                  [torch.randn(1, kv_heads, length, dim, requires_grad=True) for _ in range(steps)],
                  [torch.randn(1, kv_heads, length, dim, requires_grad=True) for _ in range(steps)]]
        with Count() as count:
            kernels.merge_diagonal_keys(*inputs, group).sum().backward()
        return count.operators

    assert operators(2, 3) == operators(8, 3)
    assert operators(8, 6) - operators(8, 1) <= 10 * 5


@pytest.mark.integration
def test_merge_of_diagonal_keys_runs_its_products_in_float32_under_autocast():
    """Under bf16 autocast (training on a GPU), the merge's small matrix products stay in float32:
    the same output and gradients as without autocast."""
    torch.manual_seed(3)
    leaves = [torch.randn(1, 4, 9, 8).to(torch.bfloat16), torch.randn(1, 4, 9) * 3,
              torch.randn(1, 4, 9, 8).to(torch.bfloat16), torch.randn(1, 2, 9, 8).to(torch.bfloat16),
              torch.randn(1, 2, 9, 8).to(torch.bfloat16)]
    leaves = [leaf.requires_grad_(True) for leaf in leaves]
    grad_out = torch.randn(1, 4, 9, 8).to(torch.bfloat16)

    def run(autocast: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = kernels.merge_diagonal_keys(*leaves[:3], [leaves[3]], [leaves[4]], 2)
        return out, torch.autograd.grad(out, leaves, grad_out)

    (out, grads), (plain, plain_grads) = run(True), run(False)
    assert torch.equal(out, plain)
    for grad, expected in zip(grads, plain_grads):
        assert torch.equal(grad, expected)


@pytest.mark.parametrize("private", [False, True])
@pytest.mark.parametrize("backward_rows", [4096, 7])  # one chunk; 6 chunks, the last short
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_autograd_bit_for_bit(dtype, backward_rows, private, monkeypatch):
    """The MLP's silu(gate) * up keeps gate and up only and recomputes silu(gate) in the
    backward pass; ``private`` gate and up (the MLP's own) are replaced by their gradients.
    Output and gradients equal autograd's through F.silu(gate) * up exactly (float32 in
    several chunks: to the last bit of a vectorised tail); a second backward is refused."""
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", backward_rows * 48)
    torch.manual_seed(2)
    leaves = ((torch.randn(4, 9, 48) * 3).to(dtype).requires_grad_(True), torch.randn(4, 9, 48).to(dtype).requires_grad_(True))
    grad_out = torch.randn(4, 9, 48).to(dtype)
    reference = F.silu(leaves[0]) * leaves[1]
    reference_grads = torch.autograd.grad(reference, leaves, grad_out)
    gate, up = (leaf * 1 for leaf in leaves) if private else leaves  # private: made for this call alone
    out = kernels.swiglu(gate, up, private)
    assert torch.equal(out, reference)
    grads = torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
    for grad, expected in zip(grads, reference_grads):
        assert grad.dtype == expected.dtype
        if backward_rows == 4096 or dtype == torch.bfloat16:
            assert torch.equal(grad, expected)
        else:  # float32 in chunks: the CPU's vectorised silu rounds a row differently at a chunk's tail
            torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)
    if private:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out, leaves, grad_out)
    else:
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, leaves, grad_out), grads))


@pytest.mark.integration
def test_compiled_layer_traces_the_drafter_s_own_autograd_functions(monkeypatch):
    """train.compile compiles the drafter's layer and final norm; its norms, diagonal-key merge
    and gate are autograd functions of the drafter's own. On the CPU (inductor), the compiled layer must
    trace them with no graph break and give the eager layer's logits and gradients. Chunks are
    small here: eagerly the norms, the gate and the merge run in several; compiled, the norms
    and the gate run whole."""
    import torch._dynamo

    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", 1024)

    from eaglenest.training.objective import TTTObjective, compile_drafter

    config = drafter.DrafterConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=300, draft_vocab_size=100, target_hidden_size=64, max_position_embeddings=512, aux_layer_ids=[1, 2, 3],
    )
    generator = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 300, (2, 40), generator=generator),
             "segment_ids": torch.tensor([[0] * 25 + [1] * 15, [0] * 40]),
             "position_ids": torch.cat([torch.arange(25), torch.arange(15)]).repeat(2, 1),
             "aux_hidden": torch.randn(2, 40, 192, generator=generator)}
    weights = torch.randn(3, 2, 40, 100, generator=generator)

    def run(compiled: bool):
        torch.manual_seed(0)
        model = drafter.Eagle3Drafter(config)
        if compiled:
            compile_drafter(model)
        objective = TTTObjective(model, 3, attention_backend="dense")
        logits = [model.compute_logits(normed) for _, normed in objective.unroll(batch)]
        sum((w * out).sum() for w, out in zip(weights, logits)).backward()
        return [out.detach() for out in logits], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    (eager_logits, eager_grads), (compiled_logits, compiled_grads) = run(False), run(True)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    for eager, compiled in zip(eager_logits, compiled_logits):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert set(compiled_grads) == set(eager_grads)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_draft_vocab_that_does_not_fit_the_config_is_refused():
    model = tiny_drafter()
    with pytest.raises(ValueError, match="does not match the config"):
        model.set_draft_vocab(torch.zeros(10, dtype=torch.int64), torch.zeros(50, dtype=torch.bool))


def test_sdpa_and_explicit_attention_agree_for_step_zero():
    # A pass without a TTT cache goes through scaled_dot_product_attention; check it against plain softmax.
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = context_attention.causal_segment_mask(torch.tensor([[0, 0, 0, 1, 1]]))
    expected = ((q @ k.transpose(-1, -2)) / 2).masked_fill(~mask, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), expected)
    out, lse = context_attention.dense_context_attention(q, k, v, mask, group=1)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, ((q @ k.transpose(-1, -2)) / 2).masked_fill(~mask, float("-inf")).logsumexp(-1))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_saved_drafter_is_refused_by_name(tmp_path, damage):
    model = tiny_drafter()
    model.save(tmp_path / "drafter")
    weights = tmp_path / "drafter" / drafter.WEIGHTS_NAME
    assert drafter.weights_problem(tmp_path / "drafter") is None
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x01  # one bit in the last tensor's bytes
    else:
        data = data[: len(data) // 2]
    weights.write_bytes(bytes(data))
    problem = drafter.weights_problem(tmp_path / "drafter")
    assert problem and ("checksum mismatch" in problem or "unreadable" in problem)
    with pytest.raises(drafter.DrafterFileError, match="Remove .* and rerun"):
        drafter.Eagle3Drafter.from_checkpoint(tmp_path / "drafter")
