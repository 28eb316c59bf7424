"""eaglenest.sglang.profile: the per-step breakdown of a torch profiler trace with SGLang's span
names (a real trace of this process, exported as SGLang's profiler exports it)."""

from __future__ import annotations

import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pathlib import Path

from eaglenest.formats import atomic
from eaglenest.sglang import profile as sglang_profile


def busy(ms: float) -> None:
    """CPU work of about ``ms`` milliseconds (torch ops, so the trace holds them too)."""
    x = torch.ones(64, 64)
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        x = x @ x / 64


def scheduler_steps(steps: int, drafting: bool, took: dict | None = None) -> None:
    """Spans named as SGLang 0.5.14's scheduler, EAGLE worker and model runner name theirs, the
    first step a prefill without drafting; ``took`` collects the wall milliseconds of each span
    inside the profiled window (after the first step's ``run_batch``, so the first step's
    ``process_batch_result`` too, as SGLang's overlap loop handles a batch's result after
    launching the next), as this process measured them around the span (a busy machine
    stretches them; the trace must say what they took, not what they were meant to take)."""
    def timed(name: str, step: int):
        class Timer:
            def __enter__(self):
                self.span = record_function(name)
                self.span.__enter__()
                self.began = time.perf_counter()

            def __exit__(self, *exc):
                elapsed = (time.perf_counter() - self.began) * 1e3
                self.span.__exit__(*exc)
                if took is not None and (step or name == "scheduler.process_batch_result"):
                    took.setdefault(name, []).append(elapsed)
        return Timer()

    for step in range(steps):
        with timed("scheduler.get_next_batch_to_run", step):
            busy(0.5)
        with timed("scheduler.run_batch", step):
            if drafting and step:
                with timed("draft", step), record_function("step[DECODE bs=1]"):  # the drafter's forward
                    busy(3)
            forward = "step[EXTEND bs=1 toks=3]" if not step else "step[TARGET_VERIFY bs=1]" if drafting else "step[DECODE bs=1]"
            with record_function(forward):
                busy(2)  # verify (or the plain forward)
            if drafting and step:
                with timed("draft_extend", step):
                    busy(1)
        with timed("scheduler.process_batch_result", step):
            busy(0.5)


def traced(tmp_path, steps: int, drafting: bool, took: dict | None = None):
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        scheduler_steps(steps, drafting, took)
    path = tmp_path / "trace.json"
    profiler.export_chrome_trace(str(path))
    gzipped = tmp_path / "0-TP-0.trace.json.gz"  # SGLang's name and compression
    gzipped.write_bytes(gzip.compress(path.read_bytes()))
    return gzipped


def test_a_speculative_servers_steps_are_split_into_draft_verify_and_scheduler(tmp_path):
    took: dict = {}
    events = sglang_profile.read_trace(traced(tmp_path, 9, drafting=True, took=took))
    breakdown = sglang_profile.cycle_breakdown(events)
    assert breakdown["steps"] == 8 and breakdown["skipped_steps"] == 1  # the prefill is left out
    cpu = breakdown["cpu_ms_per_step"]
    # Each stage as long as it took per step (within the profiler's own bookkeeping), and at
    # least what it was made to take.
    for name, durations in took.items():
        assert len(durations) == (9 if name == "scheduler.process_batch_result" else 8)
        assert cpu[name] == pytest.approx(sum(durations) / 8, abs=0.3), (name, cpu, took)
    assert cpu["draft"] > 2.5 and cpu["draft_extend"] > 0.8 and cpu["verify"] > 1.5, cpu
    assert cpu["verify"] == pytest.approx(cpu["scheduler.run_batch"] - cpu["draft"] - cpu["draft_extend"], abs=1e-3)
    assert cpu["scheduler.process_batch_result"] > 0.4
    assert breakdown["wall_ms_per_step"] >= sum(v for k, v in cpu.items() if k != "verify" and k not in ("draft", "draft_extend"))
    assert breakdown["gpu_busy_ms_per_step"] == 0  # a CPU-only trace launches no kernels
    # The steps are the target's verify forwards; the drafter's forwards inside them are not steps.
    (verify,) = breakdown["modes"].values()
    assert list(breakdown["modes"]) == ["TARGET_VERIFY"] and verify["steps"] == 8 and verify["mean_batch_size"] == 1
    assert verify["wall_ms_per_step"] > 6


