"""The Python steps of benchmarks/sglang_h200.sh: real SGLang 0.5.14 against eaglenest.

Each subcommand writes one JSON part (``--out``); the shell script runs them, records
failures and merges the parts into results.json (``merge``).

    config     launcher config for the patched server (eaglenest.sglang.launch --configfile)
    extract    one prepared shard through the server (sglang backend) and through
               transformers; per-tensor comparison, consolidate-level check, tokens/s
    refuse     the client must refuse a server at --url (SGLang without the plugin)
    generate   MT-bench first turns, greedy, through /generate; accept lengths and tokens/s
    merge      parts -> results.json
    compare    SGLang's accept length next to eaglenest's replay tau on the same prompts
    noise      the scale of bf16 noise: transformers in bfloat16 against itself in float32,
               on chosen rows of a prepared shard (e.g. the rows extract found worst)
    noise-check  extract's comparison against that noise measured over the same shard:
               is every row of SGLang against transformers within what bf16 alone does?

Works against the test suite's stand-in server (tests/support/standin_server.py) too (same protocol), which is how it is tested
without a GPU; ``generate`` needs only /generate with input_ids.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# bf16 has an 8-bit mantissa: one rounding is a relative error up to 2^-8 ~ 0.4 % per
# element, and two implementations (SGLang's fused Triton/sgl kernels against torch SDPA
# and cuBLAS in transformers) reorder the sums in every one of 30 layers, so single
# elements near zero differ by far more in relative terms. Rows must still point the
# same way: the minimum cosine per row is the test, max relative difference is reported.
MIN_ROW_COSINE = 0.99
MAX_MEAN_RELATIVE = 0.05


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)


def target_config(target_dir: str) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def launcher_config(target_dir: str, target_name: str, url: str, spool_dir: str, extra_args: list[str]) -> dict:
    hf = target_config(target_dir)
    return {
        "run": "sglang-h200",
        "target": {"name": target_name, "path": str(Path(target_dir).resolve()), "num_layers": hf["num_hidden_layers"],
                   "hidden_size": hf["hidden_size"], "tensor_parallel": 1},
        "extract": {"layer_ids": "default", "backend": "sglang",
                    "sglang": {"url": url, "spool_dir": spool_dir, "startup_timeout_s": 600, "extra_args": extra_args}},
    }


def row_cosine(reference, candidate):
    """The cosine of each row of two [T, W] tensors (fp32 math)."""
    import torch

    return torch.nn.functional.cosine_similarity(reference.float(), candidate.float(), dim=-1)


def compare_tensors(reference, candidate, cosine=None) -> dict:
    """Max relative difference and minimum row cosine of two [T, W] tensors (fp32 math);
    ``cosine``: their row cosines when the caller has them already."""
    a, b = reference.float(), candidate.float()
    diff = (a - b).abs()
    scale = a.abs().max().clamp_min(1e-12)
    cosine = row_cosine(a, b) if cosine is None else cosine
    return {
        "shape": list(a.shape),
        "max_abs_diff": float(diff.max()),
        "max_relative_diff": float(diff.max() / scale),  # relative to the tensor's largest element
        "mean_relative_diff": float(diff.mean() / a.abs().mean().clamp_min(1e-12)),
        "min_row_cosine": float(cosine.min()),
        "rows_below_cosine": int((cosine < MIN_ROW_COSINE).sum()),
        "worst_row": int(cosine.argmin()),
    }


def ids_equal(comparison: dict) -> bool:
    """Whether the token ids and loss masks of a shard comparison are equal."""
    return all(t["equal"] for k, t in comparison["tensors"].items() if "hidden" not in k)


def shard_comparison(reference_path: str, candidate_path: str, prepared_path: str) -> dict:
    from eaglenest.formats import shards

    reference, candidate = shards.ShardReader.open(reference_path), shards.ShardReader.open(candidate_path)
    prepared = shards.ShardReader.open(prepared_path)
    result = {
        "samples": len(prepared.sample_ids), "tokens": prepared.num_tokens,
        "same_samples": reference.sample_ids == candidate.sample_ids == prepared.sample_ids,
        "same_token_counts": reference.token_counts == candidate.token_counts == prepared.token_counts,
        "tensors": {},
    }
    names = ["input_ids", "loss_mask", "aux_hidden", "last_hidden"]
    ref, cand = shards.dequantize(reference.tensors(names)), shards.dequantize(candidate.tensors(names))
    for name in ("input_ids", "loss_mask"):
        result["tensors"][name] = {"equal": bool((ref[name] == cand[name]).all())}
    for name in ("aux_hidden", "last_hidden"):
        result["tensors"][name] = compare_tensors(ref[name], cand[name])
    hidden = ref["last_hidden"].shape[1]
    for layer in range(ref["aux_hidden"].shape[1] // hidden):  # each aux layer on its own
        columns = slice(layer * hidden, (layer + 1) * hidden)
        result["tensors"][f"aux_hidden[{layer}]"] = compare_tensors(ref["aux_hidden"][:, columns], cand["aux_hidden"][:, columns])
    result["tolerance"] = {"min_row_cosine": MIN_ROW_COSINE, "max_mean_relative_diff": MAX_MEAN_RELATIVE}
    hidden_ok = all(
        t["min_row_cosine"] >= MIN_ROW_COSINE and t["mean_relative_diff"] <= MAX_MEAN_RELATIVE
        for k, t in result["tensors"].items() if "hidden" in k
    )
    result["within_tolerance"] = bool(hidden_ok and ids_equal(result) and result["same_samples"]
                                      and result["same_token_counts"])
    return result


def consolidate_check(hidden_path: str, prepared_path: str, target_name: str, layer_ids: list[int], dtype: str, vocab_size: int, work: Path) -> dict:
    """The consolidate stage on this one shard: header, checksums, finite values, prepared agreement."""
    from eaglenest.stages import consolidate

    work.mkdir(parents=True, exist_ok=True)
    try:
        report = consolidate.consolidate(
            [hidden_path], [prepared_path], work / "index.json", work / "draft_vocab.safetensors", work / "split.json",
            target_vocab_size=vocab_size, draft_vocab_size=min(vocab_size, 32000),
            expect={"target": target_name, "layer_ids": list(layer_ids), "dtype": dtype},
        )
        return {"ok": True, "report": report if isinstance(report, dict) else str(report)}
    except Exception as err:  # the stage's own message says which check failed
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}


def cmd_config(options) -> int:
    import yaml

    config = launcher_config(options.target_dir, options.target_name, options.url, options.spool_dir, options.extra_args)
    Path(options.out).write_text(yaml.safe_dump(config, sort_keys=False))
    return 0


def cmd_extract(options) -> int:
    from eaglenest.stages import extract
    from eaglenest.formats import shards
    from eaglenest.sglang import client as sglang_client
    from eaglenest.target_model import layer_ids as layer_id_convention

    hf = target_config(options.target_dir)
    layer_ids = layer_id_convention.resolve("default", hf["num_hidden_layers"])
    out = Path(options.work)
    out.mkdir(parents=True, exist_ok=True)
    part = {"prepared": options.prepared, "target": options.target_name, "layer_ids": layer_ids, "url": options.url}
    try:
        part["sglang"] = sglang_client.extract_shard_via_server(
            options.prepared, out / "sglang.safetensors", options.url, options.target_name, layer_ids,
            hf["hidden_size"], hf["num_hidden_layers"], dtype=options.dtype, spool_dir=options.spool_dir,
            concurrency=options.concurrency, check_disk=False,
        )
    except Exception as err:
        part["sglang_error"] = f"{type(err).__name__}: {err}"
    if options.skip_transformers:
        write_json(options.out, part)
        return 0 if "sglang" in part else 1
    try:
        part["transformers"] = extract.extract_shard(
            options.prepared, out / "transformers.safetensors", options.target_dir, options.target_name, layer_ids,
            dtype=options.dtype, device=options.device, check_disk=False,
        )
    except Exception as err:
        part["transformers_error"] = f"{type(err).__name__}: {err}"
    if "sglang" in part:
        # Every prompt row came back: same samples, same per-sample counts, same ids.
        part["verify_sglang"] = consolidate_check(
            str(out / "sglang.safetensors"), options.prepared, options.target_name, layer_ids, options.dtype,
            hf["vocab_size"], out / "consolidate",
        )
        reader = shards.ShardReader.open(out / "sglang.safetensors")
        part["rows"] = {"prepared_tokens": shards.ShardReader.open(options.prepared).num_tokens, "sglang_tokens": reader.num_tokens}
    if "sglang" in part and "transformers" in part:
        part["comparison"] = shard_comparison(str(out / "transformers.safetensors"), str(out / "sglang.safetensors"), options.prepared)
        part["tokens_per_s"] = {"sglang": part["sglang"]["tokens_per_s"], "transformers": part["transformers"].get("tokens_per_s")}
    write_json(options.out, part)
    ok = "comparison" in part and part["comparison"]["within_tolerance"] and part["verify_sglang"]["ok"]
    return 0 if ok else 1


def cmd_refuse(options) -> int:
    from eaglenest.sglang import client as sglang_client

    part = {"url": options.url}
    try:
        info = sglang_client.identify_server(options.url)
        part.update(refused=False, info=info)
    except sglang_client.SglangServerError as err:
        part.update(refused=True, message=str(err))
    write_json(options.out, part)
    return 0 if part["refused"] else 1


def mt_bench_prompt_ids(target_dir: str, questions: str, count: int) -> list[dict]:
    """The evaluator's prompts (eaglenest.stages.evaluate.read_mt_bench order, first turn) as token ids."""
    from transformers import AutoTokenizer

    from eaglenest.stages.evaluate import read_mt_bench
    from eaglenest.stages.prepare import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return [{"id": p["id"], "input_ids": prompt_ids(tokenizer, p["messages"])} for p in read_mt_bench(questions)[:count]]


