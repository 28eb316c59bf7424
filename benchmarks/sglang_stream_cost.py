"""What streaming costs SGLang's scheduler per decode step, measured with SGLang's own output
path on the CPU (no GPU, no model): the scheduler's main thread is what bounds the regeneration
server at SmolLM2-135M's size (docs/regeneration.md, fourth run: 1.00 core, with
``process_batch_result`` 9.0 ms a step against 6.7 ms on the same server unstreamed).

After every decode step SGLang hands each running request to its output streamer
(``SchedulerOutputStreamer.stream_output``, ``srt/managers/scheduler_components/output_streamer.py``
in 0.5.14). A request that streams is sent on when its output length hits the stream interval
(``len(output_ids) % interval == 1``, ``:323-336``), one that does not every 50 tokens
(``SGLANG_FORCE_STREAM_INTERVAL``, ``srt/environ.py:344``), a finished one at once; each one sent
adds a row to the step's ``BatchTokenIDOutput`` (``:344-481``: its ids since the last send,
counts, its time stats), which is pickled onto the detokenizer's ZMQ socket
(``output_sender.py:28``). This replays that with SGLang's classes: ``--batch`` real ``Req``
objects decoding one token a step, each finishing at an answer length drawn as the run's
answers end (EOS before the cap, or the cap), a finished one replaced by a fresh one, every
step's payload sent over a real ZMQ IPC socket to a process that drains it. It times
``stream_output`` per step for requests not streamed and streamed at each ``--intervals``.

What it leaves out: the rest of ``process_batch_result`` (the same in every variant), the
detokenizer and the HTTP process (separate processes; each also handles every row sent), the
tokens a loop costs the server while its abort is on the way (the table's loop column
estimates them from the run's counts: a loop is seen at the first chunk after it, half an
interval late on average). The times are this machine's; the rows per step are not.

Run where SGLang imports (the node's environment; on a CPU-only machine SGLang's source with its
Python dependencies on ``PYTHONPATH`` and ``--stub-torchvision``, as for
``benchmarks/sglang_radix_eviction.py``):

    python benchmarks/sglang_stream_cost.py --batch 926 --steps 400 --intervals 16 32 64 128 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import time
from array import array
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

BATCH = 926  # the fourth run's decode batch 300 s in (its profile, profile-workflow-late.json)
MAX_NEW_TOKENS = 384
CAPPED_SHARE = 0.44  # the fourth run's ceiling: 1,800 of 4,096 answers reached the cap
PROMPT_TOKENS = 1_000
# The fourth run (docs/results/sglang-h200-2026-12-05-regen4/): turns stopped for a loop,
# tokens generated, and the stream interval it ran with.
RUN_STOPPED_TURNS = 11_909
RUN_GENERATED_TOKENS = 12_816_635
RUN_INTERVAL = 16


def drain(address: str, ready) -> None:
    """The detokenizer's end of the socket: receive and drop every payload."""
    import zmq

    context = zmq.Context(1)
    socket = context.socket(zmq.PULL)
    socket.bind(address)
    ready.set()
    while True:
        message = socket.recv()
        if message == b"stop":
            return


def answer_length(rng: random.Random) -> int:
    return MAX_NEW_TOKENS if rng.random() < CAPPED_SHARE else rng.randint(1, MAX_NEW_TOKENS - 1)


