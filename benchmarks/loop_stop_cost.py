"""What stopping loops inside SGLang would cost its scheduler per decode step, beside what it
would save (docs/regeneration.md, "Sampling and the repetition stop").

The ``openai`` regeneration backend cuts a looping answer after the server has generated the
rest (``eaglenest.stages.regenerate.first_loop_cut``). SGLang 0.5.14 offers two ways to stop
a request where its loop completes, both run in Python on the scheduler for every request at
every decode step:

* ``stop_regex``: after each step ``Req.update_finish_state`` (``managers/scheduler_components/
  batch_result_processor.py:702``) reaches ``_check_str_based_finish``
  (``managers/schedule_batch.py:1433``), which decodes the output's tail with the tokenizer and
  searches it (``schedule_batch.py:1262-1271``, ``:1374-1376``). A loop needs a backreference,
  which the tail-length bound does not handle: it counts as 2**30 characters
  (``sampling/sampling_params.py:253-297``), so the tail is the whole output so far.
* a custom logit processor (``--enable-custom-logit-processor``): SGLang calls it from the
  sampler with each request's parameters (``layers/sampler.py:783-800``), which carry the
  request itself (``"__req__"``, ``schedule_batch.py:770``); a loop check on its output ids is
  ``loop_cut`` at the newest token, timed as it is and behind a cheaper pre-check.

This script times both checks on this machine's CPU with the target's tokenizer, over real
regenerated answers at every output length they pass through, multiplies by the requests in
flight, and sets that against the decode step of a measured server run and the share of
generated tokens the cut discarded in a measured regeneration run:

    tar -xJf docs/results/sglang-h200-2026-12-03/regenerated-shards-0-2.tar.xz -C /tmp/answers
    python benchmarks/loop_stop_cost.py --tokenizer resources/models/SmolLM2-135M-Instruct \\
        --answers '/tmp/answers/results/*/regenerated/*/shard-*.jsonl' \\
        --engine benchmarks/results/sglang_engine_2026-12-03.json --out benchmarks/results/loop_stop_cost.json

The scheduler runs on the GPU node's CPU, not this one: the per-request times are this CPU's.

It also times the check the client runs instead (``regenerate.stream``): each answer as the
server streams it, a piece every ``--stream-interval`` tokens, through
``eaglenest.stages.regenerate.StreamedLoopCheck``; per answer, per token, and the CPU cores
that takes at the engine's measured tokens per second (the shard jobs', not the scheduler's).
"""

from __future__ import annotations

import argparse
import glob
import json
import platform
import re
import statistics
import time
from pathlib import Path

from eaglenest.stages.regenerate import LOOP_MIN_TOKENS, StreamedLoopCheck, loop_cut, loop_periods

# A span of 6-256 characters three times in a row at the end: the text form of
# repetition_stop 3 (three copies of one span). Its backreference makes SGLang decode the
# whole output at each step (the module docstring).
LOOP_REGEX = re.compile(r"(.{6,256})\1\1$", re.DOTALL)


def prechecked_loop_cut(output_ids: list[int], repeats: int = 3) -> int | None:
    """:func:`loop_cut` only for the spans whose copies all end in the newest token: the
    cheapest exact check in Python we found (most steps fail at the first comparison)."""
    n, last = len(output_ids), output_ids[-1]
    for period in loop_periods(n, repeats):
        if output_ids[n - 1 - period] == last and all(output_ids[n - 1 - r * period] == last for r in range(2, repeats)):
            return loop_cut(output_ids, repeats)
    return None


def assistant_answers(patterns: list[str], limit: int) -> list[str]:
    answers = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            for line in Path(path).read_text().splitlines():
                sample = json.loads(line)
                for k in sample.get("regenerated_turns", []):
                    answers.append(sample["messages"][k]["content"])
                    if len(answers) >= limit:
                        return answers
    if not answers:
        raise SystemExit(f"no regenerated answers in {patterns}")
    return answers


