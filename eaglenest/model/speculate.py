"""Speculative decoding with a transformers target and an eaglenest EAGLE-3 drafter.

One cycle: the drafter proposes a tree of tokens after the newest verified token (the
*root*), the target scores the root and every drafted node in ONE forward with a tree
attention mask (a 4D mask: each node sees the verified context, its ancestors and itself;
position ids are the root's position plus the node's depth), the longest path the target
agrees with is kept together with one *bonus* token from the target's own distribution at
the end of that path, and the target's KV cache keeps exactly the entries of that path.

Drafting (EAGLE-2 style): depth 1 takes the ``topk`` most likely tokens; every later depth
feeds the current frontier (``topk`` nodes) to the drafter, scores their ``topk`` children
by cumulative log-probability and keeps the ``topk`` best as the next frontier. After
``steps`` depths the ``tokens - 1`` best-scoring candidates (``tokens`` counts the root,
as SGLang's ``speculative_num_draft_tokens`` does) form the tree. ``topk = 1`` is a chain.

Acceptance: with temperature 0 a node is accepted when it is the target's argmax, so the
output is the target's greedy output token for token. With temperature > 0 the standard
speculative-sampling rule is used: a drafted token x with draft distribution q is accepted
with probability min(1, p(x)/q(x)); on rejection p becomes normalize(max(p - q, 0)) and the
next sibling is tried; when none is accepted the bonus token is drawn from what is left of p.
A chain samples its draft tokens from the drafter (q = the drafter's tempered distribution);
tree nodes are chosen deterministically (top-k), so their q is a point mass on the token:
accept with probability p(x), else remove x from p. Both keep the output distribution
exactly the target's.

The drafter reads, per verified position t, the target's aux hidden states at t (captured
by forward pre-hooks on the aux decoder layers; HF convention: the input of decoder layer i)
and the token at t + 1, as in training (eaglenest.training.objective). Drafted nodes are fed back with the
drafter's own hidden state at the true sequence positions, as EAGLE's and SGLang's inference
do. The drafter keeps its own KV cache of verified positions; the entries of drafted nodes
are dropped after each cycle and the accepted positions are recomputed from the target's
real features.

Acceptance length tau = tokens produced by verification cycles / cycles, counting the bonus
token (as EAGLE and SGLang report it); the first token, produced by the prefill, belongs to
no cycle and is counted in neither.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from eaglenest.model.drafter import Eagle3Drafter, apply_rotary, rotary_cos_sin
from eaglenest.model.draft_tree import Drafting
from eaglenest.target_model.runtime import AuxCapture


@dataclass
class DraftTree:
    """Drafted nodes in tree order (a parent before its children); node -1 is the root."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    # Per node the draft distribution it was sampled from (over the target vocab), or None
    # for a deterministically chosen node (point mass).
    draft_probs: list[torch.Tensor | None]

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]


def tree_visibility(parents: list[int]) -> torch.Tensor:
    """[1 + N, 1 + N] bool with the root at index 0: row i sees itself and its ancestors."""
    size = len(parents) + 1
    visible = torch.eye(size, dtype=torch.bool)
    visible[:, 0] = True
    for node, parent in enumerate(parents):
        row = node + 1
        if parent >= 0:
            visible[row] |= visible[parent + 1]
    return visible


def tree_attention_mask(parents: list[int], past_length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, 1 + N, past + 1 + N] mask for the target's verification forward.

    Additive (0 / dtype min) rather than boolean so that eager and SDPA attention read it alike.
    """
    visible = tree_visibility(parents)
    full = torch.cat([torch.ones(visible.shape[0], past_length, dtype=torch.bool), visible], dim=1)
    mask = torch.zeros(full.shape, dtype=dtype)
    mask.masked_fill_(~full, torch.finfo(dtype).min)
    return mask[None, None]


def returned_cache(output):
    """The KV cache a forward returned: ``cache`` since transformers 5.2x, ``past_key_values``
    before (an H200 image may carry an older 5.x than the pinned one)."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_argument(model, cache) -> dict:
    """The keyword that hands ``model`` its KV cache, by the name its forward takes (looked up
    once per model class: this runs for every decoded token)."""
    return {_cache_keyword(type(model)): cache}


