"""The regeneration stage: the target answers every assistant turn itself.

Tiny random-weight targets sample (temperature 1: greedy decoding of random weights
repeats one whitespace token), the stand-in server answers chat completions over real
HTTP, and the Snakefile runs the stage per shard, killed and resumed for real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from eaglenest import plan
from eaglenest.formats import atomic
from eaglenest.sglang import metrics
from eaglenest.stages import ingest, prepare, regenerate
from conftest import DEFAULT_CONFIG, REPO, run_snakemake, snakemake_command, synthetic_conversations, tiny_workflow_config, wait_until
from test_sglang_protocol import start_standin

SAMPLING = dict(temperature=1.0, max_new_tokens=12, device="cpu", batch_rows=4, retries=2, backoff_s=0.01)


@pytest.fixture
def conversations(tmp_path) -> Path:
    raw = synthetic_conversations(tmp_path / "raw.jsonl", 16, seed=3)
    path = tmp_path / "conversations.jsonl"
    ingest.ingest([{"name": "synthetic", "path": str(raw)}], path, tmp_path / "ingest.json", max_conversations=16, leading_assistant="drop_turn")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def run_shard(conversations, tmp_path, model, name="out", max_len=256, **settings):
    out, report = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.report.json"
    result = regenerate.regenerate_shard(
        conversations, out, report, shard_id=0, num_shards=1, model_path=model, model_name="tiny-llama",
        settings=regenerate.Settings.from_config({**SAMPLING, **settings}), max_len=max_len,
    )
    assert json.loads(report.read_text()) == result
    return read_jsonl(out), result


def assert_accounted(report: dict) -> None:
    """Every assistant turn is regenerated, failed (listed) or past max_len; every
    conversation is written or listed as dropped."""
    assert report["turns"] == report["regenerated"] + report["failed"] + report["beyond_max_len"] + report["skipped_after_drop"]
    assert report["failed"] == len(report["failures"])
    assert report["conversations_in"] == report["conversations_out"] + len(report["dropped_conversations"])


def test_end_of_turn_is_the_chat_templates_marker(tiny_llama):
    tokenizer = prepare.load_tokenizer(tiny_llama)
    assert regenerate.end_of_turn_ids(tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_transformers_backend_answers_every_assistant_turn_and_keeps_the_rest(conversations, tmp_path, tiny_llama):
    originals = {c["sample_id"]: c for c in ingest.read_conversations(conversations)}
    written, report = run_shard(conversations, tmp_path, tiny_llama)
    assert_accounted(report)
    assert report["conversations_out"] == len(originals) == len(written)
    assert report["regenerated"] > 0.8 * report["turns"]
    assert [c["sample_id"] for c in written] == sorted(originals)
    for conversation in written:
        original = originals[conversation["sample_id"]]["messages"]
        assert [m["role"] for m in conversation["messages"]] == [m["role"] for m in original]
        for k, (new, old) in enumerate(zip(conversation["messages"], original)):
            if old["role"] != "assistant":
                assert new == old, "user and system turns stay as they were"
            elif k in conversation["regenerated_turns"]:
                assert new["content"] and "<|im_end|>" not in new["content"]
    # Same settings, same answers: a rerun of a lost shard reproduces it.
    again, _ = run_shard(conversations, tmp_path, tiny_llama, name="again")
    assert again == written


def test_later_turns_are_answered_after_the_regenerated_earlier_ones(conversations, tmp_path, tiny_llama):
    written, _ = run_shard(conversations, tmp_path, tiny_llama)
    multi = next(c for c in written if len(c["regenerated_turns"]) >= 2)
    second = multi["regenerated_turns"][1]
    backend = regenerate.TransformersBackend(tiny_llama, regenerate.Settings.from_config(SAMPLING))
    # The prompt of the second answer holds the first regenerated answer, not the original.
    prompt = prepare.render(backend.tokenizer, multi["messages"][:second], add_generation_prompt=True)
    assert multi["messages"][multi["regenerated_turns"][0]]["content"] in prompt


def test_turns_past_max_len_keep_their_text_and_are_counted(conversations, tmp_path, tiny_llama):
    originals = {c["sample_id"]: c for c in ingest.read_conversations(conversations)}
    written, report = run_shard(conversations, tmp_path, tiny_llama, max_len=40)
    assert report["beyond_max_len"] > 0 and report["failed"] == 0
    assert_accounted(report)
    kept = sum(
        1 for c in written for k, m in enumerate(c["messages"])
        if m["role"] == "assistant" and k not in c["regenerated_turns"] and m == originals[c["sample_id"]]["messages"][k]
    )
    assert kept == report["beyond_max_len"]


def test_batching_bounds_rows_and_tokens(tiny_llama):
    backend = regenerate.TransformersBackend(tiny_llama, regenerate.Settings.from_config({**SAMPLING, "batch_rows": 3, "tokens_per_batch": 200}))
    lengths = [50, 10, 90, 20, 30, 5, 60]
    groups = backend.batches(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) <= 3
        assert len(group) == 1 or len(group) * (longest + 12) <= 200


@pytest.fixture
def chat_server(tmp_path, tiny_llama):
    started = []

    def start(*extra):
        process, url, _ = start_standin(tmp_path, tiny_llama, *extra)
        started.append(process)
        return url

    yield start
    for process in started:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


@pytest.mark.integration
def test_openai_backend_retries_a_server_that_is_warming_up(conversations, tmp_path, tiny_llama, chat_server):
    url = chat_server("--chat-fail-first", "3")
    written, report = run_shard(conversations, tmp_path, tiny_llama, backend="openai", url=url, concurrency=1, retries=3)
    assert_accounted(report)
    assert report["failed"] == 0 and report["retried"] >= 1
    assert report["regenerated"] > 0.8 * report["turns"]


@pytest.mark.integration
@pytest.mark.parametrize("on_failure", ["keep_original", "drop_conversation"])
def test_openai_backend_lists_every_turn_that_keeps_failing(conversations, tmp_path, tiny_llama, chat_server, on_failure):
    originals = {c["sample_id"]: c for c in ingest.read_conversations(conversations)}
    poisoned = {sid for sid, c in originals.items() if any("capital" in m["content"] for m in c["messages"] if m["role"] == "user")}
    assert poisoned, "the fixture must contain prompts the server refuses"
    url = chat_server("--chat-fail-containing", "capital")
    written, report = run_shard(conversations, tmp_path, tiny_llama, backend="openai", url=url, concurrency=2, retries=1,
                                on_failure=on_failure, max_len=2048)
    assert_accounted(report)
    failed_ids = {f["sample_id"] for f in report["failures"]}
    assert failed_ids == poisoned
    assert all(f["attempts"] == 2 and "HTTP 500" in f["error"] for f in report["failures"])
    by_id = {c["sample_id"]: c for c in written}
    if on_failure == "keep_original":
        assert set(by_id) == set(originals)
        for failure in report["failures"]:
            turn = by_id[failure["sample_id"]]["messages"][failure["turn"]]
            assert turn == originals[failure["sample_id"]]["messages"][failure["turn"]]
    else:
        assert set(report["dropped_conversations"]) == poisoned
        assert set(by_id) == set(originals) - poisoned


def test_unreachable_server_fails_every_turn_on_record_without_crashing(conversations, tmp_path, tiny_llama):
    written, report = run_shard(conversations, tmp_path, tiny_llama, backend="openai", url="http://127.0.0.1:9", retries=1)
    assert_accounted(report)
    assert report["regenerated"] == 0 and report["failed"] == report["turns"] - report["beyond_max_len"]
    assert "URLError" in report["failures"][0]["error"]
    assert len(written) == report["conversations_in"]


def test_prepared_key_changes_with_the_answers_not_with_speed_settings():
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    off = plan.prepared_key(config)
    config["regenerate"] = {"enabled": False, "temperature": 0.7}
    assert plan.prepared_key(config) == off, "regeneration off: the key of existing runs stays"
    config["regenerate"] = {"enabled": True, "temperature": 0.0, "batch_rows": 8}
    on = plan.prepared_key(config)
    assert on != off
    config["regenerate"].update(batch_rows=256, device="cuda", concurrency=64, url="http://node:30000")
    assert plan.prepared_key(config) == on
    config["regenerate"]["temperature"] = 0.7
    assert plan.prepared_key(config) != on


def test_a_loop_is_cut_after_its_first_copy_and_short_repeats_are_not_loops():
    sentence = list(range(100, 110))  # a 10-token sentence
    answer = [1, 2, 3] + sentence * 3
    assert regenerate.loop_cut(answer, 3) == 3 + 10
    assert regenerate.cut_loop(answer + sentence[:4], 3) == ([1, 2, 3] + sentence, True)
    # Three equal tokens (12 tokens of copies at most) are no loop: code indents, "...".
    assert regenerate.first_loop_cut([5, 7, 7, 7, 9, 4, 4, 4, 4], 3) is None
    assert regenerate.loop_cut(sentence * 2, 3) is None  # two copies are not three
    assert regenerate.cut_loop(answer, 0) == (answer, False)
    # A long run of one token is a loop once its copies cover 16 tokens: period 6 x 3.
    assert regenerate.first_loop_cut([8] + [0] * 30, 3) == 1 + 6


def test_the_streaming_stop_ends_each_row_where_the_cut_falls():
    import torch

    rows = [[1, 2, 3] + list(range(40, 52)) * 4, list(range(60, 110)), [9] * 3 + [4, 5] * 20]
    width = 5  # prompt tokens in front of the new ones
    stop = regenerate.loop_stopping_criteria(width, 3)
    first_stop = []
    for row in rows:
        at = next((n for n in range(1, len(row) + 1) if bool(stop(torch.tensor([[0] * width + row[:n]]), None)[0])), None)
        first_stop.append(at)
    for row, at in zip(rows, first_stop):
        cut = regenerate.first_loop_cut(row, 3)
        if cut is None:
            assert at is None
        else:  # the stop fires at the token completing the third copy; the cut keeps the first
            assert regenerate.loop_cut(row[:at], 3) == cut
    assert first_stop[0] == 3 + 36 and first_stop[1] is None
    batch = torch.tensor([[0] * width + r[:40] for r in rows])
    assert stop(batch, None).tolist() == [True, False, True]


def test_greedy_answers_stop_at_their_first_loop(conversations, tmp_path, tiny_llama):
    # Greedy decoding of random weights repeats one token: every answer loops at once.
    greedy = dict(temperature=0.0, max_new_tokens=48)
    _, report = run_shard(conversations, tmp_path, tiny_llama, name="loops", **greedy)
    _, stopped_report = run_shard(conversations, tmp_path, tiny_llama, name="stopped", repetition_stop=3, **greedy)
    assert_accounted(stopped_report)
    assert report["stopped_by_repetition"] == 0 and report["finished_by_length"] > 0
    assert stopped_report["stopped_by_repetition"] == stopped_report["regenerated"] > 0
    assert stopped_report["new_tokens"] < report["new_tokens"] / 2
    assert stopped_report["settings"]["repetition_stop"] == 3
    # The stop changes where an answer ends, not what comes before: the same greedy tokens,
    # cut where the full answer first loops.
    import torch

    backend = regenerate.TransformersBackend(tiny_llama, regenerate.Settings.from_config({**SAMPLING, **greedy, "repetition_stop": 3}))
    prompt = backend.prompt_ids(read_jsonl(conversations)[0]["messages"][:1])
    with torch.inference_mode():
        full_ids = backend.model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=48,
                                          eos_token_id=backend.stop_ids, pad_token_id=backend.pad_id)[0, len(prompt):].tolist()
    cut = regenerate.first_loop_cut(full_ids, 3)
    assert cut is not None and cut < len(full_ids)
    (generation,) = backend._generate_rows([prompt], seed=0)
    assert (generation.finish_reason, generation.new_tokens) == ("repetition", cut)
    assert cut < generation.generated_tokens <= 48  # the stopping criterion ends it once the loop is seen
    assert generation.text == backend.tokenizer.decode(full_ids[:cut], skip_special_tokens=True).strip()


@pytest.mark.integration
def test_the_openai_backend_cuts_the_servers_loops_the_same_way(conversations, tmp_path, tiny_llama, chat_server):
    url = chat_server()
    greedy = dict(backend="openai", url=url, concurrency=2, temperature=0.0, max_new_tokens=32, max_len=2048)
    written, report = run_shard(conversations, tmp_path, tiny_llama, name="cut", repetition_stop=3, **greedy)
    assert_accounted(report)
    # The server ran every answer to its 32 tokens (its work, counted); the kept answers are shorter.
    assert report["stopped_by_repetition"] > 0 and report["new_tokens"] < 32 * report["regenerated"]
    assert report["generated_tokens"] == 32 * report["regenerated"]
    tokenizer = prepare.load_tokenizer(tiny_llama)
    for conversation in written:
        for k in conversation["regenerated_turns"]:
            ids = tokenizer(conversation["messages"][k]["content"], add_special_tokens=False)["input_ids"]
            assert regenerate.first_loop_cut(ids, 3) is None


def answer_from_raw_server(tiny_llama, respond, stream: bool):
    """One turn's answer from a server whose every POST ``respond(handler)`` answers."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Raw(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            respond(self)
            self.wfile.flush()
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Raw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = regenerate.Settings.from_config({"backend": "openai", "url": f"http://127.0.0.1:{server.server_address[1]}",
                                                    "stream": stream, "repetition_stop": 3, "retries": 1, "backoff_s": 0.01})
        return regenerate.OpenAIBackend(tiny_llama, settings, "tiny-llama").answer([{"role": "user", "content": "hi"}], 0)
    finally:
        server.shutdown()


