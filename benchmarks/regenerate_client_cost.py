"""What the regeneration client itself costs per request, without a GPU: the workflow's
``openai`` backend (eaglenest.stages.regenerate.OpenAIBackend) against a server in another
process that answers at once, streamed as SGLang streams, on both routes (``regenerate.api``
chat and generate).

On the H200 the workflow's server got about 110 requests a second whatever its batch
(docs/results/sglang-h200-2026-12-04-regen2/); this says how many one client process can
make, and how much of one core a request costs it, so that the client can be told apart from
the server's HTTP process as the bound. The server sends real answers of the target's
tokenizer (the ingested conversations' own answers, cut to ``--max-new-tokens``) in pieces of
``--stream-interval`` tokens, and an answer that loops is cut and aborted as in the stage.

    python benchmarks/regenerate_client_cost.py --model resources/models/SmolLM2-135M-Instruct \
        --conversations results/<run>/data/conversations.jsonl --requests 400 --threads 56 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def serve(model: str, answers_path: str, stream_interval: int, ready_file: str) -> None:
    """Answer chat completions and /generate at once, streamed, from a pool of answers."""
    from eaglenest.stages.prepare import load_tokenizer

    tokenizer = load_tokenizer(model)
    pool = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in json.loads(Path(answers_path).read_text())]
    counter = iter(range(1 << 62))
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))  # every answer comes from the pool
            if self.path == "/abort_request":
                body = b"{}"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            with lock:
                ids = pool[next(counter) % len(pool)]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            generate = self.path == "/generate"
            sent = ""
            try:
                for end in range(stream_interval, len(ids) + stream_interval, stream_interval):
                    end = min(end, len(ids))
                    if generate:
                        payload = {"text": None, "output_ids": ids[:end],
                                   "meta_info": {"completion_tokens": end, "finish_reason": None}}
                    else:
                        text = tokenizer.decode(ids[:end], skip_special_tokens=True)
                        payload = {"object": "chat.completion.chunk",
                                   "choices": [{"index": 0, "delta": {"content": text[len(sent):]}, "finish_reason": None}]}
                        sent = text
                    self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                final = ({"text": None, "output_ids": ids, "meta_info": {"completion_tokens": len(ids),
                                                                          "finish_reason": {"type": "length"}}}
                         if generate else
                         {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": ""},
                                                                          "finish_reason": "length"}],
                          "usage": {"completion_tokens": len(ids)}})
                self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
            except (BrokenPipeError, ConnectionResetError):  # the client cut a loop and hung up
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    Path(ready_file).write_text(f"http://127.0.0.1:{server.server_address[1]}")
    server.serve_forever()


def sample(conversations: str, count: int, max_new_tokens: int, tokenizer, seed: int) -> tuple[list, list]:
    """(prompts: each turn's conversation before it, answers: the turns' own answers cut to max_new_tokens)."""
    with open(conversations, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    turns = [(row["messages"][:k], m["content"]) for row in rows for k, m in enumerate(row["messages"]) if m["role"] == "assistant"]
    random.Random(seed).shuffle(turns)
    turns = turns[:count]
    answers = [tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]) for _, text in turns]
    return [prompt for prompt, _ in turns], answers


def measure(model: str, prompts: list, api: str, url: str, threads: int, max_new_tokens: int) -> dict:
    """Requests a second and client CPU per request, the workflow's client on ``api``."""
    from eaglenest.stages import regenerate

    settings = regenerate.Settings.from_config({"backend": "openai", "url": url, "api": api, "stream": True,
                                                "repetition_stop": 3, "max_new_tokens": max_new_tokens,
                                                "temperature": 0.8, "top_p": 0.95, "retries": 0})
    backend = regenerate.OpenAIBackend(model, settings, "target")

    def one(indexed):
        index, messages = indexed
        backend.prompt_length(messages)  # the stage's max_len check, as regenerate_conversations makes it
        return backend.answer(messages, index)

    cpu, wall = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        answers = list(pool.map(one, enumerate(prompts)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    failed = [a.error for a in answers if a.text is None]
    return {"api": api, "requests": len(prompts), "threads": threads, "failed": len(failed), "first_error": failed[0] if failed else None,
            "seconds": round(wall, 3), "requests_per_s": round(len(prompts) / wall, 1),
            "client_cpu_ms_per_request": round(1000 * cpu / len(prompts), 2),
            "client_cores": round(cpu / wall, 2),
            "stopped_by_repetition": sum(a.finish_reason == "repetition" for a in answers)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the target's directory (its tokenizer and chat template)")
    parser.add_argument("--conversations", required=True, help="ingested conversations (results/<run>/data/conversations.jsonl)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--threads", type=int, default=56, help="the conversations one shard job keeps in flight")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--stream-interval", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--serve", nargs=2, metavar=("ANSWERS", "READY"), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.serve:
        serve(options.model, options.serve[0], options.stream_interval, options.serve[1])
        return 0
    from eaglenest.stages.prepare import load_tokenizer

    prompts, answers = sample(options.conversations, options.requests, options.max_new_tokens,
                              load_tokenizer(options.model), options.seed)
    work = Path(options.out).resolve().parent
    answers_path, ready = work / "client-cost-answers.json", work / "client-cost-server.url"
    answers_path.write_text(json.dumps(answers))
    ready.unlink(missing_ok=True)
    server = subprocess.Popen([sys.executable, __file__, "--model", options.model, "--conversations", options.conversations,
                               "--stream-interval", str(options.stream_interval), "--out", options.out,
                               "--serve", str(answers_path), str(ready)], env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the answering server did not start")
            time.sleep(0.1)
        url = ready.read_text()
        rows = [measure(options.model, prompts, api, url, options.threads, options.max_new_tokens) for api in ("chat", "generate")]
    finally:
        server.kill()
        server.wait()
        answers_path.unlink(missing_ok=True)
        ready.unlink(missing_ok=True)
    result = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "stream_interval": options.stream_interval,
              "max_new_tokens": options.max_new_tokens, "rows": rows,
              "generate_over_chat_requests_per_s": round(rows[1]["requests_per_s"] / rows[0]["requests_per_s"], 2)}
    Path(options.out).write_text(json.dumps(result, indent=1) + "\n")
    print("| api | requests/s | client CPU ms a request | client cores | loops cut |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['api']} | {row['requests_per_s']} | {row['client_cpu_ms_per_request']} | {row['client_cores']} "
              f"| {row['stopped_by_repetition']} |")
    return 0 if not any(row["failed"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