def test_kernels_count_for_the_span_that_launched_them(tmp_path):
    """GPU kernels match their launching CUDA runtime call by correlation id, and that call's
    innermost span names the stage; kernels launched during the skipped prefill are left out."""
    events = sglang_profile.read_trace(traced(tmp_path, 3, drafting=True))
    spans = {name: [e for e in events if e.get("cat") == "user_annotation" and e["name"] == name]
             for name in ("draft", "scheduler.run_batch", "scheduler.process_batch_result")}
    launches = [("draft", spans["draft"][0], 0.25), ("draft", spans["draft"][1], 0.25),
                ("verify", spans["scheduler.run_batch"][1], 1.0), ("verify", spans["scheduler.run_batch"][2], 1.0),
                ("prefill", spans["scheduler.run_batch"][0], 7.0)]
    pid, tid = spans["draft"][0]["pid"], spans["draft"][0]["tid"]
    for correlation, (_, span, kernel_ms) in enumerate(launches, start=1):
        at = span["ts"] + span["dur"] - 1 if span["name"] == "scheduler.run_batch" else span["ts"] + 1
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": pid, "tid": tid, "ts": at,
                       "dur": 1, "args": {"correlation": correlation}})
        events.append({"ph": "X", "cat": "kernel", "name": "kernel", "pid": 0, "tid": 7, "ts": at + 5,
                       "dur": kernel_ms * 1e3, "args": {"correlation": correlation}})
    breakdown = sglang_profile.cycle_breakdown(events)
    assert breakdown["steps"] == 2
    assert breakdown["gpu_ms_per_step"] == {"draft": 0.25, "verify": 1.0}
    assert breakdown["gpu_busy_ms_per_step"] == 1.25


def test_a_plain_servers_steps_have_no_draft_stages_and_a_foreign_trace_is_refused(tmp_path):
    breakdown = sglang_profile.cycle_breakdown(sglang_profile.read_trace(traced(tmp_path, 5, drafting=False)))
    assert breakdown["steps"] == 4 and "verify" not in breakdown["cpu_ms_per_step"]
    assert list(breakdown["modes"]) == ["DECODE"] and breakdown["modes"]["DECODE"]["steps"] == 4
    assert breakdown["cpu_ms_per_step"]["draft"] == 0
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        busy(1)
    profiler.export_chrome_trace(str(tmp_path / "other.json"))
    with pytest.raises(ValueError, match="scheduler.run_batch"):
        sglang_profile.cycle_breakdown(json.loads((tmp_path / "other.json").read_text())["traceEvents"])


def span(name: str, ts_ms: float, dur_ms: float, tid: int = 1) -> dict:
    """One CPU-side record_function span as torch's Chrome trace writes it (microseconds)."""
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 100, "tid": tid, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3}


def test_the_steps_are_told_apart_by_forward_mode_with_their_batch_sizes_and_wall_time():
    """Each forward step's span names its mode and batch (SGLang's model runner): the breakdown
    counts the profiled steps of each mode, with their mean batch size (and extend tokens) and
    wall time from one run_batch to the next, so a window of prefills shows as one."""
    steps = [(0, 5, "step[EXTEND bs=1 toks=9]"),  # the skipped first step
             (10, 4, "step[DECODE bs=620]"), (20, 4, "step[DECODE bs=600]"),
             (30, 25, "step[EXTEND bs=33 toks=1845]"), (60, 3, "step[EXTEND bs=3 toks=155]"),
             (70, 2, None)]  # a step whose forward wrote no span
    events = []
    for start, dur, forward in steps:
        events.append(span("scheduler.get_next_batch_to_run", start, 0.5))
        events.append(span("scheduler.run_batch", start + 1, dur))
        if forward:
            events.append(span(forward, start + 1.5, dur - 1))
            # torch's GPU-side twin of the same span, and one on another thread: neither is a step.
            events.append({**span(forward, start + 1.5, dur - 1), "cat": "gpu_user_annotation"})
            events.append(span("step[DECODE bs=7]", start + 1.5, 0.1, tid=2))
    events.append(span("scheduler.process_batch_result", 73, 2))  # the window ends at 75 ms
    breakdown = sglang_profile.cycle_breakdown(events)
    assert breakdown["steps"] == 5
    assert breakdown["modes"] == {
        "DECODE": {"steps": 2, "wall_ms_per_step": 10.0, "mean_batch_size": 610.0},
        "EXTEND": {"steps": 2, "wall_ms_per_step": 20.0, "mean_batch_size": 18.0, "mean_extend_tokens": 1000.0},
        "unannotated": {"steps": 1, "wall_ms_per_step": 4.0},
    }


