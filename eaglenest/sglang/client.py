"""Extract, SGLang backend: one prepared shard -> one hidden shard through a patched server.

The server (started by eaglenest.sglang.launch, or the stand-in for machines without a
GPU) stays up across shards; each extract job is a client. Before sending anything the
client asks the server who it is (``GET /eaglenest/info``) and refuses anything that is
not the patched SGLang serving this target with these layers. Then it sends the
shard's samples as token ids, prefill only (``max_new_tokens`` 1), ``concurrency`` at
a time; the server writes each sample's hidden states to the spool directory and
answers with a descriptor. The client checks every spooled file against what it sent
(token ids, row counts, widths), hands the states to eaglenest.stages.shard_driver, and deletes
the file; the driver stores and writes the shard exactly as for the transformers backend.

Failures: a request that times out or finds no server is retried with exponential
backoff; after ``max_consecutive_failures`` failed attempts in a row the job stops
with a message naming the server. A protocol error (wrong rows, wrong ids, no
descriptor) is not retried. Either way nothing is written: the shard appears
atomically at the end or not at all, and Snakemake's ``retries`` can rerun the job.
A timed-out request still ends on the server, whose late answer spools a file nobody
reads; the shard's next job (and this one, once done) removes the shard's spool files.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Iterator

import torch

from eaglenest.stages import shard_driver
from eaglenest.formats import shards
from eaglenest.sglang import patch as sglang_patch, spool
from eaglenest.target_model import layer_ids as layer_id_convention

log = logging.getLogger(__name__)


class SglangServerError(RuntimeError):
    """The server is unreachable, not ours, or answered something we cannot use."""


class _Retryable(Exception):
    pass


def _get_json(url: str, timeout: float):
    """(status, parsed JSON or None); raises URLError/timeouts for no answer at all."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        try:
            body = json.loads(err.read() or b"null")
        except ValueError:
            body = None
        return err.code, body


def identify_server(url: str, timeout: float = 10.0) -> dict:
    """``/eaglenest/info`` of the server at ``url``, or SglangServerError saying what is there instead."""
    url = url.rstrip("/")
    try:
        status, info = _get_json(url + sglang_patch.INFO_ROUTE, timeout)
    except (urllib.error.URLError, OSError) as err:
        raise SglangServerError(
            f"no server answers at {url} ({getattr(err, 'reason', err)}). Start it on the node with "
            f"`python -m eaglenest.sglang.launch --configfile <config>` (docs/sglang.md), then rerun."
        ) from None
    if status == 200 and isinstance(info, dict) and info.get("server") == sglang_patch.SERVER_KIND:
        return info
    # Something else holds the port: say what, so the user can stop it.
    found = "an HTTP server that is not eaglenest's patched SGLang"
    try:
        models_status, models = _get_json(url + "/v1/models", timeout)
        owners = {m.get("owned_by") for m in (models or {}).get("data", []) if isinstance(m, dict)}
        if models_status == 200 and "vllm" in owners:
            names = [m.get("id") for m in models["data"]]
            found = f"a vLLM OpenAI server serving {names}"
        else:
            model_status, model_info = _get_json(url + "/get_model_info", timeout)
            if model_status == 200 and isinstance(model_info, dict) and "model_path" in model_info:
                found = f"an SGLang server without the eaglenest patch serving {model_info['model_path']}"
    except (urllib.error.URLError, OSError, ValueError):
        pass
    raise SglangServerError(
        f"{url} is {found} (GET {sglang_patch.INFO_ROUTE} answered {status}). Refusing to extract from it. "
        f"Stop that server (e.g. `nvidia-smi` shows its GPU memory; kill its process), then start ours with "
        f"`python -m eaglenest.sglang.launch --configfile <config>`."
    )


def check_server(
    url: str, target_name: str, layer_ids: list[int], hidden_size: int, timeout: float = 10.0, launch_token: str | None = None,
    mode: str = "capture",
) -> dict:
    """Refuse a patched server that serves another target, other layers or another patch version;
    with ``launch_token``, also one that another launcher started (one answering on the port
    that this launcher's server has not bound yet)."""
    info = identify_server(url, timeout)
    if launch_token is not None and info.get("launch_token") != launch_token:
        raise SglangServerError(
            f"the patched SGLang server at {url} is not the one this launcher started "
            f"(launch token {info.get('launch_token')!r}); another server holds the port"
        )
    expected = {
        "patch_version": sglang_patch.PATCH_VERSION,
        "target": target_name,
        "layer_ids": list(layer_ids),  # HF convention on both sides
        "hidden_size": hidden_size,
        "mode": mode,  # a server started to generate (regenerate stage) captures nothing
    }
    wrong = {key: (info.get(key), value) for key, value in expected.items() if info.get(key) != value}
    if wrong:
        details = ", ".join(f"{key}: server has {got!r}, config wants {want!r}" for key, (got, want) in wrong.items())
        raise SglangServerError(
            f"the patched SGLang server at {url} does not match this run ({details}). Restart it with "
            f"`python -m eaglenest.sglang.launch --configfile <this run's config>`."
        )
    return info


