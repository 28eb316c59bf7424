"""What SGLang's radix cache costs the regeneration's server once its KV pool is full, measured
with SGLang's own ``RadixCache`` and ``TokenToKVPoolAllocator`` on the CPU (no GPU, no model).

The third full-set regeneration on the H200 (docs/results/sglang-h200-2026-12-04-regen2/) kept
every conversation's turns in the server's radix cache; its KV pool (3,227,882 tokens) was full
104 s in, and from then on each allocation the free pool cannot serve evicts first
(``srt/mem_cache/common.py:270-321`` in SGLang 0.5.14), on the scheduler's thread, and each
eviction heapifies every evictable leaf (``srt/mem_cache/radix_cache.py:558-585``). This
replays that run's requests against the real tree, in the order the stage sends them, and
counts what the tree does:

- requests: every regenerated turn of the run's regenerated set, its prompt the stage's token
  ids (``prepare.prompt_ids`` of the stored conversation up to that turn, as the ``generate``
  route sends it) and its answer the stored answer's ids plus the end of turn;
- the client: ``--conversations-in-flight`` conversations at a time, most turns first, each
  turn sent when the previous one is answered (``regenerate.regenerate_conversations``);
- the server: at most ``--batch`` requests decoding; a request enters with SGLang's prefix
  match (``match_prefix`` on its prompt less one token, then ``inc_lock_ref``), its uncached
  prompt allocated through the eviction check; each decode step allocates one slot per
  request through the same check; a finished request is inserted and unlocked as
  ``RadixCache.cache_finished_req`` does (``radix_cache.py:438-483``).

What this leaves out: the forward passes, SGLang's other per-request work, answers a loop cut
short in the server (their cut tails are not in the stored text), chunked prefill (prompts are
under the run's ``max_len`` of 2,048). The times are this machine's; the counts (evictable
leaves heapified per eviction, evictions per step) do not depend on it.

Run where SGLang imports (the node's environment; on a CPU-only machine SGLang's source
with its Python dependencies on ``PYTHONPATH``, transformers at the version SGLang pins (0.5.14's
wheel METADATA: ``Requires-Dist: transformers==5.8.1``), and ``--stub-torchvision``):

    python benchmarks/sglang_radix_eviction.py --model resources/models/SmolLM2-135M-Instruct \
        --regenerated results/<run>/regenerated/<key> --batch 1008 --pool-tokens 3227882 2000000 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

POOL_TOKENS = 3_227_882  # the third run's KV pool (its server log, "max_total_num_tokens")
BATCH = 354  # the third run's mean decode batch (its log's #running-req)
IN_FLIGHT = 1_008  # conversations in flight: 18 shard jobs x 56 threads


def stub_torchvision() -> None:
    """SGLang's utils import torchvision's JPEG decoder at module level; the radix cache never
    calls it, and a CPU build of torch may have no torchvision that loads beside it. An empty
    package stands in for it (transformers is told it exists so its image classes import)."""
    import importlib.abc
    import importlib.machinery
    import importlib.metadata
    import types

    class Anything:
        def __getattr__(self, name):
            return Anything()

        def __call__(self, *args, **kwargs):
            return Anything()

    class Empty(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Anything()

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            return Empty(spec.name)

        def exec_module(self, module):
            module.__path__ = []

    class Metadata(importlib.abc.MetaPathFinder):
        def find_spec(self, *args):
            return None

        def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
            if context.name == "torchvision":
                yield importlib.metadata.PathDistribution.at(_stub_dist_info())
            return

    sys.meta_path.insert(0, Finder())
    sys.meta_path.append(Metadata())


def _stub_dist_info() -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp()) / "torchvision-0.0.0.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.0.0\n")
    return folder


def load_requests(regenerated: Path, model: str, limit: int | None) -> list[list[tuple[list[int], list[int]]]]:
    """Every conversation's regenerated turns, as (prompt ids, answer ids) in turn order."""
    from eaglenest.stages.prepare import load_tokenizer, prompt_ids
    from eaglenest.stages.regenerate import end_of_turn_ids

    tokenizer = load_tokenizer(model)
    end = end_of_turn_ids(tokenizer)[:1]
    conversations = []
    for shard in sorted(regenerated.glob("shard-*.jsonl")):
        for line in shard.open():
            row = json.loads(line)
            turns = []
            for k in row["regenerated_turns"]:
                answer = tokenizer(row["messages"][k]["content"], add_special_tokens=False)["input_ids"]
                turns.append((prompt_ids(tokenizer, row["messages"][:k]), answer + end))
            if turns:
                conversations.append(turns)
            if limit and len(conversations) >= limit:
                return conversations
    return conversations


