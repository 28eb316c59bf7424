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

It is loaded as an SGLang general plugin (entry-point group ``sglang.srt.plugins``,
which sglang 0.5.23 loads at the start of the HTTP process and of every scheduler
process). eaglenest.sglang_launch registers that entry point for the server it starts
and passes the settings in ``EAGLENEST_CAPTURE`` (JSON); without that variable the
plugin does nothing, so other SGLang servers on the node are unaffected.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Callable

SGLANG_VERSION = "0.5.23"
PATCH_VERSION = 1
SERVER_KIND = "eaglenest-sglang-capture"
SETTINGS_ENV = "EAGLENEST_CAPTURE"
SPOOL_KEY = "eaglenest_spool"
INFO_ROUTE = "/eaglenest/info"
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "eaglenest_capture"
DEFAULT_SPOOL_DIR = "/dev/shm/eaglenest_hs"

# Everything in sglang the patch touches: (module, attribute path). The tests check each
# against the pinned source; apply() fails loudly if one is missing at run time.
PATCH_TARGETS = {
    "append_prefill": (
        "sglang.srt.managers.scheduler_components.batch_result_processor",
        "SchedulerBatchResultProcessor._append_prefill_hidden_states",
    ),
    "request_level_key": (
        "sglang.srt.managers.scheduler_components.output_streamer",
        "SchedulerOutputStreamer.is_request_level_customized_info_key",
    ),
    "configure_capture": (
        "sglang.srt.model_executor.model_runner",
        "configure_aux_hidden_state_capture",
    ),
    "http_app": ("sglang.srt.entrypoints.http_server", "app"),
    "parallel": ("sglang.srt.runtime_context", "get_parallel"),
}

log = logging.getLogger(__name__)
_RID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class CaptureError(RuntimeError):
    """The server is not capturing what eaglenest asked for."""


# ---------------------------------------------------------------- spool (pure, CPU-testable)


def spool_path(spool_dir: str | os.PathLike, rid: str) -> Path:
    """The spool file of request ``rid``; request ids are file names, so they are checked."""
    if not isinstance(rid, str) or not _RID.match(rid):
        raise ValueError(f"request id {rid!r} is not usable as a spool file name ([A-Za-z0-9._-], 1-200 chars)")
    return Path(spool_dir) / f"{rid}.safetensors"


def _shape_and_dtype(tensor) -> dict:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def spool_prefill_rows(spool_dir, rid: str, prompt_ids, aux_rows, last_rows) -> dict:
    """Write one request's hidden states to the spool; return the descriptor for the response.

    ``aux_rows`` [n, A*H] are the packed aux-layer inputs, ``last_rows`` [n, H] the final
    post-norm states, one row per prompt token. When a row count does not match the
    prompt (a prefix-cache hit or a chunked prefill skipped rows) nothing is written and
    the descriptor carries the reason, so the client fails with it.
    """
    import torch
    from safetensors.torch import save_file

    descriptor = {"rid": rid, "patch_version": PATCH_VERSION}
    prompt_len = len(prompt_ids)
    if aux_rows is None or last_rows is None:
        missing = "aux hidden states" if aux_rows is None else "last hidden states"
        descriptor["error"] = (
            f"the server produced no {missing}; start it with eaglenest.sglang_launch "
            "(--enable-return-aux-hidden-states --speculative-algorithm EAGLE3)"
        )
        return descriptor
    if aux_rows.shape[0] != prompt_len or last_rows.shape[0] != prompt_len:
        descriptor["error"] = (
            f"got {aux_rows.shape[0]} aux / {last_rows.shape[0]} last rows for a prompt of "
            f"{prompt_len} tokens; the radix cache or chunked prefill is on "
            "(start the server with --disable-radix-cache --chunked-prefill-size -1)"
        )
        return descriptor
    path = spool_path(spool_dir, rid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        "input_ids": torch.as_tensor(list(prompt_ids), dtype=torch.int64),
        "aux_hidden": aux_rows.detach().to("cpu").contiguous(),
        "last_hidden": last_rows.detach().to("cpu").contiguous(),
    }
    # Temp name + rename: a client that finds the file finds all of it.
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    descriptor.update(
        path=str(path),
        num_tokens=prompt_len,
        aux_hidden=_shape_and_dtype(tensors["aux_hidden"]),
        last_hidden=_shape_and_dtype(tensors["last_hidden"]),
    )
    return descriptor