def measure(batch: int, steps: int, warmup: int, stream: bool, interval: int, address: str, seed: int) -> dict:
    """Decode ``steps`` steps of ``batch`` requests (after ``warmup`` untimed ones) through
    SGLang's output streamer; the seconds and rows sent per step."""
    import zmq
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN, Req
    from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    rng = random.Random(seed)
    context = zmq.Context(1)
    socket = context.socket(zmq.PUSH)
    socket.connect(address)

    class Ranks:  # the ParallelState fields the streamer reads, on one GPU
        dp_rank = None
        attn_tp_rank = 0

    server_args = ServerArgs.__new__(ServerArgs)  # only the two fields the streamer reads
    server_args.stream_interval = interval
    server_args.enable_request_time_stats_logging = False
    class CountingSender(SenderWrapper):  # the rows SGLang put in each step's payload
        rows = 0

        def send_output(self, output, recv_obj=None):
            CountingSender.rows += len(output.rids)
            super().send_output(output, recv_obj)

    streamer = SchedulerOutputStreamer(
        send_to_detokenizer=CountingSender(socket), tree_cache=None, ps=Ranks(), server_args=server_args,
        is_generation=True, spec_algorithm=SpeculativeAlgorithm.NONE, disaggregation_mode=DisaggregationMode.NULL,
        enable_hicache_storage=lambda: False)
    made = 0

    def new_request(progress: int = 0):
        nonlocal made
        made += 1
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_p=0.95)
        prompt = array("q", (rng.randrange(49_152) for _ in range(PROMPT_TOKENS)))
        req = Req(f"r{made}", "", prompt, params, stream=stream, vocab_size=49_152)
        req.target_length = answer_length(rng)
        for _ in range(min(progress, req.target_length - 1)):
            req.output_ids.append(rng.randrange(49_152))
        return req

    # Requests at every stage of their answers, as in a full batch that has run a while.
    running = [new_request(rng.randrange(MAX_NEW_TOKENS)) for _ in range(batch)]
    seconds = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            CountingSender.rows = 0
        for req in running:
            req.output_ids.append(rng.randrange(49_152))
            if len(req.output_ids) >= req.target_length:
                req.finished_reason = (FINISH_LENGTH(length=MAX_NEW_TOKENS) if req.target_length == MAX_NEW_TOKENS
                                       else FINISH_MATCHED_TOKEN(matched=2))
        started = time.perf_counter()
        streamer.stream_output(running, return_logprob=False)
        took = time.perf_counter() - started
        if step >= warmup:
            seconds += took
        running = [req if not req.finished() else new_request() for req in running]
    socket.close(linger=1000)
    context.term()
    return {"stream": stream, "interval": interval if stream else 50, "batch": batch, "steps": steps,
            "ms_per_step": round(seconds / steps * 1e3, 3), "rows_per_step": round(CountingSender.rows / steps, 1)}


def loop_waste(interval: int) -> float:
    """The share of generated tokens a loop costs the server beyond the fourth run's, with
    chunks every ``interval`` tokens instead of 16: half an interval more per stopped turn."""
    return RUN_STOPPED_TURNS * (interval - RUN_INTERVAL) / 2 / RUN_GENERATED_TOKENS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--intervals", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--repeats", type=int, default=3, help="each variant this many times, the fastest kept")
    parser.add_argument("--step-ms", type=float, default=14.76,
                        help="the decode step the fourth run's server took at this batch (its late profile)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stub-torchvision", action="store_true",
                        help="an empty torchvision (CPU-only machines; see sglang_radix_eviction.py)")
    parser.add_argument("--out", default=None)
    options = parser.parse_args(argv)
    if options.stub_torchvision:
        from sglang_radix_eviction import stub_torchvision

        stub_torchvision()
    import sglang

    address = f"ipc://{tempfile.mkdtemp()}/detokenizer"
    ready = multiprocessing.Event()
    drainer = multiprocessing.Process(target=drain, args=(address, ready), daemon=True)
    drainer.start()
    ready.wait(30)
    variants = [(False, 50)] + [(True, interval) for interval in options.intervals]
    results = []
    for stream, interval in variants:
        runs = [measure(options.batch, options.steps, options.warmup, stream, interval, address, options.seed)
                for _ in range(options.repeats)]
        results.append(min(runs, key=lambda run: run["ms_per_step"]))
    import zmq

    context = zmq.Context(1)
    stopper = context.socket(zmq.PUSH)
    stopper.connect(address)
    stopper.send(b"stop")
    drainer.join(10)

    base = next(r for r in results if r["stream"] and r["interval"] == RUN_INTERVAL) if RUN_INTERVAL in options.intervals else None
    print(f"SGLang {sglang.__version__} output path, batch {options.batch}, {options.steps} steps, "
          f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)")
    print("| requests | rows sent a step | ms a step | vs streamed at 16 | loop tokens beyond 16's | step, if the node's CPU is this one |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        name = f"streamed, every {r['interval']}" if r["stream"] else "not streamed (every 50)"
        saved = (base["ms_per_step"] - r["ms_per_step"]) if base else 0.0
        r["ms_saved_vs_16"] = round(saved, 3)
        r["loop_waste_vs_16"] = round(loop_waste(r["interval"]), 4) if r["stream"] else None
        r["predicted_step_ms"] = round(options.step_ms - saved, 2)
        waste = f"{r['loop_waste_vs_16']:+.1%}" if r["stream"] else "(loops run to the end)"
        print(f"| {name} | {r['rows_per_step']} | {r['ms_per_step']} | {-saved:+.2f} ms | {waste} | "
              f"{r['predicted_step_ms']} ms |")
    if options.out:
        Path(options.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "sglang": sglang.__version__, "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "batch": options.batch, "steps": options.steps, "repeats": options.repeats,
            "step_ms_measured": options.step_ms, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
