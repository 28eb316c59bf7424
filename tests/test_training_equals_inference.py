"""The invariant the drafter is trained for: TTT step j in training computes, for a context and
the j true next tokens, exactly the logits the speculative decoder computes at depth j + 1 of a
chain for the same context with the same tokens drafted.

Both sides run their own code: eaglenest.training.objective.TTTObjective.unroll (packed rows,
shifted ids, rotary position t + j, the TTT attention of eaglenest.model.drafter) and eaglenest.model.speculate
(DrafterState's KV cache, build_draft_tree's positions and visibility). The chain is sampled at
temperature 1, so its tokens are arbitrary drafts, and each depth's draft distribution q comes
back in the tree; the training side is given those tokens as the true continuation.
"""

import pytest
import torch

from eaglenest.model import context_attention, speculate
from eaglenest.training.objective import TTTObjective
from test_drafter import tiny_drafter

DEPTH = 5


def sharp_drafter():
    """A random drafter whose attention scores are far from uniform (randomly initialised
    projections give near-uniform attention, under which rotary positions barely matter)."""
    model = tiny_drafter(seed=7).eval()
    with torch.no_grad():
        model.midlayer.self_attn.q_proj.weight.mul_(12.0)
        model.midlayer.self_attn.k_proj.weight.mul_(12.0)
    return model


def training_step_distributions(model, tokens, aux, at, backend):
    """softmax over target ids of TTT step j's logits at position ``at``, for every j."""
    length = tokens.numel() - 1
    batch = {
        "input_ids": tokens[:length][None], "aux_hidden": aux[None],
        "segment_ids": torch.zeros(1, length, dtype=torch.long), "position_ids": torch.arange(length)[None],
    }
    objective = TTTObjective(model, ttt_length=DEPTH, attention_backend=backend)
    with torch.no_grad():
        return [speculate.draft_distribution(model, model.compute_logits(normed[0, at]), 1.0, model.config.vocab_size)
                for _, normed in objective.unroll(batch)]


@pytest.mark.parametrize("prompt_length", [1, 6, 11])
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_ttt_step_logits_are_the_chain_decoders_logits_for_the_same_tokens(prompt_length, backend):
    model = sharp_drafter()
    vocab_size = model.config.vocab_size
    generator = torch.Generator().manual_seed(prompt_length)
    prompt = torch.randint(0, vocab_size, (prompt_length,), generator=generator)
    first = torch.randint(0, vocab_size, (1,), generator=generator)
    # Aux states of the verified positions; training also gets (random) states past them,
    # which causal attention must ignore at the position compared.
    aux = torch.randn(prompt_length + DEPTH, 3 * model.config.target_hidden_size, generator=generator)

    state = speculate.DrafterState(model)
    with torch.no_grad():
        logits, hidden = state.extend(torch.cat([prompt[1:], first]), aux[:prompt_length], 0)
        tree = speculate.build_draft_tree(
            state, logits[-1], hidden[-1], prompt_length, speculate.Drafting(steps=DEPTH, topk=1, tokens=DEPTH + 1),
            temperature=1.0, vocab_size=vocab_size, generator=torch.Generator().manual_seed(1),
        )
    assert tree.depths == list(range(1, DEPTH + 1))

    tokens = torch.cat([prompt, first, torch.tensor(tree.tokens)])
    trained = training_step_distributions(model, tokens, aux, prompt_length - 1, backend)
    for j in range(DEPTH):
        torch.testing.assert_close(trained[j], tree.draft_probs[j], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, j=j: f"TTT step {j} vs decoder depth {j + 1}: {m}")


def test_step_zero_positions_at_every_step_would_part_from_the_decoder():
    """The check above is sensitive to the convention it guards: reusing step 0's rotary
    positions at every step (what eaglenest trained with before) gives other logits."""
    model = sharp_drafter()
    generator = torch.Generator().manual_seed(3)
    length = 8
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=generator)
    aux = torch.randn(1, length, 3 * model.config.target_hidden_size, generator=generator)
    positions = torch.arange(length)[None]
    runs = []
    with torch.no_grad():
        for advance in (True, False):
            cache, hidden = context_attention.TTTCache("dense"), aux
            for j in range(2):
                logits, hidden = model(ids, hidden, positions + j if advance else positions, cache)
            runs.append(logits)
    assert (runs[0] - runs[1]).abs().max() > 1e-2