def read_spooled(path: str | os.PathLike) -> dict:
    """The tensors of one spool file: input_ids, aux_hidden, last_hidden."""
    from safetensors.torch import load_file

    return load_file(str(path))


# ---------------------------------------------------------------- settings and identity


def settings_from_env(environ=os.environ) -> dict | None:
    raw = environ.get(SETTINGS_ENV)
    if not raw:
        return None
    settings = json.loads(raw)
    for key in ("spool_dir", "target", "layer_ids", "sglang_layer_ids", "architecture", "hidden_size"):
        if key not in settings:
            raise CaptureError(f"{SETTINGS_ENV} lacks {key!r}; start the server with eaglenest.sglang_launch")
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
        "spool_dir": settings["spool_dir"],
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
            f"{list(hf_layer_ids)}: the layer-id translation in eaglenest/layer_ids.py does not match "
            "this sglang version"
        )


# ---------------------------------------------------------------- the replaced methods


def make_append_prefill_hidden_states(original: Callable, settings: dict, is_output_rank: Callable[[], bool]):
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
            last = logits_output.last_hidden_states
            descriptor = spool_prefill_rows(
                spool_dir, req.rid, req.origin_input_ids,
                logits_output.hidden_states[start:end] if logits_output.hidden_states is not None else None,
                last[start:end] if last is not None else None,
            )
            if req.customized_info is None:
                req.customized_info = {}
            req.customized_info[SPOOL_KEY] = [descriptor]
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


# ---------------------------------------------------------------- install into sglang


def _resolve(module_name: str, attr_path: str):
    import importlib

    owner = importlib.import_module(module_name)
    *parents, name = attr_path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    if not hasattr(owner, name):
        raise CaptureError(f"sglang has no {module_name}.{attr_path}; the patch is written for sglang {SGLANG_VERSION}")
    return owner, name


def apply(settings: dict, in_http_process: bool) -> None:
    """Install the patch into the sglang of this process."""
    from importlib.metadata import version

    installed = version("sglang")
    if installed != SGLANG_VERSION:
        raise CaptureError(f"sglang {installed} is installed; the eaglenest patch is written for {SGLANG_VERSION}")
    if in_http_process:
        owner, name = _resolve(*PATCH_TARGETS["http_app"])
        info = server_info(settings, installed)
        getattr(owner, name).add_api_route(INFO_ROUTE, lambda: info, methods=["GET"])
        log.info("eaglenest capture: %s added (patch %s)", INFO_ROUTE, PATCH_VERSION)
        return
    owner, name = _resolve(*PATCH_TARGETS["parallel"])
    get_parallel = getattr(owner, name)

    def is_output_rank() -> bool:
        parallel = get_parallel()
        return parallel.pp_rank == 0 and parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0

    owner, name = _resolve(*PATCH_TARGETS["append_prefill"])
    setattr(owner, name, make_append_prefill_hidden_states(getattr(owner, name), settings, is_output_rank))
    owner, name = _resolve(*PATCH_TARGETS["request_level_key"])
    setattr(owner, name, make_is_request_level_key(getattr(owner, name)))
    owner, name = _resolve(*PATCH_TARGETS["configure_capture"])
    setattr(owner, name, make_configure_capture(getattr(owner, name), settings))
    log.info("eaglenest capture: scheduler patched, spooling to %s", settings["spool_dir"])


def register() -> None:
    """SGLang general-plugin entry point; a no-op unless eaglenest.sglang_launch set the settings."""
    import multiprocessing

    settings = settings_from_env()
    if settings is None:
        return
    # The HTTP server lives in the launching process; schedulers are spawned children.
    apply(settings, in_http_process=multiprocessing.parent_process() is None)