def post_generate(url: str, payload: dict, timeout: float) -> dict:
    request = urllib.request.Request(url.rstrip("/") + "/generate", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


# Fields SGLang 0.5.14 puts in meta_info for a speculative request
# (sglang/srt/managers/tokenizer_manager.py:2301-2340, _calculate_spec_decoding_metrics, where
# spec_accept_length is completion_tokens / spec_verify_ct, :2329-2331); absent without speculation.
SPEC_FIELDS = ("spec_accept_length", "spec_verify_ct", "spec_accepted_drafts", "spec_accept_rate", "spec_accept_histogram")


def cmd_generate(options) -> int:
    prompts = mt_bench_prompt_ids(options.target_dir, options.questions, options.num_prompts)
    params = {"max_new_tokens": options.max_new_tokens, "temperature": 0.0}
    # One warm-up request: the first prefill compiles Triton kernels.
    post_generate(options.url, {"input_ids": prompts[0]["input_ids"], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}, options.timeout)

    def one(prompt):
        started = time.perf_counter()
        response = post_generate(options.url, {"input_ids": prompt["input_ids"], "sampling_params": params}, options.timeout)
        meta = response.get("meta_info", {})
        return {
            "id": prompt["id"], "prompt_tokens": len(prompt["input_ids"]),
            "output_ids": response.get("output_ids"), "completion_tokens": meta.get("completion_tokens"),
            "finish_reason": meta.get("finish_reason"), "seconds": round(time.perf_counter() - started, 4),
            **{k: meta[k] for k in SPEC_FIELDS if k in meta},
        }

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, options.concurrency)) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - started
    completion = sum(r["completion_tokens"] or 0 for r in results)
    part = {"label": options.label, "url": options.url, "num_prompts": len(results), "max_new_tokens": options.max_new_tokens,
            "concurrency": options.concurrency, "completion_tokens": completion, "wall_s": round(wall, 3),
            "tokens_per_s": round(completion / max(wall, 1e-9), 1),
            "sequential_tokens_per_s": round(completion / max(sum(r["seconds"] for r in results), 1e-9), 1),
            "requests": results}
    verify = [r.get("spec_verify_ct") for r in results]
    if all(isinstance(v, int) and v > 0 for v in verify):
        # SGLang's accept length: completion tokens per verify step (bonus token included).
        part["accept_length"] = round(completion / sum(verify), 4)
        part["accept_length_mean_of_requests"] = round(sum(r["spec_accept_length"] for r in results) / len(results), 4)
    write_json(options.out, part)
    return 0


