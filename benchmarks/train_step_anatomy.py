"""Where a drafter training step's time goes: eaglenest's step
(``eaglenest.training.loop.train_step``, the one ``eaglenest.stages.train`` runs) phase by
phase, beside the plain eager ceiling step of ``train_throughput.py``, with the step's parts
taken out one at a time, and a profile of the kernels of both steps by kind.

The step runs on a random batch of the shape (the rows of ``--rows`` x ``--token-budget``
tokens, samples of ``--sample-len``), with the real target head (a random-weight target written
as train_throughput.py writes it), the TTT objective, the one-pass loss, gradient clipping and
fused AdamW. Every figure is a mean over ``--steps`` steps after ``--warmup``:

- phases: the time between the marks ``train_step`` sets as it queues each phase (to device,
  target head, forward, backward, clip, optimizer), read from CUDA events on the GPU (the
  device's time, including any time it waited for the host) and from the clock on a CPU. The
  batches come as in the training loop (eaglenest.training.batches.DeviceBatches: the next one
  copied beside a step's clipping and optimizer), so "to device" is the time the step waited for its copy;
- ablations: the whole step again with one part taken out (each row says which; the
  difference to the whole step is what that part costs). These steps compute something else:
  they are timings, never trained drafters;
- kernels (GPU): the device time of the kernels of a profiled step (torch.profiler), by kind
  (matrix products, attention, copies and casts, elementwise, reductions, ...), and the top
  kernels; the device's busy share of the step's wall time says how far the host holds it back.

    python benchmarks/train_step_anatomy.py --shape kimi --rows 1 --token-budget 4096 --sample-len 4096 \\
        --out benchmarks/results/train_step_anatomy_h200_kimi.json
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_throughput  # noqa: E402  (the shapes, the random target and the ceiling step)
from eaglenest.formats import shards  # noqa: E402
from eaglenest.model import context_attention, drafter, kernels  # noqa: E402
from eaglenest.stages import train  # noqa: E402
from eaglenest.training import launch, loop  # noqa: E402
from eaglenest.training.batches import DeviceBatches, hidden_dtype_on  # noqa: E402
from eaglenest.training.objective import TTTObjective, compile_drafter  # noqa: E402
from eaglenest.training.target_head import TargetHead  # noqa: E402

# Kernel kinds by name, first match wins (attention before the Triton kernels that implement it).
KERNEL_KINDS = [
    ("attention", ("flex_attention", "flash", "fmha", "attention")),
    ("matrix products", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "ampere_",
                         "aten::mm", "aten::bmm", "aten::addmm")),
    ("host/device copies", ("memcpy", "memset")),
    ("copies and casts", ("copy", "catarray", "cat_", "gather", "scatter", "index")),
    ("reductions", ("reduce", "softmax", "logsumexp", "norm", "argmax", "sum")),
    ("fused (Triton)", ("triton",)),
    ("elementwise", ("elementwise",)),
]


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


class PhaseClock:
    """``mark(phase)`` ends the phase before and starts ``phase``; the time each phase took, on
    the device's stream (CUDA events) or the host's clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, phase: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((phase, event))
        else:
            self.marks.append((phase, time.perf_counter()))

    def seconds(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        spent: dict[str, float] = collections.defaultdict(float)
        for (phase, began), (_, ended) in zip(self.marks, self.marks[1:]):
            if phase == "end":
                continue
            spent[phase] += began.elapsed_time(ended) / 1e3 if self.cuda else ended - began
        return dict(spent)


def random_batch(shape: dict, args, generator: torch.Generator) -> dict:
    """A loader batch of the shape on the host (pinned where a GPU will read it): packed samples
    of ``--sample-len``, every token an assistant token, random hidden states."""
    rows, length = args.rows, args.token_budget
    target = shape["target"]
    position = torch.arange(length) % args.sample_len
    batch = {
        "input_ids": torch.randint(0, target["vocab_size"], (rows, length), generator=generator),
        "segment_ids": (torch.arange(length) // args.sample_len).repeat(rows, 1),
        "position_ids": position.repeat(rows, 1),
        "loss_mask": torch.ones(rows, length, dtype=torch.bool),
        "aux_hidden": torch.randn(rows, length, 3 * target["hidden_size"], generator=generator).bfloat16(),
        "last_hidden": torch.randn(rows, length, target["hidden_size"], generator=generator).bfloat16(),
        # Which sample each token is, on the device and on the host, as RowReader gives them
        "sample_index": (torch.arange(rows).unsqueeze(1) * (length // args.sample_len)
                         + torch.arange(length) // args.sample_len),
        "samples": tuple(range(rows * (length // args.sample_len))),
    }
    if args.hidden_dtype == shards.FP8_DTYPE:  # as the loader keeps extraction's fp8 rows: values and scales
        for name, layers in (("aux_hidden", 3), ("last_hidden", 1)):
            values, scale = shards.quantize_rows(batch[name].flatten(0, 1), layers)
            batch[name] = values.view(rows, length, -1)
            batch[shards.SCALE_TENSORS[name]] = scale.view(rows, length, -1)
    return batch


def _reused_target_head(head):
    """The target head run once: later steps reuse its soft labels (no product at all)."""
    kept = {}

    def reuse(last_hidden, in_draft=None):
        if "out" not in kept:
            kept["out"] = head(last_hidden, in_draft)
        return kept["out"]

    return reuse


def _later_epoch_target_head(head):
    """The target head as a later epoch runs it: the in-draft test known
    (eaglenest.training.target_head.InDraftCache),
    only the draft block's product."""
    kept = {}

    def later(last_hidden, in_draft=None):
        if "in_draft" not in kept:
            kept["in_draft"] = head(last_hidden)[1]
        return head(last_hidden, kept["in_draft"])

    return later


def _sdpa_context(cache, q, group):
    """The context attention of the ceiling step (SDPA, causal, no packing) with a log-sum-exp
    of zeros: its kernel time in place of FlexAttention's."""
    out = F.scaled_dot_product_attention(q, cache.context_k, cache.context_v, is_causal=True, enable_gqa=group > 1)
    return out, q.new_zeros(q.shape[:-1], dtype=torch.float32)


# Each part taken out: a function of the target head giving the head the step runs instead, or a
# context manager factory patching the part while the step runs.
ABLATIONS = {
    "without the target head (its soft labels reused)": _reused_target_head,
    "the target head of a later epoch (the in-draft test known: its draft block only)": _later_epoch_target_head,
    "without the merge of the diagonal keys (context attention's output as is)":
        lambda: train_throughput.patched(kernels, "merge_diagonal_keys", lambda out, lse, q, k, v, group: out),
    "context attention by SDPA's causal kernel instead of FlexAttention (no log-sum-exp)":
        lambda: train_throughput.patched(context_attention.TTTCache, "attend_context", _sdpa_context),
    "without gradient clipping":
        lambda: train_throughput.patched(torch.nn.utils, "clip_grad_norm_",
                                         lambda params, max_norm: torch.zeros((), device="cpu")),
}


# Parts inside the drafter's layer, which train.compile compiles: with --compile these are left out.
INSIDE_THE_LAYER = {label for label in ABLATIONS if "merge" in label or "FlexAttention" in label}


def run_steps(step, count: int, device: torch.device) -> tuple[float, list[dict]]:
    """Wall seconds a step over ``count`` steps, and each step's phase times."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    clocks = []
    for _ in range(count):
        clock = PhaseClock(device)
        step(clock.mark)
        clocks.append(clock)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = (time.perf_counter() - began) / count
    phases = [clock.seconds() for clock in clocks]
    return wall, phases


def mean_phases(phases: list[dict]) -> dict[str, float]:
    names = list(dict.fromkeys(name for p in phases for name in p))
    return {name: sum(p.get(name, 0.0) for p in phases) / len(phases) for name in names}


def kernel_profile(step, count: int, device: torch.device, top: int) -> dict:
    """The device time of a step's kernels by kind and the top kernels (GPU), or the host time
    of its operators (CPU), over ``count`` profiled steps."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(count):
            step(lambda phase: None)
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - began) / count
    by_kernel: dict[str, list] = {}
    for event in profile.key_averages():
        if device.type == "cuda":
            if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = max((getattr(event, name, 0) or 0) for name in ("self_device_time_total", "self_cuda_time_total"))
        else:
            us = event.self_cpu_time_total
        if us > 0:
            by_kernel[event.key] = [event.count, us]
    busy = sum(us for _, us in by_kernel.values()) / 1e6 / count
    kinds: dict[str, float] = collections.Counter()
    for name, (_, us) in by_kernel.items():
        kinds[kernel_kind(name)] += us / 1e6 / count
    ranked = sorted(by_kernel.items(), key=lambda item: -item[1][1])[:top]
    return {
        "profiled_steps": count, "wall_seconds_per_step": wall, "busy_seconds_per_step": busy,
        "busy_fraction": busy / wall if wall else None,
        "seconds_per_step_by_kind": dict(sorted(kinds.items(), key=lambda item: -item[1])),
        "top": [{"kernel": name[:160], "kind": kernel_kind(name), "calls_per_step": calls / count,
                 "ms_per_step": us / 1e3 / count} for name, (calls, us) in ranked],
    }


def anatomy(name: str, args, device: torch.device, workdir: Path) -> dict:
    shape = train_throughput.shape_of(name, args)
    vocab_size = shape["target"]["vocab_size"]
    draft_ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(1))[: shape["draft_vocab"]]
    train_throughput.write_target(workdir / "target", shape, draft_ids, seed=0)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    hidden_dtype = hidden_dtype_on(device)
    head = TargetHead(workdir / "target", t2d, device, hidden_dtype)
    config = train_throughput.drafter_config(shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = drafter.Eagle3Drafter(config)
    model.embed_tokens.weight.data = model.embed_tokens.weight.data.to(torch.bfloat16)  # as the target stores it
    settings = train.DEFAULTS
    objective = TTTObjective(model, args.ttt_length, settings["loss_chunk_rows"], settings["attention"],
                             args.recompute_steps)
    if args.compile and device.type == "cuda":
        compile_drafter(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    host_batch = random_batch(shape, args, torch.Generator().manual_seed(2))
    if device.type == "cuda":
        host_batch = {key: value.pin_memory() if torch.is_tensor(value) else value for key, value in host_batch.items()}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    decay = [0.8**j for j in range(args.ttt_length)]
    tokens = args.rows * args.token_budget

    def endless():
        step = 0
        while True:
            yield step, 0, {**host_batch, "tokens": torch.tensor(tokens)}
            step += 1

    # As the training loop: the next batch's copy starts once a step's backward pass is queued.
    batches = DeviceBatches(endless(), device, hidden_dtype)

    def step(mark, target_head=head):
        mark("to device")
        _, _, batch, local_tokens = next(batches)
        loop.train_step(objective, target_head, batch, local_tokens, decay, trainable, optimizer,
                        settings["max_grad_norm"], autocast, mark, after_backward=batches.prefetch)

    def timed(work) -> dict:
        for _ in range(args.warmup):
            work(lambda phase: None)
        wall, phases = run_steps(work, args.steps, device)
        return {"wall_seconds_per_step": wall, "tokens_per_s": tokens / wall, "phase_seconds": mean_phases(phases)}

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = {"shape": name, "tokens_per_step": tokens, "eaglenest": timed(step)}
    if device.type == "cuda":
        result["eaglenest"]["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    result["ablations"] = {}
    for label, ablation in ({} if args.no_ablations else ABLATIONS).items():
        if args.compile and label in INSIDE_THE_LAYER:  # a patch there would recompile the layer's graphs
            continue
        if ablation in (_reused_target_head, _later_epoch_target_head):
            other_head = ablation(head)
            run = timed(lambda mark: step(mark, other_head))
        else:
            with ablation():
                run = timed(step)
        run["saves_seconds_per_step"] = result["eaglenest"]["wall_seconds_per_step"] - run["wall_seconds_per_step"]
        result["ablations"][label] = run
    if not args.no_profile:
        result["eaglenest"]["kernels"] = kernel_profile(step, args.profile_steps, device, args.top)
    del objective, optimizer, model, head, trainable
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.no_ceiling:
        return result
    ceiling, _, _ = train_throughput.ceiling_step(name, args, device)
    result["ceiling"] = timed(ceiling)
    if not args.no_profile:
        result["ceiling"]["kernels"] = kernel_profile(ceiling, args.profile_steps, device, args.top)
    result["eaglenest_over_ceiling"] = (result["ceiling"]["wall_seconds_per_step"]
                                        / result["eaglenest"]["wall_seconds_per_step"])
    return result


def print_result(result: dict) -> None:
    ms = 1e3
    ours, ceiling = result["eaglenest"], result.get("ceiling", {"phase_seconds": {}})
    peak = f", peak {ours['peak_memory_gib']:.2f} GiB" if "peak_memory_gib" in ours else ""
    print(f"{result['shape']}: {result['tokens_per_step']} tokens a step; eaglenest {ours['wall_seconds_per_step'] * ms:.1f} ms "
          f"({ours['tokens_per_s']:.0f} tok/s{peak})" + ("" if "eaglenest_over_ceiling" not in result else
          f", ceiling {ceiling['wall_seconds_per_step'] * ms:.1f} ms ({ceiling['tokens_per_s']:.0f} tok/s): "
          f"{result['eaglenest_over_ceiling']:.3f} of the ceiling"))
    print(f"  {'phase':<14} {'eaglenest ms':>12} {'ceiling ms':>10}")
    for phase in dict.fromkeys([*ours["phase_seconds"], *ceiling["phase_seconds"]]):
        print(f"  {phase:<14} {ours['phase_seconds'].get(phase, 0) * ms:12.2f} {ceiling['phase_seconds'].get(phase, 0) * ms:10.2f}")
    print(f"  {'ablation':<84} {'ms':>8} {'saves ms':>8}")
    for label, run in result["ablations"].items():
        print(f"  {label:<84} {run['wall_seconds_per_step'] * ms:8.1f} {run['saves_seconds_per_step'] * ms:8.1f}")
    if "kernels" in ours and "kernels" in ceiling:
        kinds = dict.fromkeys([*ours["kernels"]["seconds_per_step_by_kind"], *ceiling["kernels"]["seconds_per_step_by_kind"]])
        print(f"  {'kernels by kind':<20} {'eaglenest ms':>12} {'ceiling ms':>10}   (busy: "
              f"{ours['kernels']['busy_fraction']:.1%} / {ceiling['kernels']['busy_fraction']:.1%} of the step)")
        for kind in kinds:
            print(f"  {kind:<20} {ours['kernels']['seconds_per_step_by_kind'].get(kind, 0) * ms:12.2f} "
                  f"{ceiling['kernels']['seconds_per_step_by_kind'].get(kind, 0) * ms:10.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", choices=sorted(train_throughput.SHAPES), help="repeatable; default smollm2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--token-budget", type=int, default=4096, help="tokens a row")
    parser.add_argument("--sample-len", type=int, default=1024)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-ablations", action="store_true")
    parser.add_argument("--no-ceiling", action="store_true", help="eaglenest's step alone (its peak memory: --rows 8)")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    parser.add_argument("--compile", action="store_true", help="train.compile")
    parser.add_argument("--recompute-steps", action="store_true", help="train.recompute_steps")
    parser.add_argument("--hidden-dtype", choices=["bfloat16", shards.FP8_DTYPE], default="bfloat16")
    parser.add_argument("--draft-vocab", type=int, help="the draft vocabulary (default: the shape's)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = launch.resolve_device(args.device, 0)
    results = {
        "command": " ".join(["benchmarks/train_step_anatomy.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": {"platform": platform.platform(), "torch": torch.__version__, "cpu_threads": args.threads,
                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "runs": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.shape or ["smollm2"]:
            try:
                result = anatomy(name, args, device, Path(workdir) / name)
                print_result(result)
            except Exception as exc:  # keep the other shapes' numbers
                result = {"shape": name, "error": f"{type(exc).__name__}: {exc}"}
                print(f"{name}: ERROR {result['error']}")
            results["runs"].append(result)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
