"""SGLang's own profile of its decoding steps, and what one step (a speculative cycle, or a
plain decode step) costs in it, stage by stage.

SGLang profiles its scheduler with the torch profiler on request (0.5.14, read in its source):
``POST /start_profile`` with ``num_steps`` profiles that many forward steps, stops by itself
and writes a Chrome trace ``<profile_id>-TP-0.trace.json.gz`` into ``output_dir``
(``srt/managers/io_struct.py:1760-1782``; ``managers/scheduler_components/profiler_manager.py:83-150``
and ``:286-330``). Its spans are torch ``record_function`` names, emitted whenever a profiler
runs (``srt/utils/nvtx_utils.py:84-118``): the scheduler's loop (``scheduler.get_next_batch_to_run``,
``scheduler.run_batch``, ``scheduler.process_batch_result``: ``managers/scheduler.py:2554``,
``:3144``, ``:3366``) and, in an EAGLE server, the draft stages ``draft`` and ``draft_extend``
(``speculative/eagle_worker_v2.py:1095``, ``:1134``, ``:1155``); verification is the rest of
``scheduler.run_batch``.

:func:`cycle_breakdown` reads such a trace: per forward step, the CPU time of each span
(``verify`` = run_batch less the draft stages), and the GPU time of the kernels each span
launched (a kernel belongs to the innermost span around the CUDA runtime call that launched
it, matched by the trace's correlation ids). Each model forward also leaves a span named for
its batch (``step[DECODE bs=620]``, ``step[EXTEND bs=33 toks=1845]``:
``model_executor/model_runner.py:2917`` and ``:3256-3263``), so the breakdown also says, per
forward mode, how many of the profiled steps were of it, their batch sizes and wall time.
"""

from __future__ import annotations

import gzip
import json
import re
import threading
import time
import urllib.request
from pathlib import Path

RUN_BATCH = "scheduler.run_batch"
DRAFT_STAGES = ("draft", "draft_extend")
SPANS = ("scheduler.get_next_batch_to_run", RUN_BATCH, "scheduler.process_batch_result", *DRAFT_STAGES)
# A model forward's span: its forward mode and numbers (bs, toks for an EXTEND, ...).
STEP_SPAN = re.compile(r"step\[(?P<mode>[A-Z_]+)(?P<fields>(?: \w+=\d+)*)\]")
UNANNOTATED = "unannotated"  # a step with no forward span in it (an SGLang that writes none)


def _post(url: str, payload: dict, timeout_s: float) -> bytes:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read()


def _start_request(output_dir: Path, steps: int) -> dict:
    return {"output_dir": str(output_dir), "num_steps": steps, "activities": ["CPU", "GPU"], "with_stack": False,
            "record_shapes": False}


def _trace_dir(output_dir: str | Path) -> tuple[Path, set]:
    """The directory the server is to write its trace into, made, and the traces already there."""
    output_dir = Path(output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    return output_dir, set(output_dir.glob("*.trace.json*"))


def _new_trace(output_dir: Path, before: set, steps: int, trace_wait_s: float) -> Path:
    """The trace the server exports after its last profiled step (not one of ``before``)."""
    deadline = time.monotonic() + trace_wait_s
    while True:
        new = sorted(set(output_dir.glob("*.trace.json*")) - before, key=lambda p: p.stat().st_mtime)
        if new and _readable(new[-1]):
            return new[-1]
        if time.monotonic() > deadline:
            raise RuntimeError(f"no trace in {output_dir} {trace_wait_s:.0f} s after {steps} profiled steps")
        time.sleep(0.5)


def profile_steps(url: str, steps: int, output_dir: str | Path, prompt_ids: list[int], timeout_s: float,
                  trace_wait_s: float = 120.0) -> Path:
    """Profile ``steps`` forward steps of the server at ``url`` while it answers one prompt
    alone (greedy, ``ignore_eos``, long enough to cover them); the trace file it wrote, waited
    for up to ``trace_wait_s`` after the answer."""
    output_dir, before = _trace_dir(output_dir)
    base = url.rstrip("/")
    errors = []

    def start():  # may answer only once the steps are profiled
        try:
            _post(base + "/start_profile", _start_request(output_dir, steps), timeout_s)
        except Exception as err:  # reported below, once the generation is done
            errors.append(err)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    time.sleep(1.0)  # the profiler is set up before the request's first step
    if errors:
        raise RuntimeError(f"{base}/start_profile: {errors[0]}")
    # Enough tokens for ``steps`` forward steps even when each step accepts several.
    _post(base + "/generate", {"input_ids": prompt_ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 16 * steps, "ignore_eos": True}}, timeout_s)
    starter.join(timeout_s)
    if errors:
        raise RuntimeError(f"{base}/start_profile: {errors[0]}")
    return _new_trace(output_dir, before, steps, trace_wait_s)


