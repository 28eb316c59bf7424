"""A real HTTP server that answers like the patched SGLang server, computed with transformers.

For machines without a GPU (a laptop, CI) and for the tests: it serves
``GET /eaglenest/info``, ``GET /health``, ``POST /generate`` and ``POST /v1/chat/completions``
(for the regeneration stage) exactly as a server
started by eaglenest.sglang.launch does — same request fields (one sample or
a batch of them per ``/generate``), same ``meta_info["eaglenest_spool"]`` descriptor, same
spool files, written by the same function (eaglenest.sglang.patch.spool_prefill_rows) on
background threads after the answer (eaglenest.sglang.spool.SpoolWriter) — but runs the
target with transformers (eaglenest.target_model.runtime.capture_hidden_states, one sample per
forward), so its tensors equal the transformers backend's.

Fault modes reproduce what goes wrong on a node: ``--exit-after N`` kills the process
on request N+1 (a server dying mid-shard), ``--delay-s`` answers slowly, ``--drop-rows``
spools fewer rows than the prompt has (a shape mismatch), ``--wrong-ids`` computes on another
first token than was sent (a content mismatch), ``--impersonate vllm`` answers
like a vLLM OpenAI server, ``--impersonate sglang`` like an SGLang without the patch;
``--chat-fail-first N`` answers the first N chat requests with 503 (a server warming up),
``--chat-fail-containing TEXT`` answers 500 to every chat request whose user turns contain TEXT.
A chat request with ``"stream": true`` is answered as SGLang streams it (server-sent events of
``--stream-interval`` tokens, ``--stream-token-delay-s`` per token), and ``POST /abort_request``
with its ``rid`` stops the stream at the next chunk; ``POST /freeze_gc`` freezes the stand-in's
garbage collector as SGLang's does (srt/entrypoints/http_server.py:1071-1081 in 0.5.14); ``GET /standin/stats`` lists the aborted request ids, the
tokens streamed in all and the freezes.

Serving (``--mode serve``, or in any mode without ``return_hidden_states``, as a plain SGLang
answers it), a ``POST /generate`` that streams or samples is regeneration
(``regenerate.api: generate``): token ids in, the answer's output ids out, sampled with
transformers and ended at ``stop_token_ids``, whole or streamed as SGLang streams /generate
(each event holds the output ids so far), aborted like a chat stream. Any other ``POST
/generate`` decodes greedily: with the target alone, or, given
SGLang's EAGLE-3 flags (``--speculative-algorithm EAGLE3 --speculative-draft-model-path EXPORT
--speculative-num-steps S --speculative-eagle-topk K --speculative-num-draft-tokens N``), by
speculative decoding with the drafter export and eaglenest.model.speculate, and reports the cycles
in ``meta_info`` under SGLang 0.5.23's keys (``spec_verify_ct``, ``spec_num_correct_drafts``,
``spec_accept_length``, ``spec_correct_drafts_histogram``). It reads SGLang's own flag names
(``--model-path``, ``--served-model-name``; others it does not model are ignored), so the launcher
can run it with the command line it builds for SGLang (EAGLENEST_SGLANG_COMMAND).

    python tests/support/standin_server.py --model DIR --target NAME --port 30000
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from eaglenest.target_model import layer_ids as layer_id_convention
from eaglenest.sglang import patch as sglang_patch, spool


class StandinModel:
    """The target and the settings the patched server would have been launched with."""

    def __init__(self, model_path: str, target: str, layer_ids, spool_dir: str, mode: str | None = None,
                 draft_model: str | None = None, drafting: dict | None = None):
        import torch

        from eaglenest.target_model import runtime as target_runtime

        self.model = target_runtime.load_target(model_path, "cpu", "float32")
        self.drafting = None
        if draft_model is not None:
            from eaglenest.model import speculate
            from eaglenest.stages import export

            drafter = export.load_any_drafter(draft_model, model_path).to(torch.float32).eval()
            self.decoder = speculate.SpeculativeDecoder(self.model, drafter)
            self.drafting = speculate.Drafting.from_dict(drafting)
        self.torch = torch
        self.target_runtime = target_runtime
        num_layers = self.model.config.num_hidden_layers
        self.layer_ids = layer_id_convention.resolve(layer_ids, num_layers)
        self.lock = threading.Lock()
        architecture = (self.model.config.architectures or [type(self.model).__name__])[0]
        self.settings = {
            "spool_dir": spool_dir,
            "target": target,
            "model_path": str(model_path),
            "architecture": architecture,
            "hidden_size": self.model.config.hidden_size,
            "layer_ids": self.layer_ids,
            "sglang_layer_ids": self.layer_ids,
            "tensor_parallel": 1,
            # What the launcher put in the capture settings, as the patch reads it.
            "launch_token": (sglang_patch.settings_from_env() or {}).get("launch_token"),
            "mode": mode or (sglang_patch.settings_from_env() or {}).get("mode", "capture"),
        }

    def decode(self, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        """Greedy output ids and SGLang's speculative meta_info fields (none without a drafter).

        As SGLang counts them (sglang/srt/managers/scheduler_components/batch_result_processor.py:
        832-836 in 0.5.23): one verify step per cycle, the drafts each accepted (the bonus
        excluded, a run past a stop included), and spec_accept_length = completion tokens over
        verify steps (tokenizer_manager.py:3166-3168), the prefill's first token included."""
        from eaglenest.model import speculate

        with self.lock:
            if self.drafting is None:
                eos = speculate.target_eos_ids(self.model)
                return speculate.target_decode(self.model, input_ids, max_new_tokens, eos).tokens, {}
            result = self.decoder.generate(input_ids, self.drafting, max_new_tokens, 0.0)
        if not result.cycles:
            return result.tokens, {}
        histogram = [0] * (max(result.accepted) + 1)
        for accepted in result.accepted:
            histogram[accepted] += 1
        proposed = result.cycles * (self.drafting.tokens - 1)
        return result.tokens, {
            "spec_verify_ct": result.cycles,
            "spec_num_correct_drafts": sum(result.accepted),
            "spec_num_proposed_drafts": proposed,
            "spec_accept_rate": sum(result.accepted) / proposed,
            "spec_accept_length": len(result.tokens) / result.cycles,
            "spec_correct_drafts_histogram": histogram,
        }

    def prefill(self, input_ids: list[int]):
        """(aux [n, A*H], last [n, H]) in the compute dtype, like the server's model dtype."""
        torch = self.torch
        ids = torch.tensor(input_ids, dtype=torch.int32)
        offsets = torch.tensor([0, len(input_ids)], dtype=torch.int64)
        with self.lock:  # one forward at a time, like one GPU
            return self.target_runtime.capture_hidden_states(
                self.model, ids, [len(input_ids)], offsets, self.layer_ids, torch.float32, max(len(input_ids), 1)
            )