class Replay:
    """The server's radix-cache calls for one regeneration, step by step."""

    def __init__(self, pool_tokens: int, batch: int, max_tokens: int, eviction_policy: str):
        import torch
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.torch = torch
        self.allocator = TokenToKVPoolAllocator(pool_tokens, torch.float16, "cpu", None, need_sort=False)
        self.cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                                token_to_kv_pool_allocator=self.allocator, page_size=1,
                                                eviction_policy=eviction_policy))
        self.batch = batch
        # One row of KV slots per request in the batch, as SGLang's req_to_token pool.
        self.req_to_token = torch.zeros((batch, max_tokens), dtype=torch.int64)
        self.free_rows = list(range(batch))
        self.seconds = {"evict": 0.0, "match_and_lock": 0.0, "insert_and_unlock": 0.0, "allocate": 0.0}
        self.evictions: list[tuple[int, int, int]] = []  # (step, evictable leaves heapified, tokens evicted)
        self.tokens = {"prompt": 0, "cache_hit": 0, "prefilled": 0, "decoded": 0}
        self.step = 0
        self.pool_full_step: int | None = None
        self.peak_held = 0  # KV slots the running requests hold (neither free nor evictable)

    def allocate(self, count: int):
        """SGLang's alloc_token_slots: evict first when the free pool cannot serve it."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if self.allocator.available_size() < count:
            if self.pool_full_step is None:
                self.pool_full_step = self.step
            leaves = len(self.cache.evictable_leaves)
            started = time.perf_counter()
            result = self.cache.evict(EvictParams(num_tokens=count))
            self.seconds["evict"] += time.perf_counter() - started
            self.evictions.append((self.step, leaves, result.num_tokens_evicted))
        started = time.perf_counter()
        slots = self.allocator.alloc(count)
        self.seconds["allocate"] += time.perf_counter() - started
        if slots is None:
            raise RuntimeError(f"out of KV slots at step {self.step}: {count} wanted")
        return slots

    def admit(self, prompt: list[int], answer: list[int]) -> dict:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        started = time.perf_counter()
        # At least the prompt's last token is computed (Req.init_next_round_input).
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt[:-1])))
        self.cache.inc_lock_ref(match.last_device_node)
        self.seconds["match_and_lock"] += time.perf_counter() - started
        cached = len(match.device_indices)
        row = self.free_rows.pop()
        self.req_to_token[row, :cached] = match.device_indices
        self.req_to_token[row, cached:len(prompt)] = self.allocate(len(prompt) - cached)
        self.tokens["prompt"] += len(prompt)
        self.tokens["cache_hit"] += cached
        self.tokens["prefilled"] += len(prompt) - cached
        # The prefill makes the first answer token; each decode step then computes one more.
        return {"row": row, "ids": prompt + answer, "filled": len(prompt), "end": len(prompt) + len(answer) - 1,
                "protected": cached, "last_node": match.last_device_node}

    def decode_step(self, running: list[dict]) -> None:
        torch = self.torch
        slots = self.allocate(len(running))
        held = self.allocator.size - self.allocator.available_size() - self.cache.evictable_size()
        self.peak_held = max(self.peak_held, held)
        rows = torch.tensor([r["row"] for r in running])
        columns = torch.tensor([r["filled"] for r in running])
        self.req_to_token[rows, columns] = slots
        for request in running:
            request["filled"] += 1
        self.tokens["decoded"] += len(running)
        self.step += 1

    def finish(self, request: dict) -> None:
        """RadixCache.cache_finished_req: insert what has KV, free what the tree had, unlock."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        started = time.perf_counter()
        committed = request["filled"]
        values = self.req_to_token[request["row"], :committed].clone()
        result = self.cache.insert(InsertParams(key=RadixKey(request["ids"][:committed]), value=values))
        self.allocator.free(values[request["protected"]:result.prefix_len])
        self.cache.dec_lock_ref(request["last_node"])
        self.seconds["insert_and_unlock"] += time.perf_counter() - started
        self.free_rows.append(request["row"])