def event_stream(handler, body: bytes) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_off_mid_body_is_retried_then_listed_as_failed_not_raised(tiny_llama, stream):
    """A server that dies while it sends an answer leaves a body shorter than it announced
    (http.client.IncompleteRead): the turn is retried, then fails like any transient error."""
    def cut_off(handler):
        handler.send_response(200)
        if stream:
            handler.send_header("Content-Type", "text/event-stream")
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            handler.wfile.write(b"40\r\ndata: {\"choices\": [{\"delta\": {\"content\": \"Hel")  # 64 bytes announced
        else:
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", "500")
            handler.end_headers()
            handler.wfile.write(b'{"choices": [{"message": {"content": "Hel')

    generation = answer_from_raw_server(tiny_llama, cut_off, stream)
    assert generation.text is None and generation.attempts == 2
    assert "IncompleteRead" in generation.error, generation.error


@pytest.mark.parametrize("ending", ["error", "no_finish", "abort"])
def test_a_stream_that_fails_in_band_or_stops_unfinished_is_no_answer(tiny_llama, ending):
    """SGLang reports a failure after a stream started as an error event
    (``{"object": "error", ...}``, srt/entrypoints/openai/serving_chat.py:1054-1060), and a
    stream can end without a finish reason or aborted by someone else: none is an answer,
    each is retried and then listed as failed; the partial text is not kept."""
    delta = json.dumps({"choices": [{"index": 0, "delta": {"content": "Hello there"}, "finish_reason": None}]})
    tail = {"error": json.dumps({"object": "error", "message": "out of memory", "type": "InternalServerError", "code": 500}),
            "no_finish": None,
            "abort": json.dumps({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "abort"}]})}[ending]
    body = f"data: {delta}\n\n" + (f"data: {tail}\n\n" if tail else "") + "data: [DONE]\n\n"
    generation = answer_from_raw_server(tiny_llama, lambda handler: event_stream(handler, body.encode()), stream=True)
    assert generation.text is None and generation.attempts == 2
    assert ("out of memory" if ending == "error" else "without finishing") in generation.error, generation.error


