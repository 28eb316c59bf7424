"""Drafter training throughput and MFU: the real training loop (eaglenest.train.train) on random data.

For each shape it writes a random-weight target (config.json + model.safetensors holding only
the tied embedding/head and the final norm), random hidden shards through eaglenest.shards,
consolidates them, and trains for a few steps with the real loader, loss and optimizer.
No model files are needed, so it runs on a machine without any.

FLOPs per token count what the step has to do (forward + backward; the frozen embedding has
no gradient, fc no input gradient): fc once, then per TTT step the q/k/v/o projections over
2H, the MLP, attention scores over the causal context (half the row on average) plus the
diagonal keys, and lm_head over the draft vocab at the positions that count. The target's
lm_head pass (soft labels and the in-draft-vocab test) is overhead and not counted.

    python benchmarks/train_throughput.py --shape smollm2 --shape kimi --out benchmarks/x.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest import consolidate, drafter, shards, train  # noqa: E402

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


def write_shards(root: Path, shape: dict, samples: int, sample_len: int, per_shard: int, seed: int):
    hidden = shape["target"]["hidden_size"]
    vocab_size = shape["target"]["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    hidden_paths, prepared_paths = [], []
    for shard_id in range(0, samples // per_shard):
        rows = [{"sample_id": f"b:{shard_id}:{k}",
                 "input_ids": torch.randint(0, vocab_size, (sample_len,), generator=generator).tolist(),
                 "loss_mask": [1] * sample_len} for k in range(per_shard)]
        name = shards.shard_name(shard_id)
        prepared = root / "prepared" / name
        shards.write_prepared_shard(prepared, shard_id, rows, {"target": "bench"})
        tokens = per_shard * sample_len
        aux = torch.randn(tokens, 3 * hidden, generator=generator).bfloat16()
        last = torch.randn(tokens, hidden, generator=generator).bfloat16()
        meta = {"target": "bench", "target_hidden_size": hidden, "layer_ids": shape["layer_ids"], "dtype": "bfloat16"}
        shards.write_hidden_shard(root / "hidden" / name, shards.ShardReader.open(prepared), aux, last, meta)
        hidden_paths.append(str(root / "hidden" / name))
        prepared_paths.append(str(prepared))
    return hidden_paths, prepared_paths


def step_flops(config: drafter.DrafterConfig, record: dict, row_tokens: int) -> float:
    parts = drafter.flops_per_token_step(config)
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


def bench_shape(name: str, args, device: torch.device, workdir: Path) -> dict:
    shape = SHAPES[name]
    root = workdir / name
    vocab_size = shape["target"]["vocab_size"]
    draft_ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(1))[: shape["draft_vocab"]]
    write_target(root / "target", shape, draft_ids, seed=0)
    began = time.perf_counter()
    samples = args.steps * args.rows * (args.token_budget // args.sample_len)
    hidden_paths, prepared_paths = write_shards(root, shape, samples, args.sample_len, args.samples_per_shard, seed=2)
    out = root / "consolidated"
    expect = {"target": "bench", "layer_ids": shape["layer_ids"], "dtype": "bfloat16"}
    # Random ids would give a random draft vocab; consolidate counts them, then we keep ours.
    consolidate.consolidate(hidden_paths, prepared_paths, out / "index.json", out / "draft_vocab.safetensors",
                            out / "split.json", vocab_size, shape["draft_vocab"], expect, val_fraction=0.0)
    from eaglenest import vocab

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
        "lr": 1e-4, "warmup_steps": 1, "drafter": shape["drafter"], "device": str(device), "threads": args.threads,
        "log_every": 1, "checkpoint_every": 10**9, "init_head_from_target": True,
    }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    summary = train.train(
        str(out / "index.json"), str(out / "draft_vocab.safetensors"), str(out / "split.json"), str(root / "target"),
        str(root / "drafter"), str(root / "checkpoints"), settings=settings, target_name="bench", expect=expect,
    )
    curve = json.loads((root / "drafter" / "training_curve.json").read_text())
    saved = json.loads((root / "drafter" / "config.json").read_text())
    config = drafter.DrafterConfig.from_dict({k: v for k, v in saved.items() if k in drafter.DrafterConfig.__dataclass_fields__})
    with torch.device("meta"):
        trainable = drafter.count_parameters(drafter.Eagle3Drafter(config))
    steady = curve["train"][args.warmup:]
    seconds = sum(r["seconds"] + r["data_wait_seconds"] for r in steady)
    tokens = sum(r["tokens"] for r in steady)
    flops = sum(step_flops(config, r, args.token_budget) for r in steady)
    result = {
        "shape": name, "device": str(device), "ttt_length": args.ttt_length, "token_budget": args.token_budget,
        "rows_per_step": args.rows, "tokens_per_step": steady[0]["tokens"] if steady else None,
        "steps_timed": len(steady), "tokens_per_s": tokens / seconds, "model_tflops_per_s": flops / seconds / 1e12,
        "flops_per_token": flops / tokens, "data_wait_fraction": sum(r["data_wait_seconds"] for r in steady) / seconds,
        "counted_fraction_step0": steady[0]["positions"][0] / steady[0]["tokens"] if steady else None,
        "trainable_parameters": trainable,
        "setup_seconds": setup_seconds, "step_seconds": [round(r["seconds"], 4) for r in curve["train"]],
        "summary_data_wait_fraction": summary["data_wait_fraction"],
    }
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
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
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = train.resolve_device(args.device, 0)
    results = {
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": {"platform": platform.platform(), "torch": torch.__version__, "cpu_threads": args.threads,
                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "matmul_bf16_tflops": (lambda r: r / 1e12 if r else None)(matmul_ceiling(device)),
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.shape or ["smollm2"]:
            try:
                results["runs"].append(bench_shape(name, args, device, Path(workdir)))
            except Exception as exc:  # keep the other shapes' numbers
                results["runs"].append({"shape": name, "error": f"{type(exc).__name__}: {exc}"})
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    ceiling = results["matmul_bf16_tflops"]
    print(f"{'shape':8} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'wait':>6}")
    for run in results["runs"]:
        if "error" in run:
            print(f"{run['shape']:8} ERROR {run['error']}")
            continue
        mfu = f"{run['model_tflops_per_s'] / ceiling:.1%}" if ceiling else "-"
        print(f"{run['shape']:8} {run['tokens_per_s']:10.0f} {run['model_tflops_per_s']:8.1f} {mfu:>6} "
              f"{run['data_wait_fraction']:6.1%}")


if __name__ == "__main__":
    main()
