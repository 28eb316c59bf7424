"""Speculative decoding: tree masks, caches, acceptance rules, tau, and losslessness on real SmolLM2."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from conftest import DEFAULT_CONFIG, REPO, run_snakemake
from eaglenest.model import drafter as drafter_lib
from eaglenest.model import replay, speculate
from eaglenest.stages import export

SMOLLM2 = REPO / "resources" / "models" / "SmolLM2-135M-Instruct"


def load_target(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def sparse_draft_vocab(vocab_size: int, every: int = 2) -> dict:
    """A draft vocab of every ``every``-th target id: d2t is not all zeros, so the mapping is exercised."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[::every] = True
    chosen = t2d.nonzero().squeeze(-1)
    return {"d2t": chosen - torch.arange(chosen.numel()), "t2d": t2d}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Batch-1 decoding of small models is all op overhead: more threads only contend for cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama):
    target = load_target(tiny_llama)
    drafter = drafter_lib.build_drafter(tiny_llama, sparse_draft_vocab(target.config.vocab_size), [1, 3, 4], seed=3).eval()
    return target, drafter


# ---- tree attention and cache handling --------------------------------------------------------


def test_tree_visibility_is_ancestors_and_self():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    visible = speculate.tree_visibility([-1, -1, 0, 0, 1])
    rows = {i: set(torch.nonzero(visible[i + 1]).squeeze(-1).tolist()) for i in range(5)}
    assert rows == {0: {0, 1}, 1: {0, 2}, 2: {0, 1, 3}, 3: {0, 1, 4}, 4: {0, 2, 5}}