@pytest.mark.integration
def test_a_streamed_answer_is_aborted_at_its_first_loop_and_kept_as_the_full_answers_cut(conversations, tmp_path,
                                                                                         tiny_llama, chat_server):
    """regenerate.stream: the answer streams in, the client sees the loop complete, asks the
    server to abort the request and hangs up; the server stops generating there, and the
    shard holds exactly what cutting the whole answer afterwards holds."""
    url = chat_server("--stream-interval", "2", "--stream-token-delay-s", "0.02")
    greedy = dict(backend="openai", url=url, concurrency=2, temperature=0.0, max_new_tokens=48, max_len=2048,
                  repetition_stop=3)
    cut_after, after = run_shard(conversations, tmp_path, tiny_llama, name="after", **greedy)
    stats_before = json.loads(urllib.request.urlopen(url + "/standin/stats").read())
    streamed, report = run_shard(conversations, tmp_path, tiny_llama, name="streamed", stream=True, **greedy)
    stats = json.loads(urllib.request.urlopen(url + "/standin/stats").read())
    assert_accounted(report)
    assert streamed == cut_after
    for key in ("regenerated", "stopped_by_repetition", "finished_by_length", "new_tokens", "failed"):
        assert report[key] == after[key], key
    assert report["stopped_by_repetition"] > 0
    # Every loop-stopped answer was aborted in the server, which streamed fewer tokens than the
    # answers it would have run to the end: the work the cut throws away was not done.
    assert stats_before["aborted"] == [] and len(stats["aborted"]) == report["stopped_by_repetition"]
    streamed_tokens = stats["streamed_tokens"] - stats_before["streamed_tokens"]
    assert report["new_tokens"] <= streamed_tokens < after["generated_tokens"]
    assert report["generated_tokens"] < after["generated_tokens"]


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True, "incremental", "own-interval"])
def test_the_generate_api_sends_token_ids_and_cuts_loops_on_the_ids_the_server_generated(conversations, tmp_path,
                                                                                       tiny_llama, chat_server, stream):
    """regenerate.api generate: the client sends each prompt's ids to SGLang's /generate (no
    rendering or tokenizing in the server), stopped at the template's end of turn, and checks
    the ids it gets back for loops, streamed (aborting at the first loop) or whole. Streamed
    chunks carry every id so far (SGLang's default) or only their new ones
    (--incremental-streaming-output), every --stream-interval tokens or every
    regenerate.stream_interval, asked per request. The shard is the transformers backend's,
    which generates from the same ids with the same model."""
    incremental = ["--incremental-streaming-output"] if stream == "incremental" else []
    url = chat_server("--mode", "serve", "--stream-interval", "2", "--stream-token-delay-s", "0.01", *incremental)
    own_interval = {"stream_interval": 5} if stream == "own-interval" else {}
    stream = bool(stream)
    greedy = dict(temperature=0.0, max_new_tokens=48, max_len=2048, repetition_stop=3)
    reference, in_process = run_shard(conversations, tmp_path, tiny_llama, name="reference", batch_rows=1, **greedy)
    stats_before = json.loads(urllib.request.urlopen(url + "/standin/stats").read())
    served, report = run_shard(conversations, tmp_path, tiny_llama, name="served", backend="openai", url=url, api="generate",
                               concurrency=2, stream=stream, **own_interval, **greedy)
    stats = json.loads(urllib.request.urlopen(url + "/standin/stats").read())
    assert_accounted(report)
    assert served == reference
    for key in ("regenerated", "stopped_by_repetition", "finished_by_length", "failed"):
        assert report[key] == in_process[key], key
    assert report["stopped_by_repetition"] > 0
    # A server counts an answer's stop token among its completion tokens; the in-process backend does not.
    stopped = report["regenerated"] - report["stopped_by_repetition"] - report["finished_by_length"]
    assert report["new_tokens"] == in_process["new_tokens"] + stopped
    # The client's own account of its time: one request an answer, each in flight until read,
    # at most the 2 conversations' threads at once; a streamed request's first chunk before its end.
    client = report["client"]
    assert client["requests"] == report["regenerated"] + report["retried"] and client["mean_in_flight"] <= 2
    assert 0 < client["in_request_s"] <= client["conversation_s"]
    assert client["first_chunks"] == (client["requests"] if stream else 0)
    if stream:
        assert 0 < client["mean_first_chunk_s"] < client["mean_request_s"]
    aborted = set(stats["aborted"]) - set(stats_before["aborted"])
    chunks = stats["chunks"] - stats_before["chunks"]
    streamed_tokens = stats["streamed_tokens"] - stats_before["streamed_tokens"]
    if own_interval:  # a chunk every 5 tokens, not the server's 2 (the last one of an answer may be short)
        assert streamed_tokens / 5 <= chunks <= streamed_tokens / 5 + client["requests"] < streamed_tokens / 2
    elif stream:
        assert chunks >= streamed_tokens / 2
    if stream:  # every loop ended in the server as it was seen, before the answer's end
        assert len(aborted) == report["stopped_by_repetition"]
        assert report["generated_tokens"] < 48 * report["stopped_by_repetition"] + (report["new_tokens"] - 1)
    else:
        assert not aborted


@pytest.mark.integration
def test_the_client_cost_benchmark_runs_the_stages_client_on_both_routes(conversations, tmp_path, tiny_llama):
    """benchmarks/regenerate_client_cost.py: the stage's client against a server in another
    process that streams answers at once, chat and generate, every request answered."""
    out = tmp_path / "cost.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "regenerate_client_cost.py"), "--model", str(tiny_llama),
                             "--conversations", str(conversations), "--requests", "12", "--threads", "3",
                             "--max-new-tokens", "24", "--stream-interval", "4", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    cost = json.loads(out.read_text())
    assert [row["api"] for row in cost["rows"]] == ["chat", "generate"]
    for row in cost["rows"]:
        assert row["requests"] == 12 and row["failed"] == 0 and row["requests_per_s"] > 0
        assert row["client_cpu_ms_per_request"] > 0
    assert "| generate |" in result.stdout


def test_the_repetition_stop_names_new_answers_only_when_it_is_on():
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["regenerate"] = {"enabled": True, "temperature": 0.7}
    before = plan.prepared_key(config)
    config["regenerate"]["repetition_stop"] = 0
    assert plan.prepared_key(config) == before
    config["regenerate"]["repetition_stop"] = 3
    assert plan.prepared_key(config) != before


REGENERATE_TINY = {"enabled": True, **{k: v for k, v in SAMPLING.items() if k != "backoff_s"}, "threads": 1}


def regenerated_files(workdir: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted((workdir / "results").glob("*/regenerated/*/shard-*"))}