def cmd_merge(options) -> int:
    parts_dir = Path(options.parts)
    merged = {"parts": {}}
    for path in sorted(parts_dir.glob("*.json")):
        try:
            merged["parts"][path.stem] = json.loads(path.read_text())
        except ValueError as err:
            merged["parts"][path.stem] = {"unreadable": str(err)}
    steps = merged["parts"].pop("steps", None)
    if Path(options.steps).exists():
        steps = [json.loads(line) for line in Path(options.steps).read_text().splitlines() if line.strip()]
    merged["steps"] = steps
    generated = {k: v for k, v in merged["parts"].items() if k.startswith("generate-") and "tokens_per_s" in v}
    baseline = generated.get("generate-plain", {}).get("sequential_tokens_per_s")
    merged["summary"] = {
        "steps_failed": [s["step"] for s in steps or [] if s.get("rc") != 0],
        "extract": {k: merged["parts"].get("extract", {}).get(k) for k in ("tokens_per_s", "rows")},
        "within_tolerance": merged["parts"].get("extract", {}).get("comparison", {}).get("within_tolerance"),
        "unpatched_refused": merged["parts"].get("refuse", {}).get("refused"),
        "generate": {k: {"accept_length": v.get("accept_length"), "tokens_per_s": v["tokens_per_s"],
                         "sequential_tokens_per_s": v["sequential_tokens_per_s"],
                         "speedup_vs_plain": round(v["sequential_tokens_per_s"] / baseline, 3) if baseline else None}
                     for k, v in generated.items()},
    }
    write_json(options.out, merged)
    print(json.dumps(merged["summary"], indent=1))
    return 0