def profile_busy(url: str, steps: int, output_dir: str | Path, timeout_s: float, trace_wait_s: float = 120.0) -> Path:
    """Profile the next ``steps`` forward steps of a server busy with others' requests (the
    workflow's regeneration server, or a plain one under a ceiling's load), sending none of
    its own; the trace file it wrote."""
    output_dir, before = _trace_dir(output_dir)
    try:
        _post(url.rstrip("/") + "/start_profile", _start_request(output_dir, steps), timeout_s)
    except OSError as err:  # HTTPError, URLError, timeouts
        raise RuntimeError(f"{url.rstrip('/')}/start_profile: {err}") from err
    return _new_trace(output_dir, before, steps, trace_wait_s)


def _readable(path: Path) -> bool:
    try:
        read_trace(path)
        return True
    except (OSError, EOFError, ValueError):
        return False


def read_trace(path: str | Path) -> list[dict]:
    """The events of a Chrome trace as the torch profiler exports it (gzipped or not)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def cycle_breakdown(events: list[dict], skip_steps: int = 1) -> dict:
    """Per forward step (a ``scheduler.run_batch``): the CPU milliseconds of each span, and
    the GPU milliseconds of the kernels each launched, over the profiled window after the
    first ``skip_steps`` steps (:func:`profile_steps` profiles from before its request
    arrives, so its first step is the prompt's prefill)."""
    # CPU-side record_function spans only (torch also writes a gpu_user_annotation twin).
    spans = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") in SPANS),
                   key=lambda e: e["ts"])
    run_batches = [e for e in spans if e["name"] == RUN_BATCH]
    begin = float("-inf")
    if skip_steps:
        if len(run_batches) <= skip_steps:
            raise ValueError(f"the trace has {len(run_batches)} {RUN_BATCH} spans, none after the first {skip_steps}")
        begin = run_batches[skip_steps - 1]["ts"] + run_batches[skip_steps - 1]["dur"]
        spans = [e for e in spans if e["ts"] >= begin]
    steps = sum(1 for e in spans if e["name"] == RUN_BATCH)
    if not steps:
        raise ValueError(f"the trace has no {RUN_BATCH} span: not a profile of SGLang's scheduler")
    cpu = {name: sum(e["dur"] for e in spans if e["name"] == name) / 1e3 / steps for name in SPANS}
    drafting = any(cpu[name] for name in DRAFT_STAGES)
    if drafting:
        cpu["verify"] = cpu[RUN_BATCH] - sum(cpu[name] for name in DRAFT_STAGES)

    # The innermost span (by thread) around each CUDA runtime call names its kernels' stage.
    by_thread: dict[tuple, list[dict]] = {}
    for e in spans:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    stage_of_correlation = {}
    for e in events:
        if e.get("cat") != "cuda_runtime" or "correlation" not in e.get("args", {}) or e["ts"] < begin:
            continue
        around = [s for s in by_thread.get((e.get("pid"), e.get("tid")), []) if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
        stage_of_correlation[e["args"]["correlation"]] = min(around, key=lambda s: s["dur"])["name"] if around else "other"
    gpu: dict[str, float] = {}
    for e in events:
        correlation = e.get("args", {}).get("correlation")
        if e.get("cat") == "kernel" and e.get("ph") == "X" and correlation in stage_of_correlation:
            stage = stage_of_correlation[correlation]  # launched inside the window
            if stage == RUN_BATCH and drafting:
                stage = "verify"
            gpu[stage] = gpu.get(stage, 0.0) + e["dur"] / 1e3 / steps
    window_end = max(e["ts"] + e["dur"] for e in spans)
    window = (window_end - min(e["ts"] for e in spans)) / 1e3
    return {
        "steps": steps,
        "skipped_steps": skip_steps,
        "wall_ms_per_step": round(window / steps, 4),
        "cpu_ms_per_step": {name: round(value, 4) for name, value in cpu.items()},
        "gpu_ms_per_step": {name: round(value, 4) for name, value in sorted(gpu.items())},
        "gpu_busy_ms_per_step": round(sum(gpu.values()), 4),
        "modes": mode_breakdown(spans, _step_spans(events, begin), window_end),
    }


def _step_spans(events: list[dict], begin: float) -> list[dict]:
    """The model forwards' spans in the window, each with its parsed ``mode`` and ``fields``."""
    found = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "user_annotation" or e["ts"] < begin:
            continue  # torch's gpu_user_annotation twin is left out, as for the stages
        named = STEP_SPAN.fullmatch(e.get("name", ""))
        if named:
            fields = {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", named["fields"])}
            found.append({**e, "mode": named["mode"], "fields": fields})
    return sorted(found, key=lambda e: e["ts"])


def _forward_of(run_batch: dict, step_spans: list[dict], draft_spans: list[dict]) -> dict | None:
    """The target's forward in one step: the first forward span inside ``run_batch`` (same
    thread) that is not the drafter's (inside a draft stage)."""
    def inside(inner, outer):
        same_thread = (inner.get("pid"), inner.get("tid")) == (outer.get("pid"), outer.get("tid"))
        return same_thread and outer["ts"] <= inner["ts"] <= outer["ts"] + outer["dur"]

    return next((s for s in step_spans if inside(s, run_batch) and not any(inside(s, d) for d in draft_spans)), None)


def mode_breakdown(spans: list[dict], step_spans: list[dict], window_end: float) -> dict:
    """Per forward mode (DECODE, EXTEND, TARGET_VERIFY, ... as SGLang names them): the
    profiled steps of it, their mean batch size (and extend tokens, where named) and wall
    milliseconds; a step's wall time runs from its ``scheduler.run_batch`` to the next one's
    (the last one's: to the window's end), so a mode's share of the window shows."""
    run_batches = sorted((e for e in spans if e["name"] == RUN_BATCH), key=lambda e: e["ts"])
    draft_spans = [e for e in spans if e["name"] in DRAFT_STAGES]
    ends = [e["ts"] for e in run_batches[1:]] + [window_end]
    totals: dict[str, dict] = {}
    for run_batch, end in zip(run_batches, ends):
        forward = _forward_of(run_batch, step_spans, draft_spans)
        mode = totals.setdefault(forward["mode"] if forward else UNANNOTATED, {"steps": 0, "wall_us": 0.0, "fields": {}})
        mode["steps"] += 1
        mode["wall_us"] += end - run_batch["ts"]
        for key, value in (forward["fields"] if forward else {}).items():
            mode["fields"][key] = mode["fields"].get(key, 0) + value
    return {name: _mode_means(total) for name, total in sorted(totals.items())}


def _mode_means(total: dict) -> dict:
    means = {"steps": total["steps"], "wall_ms_per_step": round(total["wall_us"] / 1e3 / total["steps"], 4)}
    names = {"bs": "mean_batch_size", "toks": "mean_extend_tokens"}  # SGLang's short names, spelled out
    for key, value in total["fields"].items():
        means[names.get(key, f"mean_{key}")] = round(value / total["steps"], 2)
    return means