def keep_cache_entries(cache, past_length: int, keep: list[int]) -> None:
    """Keep the first ``past_length`` entries plus ``keep`` (offsets after them) in every layer."""
    contiguous = keep == list(range(len(keep)))
    index = torch.tensor(keep, dtype=torch.long)
    for layer in cache.layers:
        if contiguous:
            layer.keys = layer.keys[..., : past_length + len(keep), :]
            layer.values = layer.values[..., : past_length + len(keep), :]
        else:
            tail = index.to(layer.keys.device) + past_length
            layer.keys = torch.cat([layer.keys[..., :past_length, :], layer.keys.index_select(-2, tail)], dim=-2)
            layer.values = torch.cat([layer.values[..., :past_length, :], layer.values.index_select(-2, tail)], dim=-2)


@dataclass
class DraftStep:
    """One drafter call: ``input_ids`` [T] and ``hidden`` [T, 3H or H] fed to ``state`` at
    ``positions`` [T], each entry seeing the cached entries and the new ones ``visible``
    [T, length + T] marks."""

    state: "DrafterState"
    input_ids: torch.Tensor
    hidden: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor


def run_draft_steps(drafter: Eagle3Drafter, steps: list[DraftStep]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits [T, D], hidden_out [T, H]) of every step, each appended to its state's cache.

    The row-wise layers (fc, projections, MLP, head) run once over the rows of all steps: on a
    CPU one matrix product over 20 rows costs about what one row does, since the head's
    weight is streamed from memory once. Attention runs per state, over its own cache. Same
    weights and arithmetic as ``Eagle3Drafter.forward`` (eaglenest.model.drafter), which runs
    whole sequences; decoding needs caches over verified positions and tree masks over drafts.
    """
    config = drafter.config
    layer = drafter.midlayer
    attn = layer.self_attn
    device = drafter.fc.weight.device
    counts = [step.input_ids.shape[0] for step in steps]
    # Entries that come from the target (3 aux layers) go through fc; drafted ones are already H wide.
    hidden = [step.hidden for step in steps]
    wide = [i for i, h in enumerate(hidden) if h.shape[-1] == 3 * config.target_hidden_size]
    if wide:
        reduced = drafter.fc(torch.cat([hidden[i] for i in wide]))
        for i, part in zip(wide, reduced.split([counts[i] for i in wide])):
            hidden[i] = part
    hidden = torch.cat(hidden)
    # Tree bookkeeping builds ids, positions and masks on the CPU; the drafter may be on a GPU.
    input_ids = torch.cat([step.input_ids for step in steps]).to(device)
    embeds = drafter.embed_tokens(input_ids).to(hidden.dtype)
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)[None]
    rows = x.shape[1]
    q_all = attn.q_proj(x).view(1, rows, attn.heads, attn.head_dim).transpose(1, 2)
    k_all = attn.k_proj(x).view(1, rows, attn.kv_heads, attn.head_dim).transpose(1, 2)
    v_all = attn.v_proj(x).view(1, rows, attn.kv_heads, attn.head_dim).transpose(1, 2)
    group = attn.heads // attn.kv_heads
    outs = []
    for step, q, k, v in zip(steps, q_all.split(counts, dim=2), k_all.split(counts, dim=2), v_all.split(counts, dim=2)):
        state = step.state
        cos, sin = rotary_cos_sin(step.positions.to(device)[None], attn.head_dim, attn.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        state.keys = k if state.keys is None else torch.cat([state.keys, k], dim=-2)
        state.values = v if state.values is None else torch.cat([state.values, v], dim=-2)
        keys = state.keys.repeat_interleave(group, dim=1) if group > 1 else state.keys
        values = state.values.repeat_interleave(group, dim=1) if group > 1 else state.values
        outs.append(F.scaled_dot_product_attention(q, keys, values, attn_mask=step.visible.to(device)[None, None]))
    out = torch.cat(outs, dim=2)
    out = attn.o_proj(out.transpose(1, 2).reshape(1, rows, attn.heads * attn.head_dim))[0]
    residual = hidden + out
    hidden_out = residual + layer.mlp(layer.post_attention_layernorm(residual))
    logits = drafter.lm_head(drafter.norm(hidden_out))
    return list(zip(logits.split(counts), hidden_out.split(counts)))


class DrafterState:
    """The drafter run incrementally: its own KV cache and an explicit visibility mask."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def crop(self, length: int) -> None:
        self.keys = self.keys[..., :length, :]
        self.values = self.values[..., :length, :]

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor):
        """Feed T entries; ``visible`` [T, length + T] bool. Returns (logits [T, D], hidden_out [T, H])."""
        return run_one(DraftStep(self, input_ids, hidden, positions, visible))

    def extend_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, first_position: int) -> DraftStep:
        """The call that appends verified entries causally (they see every cached entry and each other)."""
        count = input_ids.shape[0]
        visible = torch.ones(count, self.length + count, dtype=torch.bool)
        visible[:, self.length :] = torch.ones(count, count, dtype=torch.bool).tril()
        positions = torch.arange(first_position, first_position + count)
        return DraftStep(self, input_ids, hidden, positions, visible)

    def extend(self, input_ids: torch.Tensor, hidden: torch.Tensor, first_position: int):
        return run_one(self.extend_step(input_ids, hidden, first_position))