def run(conversations, pool_tokens: int, batch: int, in_flight: int, eviction_policy: str) -> dict:
    max_tokens = max(len(p) + len(a) for turns in conversations for p, a in turns) + 1
    replay = Replay(pool_tokens, batch, max_tokens, eviction_policy)
    # Most turns first, as the stage's client sends them.
    order = deque(sorted(range(len(conversations)), key=lambda i: -len(conversations[i])))
    next_turn: dict[int, int] = {}
    waiting: deque[int] = deque()  # conversations whose next turn is at the server, not yet in the batch
    running: list[dict] = []
    for _ in range(min(in_flight, len(order))):
        index = order.popleft()
        next_turn[index] = 0
        waiting.append(index)
    started = time.perf_counter()
    while waiting or running:
        to_decode = sum(r["end"] - r["filled"] for r in running)  # what the running requests will still decode
        while waiting and len(running) < batch:
            prompt, answer = conversations[waiting[0]][next_turn[waiting[0]]]
            # SGLang's PrefillAdder admits a request only while the free and evictable slots
            # cover it and what the running requests will still decode.
            room = replay.allocator.available_size() + replay.cache.evictable_size()
            if running and room < len(prompt) + len(answer) + to_decode:
                break
            index = waiting.popleft()
            request = replay.admit(prompt, answer)
            request["conversation"] = index
            running.append(request)
            to_decode += request["end"] - request["filled"]
        replay.decode_step(running)
        still = []
        for request in running:
            if request["filled"] < request["end"]:
                still.append(request)
                continue
            replay.finish(request)
            index = request["conversation"]
            next_turn[index] += 1
            if next_turn[index] < len(conversations[index]):
                waiting.append(index)
            elif order:  # the thread takes the next conversation
                fresh = order.popleft()
                next_turn[fresh] = 0
                waiting.append(fresh)
        running = still
    wall = time.perf_counter() - started
    return summarize(replay, wall)


