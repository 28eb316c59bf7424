"""Start the patched SGLang server for a run's config and wait until it answers as ours.

    python -m eaglenest.sglang.launch --configfile config/kimi-k2.5.yaml

Runs ``python -m sglang.launch_server`` (sglang==0.5.23, envs/sglang.yaml; 0.5.14 also
works, with ``--enable-return-hidden-states`` in place of the three EAGLE3 capture flags) with:

* ``--tp-size`` = ``target.tensor_parallel``;
* ``--disable-radix-cache``: with prefix caching, a prompt sharing a prefix with an
  earlier one is not recomputed and its hidden states are missing;
* ``--chunked-prefill-size -1``: sglang 0.5.23 keeps hidden states of a prompt's last
  prefill chunk only, so a chunked prompt would lose rows;
* ``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
  --return-aux-hidden-state-layer-ids <ids>``: aux capture without a draft, ids
  translated from HF convention by eaglenest.target_model.layer_ids;
* ``--dtype bfloat16`` unless ``extract.sglang.extra_args`` names a dtype: SGLang's
  ``auto`` serves a config that says float32 in float16
  (``sglang/srt/configs/model_config.py:1573-1589`` in 0.5.14), which is neither what the
  transformers backend computes in nor what a drafter trained on it is served with
  (docs/sglang.md, "On the H200").

The patch (eaglenest.sglang.patch) is applied at every start, never installed into
sglang: the launcher writes a small entry-point record for sglang's plugin loader
into its state directory and puts it and this repository on ``PYTHONPATH`` of the
server only, with the capture settings in ``EAGLENEST_CAPTURE``. A reinstalled sglang
or a rebooted node cannot leave an unpatched server behind a healthy port: the client
and this launcher check ``GET /eaglenest/info``, which only the patch serves.

``--mode serve`` starts a server that generates and captures nothing (rules regenerate_server
and evaluate_server); with ``--drafting-json`` and ``--draft-model`` it speculates with the
drafter's SGLang export (``--speculative-algorithm EAGLE3`` and the setting's
``--speculative-num-steps/--speculative-eagle-topk/--speculative-num-draft-tokens``).
``EAGLENEST_SGLANG_COMMAND`` replaces ``python -m sglang.launch_server`` in front of the same
flags (a container wrapper; on a machine without a GPU, a server that reads SGLang's flags).

As a Snakemake service (rule sglang_server, ``--service-file``): the server gets a free
port and GPU slots for its tensor-parallel ranks (none for an ``EAGLENEST_SGLANG_COMMAND``
server on a node without GPUs); the launcher publishes its state in the service file (``starting`` with its pid, ``ready``
with the URL, ``failed`` with the reason), which the block's shard jobs wait on, because
Snakemake starts a service and its consumers at the same moment. SIGTERM or SIGINT (how
Snakemake ends a service) stops the server's whole process group and exits 0; a
launcher killed outright takes the server with it (parent-death signal).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import random
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from eaglenest.target_model import layer_ids as layer_id_convention
from eaglenest.formats import atomic
from eaglenest.node import gpu_slots
from eaglenest.sglang import client as sglang_client, patch as sglang_patch
from eaglenest import settings as settings_lib

# The directory that holds the eaglenest package (a checkout or site-packages): the server's
# PYTHONPATH, so that the capture plugin imports it.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]

# A command (split like a shell line) that takes the place of ``python -m sglang.launch_server``
# in front of the same flags: a container wrapper on a node, or a server that reads SGLang's
# flags on a machine without a GPU.
SERVER_COMMAND_ENV = "EAGLENEST_SGLANG_COMMAND"


def sglang_settings(config: dict) -> dict:
    """extract.sglang with the schema's defaults (the launcher also runs outside Snakemake);
    an unknown key raises."""
    return settings_lib.section(config.get("extract", {}).get("sglang", {}), "extract", "sglang")


def model_architecture(model_path: str | os.PathLike) -> str:
    config_file = Path(model_path) / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} not found: set extract.sglang.architecture in the config")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    if not architectures:
        raise ValueError(f"{config_file} names no architecture: set extract.sglang.architecture")
    return architectures[0]


MODES = ("capture", "serve")


def capture_settings(config: dict, mode: str = "capture") -> dict:
    """What the patch needs to know, in HF convention plus the ids SGLang is given.

    ``mode`` serve: the same server identity (``/eaglenest/info``, the launch token) for a
    server that generates (the regenerate stage's chat completions) and captures nothing."""
    if mode not in MODES:
        raise ValueError(f"launcher mode {mode!r}: use one of {MODES}")
    from eaglenest import plan

    settings = sglang_settings(config)
    target = config["target"]
    architecture = settings["architecture"] or model_architecture(target["path"])
    hf_ids = plan.layer_ids(config)
    return {
        "spool_dir": settings["spool_dir"],
        "target": target["name"],
        "model_path": str(target["path"]),
        "architecture": architecture,
        "hidden_size": target["hidden_size"],
        "layer_ids": hf_ids,
        "sglang_layer_ids": layer_id_convention.hf_to_sglang(hf_ids, architecture),
        "tensor_parallel": target.get("tensor_parallel", 1),
        "writer_threads": settings["writer_threads"],
        # fp8 runs get their rows quantised in the server, before the copy to the host
        "storage_dtype": config["extract"].get("dtype", "bfloat16"),  # the schema's default
        "mode": mode,
    }


def speculative_flags(speculative: dict) -> list[str]:
    """SGLang's EAGLE-3 flags for one drafting setting (evaluate.drafting: steps, topk, tokens)
    with ``draft_model``, an SGLang export of the drafter (eaglenest.stages.export)."""
    return [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(speculative["draft_model"]),
        "--speculative-num-steps", str(speculative["steps"]),
        "--speculative-eagle-topk", str(speculative["topk"]),
        "--speculative-num-draft-tokens", str(speculative["tokens"]),
        *map(str, speculative.get("extra_args", [])),
    ]


def server_program(python: str = sys.executable, environ=os.environ) -> list[str]:
    """What runs the server: SGLang's launcher, or the command in EAGLENEST_SGLANG_COMMAND."""
    if environ.get(SERVER_COMMAND_ENV):
        return shlex.split(environ[SERVER_COMMAND_ENV])
    return [python, "-m", "sglang.launch_server"]


def launch_command(
    config: dict, capture: dict, python: str = sys.executable, url: str | None = None,
    sglang_version: str = sglang_patch.SGLANG_VERSION, speculative: dict | None = None,
) -> list[str]:
    """The server's command line. ``speculative`` (serve mode only): the EAGLE-3 drafter and
    drafting setting the server speculates with (evaluate.backend sglang)."""
    settings = sglang_settings(config)
    address = urllib.parse.urlsplit(url or settings["url"])
    if speculative is not None and capture.get("mode") != "serve":
        raise ValueError("a speculative server generates: launch it in serve mode")
    server = [
        *server_program(python),
        "--model-path", str(config["target"]["path"]),
        "--served-model-name", config["target"]["name"],
        "--host", address.hostname or "127.0.0.1",
        "--port", str(address.port or 30000),
        "--tp-size", str(capture["tensor_parallel"]),
    ]
    flags = list(map(str, settings["extra_args"]))
    dtype = [] if "--dtype" in flags else ["--dtype", "bfloat16"]
    # eaglenest sends no constrained requests; SGLang builds its grammar backend (xgrammar by
    # default, srt/server_args.py:4842-4844) at start and imports it there
    # (srt/constrained/base_grammar_backend.py:246-247), so an install without it fails to start.
    grammar = [] if "--grammar-backend" in flags else ["--grammar-backend", "none"]
    if capture.get("mode") == "serve":
        # Generation as SGLang serves it by default: the radix cache reuses a conversation's
        # earlier turns, chunked prefill and CUDA graphs as they come.
        spec = speculative_flags(speculative) if speculative is not None else []
        return [*server, *dtype, *grammar, *flags, *spec]
    if sglang_version == "0.5.14":
        # No draft-less aux capture there: the patch sets the capture layers itself
        # (EAGLENEST_CAPTURE), and return_hidden_states needs the server-wide switch.
        capture_flags = ["--enable-return-hidden-states"]
    else:
        capture_flags = [
            "--enable-return-aux-hidden-states",
            "--speculative-algorithm", "EAGLE3",
            "--return-aux-hidden-state-layer-ids", *map(str, capture["sglang_layer_ids"]),
        ]
    return [
        *server,
        "--disable-radix-cache",
        # Chunked prefill off (a prompt's rows come from one forward); prefill batches of
        # prefill_tokens run as CUDA graphs, which SGLang sizes from the chunk size otherwise.
        "--chunked-prefill-size", "-1",
        "--max-prefill-tokens", str(settings["prefill_tokens"]),
        "--cuda-graph-max-bs-prefill", str(settings["prefill_tokens"]),
        *capture_flags,
        *dtype,
        *grammar,
        *flags,
    ]


# Where a service's port is picked: below the kernel's ephemeral range, from which every
# outgoing connection (the shard jobs' requests among them) takes its local port. The pick
# and the server's bind are apart by the server's start-up (the stand-in binds after loading
# its target); a port from that range could
# meanwhile become the local end of some connection.
SERVICE_PORTS_FROM = 10000
# How often a service starts its server again on another port when the picked one was taken.
PORT_ATTEMPTS = 3


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        low, high = map(int, Path(path).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def url_with_free_port(url: str) -> str:
    """``url`` on a port nobody holds now, outside the ephemeral range where there is room:
    servers of two blocks may share a node, and so may other runs' servers and clients."""
    address = urllib.parse.urlsplit(url)
    host = address.hostname or "127.0.0.1"
    low, _ = ephemeral_port_range()
    candidates = list(range(SERVICE_PORTS_FROM, low))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:200]:
        if port_is_free(host, port):
            break
    else:  # no room below the range (or all of it held): any port the kernel has free
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    return f"{address.scheme or 'http'}://{host}:{port}"


def url_port(url: str) -> tuple[str, int]:
    address = urllib.parse.urlsplit(url)
    return address.hostname or "127.0.0.1", address.port or 30000


def write_plugin_record(state_dir: str | os.PathLike) -> Path:
    """An entry-point record that sglang's plugin loader (importlib.metadata) finds on PYTHONPATH."""
    plugin_dir = Path(state_dir) / "plugin"
    dist_info = plugin_dir / f"eaglenest_sglang_capture-{sglang_patch.PATCH_VERSION}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: eaglenest-sglang-capture\nVersion: {sglang_patch.PATCH_VERSION}\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[{sglang_patch.PLUGIN_GROUP}]\n{sglang_patch.PLUGIN_NAME} = eaglenest.sglang.patch:register\n"
    )
    return plugin_dir


