"""Start the patched SGLang server for a run's config and wait until it answers as ours.

    python -m eaglenest.sglang_launch --configfile config/kimi-k2.5.yaml

Runs ``python -m sglang.launch_server`` (sglang==0.5.23, envs/sglang.yaml) with:

* ``--tp-size`` = ``target.tensor_parallel``;
* ``--disable-radix-cache``: with prefix caching, a prompt sharing a prefix with an
  earlier one is not recomputed and its hidden states are missing;
* ``--chunked-prefill-size -1``: sglang 0.5.23 keeps hidden states of a prompt's last
  prefill chunk only, so a chunked prompt would lose rows;
* ``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
  --return-aux-hidden-state-layer-ids <ids>``: aux capture without a draft, ids
  translated from HF convention by eaglenest.layer_ids.

The patch (eaglenest.sglang_patch) is applied at every start, never installed into
sglang: the launcher writes a small entry-point record for sglang's plugin loader
into its state directory and puts it and this repository on ``PYTHONPATH`` of the
server only, with the capture settings in ``EAGLENEST_CAPTURE``. A reinstalled sglang
or a rebooted node cannot leave an unpatched server behind a healthy port: the client
and this launcher check ``GET /eaglenest/info``, which only the patch serves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

from eaglenest import layer_ids as layer_id_convention
from eaglenest import sglang_client, sglang_patch

REPO_ROOT = Path(__file__).resolve().parents[1]


def sglang_settings(config: dict) -> dict:
    """extract.sglang with the schema's defaults (the launcher runs outside Snakemake)."""
    defaults = {
        "url": "http://127.0.0.1:30000",
        "spool_dir": sglang_patch.DEFAULT_SPOOL_DIR,
        "architecture": None,
        "startup_timeout_s": 3600,
        "extra_args": [],
    }
    return {**defaults, **config.get("extract", {}).get("sglang", {})}


def model_architecture(model_path: str | os.PathLike) -> str:
    config_file = Path(model_path) / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} not found: set extract.sglang.architecture in the config")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    if not architectures:
        raise ValueError(f"{config_file} names no architecture: set extract.sglang.architecture")
    return architectures[0]


def capture_settings(config: dict) -> dict:
    """What the patch needs to know, in HF convention plus the ids SGLang is given."""
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
    }


def launch_command(config: dict, capture: dict, python: str = sys.executable) -> list[str]:
    settings = sglang_settings(config)
    address = urllib.parse.urlsplit(settings["url"])
    return [
        python, "-m", "sglang.launch_server",
        "--model-path", str(config["target"]["path"]),
        "--served-model-name", config["target"]["name"],
        "--host", address.hostname or "127.0.0.1",
        "--port", str(address.port or 30000),
        "--tp-size", str(capture["tensor_parallel"]),
        "--disable-radix-cache",
        "--chunked-prefill-size", "-1",
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm", "EAGLE3",
        "--return-aux-hidden-state-layer-ids", *map(str, capture["sglang_layer_ids"]),
        *map(str, settings["extra_args"]),
    ]


def write_plugin_record(state_dir: str | os.PathLike) -> Path:
    """An entry-point record that sglang's plugin loader (importlib.metadata) finds on PYTHONPATH."""
    plugin_dir = Path(state_dir) / "plugin"
    dist_info = plugin_dir / f"eaglenest_sglang_capture-{sglang_patch.PATCH_VERSION}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: eaglenest-sglang-capture\nVersion: {sglang_patch.PATCH_VERSION}\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[{sglang_patch.PLUGIN_GROUP}]\n{sglang_patch.PLUGIN_NAME} = eaglenest.sglang_patch:register\n"
    )
    return plugin_dir


def server_environment(capture: dict, plugin_dir: Path, base=os.environ) -> dict:
    env = dict(base)
    paths = [str(plugin_dir), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[sglang_patch.SETTINGS_ENV] = json.dumps(capture)
    return env


def wait_until_ready(url: str, process: subprocess.Popen, capture: dict, timeout_s: float, log_path: Path) -> dict:
    """Poll /eaglenest/info until the server answers as ours; fail early when it exits."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
            raise sglang_client.SglangServerError(
                f"the SGLang server exited with code {process.returncode} before it was ready; "
                f"last lines of {log_path}:\n{tail}"
            )
        try:
            return sglang_client.check_server(url, capture["target"], capture["layer_ids"], capture["hidden_size"])
        except sglang_client.SglangServerError as err:
            last_error = str(err)
        time.sleep(5)
    raise sglang_client.SglangServerError(
        f"the SGLang server at {url} was not ready after {timeout_s:.0f} s (last check: {last_error}); "
        f"see {log_path}"
    )


def serve(config: dict, state_dir: Path, python: str = sys.executable, command: list[str] | None = None) -> int:
    """Start the server, wait for it, then stay in the foreground until it exits or we are stopped."""
    settings = sglang_settings(config)
    capture = capture_settings(config)
    state_dir.mkdir(parents=True, exist_ok=True)
    Path(capture["spool_dir"]).mkdir(parents=True, exist_ok=True)
    command = command or launch_command(config, capture, python)
    env = server_environment(capture, write_plugin_record(state_dir))
    log_path = state_dir / "server.log"
    print(f"starting: {' '.join(command)}\nlog: {log_path}", file=sys.stderr, flush=True)
    with open(log_path, "ab") as server_log:
        process = subprocess.Popen(command, env=env, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(signum, frame):
        os.killpg(process.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        info = wait_until_ready(settings["url"], process, capture, settings["startup_timeout_s"], log_path)
    except BaseException:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=120)
        raise
    (state_dir / "server.json").write_text(json.dumps({"pid": process.pid, "url": settings["url"], "info": info}, indent=2))
    print(f"ready: {settings['url']} {json.dumps(info)}", file=sys.stderr, flush=True)
    return process.wait()


def main(argv=None) -> int:
    import yaml

    parser = argparse.ArgumentParser(description="Start the patched SGLang server for an eaglenest run.")
    parser.add_argument("--configfile", required=True, help="the run's workflow config (config/*.yaml)")
    parser.add_argument("--state-dir", default=None, help="server log, plugin record, server.json (default logs/<run>/sglang)")
    parser.add_argument("--print-command", action="store_true", help="print the server command and settings, start nothing")
    options = parser.parse_args(argv)
    config = yaml.safe_load(Path(options.configfile).read_text())
    state_dir = Path(options.state_dir or Path("logs") / config["run"] / "sglang")
    if options.print_command:
        capture = capture_settings(config)
        print(" ".join(launch_command(config, capture)))
        print(f"{sglang_patch.SETTINGS_ENV}={json.dumps(capture)}")
        return 0
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("sglang")
    except PackageNotFoundError:
        installed = None
    if installed != sglang_patch.SGLANG_VERSION:
        raise SystemExit(
            f"sglang {installed or 'is not installed'} in {sys.executable}; the patch needs "
            f"sglang=={sglang_patch.SGLANG_VERSION}: create the env from envs/sglang.yaml and run this there"
        )
    return serve(config, state_dir)


if __name__ == "__main__":
    sys.exit(main())