def post_json(url: str, payload: dict, timeout_s: float):
    """POST ``payload`` as JSON to ``url``; the parsed answer. urllib's errors (HTTPError,
    URLError, timeouts) reach the caller, which decides what is worth a retry."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


# How long a failed request's other samples may take to land before they are left to the next
# job's cleanup (remove_leftovers).
DISCARD_WAIT_S = 10.0


class _ShardRequests:
    """Sends one shard's samples, many to a request, and gathers their spooled tensors."""

    def __init__(self, url, spool_dir, shard_tag, layer_ids, hidden_size, storage_dtype, timeout_s, retries, backoff_s,
                 max_consecutive_failures, spool_timeout_s):
        self.url = url.rstrip("/")
        self.spool_dir = Path(spool_dir).resolve()
        self.shard_tag = shard_tag
        self.hidden_size = hidden_size
        self.widths = (len(layer_ids) * hidden_size, hidden_size)
        self.num_aux_layers, self.storage_dtype = len(layer_ids), storage_dtype
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_consecutive_failures = max_consecutive_failures
        self.spool_timeout_s = spool_timeout_s
        self.lock = threading.Lock()
        self.consecutive_failures = 0
        self.requests_sent = 0
        self.stop = threading.Event()
        self.first_error: SglangServerError | None = None  # the cause, not the "stopped" echoes

    def _post(self, payload: dict):
        try:
            return post_json(self.url + "/generate", payload, self.timeout_s)
        except urllib.error.HTTPError as err:
            body = err.read()[:500].decode(errors="replace")
            if err.code >= 500 or err.code == 429:
                raise _Retryable(f"HTTP {err.code}: {body}") from None
            raise SglangServerError(f"{self.url}/generate refused the request: HTTP {err.code}: {body}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:  # refused, reset, timed out, cut short
            raise _Retryable(f"{type(err).__name__}: {getattr(err, 'reason', err)}") from None

    def _record(self, failed: bool, reason: str = "") -> None:
        with self.lock:
            self.requests_sent += 1
            self.consecutive_failures = self.consecutive_failures + 1 if failed else 0
            if failed and self.consecutive_failures >= self.max_consecutive_failures:
                self.stop.set()
                raise SglangServerError(
                    f"SGLang server at {self.url} failed {self.consecutive_failures} requests in a row "
                    f"(last: {reason}); giving up on this shard, nothing was written. Check the server "
                    "(its log, `curl {url}/health`), restart it if it died, then rerun: Snakemake's retries "
                    "or a plain rerun extract only the missing shards.".replace("{url}", self.url)
                )

    def fetch(self, samples: list[tuple[int, list[int]]]):
        """[(index, rows as the shard stores them, finite)] of (index, token ids) samples.

        The conversion to the storage dtype happens here, on the request's own thread, so
        that the requests in flight convert side by side."""
        try:
            return self._fetch(samples)
        except SglangServerError as err:
            with self.lock:
                if self.first_error is None:
                    self.first_error = err
            self.stop.set()
            raise

    def _fetch(self, samples):
        what = f"samples {samples[0][0]}-{samples[-1][0]}" if len(samples) > 1 else f"sample {samples[0][0]}"
        for attempt in range(self.retries + 1):
            if self.stop.is_set():
                raise SglangServerError("stopped: another request of this shard failed")
            tag = uuid.uuid4().hex[:12]  # fresh per attempt: a late answer never lands on a new file
            rids = [f"eaglenest-{self.shard_tag}-{index}-{tag}" for index, _ in samples]
            # Always lists, so SGLang treats even one sample as a batch and answers with a list.
            payload = {
                "input_ids": [ids for _, ids in samples],
                "rid": rids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_hidden_states": True,
                "stream": False,
            }
            try:
                response = self._post(payload)
            except _Retryable as err:
                self._record(True, f"{what}: {err}")
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
                    continue
                raise SglangServerError(
                    f"SGLang server at {self.url}: {what} failed {self.retries + 1} times (last: {err}); "
                    "nothing was written"
                ) from None
            self._record(False)
            answers = response if isinstance(response, list) else [response]
            if len(answers) != len(samples):
                raise SglangServerError(f"{self.url} answered {len(answers)} results for {len(samples)} samples ({what})")
            collected = []
            try:
                for (index, ids), rid, answer in zip(samples, rids, answers):
                    collected.append(self._collect(index, ids, rid, answer))
            except SglangServerError:
                # The answer's other samples are being spooled still: their files would outlast
                # the job's cleanup and fill the spool directory.
                self._discard(rids[len(collected) + 1 :], answers[len(collected) + 1 :])
                raise
            return collected
        raise AssertionError("unreachable")

    def _discard(self, rids: list[str], answers: list[dict]) -> None:
        for rid, answer in zip(rids, answers):
            for descriptor in (answer.get("meta_info") or {}).get(sglang_patch.SPOOL_KEY) or []:
                path = Path(descriptor.get("path", "")).resolve()
                if path.parent != self.spool_dir or descriptor.get("rid") != rid or descriptor.get("error"):
                    continue
                try:
                    spool.wait_for_spooled(path, min(self.spool_timeout_s, DISCARD_WAIT_S))
                except spool.SpoolError:
                    pass
                path.unlink(missing_ok=True)

    def _collect(self, index: int, token_ids: list[int], rid: str, response: dict):
        meta = response.get("meta_info") or {}
        descriptors = meta.get(sglang_patch.SPOOL_KEY)
        if not descriptors:
            raise SglangServerError(
                f"{self.url} answered sample {index} without meta_info[{sglang_patch.SPOOL_KEY!r}]: its scheduler "
                "runs without the eaglenest patch (see the server log for 'eaglenest capture'); restart it with "
                "eaglenest.sglang.launch"
            )
        descriptor = descriptors[0]
        if descriptor.get("error"):
            raise SglangServerError(f"{self.url} could not capture sample {index}: {descriptor['error']}")
        path = Path(descriptor.get("path", "")).resolve()
        try:
            if path.parent != self.spool_dir or descriptor.get("rid") != rid:
                raise SglangServerError(
                    f"{self.url} spooled sample {index} to {path} (rid {descriptor.get('rid')}); expected a file "
                    f"for rid {rid} in {self.spool_dir}. Client and server must share extract.sglang.spool_dir."
                )
            spool.wait_for_spooled(path, self.spool_timeout_s)
            tensors, metadata = spool.read_spool_file(path)
        except spool.SpoolError as err:
            raise SglangServerError(
                f"sample {index}: {err}. Client and server must run on the same node and share "
                "extract.sglang.spool_dir; a full spool directory (df -h on it) also stops the server's writes."
            ) from None
        finally:
            path.unlink(missing_ok=True)
        n = len(token_ids)
        if "hidden" in tensors and tensors["hidden"].dtype == torch.uint8:  # quantised by the server
            return index, *self._server_quantized(index, token_ids, tensors)
        if "hidden" in tensors:  # packed rows [aux..., last] (sglang 0.5.14)
            aux, last = tensors["hidden"][:, : -self.hidden_size], tensors["hidden"][:, -self.hidden_size :]
        else:
            aux, last = tensors.get("aux_hidden"), tensors.get("last_hidden")
        if aux is None or last is None or tuple(aux.shape) != (n, self.widths[0]) or tuple(last.shape) != (n, self.widths[1]):
            shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
            raise SglangServerError(
                f"{self.url} returned {shapes} for sample {index} of {n} tokens; expected aux ({n}, {self.widths[0]}) "
                f"and last ({n}, {self.widths[1]})"
            )
        self._check_token_ids(index, token_ids, tensors)
        stored = shard_driver.to_storage(aux.contiguous(), last.contiguous(), self.storage_dtype, self.num_aux_layers)
        return index, stored, metadata.get("finite") == "1"

    def _check_token_ids(self, index: int, token_ids: list[int], tensors: dict) -> None:
        if not torch.equal(tensors["input_ids"], torch.tensor(token_ids, dtype=torch.int64)):
            raise SglangServerError(f"{self.url} computed sample {index} on other token ids than were sent")

    def _server_quantized(self, index: int, token_ids: list[int], tensors: dict) -> tuple[dict, bool]:
        """(the shard's fp8 tensors, finite) of rows the server quantised before their copy to
        the host (eaglenest.sglang.patch.quantized_rows): split, not computed."""
        packed, n = tensors["hidden"], len(token_ids)
        groups = self.num_aux_layers + 1
        width = groups * self.hidden_size + 4 * groups
        if self.storage_dtype != shards.FP8_DTYPE:
            raise SglangServerError(
                f"{self.url} quantised sample {index} to fp8; this run stores {self.storage_dtype}. The server was "
                "started for a run with extract.dtype float8_e4m3: restart it with this run's config."
            )
        if tuple(packed.shape) != (n, width):
            raise SglangServerError(f"{self.url} returned fp8 rows {tuple(packed.shape)} for sample {index} of {n} tokens; "
                                    f"expected ({n}, {width})")
        self._check_token_ids(index, token_ids, tensors)
        stored = sglang_patch.split_quantized_rows(packed, self.hidden_size, self.num_aux_layers)
        # An infinity makes its row's scale infinite, a NaN stays a NaN byte (quantize_rows).
        finite = (all(bool(torch.isfinite(stored[name]).all()) for name in ("aux_hidden_scale", "last_hidden_scale"))
                  and shards.all_finite(stored["aux_hidden"]) and shards.all_finite(stored["last_hidden"]))
        return stored, finite

    def remove_leftovers(self) -> None:
        """Spool files of this shard that a late answer may still write after a failure."""
        for leftover in self.spool_dir.glob(f"eaglenest-{self.shard_tag}-*"):
            leftover.unlink(missing_ok=True)


def request_groups(token_counts: list[int], samples_per_request: int, tokens_per_request: int) -> list[list[int]]:
    """Sample indices in shard order, cut into requests of at most ``samples_per_request``
    samples and ``tokens_per_request`` prompt tokens (a longer sample goes alone)."""
    groups, current, tokens = [], [], 0
    for index, count in enumerate(token_counts):
        if current and (len(current) == samples_per_request or tokens + count > tokens_per_request):
            groups.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += count
    if current:
        groups.append(current)
    return groups


def windowed(pool, groups: list[list[int]], token_counts: list[int], max_requests: int, max_tokens: int,
             call) -> Iterator:
    """Futures of ``call(group)`` for every group, run on ``pool``, as they finish.

    Groups go out in order while the window has room: at most ``max_requests`` calls and
    ``max_tokens`` prompt tokens sent and not yet answered (always at least one). A server
    finishes them nearly in that order, so answers stream out while it computes the next
    ones, instead of all at the end. More are sent before finished ones are handed on, so the
    server never waits for what the caller does with an answer (the disk).
    """
    pending: dict = {}  # future -> (group number, prompt tokens)
    sent, in_flight = 0, 0

    def send() -> None:
        nonlocal sent, in_flight
        while sent < len(groups) and len(pending) < max_requests:
            tokens = sum(token_counts[i] for i in groups[sent])
            if pending and in_flight + tokens > max_tokens:
                return
            pending[pool.submit(call, groups[sent])] = (sent, tokens)
            sent, in_flight = sent + 1, in_flight + tokens

    send()
    while pending:
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        finished = sorted(done, key=lambda future: pending[future][0])
        for future in finished:
            in_flight -= pending.pop(future)[1]
        send()
        yield from finished


def disk_preflight(prepared_path, hidden_path, layer_ids, hidden_size: int, num_layers: int, dtype: str,
                   disk_reserve_bytes: int) -> dict:
    """shard_driver.preflight for a shard of a server with this target shape (from the run's config)."""
    shard_driver.check_storage_dtype(dtype)
    layer_ids = layer_id_convention.resolve(layer_ids, num_layers)
    bytes_per_token = shards.hidden_bytes_per_token(hidden_size, len(layer_ids), dtype)
    numbers = shard_driver.preflight(Path(hidden_path), Path(prepared_path), bytes_per_token, disk_reserve_bytes)
    log.info("preflight: %s", numbers)
    return numbers


class ServerBackend:
    """The patched SGLang server at ``url``: shard_driver's hidden-state backend.

    The target's shape comes from the run's config: the server is asked nothing before the
    disk preflight has passed.
    """

    device = torch.device("cpu")  # answers arrive as host tensors read from the spool
    in_token_order = False  # concurrent requests finish in any order

    def __init__(self, url, shard_tag, target_name, hidden_size, num_layers, spool_dir, concurrency, request_timeout_s,
                 retries, backoff_s, max_consecutive_failures, samples_per_request=2, tokens_per_request=131072,
                 spool_timeout_s=120.0, dtype="bfloat16", tokens_in_flight=32768):
        self.url, self.shard_tag, self.target_name, self.dtype = url, shard_tag, target_name, dtype
        self.hidden_size, self.num_layers, self.spool_dir, self.concurrency = hidden_size, num_layers, spool_dir, concurrency
        self.samples_per_request, self.tokens_per_request = samples_per_request, tokens_per_request
        self.tokens_in_flight = tokens_in_flight
        self.retry_policy = (request_timeout_s, retries, backoff_s, max_consecutive_failures, spool_timeout_s)

    def target_shape(self) -> tuple[int, int]:
        return self.num_layers, self.hidden_size

    def start(self, layer_ids: list[int]) -> None:
        info = check_server(self.url, self.target_name, layer_ids, self.hidden_size)
        log.info("server %s: %s", self.url, info)
        spool_dir = info["spool_dir"] if self.spool_dir is None else self.spool_dir
        self.requests = _ShardRequests(self.url, spool_dir, self.shard_tag, layer_ids, self.hidden_size, self.dtype,
                                       *self.retry_policy)

    def largest_answer(self, prepared: shards.ShardReader) -> int:
        return max(prepared.token_counts, default=0)

    def hidden_states(self, prepared: shards.ShardReader, layer_ids: list[int]) -> Iterator[shard_driver.StateRows]:
        requests = self.requests
        tensors = prepared.tensors(shards.PREPARED_TENSORS)
        offsets, input_ids = tensors["offsets"].tolist(), tensors["input_ids"]
        token_counts = list(prepared.token_counts)
        # Late answers to requests an earlier attempt at this shard gave up on (timeouts).
        requests.remove_leftovers()
        groups = request_groups(token_counts, self.samples_per_request, self.tokens_per_request)
        pool = ThreadPoolExecutor(max_workers=max(1, self.concurrency), thread_name_prefix="sglang-client")
        try:
            answers = windowed(
                pool, groups, token_counts, self.concurrency, self.tokens_in_flight,
                lambda group: requests.fetch([(i, input_ids[offsets[i] : offsets[i + 1]].tolist()) for i in group]),
            )
            for future in answers:
                for index, stored, finite in future.result():  # raises the request's failure
                    yield shard_driver.StateRows(offsets[index], stored["aux_hidden"], stored["last_hidden"],
                                                 finite=finite, stored=stored)
        except BaseException as err:
            requests.stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            requests.remove_leftovers()
            # The failure that stopped the shard, not the "stopped" echoes of the requests after it.
            if requests.first_error is not None and err is not requests.first_error and not isinstance(err, GeneratorExit):
                raise requests.first_error from None
            raise
        pool.shutdown(wait=True)
        requests.remove_leftovers()  # late answers to this job's own timed-out, retried requests


def extract_shard_via_server(
    prepared_path: str | os.PathLike,
    hidden_path: str | os.PathLike,
    url: str,
    target_name: str,
    layer_ids: list[int],
    hidden_size: int,
    num_layers: int,
    dtype: str = "bfloat16",
    spool_dir: str = sglang_patch.DEFAULT_SPOOL_DIR,
    concurrency: int = 16,
    samples_per_request: int = 2,
    tokens_per_request: int = 131072,
    tokens_in_flight: int = 32768,
    spool_timeout_s: float = 120.0,
    request_timeout_s: float = 600.0,
    retries: int = 3,
    backoff_s: float = 2.0,
    max_consecutive_failures: int = 8,
    check_disk: bool = True,
    disk_reserve_bytes: int = 0,
    log_stream=None,
) -> dict:
    """Make one hidden shard from one prepared shard through the server at ``url``."""
    shard_tag = Path(hidden_path).name.split(".")[0]
    backend = ServerBackend(url, shard_tag, target_name, hidden_size, num_layers, spool_dir, concurrency, request_timeout_s,
                            retries, backoff_s, max_consecutive_failures, samples_per_request, tokens_per_request,
                            spool_timeout_s, dtype, tokens_in_flight)
    result = shard_driver.extract_hidden_shard(
        prepared_path, hidden_path, backend, target_name, layer_ids, dtype, check_disk, disk_reserve_bytes, log_stream
    )
    requests_s = result.start_s + result.compute_s
    stats = {
        "shard": Path(hidden_path).name,
        "backend": "sglang",
        "server": url,
        "samples": result.samples,
        "tokens": result.tokens,
        "bytes_per_token": result.bytes_per_token,
        "bytes": result.bytes,
        "requests": backend.requests.requests_sent,
        "requests_s": round(requests_s, 3),
        "write_s": round(result.write_s, 3),
        "tokens_per_s": round(result.tokens / max(requests_s, 1e-9), 1),
        # The whole job's rate: requests, spool reads and the shard on disk (fsynced).
        "tokens_per_s_written": round(result.tokens / max(requests_s + result.write_s, 1e-9), 1),
        **({"pipeline": result.pipeline} if result.pipeline else {}),
    }
    log.info("extracted %s", stats)
    return stats
