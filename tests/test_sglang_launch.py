"""The server launcher: plugin registration, readiness, and the workflow's sglang backend."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest
import torch
import yaml

from conftest import REPO, run_snakemake, synthetic_conversations, tiny_workflow_config
from support import STANDIN_COMMAND
from eaglenest.stages import extract
from eaglenest.formats import shards
from eaglenest.sglang import client as sglang_client, launch as sglang_launch, patch as sglang_patch
from test_sglang_protocol import standin, start_standin  # noqa: F401 (standin: a fixture)


@pytest.mark.integration
def test_plugin_record_is_found_by_the_entry_point_loader_sglang_uses(tmp_path):
    plugin_dir = sglang_launch.write_plugin_record(tmp_path)
    capture = {"spool_dir": str(tmp_path / "spool"), "target": "t", "layer_ids": [2], "sglang_layer_ids": [1],
               "architecture": "LlamaForCausalLM", "hidden_size": 8}
    env = sglang_launch.server_environment(capture, plugin_dir)
    # The same call as sglang 0.5.23's load_plugins_by_group, in a fresh interpreter.
    probe = (
        "from importlib.metadata import entry_points; import json, os;"
        f"eps = entry_points(group={sglang_patch.PLUGIN_GROUP!r});"
        "fn = [ep for ep in eps][0].load();"
        "from eaglenest.sglang import patch as sglang_patch;"
        "print(json.dumps([[ep.name for ep in eps], fn is sglang_patch.register, sglang_patch.settings_from_env()]))"
    )
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=tmp_path, check=True)
    names, is_register, settings = json.loads(result.stdout)
    assert names == [sglang_patch.PLUGIN_NAME] and is_register and settings == capture


def test_the_server_environment_carries_the_configs_env_under_the_plugins_own(tmp_path):
    capture = {"spool_dir": str(tmp_path / "spool"), "target": "t", "layer_ids": [2], "hidden_size": 8}
    extra = {"SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT": "1", sglang_patch.SETTINGS_ENV: "{}"}
    env = sglang_launch.server_environment(capture, tmp_path, base={"PATH": "/bin", "SGLANG_X": "base"}, extra=extra)
    assert env["SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT"] == "1" and env["PATH"] == "/bin" and env["SGLANG_X"] == "base"
    # what the plugin reads is the launcher's, whatever the config says
    assert json.loads(env[sglang_patch.SETTINGS_ENV]) == capture
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)


def test_plugin_does_nothing_in_servers_not_started_by_the_launcher(monkeypatch):
    monkeypatch.delenv(sglang_patch.SETTINGS_ENV, raising=False)
    assert sglang_patch.register() is None  # would raise here: sglang is not installed


def start_launcher(tmp_path, tiny_llama, sglang: dict, url: str, repick_port: bool = False):
    """The launcher (eaglenest.sglang.launch.serve) of a tiny backend-sglang config, in a process
    of its own, serving the stand-in at ``url`` and publishing to a block's service file:
    (process, workdir, service file). With ``repick_port`` it builds the SGLang command for each
    URL it tries, as the workflow's server rule does."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 4)
    configfile = tiny_workflow_config(workdir, tiny_llama, conversations, extract={"backend": "sglang", "sglang": sglang})
    service_file = workdir / "block.json"
    service_file.touch()
    command_for = ("lambda url: launch.launch_command(config, launch.capture_settings(config), url=url)"
                   if repick_port else "None")
    script = (
        "import sys, yaml; from pathlib import Path; from eaglenest.sglang import launch;"
        f"config = yaml.safe_load(Path({str(configfile)!r}).read_text());"
        f"sys.exit(launch.serve(config, Path({str(workdir / 'state')!r}), command_for={command_for}, url={url!r}, "
        f"service_file={str(service_file)!r}, repick_port={repick_port!r}))"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), sglang_launch.SERVER_COMMAND_ENV: STANDIN_COMMAND},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    return launcher, workdir, service_file


@pytest.mark.integration
def test_launcher_reports_a_server_that_exits_while_loading(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("RuntimeError: CUDA out of memory\n")
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    with pytest.raises(sglang_client.SglangServerError, match=r"exited with code 4 before it was ready(.|\n)*CUDA out of memory"):
        sglang_launch.wait_until_ready("http://127.0.0.1:9", process, {"target": "t", "layer_ids": [2], "hidden_size": 8}, 60, log)


@pytest.mark.integration
def test_launcher_waits_until_the_server_answers_as_ours(tmp_path, tiny_llama):
    process, url, spool = start_standin(tmp_path, tiny_llama)
    try:
        capture = {"target": "tiny-llama", "layer_ids": [2, 3, 4], "hidden_size": 64}
        info = sglang_launch.wait_until_ready(url, process, capture, 60, tmp_path / "server.log")
        assert info["server"] == sglang_patch.SERVER_KIND and info["spool_dir"] == str(spool)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.workflow
def test_extract_rule_with_sglang_backend_writes_the_transformers_shards(tmp_path, tiny_llama):
    """The real Snakefile, backend sglang, against the stand-in server over HTTP."""
    process, url, spool = start_standin(tmp_path, tiny_llama, layers=[2, 3, 4])
    try:
        conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 40)
        workdir = tmp_path / "work"
        workdir.mkdir()
        # A server started beside the workflow (start_server false), as by hand.
        sglang = {"url": url, "spool_dir": str(spool), "concurrency": 4, "backoff_s": 0.1, "start_server": False}
        configfile = tiny_workflow_config(workdir, tiny_llama, conversations, extract={"backend": "sglang", "sglang": sglang})
        # Up to the consolidated shards: what comes after them does not depend on the backend,
        # whose shards are compared bit for bit with the transformers backend's below.
        run_snakemake(workdir, configfile, "--cores", "2", "hidden_states")
    finally:
        process.terminate()
        process.wait(timeout=30)
    hidden = sorted((workdir / "results" / "tiny" / "hidden").glob("shard-*.safetensors"))
    assert len(hidden) == 4 and list(spool.iterdir()) == []
    assert "backend': 'sglang'" in (workdir / "logs" / "tiny" / "extract" / "shard-00000.log").read_text()
    for path in hidden:
        direct = tmp_path / "direct" / path.name
        (prepared,) = (workdir / "results" / "tiny" / "prepared").rglob(path.name)
        extract.extract_shard(prepared, direct, tiny_llama, "tiny-llama", [2, 3, 4], device="cpu", check_disk=False, tokens_per_batch=1)
        via_server, reference = shards.verify_shard(path).tensors(), shards.verify_shard(direct).tensors()
        assert all(torch.equal(via_server[name], reference[name]) for name in shards.HIDDEN_TENSORS), path.name


