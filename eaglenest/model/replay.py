"""Greedy speculative decoding replayed on the target's known output, one prompt or many at once.

With temperature 0 speculative decoding outputs the target's greedy tokens, and what the
drafter sees at every cycle is fixed by them: the target's aux features at the verified
positions (the same with a tree mask over the path as causally over the whole output) and
the verified tokens. So ONE teacher-forced target forward over prompt + reference (decoded by
``speculate.target_decode`` with ``lookahead`` >= drafting.steps) yields every feature, and a
cycle accepts the longest draft path that spells the reference's next tokens. The drafter
code and cycle bookkeeping are ``SpeculativeDecoder.generate``'s (``draft_tree_steps``,
``DrafterState``); the ~100 target forwards of a 128-token answer become one.

What remains is the drafter: a few calls per cycle, each over one to ``topk`` rows. On a CPU
such a call is bound by streaming the head's weight (32K x 576 floats for SmolLM2's drafter),
so ``replay_many`` replays prompts in lockstep and feeds one drafter call of every unfinished
prompt through one ``run_draft_steps``: each weight is read once per round, not once per prompt.
Every prompt's cycles are the same as replayed alone; only the rows a matrix product sums
together change, which moves logits by float32 rounding (tests hold the traces equal).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from eaglenest.model.drafter import Eagle3Drafter
from eaglenest.model.draft_tree import Drafting
from eaglenest.model.speculate import (
    DrafterState,
    Generation,
    draft_tree_steps,
    generation_finished,
    output_length,
    run_alone,
    run_draft_steps,
    target_eos_ids,
)
from eaglenest.target_model.runtime import AuxCapture


@dataclass
class Replay(Generation):
    """A replayed generation; ``reference_consistent`` is False when one teacher-forced
    forward over the reference does not give the reference back as its argmax (a near-tie
    that rounded the other way), so the replay's features are not exactly the decoder's."""

    reference_consistent: bool = True


def replay_cycles(
    target,
    drafter: Eagle3Drafter,
    prompt_ids: list[int],
    reference: list[int],
    drafting: Drafting,
    max_new_tokens: int,
    eos_token_ids,
):
    """One prompt's replay as a coroutine: runs the target forward, then yields every drafter
    call (a DraftStep), is sent its (logits, hidden_out), and returns the Replay."""
    eos = set(eos_token_ids)
    stop = output_length(reference, max_new_tokens, eos)
    device = next(target.parameters()).device
    sequence = list(prompt_ids) + list(reference)
    prompt_length = len(prompt_ids)
    capture = AuxCapture(target, list(drafter.config.aux_layer_ids))
    try:
        out = target(input_ids=torch.tensor([sequence], device=device), use_cache=False)
        aux = capture.take()[0].to(drafter.fc.weight.dtype)
    finally:
        capture.remove()
    greedy = out.logits[0, prompt_length - 1 : -1].argmax(-1).tolist()
    del out
    result = Replay(tokens=[reference[0]], reference_consistent=greedy == list(reference))
    state = DrafterState(drafter)
    tokens_after = torch.tensor(sequence[1 : prompt_length + 1], dtype=torch.long)
    logits, hidden = yield state.extend_step(tokens_after, aux[:prompt_length], 0)
    root = prompt_length  # index in ``sequence`` of the newest verified token
    while not generation_finished(result.tokens, max_new_tokens, eos):
        tree = yield from draft_tree_steps(state, logits[-1], hidden[-1], root, drafting, 0.0,
                                           drafter.config.vocab_size, None)
        node, accepted = -1, 0
        while True:
            following = root + accepted + 1
            if following >= len(sequence):
                raise ValueError(
                    f"reference of {len(reference)} tokens ends inside a cycle: decode it with lookahead >= "
                    f"{drafting.steps} past its stop at {stop}"
                )
            node = next((c for c in tree.children(node) if tree.tokens[c] == sequence[following]), None)
            if node is None:
                break
            accepted += 1
        new_tokens = sequence[root + 1 : root + accepted + 2]
        result.accepted.append(accepted)
        result.draft_depths.append(max(tree.depths))
        result.tokens += new_tokens
        logits, hidden = yield state.extend_step(
            torch.tensor(new_tokens, dtype=torch.long), aux[root : root + accepted + 1], root
        )
        root += accepted + 1
    result.tokens = result.tokens[:stop]
    return result


def _eos(target, eos_token_ids):
    return eos_token_ids if eos_token_ids is not None else target_eos_ids(target)


@torch.inference_mode()
def replay_greedy(
    target,
    drafter: Eagle3Drafter,
    prompt_ids: list[int],
    reference: list[int],
    drafting: Drafting,
    max_new_tokens: int,
    eos_token_ids: list[int] | None = None,
) -> Replay:
    """The cycles greedy speculative decoding goes through for one prompt, replayed on the
    target's output ``reference``. Numerically the features come from one causal forward
    rather than the tree-verification forwards, so a draft near-tie may round the other way;
    tests hold the traces equal to decoding's."""
    began = time.perf_counter()
    result = run_alone(replay_cycles(target, drafter, prompt_ids, reference, drafting, max_new_tokens,
                                     _eos(target, eos_token_ids)))
    result.seconds = time.perf_counter() - began
    return result


@torch.inference_mode()
def replay_many(
    target,
    drafter: Eagle3Drafter,
    prompts: list[list[int]],
    references: list[list[int]],
    drafting: Drafting,
    max_new_tokens: int,
    eos_token_ids: list[int] | None = None,
    batch: int = 32,
) -> list[Replay]:
    """``replay_greedy`` of every prompt, ``batch`` of them in lockstep (a finished prompt's
    place goes to the next one). Each Replay's ``seconds`` is the wall time of the rounds it
    took part in divided by the prompts that shared them: its share of the job's time."""
    if len(prompts) != len(references):
        raise ValueError(f"{len(prompts)} prompts but {len(references)} references")
    if batch < 1:
        raise ValueError(f"replay batch {batch} < 1")
    eos = _eos(target, eos_token_ids)
    results: list[Replay | None] = [None] * len(prompts)
    shares = [0.0] * len(prompts)
    waiting = iter(range(len(prompts)))
    active: dict[int, tuple] = {}  # prompt index -> (coroutine, its pending DraftStep)

    def start_next() -> bool:
        index = next(waiting, None)
        if index is None:
            return False
        began = time.perf_counter()
        coroutine = replay_cycles(target, drafter, prompts[index], references[index], drafting, max_new_tokens, eos)
        active[index] = (coroutine, next(coroutine))  # the target forward runs here
        shares[index] += time.perf_counter() - began
        return True

    while len(active) < batch and start_next():
        pass
    while active:
        began = time.perf_counter()
        order = list(active)
        outputs = run_draft_steps(drafter, [active[i][1] for i in order])
        finished = []
        for index, output in zip(order, outputs):
            coroutine = active[index][0]
            try:
                active[index] = (coroutine, coroutine.send(output))
            except StopIteration as done:
                results[index] = done.value
                finished.append(index)
        share = (time.perf_counter() - began) / len(order)
        for index in order:
            shares[index] += share
        for index in finished:
            del active[index]
            results[index].seconds = shares[index]
            start_next()
    return results