class ProfilingServer:
    """SGLang's profiling choreography over HTTP: /start_profile answers once the steps are
    profiled, and the trace appears in its output_dir; the profiled steps are the next
    /generate's (a real torch trace of SGLang-named spans). ``write_trace`` False: a server
    that never exports one."""

    def __init__(self, write_trace: bool = True):
        self.requests, self.done = [], threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, body: bytes):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append((self.path, request))
                if self.path == "/start_profile":
                    owner.profile = request
                    owner.done.wait(30)
                    return self._answer(b"Start profiling.\n")
                with profile(activities=[ProfilerActivity.CPU]) as profiler:
                    scheduler_steps(owner.profile["num_steps"], drafting=True)
                if write_trace:
                    trace = Path(owner.profile["output_dir"]) / "1764800000-TP-0.trace.json"
                    profiler.export_chrome_trace(str(trace))
                    trace.with_suffix(".json.gz").write_bytes(gzip.compress(trace.read_bytes()))
                    trace.unlink()
                owner.done.set()
                return self._answer(json.dumps({"output_ids": [1] * 8, "meta_info": {}}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_profile_is_asked_for_before_one_long_greedy_request_and_its_new_trace_is_read(tmp_path):
    server = ProfilingServer()
    (tmp_path / "old-TP-0.trace.json.gz").write_bytes(b"an earlier trace")
    trace = sglang_profile.profile_steps(server.url, 5, tmp_path, [3, 4, 5], timeout_s=30)
    assert trace.name == "1764800000-TP-0.trace.json.gz" and trace.parent == tmp_path.resolve()
    (start, profiled), (generate, request) = server.requests
    assert start == "/start_profile" and profiled["num_steps"] == 5 and profiled["output_dir"] == str(tmp_path.resolve())
    assert generate == "/generate" and request["input_ids"] == [3, 4, 5]
    assert request["sampling_params"] == {"temperature": 0, "max_new_tokens": 80, "ignore_eos": True}
    assert sglang_profile.cycle_breakdown(sglang_profile.read_trace(trace))["steps"] == 4
    server.server.shutdown()


def test_a_server_that_writes_no_trace_is_reported(tmp_path):
    server = ProfilingServer(write_trace=False)
    with pytest.raises(RuntimeError, match="no trace in"):
        sglang_profile.profile_steps(server.url, 3, tmp_path, [3], timeout_s=30, trace_wait_s=1)
    server.server.shutdown()


def others_request_once_profiling_starts(server: ProfilingServer) -> threading.Thread:
    """Someone else's request, sent once the profile was asked for (a busy server's load)."""
    import urllib.request

    def send():
        deadline = time.monotonic() + 30
        while not any(path == "/start_profile" for path, _ in server.requests) and time.monotonic() < deadline:
            time.sleep(0.05)
        body = json.dumps({"input_ids": [7], "sampling_params": {"max_new_tokens": 4}}).encode()
        urllib.request.urlopen(urllib.request.Request(server.url + "/generate", data=body), timeout=30).read()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def test_a_busy_servers_next_steps_are_profiled_without_a_request_of_its_own(tmp_path):
    server = ProfilingServer()
    sender = others_request_once_profiling_starts(server)
    trace = sglang_profile.profile_busy(server.url, 6, tmp_path, timeout_s=30)
    sender.join(30)
    assert [path for path, _ in server.requests] == ["/start_profile", "/generate"]
    assert server.requests[1][1]["input_ids"] == [7]  # the other client's, not a probe
    assert sglang_profile.cycle_breakdown(sglang_profile.read_trace(trace))["steps"] == 5
    server.server.shutdown()


def test_the_regeneration_driver_profiles_the_workflows_server_once_its_record_says_ready(tmp_path):
    """benchmarks/sglang_regenerate.py profile --record: waits for the service record's ready
    state, profiles the server it names, writes the breakdown; a server that cannot profile
    leaves an error in the same file, not a crash."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sglang_regenerate

    server = ProfilingServer()
    record = tmp_path / "regenerate.json"
    record.write_text(json.dumps({"state": "starting"}))

    def ready_soon():
        time.sleep(0.5)
        record.write_text(json.dumps({"state": "ready", "url": server.url}))

    threading.Thread(target=ready_soon, daemon=True).start()
    sender = others_request_once_profiling_starts(server)
    out = tmp_path / "profile-workflow.json"
    assert sglang_regenerate.main(["profile", "--record", str(record), "--after-s", "0", "--steps", "4", "--trace-dir",
                                   str(tmp_path / "traces"), "--timeout-s", "30", "--out", str(out)]) == 0
    sender.join(30)
    result = json.loads(out.read_text())
    assert result["url"] == server.url and result["breakdown"]["steps"] == 3
    assert set(result["breakdown"]["cpu_ms_per_step"]) >= {"scheduler.run_batch", "scheduler.get_next_batch_to_run"}
    assert result["breakdown"]["modes"]["TARGET_VERIFY"]["steps"] == 3
    server.server.shutdown()
    # No profiling route (a server that is not SGLang): the error is recorded, the exit status says so.
    assert sglang_regenerate.main(["profile", "--url", "http://127.0.0.1:9", "--after-s", "0", "--trace-dir",
                                   str(tmp_path / "traces"), "--timeout-s", "5", "--out", str(out)]) == 1
    assert "error" in json.loads(out.read_text())


def test_a_ceilings_profile_waits_for_its_load_to_start_before_counting_its_seconds(tmp_path):
    """benchmarks/sglang_regenerate.py profile --wait-for: no profile is asked for before the
    file the ceiling's client writes as its load starts (after its warm-up) appears; without
    it by --timeout-s, the result says the load never started and nothing was asked."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sglang_regenerate

    server = ProfilingServer()
    load_started = tmp_path / "ceiling-1.load-started"
    asked_before_the_load = []

    def load_starts_soon():
        time.sleep(1.0)
        asked_before_the_load.append(any(path == "/start_profile" for path, _ in server.requests))
        atomic.write_text(load_started, f"{time.time()}\n")

    threading.Thread(target=load_starts_soon, daemon=True).start()
    sender = others_request_once_profiling_starts(server)
    out = tmp_path / "profile-ceiling-1.json"
    common = ["--url", server.url, "--steps", "4", "--trace-dir", str(tmp_path / "traces"), "--out", str(out)]
    assert sglang_regenerate.main(["profile", *common, "--wait-for", str(load_started), "--after-s", "0.2",
                                   "--timeout-s", "30"]) == 0
    sender.join(30)
    assert asked_before_the_load == [False]
    result = json.loads(out.read_text())
    assert result["counted_from"] == str(load_started) and result["breakdown"]["steps"] == 3
    assert float(load_started.read_text()) > 0 and not list(tmp_path.glob("*.partial"))
    server.server.shutdown()
    # A load that never starts: said so, and the server is not asked.
    requests = len(server.requests)
    assert sglang_regenerate.main(["profile", *common, "--wait-for", str(tmp_path / "never"), "--after-s", "0",
                                   "--timeout-s", "0.5"]) == 1
    assert "the load never started" in json.loads(out.read_text())["error"] and len(server.requests) == requests


def test_a_real_sglang_0514_trace_from_the_h200_is_broken_down_by_stage_and_forward_mode():
    """The workflow's regeneration server under load (one H200, 2026-12-04): SGLang's own spans
    and forward annotations as 0.5.14 writes them, read by the same parser."""
    trace = Path(__file__).resolve().parents[1] / "docs" / "results" / "sglang-h200-2026-12-04-regen" / "profile-workflow.trace.json.gz"
    breakdown = sglang_profile.cycle_breakdown(sglang_profile.read_trace(trace))
    assert breakdown["steps"] == 31 and breakdown["skipped_steps"] == 1
    assert set(breakdown["modes"]) == {"EXTEND", "unannotated"} and breakdown["modes"]["EXTEND"]["steps"] == 30
    assert breakdown["modes"]["EXTEND"]["mean_batch_size"] == pytest.approx(5.1, abs=0.05)
    # the scheduler's CPU, not the GPU, takes the step: ~1 ms of kernels in ~45 ms
    assert breakdown["gpu_busy_ms_per_step"] < 2 < 40 < breakdown["wall_ms_per_step"]
    assert sum(breakdown["cpu_ms_per_step"].values()) == pytest.approx(41.4, abs=0.5)