@pytest.mark.workflow
def test_dry_run_of_a_tensor_parallel_8_sglang_config_plans_gpu_resources(tmp_path, tiny_llama):
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 20)
    configfile = tiny_workflow_config(
        tmp_path, tiny_llama, conversations,
        extract={"backend": "sglang", "gpus_per_job": 8, "sglang": {"start_server": False}},
    )
    config = yaml.safe_load(configfile.read_text())
    config["target"]["tensor_parallel"] = 8
    configfile.write_text(yaml.safe_dump(config))
    result = run_snakemake(tmp_path, configfile, "-n", "-p", "--cores", "all", "--resources", "gpu=8")
    output = result.stdout + result.stderr
    assert "rule extract_hidden_states" in output and "gpu=8" in output


def test_service_ports_are_picked_free_and_below_the_ephemeral_range():
    low, _ = sglang_launch.ephemeral_port_range()
    for _ in range(5):
        host, port = sglang_launch.url_port(sglang_launch.url_with_free_port("http://127.0.0.1:30000"))
        assert host == "127.0.0.1" and sglang_launch.port_is_free(host, port)
        if low > sglang_launch.SERVICE_PORTS_FROM:
            assert sglang_launch.SERVICE_PORTS_FROM <= port < low


@pytest.mark.integration
def test_a_server_of_another_launch_on_the_picked_port_is_refused_and_the_server_starts_on_another(tmp_path, tiny_llama, standin):
    """Another launch's server (same target, same layers) took the port this launcher picked
    before its own server bound it: the launcher must not take that server for its own, and
    starts its server again on another port once it has died on the taken one."""
    other, taken_url, _ = standin()
    sglang = {"spool_dir": str(tmp_path / "launcher-spool")}
    launcher, _, service_file = start_launcher(tmp_path, tiny_llama, sglang, taken_url, repick_port=True)
    try:
        record = sglang_launch.wait_for_service(service_file, startup_timeout_s=120, poll_s=0.2)
        assert record["url"] != taken_url
        own = sglang_client.identify_server(record["url"])
        assert own["launch_token"] == record["info"]["launch_token"] and own["spool_dir"] == sglang["spool_dir"]
        assert sglang_client.identify_server(taken_url)["launch_token"] is None  # the other one, still serving
        with pytest.raises(sglang_client.SglangServerError, match="not the one this launcher started"):
            sglang_client.check_server(taken_url, "tiny-llama", [2, 3, 4], 64, launch_token=own["launch_token"])
    finally:
        launcher.send_signal(signal.SIGTERM)
        stderr = launcher.communicate(timeout=90)[1]
    assert launcher.returncode == 0, stderr
    assert f"another process took {taken_url} before the server bound it; starting again on {record['url']}" in stderr
    assert not service_file.exists() and other.poll() is None


@pytest.mark.integration
@pytest.mark.parametrize("freeze", [True, False])
def test_launcher_freezes_the_ready_servers_garbage_collector_when_asked(tmp_path, tiny_llama, freeze):
    """extract.sglang.freeze_gc: once the server answers as ours, the launcher asks it to freeze
    (SGLang's /freeze_gc), before its jobs are told it is ready; the record says whether it did."""
    sglang = {"spool_dir": str(tmp_path / "spool"), "freeze_gc": freeze}
    url = sglang_launch.url_with_free_port("http://127.0.0.1:30000")
    launcher, workdir, service_file = start_launcher(tmp_path, tiny_llama, sglang, url)
    try:
        record = sglang_launch.wait_for_service(service_file, startup_timeout_s=120, poll_s=0.2)
        assert record["gc_frozen"] is freeze
        with urllib.request.urlopen(record["url"] + "/standin/stats", timeout=10) as response:
            assert json.loads(response.read())["gc_frozen"] == (1 if freeze else 0)
        assert json.loads((workdir / "state" / "server.json").read_text())["gc_frozen"] is freeze
    finally:
        launcher.send_signal(signal.SIGTERM)
        stderr = launcher.communicate(timeout=90)[1]
    assert launcher.returncode == 0, stderr


def test_a_server_without_the_freeze_route_is_served_as_it_is(capsys):
    """A server that answers /freeze_gc with an error (not SGLang, or an SGLang without the
    route) is not a failed start: freeze_gc says False and why, and the launcher goes on."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert sglang_launch.freeze_gc(url, timeout_s=10) is False
        assert sglang_launch.freeze_gc("http://127.0.0.1:9", timeout_s=2) is False  # nothing listening
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert f"the server at {url} did not freeze its garbage collector (HTTP Error 404" in err
