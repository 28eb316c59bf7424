"""Evaluate through SGLang servers (``evaluate.backend: sglang``): accept length, tokens/s and
speedup of the drafter as SGLang serves it.

SGLang fixes the drafting setting when the server starts, so the workflow starts one server
per setting of ``evaluate.drafting`` with the run's SGLang export as its EAGLE-3 draft model,
and one plain server (no speculation) for the baseline (rule evaluate_server,
eaglenest.sglang.launch --mode serve). One job per eval set and server sends the set's
prompts, rendered exactly as the transformers evaluator renders them
(eaglenest.stages.prepare.prompt_ids), as token ids to ``POST /generate``, greedy, once per
entry of ``evaluate.sglang.concurrency`` (requests in flight), and writes what each request
returned: output ids, completion tokens, wall time and SGLang's speculative counters from
``meta_info``. The merge step pairs a setting's file with the plain server's into the same
metrics.json as the transformers evaluator writes, so summary, plots and report read both.

How the figures are read from SGLang (0.5.23, docs/sglang.md):
- cycles = ``spec_verify_ct`` (verify steps); accepted drafts = ``spec_num_correct_drafts``
  (``spec_accepted_drafts`` in 0.5.14); tau = (accepted drafts + cycles) / cycles, the bonus
  token counted and the prefill's first token not, as eaglenest.model.speculate counts it.
  SGLang's own ``spec_accept_length`` (completion tokens / verify steps) counts the prefill's
  token too; it is kept beside tau as ``server_accept_length``.
- acceptance by position from ``spec_correct_drafts_histogram`` (verify steps by drafts
  accepted), each cycle taken as drafted ``steps`` deep (exact for chains; a tree's best
  candidates may stop short of ``steps``).
- tokens/s = completion tokens of all prompts / wall time of the measurement; speedup =
  speculative tokens/s over the plain server's at the same concurrency.
- lossless: at the first concurrency, every prompt's output ids equal the plain server's.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglenest.formats import atomic
from eaglenest.sglang import client as sglang_client
from eaglenest.stages import evaluate

log = logging.getLogger(__name__)

PLAIN = "plain"  # the server without speculation: the baseline of every setting's speedup
BACKEND = "sglang"
# Accepted drafts per request: 0.5.23's key, then 0.5.14's (docs/sglang.md).
ACCEPTED_KEYS = ("spec_num_correct_drafts", "spec_accepted_drafts")
HISTOGRAM_KEYS = ("spec_correct_drafts_histogram", "spec_accept_histogram")


def post_generate(url: str, payload: dict, timeout_s: float) -> dict:
    try:
        return sglang_client.post_json(url.rstrip("/") + "/generate", payload, timeout_s)
    except urllib.error.HTTPError as err:
        raise sglang_client.SglangServerError(
            f"{url}/generate answered {err.code}: {err.read()[:500].decode(errors='replace')}"
        ) from None
    except (urllib.error.URLError, OSError) as err:
        raise sglang_client.SglangServerError(f"no answer from {url}/generate ({getattr(err, 'reason', err)})") from None


def server_url(service_file: str | os.PathLike | None, url: str | None, startup_timeout_s: float) -> str:
    """The server's URL: from its service record (the workflow started it), else ``url``."""
    if service_file:
        from eaglenest.sglang import launch

        return launch.wait_for_service(service_file, startup_timeout_s)["url"]
    if not url:
        raise ValueError("no server: evaluate.sglang.start_server is false and evaluate.sglang.urls names none for it")
    return url


def check_serving(url: str, target_name: str) -> dict:
    """The server is eaglenest's patched SGLang started to generate, for this target."""
    info = sglang_client.identify_server(url)
    if info.get("mode") != "serve" or info.get("target") != target_name:
        raise sglang_client.SglangServerError(
            f"{url} serves {info.get('target')!r} in {info.get('mode')!r} mode; the evaluation needs {target_name!r} "
            "in serve mode (eaglenest.sglang.launch --mode serve)"
        )
    return info


def _request_record(prompt: dict, ids: list[int], answer: dict, seconds: float) -> dict:
    meta = answer.get("meta_info") or {}
    output_ids = answer.get("output_ids")
    if not isinstance(output_ids, list):
        raise sglang_client.SglangServerError(f"{prompt['id']}: the server's answer has no output_ids: {str(answer)[:300]}")
    accepted = next((meta[key] for key in ACCEPTED_KEYS if key in meta), None)
    histogram = next((meta[key] for key in HISTOGRAM_KEYS if key in meta), None)
    return {
        "id": prompt["id"], "category": prompt["category"], "prompt_tokens": len(ids), "output_ids": output_ids,
        "completion_tokens": int(meta.get("completion_tokens", len(output_ids))), "seconds": seconds,
        "finish_reason": meta.get("finish_reason"), "spec_verify_ct": meta.get("spec_verify_ct"),
        "accepted_drafts": accepted, "accept_histogram": histogram,
        "server_accept_length": meta.get("spec_accept_length"),
    }