def server_environment(capture: dict, plugin_dir: Path, base=os.environ, extra: dict | None = None) -> dict:
    """The server's environment: ``base``, then extract.sglang.env (``extra``), then what the
    plugin needs (its path and settings), which the config cannot override."""
    env = {**base, **(extra or {})}
    paths = [str(plugin_dir), str(PACKAGE_PARENT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[sglang_patch.SETTINGS_ENV] = json.dumps(capture)
    return env


class ServerExitedError(sglang_client.SglangServerError):
    """The server process ended before it answered as ours."""


def wait_until_ready(url: str, process: subprocess.Popen, capture: dict, timeout_s: float, log_path: Path, poll_s: float = 0.2) -> dict:
    """Poll /eaglenest/info until the server answers as ours (with this start's launch token,
    when the capture settings carry one); fail early when it exits. A poll is one local
    request, so a ready server is seen within ``poll_s`` at next to no cost."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
            raise ServerExitedError(
                f"the SGLang server exited with code {process.returncode} before it was ready; "
                f"last lines of {log_path}:\n{tail}"
            )
        try:
            return sglang_client.check_server(
                url, capture["target"], capture["layer_ids"], capture["hidden_size"],
                launch_token=capture.get("launch_token"), mode=capture.get("mode", "capture"),
            )
        except sglang_client.SglangServerError as err:
            last_error = str(err)
        time.sleep(poll_s)
    raise sglang_client.SglangServerError(
        f"the SGLang server at {url} was not ready after {timeout_s:.0f} s (last check: {last_error}); "
        f"see {log_path}"
    )


def freeze_gc(url: str, timeout_s: float = 60.0) -> bool:
    """Ask a ready server to freeze its garbage collector: SGLang's ``/freeze_gc``
    (srt/entrypoints/http_server.py:1071-1081 in 0.5.14) freezes the HTTP process's, then has
    the scheduler freeze its own and the detokenizer's (srt/managers/tokenizer_manager.py:1779-1782,
    scheduler.py:4035-4039). Without it a full collection while serving scans everything the
    process loaded at start-up too; on one H100 the HTTP process of a regeneration server spent
    a quarter of its time collecting, about 1 s a full collection (docs/regeneration.md). A
    server without the route answers an error: it is served as it is, and False says so."""
    request = urllib.request.Request(url.rstrip("/") + "/freeze_gc", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
        return True
    except OSError as err:  # HTTPError and URLError are OSErrors; so is a timeout
        print(f"the server at {url} did not freeze its garbage collector ({err}); it serves as it is",
              file=sys.stderr, flush=True)
        return False


# A service file stays empty until the launcher has started: a launcher that has not
# written it after this long never started (broken environment, see the rule's log).
LAUNCHER_START_TIMEOUT_S = 300
# How long a stopped server may take to exit before its process group is killed.
STOP_GRACE_S = 60


def write_service_record(path: str | os.PathLike, state: str, **fields) -> None:
    """The launcher's state for the block's shard jobs, replaced atomically."""
    record = {"state": state, "host": socket.gethostname(), "launcher_pid": os.getpid(), **fields}
    atomic.write_json(path, record)


def read_service_record(path: str | os.PathLike) -> dict | None:
    """The record, or None while the file is missing, empty or half written by the rule's shell
    (it is replaced atomically only once the launcher runs)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return None


def _launcher_died(record: dict) -> bool:
    if record["host"] != socket.gethostname():
        return False  # only a process on this node can be checked
    try:
        os.kill(record["launcher_pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # exited but not reaped yet
        return "\nState:\tZ" in Path(f"/proc/{record['launcher_pid']}/status").read_text()
    except FileNotFoundError:
        return True


def served(settings, inputs, config: dict, what: str):
    """A client stage's ``settings`` (with a ``url``) pointed at the server Snakemake started beside
    the job (its input ``server``) once that server is loaded; as they are when the job has none."""
    if "server" not in inputs.keys():
        return settings
    record = wait_for_service(inputs.server, config["extract"]["sglang"]["startup_timeout_s"])
    logging.info("%s server ready at %s (pid %s)", what, record["url"], record["server_pid"])
    return dataclasses.replace(settings, url=record["url"])


def wait_for_service(path: str | os.PathLike, startup_timeout_s: float, poll_s: float = 0.2) -> dict:
    """The ready record of the block's server (its URL); SglangServerError when it failed,
    was stopped, its launcher died, or it was not ready in time. A shard job calls this
    first: Snakemake started it together with the server, which may still be loading.
    A poll reads one small file, so the job starts within ``poll_s`` of the server's ready."""
    started = time.monotonic()
    seen = None
    while True:
        record = read_service_record(path)
        waited = time.monotonic() - started
        if record is None:
            if seen is not None:  # a stopped launcher removes its service file
                raise sglang_client.SglangServerError(
                    f"the block's SGLang server was stopped before it was ready ({path} is gone); see {seen.get('log')}"
                )
            if waited > LAUNCHER_START_TIMEOUT_S:
                raise sglang_client.SglangServerError(
                    f"the SGLang server launcher never wrote {path} in {LAUNCHER_START_TIMEOUT_S} s: it did not "
                    "start; see the log of rule sglang_server for this block"
                )
        elif record["state"] == "failed":
            raise sglang_client.SglangServerError(
                f"the block's SGLang server failed: {record['error']} (launcher log: {record.get('log')})"
            )
        elif _launcher_died(record):
            raise sglang_client.SglangServerError(
                f"the launcher of the block's SGLang server (pid {record['launcher_pid']}) is gone, its record says "
                f"{record['state']!r}; see {record.get('log') or 'the launcher log of its server rule'}"
            )
        elif record["state"] == "ready":
            return record
        seen = record or seen
        if waited > startup_timeout_s + LAUNCHER_START_TIMEOUT_S:
            raise sglang_client.SglangServerError(
                f"the block's SGLang server was not ready after {waited:.0f} s (record: {seen}); "
                "raise extract.sglang.startup_timeout_s if loading the target takes longer"
            )
        time.sleep(poll_s)


def _sigterm_when_parent_dies(parent_pid: int) -> None:
    """This process gets SIGTERM when ``parent_pid`` dies, even by SIGKILL (Linux).

    The server, in a session of its own, calls it before exec: Snakemake SIGKILLs every
    job of a failed group, and a killed run takes the launcher with it. The launcher calls
    it as a service: a Snakemake killed alone would leave it serving nobody."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _stop_process_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def serve(
    config: dict,
    state_dir: Path,
    python: str = sys.executable,
    command_for=None,
    url: str | None = None,
    service_file: str | os.PathLike | None = None,
    gpus: int = 0,
    repick_port: bool = False,
    mode: str = "capture",
) -> int:
    """Start the server, wait for it, then stay in the foreground until it exits or we are stopped.

    ``command_for(url)`` replaces the SGLang command (the stand-in server); ``url`` replaces
    extract.sglang.url; ``service_file`` publishes the state for the block's shard jobs;
    ``gpus`` > 0 holds that many GPU slots of the node for the server's lifetime;
    ``repick_port``: the port was picked here, and a server that dies because another
    process took it meanwhile is started again on another (PORT_ATTEMPTS in all)."""
    settings = sglang_settings(config)
    # A token per start, answered by /eaglenest/info: a server that another launcher
    # started on the same port is never taken for this one.
    capture = {**capture_settings(config, mode), "launch_token": secrets.token_hex(8)}
    url = url or settings["url"]
    state_dir.mkdir(parents=True, exist_ok=True)
    Path(capture["spool_dir"]).mkdir(parents=True, exist_ok=True)
    command_for = command_for or (lambda server_url: launch_command(config, capture, python, server_url))
    env = server_environment(capture, write_plugin_record(state_dir), extra=settings["env"])
    log_path = state_dir / "server.log"
    stopping = False

    def publish(state: str, **fields) -> None:
        if service_file is not None:
            write_service_record(service_file, state, url=url, log=str(log_path), **fields)

    def stop(signum, frame):
        nonlocal stopping
        stopping = True
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)

    def stopped(message: str) -> int:
        # A service file outlives only a launcher killed outright: Snakemake would find it
        # marked incomplete at the next start and run the block again.
        if service_file is not None:
            Path(service_file).unlink(missing_ok=True)
        print(message, file=sys.stderr, flush=True)
        return 0

    process = None
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if service_file is not None:
        _sigterm_when_parent_dies(os.getppid())
    publish("starting")
    # The kernel drops the slots' flocks when the launcher dies, however it dies.
    slots = gpu_slots.acquire(gpus) if gpus > 0 else None
    if stopping:
        return stopped("stopped while waiting for GPU slots")
    if slots is not None:
        env["CUDA_VISIBLE_DEVICES"] = slots.cuda_visible_devices
    # Where the server runs, for whoever reads this log after a node or GPU failure.
    print(
        f"host {socket.gethostname()} CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')} "
        f"SLURM_JOB_ID={env.get('SLURM_JOB_ID')}",
        file=sys.stderr, flush=True,
    )
    launcher_pid = os.getpid()
    for attempt in range(1, PORT_ATTEMPTS + 1):
        command = command_for(url)
        print(f"starting: {' '.join(command)}\nlog: {log_path}", file=sys.stderr, flush=True)
        with open(log_path, "ab") as server_log:
            process = subprocess.Popen(
                command, env=env, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: _sigterm_when_parent_dies(launcher_pid),
            )
        if stopping:  # the signal came before there was a server to stop
            _stop_process_group(process)
            return stopped("stopped while the server was starting")
        try:
            info = wait_until_ready(url, process, capture, settings["startup_timeout_s"], log_path)
            break
        except BaseException as err:
            _stop_process_group(process)
            if stopping:
                return stopped("stopped before the server was ready")
            port_taken = isinstance(err, ServerExitedError) and not port_is_free(*url_port(url))
            if not (repick_port and port_taken and attempt < PORT_ATTEMPTS):
                publish("failed", error=str(err).splitlines()[0])
                raise
            taken_url, url = url, url_with_free_port(url)
            print(f"another process took {taken_url} before the server bound it; starting again on {url}", file=sys.stderr, flush=True)
    gc_frozen = freeze_gc(url) if settings["freeze_gc"] else False
    (state_dir / "server.json").write_text(json.dumps({"pid": process.pid, "url": url, "info": info, "gc_frozen": gc_frozen},
                                                      indent=2))
    publish("ready", server_pid=process.pid, info=info, gc_frozen=gc_frozen)
    print(f"ready: {url} {json.dumps(info)}", file=sys.stderr, flush=True)
    while process.poll() is None:  # not wait(): a signal handler must be able to run
        time.sleep(0.5)
    if stopping:
        _stop_process_group(process)  # what is left of the group after its leader exited
        return stopped(f"stopped: the server exited with code {process.returncode}")
    publish("failed", error=f"the server exited with code {process.returncode} while serving; see {log_path}")
    return process.returncode or 1


def main(argv=None) -> int:
    import yaml

    parser = argparse.ArgumentParser(description="Start the patched SGLang server for an eaglenest run.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--configfile", help="the run's workflow config (config/*.yaml)")
    source.add_argument("--config-json", help="the run's config as JSON (rule sglang_server passes its own)")
    parser.add_argument("--state-dir", default=None, help="server log, plugin record, server.json (default logs/<run>/sglang)")
    parser.add_argument("--service-file", default=None, help="run as the workflow's service: publish state here, pick a free port")
    parser.add_argument("--print-command", action="store_true", help="print the server command and settings, start nothing")
    parser.add_argument("--url", default=None,
                        help="listen here instead of extract.sglang.url, e.g. one evaluation server per setting "
                             "started by hand (evaluate.sglang.urls)")
    parser.add_argument("--mode", choices=MODES, default="capture",
                        help="capture: hidden states for extraction (default); serve: generation for the regenerate "
                             "and evaluate stages")
    parser.add_argument("--drafting-json", default=None,
                        help='serve mode: speculate with this drafting setting, e.g. {"steps": 3, "topk": 1, "tokens": 4}')
    parser.add_argument("--draft-model", default=None, help="with --drafting-json: the drafter's SGLang export")
    parser.add_argument("--draft-extra-args-json", default="[]", help="with --drafting-json: more flags, a JSON list")
    options = parser.parse_args(argv)
    if (options.drafting_json is None) != (options.draft_model is None):
        parser.error("--drafting-json and --draft-model go together")
    speculative = None
    if options.drafting_json is not None:
        speculative = {**json.loads(options.drafting_json), "draft_model": options.draft_model,
                       "extra_args": json.loads(options.draft_extra_args_json)}
    config = json.loads(options.config_json) if options.config_json else yaml.safe_load(Path(options.configfile).read_text())
    state_dir = Path(options.state_dir or Path("logs") / config["run"] / "sglang")
    try:
        settings = sglang_settings(config)
        capture = capture_settings(config, options.mode)
        url = options.url or settings["url"]
        url = url_with_free_port(url) if options.service_file else url
        # The flags depend on the sglang of this env; without one, the pinned version's.
        version = installed_sglang_version() or sglang_patch.SGLANG_VERSION
        command_for = lambda server_url: launch_command(  # noqa: E731
            config, capture, url=server_url, sglang_version=version, speculative=speculative)
        if options.print_command:
            print(" ".join(command_for(url)))
            print(f"{sglang_patch.SETTINGS_ENV}={json.dumps(capture)}")
            return 0
        if not os.environ.get(SERVER_COMMAND_ENV):
            check_sglang_version()
    except BaseException as err:  # the shard jobs waiting on the service file learn why at once
        if options.service_file:
            write_service_record(options.service_file, "failed", error=str(err) or type(err).__name__)
        raise
    # A service holds the GPUs it runs on; a server command of EAGLENEST_SGLANG_COMMAND on a
    # node without GPUs (the tests' stand-in) computes on the CPU.
    on_cpu = bool(os.environ.get(SERVER_COMMAND_ENV)) and not gpu_slots.node_devices()
    gpus = capture["tensor_parallel"] if options.service_file and not on_cpu else 0
    return serve(
        config, state_dir, command_for=command_for, url=url, service_file=options.service_file, gpus=gpus,
        repick_port=bool(options.service_file), mode=options.mode,
    )


def installed_sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_sglang_version() -> str:
    installed = installed_sglang_version()
    if installed not in sglang_patch.SUPPORTED_SGLANG_VERSIONS:
        raise SystemExit(
            f"sglang {installed or 'is not installed'} in {sys.executable}; the patch needs sglang "
            f"{' or '.join(sglang_patch.SUPPORTED_SGLANG_VERSIONS)} (production: {sglang_patch.SGLANG_VERSION}): "
            "create the env from envs/sglang.yaml and run this there"
        )
    return installed


if __name__ == "__main__":
    sys.exit(main())
