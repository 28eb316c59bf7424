"""The patch that makes a running SGLang server hand back hidden states as files.

Written against sglang==0.5.23 (``SGLANG_VERSION``; envs/sglang.yaml pins the same).
That version already captures EAGLE-3 aux hidden states for a target without a draft
(``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
--return-aux-hidden-state-layer-ids ...`` -> ``set_eagle3_layers_to_capture``), and its
logits processor keeps, under full capture, the packed aux states in
``LogitsProcessorOutput.hidden_states`` and the final post-norm state in
``LogitsProcessorOutput.last_hidden_states``. What it lacks is a way out: a request
with ``return_hidden_states`` gets the aux states as JSON float lists (57 KB/token of
Kimi-K2.5 turned into megabytes of text) and never the last hidden state.

So the patch changes three methods and adds one route, nothing in any model:

1. ``SchedulerBatchResultProcessor._append_prefill_hidden_states``: for a full-capture
   request, write its aux rows, last rows and prompt ids to one safetensors file in the
   spool directory, named by request id, and put only a descriptor (path, shapes,
   dtypes) in the request's ``customized_info`` instead of float lists.
2. ``SchedulerOutputStreamer.is_request_level_customized_info_key``: our descriptor is
   sent once per request (not sliced per output token); it arrives in the response's
   ``meta_info["eaglenest_spool"]``.
3. ``model_runner.configure_aux_hidden_state_capture``: after SGLang rewrote the layer
   ids, check that the model captures exactly the HF-convention layers eaglenest asked
   for, and stop the server at load time if not.
4. ``GET /eaglenest/info`` on the HTTP app: identifies the patched server, the patch
   version, the target and its layers, so a client never talks to the wrong server.

sglang 0.5.14 (the release that runs on torch 2.11, e.g. on the H200 test image) has
neither the draft-less aux capture nor ``last_hidden_states``; there the patch does the
same with other hooks (``PATCH_TARGETS["0.5.14"]``): ``ModelRunner.init_aux_hidden_state_capture``
also sets the target's capture layers (no draft needed), ``LogitsProcessor._get_hidden_states_to_store``
appends the final post-norm state to the packed aux states under full capture (rows
``[n, (A+1)*H]``), and the replaced ``_append_prefill_hidden_states`` splits them again.
0.5.14 slices ``customized_info`` per output token, which our one-element list survives
for a one-token (prefill-only) request, so it needs no request-level key.

It is loaded as an SGLang general plugin (entry-point group ``sglang.srt.plugins``,
which sglang 0.5.14 and 0.5.23 load at the start of the HTTP process and of every
scheduler process). eaglenest.sglang.launch registers that entry point for the server it starts
and passes the settings in ``EAGLENEST_CAPTURE`` (JSON); without that variable the
plugin does nothing, so other SGLang servers on the node are unaffected.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable

from eaglenest.sglang import spool
from eaglenest.sglang.spool import spool_path  # noqa: F401  (the name clients and tests use)

SGLANG_VERSION = "0.5.23"  # production pin (envs/sglang.yaml)
# Every version the patch has hooks for; the tests check each against its source.
SUPPORTED_SGLANG_VERSIONS = ("0.5.23", "0.5.14")
PATCH_VERSION = 2  # 2: spool files written off the scheduler thread, batched requests
SERVER_KIND = "eaglenest-sglang-capture"
# extract.dtype of a run whose rows the server quantises (eaglenest.formats.shards.FP8_DTYPE;
# not imported: this module loads in SGLang's processes before torch is needed)
FP8_STORAGE = "float8_e4m3"
SETTINGS_ENV = "EAGLENEST_CAPTURE"
SPOOL_KEY = "eaglenest_spool"
INFO_ROUTE = "/eaglenest/info"
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "eaglenest_capture"
DEFAULT_SPOOL_DIR = "/dev/shm/eaglenest_hs"

# Everything in sglang the patch touches, per version: (module, attribute path). The tests
# check each against that version's source; apply() fails loudly if one is missing at run time.
_BATCH_RESULT = "sglang.srt.managers.scheduler_components.batch_result_processor"
_SHARED_TARGETS = {
    "append_prefill": (_BATCH_RESULT, "SchedulerBatchResultProcessor._append_prefill_hidden_states"),
    "http_app": ("sglang.srt.entrypoints.http_server", "app"),
    "parallel": ("sglang.srt.runtime_context", "get_parallel"),
}
PATCH_TARGETS = {
    "0.5.23": {
        **_SHARED_TARGETS,
        "request_level_key": (
            "sglang.srt.managers.scheduler_components.output_streamer",
            "SchedulerOutputStreamer.is_request_level_customized_info_key",
        ),
        "configure_capture": ("sglang.srt.model_executor.model_runner", "configure_aux_hidden_state_capture"),
    },
    "0.5.14": {
        **_SHARED_TARGETS,
        "init_capture": ("sglang.srt.model_executor.model_runner", "ModelRunner.init_aux_hidden_state_capture"),
        "hidden_states_to_store": ("sglang.srt.layers.logits_processor", "LogitsProcessor._get_hidden_states_to_store"),
    },
}

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """The server is not capturing what eaglenest asked for."""


# ---------------------------------------------------------------- spool (pure, CPU-testable)


def spool_prefill_rows(spool_dir, rid: str, prompt_ids, rows: dict, writer: spool.SpoolWriter | None = None, ready=None) -> dict:
    """Spool one request's hidden states; return the descriptor for its response at once.

    ``rows`` maps spool tensor names (``aux_hidden`` and ``last_hidden``, or the packed
    ``hidden``; see eaglenest.sglang.spool) to host tensors with one row per prompt token,
    or to None where the server produced none. When a row count does not match the prompt
    (a prefix-cache hit or a chunked prefill skipped rows) nothing is written and the
    descriptor carries the reason, so the client fails with it. With a ``writer`` the file
    is written on its threads once ``ready`` (the device-to-host copy's event) has fired;
    without one, here and now.
    """
    import torch

    descriptor = {"rid": rid, "patch_version": PATCH_VERSION}
    prompt_len = len(prompt_ids)
    missing = [name for name, tensor in rows.items() if tensor is None]
    if missing:
        descriptor["error"] = (
            f"the server produced no {' / '.join(missing)}; start it with eaglenest.sglang.launch "
            "(--enable-return-aux-hidden-states --speculative-algorithm EAGLE3)"
        )
        return descriptor
    counts = {name: int(tensor.shape[0]) for name, tensor in rows.items()}
    if any(count != prompt_len for count in counts.values()):
        descriptor["error"] = (
            f"got {counts} rows for a prompt of {prompt_len} tokens; the radix cache or chunked prefill is on "
            "(start the server with --disable-radix-cache --chunked-prefill-size -1)"
        )
        return descriptor
    path = spool.spool_path(spool_dir, rid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"input_ids": torch.as_tensor(list(prompt_ids), dtype=torch.int64), **rows}
    metadata = {"rid": rid}
    if writer is None:
        spool.write_request(path, tensors, metadata, ready)
    else:
        writer.submit(path, tensors, metadata, ready)
    descriptor.update(
        path=str(path),
        num_tokens=prompt_len,
        tensors={name: _shape_and_dtype(tensor) for name, tensor in rows.items()},
    )
    return descriptor


def _shape_and_dtype(tensor) -> dict:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def quantized_rows(rows, hidden_size: int):
    """Packed rows ``[aux..., last]`` [T, G*H] as the fp8 shard stores them, in one uint8
    tensor [T, G*H + 4*G]: each layer's e4m3 row (``shards.quantize_rows``, one scale per row
    and layer, as the client and the transformers backend quantise), then the G float32
    scales. Computed where the rows are (on the GPU in the server), so the copy to the host
    and the spool carry half the bytes and the client only splits them
    (``split_quantized_rows``). An infinity makes its row's scale infinite; a NaN stays a
    NaN byte (the client checks both)."""
    import torch

    from eaglenest.formats import shards

    quantized, scale = shards.quantize_rows(rows, rows.shape[-1] // hidden_size)
    return torch.cat([quantized.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def split_quantized_rows(packed, hidden_size: int, num_aux_layers: int) -> dict:
    """The shard's fp8 tensors and scales from ``quantized_rows``'s uint8 rows."""
    import torch

    width = (num_aux_layers + 1) * hidden_size
    quantized = packed[:, :width].view(torch.float8_e4m3fn)
    scale = packed[:, width:].contiguous().view(torch.float32)
    aux_width = num_aux_layers * hidden_size
    return {
        "aux_hidden": quantized[:, :aux_width].contiguous(),
        "last_hidden": quantized[:, aux_width:].contiguous(),
        "aux_hidden_scale": scale[:, :num_aux_layers].contiguous(),
        "last_hidden_scale": scale[:, num_aux_layers:].contiguous(),
    }


def read_spooled(path: str | os.PathLike) -> dict:
    """The tensors of one spool file: input_ids, aux_hidden, last_hidden (a packed file split)."""
    tensors, _ = spool.read_spool_file(path)
    return tensors


def rows_on_host(logits_output, names: tuple[str, ...]):
    """({name: host tensor or None}, ready event or None) of a batch's captured rows.

    Under SGLang's overlap scheduler the rows already reached pinned host memory with the
    batch's other results; otherwise one asynchronous copy per batch (not per request)
    takes them there, and the spool writer waits for its event, not the scheduler."""
    cache = logits_output.__dict__.setdefault("_eaglenest_host", {})
    if names not in cache:
        tensors = {name: getattr(logits_output, name, None) for name in names}
        ready = None
        if any(t is not None and t.is_cuda for t in tensors.values()):
            import torch

            tensors = {name: t.to("cpu", non_blocking=True) if t is not None else None for name, t in tensors.items()}
            ready = torch.cuda.Event()
            ready.record()
        cache[names] = (tensors, ready)
    return cache[names]


# ---------------------------------------------------------------- settings and identity


def settings_from_env(environ=os.environ) -> dict | None:
    raw = environ.get(SETTINGS_ENV)
    if not raw:
        return None
    settings = json.loads(raw)
    for key in ("spool_dir", "target", "layer_ids", "sglang_layer_ids", "architecture", "hidden_size"):
        if key not in settings:
            raise CaptureError(f"{SETTINGS_ENV} lacks {key!r}; start the server with eaglenest.sglang.launch")
    return settings


def server_info(settings: dict, sglang_version: str) -> dict:
    """What GET /eaglenest/info answers; the client compares it with its own config."""
    return {
        "server": SERVER_KIND,
        "patch_version": PATCH_VERSION,
        "sglang_version": sglang_version,
        "target": settings["target"],
        "model_path": settings.get("model_path"),
        "architecture": settings["architecture"],
        "hidden_size": settings["hidden_size"],
        # HF convention (input of decoder layer i); sglang_layer_ids is what SGLang was given.
        "layer_ids": settings["layer_ids"],
        "sglang_layer_ids": settings["sglang_layer_ids"],
        "tensor_parallel": settings.get("tensor_parallel", 1),
        "mode": settings.get("mode", "capture"),
        "storage_dtype": settings.get("storage_dtype", "bfloat16"),
        "spool_dir": settings["spool_dir"],
        # Set per start by the launcher: which server answers on a port, not only what it serves.
        "launch_token": settings.get("launch_token"),
    }


def captured_layers_of(model) -> list[int]:
    """``layers_to_capture`` of a loaded SGLang model (Kimi-K2.5 wraps a language_model)."""
    inner = getattr(model, "language_model", None) or model
    return list(inner.model.layers_to_capture)


def check_captured_layers(model, hf_layer_ids: list[int]) -> None:
    captured = captured_layers_of(model)
    if captured != list(hf_layer_ids):
        raise CaptureError(
            f"{type(model).__name__} captures layers {captured} but eaglenest asked for HF layers "
            f"{list(hf_layer_ids)}: the layer-id translation in eaglenest/target_model/layer_ids.py does not match "
            "this sglang version"
        )


# ---------------------------------------------------------------- the replaced methods


def make_append_prefill_hidden_states(original: Callable, settings: dict, is_output_rank: Callable[[], bool],
                                     writer: spool.SpoolWriter | None = None):
    """Replacement for SchedulerBatchResultProcessor._append_prefill_hidden_states (same signature)."""
    spool_dir = settings["spool_dir"]

    def _append_prefill_hidden_states(
        self, *, req, logits_output, hidden_state_offset, capture_hidden_mode, extend_input_len, store=True
    ):
        # Only full-capture requests that asked for everything (return_hidden_states=True)
        # are ours; "last" requests and last-token capture keep SGLang's behaviour.
        if not capture_hidden_mode.is_full() or req.return_hidden_states is not True:
            return original(
                self, req=req, logits_output=logits_output, hidden_state_offset=hidden_state_offset,
                capture_hidden_mode=capture_hidden_mode, extend_input_len=extend_input_len, store=store,
            )
        start, end = hidden_state_offset, hidden_state_offset + extend_input_len
        # Every TP rank runs this; only the rank whose output reaches the client writes.
        if store and is_output_rank():
            host, ready = rows_on_host(logits_output, ("hidden_states", "last_hidden_states"))
            rows = {
                "aux_hidden": host["hidden_states"][start:end] if host["hidden_states"] is not None else None,
                "last_hidden": host["last_hidden_states"][start:end] if host["last_hidden_states"] is not None else None,
            }
            _spool_descriptor(req, spool_dir, rows, writer, ready)
        return end

    _append_prefill_hidden_states.eaglenest_patch_version = PATCH_VERSION
    return _append_prefill_hidden_states


def make_is_request_level_key(original: Callable):
    def is_request_level_customized_info_key(self, key: str) -> bool:
        return key == SPOOL_KEY or original(self, key)

    return is_request_level_customized_info_key


def make_configure_capture(original: Callable, settings: dict):
    def configure_aux_hidden_state_capture(*, model, **kwargs):
        original(model=model, **kwargs)
        if kwargs.get("eagle_use_aux_hidden_state"):
            check_captured_layers(model, settings["layer_ids"])
            log.info("eaglenest capture: %s captures HF layers %s", type(model).__name__, settings["layer_ids"])

    return configure_aux_hidden_state_capture


def _spool_descriptor(req, spool_dir, rows: dict, writer, ready) -> None:
    descriptor = spool_prefill_rows(spool_dir, req.rid, req.origin_input_ids, rows, writer, ready)
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[SPOOL_KEY] = [descriptor]


def make_append_prefill_hidden_states_0514(original: Callable, settings: dict, is_output_rank: Callable[[], bool],
                                          writer: spool.SpoolWriter | None = None):
    """sglang 0.5.14's SchedulerBatchResultProcessor._append_prefill_hidden_states (same signature).

    Its rows are ``[aux..., last]`` packed by make_hidden_states_to_store_0514, one per
    prompt token; they are spooled packed (``hidden``) and the client splits them. 0.5.14
    itself advances the offset by the prompt length."""
    spool_dir, hidden = settings["spool_dir"], settings["hidden_size"]

    def _append_prefill_hidden_states(self, *, req, logits_output, hidden_state_offset):
        if req.return_hidden_states is not True:
            return original(self, req=req, logits_output=logits_output, hidden_state_offset=hidden_state_offset)
        end = hidden_state_offset + len(req.origin_input_ids)
        if is_output_rank():
            host, ready = rows_on_host(logits_output, ("hidden_states",))
            # A prefix-cache hit or a chunk computes fewer rows than the prompt has: pass
            # what was computed so that the descriptor says so instead of reading past it.
            rows = host["hidden_states"][hidden_state_offset : hidden_state_offset + req.extend_input_len]
            # More than one layer's columns: [aux..., last] (bf16, or quantized_rows' uint8).
            packed = {"hidden": rows} if rows.shape[-1] > hidden else {"aux_hidden": None}
            _spool_descriptor(req, spool_dir, packed, writer, ready)
        return end

    _append_prefill_hidden_states.eaglenest_patch_version = PATCH_VERSION
    return _append_prefill_hidden_states


def make_hidden_states_to_store_0514(original: Callable, settings: dict | None = None):
    """sglang 0.5.14's LogitsProcessor._get_hidden_states_to_store, keeping the final state too.

    Under full capture with aux layers 0.5.14 stores only the packed aux states; this
    appends the final post-norm hidden state as the last H columns. A run that stores fp8
    (``storage_dtype``) gets them quantised here, on the GPU, before SGLang copies the batch's
    results to the host (``quantized_rows``)."""
    settings = settings or {}
    quantize = settings.get("storage_dtype") == FP8_STORAGE

    def _get_hidden_states_to_store(
        self, hidden_states, hidden_states_before_norm, aux_hidden_states, pruned_states,
        pruned_states_before_norm, aux_pruned_states, sample_indices, logits_metadata,
    ):
        stored = original(
            self, hidden_states, hidden_states_before_norm, aux_hidden_states, pruned_states,
            pruned_states_before_norm, aux_pruned_states, sample_indices, logits_metadata,
        )
        mode = logits_metadata.capture_hidden_mode
        if mode.need_capture() and mode.is_full() and aux_hidden_states is not None and hidden_states_before_norm is None:
            import torch

            rows = torch.cat([stored, hidden_states], dim=-1)
            return quantized_rows(rows, settings["hidden_size"]) if quantize else rows
        return stored

    return _get_hidden_states_to_store


def make_init_capture_0514(original: Callable, settings: dict):
    """sglang 0.5.14's ModelRunner.init_aux_hidden_state_capture, capturing without a draft."""

    def init_aux_hidden_state_capture(self):
        original(self)
        if self.is_draft_worker:
            return
        self.model.set_eagle3_layers_to_capture(list(settings["sglang_layer_ids"]))
        check_captured_layers(self.model, settings["layer_ids"])
        log.info("eaglenest capture: %s captures HF layers %s", type(self.model).__name__, settings["layer_ids"])

    return init_aux_hidden_state_capture