NOISE_BARS = (0.999, 0.995, 0.99, 0.98, 0.97, 0.95)


def cmd_noise(options) -> int:
    """transformers in bfloat16 against transformers in float32 on the samples holding
    ``--rows`` (token rows of the prepared shard) and the first ``--samples`` samples.

    The extract step's tolerance compares two bf16 implementations; this measures how far
    one bf16 implementation already is from exact arithmetic on the same rows, per tensor as
    ``compare_tensors`` reports it, and the cosine at each chosen row."""
    import torch

    from eaglenest.formats import shards
    from eaglenest.target_model import runtime as target_runtime
    from eaglenest.target_model import layer_ids as layer_id_convention

    torch.set_num_threads(options.threads)
    hf = target_config(options.target_dir)
    layer_ids = layer_id_convention.resolve("default", hf["num_hidden_layers"])
    prepared = shards.ShardReader.open(options.prepared)
    counts = prepared.token_counts
    starts = list(itertools.accumulate(counts, initial=0))  # sample i is rows starts[i]:starts[i + 1]
    rows = [int(r) for r in options.rows.split(",")] if options.rows else []
    sample_of = {row: bisect.bisect_right(starts, row) - 1 for row in rows}
    chosen = sorted(set(range(min(options.samples, len(counts)))) | set(sample_of.values()))
    ids = prepared.tensor("input_ids")
    sub_ids = torch.cat([ids[starts[i]:starts[i + 1]] for i in chosen])
    sub_counts = [counts[i] for i in chosen]
    sub_offsets = torch.tensor(list(itertools.accumulate(sub_counts, initial=0)))
    outputs = {}
    for compute in ("float32", "bfloat16"):
        model = target_runtime.load_target(options.target_dir, target_runtime.pick_device(options.device), compute)
        started = time.perf_counter()
        aux, last = target_runtime.capture_hidden_states(model, sub_ids, sub_counts, sub_offsets, layer_ids, getattr(torch, compute),
                                                  options.tokens_per_batch)
        outputs[compute] = {"aux": aux, "last": last, "seconds": round(time.perf_counter() - started, 1)}
        del model
    ref, cand = outputs["float32"], outputs["bfloat16"]
    hidden = hf["hidden_size"]
    tensors = {"last_hidden": (ref["last"], cand["last"])}
    for layer in range(len(layer_ids)):
        columns = slice(layer * hidden, (layer + 1) * hidden)
        tensors[f"aux_hidden[{layer}]"] = (ref["aux"][:, columns], cand["aux"][:, columns])
    # Where each chosen row sits in the sub-shard.
    local = {}
    for row, sample in sample_of.items():
        local[row] = int(sub_offsets[chosen.index(sample)]) + row - starts[sample]
    part = {"prepared": options.prepared, "layer_ids": layer_ids, "samples": len(chosen), "tokens": int(sub_offsets[-1]),
            "seconds": {k: v["seconds"] for k, v in outputs.items()}, "tensors": {}, "rows": {}}
    for name, (a, b) in tensors.items():
        cosine = row_cosine(a, b)
        part["tensors"][name] = compare_tensors(a, b, cosine)
        # The tail of the distribution, which a per-row tolerance has to cover.
        part["tensors"][name]["rows_below"] = {str(bar): int((cosine < bar).sum()) for bar in NOISE_BARS}
        part["tensors"][name]["cosine_quantiles"] = {
            str(q): round(float(torch.quantile(cosine.double(), q)), 6) for q in (1e-5, 1e-4, 1e-3, 1e-2)}
        for row, at in local.items():
            part["rows"].setdefault(str(row), {"sample": sample_of[row], "position": row - starts[sample_of[row]]})[name] = \
                round(float(cosine[at]), 5)
    write_json(options.out, part)
    print(json.dumps({k: {m: v[m] for m in ("min_row_cosine", "rows_below_cosine", "mean_relative_diff")}
                      for k, v in part["tensors"].items()}, indent=1))
    print(json.dumps(part["rows"], indent=1))
    return 0