def measure(url: str, prompts: list[dict], prompt_tokens: list[list[int]], max_new_tokens: int, concurrency: int,
            timeout_s: float) -> dict:
    """Every prompt once, ``concurrency`` requests in flight; per-request records in prompt order."""
    def one(index: int) -> dict:
        payload = {"input_ids": prompt_tokens[index],
                   "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
        began = time.perf_counter()
        answer = post_generate(url, payload, timeout_s)
        return _request_record(prompts[index], prompt_tokens[index], answer, time.perf_counter() - began)

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        records = list(pool.map(one, range(len(prompts))))
    seconds = time.perf_counter() - began
    tokens = sum(r["completion_tokens"] for r in records)
    return {"concurrency": concurrency, "seconds": seconds, "completion_tokens": tokens,
            "tokens_per_second": tokens / seconds if seconds > 0 else None, "per_prompt": records}


def evaluate_on_server(
    target_path: str | os.PathLike,
    eval_set: str,
    prompts_path: str | os.PathLike,
    setting: str,
    drafting: dict | None,
    part_path: str | os.PathLike,
    num_prompts: int | None,
    max_new_tokens: int,
    concurrency: list[int],
    target_name: str,
    drafter: str = "",
    service_file: str | os.PathLike | None = None,
    url: str | None = None,
    startup_timeout_s: float = 3600,
    timeout_s: float = 3600,
    profile_steps: int = 0,
) -> dict:
    """One eval set through one server (``setting``: a drafting name, or ``plain``): its part file."""
    from transformers import AutoTokenizer

    from eaglenest.stages.prepare import prompt_ids

    prompts = evaluate.load_prompts(eval_set, prompts_path, num_prompts)
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    prompt_tokens = [prompt_ids(tokenizer, prompt["messages"]) for prompt in prompts]
    url = server_url(service_file, url, startup_timeout_s)
    log.info("%s through the %s server at %s", eval_set, setting, url)
    info = check_serving(url, target_name)
    # One short request first: the server's first batch pays one-time costs (CUDA graph
    # capture, kernel autotuning) that would time neither side fairly.
    post_generate(url, {"input_ids": prompt_tokens[0], "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
                  timeout_s)
    runs = []
    for requests_in_flight in concurrency:
        run = measure(url, prompts, prompt_tokens, max_new_tokens, requests_in_flight, timeout_s)
        speculated = [r["spec_verify_ct"] is not None for r in run["per_prompt"]]
        if drafting is None and any(speculated):
            raise sglang_client.SglangServerError(f"the plain server at {url} speculates (meta_info has spec_verify_ct)")
        if drafting is not None and not all(speculated):
            raise sglang_client.SglangServerError(
                f"the {setting} server at {url} answered without spec_verify_ct: it does not speculate")
        log.info("%s x %s, %d in flight: %d tokens in %.2f s, %.1f tokens/s", eval_set, setting, requests_in_flight,
                 run["completion_tokens"], run["seconds"], run["tokens_per_second"] or 0.0)
        runs.append(run)
    part = {
        "backend": BACKEND, "eval_set": eval_set, "setting": setting, "drafting": drafting,
        "max_new_tokens": max_new_tokens, "temperature": 0, "target": target_name,
        "drafter": drafter if drafting is not None else "", "url": url, "server": info, "runs": runs,
    }
    if profile_steps:
        part["profile"] = server_profile(url, profile_steps, Path(part_path).with_name(Path(part_path).stem + "-profile"),
                                         prompt_tokens[0], timeout_s)
    atomic.write_json(part_path, part)
    return part


def server_profile(url: str, steps: int, trace_dir: Path, prompt_ids: list[int], timeout_s: float) -> dict:
    """SGLang's own profile of ``steps`` forward steps of one prompt alone, broken down per
    step (eaglenest.sglang.profile). A server that cannot profile costs the measurement
    nothing: the reason is kept instead."""
    from eaglenest.sglang import profile

    try:
        trace = profile.profile_steps(url, steps, trace_dir, prompt_ids, timeout_s)
        return {"trace": str(trace), **profile.cycle_breakdown(profile.read_trace(trace))}
    except (OSError, RuntimeError, ValueError, KeyError) as err:
        log.warning("no profile from %s: %s", url, err)
        return {"error": f"{type(err).__name__}: {err}"}


def _per_prompt(spec: dict, plain: dict, drafting: dict) -> dict:
    cycles = spec["spec_verify_ct"] or 0
    histogram = spec["accept_histogram"]
    # Per-cycle accepted drafts, in no particular order: what acceptance_stats reads.
    accepted = [k for k, count in enumerate(histogram) for _ in range(count)] if histogram else []
    if histogram and sum(histogram) != cycles:
        raise ValueError(f"{spec['id']}: the server's accept histogram counts {sum(histogram)} verify steps, "
                         f"spec_verify_ct says {cycles}")
    return {
        "id": spec["id"], "category": spec["category"], "prompt_tokens": spec["prompt_tokens"],
        "new_tokens": spec["completion_tokens"], "cycles": cycles, "accepted": accepted,
        "accepted_drafts": spec["accepted_drafts"], "draft_depths": [drafting["steps"]] * len(accepted),
        "seconds": spec["seconds"], "target_tokens": plain["completion_tokens"], "target_seconds": plain["seconds"],
        "lossless": spec["output_ids"] == plain["output_ids"], "server_accept_length": spec["server_accept_length"],
    }


def metrics_from_server_parts(spec: dict, plain: dict) -> dict:
    """metrics.json of one eval set x drafting setting from its server's part and the plain server's."""
    from eaglenest.model import speculate

    if spec["setting"] == PLAIN or plain["setting"] != PLAIN:
        raise ValueError(f"expected a drafting setting's part and the plain one, got {spec['setting']} and {plain['setting']}")
    for key in ("eval_set", "max_new_tokens", "target"):
        if spec[key] != plain[key]:
            raise ValueError(f"the {spec['setting']} and plain parts disagree on {key}: {spec[key]!r} vs {plain[key]!r}")
    plain_runs = {run["concurrency"]: run for run in plain["runs"]}
    if [run["concurrency"] for run in spec["runs"]] != list(plain_runs):
        raise ValueError(f"the {spec['setting']} and plain parts were measured at other concurrencies: remove them and rerun")
    drafting = spec["drafting"]
    by_concurrency = []
    for run in spec["runs"]:
        base = plain_runs[run["concurrency"]]
        ids = [p["id"] for p in run["per_prompt"]]
        if ids != [p["id"] for p in base["per_prompt"]]:
            raise ValueError(f"the {spec['setting']} and plain parts hold other prompts: remove them and rerun")
        cycles = sum(p["spec_verify_ct"] for p in run["per_prompt"])
        accepted = [p["accepted_drafts"] for p in run["per_prompt"]]
        tau = None if None in accepted or not cycles else (sum(accepted) + cycles) / cycles
        speed, base_speed = run["tokens_per_second"], base["tokens_per_second"]
        by_concurrency.append({
            "concurrency": run["concurrency"], "tau": tau,
            "server_accept_length": sum(p["completion_tokens"] for p in run["per_prompt"]) / cycles if cycles else None,
            "speculative_tokens_per_second": speed, "target_tokens_per_second": base_speed,
            "speedup": speed / base_speed if speed and base_speed else None,
            "lossless": all(a["output_ids"] == b["output_ids"] for a, b in zip(run["per_prompt"], base["per_prompt"])),
        })
    headline, base = spec["runs"][0], plain_runs[spec["runs"][0]["concurrency"]]
    per_prompt = [_per_prompt(a, b, drafting) for a, b in zip(headline["per_prompt"], base["per_prompt"])]
    if all(p["accepted"] for p in per_prompt if p["cycles"]):
        stats = speculate.acceptance_stats([a for p in per_prompt for a in p["accepted"]],
                                           [d for p in per_prompt for d in p["draft_depths"]])
    else:  # a server without the histogram: tau from the totals, no per-position figures
        cycles = sum(p["cycles"] for p in per_prompt)
        stats = {"cycles": cycles, "tokens": sum(p["accepted_drafts"] for p in per_prompt) + cycles,
                 "tau": by_concurrency[0]["tau"], "acceptance_by_position": [], "accept_length_histogram": []}
    first = by_concurrency[0]
    return {
        "eval_set": spec["eval_set"],
        "drafting": {"name": spec["setting"], **{k: drafting[k] for k in ("steps", "topk", "tokens")}},
        **stats,
        "prompts": len(per_prompt),
        "chunks": 1,
        "method": "decode",
        "backend": BACKEND,
        "max_new_tokens": spec["max_new_tokens"],
        "temperature": 0,
        "lossless": first["lossless"],
        "mismatched_prompts": [p["id"] for p in per_prompt if not p["lossless"]],
        "reference_inconsistent_prompts": [],
        "speculative_tokens_per_second": first["speculative_tokens_per_second"],
        "target_tokens_per_second": first["target_tokens_per_second"],
        "speedup": first["speedup"],
        "concurrency": first["concurrency"],
        "server_accept_length": first["server_accept_length"],
        "by_concurrency": by_concurrency,
        "device": f"sglang {spec['server'].get('sglang_version')} tp {spec['server'].get('tensor_parallel')}",
        "dtype": None,
        "threads": None,
        "target": spec["target"],
        "drafter": spec["drafter"],
        "per_prompt": per_prompt,
    }


def merge_server_parts(parts: list[dict], metrics_path: str | os.PathLike) -> dict:
    (spec,) = [part for part in parts if part["setting"] != PLAIN]
    (plain,) = [part for part in parts if part["setting"] == PLAIN]
    metrics = metrics_from_server_parts(spec, plain)
    atomic.write_json(metrics_path, metrics)
    log.info("%s x %s (sglang): tau %s over %d prompts, speedup %s at %d in flight, lossless %s",
             metrics["eval_set"], metrics["drafting"]["name"], metrics["tau"], metrics["prompts"],
             evaluate._times(metrics["speedup"]), metrics["concurrency"], metrics["lossless"])
    return metrics


def read_parts(paths: list[str | os.PathLike]) -> list[dict]:
    return [json.loads(Path(path).read_text()) for path in paths]