def make_handler(options, state: dict):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # keep the test output readable
            if options.verbose:
                super().log_message(fmt, *args)

        def _send(self, status: int, payload) -> None:
            self._send_body(status, json.dumps(payload).encode(), "application/json")

        def _send_body(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if options.impersonate == "vllm":
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": options.target, "object": "model", "owned_by": "vllm"}]})
                return self._send(404, {"detail": "Not Found"})
            if self.path == "/health":
                return self._send(200, {})
            if options.impersonate == "sglang" and self.path == "/get_model_info":
                return self._send(200, {"model_path": str(options.model), "is_generation": True})
            if self.path == "/standin/stats":
                with state["lock"]:
                    return self._send(200, {"aborted": sorted(state["aborted"]), "streamed_tokens": state["streamed_tokens"],
                                            "chunks": state["chunks"], "gc_frozen": state["gc_frozen"]})
            if options.impersonate is None and self.path == sglang_patch.INFO_ROUTE:
                return self._send(200, sglang_patch.server_info(state["model"].settings, "stand-in"))
            if options.enable_metrics and self.path == "/metrics":
                # SGLang's Prometheus text (--enable-metrics), of what the stand-in counts: the
                # requests it is answering now. It has no radix cache, so no eviction metrics.
                with state["lock"]:
                    body = (f"# TYPE sglang:num_running_reqs gauge\n"
                            f'sglang:num_running_reqs{{model_name="{options.target}",tp_rank="0"}} {state["running"]}.0\n')
                return self._send_body(200, body.encode(), "text/plain; version=0.0.4")
            return self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length", 0))
            request = json.loads(self.rfile.read(length) or b"{}")
            with state["lock"]:
                state["running"] += 1
            try:
                return self._answer_post(request)
            finally:
                with state["lock"]:
                    state["running"] -= 1

        def _answer_post(self, request):
            if self.path == "/v1/chat/completions" and options.impersonate is None:
                return self._chat(request)
            if self.path == "/freeze_gc" and options.impersonate != "vllm":  # as SGLang: freeze, then a line of text
                gc.freeze()
                with state["lock"]:
                    state["gc_frozen"] += 1
                return self._send_body(200, b"Garbage collection frozen.\n", "text/plain")
            if self.path == "/abort_request" and options.impersonate is None:
                with state["lock"]:
                    state["aborted"].add(request.get("rid"))
                return self._send(200, {})
            if options.impersonate == "vllm" or self.path != "/generate":
                return self._send(404, {"detail": "Not Found"})
            with state["lock"]:
                state["requests"] += 1
                count = state["requests"]
            if options.exit_after is not None and count > options.exit_after:
                os._exit(3)  # a crash: no answer, no cleanup, the port closes
            if options.delay_s:
                time.sleep(options.delay_s)
            sampling = request.get("sampling_params") or {}
            regeneration = request.get("stream") or float(sampling.get("temperature", 1.0)) != 0
            if state["model"].settings["mode"] == "serve" or (regeneration and not request.get("return_hidden_states")):
                if regeneration:  # (api: generate), also from a server the launcher did not patch, as a plain SGLang
                    return self._generate_answer(request)
                return self._generate(request)
            input_ids, rids = request.get("input_ids"), request.get("rid")
            batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
            samples = list(zip(input_ids, rids)) if batch and isinstance(rids, list) and len(rids) == len(input_ids) else (
                [] if batch else [(input_ids, rids)])
            if not samples or any(not isinstance(ids, list) or not ids or not isinstance(rid, str) for ids, rid in samples):
                return self._send(400, {"error": {"message": "need input_ids (a list of ints, or of such lists) and rid (one per sample)"}})
            answers = [self._prefill(ids, rid, request.get("return_hidden_states") is True) for ids, rid in samples]
            return self._send(200, answers if batch else answers[0])

        def _generate(self, request):
            """One prompt of a /generate request of a serving SGLang: greedy decoding of token ids."""
            input_ids, sampling = request.get("input_ids"), request.get("sampling_params") or {}
            if not isinstance(input_ids, list) or not input_ids or not all(isinstance(i, int) for i in input_ids):
                return self._send(400, {"error": {"message": "need input_ids, a list of ints (one prompt)"}})
            if float(sampling.get("temperature", 1.0)) != 0:
                return self._send(400, {"error": {"message": "the stand-in decodes greedily only (temperature 0)"}})
            max_new_tokens = int(sampling.get("max_new_tokens", 128))
            began = time.perf_counter()
            output_ids, spec = state["model"].decode(input_ids, max_new_tokens)
            finish = ({"type": "length", "length": max_new_tokens} if len(output_ids) >= max_new_tokens
                      else {"type": "stop", "matched": output_ids[-1]})
            meta = {"id": request.get("rid") or f"req-{time.monotonic_ns()}", "prompt_tokens": len(input_ids),
                    "completion_tokens": len(output_ids), "finish_reason": finish,
                    "e2e_latency": time.perf_counter() - began, **spec}
            return self._send(200, {"text": "", "output_ids": output_ids, "meta_info": meta})

        def _generate_answer(self, request):
            """One prompt of a /generate request as a serving SGLang answers regeneration: sampled
            (or greedy) with transformers, ended at ``stop_token_ids``, whole or streamed as
            SGLang streams /generate (each event holds the output ids so far)."""
            input_ids, sampling = request.get("input_ids"), request.get("sampling_params") or {}
            if not isinstance(input_ids, list) or not input_ids or not all(isinstance(i, int) for i in input_ids):
                return self._send(400, {"error": {"message": "need input_ids, a list of ints (one prompt)"}})
            with state["lock"]:
                state["chat_requests"] += 1
            answer = self._answer_with_generator(
                lambda generator: generator._generate_group([input_ids], int(sampling.get("sampling_seed") or 0))[0],
                float(sampling.get("temperature", 1.0)), float(sampling.get("top_p", 1.0)),
                int(sampling.get("max_new_tokens", 128)), stop_ids=sampling.get("stop_token_ids"))
            if answer.text is None:
                return self._send(500, {"error": {"message": answer.error}})
            ids, reason = answer.output_ids, {"type": "length" if answer.finish_reason == "length" else "stop"}
            rid = request.get("rid") or f"req-{time.monotonic_ns()}"

            def meta(count, finish=None) -> dict:
                return {"id": rid, "prompt_tokens": len(input_ids), "completion_tokens": count, "finish_reason": finish}

            if not request.get("stream"):
                return self._send(200, {"text": answer.text, "output_ids": ids, "meta_info": meta(len(ids), reason)})
            incremental = options.incremental_streaming_output
            streamed = [0]  # ids sent so far: an incremental chunk carries only the ones after them

            def piece(end) -> dict:
                start, streamed[0] = (streamed[0] if incremental else 0), end
                return {"text": None, "output_ids": ids[start:end], "meta_info": meta(end)}

            self._stream_tokens(request.get("rid"), ids, piece=piece,
                                ending=lambda sent, aborted: [{"text": None, "output_ids": [] if incremental else ids[:sent],
                                                               "meta_info": meta(sent, {"type": "abort"} if aborted else reason)}],
                                interval=sampling.get("stream_interval"))

        def _answer_with_generator(self, generate, temperature, top_p, max_new_tokens, stop_ids=None):
            with state["generate_lock"]:  # one generate at a time on the one model
                generator = state.get("chat") or chat_generator(options)
                state["chat"] = generator
                generator.settings = dataclasses.replace(generator.settings, temperature=temperature, top_p=top_p,
                                                         max_new_tokens=max_new_tokens)
                default_stop = generator.stop_ids
                generator.stop_ids = list(stop_ids) if stop_ids else default_stop
                try:
                    return generate(generator)
                finally:
                    generator.stop_ids = default_stop

        def _prefill(self, input_ids, rid, return_hidden_states):
            """One sample of a /generate request, as the patched server answers it."""
            if options.wrong_ids:  # a server that re-tokenized: same length, another first token
                input_ids = [(input_ids[0] + 1) % state["model"].model.config.vocab_size, *input_ids[1:]]
            aux, last = state["model"].prefill(input_ids)
            meta = {"id": rid, "prompt_tokens": len(input_ids), "completion_tokens": 1,
                    "finish_reason": {"type": "length", "length": 1}}
            if return_hidden_states and options.impersonate is None:
                spooled_ids = input_ids
                if options.drop_rows:  # a server that lost rows and spooled them anyway: the client must notice
                    aux, last = aux[: -options.drop_rows], last[: -options.drop_rows]
                    spooled_ids = input_ids[: len(aux)]
                rows = {"aux_hidden": aux, "last_hidden": last}
                if options.storage_dtype == sglang_patch.FP8_STORAGE:  # quantised in the server, as SGLang 0.5.14's patch does
                    import torch

                    rows = {"hidden": sglang_patch.quantized_rows(torch.cat([aux, last], dim=-1), last.shape[-1])}
                # Written on background threads after the answer, as the patched server does.
                meta[sglang_patch.SPOOL_KEY] = [sglang_patch.spool_prefill_rows(
                    options.spool_dir, rid, spooled_ids, rows, state["writer"]
                )]
            return {"text": "", "output_ids": [0], "meta_info": meta}

        def _chat(self, request):
            """OpenAI chat completions, as SGLang serves them, for the regeneration stage."""
            with state["lock"]:
                state["chat_requests"] += 1
                count = state["chat_requests"]
            if count <= options.chat_fail_first:
                return self._send(503, {"error": {"message": f"warming up (request {count})"}})
            messages = request.get("messages")
            if not isinstance(messages, list) or not messages:
                return self._send(400, {"error": {"message": "need messages"}})
            if options.chat_fail_containing and any(
                m.get("role") == "user" and options.chat_fail_containing in str(m.get("content")) for m in messages
            ):
                return self._send(500, {"error": {"message": "internal error on this prompt"}})
            if options.delay_s:
                time.sleep(options.delay_s)
            (answer,) = self._answer_with_generator(
                lambda generator: generator.generate([messages], seed=int(request.get("seed", 0))),
                float(request.get("temperature", 1.0)), float(request.get("top_p", 1.0)), int(request.get("max_tokens", 128)))
            if answer.text is None:
                return self._send(500, {"error": {"message": answer.error}})
            if request.get("stream"):
                return self._stream_chat(request, answer, state["chat"].tokenizer, count)
            return self._send(200, {
                "id": f"chatcmpl-{count}", "object": "chat.completion", "model": options.target,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                             "finish_reason": answer.finish_reason}],
                "usage": {"completion_tokens": answer.new_tokens},
            })

        def _stream_chat(self, request, answer, tokenizer, count):
            """The answer as SGLang streams chat completions: a delta of text per
            ``--stream-interval`` tokens, the finish reason, a usage chunk when asked, ``[DONE]``;
            an aborted request's stream ends at the next chunk with finish reason ``abort``."""
            ids = tokenizer(answer.text, add_special_tokens=False)["input_ids"]
            sent = [""]

            def chunk(content, reason=None) -> dict:
                return {"id": f"chatcmpl-{count}", "object": "chat.completion.chunk", "model": options.target,
                        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": reason}]}

            def piece(end):
                text = tokenizer.decode(ids[:end], skip_special_tokens=True)
                if not (text.startswith(sent[0]) and len(text) > len(sent[0])):  # hold back a character still incomplete
                    return None
                delta, sent[0] = text[len(sent[0]):], text
                return chunk(delta)

            def ending(sent_tokens, aborted):
                events = [chunk("", "abort" if aborted else answer.finish_reason)]
                if (request.get("stream_options") or {}).get("include_usage"):
                    events.append({"id": f"chatcmpl-{count}", "object": "chat.completion.chunk", "choices": [],
                                   "usage": {"completion_tokens": sent_tokens}})
                return events

            self._stream_tokens(request.get("rid"), ids, piece, ending)

        def _stream_tokens(self, rid, ids, piece, ending, interval=None):
            """Server-sent events over ``ids``: ``piece(end)`` per ``interval`` tokens (the
            request's own, else ``--stream-interval``; None: nothing to send yet),
            ``ending(tokens sent, aborted)``'s events, ``[DONE]``; a request aborted
            (``/abort_request`` with its ``rid``) ends at the next piece."""
            interval = int(interval or options.stream_interval)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            sent_tokens, aborted = 0, False

            def event(payload) -> None:
                self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                self.wfile.flush()

            try:
                for end in range(interval, len(ids) + interval, interval):
                    end = min(end, len(ids))
                    time.sleep(options.stream_token_delay_s * (end - sent_tokens))
                    with state["lock"]:
                        aborted = rid is not None and rid in state["aborted"]
                        if not aborted:
                            state["streamed_tokens"] += end - sent_tokens
                    if aborted:
                        break
                    sent_tokens = end
                    with state["lock"]:
                        state["chunks"] += 1
                    payload = piece(end)
                    if payload is not None:
                        event(payload)
                for payload in ending(sent_tokens, aborted):
                    event(payload)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client hung up
                pass

    return Handler


def chat_generator(options):
    from eaglenest.stages.regenerate import Settings, TransformersBackend

    return TransformersBackend(options.model, Settings.from_config({"device": "cpu", "retries": 0}))


def serve(options) -> None:
    state = {"lock": threading.Lock(), "generate_lock": threading.Lock(), "requests": 0, "chat_requests": 0,
             "writer": spool.SpoolWriter(2), "aborted": set(), "streamed_tokens": 0, "chunks": 0, "running": 0,
             "gc_frozen": 0}
    if options.speculative_algorithm not in (None, "EAGLE3"):
        raise SystemExit(f"the stand-in speculates with EAGLE3 only, not {options.speculative_algorithm}")
    drafting = None
    if options.speculative_algorithm == "EAGLE3":
        drafting = {"steps": options.speculative_num_steps, "topk": options.speculative_eagle_topk,
                    "tokens": options.speculative_num_draft_tokens}
    state["model"] = StandinModel(str(options.model), options.target, options.layer_ids, options.spool_dir, options.mode,
                                  draft_model=options.speculative_draft_model_path, drafting=drafting)
    state["model"].settings["storage_dtype"] = options.storage_dtype
    server = ThreadingHTTPServer((options.host, options.port), make_handler(options, state))
    server.daemon_threads = True
    port = server.server_address[1]
    if options.ready_file:
        tmp = Path(options.ready_file).with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": f"http://{options.host}:{port}", "pid": os.getpid()}))
        os.replace(tmp, options.ready_file)
    print(f"stand-in server for {options.target} on http://{options.host}:{port}", file=sys.stderr, flush=True)
    server.serve_forever()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", "--model-path", dest="model", required=True, help="transformers model directory")
    parser.add_argument("--target", "--served-model-name", dest="target", required=True,
                        help="target name the server reports")
    parser.add_argument("--speculative-algorithm", default=None, help="EAGLE3: decode speculatively (serve mode)")
    parser.add_argument("--speculative-draft-model-path", default=None, help="the drafter's SGLang export")
    parser.add_argument("--speculative-num-steps", type=int, default=None)
    parser.add_argument("--speculative-eagle-topk", type=int, default=None)
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    # SGLang 0.5.23's draft-less aux capture (what the launcher asks for in capture mode):
    # EAGLE3 with no draft model, and the layers in SGLang's numbering.
    parser.add_argument("--enable-return-aux-hidden-states", action="store_true")
    parser.add_argument("--return-aux-hidden-state-layer-ids", nargs="*", type=int, default=None)
    parser.add_argument("--layer-ids", nargs="*", type=int, default=None, help="HF-convention aux layers (default [2, N//2, N-3])")
    parser.add_argument("--spool-dir", default=None, help="default: the launcher's capture settings, else /dev/shm/eaglenest_hs")
    parser.add_argument("--storage-dtype", default=None,
                        help="float8_e4m3: quantise the rows before spooling them (default: the launcher's capture settings)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (see --ready-file)")
    parser.add_argument("--ready-file", help="written (url, pid) once the server listens")
    parser.add_argument("--exit-after", type=int, default=None, help="die on the request after this many")
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--drop-rows", type=int, default=0)
    parser.add_argument("--wrong-ids", action="store_true", help="compute on other token ids than were sent")
    parser.add_argument("--impersonate", choices=["vllm", "sglang"], default=None)
    parser.add_argument("--chat-fail-first", type=int, default=0, help="answer the first N chat requests with 503")
    parser.add_argument("--chat-fail-containing", default=None, help="answer 500 to chat requests whose user turns contain this text")
    parser.add_argument("--stream-interval", type=int, default=1, help="SGLang's: tokens per streamed chunk")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="SGLang's: a /generate chunk carries its new ids only, not every id so far")
    parser.add_argument("--stream-token-delay-s", type=float, default=0.0, help="a pause per streamed token (decode time)")
    parser.add_argument("--mode", choices=["capture", "serve"], default=None,
                        help="what /eaglenest/info says the server was started for (default: the launcher's settings, else capture)")
    parser.add_argument("--enable-metrics", action="store_true", help="SGLang's: GET /metrics (Prometheus text)")
    parser.add_argument("--verbose", action="store_true")
    # SGLang's flags that only tune a GPU server (--tp-size, --dtype, ...): nothing to model here.
    options, ignored = parser.parse_known_args(argv)
    if ignored:
        print(f"stand-in: ignoring SGLang flags {ignored}", file=sys.stderr, flush=True)
    # SGLang reads some scheduler knobs from its environment only: which of them this server got.
    knobs = {name: value for name, value in sorted(os.environ.items()) if name.startswith("SGLANG_")}
    if knobs:
        print(f"stand-in: SGLang environment {knobs}", file=sys.stderr, flush=True)
    # Started by eaglenest.sglang.launch (EAGLENEST_SGLANG_COMMAND), the stand-in gets SGLang's
    # flags and, as the patched server does, its capture settings from the environment.
    launched_with = sglang_patch.settings_from_env() or {}
    options.layer_ids = options.layer_ids or launched_with.get("layer_ids") or None
    options.spool_dir = options.spool_dir or launched_with.get("spool_dir") or sglang_patch.DEFAULT_SPOOL_DIR
    options.storage_dtype = options.storage_dtype or launched_with.get("storage_dtype") or "bfloat16"
    if options.enable_return_aux_hidden_states and options.speculative_draft_model_path is None:
        # Capture, not speculation; the layers asked for must be the run's, as SGLang numbers them.
        if launched_with and options.return_aux_hidden_state_layer_ids != launched_with["sglang_layer_ids"]:
            parser.error(f"--return-aux-hidden-state-layer-ids {options.return_aux_hidden_state_layer_ids} are not the "
                         f"capture settings' SGLang layer ids {launched_with['sglang_layer_ids']}")
        options.speculative_algorithm = None
    if options.speculative_algorithm and None in (options.speculative_draft_model_path, options.speculative_num_steps,
                                                 options.speculative_eagle_topk, options.speculative_num_draft_tokens):
        parser.error("--speculative-algorithm EAGLE3 needs the draft model path, steps, topk and draft tokens")
    return options


if __name__ == "__main__":
    serve(parse_args())