def time_per_call(function, arguments: list, repeats: int) -> float:
    """Mean seconds of one call over ``arguments``, the best of ``repeats`` passes."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for argument in arguments:
            function(argument)
        best = min(best, (time.perf_counter() - start) / len(arguments))
    return best


def measure(tokenizer, answers: list[str], max_new_tokens: int, stride: int, repeats: int, stream_interval: int = 16) -> dict:
    # Each answer at the output lengths it passes through while it is generated (every
    # ``stride``-th), so long outputs weigh as many steps as they take.
    prefixes = []
    for answer in answers:
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"][:max_new_tokens]
        prefixes += [ids[:n] for n in range(LOOP_MIN_TOKENS, len(ids) + 1, stride)]

    def stop_regex_check(output_ids):
        return LOOP_REGEX.search(tokenizer.decode(output_ids)) is not None

    def token_check(output_ids):
        return loop_cut(output_ids, 3) is not None

    def prechecked_token_check(output_ids):
        return prechecked_loop_cut(output_ids, 3) is not None

    # The client's check of a streamed answer (regenerate.stream): the text as the server sends
    # it, a piece every ``stream_interval`` tokens, each piece tokenized again and checked.
    streams = []
    for answer in answers:
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"][:max_new_tokens]
        ends = list(range(stream_interval, len(ids), stream_interval)) + [len(ids)]
        streams.append((len(ids), [tokenizer.decode(ids[:end], skip_special_tokens=True) for end in ends]))

    def streamed_check(stream):
        check = StreamedLoopCheck(tokenizer, 3)
        for text in stream[1]:
            if check.feed(text) is not None:
                return True
        return False

    per_answer = time_per_call(streamed_check, streams, repeats)
    streamed_tokens = statistics.fmean(tokens for tokens, _ in streams)
    return {
        "answers": len(answers),
        "stream_interval": stream_interval,
        "client_streamed_check_us_per_answer": round(per_answer * 1e6, 1),
        "client_streamed_check_us_per_token": round(per_answer * 1e6 / streamed_tokens, 2),
        "checked_lengths": len(prefixes),
        "mean_output_tokens": round(statistics.fmean(len(p) for p in prefixes), 1),
        "stop_regex_us": round(time_per_call(stop_regex_check, prefixes, repeats) * 1e6, 2),
        "token_check_us": round(time_per_call(token_check, prefixes, repeats) * 1e6, 2),
        "prechecked_token_check_us": round(time_per_call(prechecked_token_check, prefixes, repeats) * 1e6, 2),
    }


def engine_figures(path: Path) -> dict:
    """The decode step and the cut share, from a measured regeneration run's results file."""
    results = json.loads(path.read_text())
    regenerate = results["regenerate"]
    sweep = results.get("regenerate_ceiling_sweep")
    if sweep:  # the fastest plain server: its requests in flight share its tokens per second
        fastest = max(sweep["sweep"], key=lambda entry: entry["tokens_per_s"])
        in_flight, tokens_per_s, source = fastest["concurrency"], fastest["tokens_per_s"], "regenerate_ceiling_sweep"
    else:
        in_flight, tokens_per_s, source = 256, regenerate["ceiling_tokens_per_s"], "regenerate"
    return {
        "in_flight": in_flight,
        "tokens_per_s": tokens_per_s,
        "step_ms": round(1e3 * in_flight / tokens_per_s, 2),
        "step_source": f"{path}:{source}",
        "cut_share": round(1 - regenerate["new_tokens"] / regenerate["generated_tokens"], 4),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="the target's folder (its tokenizer.json)")
    parser.add_argument("--answers", nargs="+", required=True, help="regenerated shard files (glob patterns)")
    parser.add_argument("--engine", required=True, help="a sglang_engine_<date>.json with a regenerate run")
    parser.add_argument("--limit", type=int, default=400, help="answers to time")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-interval", type=int, default=16, help="tokens per streamed piece (SGLang's --stream-interval)")
    parser.add_argument("--out", required=True)
    options = parser.parse_args(argv)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(options.tokenizer)
    cost = measure(tokenizer, assistant_answers(options.answers, options.limit), options.max_new_tokens,
                   options.stride, options.repeats, options.stream_interval)
    engine = engine_figures(Path(options.engine))
    rows = []
    for name, key in (("stop_regex (decode + search)", "stop_regex_us"),
                      ("logit processor: loop_cut", "token_check_us"),
                      ("logit processor: pre-checked loop_cut", "prechecked_token_check_us")):
        per_step_ms = cost[key] * engine["in_flight"] / 1e3
        rows.append({"check": name, "per_request_us": cost[key], "per_step_ms": round(per_step_ms, 2),
                     "share_of_step": round(per_step_ms / engine["step_ms"], 3)})
    result = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
              "regex": LOOP_REGEX.pattern, **cost, "engine": engine, "checks": rows,
              # The streamed check runs in the shard jobs, not the scheduler: CPU cores at the run's rate.
              "client_streamed_check_cores": round(cost["client_streamed_check_us_per_token"] * engine["tokens_per_s"] / 1e6, 2)}
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{cost['answers']} answers, {cost['checked_lengths']} output lengths (mean {cost['mean_output_tokens']} tokens); "
          f"decode step {engine['step_ms']} ms at {engine['in_flight']} in flight; the cut discarded "
          f"{engine['cut_share']:.1%} of generated tokens")
    print(f"{'check':<36}{'us/request':>12}{'ms/step':>10}{'of step':>10}")
    for row in rows:
        print(f"{row['check']:<36}{row['per_request_us']:>12}{row['per_step_ms']:>10}{row['share_of_step']:>10.1%}")
    print(f"client, streamed answers (a piece every {cost['stream_interval']} tokens): "
          f"{cost['client_streamed_check_us_per_answer']} us an answer, {cost['client_streamed_check_us_per_token']} us a token, "
          f"{result['client_streamed_check_cores']} cores at {engine['tokens_per_s']:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
