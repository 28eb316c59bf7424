"""Extraction throughput against its two ceilings, in one process.

For each target shape (random weights built from a config, so nothing is downloaded):

(a) forward only: the base model over the same packed rows, no capture, no copies;
(b) our extraction end to end: prepared shard file in, published (fsynced) hidden shard
    file out through eaglenest.stages.extract.extract_shard, bf16 and fp8 storage, then a deep
    verification (untimed); plus the simple padded path for comparison;
(c) the naive path: ``output_hidden_states=True`` on padded length buckets with an
    attention mask and a plain ``.cpu()`` copy, as per-sample dump scripts do it;
(d) the output disk's sequential write bandwidth for shard-sized files, fsynced.

Sample lengths are drawn from ``sharegpt_token_counts.json`` (ShareGPT conversations
rendered with SmolLM2's chat template, untruncated; ``--make-lengths`` rebuilds it) and
cut at ``--max-len``. Prints a table and writes JSON (``--out``). ``--smoke`` runs a
small CPU configuration, as CI does.

    python benchmarks/extract_throughput.py --out benchmarks/results/h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from eaglenest.stages import extract
from eaglenest.formats import shards
from eaglenest.target_model import runtime as target_runtime
from eaglenest.target_model import layer_ids as layer_id_convention

HERE = Path(__file__).resolve().parent
LENGTHS_FILE = HERE / "sharegpt_token_counts.json"

SHAPES = {
    # SmolLM2-135M-Instruct's config.
    "smollm2-135m": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    # Llama-3.1-8B's config (dense; fits one GPU in bf16).
    "llama-3.1-8b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    # CI smoke size.
    "tiny": dict(
        hidden_size=64, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=320, max_position_embeddings=2048, tie_word_embeddings=True,
    ),
}


def make_lengths(count: int) -> None:
    """Token counts of the first ``count`` valid ShareGPT conversations (SmolLM2 template)."""
    from eaglenest.stages import ingest, prepare

    root = HERE.parent
    tokenizer = prepare.load_tokenizer(root / "resources/models/SmolLM2-135M-Instruct")
    source = root / "resources/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    counts = []
    for record in ingest.iter_source_records(source, {}):
        try:
            _, messages, _ = ingest.normalise(record, "drop_turn")
        except ingest.BadRecord:
            continue
        counts.append(len(tokenizer(prepare.render(tokenizer, messages, False))["input_ids"]))
        if len(counts) == count:
            break
    note = (
        f"token counts of the first {len(counts)} valid conversations of ShareGPT_V3_unfiltered_cleaned_split.json "
        "(normalised as eaglenest.stages.ingest does), rendered with SmolLM2-135M-Instruct's chat template, untruncated"
    )
    LENGTHS_FILE.write_text(json.dumps({"note": note, "token_counts": counts}) + "\n")


def sample_lengths(total_tokens: int, max_len: int, seed: int) -> list[int]:
    pool = json.loads(LENGTHS_FILE.read_text())["token_counts"]
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total_tokens:
        lengths.append(min(pool[int(torch.randint(len(pool), (1,), generator=generator))], max_len))
    return lengths


def write_prepared(path: Path, lengths: list[int], vocab: int, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    rows = [
        {"sample_id": f"bench:{i}", "input_ids": torch.randint(3, vocab, (n,), generator=generator).tolist(), "loss_mask": [1] * n}
        for i, n in enumerate(lengths)
    ]
    shards.write_prepared_shard(path, 0, rows, {"target": "bench"})
    return path


def build_model(shape: str, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape])
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def forward_only(model, prepared_path: Path, tokens_per_batch: int, device: str) -> dict:
    """Packed rows through the base model; nothing captured, nothing copied back."""
    reader = shards.ShardReader.open(prepared_path)
    counts, ids = reader.token_counts, reader.tensor("input_ids")
    base = target_runtime.base_model(model)
    batches = target_runtime.packed_batches(counts, tokens_per_batch)
    first = [0]
    for batch in batches:
        first.append(first[-1] + sum(counts[i] for i in batch))
    with target_runtime.attention_implementation(model, target_runtime.PACKED_ATTENTION):
        sync(device)
        started = time.perf_counter()
        for batch, start in zip(batches, first):
            inputs = target_runtime.packed_inputs([counts[i] for i in batch], start, ids, torch.device(device))
            base(input_ids=inputs[0], position_ids=inputs[1], use_cache=False, packed_segments=inputs[2])
        sync(device)
    seconds = time.perf_counter() - started
    return {"tokens": reader.num_tokens, "seconds": round(seconds, 3), "tokens_per_s": round(reader.num_tokens / seconds, 1)}


@torch.inference_mode()
def naive_output_hidden_states(model, prepared_path: Path, tokens_per_batch: int, layer_ids: list[int], device: str, max_tokens: int) -> dict:
    """Padded length buckets with an attention mask, all hidden states returned, plain copies."""
    reader = shards.ShardReader.open(prepared_path)
    counts, ids, offsets = reader.token_counts, reader.tensor("input_ids"), reader.tensor("offsets")
    keep, tokens = [], 0
    for index, n in enumerate(counts):
        if tokens + n > max_tokens and keep:
            break
        keep.append(index)
        tokens += n
    sub_counts = [counts[i] for i in keep]
    sync(device)
    started = time.perf_counter()
    for batch in target_runtime.length_batches(sub_counts, tokens_per_batch):
        width = max(sub_counts[i] for i in batch)
        batch_ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, index in enumerate(batch):
            start, end = int(offsets[keep[index]]), int(offsets[keep[index] + 1])
            batch_ids[row, : end - start] = ids[start:end]
            mask[row, : end - start] = 1
        out = model.model(input_ids=batch_ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, use_cache=False)
        for row, index in enumerate(batch):
            n = sub_counts[index]
            [out.hidden_states[i][row, :n].cpu() for i in layer_ids]
            out.last_hidden_state[row, :n].cpu()
    sync(device)
    seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}


def disk_write(directory: Path, file_bytes: int, files: int) -> dict:
    """Sequential write bandwidth for shard-sized files: write, fsync, rename, as shards are."""
    chunk = memoryview(torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes())
    directory.mkdir(parents=True, exist_ok=True)
    written, started = 0, time.perf_counter()
    for number in range(files):
        path = directory / f"disk-test-{number}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = file_bytes
        while left > 0:
            left -= os.write(fd, chunk[: min(len(chunk), left)])
        os.fsync(fd)
        os.close(fd)
        written += file_bytes
    seconds = time.perf_counter() - started
    for number in range(files):
        (directory / f"disk-test-{number}.bin").unlink()
    return {"bytes": written, "files": files, "seconds": round(seconds, 3), "bytes_per_s": round(written / seconds)}


def reconstruction_error(bf16_path: Path, fp8_path: Path, layer_ids: list[int]) -> dict:
    """fp8 vs the bf16 shard of the same rows: relative Frobenius error, per layer and overall."""
    reference = shards.ShardReader.open(bf16_path).hidden_tensors(dtype=torch.float32)
    restored = shards.ShardReader.open(fp8_path).hidden_tensors(dtype=torch.float32)
    hidden = reference["last_hidden"].shape[1]
    out = {}
    for name in ("aux_hidden", "last_hidden"):
        a, b = reference[name], restored[name]
        out[name] = float((b - a).norm() / a.norm())
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        out[f"{name}_min_row_cosine"] = float(cos.min())
    for k, layer in enumerate(layer_ids):
        a = reference["aux_hidden"][:, k * hidden : (k + 1) * hidden]
        b = restored["aux_hidden"][:, k * hidden : (k + 1) * hidden]
        out[f"aux_layer_{layer}"] = float((b - a).norm() / a.norm())
    return out


def value_difference(a_path: Path, b_path: Path) -> dict:
    a = shards.ShardReader.open(a_path).hidden_tensors(dtype=torch.float32)
    b = shards.ShardReader.open(b_path).hidden_tensors(dtype=torch.float32)
    return {name: float((a[name] - b[name]).norm() / a[name].norm()) for name in a}


def run_shape(shape: str, args, device: str, dtype: torch.dtype, log) -> dict:
    work = Path(args.workdir) / shape
    shutil.rmtree(work, ignore_errors=True)
    tokens_per_batch = args.tokens_per_batch or (32768 if SHAPES[shape]["hidden_size"] < 2048 else 16384)
    shard_tokens = args.shard_tokens or (1_000_000 if shape == "smollm2-135m" else 300_000)
    model = build_model(shape, device, dtype)
    layer_ids = layer_id_convention.default_layer_ids(model.config.num_hidden_layers)
    vocab = model.config.vocab_size
    lengths = sample_lengths(shard_tokens, args.max_len, args.seed)
    prepared = write_prepared(work / "prepared" / "shard-00000.safetensors", lengths, vocab, args.seed)
    warm = write_prepared(work / "warm" / "prepared" / "shard-00000.safetensors", lengths[: max(4, len(lengths) // 20)], vocab, args.seed + 1)
    row = {"shape": shape, "config": SHAPES[shape], "layer_ids": layer_ids, "samples": len(lengths), "tokens": sum(lengths),
           "max_len": args.max_len, "mean_len": round(sum(lengths) / len(lengths), 1), "tokens_per_batch": tokens_per_batch}
    hidden = model.config.hidden_size

    def fast(prepared_path, out, storage="bfloat16", layout="packed"):
        return extract.extract_shard(prepared_path, out, None, f"random-{shape}", layer_ids, dtype=storage,
                                     tokens_per_batch=tokens_per_batch, check_disk=False, layout=layout, model=model)

    log(f"[{shape}] warm-up")
    fast(warm, work / "warm" / "hidden" / "shard-00000.safetensors")
    forward_only(model, warm, tokens_per_batch, device)
    log(f"[{shape}] forward only")
    row["forward_only"] = forward_only(model, prepared, tokens_per_batch, device)
    results = {}
    for storage in ("bfloat16", "float8_e4m3"):
        out = work / storage / "shard-00000.safetensors"
        log(f"[{shape}] extract fast {storage}")
        stats = fast(prepared, out, storage)
        wall = stats["forward_s"] + stats["write_s"]
        verify_started = time.perf_counter()
        shards.verify_shard(out, deep=True, expect={"dtype": storage, "layer_ids": layer_ids})
        stats["verified"] = True
        stats["verify_deep_s"] = round(time.perf_counter() - verify_started, 3)
        stats["seconds"] = round(wall, 3)
        stats["bytes_per_s"] = round(stats["bytes"] / wall)
        if "gpu_busy_s" in stats:
            stats["gpu_busy_fraction"] = round(stats["gpu_busy_s"] / wall, 3)
            # Busy while rows were being computed (without the final flush of the last rows).
            stats["gpu_busy_fraction_while_computing"] = round(stats["gpu_busy_s"] / stats["forward_s"], 3)
        results[storage] = (stats, out)
    row["extract_fast"], row["extract_fast_fp8"] = results["bfloat16"][0], results["float8_e4m3"][0]
    row["fp8_reconstruction_error"] = reconstruction_error(results["bfloat16"][1], results["float8_e4m3"][1], layer_ids)
    # The simple path and the naive one on a slice of the shard (they are much slower).
    slice_tokens = min(shard_tokens, args.slow_path_tokens)
    sub = write_prepared(work / "sub" / "prepared" / "shard-00000.safetensors", [n for n in _prefix(lengths, slice_tokens)], vocab, args.seed)
    log(f"[{shape}] extract simple (padded, synchronous)")
    simple_out = work / "sub" / "simple" / "shard-00000.safetensors"
    simple = fast(sub, simple_out, "bfloat16", "padded")
    simple["seconds"] = round(simple["forward_s"] + simple["write_s"], 3)
    row["extract_simple"] = simple
    packed_out = work / "sub" / "packed" / "shard-00000.safetensors"
    fast(sub, packed_out, "bfloat16", "packed")
    # Same rows, packed vs padded: what the kernels' rounding differs by (bf16 on the GPU).
    row["packed_vs_padded_relative_difference"] = value_difference(simple_out, packed_out)
    log(f"[{shape}] naive output_hidden_states")
    row["naive_output_hidden_states"] = naive_output_hidden_states(
        model, sub, tokens_per_batch, layer_ids, device, max_tokens=slice_tokens
    )
    log(f"[{shape}] disk")
    file_bytes = results["bfloat16"][0]["bytes"]
    row["disk_write"] = disk_write(work / "disk", file_bytes, args.disk_files)
    for key in ("bfloat16", "float8_e4m3"):
        results[key][1].unlink()
    bytes_per_token = {s: shards.hidden_bytes_per_token(hidden, len(layer_ids), s) for s in ("bfloat16", "float8_e4m3")}
    row["bytes_per_token"] = bytes_per_token
    disk_bw = row["disk_write"]["bytes_per_s"]
    for key, storage in (("extract_fast", "bfloat16"), ("extract_fast_fp8", "float8_e4m3")):
        ceilings = {"forward_only": row["forward_only"]["tokens_per_s"], "disk": round(disk_bw / bytes_per_token[storage], 1)}
        tighter = min(ceilings, key=ceilings.get)
        row[key]["ceilings_tokens_per_s"] = ceilings
        row[key]["tighter_ceiling"] = tighter
        row[key]["ratio_to_forward_only"] = round(row[key]["tokens_per_s"] / ceilings["forward_only"], 3)
        row[key]["ratio_to_disk"] = round(row[key]["tokens_per_s"] / ceilings["disk"], 3)
        row[key]["ratio_to_tighter_ceiling"] = round(row[key]["tokens_per_s"] / ceilings[tighter], 3)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    shutil.rmtree(work, ignore_errors=True)
    return row


def _prefix(lengths: list[int], tokens: int) -> list[int]:
    out, total = [], 0
    for n in lengths:
        if total + n > tokens and out:
            break
        out.append(n)
        total += n
    return out


def table(result: dict) -> str:
    lines = [
        "| shape | path | tok/s | x forward-only | x disk ceiling | x tighter | GPU busy | MB/s written |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["shapes"]:
        forward = row["forward_only"]["tokens_per_s"]
        disk_bf16 = row["disk_write"]["bytes_per_s"] / row["bytes_per_token"]["bfloat16"]
        lines.append(f"| {row['shape']} | forward only (packed rows) | {forward:,.0f} | 1.00 | {forward / disk_bf16:.2f} | | | |")
        for key, label in (("extract_fast", "eaglenest fast, bf16"), ("extract_fast_fp8", "eaglenest fast, fp8 e4m3")):
            r = row[key]
            busy = f"{r['gpu_busy_fraction']:.0%}" if "gpu_busy_fraction" in r else "n/a"
            lines.append(
                f"| {row['shape']} | {label} | {r['tokens_per_s']:,.0f} | {r['ratio_to_forward_only']:.2f} | {r['ratio_to_disk']:.2f} | "
                f"{r['ratio_to_tighter_ceiling']:.2f} ({r['tighter_ceiling']}) | {busy} | {r['bytes_per_s'] / 1e6:,.0f} |"
            )
        for key, label in (("extract_simple", "eaglenest simple (padded, sync)"), ("naive_output_hidden_states", "naive output_hidden_states")):
            r = row[key]
            lines.append(f"| {row['shape']} | {label} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / forward:.2f} | {r['tokens_per_s'] / disk_bf16:.2f} | | | |")
        d = row["disk_write"]
        lines.append(f"| {row['shape']} | disk write, fsynced ({d['files']} x {d['bytes'] / d['files'] / 1e9:.2f} GB) | {disk_bf16:,.0f} (bf16) | | | | | {d['bytes_per_s'] / 1e6:,.0f} |")
    return "\n".join(lines)


def hardware(device: str) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,llama-3.1-8b")
    parser.add_argument("--out", default=None, help="JSON result path")
    parser.add_argument("--workdir", default="/tmp/eaglenest-bench", help="local disk for shard files")
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--shard-tokens", type=int, default=None, help="tokens in the benchmark shard (default per shape)")
    parser.add_argument("--tokens-per-batch", type=int, default=None)
    parser.add_argument("--slow-path-tokens", type=int, default=60_000, help="tokens for the simple and naive paths")
    parser.add_argument("--disk-files", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU (CI)")
    parser.add_argument("--make-lengths", type=int, default=None, help="rebuild the length distribution from N conversations")
    args = parser.parse_args(argv)
    if args.make_lengths:
        make_lengths(args.make_lengths)
        return 0
    if args.smoke:
        args.shapes, args.shard_tokens, args.max_len, args.slow_path_tokens = "tiny", 3000, 512, 1500
        args.tokens_per_batch = args.tokens_per_batch or 1024
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def log(message):
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python", "benchmarks/extract_throughput.py", *(sys.argv[1:] if argv is None else argv)]),
        "device": device,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "hardware": hardware(device),
        "shapes": [],
    }
    for shape in args.shapes.split(","):
        result["shapes"].append(run_shape(shape, args, device, dtype, log))
        if args.out:  # keep what is done if a later shape fails or runs out of time
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["varlen_attention"] = {"available": target_runtime._varlen_kernel() is not None, "failures": target_runtime._VARLEN_FAILED}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