@pytest.mark.workflow
def test_workflow_regenerates_per_shard_and_a_kill_costs_only_unfinished_shards(tmp_path, tiny_llama):
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 30)
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    for workdir in (reference_dir, killed_dir):
        workdir.mkdir()
    reference_config = tiny_workflow_config(reference_dir, tiny_llama, conversations, regenerate=REGENERATE_TINY, data={"max_conversations": 30})
    # Two shard jobs at a time: each job is one process of one thread, so its answers do not
    # depend on what runs beside it; only the killed run below needs one job at a time.
    run_snakemake(reference_dir, reference_config, "--cores", "2", "prepare_report", "regenerate_report")
    reference = regenerated_files(reference_dir)
    assert len(reference) == 2 * plan.num_shards(yaml.safe_load(reference_config.read_text()))
    summary = json.loads(next((reference_dir / "results").glob("*/regenerated/*/regenerate_report.json")).read_text())
    assert_accounted(summary)
    assert summary["regenerated"] > 0.8 * summary["turns"]

    # Kill the whole workflow as soon as the first shard is finished, then resume.
    configfile = tiny_workflow_config(killed_dir, tiny_llama, conversations, regenerate=REGENERATE_TINY, data={"max_conversations": 30})
    process = subprocess.Popen(snakemake_command(killed_dir, configfile, "--cores", "1", "prepare_report", "regenerate_report"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wait_until(lambda: len(regenerated_files(killed_dir)) >= 4, timeout=300)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    survived = regenerated_files(killed_dir)
    assert 4 <= len(survived) < len(reference), "the kill must land mid-stage"
    time.sleep(0.01)
    run_snakemake(killed_dir, configfile, "--cores", "1", "--unlock")
    run_snakemake(killed_dir, configfile, "--cores", "1", "--rerun-incomplete", "prepare_report", "regenerate_report")
    resumed = regenerated_files(killed_dir)
    # With one core at most one shard job was in flight: Snakemake remakes its outputs
    # (written, not yet recorded as done); every other finished shard stays untouched.
    remade = {name.split(".")[0] for name, stat in survived.items() if resumed[name] != stat}
    assert len(remade) <= 1, f"finished shards were remade: {sorted(remade)}"
    # The answers equal the uninterrupted run's (reports differ only in their timings).
    answers = lambda files: {n: d for n, (d, _) in files.items() if n.endswith(".jsonl")}  # noqa: E731
    assert answers(resumed) == answers(reference)
    assert not list(killed_dir.rglob("*.tmp*"))


@pytest.mark.workflow
def test_smollm2_answers_real_sharegpt_turns_through_the_workflow(tmp_path):
    """The real target on a handful of real turns, greedy, through the Snakefile."""
    os.symlink(REPO / "resources", tmp_path / "resources")
    (REPO / "resources").mkdir(exist_ok=True)
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["run"] = "regenerate-smollm2"
    config["data"].update(max_conversations=3, samples_per_shard=3, max_len=256)
    config["regenerate"] = {"enabled": True, "max_new_tokens": 16, "threads": 2, "device": "cpu"}
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    run_snakemake(tmp_path, configfile, "--cores", "2", "prepare_report", "regenerate_report")
    summary = json.loads(next(tmp_path.glob("results/*/regenerated/*/regenerate_report.json")).read_text())
    assert_accounted(summary)
    assert summary["failed"] == 0 and summary["regenerated"] >= 2
    answers = [
        c["messages"][k]["content"]
        for path in tmp_path.glob("results/*/regenerated/*/shard-*.jsonl")
        for c in read_jsonl(path) for k in c["regenerated_turns"]
    ]
    assert len(answers) == summary["regenerated"]
    # Real answers: words, and none carries the template's markers.
    assert all(len(a.split()) >= 3 and "<|im_" not in a for a in answers)
    prepared = json.loads(next(tmp_path.glob("results/*/prepared/*/prepare_report.json")).read_text())
    assert prepared["samples"] == summary["conversations_out"] and prepared["loss_tokens"] > 0


@pytest.mark.integration
@pytest.mark.parametrize("api", ["chat", "generate"])
def test_the_regeneration_ceiling_asks_a_server_the_stages_prompts_with_the_runs_sampling(conversations, tmp_path, tiny_llama,
                                                                                         chat_server, api):
    """benchmarks/sglang_regenerate.py ceiling: what a plain client gets from the server on the
    prompts the stage asks (any turn's, or first turns only), with the run's sampling settings,
    through the route the stage's client uses (regenerate.api)."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import sglang_regenerate

    url = chat_server("--mode", "serve")
    workdir = tmp_path / "work"
    workdir.mkdir()
    configfile = tiny_workflow_config(workdir, tiny_llama, conversations,
                                      regenerate={"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 6, "api": api})
    out = tmp_path / "ceiling.json"
    assert sglang_regenerate.main(["ceiling", "--url", url, "--conversations", str(conversations), "--model-path",
                                   str(tiny_llama), "--config", str(configfile), "--prompts", "5", "--concurrency", "3",
                                   "--server-flags=--scheduler-recv-interval 16",
                                   "--server-env=SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT=1",
                                   "--load-started", str(tmp_path / "load-started"), "--out", str(out)]) == 0
    ceiling = json.loads(out.read_text())
    assert ceiling["prompts"] == 5 and ceiling["sampling"] == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 6}
    assert ceiling["turns"] == "all" and ceiling["server_flags"] == ["--scheduler-recv-interval", "16"]
    assert ceiling["server_env"] == {"SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT": "1"}
    assert float((tmp_path / "load-started").read_text()) > 0
    assert (ceiling["api"], ceiling["route"]) == (api, {"chat": "/v1/chat/completions", "generate": "/generate"}[api])
    assert 0 < ceiling["generated_tokens"] <= 5 * 6 and ceiling["tokens_per_s"] > 0 and ceiling["requests_per_s"] > 0
    assert sum(ceiling["finish_reasons"].values()) == 5
    # First turns only: every message before the first assistant turn.
    first, skipped = sglang_regenerate.sample_prompts(str(conversations), str(tiny_llama), 2048, 3, seed=0, turns="first")
    assert skipped == 0 and len(first) == 3
    assert all(prompt and prompt[-1]["role"] == "user" and all(m["role"] != "assistant" for m in prompt) for prompt, _ in first)
    # Every turn: later turns' prompts hold the conversation so far, so they are longer.
    rows = [json.loads(line) for line in conversations.read_text().splitlines() if line.strip()]
    turns = sum(m["role"] == "assistant" for row in rows for m in row["messages"])
    every, skipped = sglang_regenerate.sample_prompts(str(conversations), str(tiny_llama), 2048, turns, seed=0)
    assert skipped == 0 and len(every) == turns > len(rows)
    assert all(prompt[-1]["role"] == "user" for prompt, _ in every)
    assert any(m["role"] == "assistant" for prompt, _ in every for m in prompt)
    # Prompts of max_len tokens or more are left out, as the stage leaves them out.
    from eaglenest.stages.prepare import load_tokenizer, prompt_ids

    tokenizer = load_tokenizer(str(tiny_llama))
    assert all(ids == prompt_ids(tokenizer, prompt) for prompt, ids in every)  # the ids /generate is sent
    lengths = sorted(len(ids) for _, ids in every)
    max_len = lengths[len(lengths) // 2]
    short, skipped = sglang_regenerate.sample_prompts(str(conversations), str(tiny_llama), max_len, turns, seed=0)
    assert skipped == sum(length >= max_len for length in lengths) > 0 and len(short) == turns - skipped
    assert all(len(ids) < max_len for _, ids in short)


@pytest.mark.integration
def test_the_ceiling_can_load_the_server_through_the_stages_own_streamed_client(conversations, tmp_path, tiny_llama,
                                                                                chat_server):
    """ceiling --client workflow: the same prompts through the regenerate stage's client
    (token ids to /generate, streamed, a loop aborted as it is seen), so a run's server cost of
    streaming is measured beside the plain ceiling on one server."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import sglang_regenerate

    url = chat_server("--mode", "serve", "--stream-interval", "2")
    workdir = tmp_path / "work"
    workdir.mkdir()
    configfile = tiny_workflow_config(workdir, tiny_llama, conversations,
                                      regenerate={"temperature": 0.0, "max_new_tokens": 32, "api": "generate",
                                                  "stream": True, "repetition_stop": 3})
    out = tmp_path / "ceiling.json"
    stats_before = json.loads(urllib.request.urlopen(url + "/standin/stats").read())
    assert sglang_regenerate.main(["ceiling", "--client", "workflow", "--url", url, "--conversations", str(conversations),
                                   "--model-path", str(tiny_llama), "--config", str(configfile), "--prompts", "6",
                                   "--concurrency", "3", "--out", str(out)]) == 0
    stats = json.loads(urllib.request.urlopen(url + "/standin/stats").read())
    ceiling = json.loads(out.read_text())
    assert (ceiling["client"], ceiling["route"], ceiling["streamed"]) == ("workflow", "/generate", True)
    assert sum(ceiling["finish_reasons"].values()) == 6 and "failed" not in ceiling["finish_reasons"]
    looped = ceiling["finish_reasons"].get("repetition", 0)
    assert looped > 0  # greedy answers of a random model loop; each one was aborted in the server
    assert len(set(stats["aborted"]) - set(stats_before["aborted"])) >= looped  # the warm-up may loop too
    assert 0 < ceiling["kept_tokens"] < ceiling["generated_tokens"] and ceiling["kept_tokens_per_s"] > 0


def test_a_server_answers_each_conversation_turn_after_turn_without_waiting_for_the_others():
    """With a server backend no turn waits for the slowest answer of its turn index: a long
    conversation's later turns go out while another conversation's first answer is still
    being generated, and every turn is still answered after the turns before it."""
    import threading

    slow_answered = threading.Event()
    order = []

    class Server:
        def prompt_length(self, messages):
            return len(messages)

        def answer(self, messages, seed):
            user = messages[-1]["content"]
            if user == "slow":
                # Released only once the long conversation's third turn has gone out.
                assert slow_answered.wait(5)
            order.append((user, len(messages)))
            if user == "a3":
                slow_answered.set()
            return regenerate.Generation(f"answer to {user}", "stop", 3, generated_tokens=3)

    def chat(sample_id, users):
        messages = []
        for user in users:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": "old"}]
        return {"sample_id": sample_id, "messages": messages}

    conversations = [chat("s:long", ["a1", "a2", "a3"]), chat("s:slow", ["slow"])]
    settings = regenerate.Settings.from_config({**SAMPLING, "backend": "openai", "concurrency": 2})
    kept, counts = regenerate.regenerate_conversations(conversations, Server(), settings, max_len=100, seed=0)
    assert [user for user, _ in order] == ["a1", "a2", "a3", "slow"]
    assert counts["regenerated"] == counts["turns"] == 4 and counts["generated_tokens"] == 12
    # Turn k was asked with every earlier turn already answered by the server.
    long = kept[0]["messages"]
    assert [m["content"] for m in long if m["role"] == "assistant"] == ["answer to a1", "answer to a2", "answer to a3"]
    assert kept[0]["regenerated_turns"] == [1, 3, 5]


def test_the_clients_time_is_summed_over_threads_and_shards_and_read_over_the_wall_time():
    timing = metrics.RequestTiming()
    for _ in range(4):  # four requests of 1.5 s, two streamed, four conversations of 2 s
        timing.add(requests=1, in_request_s=1.5, conversation_s=2.0)
    timing.add(first_chunks=2, first_chunk_s=0.5)
    report = timing.report(seconds=3.0)
    assert report == {"requests": 4, "in_request_s": 6.0, "first_chunks": 2, "first_chunk_s": 0.5, "conversation_s": 8.0,
                      "mean_in_flight": 2.0, "mean_busy_threads": 2.67, "mean_request_s": 1.5, "mean_first_chunk_s": 0.25}
    totals = metrics.client_totals([{"client": report}, {"client": report}, {"turns": 3}])
    assert totals == {"shards": 2, "requests": 8, "in_request_s": 12.0, "first_chunks": 4, "first_chunk_s": 1.0,
                      "conversation_s": 16.0}
    assert metrics.client_totals([{"turns": 3}]) is None  # a transformers run: no server client


def test_a_server_gets_the_conversations_with_most_turns_first_and_the_shard_keeps_its_order():
    """The longest conversations go out first, so none of them starts last and leaves the
    server a tail of one request at a time; the shard's rows keep their order."""
    asked = []

    class Server:
        def prompt_length(self, messages):
            return len(messages)

        def answer(self, messages, seed):
            asked.append(messages[0]["content"])
            return regenerate.Generation("new", "stop", 1, generated_tokens=1)

    def chat(sample_id, turns):
        messages = []
        for _ in range(turns):
            messages += [{"role": "user", "content": sample_id}, {"role": "assistant", "content": "old"}]
        return {"sample_id": sample_id, "messages": messages}

    conversations = [chat("one", 1), chat("three", 3), chat("two", 2)]
    settings = regenerate.Settings.from_config({**SAMPLING, "backend": "openai", "concurrency": 1})
    kept, counts = regenerate.regenerate_conversations(conversations, Server(), settings, max_len=100, seed=0)
    assert asked == ["three"] * 3 + ["two"] * 2 + ["one"]
    assert [c["sample_id"] for c in kept] == ["one", "three", "two"] and counts["regenerated"] == 6


# Lines as SGLang 0.5.14 logs them (its scheduler's prefill and decode reports).
SERVER_LOG = """\
[2026-12-03 18:50:01] Prefill batch, #new-seq: 1, #new-token: 32, #cached-token: 26, token usage: 0.09, #running-req: 249, #queue-req: 0, #pending-token: 0, cuda graph: True, input throughput (token/s): 437.93
[2026-12-03 18:50:01] Prefill batch, #new-seq: 3, #new-token: 75, #cached-token: 2509, token usage: 0.09, #running-req: 250, #queue-req: 0, #pending-token: 0, cuda graph: True, input throughput (token/s): 6013.95
[2026-12-03 18:50:02] Decode batch, #running-req: 251, #token: 123308, token usage: 0.04, cuda graph: True, gen throughput (token/s): 13559.99, #queue-req: 0
[2026-12-03 18:50:02] INFO:     127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 200 OK
[2026-12-03 18:50:03] Decode batch, #running-req: 189, #token: 151039, token usage: 0.05, cuda graph: True, gen throughput (token/s): 43788.11, #queue-req: 0
"""


def test_a_servers_log_tells_its_prefill_passes_and_decode_steps(tmp_path):
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import sglang_regenerate

    log = tmp_path / "server.log"
    log.write_text(SERVER_LOG)
    schedule = sglang_regenerate.server_schedule(log, decode_log_interval=40)
    assert schedule["prefill_passes"] == 2 and schedule["requests_per_prefill_pass"] == 2.0
    assert schedule["prefill_new_tokens"] == 107 and schedule["prefix_cache_hit"] == round(2535 / 2642, 3)
    # A decode line is logged every 40 decode steps.
    assert schedule["decode_steps"] == 80 and schedule["prefill_passes_per_decode_step"] == 0.025
    assert schedule["mean_running_requests"] == 220.0 and schedule["highest_logged_gen_tokens_per_s"] == 43788.11
    assert (schedule["first_line"], schedule["last_line"]) == ("2026-12-03 18:50:01", "2026-12-03 18:50:03")
    # Per window of the log: the requests that arrived (prefilled) and the batch that ran.
    windows = sglang_regenerate.server_schedule(log, decode_log_interval=40, window_s=2)["windows"]
    assert windows == [
        {"from_s": 0, "requests_per_s": 2.0, "prompt_tokens_per_request": round(2642 / 4), "mean_running_requests": 251.0,
         "mean_logged_gen_tokens_per_s": 13560.0},
        {"from_s": 2, "requests_per_s": 0.0, "prompt_tokens_per_request": None, "mean_running_requests": 189.0,
         "mean_logged_gen_tokens_per_s": 43788.1},
    ]


def test_the_cpu_sampler_names_the_parts_of_a_regeneration_and_their_busiest_threads():
    """benchmarks/sglang_regenerate.py cpu (benchmarks/process_cpu.py): real busy processes, one
    titled as SGLang titles its scheduler and one with a regenerate job's command line, each
    found with the cores it used."""
    import subprocess
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import process_cpu

    spin = "import time\nend = time.time() + 4\nwhile time.time() < end: pass"
    busy = [subprocess.Popen(["bash", "-c", f'exec -a sglang::scheduler_TP0 {sys.executable} -c "$0"', spin]),
            subprocess.Popen([sys.executable, "-c", spin, "/work/.snakemake/scripts/tmpx.regenerate.py"])]
    try:
        time.sleep(0.5)
        sampled = process_cpu.sample_cpu(1.5)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    parts = {part["role"]: part for part in sampled["parts"]}
    assert sampled["machine_cpus"] >= 1 and sampled["machine_busy_cores"] > 0
    for role in ("sglang::scheduler", "regenerate jobs (the workflow's clients)"):
        assert parts[role]["processes"] >= 1 and parts[role]["cores"] > 0.2, parts
        assert 0.2 < parts[role]["busiest_thread_cores"] <= parts[role]["cores"] + 0.05
        assert 0 <= parts[role]["busiest_thread_waiting"] <= 1.05
    # Two spinning threads per core: each waits for a core about as long as it runs.
    crowd = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2 * (os.cpu_count() or 1))]
    titled = subprocess.Popen(["bash", "-c", f'exec -a sglang::scheduler_TP0 {sys.executable} -c "$0"', spin])
    try:
        time.sleep(0.5)
        crowded = {part["role"]: part for part in process_cpu.sample_cpu(1.5)["parts"]}
    finally:
        for process in [*crowd, titled]:
            process.kill()
            process.wait()
    assert crowded["sglang::scheduler"]["busiest_thread_waiting"] > 0.3, crowded


