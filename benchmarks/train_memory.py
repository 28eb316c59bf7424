"""Peak GPU memory of one drafter training step, modelled on the CPU, with what fills it.

The step of eaglenest.stages.train (the target head's soft labels, the TTT unroll of
TTTObjective, the one-pass loss, backward, fused AdamW, bf16 autocast) runs under fake tensors:
nothing is allocated and no GPU is needed, but every tensor the step makes has its real shape
and dtype. Each storage is counted from the op that makes it until the last reference to it
goes, and the breakdown at the peak names the phase, the drafter module (forward pass), the op
and the last dimension of what is live: the answer to "what fills the memory" that a GPU's
allocator statistics do not give. It also counts the step's operators (views left out) by phase
and, in the forward pass, by module: about the kernels an eager GPU step launches, each with
its host-side cost whatever its size.

What stands in for the GPU step:
- FlexAttention's compiled kernel is an autograd function that returns its outputs' shapes and
  keeps what a fused attention kernel keeps for its backward pass (q, k, v, the output and the
  log-sum-exp; no [T, T] scores); its block mask is not built (compiled, it is a few MB).
- autocast is the CPU's bf16 autocast, and the loss runs in autocast's dtype, as on a GPU.
Not counted: the CUDA caching allocator's slack and fragmentation, cuBLAS workspaces, the CUDA
context. The H200 measurements this was checked against are in docs/performance.md.

    python benchmarks/train_memory.py --shape kimi --rows 1 --token-budget 4096 --out benchmarks/results/x.json
    python benchmarks/train_memory.py --shape kimi --rows 8 --token-budget 4096 --recompute-steps --out ...
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import time
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_throughput  # noqa: E402  (the shapes and the drafter config of the throughput benchmark)
from eaglenest.model import context_attention, drafter  # noqa: E402
from eaglenest.training import draft_loss  # noqa: E402
from eaglenest.training.objective import TTTObjective  # noqa: E402

GIB = 2**30


class FusedAttentionShapes(torch.autograd.Function):
    """A fused causal attention kernel as far as memory goes: outputs of the right shapes, and
    the tensors such a kernel saves for its backward pass."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class LiveStorages(TorchDispatchMode):
    """Bytes of every storage an op makes, while it lives; the live set's breakdown at the peak."""

    def __init__(self, module_stack: list[str]):
        super().__init__()
        self.module_stack = module_stack
        self.phase = "setup"
        self.live: dict[int, tuple[tuple[str, str, str, str], int]] = {}
        self.refs: list[weakref.ref] = []
        self.total = self.peak = 0
        self.peak_phase = ""
        self.at_peak: dict[tuple[str, str, str, str], int] = {}
        # Operators other than views, by (phase, module): what an eager GPU step launches, about.
        self.operators: collections.Counter = collections.Counter()

    def _count(self, func, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.live:  # a view, or an op that wrote in place
            return
        module = self.module_stack[-1] if self.phase == "forward" and self.module_stack else ""
        label = (self.phase, module, f"{func.overloadpacket.__name__} [..., {tensor.shape[-1] if tensor.dim() else 1}]",
                 str(tensor.dtype).removeprefix("torch."))
        self.live[key] = (label, storage.nbytes())
        self.total += storage.nbytes()

        def released(_, key=key):
            label_bytes = self.live.pop(key, None)
            if label_bytes is not None:
                self.total -= label_bytes[1]

        self.refs.append(weakref.ref(storage, released))
        if self.total > self.peak:
            self.peak, self.peak_phase = self.total, self.phase
            breakdown = collections.Counter()
            for label, nbytes in self.live.values():
                breakdown[label] += nbytes
            self.at_peak = dict(breakdown)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and not func.is_view:  # not the device and size queries
            module = self.module_stack[-1] if self.phase == "forward" and self.module_stack else ""
            self.operators[(self.phase, module)] += 1
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._count(func, item)
        return out


def model_step(shape: dict, rows: int, row_tokens: int, ttt_length: int, recompute_steps: bool, steps: int = 2,
               embedding_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Run ``steps`` training steps of ``rows`` full rows under fake tensors; the peak and its breakdown.
    ``embedding_dtype``: the dtype the target stores its embedding in, which build_drafter keeps
    for the frozen copy when it is a half precision (Kimi-K2.5's: bf16)."""
    config = train_throughput.drafter_config(shape)
    tokens = rows * row_tokens
    module_stack: list[str] = []
    names: dict[int, str] = {}
    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: module_stack.append(names.get(id(module), type(module).__name__))),
        torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: module_stack.pop() and None),
    ]
    saved = context_attention.flex_context_attention, context_attention.segment_block_mask, draft_loss._compute_dtype
    context_attention.flex_context_attention = lambda q, k, v, block_mask: FusedAttentionShapes.apply(q, k, v)
    context_attention.segment_block_mask = lambda segment_ids: None
    draft_loss._compute_dtype = lambda t: torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else t.dtype
    counter = LiveStorages(module_stack)
    try:
        with FakeTensorMode(), counter:
            model = drafter.Eagle3Drafter(config)  # float32 weights, the embedding frozen: as _train has them
            if embedding_dtype in (torch.bfloat16, torch.float16):  # as build_drafter keeps a half-precision target's
                model.embed_tokens.weight = torch.nn.Parameter(
                    torch.empty(config.vocab_size, config.hidden_size, dtype=embedding_dtype), requires_grad=False)
            names.update({id(module): name or "drafter" for name, module in model.named_modules()})
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
            objective = TTTObjective(model, ttt_length, attention_backend="flex", recompute_steps=recompute_steps)
            # The target's head in the hidden states' dtype (TargetHead on a GPU), and a step's rows.
            target_head = torch.empty(config.vocab_size, config.target_hidden_size, dtype=torch.bfloat16)
            batch = {
                "input_ids": torch.zeros(rows, row_tokens, dtype=torch.long),
                "segment_ids": torch.zeros(rows, row_tokens, dtype=torch.long),
                "position_ids": torch.arange(row_tokens).repeat(rows, 1),
                "loss_mask": torch.ones(rows, row_tokens, dtype=torch.bool),
                "aux_hidden": torch.empty(rows, row_tokens, 3 * config.target_hidden_size, dtype=torch.bfloat16),
            }
            # Every position counts at every step but the last few of the row: the most a step can hold.
            positions = [torch.arange(tokens - 2 - j) for j in range(ttt_length)]
            last_hidden = torch.empty(rows, row_tokens, config.target_hidden_size, dtype=torch.bfloat16)
            for step in range(steps):
                if step == steps - 1:  # the operators of the last step alone
                    counter.operators.clear()
                if step:
                    batch["aux_hidden"], last_hidden = upcoming
                    del upcoming
                counter.phase = "target head"
                # As TargetHead makes them: the draft rows' logits in one product, the other rows' a
                # chunk at a time for the in-draft test. The step's last hidden states are read by
                # the target's head, then dropped (as _train does).
                flat = last_hidden.flatten(0, 1)
                target_logits = flat @ target_head[: config.draft_vocab_size].T
                for chunk in flat.split(max(1, (1 << 26) // config.vocab_size)):
                    other = chunk @ target_head[config.draft_vocab_size:].T
                    del other
                del chunk, flat, last_hidden
                counter.phase = "forward"
                # Each step's weight in the loss, known before the forward pass, as _train passes them.
                step_weights = torch.stack([torch.tensor(0.8 ** j / max(len(p), 1), dtype=torch.float64)
                                            for j, p in enumerate(positions)])
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss, results = objective(batch, target_logits, positions, step_weights)
                counter.phase = "backward"
                loss.backward()
                # The next step's rows, copied to the device once the backward pass is queued
                # (DeviceBatches.prefetch): alive beside this step's clipping and optimizer.
                # This step's rows stay alive until the next step takes the place of its batch.
                counter.phase = "next batch"
                upcoming = (torch.empty_like(batch["aux_hidden"]),
                            torch.empty(rows, row_tokens, config.target_hidden_size, dtype=torch.bfloat16))
                torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                counter.phase = "optimizer"
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)  # where _train frees them
                del results, loss, target_logits
    finally:
        for hook in hooks:
            hook.remove()
        context_attention.flex_context_attention, context_attention.segment_block_mask, draft_loss._compute_dtype = saved
    by_phase = collections.Counter()
    for (phase, _, _, _), nbytes in counter.at_peak.items():
        by_phase[phase] += nbytes
    top = sorted(counter.at_peak.items(), key=lambda item: -item[1])
    operators = collections.Counter()
    for (phase, _), count in counter.operators.items():
        operators[phase] += count
    return {
        "rows": rows, "row_tokens": row_tokens, "tokens_per_step": tokens, "ttt_length": ttt_length,
        "recompute_steps": recompute_steps, "trainable_parameters": sum(p.numel() for p in trainable),
        "peak_gib": counter.peak / GIB, "peak_during": counter.peak_phase,
        "live_at_peak_gib_by_phase_made": {phase: nbytes / GIB for phase, nbytes in by_phase.most_common()},
        "live_at_peak": [{"made_in": phase, "module": module, "op": op, "dtype": dtype, "gib": nbytes / GIB}
                         for (phase, module, op, dtype), nbytes in top],
        "operators_per_step": dict(operators),
        "forward_operators_by_module": {module or "(none)": count for (phase, module), count
                                        in counter.operators.most_common() if phase == "forward"},
    }


def print_table(result: dict, shape_name: str, rows_shown: int) -> None:
    print(f"{shape_name}, {result['rows']} x {result['row_tokens']} tokens, TTT {result['ttt_length']}, "
          f"recompute_steps {result['recompute_steps']}: peak {result['peak_gib']:.2f} GiB (during {result['peak_during']})")
    print("  operators a step (views left out), by phase: " + ", ".join(
        f"{phase} {count}" for phase, count in result["operators_per_step"].items()))
    print("  live at the peak, by the phase that made it: " + ", ".join(
        f"{phase} {gib:.2f}" for phase, gib in result["live_at_peak_gib_by_phase_made"].items()))
    print(f"  {'GiB':>7}  {'made in':<11} {'module':<32} {'dtype':<9} op")
    for row in result["live_at_peak"][:rows_shown]:
        print(f"  {row['gib']:7.2f}  {row['made_in']:<11} {row['module']:<32} {row['dtype']:<9} {row['op']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", choices=sorted(train_throughput.SHAPES), help="repeatable; default kimi")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--token-budget", type=int, default=4096, help="tokens a row")
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--recompute-steps", action="store_true", help="train.recompute_steps")
    parser.add_argument("--draft-vocab", type=int, help="the draft vocabulary (default: the shape's)")
    parser.add_argument("--embedding-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the dtype the target stores its embedding in (Kimi-K2.5: bfloat16)")
    parser.add_argument("--show", type=int, default=20, help="rows of the breakdown printed")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    results = []
    for name in args.shape or ["kimi"]:
        started = time.perf_counter()
        result = model_step(train_throughput.shape_of(name, args), args.rows, args.token_budget, args.ttt_length,
                            args.recompute_steps, embedding_dtype=getattr(torch, args.embedding_dtype))
        result.update(shape=name, model_seconds=time.perf_counter() - started)
        print_table(result, name, args.show)
        results.append(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(["benchmarks/train_memory.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": {"platform": platform.platform(), "torch": torch.__version__},
        "runs": results,
    }, indent=1))


if __name__ == "__main__":
    main()