def summarize(replay: Replay, wall: float) -> dict:
    evictions = replay.evictions
    full = replay.pool_full_step
    steps_full = replay.step - full if full is not None else 0
    leaves = sorted(e[1] for e in evictions)
    cache_seconds = sum(replay.seconds.values())
    return {
        "decode_steps": replay.step,
        "pool_full_at_step": full,
        "peak_tokens_held_by_running_requests": replay.peak_held,
        "tokens": replay.tokens,
        "evictions": len(evictions),
        "evictions_per_step_once_full": round(len(evictions) / steps_full, 3) if steps_full else 0.0,
        "evictable_leaves_heapified": {
            "mean": round(sum(leaves) / len(leaves), 1) if leaves else 0,
            "median": leaves[len(leaves) // 2] if leaves else 0,
            "max": leaves[-1] if leaves else 0,
        },
        "tokens_evicted_per_eviction": round(sum(e[2] for e in evictions) / len(evictions), 1) if evictions else 0,
        "cpu_seconds": {k: round(v, 3) for k, v in replay.seconds.items()},
        "evict_ms_per_eviction": round(1000 * replay.seconds["evict"] / len(evictions), 3) if evictions else 0,
        "evict_ms_per_step_once_full": round(1000 * replay.seconds["evict"] / steps_full, 3) if steps_full else 0,
        "evict_share_of_cache_seconds": round(replay.seconds["evict"] / cache_seconds, 3) if cache_seconds else 0,
        "replay_wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the target's folder (its tokenizer and chat template)")
    parser.add_argument("--regenerated", required=True, type=Path, help="a regenerated set's folder (shard-*.jsonl)")
    parser.add_argument("--pool-tokens", type=int, nargs="+", default=[POOL_TOKENS],
                        help="KV pool sizes to replay, one after another (SGLang's --max-total-tokens)")
    parser.add_argument("--batch", type=int, default=BATCH, help="requests decoding at most")
    parser.add_argument("--conversations-in-flight", type=int, default=IN_FLIGHT)
    parser.add_argument("--eviction-policy", default="lru")
    parser.add_argument("--limit", type=int, default=None, help="the first N conversations only (a quick look)")
    parser.add_argument("--requests-cache", type=Path, default=None,
                        help="keep the tokenized requests in this file and read them from it next time")
    parser.add_argument("--stub-torchvision", action="store_true", help="see stub_torchvision")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.stub_torchvision:
        stub_torchvision()
    import sglang

    started = time.perf_counter()
    if args.requests_cache and args.requests_cache.exists():
        conversations, tokenize_s = pickle.loads(args.requests_cache.read_bytes())
    else:
        conversations = load_requests(args.regenerated, args.model, args.limit)
        tokenize_s = time.perf_counter() - started
        if args.requests_cache:
            args.requests_cache.write_bytes(pickle.dumps((conversations, tokenize_s)))
    print(f"{len(conversations)} conversations, {sum(len(c) for c in conversations)} turns ({tokenize_s:.0f} s)", flush=True)
    rows = []
    for pool_tokens in args.pool_tokens:
        row = {"pool_tokens": pool_tokens,
               **run(conversations, pool_tokens, args.batch, args.conversations_in_flight, args.eviction_policy)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    first = rows[0]
    for row in rows:  # against the first pool, measured in the same run
        row["evict_ms_per_step_vs_first"] = (round(row["evict_ms_per_step_once_full"] / first["evict_ms_per_step_once_full"], 3)
                                             if first["evict_ms_per_step_once_full"] else None)
        row["cache_hit_vs_first"] = round(row["tokens"]["cache_hit"] / first["tokens"]["cache_hit"], 4)
    record = {
        "what": "SGLang's radix cache replaying the regeneration's requests, CPU only",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "sglang": sglang.__version__,
        "regenerated": str(args.regenerated),
        "conversations": len(conversations),
        "turns": sum(len(c) for c in conversations),
        "batch": args.batch,
        "conversations_in_flight": args.conversations_in_flight,
        "eviction_policy": args.eviction_policy,
        # Rendering and tokenizing every prompt once, one process: the chat route's work in
        # SGLang's HTTP process, the generate route's in the clients.
        "render_and_tokenize_s": round(tokenize_s, 1),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nbatch {args.batch}, {args.conversations_in_flight} conversations in flight; times on this machine")
    print("| KV pool tokens | full at step | evictions a step | leaves heapified (mean) | evict ms a step | vs first "
          "| cache-hit tokens | vs first | peak held by running |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['pool_tokens']:,} | {row['pool_full_at_step']} | {row['evictions_per_step_once_full']} "
              f"| {row['evictable_leaves_heapified']['mean']:,} | {row['evict_ms_per_step_once_full']} "
              f"| {row['evict_ms_per_step_vs_first']} | {row['tokens']['cache_hit']:,} | {row['cache_hit_vs_first']} "
              f"| {row['peak_tokens_held_by_running_requests']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