@pytest.mark.integration
def test_the_cpu_sampler_profiles_each_sglang_process_with_py_spy(tmp_path):
    """benchmarks/sglang_regenerate.py cpu --pyspy-dir: py-spy on a real busy process titled as
    SGLang titles its scheduler, over the sampled seconds; its summary says which function of
    which thread held the time, leaf and inclusive."""
    import subprocess
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import sglang_regenerate

    spin = "import time\ndef steps():\n    end = time.time() + 6\n    while time.time() < end: pass\nsteps()"
    busy = subprocess.Popen(["bash", "-c", f'exec -a sglang::scheduler_TP0 {sys.executable} -c "$0"', spin])
    ready = tmp_path / "load-started"
    ready.write_text("now\n")
    try:
        time.sleep(0.5)
        assert sglang_regenerate.main(["cpu", "--wait-for", str(ready), "--after-s", "0", "--seconds", "2",
                                       "--pyspy-dir", str(tmp_path / "pyspy"), "--out", str(tmp_path / "cpu.json")]) == 0
    finally:
        busy.kill()
        busy.wait()
    result = json.loads((tmp_path / "cpu.json").read_text())
    scheduler = result["pyspy"]["sglang::scheduler"]
    assert scheduler["samples"] > 50 and (tmp_path / "pyspy" / "sglang-scheduler.txt").exists()
    main = scheduler["threads"][0]
    assert main["top"][0][0].startswith("steps (<string>:4)") and main["top"][0][1] > 0.9
    # Inclusive: the function and its caller each hold (nearly) every sample.
    inclusive = {frame.split(" (")[0]: share for frame, share in main["inclusive"]}
    assert inclusive["steps"] > 0.9 and inclusive["<module>"] >= inclusive["steps"]