def run_one(step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter call on its own: ``run_draft_steps`` of that step alone."""
    return run_draft_steps(step.state.drafter, [step])[0]


def run_alone(coroutine):
    """Drive a drafting coroutine (one that yields DraftSteps and is sent their results) one
    drafter call at a time; returns what it returns."""
    try:
        step = next(coroutine)
        while True:
            step = coroutine.send(run_one(step))
    except StopIteration as done:
        return done.value


def draft_distribution(drafter: Eagle3Drafter, logits: torch.Tensor, temperature: float, vocab_size: int) -> torch.Tensor:
    """The drafter's tempered distribution moved from draft ids to target ids ([..., V])."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    out = torch.zeros(*probs.shape[:-1], vocab_size, dtype=probs.dtype, device=probs.device)
    ids = drafter.draft_to_target(torch.arange(logits.shape[-1], device=drafter.d2t.device)).to(logits.device)
    out[..., ids] = probs
    return out


def build_draft_tree(
    state: DrafterState,
    last_logits: torch.Tensor,
    last_hidden: torch.Tensor,
    root_position: int,
    drafting: Drafting,
    temperature: float,
    vocab_size: int,
    generator: torch.Generator | None,
) -> DraftTree:
    """Draft after the root; ``last_*`` come from the drafter entry whose token is the root."""
    return run_alone(draft_tree_steps(state, last_logits, last_hidden, root_position, drafting, temperature,
                                      vocab_size, generator))


def draft_tree_steps(
    state: DrafterState,
    last_logits: torch.Tensor,
    last_hidden: torch.Tensor,
    root_position: int,
    drafting: Drafting,
    temperature: float,
    vocab_size: int,
    generator: torch.Generator | None,
):
    """``build_draft_tree`` as a coroutine: yields each depth's DraftStep, is sent its
    (logits, hidden_out), returns the DraftTree. Replay runs many of these in lockstep."""
    drafter = state.drafter
    context_length = state.length
    sample_chain = drafting.topk == 1 and temperature > 0
    # Pool of candidates: token, parent (pool index, -1 root), depth, cumulative log-prob, q.
    tokens, parents, depths, scores, qs = [], [], [], [], []
    fed_slot: dict[int, int] = {}  # pool index -> its entry in the drafter's cache

    def add_children(parent: int, logits: torch.Tensor, parent_score: float) -> list[int]:
        logp = torch.log_softmax(logits.float(), dim=-1)
        if sample_chain:
            # Sampling runs on the CPU with a CPU generator, wherever the models run.
            cpu_logits = logits.float().cpu()
            draft_id = torch.multinomial(torch.softmax(cpu_logits / temperature, dim=-1), 1, generator=generator)
            q = draft_distribution(drafter, cpu_logits, temperature, vocab_size)
            picks = [(int(drafter.draft_to_target(draft_id.to(logits.device))), float(logp[int(draft_id)]), q)]
        else:
            top = torch.topk(logp, drafting.topk)
            ids = drafter.draft_to_target(top.indices)
            # One copy to the host per drafted node, not one per child: on a GPU each item
            # read is a synchronisation, and a 10-wide tree drafts 10 children per node.
            picks = [(t, s, None) for t, s in zip(ids.tolist(), top.values.tolist())]
        made = []
        for target_id, logprob, q in picks:
            tokens.append(target_id)
            parents.append(parent)
            depths.append(1 if parent < 0 else depths[parent] + 1)
            scores.append(parent_score + logprob)
            qs.append(q)
            made.append(len(tokens) - 1)
        return made

    frontier = add_children(-1, last_logits, 0.0)
    frontier_hidden = last_hidden.expand(len(frontier), -1)
    for depth in range(2, drafting.steps + 1):
        # Feed the frontier: each node sees the verified context, its fed ancestors and itself.
        count = len(frontier)
        visible = torch.zeros(count, state.length + count, dtype=torch.bool)
        visible[:, :context_length] = True
        for row, node in enumerate(frontier):
            ancestor = parents[node]
            while ancestor >= 0:
                visible[row, fed_slot[ancestor]] = True
                ancestor = parents[ancestor]
            visible[row, state.length + row] = True
        for row, node in enumerate(frontier):
            fed_slot[node] = state.length + row
        positions = torch.full((count,), root_position + depth - 2, dtype=torch.long)
        ids = torch.tensor([tokens[n] for n in frontier], dtype=torch.long)
        logits, hidden_out = yield DraftStep(state, ids, frontier_hidden, positions, visible)
        children, child_hidden = [], []
        for row, node in enumerate(frontier):
            made = add_children(node, logits[row], scores[node])
            children += made
            child_hidden += [hidden_out[row]] * len(made)
        keep = sorted(range(len(children)), key=lambda i: -scores[children[i]])[: drafting.topk]
        frontier = [children[i] for i in keep]
        frontier_hidden = torch.stack([child_hidden[i] for i in keep])

    # The best tokens - 1 candidates; a child never outscores its parent (log-probs <= 0),
    # and ties go to the shallower node, so every chosen node's parent is chosen before it.
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))
    chosen: list[int] = []
    chosen_set: set[int] = set()
    for node in order:
        if len(chosen) == drafting.tokens - 1:
            break
        if parents[node] < 0 or parents[node] in chosen_set:
            chosen.append(node)
            chosen_set.add(node)
    chosen.sort(key=lambda i: (depths[i], i))
    new_index = {node: i for i, node in enumerate(chosen)}
    state.crop(context_length)
    return DraftTree(
        tokens=[tokens[n] for n in chosen],
        parents=[new_index[parents[n]] if parents[n] >= 0 else -1 for n in chosen],
        depths=[depths[n] for n in chosen],
        draft_probs=[qs[n] for n in chosen],
    )


