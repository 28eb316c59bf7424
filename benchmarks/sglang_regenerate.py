"""Regeneration through a real SGLang server beside the engine's own speed, on one GPU.

Two parts of one run (benchmarks/sglang_regenerate.sh drives them on the node):

``ceiling``: a plain SGLang server (no eaglenest code in it) answers a seeded sample of the
prompts the regenerate stage asks (``--turns all``, the default: any assistant turn's, with
the conversation before it; ``--turns first``: first turns only; the prompts the stage would
skip as too long skipped) with the same sampling settings, from a plain client that keeps
``concurrency`` requests in flight. Its generated tokens per second are what the engine does
alone on prompts of the workflow's lengths.

``pick``: of several ceilings measured with different server flags (``CEILING_SWEEP``), the
fastest; writes it as the run's ceiling and as a config overlay whose ``extract.sglang.extra_args``
the workflow's server then runs with, so that the ceiling and the run share their flags. A
sweep entry's ``NAME=VALUE`` words (SGLang reads some scheduler knobs only from the
environment) went into its server's environment; the fastest's go under ``extract.sglang.env``.

``schedule``: what an SGLang server's own log says about its scheduling: prefill passes and
the requests in each, decode steps, requests running, prefix-cache hits. Where generation
time goes when answers end one at a time and each arrival gets a prefill pass of its own.

``profile``: SGLang's own profile (torch profiler, ``/start_profile``) of the next steps of a
busy server, the ceiling's plain one or the workflow's, broken down by scheduler stage with the
GPU time of each (``eaglenest.sglang.profile.cycle_breakdown``): where a step's time goes.

``metrics``: SGLang's own metrics of a server started with ``--enable-metrics``
(``eaglenest.sglang.metrics``), scraped every ``--every-s`` until it stops: the radix cache's
evictions (how many, the scheduler time they took, the tokens they freed), the batch and the
KV pool's use. A pool full of cached conversations evicts before every allocation.

``summary``: the workflow's regenerate stage (rule ``regenerate``, its server started by rule
``regenerate_server``) on the same conversations: every turn accounted for (from
``regenerate_report.json``), generated and kept tokens, the wall time from the server's
readiness to the last shard, against the ceiling. Writes the ``regenerate`` section of
``benchmarks/results/sglang_engine_<date>.json``.

    python benchmarks/sglang_regenerate.py ceiling --url http://127.0.0.1:30030 --conversations CONV.jsonl \\
        --model-path MODEL --config CONFIG.yaml... --prompts 2048 --concurrency 256 --out ceiling.json
    python benchmarks/sglang_regenerate.py pick --ceilings ceiling-*.json --config CONFIG.yaml... \
        --out ceiling.json --overlay server-flags.yaml
    python benchmarks/sglang_regenerate.py schedule --log server.log
    python benchmarks/sglang_regenerate.py summary --workdir WORK --run RUN --ceiling ceiling.json --out OUT.json \
        [--server-log server.log] [--metrics metrics-workflow.json]
    python benchmarks/sglang_regenerate.py metrics --record results/RUN/sglang/regenerate.json --out metrics-workflow.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import pyspy_profiles  # noqa: E402  (beside this file)
from process_cpu import sample_cpu, sglang_processes  # noqa: E402

# The transformers backend's regeneration speed (docs/regeneration.md: SmolLM2-135M on one
# H200, 2026-11-29, 8 shard jobs side by side); not remeasured in this run.
TRANSFORMERS_NEW_TOKENS_PER_S = 1950
# A CEILING_SWEEP word that sets the plain server's environment rather than a flag.
ENV_WORD = re.compile(r"(?P<name>[A-Z_][A-Z0-9_]*)=(?P<value>\S*)")


def sample_prompts(conversations_path: str, model_path: str, max_len: int, count: int, seed: int,
                   turns: str = "all") -> tuple[list, int]:
    """(prompts, skipped): a seeded sample of the prompts the stage asks, those it would skip
    as ``max_len`` or longer left out, as the stage leaves them out; each prompt is (its
    messages, its token ids as the stage renders them). ``turns="all"``: any assistant turn's,
    the conversation before it as the source holds it (the stage asks the same turn with its
    own earlier answers in their place), so the prompts have the lengths the workflow's server
    sees; ``"first"``: the first assistant turn's only."""
    from eaglenest.stages.prepare import load_tokenizer, prompt_ids

    with open(conversations_path, encoding="utf-8") as handle:  # JSON lines: split on "\n" only
        rows = [json.loads(line) for line in handle if line.strip()]
    candidates = []
    for row in rows:
        assistant_turns = [k for k, message in enumerate(row["messages"]) if message["role"] == "assistant"]
        candidates += [row["messages"][:k] for k in (assistant_turns if turns == "all" else assistant_turns[:1])]
    random.Random(seed).shuffle(candidates)
    tokenizer = load_tokenizer(model_path)
    prompts, skipped = [], 0
    for prompt in candidates:
        ids = prompt_ids(tokenizer, prompt)
        if len(ids) >= max_len:
            skipped += 1
            continue
        prompts.append((prompt, ids))
        if len(prompts) == count:
            break
    return prompts, skipped