def noise_check(comparison: dict, noise: dict) -> dict:
    """SGLang against transformers (both bf16), tensor by tensor, against how far bf16 alone
    moves the same rows from exact arithmetic (``noise``: the noise step over the same shard).

    A row is within bf16 noise when its cosine is at least the tensor's bar: the worst row
    cosine bf16 alone reaches on that tensor, or MIN_ROW_COSINE where bf16 alone stays above
    it (the fixed bar is kept where the noise is smaller). The mean relative difference may be
    at most twice bf16's own: two bf16 implementations each carry their own rounding."""
    tensors = {}
    for name, measured in noise["tensors"].items():
        got = comparison["tensors"][name]
        bar = min(MIN_ROW_COSINE, measured["min_row_cosine"])
        mean_bar = 2 * measured["mean_relative_diff"]
        tensors[name] = {
            "sglang_min_row_cosine": got["min_row_cosine"], "bf16_min_row_cosine": measured["min_row_cosine"],
            "row_bar": bar, "sglang_rows_below_0.99": got["rows_below_cosine"],
            "bf16_rows_below_0.99": measured.get("rows_below", {}).get(str(MIN_ROW_COSINE)),
            "sglang_mean_relative_diff": got["mean_relative_diff"], "bf16_mean_relative_diff": measured["mean_relative_diff"],
            "every_row_within": got["min_row_cosine"] >= bar, "mean_within": got["mean_relative_diff"] <= mean_bar,
        }
    same_rows = comparison["tokens"] == noise["tokens"] and noise["samples"] == comparison["samples"]
    ids_are_equal = ids_equal(comparison)
    return {
        "tensors": tensors, "same_rows_measured": same_rows, "ids_equal": ids_are_equal,
        "within_bf16_noise": bool(same_rows and ids_are_equal and comparison["same_samples"]
                                  and comparison["same_token_counts"]
                                  and all(t["every_row_within"] and t["mean_within"] for t in tensors.values())),
    }