@torch.inference_mode()
def test_tree_verification_gives_the_logits_of_each_branch_run_alone(tiny_pair):
    target, _ = tiny_pair
    prompt = [11, 42, 7, 99, 5, 23]
    root, parents = 17, [-1, -1, 0, 0, 1, 2, 4]
    tokens = [30, 31, 32, 33, 34, 35, 36]
    depths = [1, 1, 2, 2, 2, 3, 3]
    past = target(input_ids=torch.tensor([prompt]), use_cache=True).cache
    mask = speculate.tree_attention_mask(parents, len(prompt), torch.float32)
    positions = torch.tensor([[len(prompt)] + [len(prompt) + d for d in depths]])
    tree_logits = target(input_ids=torch.tensor([[root] + tokens]), position_ids=positions, attention_mask=mask,
                         cache=past, use_cache=True).logits[0]
    for node in range(len(tokens)):
        branch, ancestor = [], node
        while ancestor >= 0:
            branch.insert(0, ancestor)
            ancestor = parents[ancestor]
        alone = target(input_ids=torch.tensor([prompt + [root] + [tokens[n] for n in branch]])).logits[0]
        torch.testing.assert_close(tree_logits[node + 1], alone[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tree_logits[0], alone[len(prompt)], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_keeping_a_branch_of_the_cache_equals_a_cache_built_on_that_branch(tiny_pair):
    target, _ = tiny_pair
    prompt = [3, 14, 15, 92, 65]
    root, parents, tokens, depths = 35, [-1, -1, 1, 1], [89, 79, 32, 38], [1, 1, 2, 2]
    cache = target(input_ids=torch.tensor([prompt]), use_cache=True).cache
    mask = speculate.tree_attention_mask(parents, len(prompt), torch.float32)
    positions = torch.tensor([[len(prompt)] + [len(prompt) + d for d in depths]])
    target(input_ids=torch.tensor([[root] + tokens]), position_ids=positions, attention_mask=mask, cache=cache, use_cache=True)
    # Keep root -> node 1 -> node 3 (rows 0, 2, 4): not a prefix of the tree order.
    speculate.keep_cache_entries(cache, len(prompt), [0, 2, 4])
    following = target(input_ids=torch.tensor([[50]]), cache=cache, use_cache=True).logits[0, -1]
    fresh = target(input_ids=torch.tensor([prompt + [root, 79, 38, 50]])).logits[0, -1]
    torch.testing.assert_close(following, fresh, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_incremental_drafter_matches_the_drafter_forward(tiny_pair):
    target, drafter = tiny_pair
    torch.manual_seed(0)
    length = 12
    input_ids = torch.randint(0, target.config.vocab_size, (length,))
    aux = torch.randn(length, 3 * target.config.hidden_size)
    expected_logits, expected_hidden = drafter(input_ids[None], aux[None])
    state = speculate.DrafterState(drafter)
    first = state.extend(input_ids[:5], aux[:5], 0)
    second = state.extend(input_ids[5:], aux[5:], 5)
    torch.testing.assert_close(torch.cat([first[0], second[0]]), expected_logits[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([first[1], second[1]]), expected_hidden[0], rtol=1e-4, atol=1e-5)


@torch.inference_mode()
def test_a_drafted_node_sees_only_its_ancestors(tiny_pair):
    """Siblings fed together under the tree mask = each branch fed alone as a plain chain."""
    target, drafter = tiny_pair
    torch.manual_seed(1)
    context_ids = torch.randint(0, target.config.vocab_size, (6,))
    aux = torch.randn(6, 3 * target.config.hidden_size)

    def after_context():
        state = speculate.DrafterState(drafter)
        return state, state.extend(context_ids, aux, 0)

    state, (_, hidden) = after_context()
    siblings = torch.tensor([40, 41])
    # Rows: sibling 40, sibling 41, child 42 of 41. Slots: context 0..5, then the three nodes.
    visible = torch.zeros(3, 9, dtype=torch.bool)
    visible[:, :6] = True
    visible[0, 6] = visible[1, 7] = True
    visible[2, 7] = visible[2, 8] = True
    h = hidden[-1:].expand(2, -1)
    tree_logits, tree_hidden = state.step(siblings, h, torch.tensor([6, 6]), visible[:2, :8])
    child_logits, _ = state.step(torch.tensor([42]), tree_hidden[1:], torch.tensor([7]), visible[2:])
    for row, token in enumerate(siblings.tolist()):
        alone, (_, hidden) = after_context()
        logits, out = alone.extend(torch.tensor([token]), hidden[-1:], 6)
        torch.testing.assert_close(tree_logits[row], logits[0], rtol=1e-4, atol=1e-5)
    chain_logits, _ = alone.extend(torch.tensor([42]), out, 7)
    torch.testing.assert_close(child_logits[0], chain_logits[0], rtol=1e-4, atol=1e-5)


@torch.inference_mode()
def test_draft_tree_respects_the_budget_and_puts_parents_first(tiny_pair):
    target, drafter = tiny_pair
    state = speculate.DrafterState(drafter)
    logits, hidden = state.extend(torch.arange(6), torch.randn(6, 3 * target.config.hidden_size), 0)
    drafting = speculate.Drafting(steps=3, topk=2, tokens=7)
    tree = speculate.build_draft_tree(state, logits[-1], hidden[-1], 6, drafting, 0.0, target.config.vocab_size, None)
    assert state.length == 6, "drafted entries must be dropped after drafting"
    assert len(tree) == drafting.tokens - 1 and max(tree.depths) <= drafting.steps
    top2 = drafter.draft_to_target(torch.topk(logits[-1], 2).indices).tolist()
    assert [t for t, d in zip(tree.tokens, tree.depths) if d == 1] == top2
    for node, parent in enumerate(tree.parents):
        assert parent < node and (parent < 0 or tree.depths[parent] == tree.depths[node] - 1)
    chain = speculate.build_draft_tree(state, logits[-1], hidden[-1], 6, speculate.Drafting(steps=4), 0.0,
                                       target.config.vocab_size, None)
    assert chain.parents == [-1, 0, 1, 2] and chain.depths == [1, 2, 3, 4]


# ---- acceptance statistics -------------------------------------------------------------------


def test_tau_and_per_position_acceptance_on_a_hand_made_trace():
    stats = speculate.acceptance_stats(accepted=[0, 3, 1, 2], draft_depths=[3, 3, 3, 3])
    assert stats["cycles"] == 4 and stats["tokens"] == 10 and stats["tau"] == 2.5
    assert stats["acceptance_by_position"] == [3 / 4, 2 / 3, 1 / 2]
    assert stats["acceptance_by_position_unconditional"] == [3 / 4, 2 / 4, 1 / 4]
    assert stats["accept_length_histogram"] == [1, 1, 1, 1]


def test_per_position_acceptance_counts_only_cycles_that_drafted_that_deep():
    # A tree budget can leave a cycle shallower than num_steps: its position 3 was never offered.
    stats = speculate.acceptance_stats(accepted=[2, 2, 3, 0, 1], draft_depths=[2, 3, 3, 3, 1])
    assert stats["tau"] == (8 + 5) / 5
    # Position 2 is offered only where position 1 was accepted and the tree reached depth 2.
    assert stats["offered_by_position"] == [5, 3, 2]
    assert stats["acceptance_by_position"] == [4 / 5, 3 / 3, 1 / 2]
    assert stats["acceptance_by_position_unconditional"] == [4 / 5, 3 / 4, 1 / 3]


def test_no_cycle_gives_no_tau_and_impossible_traces_are_refused():
    assert math.isnan(speculate.acceptance_stats([], [])["tau"])
    with pytest.raises(ValueError):
        speculate.acceptance_stats([4], [3])
    with pytest.raises(ValueError):
        speculate.acceptance_stats([1, 2], [3])


# ---- speculative sampling ---------------------------------------------------------------------


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def chi_square_limit(cells: int) -> float:
    # Far tail of chi-square(df): mean df, sd sqrt(2 df); 6 sd misses a true match ~never.
    df = cells - 1
    return df + 6 * math.sqrt(2 * df)


def test_speculative_accept_keeps_the_target_distribution():
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    q = torch.tensor([0.5, 0.1, 0.2, 0.1, 0.1])
    samples = 20000
    sampled = torch.zeros(5)
    point_mass = torch.zeros(5)
    for _ in range(samples):
        drafts = torch.multinomial(q, 2, replacement=True, generator=generator).tolist()
        _, token = speculate.speculative_accept(p, drafts, [q, q], generator)
        sampled[token] += 1
        _, token = speculate.speculative_accept(p, [1, 3], [None, None], generator)
        point_mass[token] += 1
    assert chi_square(sampled, p) < chi_square_limit(5)
    assert chi_square(point_mass, p) < chi_square_limit(5)
    # The statistic has power: the draft's own distribution is far outside the limit.
    assert chi_square(sampled, q) > chi_square_limit(5)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A random target over 16 tokens and a drafter over 8 of them: the two distributions
    overlap enough that drafts are both accepted and rejected, and every outcome can be counted."""
    from transformers import AutoModelForCausalLM

    from support import tiny

    path = tmp_path_factory.mktemp("small-vocab") / "model"
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(tiny.tiny_config(vocab_size=16, num_layers=4)).save_pretrained(str(path))
    target = load_target(path)
    return target, drafter_lib.build_drafter(path, sparse_draft_vocab(16), [1, 2, 3], seed=3).eval()


def exact_triple_distribution(target, prompt, temperature) -> torch.Tensor:
    """[V ** 3]: the target's probability of each sequence of three generated tokens."""
    vocab = target.config.vocab_size

    def next_probs(prefixes):
        with torch.inference_mode():
            logits = target(input_ids=torch.tensor([prompt + list(x) for x in prefixes])).logits[:, -1]
        return torch.softmax(logits.double() / temperature, -1)

    first = next_probs([()])[0]
    second = next_probs([(x,) for x in range(vocab)])
    third = next_probs([(x, y) for x in range(vocab) for y in range(vocab)]).view(vocab, vocab, vocab)
    return (first[:, None, None] * second[:, :, None] * third).flatten()


@pytest.mark.parametrize("drafting", [speculate.Drafting(steps=2, topk=1), speculate.Drafting(steps=2, topk=3, tokens=6)],
                         ids=lambda d: d.name)
def test_speculative_sampling_on_a_tiny_model_matches_the_target_distribution(small_vocab_pair, drafting):
    target, drafter = small_vocab_pair
    temperature, samples, prompt, vocab = 0.2, 1500, [3, 9, 1, 14], 16
    exact = exact_triple_distribution(target, prompt, temperature)
    decoder = speculate.SpeculativeDecoder(target, drafter, eos_token_ids=[])
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros_like(exact)
    accepted = torch.zeros(3)  # cycles that accepted 0, 1, 2 drafted tokens
    for _ in range(samples):
        result = decoder.generate(prompt, drafting, max_new_tokens=3, temperature=temperature, generator=generator)
        first, second, third = result.tokens
        counts[(first * vocab + second) * vocab + third] += 1
        accepted[result.accepted[0]] += 1
    keep = exact * samples >= 5  # chi-square wants expected counts >= 5: pool the rare sequences
    counts = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    probs = torch.cat([exact[keep], exact[~keep].sum(0, keepdim=True)])
    assert (accepted > 0.02 * samples).all(), f"cycles by accepted count {accepted.tolist()}: every branch must occur"
    assert chi_square(counts, probs) < chi_square_limit(len(probs))


# ---- greedy is lossless -----------------------------------------------------------------------


@pytest.mark.parametrize("drafting", [speculate.Drafting(3, 1, 4), speculate.Drafting(3, 3, 8)], ids=lambda d: d.name)
def test_greedy_is_lossless_on_a_tiny_target(tiny_pair, drafting):
    target, drafter = tiny_pair
    decoder = speculate.SpeculativeDecoder(target, drafter)
    for prompt in ([5, 6, 7], [100, 3, 250, 8, 19, 77]):
        expected = speculate.target_decode(target, prompt, 20, decoder.eos_token_ids)
        assert decoder.generate(prompt, drafting, 20).tokens == expected.tokens


@pytest.fixture(scope="module")
def smollm2():
    if not SMOLLM2.exists():
        run_snakemake(REPO, DEFAULT_CONFIG, "--cores", "2", str(SMOLLM2.relative_to(REPO)))
    from transformers import AutoTokenizer

    return load_target(SMOLLM2), AutoTokenizer.from_pretrained(str(SMOLLM2))


SMOLLM2_PROMPTS = ["Write a haiku about the sea.", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]


def chat_ids(tokenizer, text):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def assert_lossless_on_smollm2(target, tokenizer, drafter, max_new_tokens=16):
    decoder = speculate.SpeculativeDecoder(target, drafter)
    traces = []
    for text in SMOLLM2_PROMPTS:
        prompt = chat_ids(tokenizer, text)
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(prompt):]
        for drafting in (speculate.Drafting(3, 1, 4), speculate.Drafting(3, 4, 10)):
            result = decoder.generate(prompt, drafting, max_new_tokens)
            assert result.tokens == expected.tolist(), (text, drafting.name)
            traces.append(result)
    return speculate.acceptance_stats(sum((r.accepted for r in traces), []), sum((r.draft_depths for r in traces), []))


@pytest.mark.workflow
def test_greedy_is_lossless_on_smollm2_with_an_untrained_drafter(smollm2, tmp_path):
    target, tokenizer = smollm2
    vocab = sparse_draft_vocab(target.config.vocab_size, every=6)
    drafter = drafter_lib.build_drafter(SMOLLM2, vocab, [2, 15, 27], init_head_from_target=False).eval()
    stats = assert_lossless_on_smollm2(target, tokenizer, drafter)
    assert stats["tau"] < 1.5, "a random drafter should almost never be accepted"


def trained_drafters() -> list[Path]:
    """EAGLENEST_TRAINED_DRAFTER (a drafter directory or an export, e.g. the one in docs/results/) or the
    demo's results/*/train/drafter."""
    if os.environ.get("EAGLENEST_TRAINED_DRAFTER"):
        return [Path(os.environ["EAGLENEST_TRAINED_DRAFTER"])]
    return sorted(p.parent for p in REPO.glob("results/*/train/drafter/model.safetensors"))


@pytest.mark.workflow
@pytest.mark.skipif(not trained_drafters(), reason="no trained drafter: run the demo or set EAGLENEST_TRAINED_DRAFTER")
def test_greedy_is_lossless_on_smollm2_with_the_trained_drafter(smollm2):
    target, tokenizer = smollm2
    drafter = export.load_any_drafter(trained_drafters()[0], SMOLLM2).eval()
    stats = assert_lossless_on_smollm2(target, tokenizer, drafter)
    assert stats["tau"] > 1.0, "the trained drafter should get some tokens accepted"


# ---- replay: the decoder's cycles from one teacher-forced forward ----------------------------


def assert_replay_matches_decoding(target, drafter, prompts, draftings, max_new_tokens):
    """Replay on the target's greedy output gives the decoder's exact cycles, alone and with
    every prompt in lockstep (replay_many); returns the cycle count."""
    decoder = speculate.SpeculativeDecoder(target, drafter)
    eos = sorted(decoder.eos_token_ids)
    lookahead = max(d.steps for d in draftings)
    references = [speculate.target_decode(target, prompt, max_new_tokens, eos, lookahead=lookahead).tokens
                  for prompt in prompts]
    cycles = 0
    for drafting in draftings:
        together = replay.replay_many(target, drafter, prompts, references, drafting, max_new_tokens, eos, batch=8)
        # A batch of 1 (each prompt alone through replay_many) and of 2 (a finished prompt's
        # place taken by the next) give the same traces as all prompts at once.
        for batch in (1, 2):
            assert [(r.tokens, r.accepted, r.draft_depths) for r in replay.replay_many(
                target, drafter, prompts, references, drafting, max_new_tokens, eos, batch=batch)] == [
                (r.tokens, r.accepted, r.draft_depths) for r in together], (drafting.name, batch)
        for prompt, reference, batched in zip(prompts, references, together):
            assert len(reference) == speculate.output_length(reference, max_new_tokens, eos) + lookahead
            decoded = decoder.generate(prompt, drafting, max_new_tokens)
            replayed = replay.replay_greedy(target, drafter, prompt, reference, drafting, max_new_tokens, eos)
            assert replayed.reference_consistent and batched.reference_consistent
            assert replayed.tokens == decoded.tokens == batched.tokens
            assert (replayed.accepted, replayed.draft_depths) == (decoded.accepted, decoded.draft_depths), drafting.name
            assert (batched.accepted, batched.draft_depths) == (decoded.accepted, decoded.draft_depths), drafting.name
            cycles += replayed.cycles
    return cycles


def test_drafter_calls_run_together_give_each_calls_own_logits_and_caches(tiny_pair):
    """run_draft_steps over several states (a 3H-wide extend beside an H-wide tree step) gives
    what each call gives alone, and leaves each state's cache as alone."""
    _, drafter = tiny_pair
    torch.manual_seed(3)
    wide = 3 * drafter.config.target_hidden_size
    alone, together = [], []
    for states in (alone, together):
        for length in (5, 9):
            state = speculate.DrafterState(drafter)
            generator = torch.Generator().manual_seed(length)
            state.extend(torch.randint(0, 200, (length,), generator=generator),
                         torch.randn(length, wide, generator=generator), 0)
            states.append(state)
    generator = torch.Generator().manual_seed(11)
    calls = [
        lambda state: state.extend_step(torch.tensor([7, 8]), torch.randn(2, wide, generator=generator), 5),
        lambda state: speculate.DraftStep(state, torch.tensor([3, 4, 5]),
                                          torch.randn(3, drafter.config.hidden_size, generator=generator),
                                          torch.tensor([9, 9, 9]), torch.ones(3, 12, dtype=torch.bool).tril(9)),
    ]
    generator.manual_seed(11)
    expected = [speculate.run_draft_steps(drafter, [call(state)])[0] for call, state in zip(calls, alone)]
    generator.manual_seed(11)
    got = speculate.run_draft_steps(drafter, [call(state) for call, state in zip(calls, together)])
    for (want_logits, want_hidden), (logits, hidden) in zip(expected, got):
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
    for a, b in zip(alone, together):
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.values, a.values, rtol=1e-5, atol=1e-5)


def test_replay_gives_the_decoders_cycles_on_a_tiny_target(tiny_pair):
    target, drafter = tiny_pair
    draftings = [speculate.Drafting(3, 1, 4), speculate.Drafting(3, 3, 8), speculate.Drafting(5, 1, 6)]
    assert assert_replay_matches_decoding(target, drafter, [[5, 6, 7], [100, 3, 250, 8, 19, 77]], draftings, 24) > 0


def test_replay_refuses_a_reference_without_lookahead(tiny_pair):
    target, drafter = tiny_pair
    reference = speculate.target_decode(target, [5, 6, 7], 12, [])
    with pytest.raises(ValueError, match="lookahead"):
        # One reference token and no lookahead: the first cycle already needs the second.
        replay.replay_greedy(target, drafter, [5, 6, 7], reference.tokens[:1], speculate.Drafting(3, 1, 4), 12, [])


@pytest.mark.workflow
@pytest.mark.skipif(not trained_drafters(), reason="no trained drafter: run the demo or set EAGLENEST_TRAINED_DRAFTER")
def test_replay_gives_the_decoders_cycles_on_smollm2_with_the_trained_drafter(smollm2):
    target, tokenizer = smollm2
    drafter = export.load_any_drafter(trained_drafters()[0], SMOLLM2).eval()
    prompts = [chat_ids(tokenizer, text) for text in SMOLLM2_PROMPTS]
    draftings = [speculate.Drafting(3, 1, 4), speculate.Drafting(4, 4, 10)]
    assert assert_replay_matches_decoding(target, drafter, prompts, draftings, 32) > 0
    # Cycles that accepted drafts are what the replay must get right: there are some.
    decoded = replay.replay_greedy(target, drafter, prompts[0], speculate.target_decode(
        target, prompts[0], 32, lookahead=4).tokens, draftings[1], 32)
    assert sum(decoded.accepted) > 0
