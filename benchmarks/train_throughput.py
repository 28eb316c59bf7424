"""Drafter training throughput and MFU: the real training loop (eaglenest.stages.train.train) on random data.

For each shape it writes a random-weight target (config.json + model.safetensors holding only
the tied embedding/head and the final norm), random hidden shards through eaglenest.formats.shards,
consolidates them, and trains for a few steps with the real loader, loss and optimizer.
No model files are needed, so it runs on a machine without any.

FLOPs per token count what the step has to do (forward + backward; the frozen embedding has
no gradient, fc no input gradient): fc once, then per TTT step the q/k/v/o projections over
2H, the MLP, attention scores over the causal context (half the row on average) plus the
diagonal keys, and lm_head over the draft vocab at the positions that count. The target's
lm_head pass (soft labels and the in-draft-vocab test) is overhead and not counted.

With ``--ceiling`` each shape also runs the plain eager step it is measured against: the same
drafter weights unrolled ``ttt_length`` times over the same tokens with ordinary causal
attention (``scaled_dot_product_attention(is_causal=True)``, no TTT mask, no packing), a hard
cross-entropy over every position, no target head, fused AdamW. It does the same counted FLOPs
with the least a PyTorch step can do besides them; the table prints the ratio.

``--check`` (GPU) first compares the FlexAttention and dense TTT paths on one random batch in
float32: logits of every step and every weight's gradient; and the merge of the diagonal keys
as the GPU runs it (compiled, fused) against autograd through its plain ops.

    python benchmarks/train_throughput.py --shape smollm2 --shape kimi --ceiling --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest.stages import consolidate, train  # noqa: E402
from eaglenest.model import drafter, kernels
from eaglenest.model.flops import count_parameters, flops_per_token_step
from eaglenest.training import launch
from eaglenest.training.objective import TTTObjective
from eaglenest.formats import shards

SHAPES = {
    # SmolLM2-135M-Instruct: Llama, hidden 576, 9 heads / 3 kv heads, MLP 1536, vocab 49152.
    "smollm2": dict(
        target=dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5),
        drafter={}, draft_vocab=8192, layer_ids=[2, 15, 27],
    ),
    # Kimi-K2.5 (DeepSeek-V3 text backbone): hidden 7168, vocab 163,840; the drafter takes
    # 56 heads / 8 kv heads of 128 and an MLP of 18432 (train.drafter overrides).
    "kimi": dict(
        target=dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, head_dim=112,
                    intermediate_size=18432, vocab_size=163840, max_position_embeddings=262144,
                    rms_norm_eps=1e-6),
        drafter=dict(num_attention_heads=56, num_key_value_heads=8, head_dim=128), draft_vocab=32000,
        layer_ids=[2, 30, 58],
    ),
}


def write_target(path: Path, shape: dict, draft_rows: torch.Tensor, seed: int) -> None:
    """Random tied embedding/head; the draft-vocab rows are larger so that, as in a real run,
    most target argmaxes fall inside the draft vocab."""
    cfg = shape["target"]
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=generator) * 0.02
    embed[draft_rows] *= 3.0
    path.mkdir(parents=True, exist_ok=True)
    save_file({"model.embed_tokens.weight": embed.bfloat16(), "model.norm.weight": torch.ones(cfg["hidden_size"])},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "tie_word_embeddings": True}))


def write_shards(root: Path, shape: dict, samples: int, sample_len: int, per_shard: int, seed: int,
                 hidden_dtype: str = "bfloat16"):
    hidden = shape["target"]["hidden_size"]
    vocab_size = shape["target"]["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    hidden_paths, prepared_paths = [], []
    # Every sample is written: the last shard holds what is left (fewer samples than one shard
    # holds, e.g. 1 row of one 4,096-token sample for 4 steps, still makes a shard).
    for shard_id, first in enumerate(range(0, samples, per_shard)):
        count = min(per_shard, samples - first)
        rows = [{"sample_id": f"b:{shard_id}:{k}",
                 "input_ids": torch.randint(0, vocab_size, (sample_len,), generator=generator).tolist(),
                 "loss_mask": [1] * sample_len} for k in range(count)]
        name = shards.shard_name(shard_id)
        prepared = root / "prepared" / name
        shards.write_prepared_shard(prepared, shard_id, rows, {"target": "bench"})
        tokens = count * sample_len
        aux = torch.randn(tokens, 3 * hidden, generator=generator).bfloat16()
        last = torch.randn(tokens, hidden, generator=generator).bfloat16()
        meta = {"target": "bench", "target_hidden_size": hidden, "layer_ids": shape["layer_ids"], "dtype": hidden_dtype}
        scales = ()
        if hidden_dtype == shards.FP8_DTYPE:  # as extraction stores them: e4m3, a scale per token and layer
            (aux, aux_scale), (last, last_scale) = shards.quantize_rows(aux, 3), shards.quantize_rows(last, 1)
            scales = (aux_scale, last_scale)
        shards.write_hidden_shard(root / "hidden" / name, shards.ShardReader.open(prepared), aux, last, meta, *scales)
        hidden_paths.append(str(root / "hidden" / name))
        prepared_paths.append(str(prepared))
    return hidden_paths, prepared_paths


def write_consolidated(root: Path, shape: dict, args) -> tuple[Path, dict]:
    """Random shards of the shape for ``args.steps`` steps of ``args.rows`` rows of samples of
    ``args.sample_len``, consolidated with no validation split: (the consolidated folder, the
    metadata the shards are expected to carry)."""
    samples = args.steps * args.rows * (args.token_budget // args.sample_len)
    hidden_paths, prepared_paths = write_shards(root, shape, samples, args.sample_len, args.samples_per_shard, seed=2,
                                                hidden_dtype=args.hidden_dtype)
    out = root / "consolidated"
    expect = {"target": "bench", "layer_ids": shape["layer_ids"], "dtype": args.hidden_dtype}
    # Random ids would give a random draft vocab; bench_shape replaces it with the target's own.
    consolidate.consolidate(hidden_paths, prepared_paths, out / "index.json", out / "draft_vocab.safetensors",
                            out / "split.json", shape["target"]["vocab_size"], shape["draft_vocab"], expect,
                            val_fraction=0.0)
    return out, expect


def step_flops(config: drafter.DrafterConfig, record: dict, row_tokens: int) -> float:
    parts = flops_per_token_step(config)
    tokens = record["tokens"]
    q_width = config.num_attention_heads * config.head_dim
    total = 2 * parts["fc"] * tokens  # forward + weight gradient
    for j, positions in enumerate(record["positions"]):
        context = row_tokens / 2 + j  # causal half of the row + diagonal keys
        per_token = parts["attention_proj"] + parts["mlp"] + 4 * q_width * context
        total += 3 * per_token * tokens + 3 * parts["lm_head"] * positions
    return total


def matmul_ceiling(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3)


def bench_shape(name: str, args, device: torch.device, workdir: Path) -> list[dict]:
    """One random target and its shards for the shape; then eaglenest's step timed once per
    ``--processes`` count (1: in this process; more: under torchrun, DDP, the same global batch)."""
    shape = shape_of(name, args)
    root = workdir / name
    vocab_size = shape["target"]["vocab_size"]
    draft_ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(1))[: shape["draft_vocab"]]
    write_target(root / "target", shape, draft_ids, seed=0)
    began = time.perf_counter()
    out, expect = write_consolidated(root, shape, args)
    from eaglenest.formats import vocab

    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    chosen = t2d.nonzero().squeeze(-1)
    vocab.save_draft_vocab(out / "draft_vocab.safetensors", chosen - torch.arange(chosen.numel()), t2d,
                           torch.ones(vocab_size, dtype=torch.int64), {})
    split = json.loads((out / "split.json").read_text())
    split["val"] = split["train"][:1]  # validation needs one sample; it is not timed
    (out / "split.json").write_text(json.dumps(split))
    setup_seconds = time.perf_counter() - began
    settings = {
        "ttt_length": args.ttt_length, "epochs": 1, "token_budget": args.token_budget, "rows_per_step": args.rows,
        "lr": 1e-4, "warmup_steps": 1, "drafter": shape["drafter"], "device": device.type, "threads": args.threads,
        "log_every": 1, "checkpoint_every": 10**9, "init_head_from_target": True,
        **({"compile": True} if args.compile else {}), **({"attention": args.attention} if args.attention else {}),
        **({"recompute_steps": True} if args.recompute_steps else {}),
    }
    runs = []
    for processes in args.processes or [1]:
        arguments = {
            "index_path": str(out / "index.json"), "draft_vocab_path": str(out / "draft_vocab.safetensors"),
            "split_path": str(out / "split.json"), "target_path": str(root / "target"),
            "out_dir": str(root / f"drafter-{processes}"), "checkpoint_dir": str(root / f"checkpoints-{processes}"),
            "settings": settings, "target_name": "bench", "expect": expect,
        }
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        with profiled(args.profile and processes == 1, device) as profile:
            train.launch(arguments, processes=processes)
        run = timed_run(name, args, root / f"drafter-{processes}", processes, setup_seconds)
        if profile:
            run["profile"] = profile_table(profile)
        runs.append(run)
    return runs


def timed_run(name: str, args, drafter_dir: Path, processes: int, setup_seconds: float) -> dict:
    """The steady steps of a training run's curve: tokens/s (the global batch's), FLOPs, losses."""
    curve = json.loads((drafter_dir / "training_curve.json").read_text())
    summary = curve["summary"]
    saved = json.loads((drafter_dir / "config.json").read_text())
    config = drafter.DrafterConfig.from_dict({k: v for k, v in saved.items() if k in drafter.DrafterConfig.__dataclass_fields__})
    with torch.device("meta"):
        trainable = count_parameters(drafter.Eagle3Drafter(config))
    steady = curve["train"][args.warmup:]
    seconds = sum(r["seconds"] + r["data_wait_seconds"] for r in steady)
    tokens = sum(r["tokens"] for r in steady)
    flops = sum(step_flops(config, r, args.token_budget) for r in steady)
    result = {
        "shape": name, "device": summary["device"], "processes": processes, "ttt_length": args.ttt_length,
        "token_budget": args.token_budget, "rows_per_step": args.rows,
        "tokens_per_step": steady[0]["tokens"] if steady else None,
        "steps_timed": len(steady), "tokens_per_s": tokens / seconds, "model_tflops_per_s": flops / seconds / 1e12,
        "flops_per_token": flops / tokens, "data_wait_fraction": sum(r["data_wait_seconds"] for r in steady) / seconds,
        "counted_fraction_step0": steady[0]["positions"][0] / steady[0]["tokens"] if steady else None,
        "trainable_parameters": trainable,
        "setup_seconds": setup_seconds, "step_seconds": [round(r["seconds"], 4) for r in curve["train"]],
        "losses": [r["loss"] for r in curve["train"]],
        "summary_data_wait_fraction": summary["data_wait_fraction"],
    }
    if summary.get("peak_memory_gib") is not None:  # rank 0's, on a GPU
        result["peak_memory_gib"] = summary["peak_memory_gib"]
    return result


@contextmanager
def patched(owner, attribute: str, value):
    """``owner.attribute`` is ``value`` while the context lasts."""
    saved = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, saved)


@contextmanager
def profiled(enabled: bool, device: torch.device):
    """torch.profiler over the whole training call when ``enabled`` (its step times then
    include the profiler's own cost); yields the profiler or None."""
    if not enabled:
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        yield profile


def profile_table(profile, rows: int = 30) -> list[dict]:
    """The operators that took the most time, by self time: on a GPU only what ran on the
    device (kernels and copies), on a CPU the CPU time; name, calls, milliseconds, share."""
    events = profile.key_averages()

    def device_us(event):
        return max((getattr(event, name, 0) or 0) for name in ("self_device_time_total", "self_cuda_time_total"))

    timed = [(e, device_us(e)) for e in events]
    if any(us for _, us in timed):
        timed = [(e, us) for e, us in timed if us > 0]
    else:
        timed = [(e, e.self_cpu_time_total) for e in events]
    total = sum(us for _, us in timed) or 1
    ranked = sorted(timed, key=lambda pair: pair[1], reverse=True)[:rows]
    return [{"op": e.key, "calls": e.count, "ms": round(us / 1e3, 3), "share": round(us / total, 4)} for e, us in ranked]


def shape_of(name: str, args) -> dict:
    """SHAPES[name], with the draft vocabulary of ``--draft-vocab`` when given."""
    shape = dict(SHAPES[name])
    if getattr(args, "draft_vocab", None):
        shape["draft_vocab"] = args.draft_vocab
    return shape


def drafter_config(shape: dict) -> drafter.DrafterConfig:
    """The drafter eaglenest builds for the shape's target (as build_drafter sizes it)."""
    return drafter.DrafterConfig.from_target_config(shape["target"], shape["draft_vocab"], shape["layer_ids"],
                                                    **shape["drafter"])


def plain_layer(model: drafter.Eagle3Drafter, ids, hidden, positions):
    """The drafter's layer with ordinary causal attention (flash kernel, no TTT mask)."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    batch, length = ids.shape
    residual = hidden
    x = torch.cat([layer.input_layernorm(model.embed_tokens(ids).to(hidden.dtype)), layer.hidden_norm(hidden)], -1)
    q = attn.q_proj(x).view(batch, length, attn.heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(batch, length, attn.kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(batch, length, attn.kv_heads, attn.head_dim).transpose(1, 2)
    cos, sin = drafter.rotary_cos_sin(positions, attn.head_dim, attn.rope_theta, q.dtype)
    q, k = drafter.apply_rotary(q, cos, sin), drafter.apply_rotary(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=attn.heads != attn.kv_heads)
    residual = residual + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
    out = residual + layer.mlp(layer.post_attention_layernorm(residual))
    return model.norm(out), out


def ceiling_step(name: str, args, device: torch.device):
    """The plain eager step of the same shape and tokens (see the module docstring), ready to
    run: (step(), its FLOPs, tokens a step). step() takes an optional ``mark(phase)`` called as
    each phase is queued (benchmarks/train_step_anatomy.py)."""
    shape = shape_of(name, args)
    config = drafter_config(shape)
    torch.manual_seed(0)
    model = drafter.Eagle3Drafter(config).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    rows, length = args.rows, args.token_budget
    hidden_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    aux = torch.randn(rows, length, 3 * config.target_hidden_size, device=device, dtype=hidden_dtype)
    ids = torch.randint(0, config.vocab_size, (rows, length), device=device)
    labels = torch.randint(0, config.draft_vocab_size, (rows * length,), device=device)
    positions = torch.arange(length, device=device).expand(rows, length)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step(mark=lambda phase: None):
        mark("forward")
        with autocast:
            hidden = model.fc(aux)
            loss = 0.0
            for j in range(args.ttt_length):
                normed, hidden = plain_layer(model, ids, hidden, positions + j)
                loss = loss + F.cross_entropy(model.lm_head(normed).flatten(0, 1), labels)
        mark("backward")
        loss.backward()
        mark("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # as eaglenest's step: no gradients held through the forward pass
        mark("end")

    record = {"tokens": rows * length, "positions": [rows * length] * args.ttt_length}
    return step, step_flops(config, record, length), rows * length


def bench_ceiling(name: str, args, device: torch.device) -> dict:
    """The plain eager step of the same shape and tokens (see the module docstring), timed."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step, flops_per_step, tokens_per_step = ceiling_step(name, args, device)
    for _ in range(args.warmup):
        step()
    timed = max(1, args.steps - args.warmup)
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(timed):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    result = {"shape": name, "step": "ceiling (plain eager, causal flash attention, no TTT mask)",
              "tokens_per_step": tokens_per_step, "steps_timed": timed, "tokens_per_s": tokens_per_step * timed / seconds,
              "model_tflops_per_s": flops_per_step * timed / seconds / 1e12, "data_wait_fraction": 0.0}
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del step
    return result


def check_backends(device: torch.device) -> dict:
    """FlexAttention (compiled, on the GPU) against the dense path, float32: every step's
    logits and every gradient, on packed rows of uneven samples."""

    shape = SHAPES["smollm2"]
    config = drafter_config(shape)
    lengths = [700, 129, 1, 1218]
    length = sum(lengths)
    generator = torch.Generator().manual_seed(11)
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (1, length), generator=generator),
        "aux_hidden": torch.randn(1, length, 3 * config.target_hidden_size, generator=generator),
        "segment_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    weights = torch.randn(7, length, config.draft_vocab_size, generator=generator).to(device) * 1e-2
    runs = {}
    for backend, reference_merge in (("dense", False), ("flex", False), ("dense", True)):
        torch.manual_seed(0)
        model = drafter.Eagle3Drafter(config).to(device)
        objective = TTTObjective(model, 7, attention_backend=backend)
        # The merge of the diagonal keys as the GPU runs it (compiled, fused) or by autograd
        # through its plain ops, the tests' reference.
        merge = kernels.merge_diagonal_keys_autograd if reference_merge else kernels.merge_diagonal_keys
        with patched(kernels, "merge_diagonal_keys", merge):
            logits = [model.compute_logits(normed)[0] for _, normed in objective.unroll(batch)]
            sum((w * out).sum() for w, out in zip(weights, logits)).backward()
        runs[backend, reference_merge] = ([out.detach() for out in logits],
                                          {n: p.grad for n, p in model.named_parameters() if p.requires_grad})

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    def compare(got, expected):
        (got_logits, got_grads), (expected_logits, expected_grads) = runs[got], runs[expected]
        return {"logits_rel_err": [rel(g, e) for g, e in zip(got_logits, expected_logits)],
                "grad_rel_err": {n: rel(got_grads[n], expected_grads[n]) for n in expected_grads}}

    result = compare(("flex", False), ("dense", False))
    result["merge"] = compare(("dense", False), ("dense", True))
    result["max_rel_err"] = max(result["logits_rel_err"] + list(result["grad_rel_err"].values())
                                + result["merge"]["logits_rel_err"] + list(result["merge"]["grad_rel_err"].values()))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable; default smollm2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--sample-len", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--samples-per-shard", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--ceiling", action="store_true", help="also time the plain eager step of each shape")
    parser.add_argument("--check", action="store_true", help="first compare the flex and dense TTT paths (GPU)")
    parser.add_argument("--compile", action="store_true", help="train.compile: torch.compile the drafter layer")
    parser.add_argument("--attention", choices=["auto", "dense", "flex"], help="train.attention (default auto)")
    parser.add_argument("--recompute-steps", action="store_true",
                        help="train.recompute_steps: recompute each TTT step's activations in the backward pass")
    parser.add_argument("--hidden-dtype", choices=["bfloat16", "float8_e4m3"], default="bfloat16",
                        help="storage dtype of the random hidden shards (extract.dtype; the H200 configs use fp8)")
    parser.add_argument("--draft-vocab", type=int,
                        help="consolidate.draft_vocab_size (default: the shape's; config/h200-smollm2.yaml trains 32000)")
    parser.add_argument("--profile", action="store_true",
                        help="record the operators' device time over the run (torch.profiler; slows the steps)")
    parser.add_argument("--processes", type=int, action="append",
                        help="repeatable: time eaglenest's step with this many DDP processes (torchrun; GPUs on a "
                             "GPU node, gloo workers on a CPU), each at the same global batch; default 1")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = launch.resolve_device(args.device, 0)
    results = {
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": {"platform": platform.platform(), "torch": torch.__version__, "cpu_threads": args.threads,
                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "matmul_bf16_tflops": (lambda r: r / 1e12 if r else None)(matmul_ceiling(device)),
        "runs": [],
    }
    results["settings"] = {"rows": args.rows, "hidden_dtype": args.hidden_dtype, "token_budget": args.token_budget,
                           "sample_len": args.sample_len,
                           "ttt_length": args.ttt_length, "compile": args.compile, "attention": args.attention or "auto",
                           "recompute_steps": args.recompute_steps, "profile": args.profile,
                           "draft_vocab": {name: shape_of(name, args)["draft_vocab"] for name in args.shape or ["smollm2"]}}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    def attempt(name, work):
        try:
            results["runs"].extend(work())
        except Exception as exc:  # keep the other shapes' numbers
            results["runs"].append({"shape": name, "error": f"{type(exc).__name__}: {exc}"})
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.check:
        try:
            results["backend_check"] = check_backends(device)
        except Exception as exc:
            results["backend_check"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.shape or ["smollm2"]:
            attempt(name, lambda: bench_shape(name, args, device, Path(workdir)))
            if args.ceiling:
                attempt(name, lambda: [bench_ceiling(name, args, device)])
    print_table(results)
    save()  # with the ratios print_table adds


def print_table(results: dict) -> None:
    ceiling = results["matmul_bf16_tflops"]
    if "backend_check" in results:
        print("flex vs dense (float32):", json.dumps(results["backend_check"].get("max_rel_err",
                                                                                results["backend_check"])))
    print(f"{'shape':8} {'step':12} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'wait':>6} {'peak GiB':>8} {'x ceiling':>9} "
          f"{'x 1 proc':>8} {'loss vs 1':>9}")
    eaglenest_runs, one_process = {}, {}
    for run in results["runs"]:
        if "error" in run:
            print(f"{run['shape']:8} ERROR {run['error']}")
            continue
        kind = "ceiling" if "ceiling" in run.get("step", "") else "eaglenest"
        processes = run.get("processes", 1)
        # MFU of the GPUs the step ran on: the model FLOP rate over the ceiling of that many.
        mfu = f"{run['model_tflops_per_s'] / (ceiling * processes):.1%}" if ceiling else "-"
        ratio, scaling, loss_gap = "", "", ""
        if kind == "eaglenest":
            if processes == 1:
                eaglenest_runs[run["shape"]] = one_process[run["shape"]] = run
            elif run["shape"] in one_process:
                # The same data, initial weights and global batch: the curves must agree.
                base = one_process[run["shape"]]
                run["tokens_per_s_over_one_process"] = run["tokens_per_s"] / base["tokens_per_s"]
                run["loss_max_rel_diff_vs_one_process"] = max(
                    abs(a - b) / max(abs(b), 1e-12) for a, b in zip(run["losses"], base["losses"]))
                scaling = f"{run['tokens_per_s_over_one_process']:.2f}"
                loss_gap = f"{run['loss_max_rel_diff_vs_one_process']:.1e}"
        elif run["shape"] in eaglenest_runs:
            ratio = f"{eaglenest_runs[run['shape']]['tokens_per_s'] / run['tokens_per_s']:.2f}"
            run["eaglenest_over_ceiling"] = float(ratio)
        peak = f"{run['peak_memory_gib']:.1f}" if "peak_memory_gib" in run else "-"
        step = kind if kind == "ceiling" else f"{kind} x{processes}"
        print(f"{run['shape']:8} {step:12} {run['tokens_per_s']:10.0f} {run['model_tflops_per_s']:8.1f} {mfu:>6} "
              f"{run['data_wait_fraction']:6.1%} {peak:>8} {ratio:>9} {scaling:>8} {loss_gap:>9}")


if __name__ == "__main__":
    main()