class CountingChatServer:
    """Answers chat completions (one token each) and notes, per request, whether ``marker``
    existed when it arrived."""

    def __init__(self, marker: Path):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.marker_seen = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                owner.marker_seen.append(marker.exists())
                body = json.dumps({"usage": {"completion_tokens": 1}, "choices": [{"finish_reason": "stop"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_ceiling_marks_its_loads_start_after_the_warm_up_request(tmp_path):
    """The profiler of a ceiling waits for this mark: the warm-up request (minutes on a fresh
    node, while flashinfer builds its kernels) goes out before it, every measured one after."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import sglang_regenerate

    marker = tmp_path / "load-started"
    server = CountingChatServer(marker)
    prompts = [[{"role": "user", "content": f"q{k}"}] for k in range(6)]
    bodies = [{"model": "tiny", "messages": messages, "max_tokens": 1} for messages in prompts]
    result = sglang_regenerate.measure_ceiling(server.url, "/v1/chat/completions", bodies, concurrency=3, seed=0,
                                               on_load_start=lambda: atomic.write_text(marker, f"{time.time()}\n"))
    server.server.shutdown()
    assert result["prompts"] == 6 and result["generated_tokens"] == 6
    assert server.marker_seen == [False] + [True] * 6  # the warm-up, then the load
    assert sglang_regenerate.server_env("A_1=x B=") == {"A_1": "x", "B": ""}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        sglang_regenerate.server_env("--scheduler-recv-interval")


def test_the_fastest_ceiling_gives_the_regeneration_server_its_flags():
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import sglang_regenerate

    ceilings = [{"server_flags": [], "concurrency": 256, "tokens_per_s": 18852.6, "seconds": 28.8},
                {"server_flags": ["--scheduler-recv-interval", "16"], "concurrency": 256, "tokens_per_s": 30000.0, "seconds": 18.1},
                {"server_flags": ["--enable-prefill-delayer"], "concurrency": 256, "tokens_per_s": 25000.0, "seconds": 21.7}]
    best, overlay = sglang_regenerate.pick_ceiling(ceilings, ["--attention-backend", "triton"], num_shards=18,
                                                   base_concurrency=256)
    assert best["tokens_per_s"] == 30000.0 and [entry["tokens_per_s"] for entry in best["sweep"]] == [18852.6, 30000.0, 25000.0]
    # The config's own flags stay first; the sweep's best are added after them; the shard
    # jobs keep their requests in flight.
    assert overlay == {"extract": {"sglang": {"extra_args": ["--attention-backend", "triton", "--scheduler-recv-interval", "16"]}}}
    # A best measured at 512 in flight: the 18 shard jobs share the 512.
    ceilings.append({"server_flags": ["--cuda-graph-max-bs-decode", "512"], "concurrency": 512, "tokens_per_s": 41000.0,
                     "seconds": 13.2})
    best, overlay = sglang_regenerate.pick_ceiling(ceilings, [], num_shards=18, base_concurrency=256)
    assert best["concurrency"] == 512 and overlay["regenerate"] == {"concurrency": 28}
    assert overlay["extract"]["sglang"]["extra_args"] == ["--cuda-graph-max-bs-decode", "512"]
    # A best that ran with an environment of its own: that environment over the config's.
    ceilings.append({"server_flags": ["--scheduler-recv-interval", "16"], "concurrency": 256, "tokens_per_s": 50000.0,
                     "seconds": 10.0, "server_env": {"SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT": "1"}})
    best, overlay = sglang_regenerate.pick_ceiling(ceilings, [], num_shards=18, base_concurrency=256,
                                                   config_env={"SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT": "1000",
                                                               "SGLANG_OTHER": "x"})
    assert overlay["extract"]["sglang"]["env"] == {"SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT": "1", "SGLANG_OTHER": "x"}
    assert [entry["server_env"] for entry in best["sweep"]] == [{}] * 4 + [best["server_env"]]


def test_the_picked_flags_replace_the_values_of_flags_the_config_has_and_add_the_rest():
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import sglang_regenerate

    config_flags = ["--attention-backend", "triton", "--cuda-graph-max-bs-decode", "512", "--enable-x", "--stream-interval", "16"]
    picked = ["--cuda-graph-max-bs-decode", "1024", "--disable-prefill-cuda-graph", "--chunked-prefill-size", "-1"]
    assert sglang_regenerate.merge_flags(config_flags, picked) == [
        "--attention-backend", "triton", "--cuda-graph-max-bs-decode", "1024", "--enable-x", "--stream-interval", "16",
        "--disable-prefill-cuda-graph", "--chunked-prefill-size", "-1"]
    assert sglang_regenerate.merge_flags(config_flags, []) == config_flags
    best, overlay = sglang_regenerate.pick_ceiling(
        [{"server_flags": picked[:2], "concurrency": 1008, "tokens_per_s": 2.0, "seconds": 1.0}], config_flags, 18, 1008)
    assert overlay["extract"]["sglang"]["extra_args"].count("--cuda-graph-max-bs-decode") == 1


def test_the_picked_ceilings_environment_goes_into_the_overlay(tmp_path, capsys):
    """pick writes the fastest's NAME=VALUE words under extract.sglang.env and shows them in its
    table; the overlay is a config the workflow takes."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import sglang_regenerate
    from eaglenest.node.recon.config import load_config

    env = {"SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT": "1"}
    paths = []
    for label, (flags, server_env, speed) in enumerate([([], {}, 20000.0), (["--enable-prefill-delayer"], env, 30000.0)]):
        paths.append(tmp_path / f"ceiling-{label}.json")
        paths[-1].write_text(json.dumps({"server_flags": flags, "server_env": server_env, "concurrency": 192,
                                         "tokens_per_s": speed, "seconds": 10.0}))
    overlay_path, out = tmp_path / "server-flags.yaml", tmp_path / "ceiling.json"
    assert sglang_regenerate.main(["pick", "--ceilings", *map(str, paths), "--config", str(DEFAULT_CONFIG),
                                   "--base-concurrency", "192", "--out", str(out), "--overlay", str(overlay_path)]) == 0
    table = capsys.readouterr().out
    assert "SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT=1 --enable-prefill-delayer" in table
    assert "(the config flags alone)" in table
    overlay = yaml.safe_load(overlay_path.read_text())
    assert overlay["extract"]["sglang"] == {"extra_args": ["--enable-prefill-delayer"], "env": env}
    config = load_config(REPO, [str(DEFAULT_CONFIG), str(overlay_path)])
    assert config["extract"]["sglang"]["extra_args"] == ["--enable-prefill-delayer"] and config["extract"]["sglang"]["env"] == env
    assert "regenerate" not in overlay  # no client loads: the config's stream interval stays
    # The stage's own client at two stream intervals on the same server: the faster's goes in.
    clients = []
    for interval, kept in ((16, 900.0), (64, 1000.0)):
        clients.append(tmp_path / f"client-workflow-i{interval}.json")
        clients[-1].write_text(json.dumps({"client": "workflow", "streamed": True, "stream_interval": interval,
                                           "tokens_per_s": kept + 10, "kept_tokens_per_s": kept}))
    assert sglang_regenerate.main(["pick", "--ceilings", *map(str, paths), "--config", str(DEFAULT_CONFIG),
                                   "--base-concurrency", "192", "--clients", *map(str, clients), "--out", str(out),
                                   "--overlay", str(overlay_path)]) == 0
    assert yaml.safe_load(overlay_path.read_text())["regenerate"] == {"stream_interval": 64}
    assert load_config(REPO, [str(DEFAULT_CONFIG), str(overlay_path)])["regenerate"]["stream_interval"] == 64
    assert [c["stream_interval"] for c in json.loads(out.read_text())["workflow_clients"]] == [16, 64]
    assert sglang_regenerate.pick_stream_interval([json.loads(clients[0].read_text())]) is None  # one interval: no choice


def test_the_loop_stop_cost_benchmark_times_checks_that_find_the_loops_the_cut_finds(tmp_path):
    """benchmarks/loop_stop_cost.py: the pre-checked token check agrees with loop_cut at every
    output length, the text regex sees a looped answer and no plain one, and the step time and
    cut share come from the results file's measured runs."""
    import random
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import loop_stop_cost

    rng = random.Random(0)
    plain = [rng.randrange(1000) for _ in range(200)]
    looped = plain[:50] + [7, 8, 9, 10, 11, 12, 13] * 4 + plain[50:80]
    for ids in (plain, looped):
        for n in range(1, len(ids) + 1):
            assert loop_stop_cost.prechecked_loop_cut(ids[:n]) == regenerate.loop_cut(ids[:n], 3), n
    assert regenerate.first_loop_cut(looped, 3) == 50 + 7
    assert loop_stop_cost.LOOP_REGEX.search("An answer. " + "It repeats itself here. " * 3)
    assert not loop_stop_cost.LOOP_REGEX.search("An answer that says one thing and then another.")
    results = {"regenerate": {"new_tokens": 830, "generated_tokens": 1000, "ceiling_tokens_per_s": 20000.0},
               "regenerate_ceiling_sweep": {"sweep": [{"concurrency": 256, "tokens_per_s": 20000.0},
                                                      {"concurrency": 512, "tokens_per_s": 40000.0}]}}
    (tmp_path / "engine.json").write_text(json.dumps(results))
    engine = loop_stop_cost.engine_figures(tmp_path / "engine.json")
    assert engine["in_flight"] == 512 and engine["step_ms"] == 12.8 and engine["cut_share"] == 0.17


def test_the_first_loop_is_found_where_checking_every_length_finds_it():
    """first_loop_cut tries only the spans whose copies end on the same token; on random
    answers over small vocabularies (loops of every span length appear) it agrees with
    loop_cut at every length, from any start below the first loop."""
    import random

    rng = random.Random(7)
    found = 0
    for trial in range(400):
        vocab, length, repeats = rng.choice([2, 3, 5, 40]), rng.randrange(0, 160), rng.choice([2, 3, 4])
        tokens = [rng.randrange(vocab) for _ in range(length)]
        if trial % 3 == 0 and length > 20:  # plant a loop of a long span
            period = rng.randrange(6, 40)
            at = rng.randrange(0, length)
            tokens[at:at] = tokens[at:at + period] * repeats if len(tokens[at:at + period]) == period else []
        reference = next((regenerate.loop_cut(tokens, repeats, n) for n in range(min(regenerate.LOOP_MIN_TOKENS, len(tokens)),
                          len(tokens) + 1) if regenerate.loop_cut(tokens, repeats, n) is not None), None)
        assert regenerate.first_loop_cut(tokens, repeats) == reference, (tokens, repeats)
        completes = next((n for n in range(len(tokens) + 1) if regenerate.loop_cut(tokens, repeats, n) is not None), None)
        if completes is not None:
            found += 1
            start = rng.randrange(0, completes + 1)
            assert regenerate.first_loop_cut(tokens, repeats, start=start) == reference
    assert found > 50


@pytest.mark.parametrize("piece", [1, 3, 16])
def test_a_streamed_answer_checked_piece_by_piece_is_cut_where_the_whole_answer_is(tiny_llama, piece):
    """regenerate.StreamedLoopCheck (what the openai backend runs on a stream): the text so far,
    fed a piece at a time, finds the loop at the first piece that completes it, with the cut
    first_loop_cut gives the whole answer; an answer without a loop is never cut."""
    tokenizer = prepare.load_tokenizer(tiny_llama)
    looped = "An answer begins here, and then " + "it says the same sentence again. " * 5 + "The end."
    plain = "An answer that says one thing, then another thing, and ends without saying anything twice."
    for text, loops in ((looped, True), (plain, False)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected = regenerate.first_loop_cut(ids, 3)
        assert (expected is not None) == loops
        for by_ids in (False, True):  # the text so far (chat), or the ids so far (/generate)
            check, cut, fed = regenerate.StreamedLoopCheck(tokenizer, 3), None, 0
            for end in list(range(piece, len(ids), piece)) + [len(ids)]:
                fed = end
                cut = (check.feed_ids(ids[:end]) if by_ids
                       else check.feed(tokenizer.decode(ids[:end], skip_special_tokens=True)))
                if cut is not None:
                    break
            assert cut == expected
            if loops:  # found at the first piece that completes the loop, not later
                completes = next(n for n in range(len(ids) + 1) if regenerate.loop_cut(ids, 3, n) is not None)
                assert fed - piece < completes <= fed


def test_original_answers_kept_beside_regenerated_ones_share_the_conversations_shard_and_split(tmp_path, tiny_llama):
    """regenerate.mix_original: prepare keeps both versions of each conversation, the
    original as <id>@original, in the shard its id picks; consolidate puts both versions on
    the same side of the split, and a run without copies splits exactly as before."""
    regenerated = tmp_path / "regenerated.jsonl"
    raw = synthetic_conversations(tmp_path / "raw.jsonl", 12, seed=5)
    originals = tmp_path / "originals.jsonl"
    ingest.ingest([{"name": "synthetic", "path": str(raw)}], originals, tmp_path / "ingest.json", max_conversations=12,
                  leading_assistant="drop_turn")
    rows = read_jsonl(originals)
    regenerated.write_text("".join(json.dumps({**c, "messages": [
        dict(m, content="a regenerated answer") if m["role"] == "assistant" else m for m in c["messages"]]}) + "\n"
        for c in rows if prepare.shard_of(c["sample_id"], 2) == 0))
    out = tmp_path / "shard.safetensors"
    stats = prepare.prepare_shard([regenerated], tiny_llama, out, shard_id=0, num_shards=2, max_len=256,
                                  target_name="tiny-llama", originals_paths=[originals])
    from eaglenest.formats import shards
    ids = shards.ShardReader.open(out).sample_ids
    mine = sorted(c["sample_id"] for c in rows if prepare.shard_of(c["sample_id"], 2) == 0)
    assert ids == sorted(mine + [i + ingest.ORIGINAL_SUFFIX for i in mine]) and stats["original_samples"] == len(mine)
    # The two versions differ where the answers do.
    reader = shards.ShardReader.open(out)
    tokens = dict(zip(ids, reader.tensor("input_ids").split(reader.token_counts)))
    assert not torch.equal(tokens[mine[0]], tokens[mine[0] + ingest.ORIGINAL_SUFFIX])

    from eaglenest.stages.consolidate import in_validation
    import hashlib
    for sample_id in mine:
        assert in_validation(sample_id, 0.5, 3) == in_validation(sample_id + ingest.ORIGINAL_SUFFIX, 0.5, 3)
        # Without copies, the split is the one of every earlier run.
        digest = hashlib.sha256(f"3:{sample_id}".encode()).digest()
        assert in_validation(sample_id, 0.5, 3) == (int.from_bytes(digest[:8], "big") / 2**64 < 0.5)
    assert {in_validation(i, 0.5, 3) for i in mine} == {True, False}


def test_a_share_of_conversations_keeps_its_original_answers_instead_of_the_targets(tmp_path, tiny_llama):
    """regenerate.original_share: each conversation once, the picked share as <id>@original
    with its original answers, the rest as the target answered; picked by id and seed, apart
    from the validation split; a conversation the regeneration dropped stays dropped."""
    raw = synthetic_conversations(tmp_path / "raw.jsonl", 40, seed=5)
    originals = tmp_path / "originals.jsonl"
    ingest.ingest([{"name": "synthetic", "path": str(raw)}], originals, tmp_path / "ingest.json", max_conversations=40,
                  leading_assistant="drop_turn")
    rows = read_jsonl(originals)
    dropped = rows[0]["sample_id"]
    regenerated = tmp_path / "regenerated.jsonl"
    regenerated.write_text("".join(json.dumps({**c, "messages": [
        dict(m, content="a regenerated answer") if m["role"] == "assistant" else m for m in c["messages"]]}) + "\n"
        for c in rows if c["sample_id"] != dropped))
    from eaglenest.formats import shards
    from eaglenest.stages.consolidate import in_validation

    def prepared(share, seed=0, name="shard"):
        out = tmp_path / f"{name}.safetensors"
        stats = prepare.prepare_shard([regenerated], tiny_llama, out, shard_id=0, num_shards=1, max_len=256,
                                      target_name="tiny-llama", originals_paths=[originals], original_share=share,
                                      share_seed=seed)
        reader = shards.ShardReader.open(out)
        return stats, dict(zip(reader.sample_ids, reader.tensor("input_ids").split(reader.token_counts)))

    kept = sorted(c["sample_id"] for c in rows if c["sample_id"] != dropped)
    stats, tokens = prepared(0.5)
    picked = [i for i in kept if prepare.takes_original(i, 0.5, 0)]
    assert 0 < len(picked) < len(kept)
    assert sorted(tokens) == sorted([i + ingest.ORIGINAL_SUFFIX for i in picked] + [i for i in kept if i not in picked])
    assert stats["original_samples"] == len(picked) and stats["samples"] == len(kept)
    assert dropped not in tokens and dropped + ingest.ORIGINAL_SUFFIX not in tokens
    # The picked ones hold the original answers, the others the target's.
    _, every_original = prepared(1.0, name="all-original")
    for i in picked:
        assert torch.equal(tokens[i + ingest.ORIGINAL_SUFFIX], every_original[i + ingest.ORIGINAL_SUFFIX])
    assert set(every_original) == {i + ingest.ORIGINAL_SUFFIX for i in kept}
    # Another seed picks others; both sides of a split get a share.
    assert picked != [i for i in kept if prepare.takes_original(i, 0.5, 1)]
    assert {in_validation(i, 0.5, 0) for i in picked} == {True, False}
    with pytest.raises(ValueError, match="originals_paths"):
        prepare.prepare_shard([regenerated], tiny_llama, tmp_path / "x.safetensors", shard_id=0, num_shards=1,
                              max_len=256, target_name="tiny-llama", original_share=0.5)


@pytest.mark.workflow
@pytest.mark.parametrize("mixing", ["mix_original", "original_share"])
def test_a_run_that_keeps_original_answers_trains_on_both_with_one_split_per_conversation(tmp_path, tiny_llama, mixing):
    """regenerate.mix_original (both versions of every conversation) and
    regenerate.original_share (the original instead of the target's answers for a share)
    through the Snakefile; the run also keeps an earlier run's draft vocabulary
    (consolidate.draft_vocab_from), as a warm start on new data needs. Both together are refused."""
    from eaglenest.formats import vocab

    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 16)
    setting = {"mix_original": True} if mixing == "mix_original" else {"original_share": 0.5}
    configfile = tiny_workflow_config(tmp_path, tiny_llama, conversations, data={"max_conversations": 16},
                                      regenerate={**REGENERATE_TINY, **setting})
    config = yaml.safe_load(configfile.read_text())
    sizes = config["target"]["vocab_size"], config["consolidate"]["draft_vocab_size"]
    earlier = tmp_path / "earlier_draft_vocab.safetensors"
    d2t, t2d = vocab.build_draft_vocab(torch.randint(0, 50, (sizes[0],)), sizes[1])
    vocab.save_draft_vocab(earlier, d2t, t2d, torch.zeros(sizes[0], dtype=torch.int64), {})
    config["consolidate"].update(val_fraction=0.3, draft_vocab_from=str(earlier))
    configfile.write_text(yaml.safe_dump(config, sort_keys=False))
    plain = dict(config, regenerate={**config["regenerate"], "mix_original": False, "original_share": 0})
    assert plan.prepared_key(config) != plan.prepared_key(plain)  # its own prepared shards
    assert plan.regeneration_key(config) == plan.regeneration_key(plain)  # the same regenerated ones
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump(dict(config, regenerate={**config["regenerate"], "mix_original": True,
                                                            "original_share": 0.5}), sort_keys=False))
    refused = run_snakemake(tmp_path, both, "-n", check=False)
    assert refused.returncode != 0 and "set one of them" in refused.stdout + refused.stderr
    run_snakemake(tmp_path, configfile, "--cores", "2", "prepare_report", "regenerate_report",
                  f"results/{config['run']}/consolidated/split.json")
    report = json.loads(next(tmp_path.glob("results/*/prepared/*/prepare_report.json")).read_text())
    regenerated = json.loads(next(tmp_path.glob("results/*/regenerated/*/regenerate_report.json")).read_text())
    if mixing == "mix_original":
        assert report["original_samples"] == regenerated["conversations_out"] == report["samples"] // 2
    else:  # each conversation once, a share of them with its original answers
        assert report["samples"] == regenerated["conversations_out"] and 0 < report["original_samples"] < report["samples"]
    split = json.loads(next(tmp_path.glob("results/*/consolidated/split.json")).read_text())
    side = {sample_id: name for name in ("train", "val") for sample_id in split[name]}
    assert len(side) == report["samples"] and split["val"] and split["train"]
    from eaglenest.stages.consolidate import in_validation

    split_side = lambda i: "val" if in_validation(ingest.base_sample_id(i), 0.3, config["consolidate"]["seed"]) else "train"
    assert all(side[i] == split_side(i) for i in side)  # a conversation's side, whichever version it trains on
    assert any(i.endswith(ingest.ORIGINAL_SUFFIX) for i in split["val"] + split["train"])
    kept = vocab.load_draft_vocab(next(tmp_path.glob("results/*/consolidated/draft_vocab.safetensors")))
    assert torch.equal(kept["d2t"], d2t) and torch.equal(kept["t2d"], t2d)
