"""benchmarks/sglang_h200.sh and its Python steps, without a GPU: against the stand-in server."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from test_sglang_protocol import prepared_shard, standin  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "sglang_h200.py"


_spec = importlib.util.spec_from_file_location("sglang_h200", SCRIPT)
sglang_h200 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sglang_h200)


def run_step(*args) -> int:
    return sglang_h200.main([str(a) for a in args])


@pytest.mark.integration
def test_extract_step_compares_both_backends_and_verifies_the_server_shard(standin, prepared_shard, tiny_llama, tmp_path):
    _, url, spool = standin(target="tiny-llama", layers=[])
    part = tmp_path / "extract.json"
    done = run_step("extract", "--out", part, "--target-dir", tiny_llama, "--target-name", "tiny-llama", "--url", url,
                    "--spool-dir", spool, "--prepared", prepared_shard, "--work", tmp_path / "shards", "--device", "cpu")
    result = json.loads(part.read_text())
    assert done == 0, result
    assert result["comparison"]["within_tolerance"] and result["verify_sglang"]["ok"]
    assert result["rows"]["prepared_tokens"] == result["rows"]["sglang_tokens"]
    assert result["comparison"]["tensors"]["last_hidden"]["min_row_cosine"] > 0.999
    assert set(result["tokens_per_s"]) == {"sglang", "transformers"}


class _UnpatchedSglang(BaseHTTPRequestHandler):
    """What a plain SGLang answers: /get_model_info, and 404 for our route."""

    def do_GET(self):
        found = self.path == "/get_model_info"
        body = json.dumps({"model_path": "/m/smol"} if found else {"detail": "Not Found"}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_refuse_step_passes_only_when_the_server_is_refused(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _UnpatchedSglang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert run_step("refuse", "--out", tmp_path / "refuse.json", "--url", f"http://127.0.0.1:{server.server_address[1]}") == 0
    finally:
        server.shutdown()
    part = json.loads((tmp_path / "refuse.json").read_text())
    assert part["refused"] and "without the eaglenest patch serving /m/smol" in part["message"]


@pytest.mark.integration
def test_gpu_script_dry_run_plans_every_step_and_writes_results(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "TARGET_DIR": str(tmp_path), "PREPARED_SHARD": str(tmp_path),
           "DRAFTER_EXPORT": str(tmp_path), "EVAL_PROMPTS": str(tmp_path)}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "sglang_h200.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert steps == ["install", "environment", "patched-config", "extract", "refuse", "generate-plain", "generate-chain", "generate-tree"]
    for server in ("patched", "plain", "chain", "tree"):
        assert f"DRY server {server}" in done.stderr
    assert "--speculative-num-steps 6 --speculative-eagle-topk 10 --speculative-num-draft-tokens 60" in done.stderr
    assert json.loads((tmp_path / "out" / "results.json").read_text())["summary"]["steps_failed"] == []


@pytest.mark.integration
def test_gpu_script_runs_its_phases_apart_into_one_results_file(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "TARGET_DIR": str(tmp_path), "PREPARED_SHARD": str(tmp_path),
           "DRAFTER_EXPORT": str(tmp_path), "EVAL_PROMPTS": str(tmp_path)}
    out = tmp_path / "out"
    for phases in ("extract", "serve"):
        done = subprocess.run(["bash", str(REPO / "benchmarks" / "sglang_h200.sh"), str(out)], env={**env, "PHASES": phases},
                              capture_output=True, text=True, cwd=REPO, timeout=60)
        assert done.returncode == 0, done.stderr[-3000:]
        steps = [json.loads(line)["step"] for line in (out / "steps.jsonl").read_text().splitlines()]
        if phases == "extract":
            assert steps == ["install", "environment", "patched-config", "extract"]
            assert "DRY server plain" not in done.stderr
    assert steps[4:] == ["install", "environment", "refuse", "generate-plain", "generate-chain", "generate-tree"]
    assert "DRY server patched" not in done.stderr


def test_compare_counts_verify_steps_as_the_replay_counts_cycles(tmp_path):
    # Prompt a: SGLang 9 tokens in 4 verify steps (the first token is the prefill's), the
    # same output as the reference; prompt b: a different output.
    requests = [
        {"id": "mt_bench/81", "output_ids": list(range(9)), "completion_tokens": 9, "spec_verify_ct": 4, "spec_accept_length": 2.25},
        {"id": "mt_bench/82", "output_ids": [5] * 6, "completion_tokens": 6, "spec_verify_ct": 5, "spec_accept_length": 1.2},
    ]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"parts": {"generate-chain": {"accept_length": 15 / 9, "requests": requests}}}))
    chunks = tmp_path / "chunks"
    chunks.mkdir()
    (chunks / "0.json").write_text(json.dumps({"per_prompt": [
        {"id": "mt_bench/81", "output_length": 9, "tokens": list(range(9)) + [0] * 3},
        {"id": "mt_bench/82", "output_length": 6, "tokens": [4] * 9},
    ]}))
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"per_prompt": [
        {"id": "mt_bench/81", "accepted": [1, 2, 0, 1], "cycles": 4},   # 8 tokens in 4 cycles
        {"id": "mt_bench/82", "accepted": [0, 0, 0, 0, 1], "cycles": 5},  # 6 tokens in 5 cycles
    ]}))
    out = tmp_path / "compare.json"
    assert run_step("compare", "--results", results, "--references", chunks, "--setting", f"chain={metrics}", "--out", out) == 0
    row = json.loads(out.read_text())["settings"]["chain"]
    assert row["prompts"] == 2 and row["same_output_prompts"] == 1
    assert row["sglang_per_verify"] == round((8 + 5) / 9, 4)
    assert row["eaglenest_tau"] == round(14 / 9, 4)
    assert row["sglang_per_verify_same_output"] == 2.0 and row["eaglenest_tau_same_output"] == 2.0
    assert row["difference_same_output"] == 0.0


def test_noise_step_measures_bf16_against_float32_on_the_chosen_rows(prepared_shard, tiny_llama, tmp_path):
    from eaglenest.formats import shards

    counts = shards.ShardReader.open(prepared_shard).token_counts
    row = counts[0] + 2  # the third token of the second sample
    out = tmp_path / "noise.json"
    assert run_step("noise", "--out", out, "--target-dir", tiny_llama, "--prepared", prepared_shard, "--rows", row,
                    "--samples", 1, "--device", "cpu", "--threads", 1) == 0
    part = json.loads(out.read_text())
    assert part["samples"] == 2 and part["tokens"] == counts[0] + counts[1]
    assert part["rows"][str(row)]["sample"] == 1 and part["rows"][str(row)]["position"] == 2
    for name, tensor in part["tensors"].items():
        # bf16 moves every value (an 8-bit mantissa) but keeps each row's direction.
        assert 0 < tensor["mean_relative_diff"] < 0.05 and tensor["min_row_cosine"] > 0.95, (name, tensor)
        assert 0.95 < part["rows"][str(row)][name] <= 1.0 + 1e-6
        below = [tensor["rows_below"][bar] for bar in sorted(tensor["rows_below"], key=float, reverse=True)]
        assert below == sorted(below, reverse=True) and below[-1] == 0  # none under 0.95 (min cosine > 0.95)
        quantiles = [tensor["cosine_quantiles"][q] for q in sorted(tensor["cosine_quantiles"], key=float)]
        assert quantiles == sorted(quantiles) and quantiles[0] >= tensor["min_row_cosine"] - 1e-6


def _noise_pair(sglang_min: float, sglang_mean: float) -> tuple[dict, dict]:
    """An extract comparison and a noise measurement over the same 10 rows, one hidden tensor."""
    comparison = {"samples": 2, "tokens": 10, "same_samples": True, "same_token_counts": True,
                  "tensors": {"input_ids": {"equal": True},
                              "last_hidden": {"min_row_cosine": sglang_min, "rows_below_cosine": 1,
                                              "mean_relative_diff": sglang_mean}}}
    noise = {"samples": 2, "tokens": 10,
             "tensors": {"last_hidden": {"min_row_cosine": 0.95, "mean_relative_diff": 0.02, "rows_below": {"0.99": 2}}}}
    return comparison, noise


def test_noise_check_takes_the_bf16_noise_as_the_bar_where_it_is_wider_than_the_fixed_one(tmp_path):
    within = sglang_h200.noise_check(*_noise_pair(sglang_min=0.96, sglang_mean=0.03))
    assert within["within_bf16_noise"] and within["tensors"]["last_hidden"]["row_bar"] == 0.95
    # one row further from transformers than bf16 alone moves any row from exact arithmetic
    assert not sglang_h200.noise_check(*_noise_pair(sglang_min=0.94, sglang_mean=0.03))["within_bf16_noise"]
    # a mean difference over twice bf16's own
    assert not sglang_h200.noise_check(*_noise_pair(sglang_min=0.96, sglang_mean=0.05))["within_bf16_noise"]
    # a noise measurement over other rows proves nothing about these
    comparison, noise = _noise_pair(sglang_min=0.96, sglang_mean=0.03)
    noise["tokens"] = 9
    assert not sglang_h200.noise_check(comparison, noise)["within_bf16_noise"]
    # where bf16 alone stays above 0.99 the fixed bar of 0.99 holds
    comparison, noise = _noise_pair(sglang_min=0.985, sglang_mean=0.03)
    noise["tensors"]["last_hidden"]["min_row_cosine"] = 0.999
    assert not sglang_h200.noise_check(comparison, noise)["within_bf16_noise"]
    # the command: exit status 1 when not within, and the report written either way
    results, noise_path, out = tmp_path / "results.json", tmp_path / "noise.json", tmp_path / "check.json"
    results.write_text(json.dumps({"parts": {"extract": {"comparison": comparison}}}))
    noise_path.write_text(json.dumps(noise))
    assert run_step("noise-check", "--results", results, "--noise", noise_path, "--out", out) == 1
    assert json.loads(out.read_text())["within_bf16_noise"] is False