# ---------------------------------------------------------------- install into sglang


def _resolve(module_name: str, attr_path: str, sglang_version: str):
    import importlib

    owner = importlib.import_module(module_name)
    *parents, name = attr_path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    if not hasattr(owner, name):
        raise CaptureError(f"sglang {sglang_version} has no {module_name}.{attr_path}")
    return owner, name


def _replace(targets: dict, key: str, sglang_version: str, make: Callable) -> None:
    owner, name = _resolve(*targets[key], sglang_version)
    setattr(owner, name, make(getattr(owner, name)))


def apply(settings: dict, in_http_process: bool) -> None:
    """Install the patch into the sglang of this process."""
    from importlib.metadata import version

    installed = version("sglang")
    if installed not in PATCH_TARGETS:
        raise CaptureError(f"sglang {installed} is installed; the eaglenest patch is written for {', '.join(SUPPORTED_SGLANG_VERSIONS)}")
    targets = PATCH_TARGETS[installed]
    if in_http_process:
        owner, name = _resolve(*targets["http_app"], installed)
        info = server_info(settings, installed)
        getattr(owner, name).add_api_route(INFO_ROUTE, lambda: info, methods=["GET"])
        log.info("eaglenest capture: %s added (patch %s)", INFO_ROUTE, PATCH_VERSION)
        return
    if settings.get("mode", "capture") == "serve":  # a generating server: identity only, scheduler as shipped
        log.info("eaglenest capture: serve mode, scheduler of sglang %s left as it is", installed)
        return
    owner, name = _resolve(*targets["parallel"], installed)
    get_parallel = getattr(owner, name)

    def is_output_rank() -> bool:
        parallel = get_parallel()
        return parallel.pp_rank == 0 and parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0

    writer = spool.SpoolWriter(int(settings.get("writer_threads", 4)))
    if installed == "0.5.14":
        _replace(targets, "append_prefill", installed,
                 lambda f: make_append_prefill_hidden_states_0514(f, settings, is_output_rank, writer))
        _replace(targets, "hidden_states_to_store", installed, lambda f: make_hidden_states_to_store_0514(f, settings))
        _replace(targets, "init_capture", installed, lambda f: make_init_capture_0514(f, settings))
    else:
        _replace(targets, "append_prefill", installed,
                 lambda f: make_append_prefill_hidden_states(f, settings, is_output_rank, writer))
        _replace(targets, "request_level_key", installed, make_is_request_level_key)
        _replace(targets, "configure_capture", installed, lambda f: make_configure_capture(f, settings))
    log.info("eaglenest capture: scheduler of sglang %s patched, spooling to %s", installed, settings["spool_dir"])


def register() -> None:
    """SGLang general-plugin entry point; a no-op unless eaglenest.sglang.launch set the settings."""
    import multiprocessing

    settings = settings_from_env()
    if settings is None:
        return
    from eaglenest.sglang import gc_stats

    gc_stats.start_from_env()  # only where EAGLENEST_GC_STATS names a folder
    # The HTTP server lives in the launching process; schedulers are spawned children.
    apply(settings, in_http_process=multiprocessing.parent_process() is None)