def cmd_noise_check(options) -> int:
    results = json.loads(Path(options.results).read_text())
    comparison = results.get("parts", {}).get("extract", results).get("comparison")
    if comparison is None:
        raise SystemExit(f"{options.results}: no extract comparison")
    report = {"results": options.results, "noise": options.noise,
              **noise_check(comparison, json.loads(Path(options.noise).read_text()))}
    write_json(options.out, report)
    for name, row in report["tensors"].items():
        print(f"{name:14} SGLang min {row['sglang_min_row_cosine']:.4f}  bf16 alone min {row['bf16_min_row_cosine']:.4f}  "
              f"bar {row['row_bar']:.4f}  rows<0.99 {row['sglang_rows_below_0.99']}/{row['bf16_rows_below_0.99']}  "
              f"mean {row['sglang_mean_relative_diff']:.4f}/{row['bf16_mean_relative_diff']:.4f}")
    print("within bf16 noise:", report["within_bf16_noise"])
    return 0 if report["within_bf16_noise"] else 1


def _accept_totals(rows: list[tuple[int, int]]) -> float | None:
    """Tokens per verify step over a set of prompts: sum of tokens / sum of steps."""
    steps = sum(s for _, s in rows)
    return round(sum(t for t, _ in rows) / steps, 4) if steps else None