def speculative_accept(
    target_probs: torch.Tensor,
    candidates: list[int],
    draft_probs: list[torch.Tensor | None],
    generator: torch.Generator | None,
) -> tuple[int | None, int]:
    """Speculative sampling over sibling candidates: (index of the accepted one or None, token).

    A candidate drawn from q is accepted with probability min(1, p(x)/q(x)); on rejection p
    becomes normalize(max(p - q, 0)). A deterministic candidate (q None) is a point mass. The
    returned token is the accepted candidate or a draw from the residual p; either way it is
    distributed as the original p.
    """
    p = target_probs.double()
    for index, (token, q) in enumerate(zip(candidates, draft_probs)):
        if q is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        q = q.double()
        ratio = float(p[token] / q[token]) if q[token] > 0 else 0.0
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < min(1.0, ratio):
            return index, token
        residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        if total <= 0.0:
            break
        p = residual / total
    return None, int(torch.multinomial(p, 1, generator=generator))


@dataclass
class Generation:
    """What one prompt produced and how: tokens, and per cycle accepted drafts and draft depth."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    draft_depths: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def cycles(self) -> int:
        return len(self.accepted)


class SpeculativeDecoder:
    """Target + drafter for speculative decoding of one prompt at a time (batch 1)."""

    def __init__(self, target, drafter: Eagle3Drafter, eos_token_ids: list[int] | None = None):
        self.target = target.eval()
        self.drafter = drafter.eval()
        self.vocab_size = target.config.vocab_size
        if drafter.config.vocab_size != self.vocab_size:
            raise ValueError(f"drafter vocab {drafter.config.vocab_size} != target vocab {self.vocab_size}")
        if drafter.config.target_hidden_size != target.config.hidden_size:
            raise ValueError(
                f"drafter was built for hidden size {drafter.config.target_hidden_size}, target has {target.config.hidden_size}"
            )
        self.layer_ids = list(drafter.config.aux_layer_ids)
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else target_eos_ids(target))

    def _pick(self, logits: torch.Tensor, temperature: float, generator) -> int:
        if temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(torch.softmax(logits.double().cpu() / temperature, dim=-1), 1, generator=generator))

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        drafting: Drafting,
        max_new_tokens: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Generation:
        device = next(self.target.parameters()).device
        began = time.perf_counter()
        capture = AuxCapture(self.target, self.layer_ids)
        try:
            prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
            out = self.target(input_ids=prompt, use_cache=True)
            cache = returned_cache(out)
            aux = capture.take()[0]
            first = self._pick(out.logits[0, -1], temperature, generator)
            result = Generation(tokens=[first])
            drafter_state = DrafterState(self.drafter)
            next_tokens = torch.tensor(prompt_ids[1:] + [first], dtype=torch.long, device=device)
            logits, hidden = drafter_state.extend(next_tokens, aux.to(self.drafter.fc.weight.dtype), 0)
            root_position = len(prompt_ids)
            while not generation_finished(result.tokens, max_new_tokens, self.eos_token_ids):
                tree = build_draft_tree(
                    drafter_state, logits[-1], hidden[-1], root_position, drafting, temperature,
                    self.vocab_size, generator,
                )
                root = result.tokens[-1]
                ids = torch.tensor([[root] + tree.tokens], dtype=torch.long, device=device)
                positions = torch.tensor([[root_position] + [root_position + d for d in tree.depths]], device=device)
                dtype = next(self.target.parameters()).dtype
                mask = tree_attention_mask(tree.parents, root_position, dtype).to(device)
                out = self.target(input_ids=ids, position_ids=positions, attention_mask=mask,
                                  use_cache=True, **cache_argument(self.target, cache))
                aux = capture.take()[0]
                path, new_tokens = self._accept(tree, out.logits[0], temperature, generator)
                keep_cache_entries(cache, root_position, path)
                result.accepted.append(len(path) - 1)
                result.draft_depths.append(max(tree.depths))
                result.tokens += new_tokens
                # The drafter's next entries: the target's features on the kept path, each
                # with the token that follows it.
                path_index = torch.tensor(path, dtype=torch.long, device=device)
                next_tokens = torch.tensor(new_tokens, dtype=torch.long, device=device)
                logits, hidden = drafter_state.extend(
                    next_tokens, aux.index_select(0, path_index).to(self.drafter.fc.weight.dtype), root_position
                )
                root_position += len(path)
        finally:
            capture.remove()
        result.tokens = result.tokens[: output_length(result.tokens, max_new_tokens, self.eos_token_ids)]
        result.seconds = time.perf_counter() - began
        return result

    def _accept(self, tree: DraftTree, logits: torch.Tensor, temperature: float, generator):
        """Walk the tree from the root: (kept rows incl. the root, new tokens incl. the bonus)."""
        node, path, new_tokens = -1, [0], []
        while True:
            children = tree.children(node)
            row = logits[node + 1]
            if temperature == 0:
                token = int(row.argmax())
                chosen = next((c for c in children if tree.tokens[c] == token), None)
            else:
                probs = torch.softmax(row.double().cpu() / temperature, dim=-1)
                index, token = speculative_accept(
                    probs, [tree.tokens[c] for c in children], [tree.draft_probs[c] for c in children], generator
                )
                chosen = None if index is None else children[index]
            new_tokens.append(token)
            if chosen is None:
                return path, new_tokens
            node = chosen
            path.append(node + 1)

def target_eos_ids(target) -> list[int]:
    ids = []
    for source in (getattr(target, "generation_config", None), target.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids += value if isinstance(value, list) else [value]
    return sorted(set(ids))


def generation_finished(tokens: list[int], max_new_tokens: int, eos_token_ids) -> bool:
    """Whether a speculative generation stops before its next cycle (a cycle can overshoot)."""
    return len(tokens) >= max_new_tokens or any(token in eos_token_ids for token in tokens)


def output_length(tokens: list[int], max_new_tokens: int, eos_token_ids) -> int:
    """How many of ``tokens`` a generation keeps: up to the first end of turn, at most max_new_tokens."""
    eos = set(eos_token_ids)
    for index, token in enumerate(tokens[:max_new_tokens]):
        if token in eos:
            return index + 1
    return min(len(tokens), max_new_tokens)


@torch.inference_mode()
def target_decode(
    target, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int] | None = None, lookahead: int = 0
) -> Generation:
    """Plain greedy decoding with the target alone (one forward per token): the reference
    output and the baseline time for the speedup.

    ``lookahead`` > 0 keeps decoding that many tokens past where the output stops (end of
    turn or max_new_tokens): a verification cycle can accept drafted tokens past the stop,
    and ``replay_greedy`` needs the target's tokens there. ``seconds`` times the output alone.
    """
    eos = set(eos_token_ids if eos_token_ids is not None else target_eos_ids(target))
    device = next(target.parameters()).device
    began = time.perf_counter()
    out = target(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]

    def decode_next_token():
        nonlocal out
        out = target(input_ids=torch.tensor([[tokens[-1]]], device=device), use_cache=True,
                     **cache_argument(target, returned_cache(out)))
        tokens.append(int(out.logits[0, -1].argmax()))

    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        decode_next_token()
    seconds = time.perf_counter() - began
    for _ in range(lookahead):
        decode_next_token()
    return Generation(tokens=tokens, seconds=seconds)


def acceptance_stats(accepted: list[int], draft_depths: list[int]) -> dict:
    """tau and per-position acceptance from per-cycle traces.

    ``accepted[c]``: drafted tokens accepted in cycle c; ``draft_depths[c]``: the depth of
    that cycle's draft tree. tau = (accepted + 1 bonus) summed / cycles. Position i's
    conditional rate = cycles that accepted >= i / cycles that accepted >= i - 1 and drafted
    at least i deep (how often position i is accepted given i - 1 was); the unconditional rate
    divides by all cycles that drafted at least i deep.
    """
    if len(accepted) != len(draft_depths):
        raise ValueError(f"{len(accepted)} accepted counts but {len(draft_depths)} draft depths")
    for a, d in zip(accepted, draft_depths):
        if not 0 <= a <= d:
            raise ValueError(f"accepted {a} outside [0, draft depth {d}]")
    cycles = len(accepted)
    depth = max(draft_depths, default=0)
    conditional, unconditional, reached = [], [], []
    for i in range(1, depth + 1):
        offered = sum(1 for a, d in zip(accepted, draft_depths) if a >= i - 1 and d >= i)
        drafted = sum(1 for d in draft_depths if d >= i)
        hits = sum(1 for a in accepted if a >= i)
        conditional.append(hits / offered if offered else None)
        unconditional.append(hits / drafted if drafted else None)
        reached.append(offered)
    return {
        "cycles": cycles,
        "tokens": sum(accepted) + cycles,
        "tau": (sum(accepted) + cycles) / cycles if cycles else math.nan,
        "acceptance_by_position": conditional,
        "acceptance_by_position_unconditional": unconditional,
        "offered_by_position": reached,
        "accept_length_histogram": [sum(1 for a in accepted if a == n) for n in range(depth + 1)],
    }