def ceiling_requests(prompts: list, model: str, section: dict, stop_ids: list[int]) -> tuple[str, list[dict]]:
    """(the route, one request body per prompt) as the workflow's client asks them
    (``regenerate.api``): chat completions of the messages, or SGLang's /generate of the ids."""
    if section["api"] == "generate":
        sampling = {"temperature": section["temperature"], "top_p": section["top_p"],
                    "max_new_tokens": section["max_new_tokens"], "stop_token_ids": stop_ids}
        return "/generate", [{"input_ids": ids, "sampling_params": sampling} for _, ids in prompts]
    sampling = {"temperature": section["temperature"], "top_p": section["top_p"], "max_tokens": section["max_new_tokens"]}
    return "/v1/chat/completions", [{"model": model, "messages": messages, **sampling} for messages, _ in prompts]


def measure_ceiling(url: str, route: str, bodies: list[dict], concurrency: int, seed: int, on_load_start=None) -> dict:
    """The generation speed of ``concurrency`` requests in flight from a plain client, after
    one warm-up request; ``on_load_start`` is called as the first measured request goes out."""
    endpoint = url.rstrip("/") + route

    def ask(index, body):
        if "sampling_params" in body:  # each request its own seed, the shared body left as it is
            body = {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": seed + index}}
        else:
            body = {**body, "seed": seed + index}
        request = urllib.request.Request(endpoint, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
        if "meta_info" in answer:  # /generate
            tokens = int(answer["meta_info"]["completion_tokens"])
            return tokens, tokens, (answer["meta_info"].get("finish_reason") or {}).get("type")
        tokens = int(answer["usage"]["completion_tokens"])
        return tokens, tokens, answer["choices"][0].get("finish_reason")

    return {**timed_load(ask, bodies, concurrency, on_load_start), "route": route}


def measure_workflow_client(backend, prompts: list, concurrency: int, seed: int, on_load_start=None) -> dict:
    """The same load from the regenerate stage's own client (``OpenAIBackend.answer``: its
    route, streaming and loop cut as the config sets them), one request per prompt; kept
    tokens are what the stage would keep, generated ones what the server made for them."""

    def ask(index, prompt):
        generation = backend.answer(prompt[0], seed + index)
        reason = generation.finish_reason if generation.error is None else "failed"
        return generation.generated_tokens, generation.new_tokens, reason

    route = backend.endpoint[len(backend.settings.url.rstrip("/")):]  # as the plain ceiling names it
    return {**timed_load(ask, prompts, concurrency, on_load_start), "route": route,
            "client": "workflow", "streamed": bool(backend.settings.stream and backend.settings.repetition_stop >= 2),
            "stream_interval": backend.settings.stream_interval}


def timed_load(ask, items: list, concurrency: int, on_load_start=None) -> dict:
    """``ask(index, item) -> (generated tokens, kept tokens, finish reason)`` over every item,
    ``concurrency`` at a time, after the first item once as a warm-up."""
    ask(0, items[0])
    if on_load_start is not None:
        on_load_start()
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(ask, range(len(items)), items))
    seconds = time.perf_counter() - started
    generated = sum(tokens for tokens, _, _ in answers)
    kept = sum(tokens for _, tokens, _ in answers)
    reasons: dict = {}
    for _, _, reason in answers:
        reasons[str(reason)] = reasons.get(str(reason), 0) + 1
    return {"prompts": len(items), "concurrency": concurrency, "generated_tokens": generated, "kept_tokens": kept,
            "seconds": round(seconds, 3), "requests_per_s": round(len(items) / seconds, 1),
            "tokens_per_s": round(generated / seconds, 1), "kept_tokens_per_s": round(kept / seconds, 1),
            "finish_reasons": reasons}


def server_env(words: str) -> dict:
    """``NAME=VALUE`` words (a sweep entry's environment) as a dict; anything else is refused."""
    env = {}
    for word in words.split():
        found = ENV_WORD.fullmatch(word)
        if not found:
            raise ValueError(f"not an environment entry (NAME=VALUE): {word!r}")
        env[found["name"]] = found["value"]
    return env


def cmd_ceiling(options) -> int:
    from eaglenest.formats import atomic
    from eaglenest.node.recon.config import load_config

    from eaglenest.stages.prepare import load_tokenizer
    from eaglenest.stages.regenerate import end_of_turn_ids

    config = load_config(REPO, options.config)  # as the Snakefile sees it
    section = config["regenerate"]
    prompts, skipped = sample_prompts(options.conversations, options.model_path, config["data"]["max_len"],
                                      options.prompts, options.seed, options.turns)
    sampling = {"temperature": section["temperature"], "top_p": section["top_p"], "max_tokens": section["max_new_tokens"]}
    # The profiler waits for the load itself, not for the warm-up (flashinfer may build its
    # kernels in it, for minutes on a fresh node).
    # Written whole or not at all (eaglenest.formats.atomic): whoever waits for it reads it complete.
    on_load_start = (lambda: atomic.write_text(options.load_started, f"{time.time()}\n")) if options.load_started else None
    if options.client == "workflow":
        from eaglenest.stages.regenerate import OpenAIBackend, Settings

        interval = {"stream_interval": options.stream_interval} if options.stream_interval else {}
        settings = Settings.from_config({**section, "url": options.url, "model": options.model or section.get("model"),
                                         **interval})
        backend = OpenAIBackend(options.model_path, settings, config["target"]["name"])
        result = measure_workflow_client(backend, prompts, options.concurrency, options.seed, on_load_start)
    else:
        stop_ids = end_of_turn_ids(load_tokenizer(options.model_path)) if section["api"] == "generate" else []
        route, bodies = ceiling_requests(prompts, options.model or config["target"]["name"], section, stop_ids)
        result = measure_ceiling(options.url, route, bodies, options.concurrency, options.seed, on_load_start)
    result.update(sampling=sampling, api=section["api"], turns=options.turns, skipped_beyond_max_len=skipped, seed=options.seed,
                  server_flags=options.server_flags.split(), server_env=server_env(options.server_env))
    Path(options.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


def flag_groups(args: list[str]) -> list[list[str]]:
    """Command-line words grouped by flag: each ``--flag`` with the words up to the next one
    (its value, if any)."""
    groups: list[list[str]] = []
    for word in map(str, args):
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def merge_flags(base: list[str], extra: list[str]) -> list[str]:
    """``base`` with ``extra``'s flags: a flag ``base`` already has takes ``extra``'s value in
    its place, a new one is appended (the overlay then says each flag once)."""
    merged = flag_groups(base)
    for group in flag_groups(extra):
        at = next((i for i, have in enumerate(merged) if have[0] == group[0]), None)
        if at is None:
            merged.append(group)
        else:
            merged[at] = group
    return [word for group in merged for word in group]


def pick_ceiling(ceilings: list[dict], extra_args: list[str], num_shards: int, base_concurrency: int,
                 config_env: dict | None = None) -> tuple[dict, dict]:
    """(the fastest ceiling with the others under ``sweep``, the overlay that gives the
    workflow's server its flags: the config's ``extract.sglang.extra_args`` and the best's;
    and, when the best ran with an environment of its own, ``extract.sglang.env``: the
    config's ``config_env`` with the best's over it). A best measured at another number of
    requests in flight than ``base_concurrency`` also sets ``regenerate.concurrency``: that
    number shared by the shard jobs, which all run side by side against the one server."""
    best = max(ceilings, key=lambda ceiling: ceiling["tokens_per_s"])
    sweep = [{"server_flags": c.get("server_flags", []), "server_env": c.get("server_env", {}), "concurrency": c["concurrency"],
              "tokens_per_s": c["tokens_per_s"], "seconds": c["seconds"], "schedule": c.get("schedule")} for c in ceilings]
    overlay = {"extract": {"sglang": {"extra_args": merge_flags(extra_args, best.get("server_flags", []))}}}
    if best.get("server_env"):
        overlay["extract"]["sglang"]["env"] = {**(config_env or {}), **best["server_env"]}
    if best["concurrency"] != base_concurrency:
        overlay["regenerate"] = {"concurrency": max(1, round(best["concurrency"] / num_shards))}
    return {**best, "sweep": sweep}, overlay


def pick_stream_interval(clients: list[dict]) -> int | None:
    """The ``regenerate.stream_interval`` of the stage's own client load that kept the most
    tokens a second, when loads at more than one interval ran on the same server; else None."""
    streamed = [client for client in clients if client.get("streamed") and client.get("stream_interval")]
    if len({client["stream_interval"] for client in streamed}) < 2:
        return None
    return max(streamed, key=lambda client: client["kept_tokens_per_s"])["stream_interval"]


def server_settings(entry: dict) -> str:
    """A ceiling's environment and flags beyond the config's, as the sweep entry spelled them."""
    words = [f"{name}={value}" for name, value in entry.get("server_env", {}).items()] + list(entry.get("server_flags", []))
    return " ".join(words) or "(the config flags alone)"


def cmd_pick(options) -> int:
    import yaml

    from eaglenest import plan
    from eaglenest.node.recon.config import load_config

    config = load_config(REPO, options.config)
    ceilings = [json.loads(Path(path).read_text()) for path in options.ceilings if Path(path).exists()]
    if not ceilings:
        print("no ceiling was measured", file=sys.stderr)
        return 1
    sglang = config["extract"]["sglang"]
    best, overlay = pick_ceiling(ceilings, sglang.get("extra_args") or [], plan.num_shards(config), options.base_concurrency,
                                 sglang.get("env"))
    clients = [json.loads(Path(path).read_text()) for path in options.clients or [] if Path(path).exists()]
    interval = pick_stream_interval(clients)
    if interval is not None:  # the stage's own client was faster at another chunk size
        overlay.setdefault("regenerate", {})["stream_interval"] = interval
        best["workflow_clients"] = [{key: client.get(key) for key in ("stream_interval", "tokens_per_s", "kept_tokens_per_s")}
                                    for client in clients]
    Path(options.out).write_text(json.dumps(best, indent=1) + "\n")
    Path(options.overlay).write_text(
        "# The regeneration server's flags: the ceiling sweep's fastest (benchmarks/sglang_regenerate.py pick)\n"
        + yaml.safe_dump(overlay, sort_keys=False))
    for entry in best["sweep"]:
        print(f"{entry['tokens_per_s']:>10} tok/s  {entry['concurrency']:>4} in flight  {server_settings(entry)}")
    print(f"picked: {server_settings(best)}, {best['concurrency']} in flight")
    return 0


LOG_LINE = re.compile(r"^\[(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]]*\] (?P<kind>Prefill|Decode) batch(?P<rest>.*)$")


def server_schedule(log_path: Path, decode_log_interval: int = 40, window_s: int = 60) -> dict:
    """The scheduling an SGLang server's log records. Each prefill pass logs one ``Prefill
    batch`` line; a ``Decode batch`` line is logged every ``decode_log_interval`` decode steps
    (SGLang's ``--decode-log-interval``, 40 by default), so decode steps are counted from them.
    ``windows``: the same per ``window_s`` seconds of the log, so that a rate of arriving
    requests that stays flat while the running batch swings shows itself."""
    def number(rest: str, key: str) -> float | None:
        found = re.search(rf"{re.escape(key)}: ([\d.]+)", rest)
        return float(found.group(1)) if found else None

    prefill_passes = prefill_requests = new_tokens = cached_tokens = decode_lines = 0
    running, throughput, times = [], [], []
    windows: dict[int, dict] = {}
    start = None
    with open(log_path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            found = LOG_LINE.match(line)
            if not found:
                continue
            times.append(found["time"])
            seconds = datetime.strptime(found["time"], "%Y-%m-%d %H:%M:%S").timestamp()
            start = seconds if start is None else start
            window = windows.setdefault(int((seconds - start) // window_s),
                                        {"requests": 0, "prompt_tokens": 0, "running": [], "throughput": []})
            rest = found["rest"]
            if found["kind"] == "Prefill":
                prefill_passes += 1
                requests = int(number(rest, "#new-seq") or 0)
                new, cached = int(number(rest, "#new-token") or 0), int(number(rest, "#cached-token") or 0)
                prefill_requests += requests
                new_tokens += new
                cached_tokens += cached
                window["requests"] += requests
                window["prompt_tokens"] += new + cached
            else:
                decode_lines += 1
                running.append(number(rest, "#running-req") or 0)
                throughput.append(number(rest, "gen throughput (token/s)") or 0)
                window["running"].append(running[-1])
                window["throughput"].append(throughput[-1])
    decode_steps = decode_lines * decode_log_interval

    def mean(values: list) -> float | None:
        return round(sum(values) / len(values), 1) if values else None

    per_window = [{"from_s": index * window_s, "requests_per_s": round(w["requests"] / window_s, 1),
                   "prompt_tokens_per_request": round(w["prompt_tokens"] / w["requests"]) if w["requests"] else None,
                   "mean_running_requests": mean(w["running"]), "mean_logged_gen_tokens_per_s": mean(w["throughput"])}
                  for index, w in sorted(windows.items())]
    return {
        "prefill_passes": prefill_passes,
        "requests_per_prefill_pass": round(prefill_requests / prefill_passes, 2) if prefill_passes else None,
        "prefill_new_tokens": new_tokens,
        "prefix_cache_hit": round(cached_tokens / (cached_tokens + new_tokens), 3) if new_tokens + cached_tokens else None,
        "decode_steps": decode_steps,
        "prefill_passes_per_decode_step": round(prefill_passes / decode_steps, 3) if decode_steps else None,
        "mean_running_requests": round(sum(running) / len(running), 1) if running else None,
        "highest_logged_gen_tokens_per_s": max(throughput) if throughput else None,
        "first_line": times[0] if times else None,
        "last_line": times[-1] if times else None,
        "window_s": window_s,
        "windows": per_window,
    }


def cmd_schedule(options) -> int:
    schedule = server_schedule(Path(options.log), options.decode_log_interval, options.window_s)
    if options.into:  # a ceiling's result: the schedule of the server that answered it
        into = Path(options.into)
        if into.exists():
            into.write_text(json.dumps({**json.loads(into.read_text()), "schedule": schedule}, indent=1) + "\n")
    print(json.dumps(schedule, indent=1))
    return 0


def ready_record(record: Path, timeout_s: float) -> dict | None:
    """The service record of the workflow's server once it says ``ready``; None when it
    says the server failed or stopped, or after ``timeout_s``."""
    from eaglenest.sglang import launch

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        fields = launch.read_service_record(record) or {}
        if fields.get("state") == "ready":
            return fields
        if fields.get("state") in ("failed", "stopped"):
            return None
        time.sleep(0.2)
    return None


def watch_ready(record: Path, out: Path, timeout_s: float = 1800) -> float | None:
    """Wait until the service record of the workflow's server says ``ready``; write the
    time (epoch seconds) to ``out``: generation starts there."""
    if ready_record(record, timeout_s) is None:
        return None
    ready = time.time()
    out.write_text(f"{ready}\n")
    return ready


def server_url(options) -> str | None:
    """``--url``, or the URL in ``--record`` (the workflow server's service record) once it
    says ready; None (with the reason on stderr) when it never does."""
    if options.url is not None:
        return options.url
    record = ready_record(Path(options.record), options.timeout_s)
    if record is None:
        print(f"no ready server in {options.record}", file=sys.stderr)
        return None
    return record["url"]


def wait_for_file(path: Path, timeout_s: float) -> bool:
    """Whether ``path`` exists within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def cmd_profile(options) -> int:
    """SGLang's own profile of a busy server's next steps: the workflow's (``--record``: once
    its service record says ready) or a plain one (``--url``), ``--after-s`` into its load
    (with ``--wait-for``: after that file appears, the ceiling client's mark of its load)."""
    from eaglenest.sglang import profile

    url = server_url(options)
    if url is None:
        return 1
    result = {"url": url, "after_s": options.after_s, "steps": options.steps}
    try:
        if options.wait_for:  # --after-s counts from the load's start, not from the server's
            result["counted_from"] = options.wait_for
            if not wait_for_file(Path(options.wait_for), options.timeout_s):
                raise RuntimeError(f"no {options.wait_for} after {options.timeout_s:.0f} s: the load never started")
        time.sleep(options.after_s)
        trace = profile.profile_busy(url, options.steps, options.trace_dir, timeout_s=options.timeout_s)
        result.update(trace=str(trace), breakdown=profile.cycle_breakdown(profile.read_trace(trace), skip_steps=1))
    except (OSError, RuntimeError, ValueError) as err:  # the run goes on without its profile
        result["error"] = f"{type(err).__name__}: {err}"
    Path(options.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result.get("breakdown") or result))
    return 0 if "breakdown" in result else 1


def cmd_cpu(options) -> int:
    """Cores per part of a busy regeneration: the workflow's (``--record``: once its server
    is ready) or a ceiling's (``--wait-for``: its client's mark of its load), ``--after-s``
    into it, for ``--seconds``."""
    result = {"after_s": options.after_s}
    if options.record and ready_record(Path(options.record), options.timeout_s) is None:
        result["error"] = f"no ready server in {options.record}"
    elif options.wait_for and not wait_for_file(Path(options.wait_for), options.timeout_s):
        result["error"] = f"no {options.wait_for} after {options.timeout_s:.0f} s: the load never started"
    else:
        time.sleep(options.after_s)
        profiles = pyspy_profiles.record(sglang_processes(), options.seconds, Path(options.pyspy_dir)) if options.pyspy_dir else []
        result.update(sample_cpu(options.seconds))
        if profiles:  # where the time of each SGLang process's threads went, over the same seconds
            result["pyspy"] = pyspy_profiles.finish(profiles)
    Path(options.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if "parts" in result else 1


def watch_metrics(url: str, every_s: float, out: Path, scrapes: int | None = None) -> dict:
    """Scrape the server's metrics every ``every_s`` until it stops answering (or ``scrapes``
    times); after each scrape ``out`` holds the series and the eviction from the first scrape
    to the last (eaglenest.sglang.metrics), so a run stopped at any point keeps what it saw."""
    from eaglenest.sglang import metrics

    series: list[dict] = []
    result: dict = {"url": url, "every_s": every_s, "series": series}
    while scrapes is None or len(series) < scrapes:
        try:
            series.append({"time": round(time.time(), 3), **metrics.read_metrics(url)})
        except OSError as err:  # stopped (or never started with --enable-metrics): keep what there is
            result.setdefault("error" if not series else "ended", f"{type(err).__name__}: {err}")
            break
        if len(series) > 1:
            result["eviction"] = metrics.eviction_summary(series[0], series[-1], series[-1]["time"] - series[0]["time"])
        out.write_text(json.dumps(result, indent=1) + "\n")
        if scrapes is None or len(series) < scrapes:
            time.sleep(every_s)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def cmd_metrics(options) -> int:
    """SGLang's own metrics (started with --enable-metrics) of the workflow's server
    (``--record``: from when it is ready until it stops) or of a plain one (``--url``)."""
    url = server_url(options)
    if url is None:
        return 1
    result = watch_metrics(url, options.every_s, Path(options.out), options.scrapes)
    print(json.dumps(result.get("eviction") or {key: result.get(key) for key in ("url", "error")}))
    return 0 if result["series"] else 1


def regenerate_summary(workdir: Path, run: str, ceiling: dict | None, ready: float | None,
                       server_log: Path | None = None, cpu: dict | None = None, server_metrics: dict | None = None) -> dict:
    """The issue's ``regenerate`` row from a finished (or partly finished) regenerate stage:
    from ``ready`` (when the workflow's server was ready) to the last shard's report."""
    from eaglenest.sglang import metrics
    from eaglenest.stages import regenerate

    reports = sorted((workdir / "results" / run / "regenerated").glob("*/shard-*.report.json"))
    shards = [json.loads(path.read_text()) for path in reports]
    ended = max((path.stat().st_mtime for path in reports), default=None)
    seconds = (ended - ready) if ended is not None and ready is not None else None
    totals = regenerate.totals(shards)
    generated_per_s = round(totals["generated_tokens"] / seconds, 1) if seconds else None
    result = {
        "shards_done": len(shards),
        "conversations": totals["conversations_in"],
        **totals,
        "accounted": totals["regenerated"] + totals["beyond_max_len"] + totals["failed"] + totals["skipped_after_drop"]
        == totals["turns"],
        "seconds": round(seconds, 3) if seconds else None,
        "new_tokens_per_s": round(totals["new_tokens"] / seconds, 1) if seconds else None,
        "generated_tokens_per_s": generated_per_s,
        "transformers_new_tokens_per_s": TRANSFORMERS_NEW_TOKENS_PER_S,
        "failed_turns": totals["failed"],
    }
    if ceiling:
        result["ceiling_tokens_per_s"] = ceiling["tokens_per_s"]
        result["ratio_to_ceiling"] = round(generated_per_s / ceiling["tokens_per_s"], 3) if generated_per_s else None
        result["ceiling"] = ceiling
    client = metrics.client_totals(shards)
    if client and seconds:  # the requests the clients kept in flight, beside the server's batch (schedule)
        result["client"] = {**client, **metrics.client_means(client, seconds)}
    if server_log is not None and server_log.exists():
        result["schedule"] = server_schedule(server_log)
    if cpu is not None:
        result["cpu"] = cpu
    if server_metrics is not None:
        result["server_metrics"] = {key: server_metrics.get(key) for key in ("eviction", "error", "ended")}
        result["server_metrics"]["last"] = server_metrics["series"][-1] if server_metrics.get("series") else None
    return result


GC_SKIP_S = 60  # the server's first minute (warm-up, the clients' ramp) left out of the collector's share


def cmd_summary(options) -> int:
    ceiling = json.loads(Path(options.ceiling).read_text()) if options.ceiling and Path(options.ceiling).exists() else None
    ready = float(Path(options.ready).read_text()) if options.ready and Path(options.ready).exists() else None
    cpu = json.loads(Path(options.cpu).read_text()) if options.cpu and Path(options.cpu).exists() else None
    server_metrics = (json.loads(Path(options.metrics).read_text())
                      if options.metrics and Path(options.metrics).exists() else None)
    result = regenerate_summary(Path(options.workdir), options.run, ceiling, ready,
                                Path(options.server_log) if options.server_log else None, cpu, server_metrics)
    if options.gc_dir and Path(options.gc_dir).is_dir():  # the collector's share, once the load is under way
        from eaglenest.sglang import gc_stats

        result["gc"] = gc_stats.summarize(options.gc_dir, since=ready + GC_SKIP_S if ready else None)
        for row in result["gc"]:
            print(f"gc {row['role']}: {100 * row['gc_fraction']:.2f} % of {row['window_s']} s, "
                  f"collections/s {row['collections_per_s']}, gen-2 mean {row['gen2_mean_ms']} ms", file=sys.stderr)
    Path(options.out).write_text(json.dumps({"regenerate": result}, indent=1) + "\n")
    print("| conversations | turns | regenerated | stopped by repetition | failed | generated tok/s | kept tok/s "
          "| ceiling tok/s | ratio | clients' requests in flight | server's batch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {result['conversations']} | {result['turns']} | {result['regenerated']} | {result['stopped_by_repetition']} "
          f"| {result['failed']} | {result['generated_tokens_per_s']} | {result['new_tokens_per_s']} "
          f"| {result.get('ceiling_tokens_per_s')} | {result.get('ratio_to_ceiling')} "
          f"| {(result.get('client') or {}).get('mean_in_flight')} "
          f"| {(result.get('schedule') or {}).get('mean_running_requests')} |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ceiling = commands.add_parser("ceiling", help="a plain server's generation speed on first-turn prompts")
    ceiling.add_argument("--url", required=True)
    ceiling.add_argument("--conversations", required=True, help="the run's data/conversations.jsonl")
    ceiling.add_argument("--model-path", required=True, help="the target's directory (its tokenizer measures prompts)")
    ceiling.add_argument("--model", default=None, help="the served model name (default: target.name)")
    ceiling.add_argument("--config", nargs="+", required=True, help="the run's config files, in order")
    ceiling.add_argument("--prompts", type=int, default=2048)
    ceiling.add_argument("--concurrency", type=int, default=256)
    ceiling.add_argument("--seed", type=int, default=0)
    ceiling.add_argument("--client", choices=["plain", "workflow"], default="plain",
                         help="plain: one unstreamed request per prompt (the engine's ceiling); workflow: the "
                              "regenerate stage's own client, streamed and loop-cut as the config says")
    ceiling.add_argument("--turns", choices=["all", "first"], default="all",
                         help="sample the prompts of every assistant turn (default) or of first turns only")
    ceiling.add_argument("--stream-interval", type=int, default=None,
                         help="--client workflow: regenerate.stream_interval for this load (default: the config's)")
    ceiling.add_argument("--server-flags", default="",
                         help="the flags the server runs with beyond the config's, recorded (--server-flags=\"--a b\")")
    ceiling.add_argument("--server-env", default="",
                         help="NAME=VALUE words the server's environment has beyond the config's, recorded")
    ceiling.add_argument("--load-started", default=None,
                         help="a file written as the first measured request goes out, after the warm-up (profile --wait-for)")
    ceiling.add_argument("--out", required=True)
    pick = commands.add_parser("pick", help="the fastest of several ceilings, and its flags as a config overlay")
    pick.add_argument("--ceilings", nargs="+", required=True)
    pick.add_argument("--config", nargs="+", required=True, help="the run's config files, in order")
    pick.add_argument("--out", required=True)
    pick.add_argument("--overlay", required=True)
    pick.add_argument("--base-concurrency", type=int, default=256, help="the requests in flight the config's own give")
    pick.add_argument("--clients", nargs="*", default=None,
                      help="the stage's own client's loads (ceiling --client workflow) at several --stream-interval: "
                           "the fastest one's goes into the overlay")
    schedule = commands.add_parser("schedule", help="prefill passes, decode steps and batch sizes from a server's log")
    schedule.add_argument("--log", required=True)
    schedule.add_argument("--decode-log-interval", type=int, default=40)
    schedule.add_argument("--window-s", type=int, default=60, help="the length of each window of the per-window rates")
    schedule.add_argument("--into", default=None, help="a JSON file (a ceiling's) to add the schedule to, if it exists")
    summary = commands.add_parser("summary", help="the regenerate stage's row against the ceiling")
    summary.add_argument("--workdir", required=True)
    summary.add_argument("--run", required=True)
    summary.add_argument("--ceiling", default=None)
    summary.add_argument("--ready", default=None, help="the file watch wrote (when the server was ready)")
    summary.add_argument("--server-log", default=None, help="the workflow's server log (see schedule)")
    summary.add_argument("--cpu", default=None, help="what cpu sampled during the workflow's run")
    summary.add_argument("--metrics", default=None, help="what metrics scraped during the workflow's run")
    summary.add_argument("--gc-dir", default=None,
                         help="where the workflow's server wrote its collector's time (EAGLENEST_GC_STATS)")
    summary.add_argument("--out", required=True)
    watch = commands.add_parser("watch", help="write when the workflow's regeneration server is ready")
    watch.add_argument("--record", required=True, help="its service record (results/<run>/sglang/regenerate.json)")
    watch.add_argument("--out", required=True)
    prof = commands.add_parser("profile", help="SGLang's profile of a busy server's next steps, broken down by stage")
    where = prof.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", default=None, help="a server already answering (a ceiling's plain server)")
    where.add_argument("--record", default=None, help="the workflow server's service record: profiled once it is ready")
    prof.add_argument("--after-s", type=float, default=60.0,
                      help="seconds into its load (after ready, with --record; after --wait-for's file appears, with it)")
    prof.add_argument("--wait-for", default=None,
                      help="a file that appears when the load starts (ceiling --load-started); waited for up to --timeout-s")
    prof.add_argument("--steps", type=int, default=32)
    prof.add_argument("--trace-dir", required=True, help="where the server writes its trace")
    prof.add_argument("--timeout-s", type=float, default=1800.0, help="for the record, the --wait-for file and the profile each")
    prof.add_argument("--out", required=True)
    cpu = commands.add_parser("cpu", help="the cores each part of a busy regeneration keeps busy (server processes, clients)")
    when = cpu.add_mutually_exclusive_group(required=True)
    when.add_argument("--record", default=None, help="the workflow server's service record: sampled once it is ready")
    when.add_argument("--wait-for", default=None, help="a file that appears when the load starts (ceiling --load-started)")
    cpu.add_argument("--after-s", type=float, default=60.0, help="seconds into the load before sampling")
    cpu.add_argument("--seconds", type=float, default=30.0, help="how long to sample")
    cpu.add_argument("--timeout-s", type=float, default=1800.0, help="for the record or the --wait-for file")
    cpu.add_argument("--pyspy-dir", default=None,
                     help="also py-spy every SGLang process over the same seconds: raw stacks here, a summary in the output")
    cpu.add_argument("--out", required=True)
    scrape = commands.add_parser("metrics", help="SGLang's own metrics of a busy server (--enable-metrics): radix "
                                                 "cache eviction, batch, KV use")
    server = scrape.add_mutually_exclusive_group(required=True)
    server.add_argument("--url", default=None, help="a server already answering (a ceiling's plain server)")
    server.add_argument("--record", default=None, help="the workflow server's service record: scraped from ready to stop")
    scrape.add_argument("--every-s", type=float, default=20.0)
    scrape.add_argument("--scrapes", type=int, default=None, help="stop after that many (default: until it stops)")
    scrape.add_argument("--timeout-s", type=float, default=1800.0, help="for the record")
    scrape.add_argument("--out", required=True)
    options = parser.parse_args(argv)
    if options.command == "watch":
        return 0 if watch_ready(Path(options.record), Path(options.out)) is not None else 1
    commands = {"ceiling": cmd_ceiling, "pick": cmd_pick, "schedule": cmd_schedule, "summary": cmd_summary,
                "profile": cmd_profile, "cpu": cmd_cpu, "metrics": cmd_metrics}
    return commands[options.command](options)


if __name__ == "__main__":
    raise SystemExit(main())