def cmd_compare(options) -> int:
    """Per drafting setting: SGLang's accept length and eaglenest's tau on the same prompts.

    Both count the tokens a verify step yields (accepted drafts + the target's own token).
    SGLang's completion tokens also hold the first token, which the prefill samples before any
    verify step, so ``per_verify`` leaves it out: (completion - 1) / verify steps, the same
    count as the replay's sum(accepted + 1) / cycles. ``same_output`` keeps only the prompts
    whose SGLang output equals the greedy reference token for token (bfloat16 on the GPU and
    float32 on the CPU part at near-ties, and from there the texts, and the acceptance, differ).
    """
    merged = json.loads(Path(options.results).read_text())
    references = {}
    for chunk in sorted(Path(options.references).glob("*.json")):
        for prompt in json.loads(chunk.read_text())["per_prompt"]:
            references[prompt["id"]] = prompt["tokens"][: prompt["output_length"]]
    report = {"results": options.results, "references": options.references, "settings": {}}
    for spec in options.setting:
        label, metrics_path = spec.split("=", 1)
        part = merged["parts"][f"generate-{label}"]
        ours = {p["id"]: p for p in json.loads(Path(metrics_path).read_text())["per_prompt"]}
        prompts = []
        for request in part["requests"]:
            replay = ours[request["id"]]
            output = request.get("output_ids") or []
            prompts.append({
                "id": request["id"],
                "same_output": request["id"] in references and output == references[request["id"]],
                "sglang": (request["completion_tokens"] - 1, request["spec_verify_ct"]),
                "sglang_reported": request.get("spec_accept_length"),
                "eaglenest": (sum(a + 1 for a in replay["accepted"]), replay["cycles"]),
            })
        same = [p for p in prompts if p["same_output"]]
        row = {
            "metrics": metrics_path,
            "prompts": len(prompts),
            "same_output_prompts": len(same),
            "sglang_accept_length": part.get("accept_length"),
            "sglang_per_verify": _accept_totals([p["sglang"] for p in prompts]),
            "eaglenest_tau": _accept_totals([p["eaglenest"] for p in prompts]),
            "sglang_per_verify_same_output": _accept_totals([p["sglang"] for p in same]),
            "eaglenest_tau_same_output": _accept_totals([p["eaglenest"] for p in same]),
            "per_prompt": [{**p, "sglang": list(p["sglang"]), "eaglenest": list(p["eaglenest"])} for p in prompts],
        }
        for key in ("", "_same_output"):
            a, b = row[f"sglang_per_verify{key}"], row[f"eaglenest_tau{key}"]
            row[f"difference{key}"] = round(a - b, 4) if a is not None and b is not None else None
        report["settings"][label] = row
    write_json(options.out, report)
    def number(value):  # a missing figure prints as nan, a difference of 0.0 as +0.000
        return float("nan") if value is None else value

    print(f"{'setting':8} {'prompts':>7} {'SGLang':>8} {'per verify':>10} {'eaglenest':>9} {'diff':>7} | {'same out':>8} {'SGLang':>8} {'eaglenest':>9} {'diff':>7}")
    for label, row in report["settings"].items():
        print(f"{label:8} {row['prompts']:7d} {number(row['sglang_accept_length']):8.3f} {number(row['sglang_per_verify']):10.3f} "
              f"{number(row['eaglenest_tau']):9.3f} {number(row['difference']):+7.3f} | {row['same_output_prompts']:8d} "
              f"{number(row['sglang_per_verify_same_output']):8.3f} {number(row['eaglenest_tau_same_output']):9.3f} "
              f"{number(row['difference_same_output']):+7.3f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", required=True)
    common.add_argument("--target-dir")
    common.add_argument("--target-name", default="SmolLM2-135M-Instruct")
    common.add_argument("--url", default="http://127.0.0.1:30010")
    common.add_argument("--spool-dir", default="/dev/shm/eaglenest_hs_h200")
    config = sub.add_parser("config", parents=[common])
    config.add_argument("extra_args", nargs="*")
    ext = sub.add_parser("extract", parents=[common])
    ext.add_argument("--prepared", required=True)
    ext.add_argument("--work", required=True)
    ext.add_argument("--dtype", default="bfloat16")
    ext.add_argument("--device", default="auto")
    ext.add_argument("--concurrency", type=int, default=16)
    ext.add_argument("--skip-transformers", action="store_true")
    sub.add_parser("refuse", parents=[common])
    gen = sub.add_parser("generate", parents=[common])
    gen.add_argument("--questions", required=True)
    gen.add_argument("--label", required=True)
    gen.add_argument("--num-prompts", type=int, default=20)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--concurrency", type=int, default=1, help="1: per-request latency, the speculative speedup")
    gen.add_argument("--timeout", type=float, default=120.0)
    merge = sub.add_parser("merge")
    merge.add_argument("--parts", required=True)
    merge.add_argument("--steps", required=True)
    merge.add_argument("--out", required=True)
    compare = sub.add_parser("compare")
    compare.add_argument("--results", required=True, help="results.json of benchmarks/sglang_h200.sh")
    compare.add_argument("--references", required=True, help="evaluate/<set>/reference/chunks of the same prompts")
    compare.add_argument("--setting", action="append", required=True, help="LABEL=metrics.json, e.g. chain=.../steps3-topk1-tokens4/metrics.json")
    compare.add_argument("--out", required=True)
    noise = sub.add_parser("noise", parents=[common])
    noise.add_argument("--prepared", required=True)
    noise.add_argument("--rows", default="", help="comma-separated token rows of the prepared shard")
    noise.add_argument("--samples", type=int, default=32, help="also the first N samples")
    noise.add_argument("--device", default="auto")
    noise.add_argument("--threads", type=int, default=2)
    noise.add_argument("--tokens-per-batch", type=int, default=16384)
    check = sub.add_parser("noise-check", help="the extract comparison against the measured bf16 noise")
    check.add_argument("--results", required=True, help="results.json of benchmarks/sglang_h200.sh (or its extract part)")
    check.add_argument("--noise", required=True, help="the noise step's JSON over the same shard")
    check.add_argument("--out", required=True)
    options = parser.parse_args(argv)
    commands = {"noise-check": cmd_noise_check, "config": cmd_config, "extract": cmd_extract, "refuse": cmd_refuse, "generate": cmd_generate, "merge": cmd_merge,
                "compare": cmd_compare, "noise": cmd_noise}
    return commands[options.command](options)


if __name__ == "__main__":
    sys.exit(main())
