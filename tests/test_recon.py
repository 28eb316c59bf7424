"""eaglenest recon: built situations (killed runs, corrupt shards, wrong servers), real processes."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import planned_jobs, run_snakemake, snakemake_command, wait_until
from eaglenest import cli
from eaglenest.formats import atomic
from eaglenest.node import recon

NO_GPU = lambda args: (_ for _ in ()).throw(OSError("no nvidia-smi"))  # noqa: E731  (a machine without GPUs)


def planned_shards(workdir: Path, configfile: Path) -> list[int]:
    """Shard ids of the extract jobs that ``snakemake -n`` plans."""
    result = run_snakemake(workdir, configfile, "-n")
    text = result.stdout + result.stderr
    ids = set()
    for block in re.split(r"\n(?=(?:local)?rule )", text):
        if block.lstrip().startswith(("rule extract_hidden_states", "localrule extract_hidden_states")):
            match = re.search(r"wildcards: shard=(\d+)", block)
            ids.add(int(match.group(1)))
    return sorted(ids)


def run_recon(workdir: Path, configfile: Path, **kwargs) -> dict:
    kwargs.setdefault("nvidia_smi", NO_GPU)
    return recon.recon(workdir, [str(configfile)], **kwargs)


@pytest.fixture(scope="module")
def finished_run(finished_tiny_run) -> tuple[Path, Path]:
    """A tiny workflow run to the end: 4 hidden shards, consolidated (conftest's, shared)."""
    return finished_tiny_run


@pytest.fixture
def run_copy(finished_run, tmp_path) -> tuple[Path, Path]:
    """A private copy of the finished run (mtimes kept) that a test may damage."""
    source, _ = finished_run
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir, symlinks=True)
    # The copied config still names the original conversations file: same params, nothing replanned.
    return workdir, workdir / "config.yaml"


def hidden(workdir: Path, shard_id: int) -> Path:
    return workdir / "results" / "tiny" / "hidden" / f"shard-{shard_id:05d}.safetensors"


def killed_writer(final: Path) -> Path:
    """Leave a real partial file: an atomic writer SIGKILLed halfway through its write."""
    code = (
        "import sys, time\n"
        "from eaglenest.formats import atomic\n"
        "def write(tmp):\n"
        "    with open(tmp, 'wb') as handle:\n"
        "        handle.write(b'\\0' * 4096); handle.flush(); print('writing', flush=True); time.sleep(60)\n"
        "atomic.write_with(sys.argv[1], write)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", code, str(final)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    leftovers = list(final.parent.glob(final.name + atomic.TMP_MARKER + "*"))
    assert len(leftovers) == 1 and not final.exists()
    return leftovers[0]


# --------------------------------------------------------------------------- config


def test_config_is_loaded_like_the_workflow_with_overrides_and_defaults(tmp_path):
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({"run": "other", "data": {"max_conversations": 10}, "extract": {"dtype": "float16"}}))
    config = recon.load_config(recon.REPO, [str(override)])
    assert config["run"] == "other"
    assert config["data"]["max_conversations"] == 10
    assert config["data"]["samples_per_shard"] == 32  # merged, not replaced
    assert config["extract"]["gpus_per_job"] == 0  # default from the schema
    assert config["target"]["tensor_parallel"] == 1


def test_invalid_config_is_a_usage_error_with_the_bad_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"extract": {"dtype": "int3"}}))
    with pytest.raises(recon.ReconError, match="extract/dtype"):
        recon.load_config(recon.REPO, [str(bad)])
    assert cli.main(["recon", "--directory", str(recon.REPO), "--configfile", str(bad)]) == 2
    assert "extract/dtype" in capsys.readouterr().err


# --------------------------------------------------------------------------- GPUs and processes

# nvidia-smi (driver 570) on an 8x H200 node where a vLLM server auto-started at boot:
# --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits
H200_GPUS = "\n".join(
    f"{i}, GPU-6f0c{i}e2a-41d3-9b5e-8c7f-2d1e0a9b3c4{i}, NVIDIA H200, 77618, 143771, 0" for i in range(8)
) + "\n"
# --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits
H200_APPS = "".join(
    f"GPU-6f0c{i}e2a-41d3-9b5e-8c7f-2d1e0a9b3c4{i}, {{pid}}, VLLM::Worker_TP{i}, 77600\n" for i in range(8)
)


@pytest.fixture
def fake_vllm_process():
    """A real process whose command line is vLLM's OpenAI server."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/Kimi-K2.5",
                                "--tensor-parallel-size", "8"])
    # Until the child has exec'd, /proc shows no command line (seen on a loaded 2-core machine).
    cmdline = Path(f"/proc/{process.pid}/cmdline")
    deadline = time.monotonic() + 30
    while b"vllm.entrypoints" not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    yield process
    process.kill()
    process.wait()


@pytest.mark.integration
def test_nvidia_smi_output_names_the_vllm_process_holding_idle_gpus(fake_vllm_process):
    outputs = {"--query-gpu": H200_GPUS, "--query-compute-apps": H200_APPS.format(pid=fake_vllm_process.pid)}
    run = lambda args: outputs[args[0].split("=")[0]]  # noqa: E731  (recorded nvidia-smi text)
    section = recon.check_gpus(recon.list_processes(), gpus_needed=True, run=run)
    assert section["status"] == recon.BLOCK
    assert [g["memory_used_mib"] for g in section["gpus"]] == [77618.0] * 8
    assert all(g["idle_holder"] for g in section["gpus"])
    (holder,) = section["holders"]
    assert holder["pid"] == fake_vllm_process.pid and holder["kind"] == "vllm"
    assert holder["gpus"] == list(range(8))
    assert "vllm.entrypoints.openai.api_server" in holder["cmdline"] and holder["started"]
    assert section["steps"][0]["command"] == f"kill {fake_vllm_process.pid}"
    assert "0 % utilisation" in section["summary"]


def test_gpu_parsing_handles_mig_not_supported_fields_and_no_processes():
    gpus = recon.parse_gpu_query("0, GPU-aaaa, NVIDIA H200, 0, 143771, [N/A]\n")
    assert gpus[0]["utilization_pct"] is None and gpus[0]["memory_used_mib"] == 0
    section = recon.gpu_report(gpus, recon.parse_apps_query(""), {}, gpus_needed=True)
    assert section["status"] == recon.OK and section["holders"] == []
    with pytest.raises(ValueError, match="unexpected nvidia-smi"):
        recon.parse_gpu_query("0, GPU-aaaa, NVIDIA H200\n")


def test_machine_without_nvidia_smi_says_so_and_goes_on():
    section = recon.check_gpus({}, gpus_needed=True, run=NO_GPU)
    assert section["status"] == recon.NA and "no nvidia-smi" in section["summary"]


@pytest.mark.parametrize(
    "cmdline, kind",
    [
        ("python -m eaglenest.cli serve --configfile config/kimi-k2.5.yaml", "eaglenest-sglang"),
        ("/opt/conda/envs/sglang/bin/python -m sglang.launch_server --model-path /models/Kimi-K2.5 --tp 8", "sglang"),
        ("sglang::scheduler_TP3", "sglang"),
        ("/usr/bin/python3 /usr/local/bin/vllm serve /models/Kimi-K2.5 --tensor-parallel-size 8", "vllm"),
        ("VLLM::EngineCore", "vllm"),
        ("torchrun --nproc-per-node 8 -m eaglenest.stages.train --config results/kimi/train/config.json", "eaglenest-train"),
        ("python /work/.snakemake/scripts/tmpab12cd.train.py", "eaglenest-train"),
        ("python /work/.snakemake/scripts/tmpx9.extract_shard.py", "eaglenest-extract"),
        ("/usr/bin/python3 -m snakemake --cores all", "snakemake"),
        ("/usr/bin/python3 jupyter-lab --port 8888", "unknown"),
    ],
)
def test_process_kind_is_named_from_its_command_line(cmdline, kind):
    assert recon.process_kind(cmdline.split()) == kind


def test_sglang_workers_of_our_launcher_count_as_ours():
    processes = {
        10: {"cmdline": ["python", "-m", "eaglenest.cli", "serve"], "ppid": 1},
        11: {"cmdline": ["sglang::scheduler_TP0"], "ppid": 10},
        20: {"cmdline": ["sglang::scheduler_TP0"], "ppid": 1},
    }
    assert recon.kind_with_parents(11, processes) == "eaglenest-sglang"
    assert recon.kind_with_parents(20, processes) == "sglang"


# --------------------------------------------------------------------------- servers


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = self.routes.get(self.path)
        if body is None:
            self.send_error(404)
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    """Start a real HTTP server on 127.0.0.1 answering the given JSON routes; yields its URL."""
    servers = []

    def start(routes: dict) -> str:
        handler = type("Routes", (_Handler,), {"routes": routes})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


VLLM_MODELS = {"object": "list", "data": [{"id": "/models/Kimi-K2.5", "object": "model", "owned_by": "vllm",
                                           "root": "/models/Kimi-K2.5", "max_model_len": 262144}]}


def sglang_config(tmp_path: Path) -> dict:
    override = tmp_path / "sglang.yaml"
    override.write_text(yaml.safe_dump({"extract": {"backend": "sglang"}}))
    return recon.load_config(recon.REPO, [str(override)])


def test_wrong_server_on_the_configured_url_is_named_and_its_pid_given(http_server, tmp_path):
    url = http_server({"/v1/models": VLLM_MODELS, "/version": {"version": "0.11.0"}})
    section = recon.check_servers(sglang_config(tmp_path), recon.list_processes(), server_url=url)
    assert section["status"] == recon.BLOCK
    assert section["probe"]["kind"] == "vllm"
    assert "something else answers: vLLM" in section["summary"]
    # The listener is found through /proc/net/tcp: here it is this very process.
    assert section["steps"][0]["command"] == f"kill {os.getpid()}"


def test_nothing_answering_on_the_configured_url_blocks(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    section = recon.check_servers(sglang_config(tmp_path), {}, listeners=[], server_url=f"http://127.0.0.1:{port}")
    assert section["status"] == recon.BLOCK and section["probe"]["kind"] == "nothing"
    assert "nothing answers" in section["summary"]
    assert section["steps"][0]["command"] == "python -m eaglenest.sglang.launch"


@pytest.mark.integration
def test_no_server_is_expected_between_runs_when_the_workflow_starts_one_per_block(tmp_path):
    section = recon.check_servers(sglang_config(tmp_path), {}, listeners=[])  # start_server: true by default
    assert section["status"] == recon.NA and "starts a server per block" in section["summary"]
    assert section["steps"] == []


def test_patched_sglang_for_this_run_is_accepted_and_one_for_another_target_is_not(http_server, tmp_path):
    from eaglenest import plan
    from eaglenest.sglang import patch as sglang_patch

    config = sglang_config(tmp_path)
    info = {"server": sglang_patch.SERVER_KIND, "patch_version": sglang_patch.PATCH_VERSION,
            "target": config["target"]["name"], "layer_ids": plan.layer_ids(config),
            "hidden_size": config["target"]["hidden_size"], "tensor_parallel": 1}
    good = http_server({sglang_patch.INFO_ROUTE: info})
    assert recon.check_servers(config, {}, listeners=[], server_url=good)["status"] == recon.OK
    other = http_server({sglang_patch.INFO_ROUTE: dict(info, target="meta-llama/Llama-3-8B")})
    section = recon.check_servers(config, {}, listeners=[], server_url=other)
    assert section["status"] == recon.BLOCK and "patched SGLang for another run" in section["summary"]
    assert "meta-llama/Llama-3-8B" in section["summary"]
    plain = http_server({"/get_model_info": {"model_path": config["target"]["path"], "is_generation": True}})
    section = recon.check_servers(config, {}, listeners=[], server_url=plain)
    assert section["probe"]["kind"] == "sglang" and "plain SGLang" in section["summary"]


def test_every_stage_that_uses_a_server_is_checked_and_each_hand_started_one_probed(http_server, tmp_path):
    override = tmp_path / "servers.yaml"
    plain = http_server({"/get_model_info": {"model_path": "tiny", "is_generation": True}})
    vllm = http_server({"/v1/models": VLLM_MODELS})
    override.write_text(yaml.safe_dump({
        "regenerate": {"enabled": True, "backend": "openai", "start_server": False, "url": vllm},
        "evaluate": {"backend": "sglang", "temperature": 0,
                     "drafting": [{"steps": 3, "topk": 1, "tokens": 4}, {"steps": 6, "topk": 10, "tokens": 60}],
                     "sglang": {"start_server": False, "urls": {"plain": plain, "steps3-topk1-tokens4": vllm}}},
    }))
    config = recon.load_config(recon.REPO, [str(override)])
    section = recon.check_servers(config, {}, listeners=[])
    checked = {(one["stage"], one["name"]): one for one in section["checked"]}
    assert sorted(checked) == [("evaluate", "plain"), ("evaluate", "steps3-topk1-tokens4"),
                               ("evaluate", "steps6-topk10-tokens60"), ("regenerate", "regenerate")]
    # Regeneration speaks OpenAI chat completions, which vLLM serves too; evaluation reads SGLang's meta_info.
    assert checked["regenerate", "regenerate"]["status"] == recon.OK
    assert checked["evaluate", "plain"]["status"] == recon.OK
    assert checked["evaluate", "steps3-topk1-tokens4"]["status"] == recon.BLOCK
    assert "something else answers: vLLM" in checked["evaluate", "steps3-topk1-tokens4"]["summary"]
    missing = checked["evaluate", "steps6-topk10-tokens60"]
    assert missing["status"] == recon.BLOCK and "names no server URL" in missing["summary"]
    assert "evaluate.sglang.urls.steps6-topk10-tokens60" in missing["steps"][0]["why"]
    assert section["status"] == recon.BLOCK and section["summary"].startswith("evaluate ")
    # Extraction uses the transformers backend here: no server of its own is checked.
    assert section["probe"] is None and section["url"] is None

    override.write_text(yaml.safe_dump({"regenerate": {"enabled": True, "backend": "openai"},
                                        "evaluate": {"backend": "sglang", "temperature": 0}}))
    section = recon.check_servers(recon.load_config(recon.REPO, [str(override)]), {}, listeners=[])
    assert section["status"] == recon.NA and section["checked"] == []
    assert "one server for the regenerate jobs" in section["summary"]
    assert "a server per drafting setting and a plain one" in section["summary"]


def test_proc_net_tcp_listeners_are_parsed_for_ipv4_and_ipv6():
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:7530 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 48211 1 0 100 0 0 10 0\n"
        "   1: 0100007F:7530 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 48299 1 0 20 4 30 10 -1\n"
    )
    assert recon.parse_proc_net_tcp(text) == [{"address": "127.0.0.1", "port": 30000, "inode": 48211}]
    text6 = (
        "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 00000000000000000000000001000000:1F40 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5512 1 0 100 0 0 10 0\n"
    )
    assert recon.parse_proc_net_tcp(text6) == [{"address": "::1", "port": 8000, "inode": 5512}]


# --------------------------------------------------------------------------- workflow state


@pytest.mark.workflow
def test_finished_run_is_ready_with_nothing_to_run(finished_run):
    workdir, configfile = finished_run
    report = run_recon(workdir, configfile)
    workflow = report["sections"]["workflow"]
    assert workflow["by_state"]["done"] == [0, 1, 2, 3]
    assert workflow["to_build"] == [] and workflow["predicted_jobs"] == {}
    assert planned_jobs(workdir, configfile) == {}
    assert workflow["samples_done"] == workflow["samples_total"] > 0
    # The finished tiny run trained, exported and evaluated: every later stage is present.
    for stage in ("checkpoints", "drafter", "export", "eval"):
        assert workflow["later_stages"][stage]["state"] == "present", (stage, workflow["later_stages"][stage])
    assert report["verdict"]["ready"] and report["verdict"]["next_command"].startswith("nothing to run")


@pytest.mark.workflow
def test_run_killed_mid_extraction_reports_missing_and_partial_shards_and_unlock_first(run_copy):
    workdir, configfile = run_copy
    for shard_id in (1, 2, 3):
        hidden(workdir, shard_id).unlink()
    process = subprocess.Popen(snakemake_command(workdir, configfile, "--cores", "1"), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    # Snakemake picks the order of the three shard jobs: kill once the first of them is written.
    while not any(hidden(workdir, i).exists() for i in (1, 2, 3)):
        assert process.poll() is None and time.monotonic() < deadline, "snakemake ended before a shard was written"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    absent = [i for i in range(4) if not hidden(workdir, i).exists()]
    assert absent, "snakemake finished before it was killed"
    partial = absent[-1]
    killed_writer(hidden(workdir, partial))

    report = run_recon(workdir, configfile)
    workflow, smk = report["sections"]["workflow"], report["sections"]["snakemake"]
    assert workflow["by_state"]["partial"] == [partial]
    assert workflow["by_state"]["missing"] == absent[:-1]
    # A shard renamed into place just before the kill is still marked incomplete by Snakemake.
    incomplete = workflow["by_state"]["incomplete"]
    assert all(hidden(workdir, i).exists() for i in incomplete)
    expected = sorted(absent + incomplete)
    assert workflow["to_build"] == expected
    assert smk["locks"] and not smk["snakemake_alive"]
    assert not report["verdict"]["ready"]
    assert report["verdict"]["next_command"] == recon.snakemake_command([str(configfile)], workdir, "--unlock")
    commands = [s["command"] for s in report["verdict"]["steps"]]
    assert any(c and c.startswith("rm ") and atomic.TMP_MARKER in c for c in commands)
    assert commands[-1].startswith("snakemake --cores all")

    # Follow the advice: unlock; recon's shard list equals what snakemake -n plans.
    run_snakemake(workdir, configfile, "--unlock")
    report = run_recon(workdir, configfile)
    assert planned_shards(workdir, configfile) == report["sections"]["workflow"]["to_build"] == expected
    assert report["verdict"]["ready"]
    assert report["verdict"]["next_command"].startswith("rm ")  # the partial file first
    resume = report["verdict"]["steps"][-1]["command"]
    assert resume.startswith("snakemake --cores all") and ("--rerun-incomplete" in resume) == bool(incomplete)
    assert planned_jobs(workdir, configfile).get("extract_hidden_states") == len(expected)


@pytest.mark.workflow
def test_truncated_shard_is_corrupt_in_header_mode_and_bit_flip_only_in_deep_mode(run_copy):
    workdir, configfile = run_copy
    truncated, flipped = hidden(workdir, 1), hidden(workdir, 2)
    os.truncate(truncated, truncated.stat().st_size - 100)
    with open(flipped, "r+b") as handle:
        handle.seek(-10, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-10, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x40]))

    fast = run_recon(workdir, configfile)["sections"]["workflow"]
    assert fast["by_state"]["corrupt"] == [1] and 2 in fast["by_state"]["done"]
    deep = run_recon(workdir, configfile, deep=True)
    workflow = deep["sections"]["workflow"]
    assert workflow["by_state"]["corrupt"] == [1, 2]
    assert "checksum mismatch" in workflow["shards"][2]["reason"]
    # Snakemake cannot see corruption: nothing planned until recon's rm is run.
    assert workflow["to_build"] == [] and planned_shards(workdir, configfile) == []
    assert not deep["verdict"]["ready"]
    rm = deep["verdict"]["steps"][0]["command"]
    assert rm == f"rm {hidden(workdir, 1).relative_to(workdir)} {hidden(workdir, 2).relative_to(workdir)}"
    assert deep["verdict"]["next_command"] == rm
    for path in rm.split()[1:]:
        (workdir / path).unlink()
    assert planned_shards(workdir, configfile) == [1, 2] == run_recon(workdir, configfile)["sections"]["workflow"]["to_build"]


@pytest.mark.workflow
def test_bit_flip_in_the_trained_drafter_is_found_by_deep_recon_and_rebuilt_identically(run_copy):
    workdir, configfile = run_copy
    weights = workdir / "results" / "tiny" / "train" / "drafter" / "model.safetensors"
    original = weights.read_bytes()
    damaged = bytearray(original)
    damaged[-64] ^= 0x10
    weights.write_bytes(bytes(damaged))
    assert run_recon(workdir, configfile)["verdict"]["ready"], "header mode reads no weights"
    deep = run_recon(workdir, configfile, deep=True)
    drafter_state = deep["sections"]["workflow"]["later_stages"]["drafter"]
    assert drafter_state["state"] == "corrupt" and "checksum mismatch" in drafter_state["problem"]
    assert not deep["verdict"]["ready"]
    assert deep["verdict"]["next_command"] == "rm -r results/tiny/train/drafter"
    shutil.rmtree(workdir / "results" / "tiny" / "train" / "drafter")
    run_snakemake(workdir, configfile, "--cores", "2")
    # Training resumes from its last checkpoint: the same weights, byte for byte.
    assert weights.read_bytes() == original
    assert run_recon(workdir, configfile, deep=True)["verdict"]["ready"]


@pytest.mark.workflow
def test_incomplete_marker_on_an_existing_shard_asks_for_rerun_incomplete(run_copy):
    workdir, configfile = run_copy
    # What a kill between the atomic rename and Snakemake's bookkeeping leaves behind.
    key = str(hidden(workdir, 0).relative_to(workdir))
    marker = workdir / ".snakemake" / "incomplete" / __import__("base64").urlsafe_b64encode(key.encode()).decode()
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"external_jobid": None}))
    report = run_recon(workdir, configfile)
    assert report["sections"]["workflow"]["by_state"]["incomplete"] == [0]
    assert report["sections"]["snakemake"]["rerun_incomplete"]
    assert "--rerun-incomplete" in report["verdict"]["next_command"]
    assert planned_shards(workdir, configfile) == [0]


@pytest.mark.workflow
def test_fix_removes_stale_temps_and_locks_and_says_so(run_copy, capsys):
    workdir, configfile = run_copy
    hidden(workdir, 3).unlink()
    temp = killed_writer(hidden(workdir, 3))
    locks = workdir / ".snakemake" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    (locks / "0.output.lock").write_text(str(hidden(workdir, 3).relative_to(workdir)) + "\n")
    code = cli.main(["recon", "--directory", str(workdir), "--configfile", str(configfile), "--fix"])
    out = capsys.readouterr().out
    assert not temp.exists() and not list(locks.glob("*.lock"))
    assert "fixed: removed" in out and code == 0
    assert "Next command: snakemake --cores all" in out


@pytest.mark.workflow
def test_missing_weight_file_blocks_with_the_file_named(run_copy, tiny_llama, tmp_path):
    workdir, configfile = run_copy
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    weights = sorted(model.glob("*.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": weights[0].name, "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    config = yaml.safe_load(configfile.read_text())
    config["target"]["path"] = str(model)
    configfile.write_text(yaml.safe_dump(config))
    report = run_recon(workdir, configfile)
    code = report["sections"]["code"]
    assert code["status"] == recon.BLOCK
    assert "model-00002-of-00002.safetensors missing" in code["target_model"]["summary"]
    assert not report["verdict"]["ready"]


@pytest.mark.workflow
def test_an_unconverted_embedded_target_beside_its_shards_says_to_convert_first(run_copy):
    """Hidden shards brought to a machine without the converted embedded target: a run that
    converts it plans every shard again (docs/reruns.md), so recon says to convert first, and
    the run's own command comes after."""
    workdir, configfile = run_copy
    config = yaml.safe_load(configfile.read_text())
    config["target"].update(embedded="smollm2", path=str(workdir / "resources" / "models" / "not-converted"))
    configfile.write_text(yaml.safe_dump(config))
    report = run_recon(workdir, configfile)
    code = report["sections"]["code"]
    assert code["status"] == recon.WARN
    assert "4 hidden-state shard(s) exist" in code["target_summary"]
    commands = [step["command"] for step in report["verdict"]["steps"]]
    convert = next(c for c in commands if c and "convert_embedded_target" in c)
    assert convert.endswith(f"--configfile {configfile}")
    assert report["verdict"]["next_command"] == convert
    # Without shards there is nothing to lose: the workflow converts it as usual.
    for shard in (workdir / "results" / "tiny" / "hidden").glob("shard-*.safetensors"):
        shard.unlink()
    assert run_recon(workdir, configfile)["sections"]["code"]["target_model"]["status"] == recon.OK


@pytest.mark.workflow
def test_disk_too_small_blocks_with_numbers(run_copy):
    workdir, configfile = run_copy
    hidden(workdir, 0).unlink()
    config = yaml.safe_load(configfile.read_text())
    free = shutil.disk_usage(workdir).free
    config["extract"]["disk_reserve_mb"] = (free >> 20) + 1  # the preflight's reserve alone exceeds the disk
    configfile.write_text(yaml.safe_dump(config))
    report = run_recon(workdir, configfile)
    disk = report["sections"]["disk"]
    assert disk["status"] == recon.BLOCK and disk["shards_left"] == 1
    assert disk["needed_bytes"] == report["sections"]["workflow"]["shards"][0]["planned_tokens"] * disk_bytes_per_token(config)
    assert report["verdict"]["blockers"][0].startswith("disk: too small")


def disk_bytes_per_token(config: dict) -> int:
    from eaglenest import plan

    return plan.bytes_per_token(config["target"]["hidden_size"], len(plan.layer_ids(config)), config["extract"]["dtype"])


@pytest.mark.workflow
def test_json_output_and_exit_status_of_the_cli(finished_run, capsys):
    workdir, configfile = finished_run
    code = cli.main(["recon", "--directory", str(workdir), "--configfile", str(configfile), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["verdict"]["ready"]
    assert set(report["sections"]) == {"gpus", "servers", "workflow", "snakemake", "disk", "code"}
    cli.main(["recon", "--directory", str(workdir), "--configfile", str(configfile)])
    human = capsys.readouterr().out.splitlines()
    assert len(human) <= 24 and human[-1].startswith("Next command:")


FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"


@pytest.mark.integration
def test_nvidia_smi_captured_on_an_h200_with_a_process_holding_memory_at_zero_utilisation(fake_vllm_process):
    """Output captured on an H200 (2026-11-29) while a process held 19.7 GB and computed nothing;
    the capture's pid is swapped for a live local process so recon can read its command line."""
    gpu_text = (FIXTURES / "h200-query-gpu.csv").read_text()
    apps_text = (FIXTURES / "h200-query-apps.csv").read_text()
    captured_pid = recon.parse_apps_query(apps_text)[0]["pid"]
    outputs = {"--query-gpu": gpu_text, "--query-compute-apps": apps_text.replace(f", {captured_pid},", f", {fake_vllm_process.pid},")}
    (gpu,) = recon.parse_gpu_query(gpu_text)
    assert gpu["name"] == "NVIDIA H200" and gpu["memory_used_mib"] == 19693 and gpu["utilization_pct"] == 0
    section = recon.check_gpus(recon.list_processes(), gpus_needed=True, run=lambda args: outputs[args[0].split("=")[0]])
    assert section["gpus"][0]["idle_holder"] and section["status"] == recon.BLOCK
    (holder,) = section["holders"]
    assert holder["kind"] == "vllm" and holder["used_memory_mib"] == 19684
    assert section["steps"][0]["command"] == f"kill {fake_vllm_process.pid}"
    # The same capture's nvidia-smi -q -x agrees on the numbers recon reads from the query format.
    xml = (FIXTURES / "h200-q.xml").read_text()
    assert "<product_name>NVIDIA H200</product_name>" in xml and f"<pid>{captured_pid}</pid>" in xml


@pytest.mark.workflow
def test_killed_training_job_is_never_ready_with_nothing_to_run(run_copy):
    workdir, configfile = run_copy
    run_dir = workdir / "results" / "tiny"
    shutil.rmtree(run_dir / "train" / "drafter")
    (run_dir / "train" / "training_summary.json").unlink()
    train_log = workdir / "logs" / "tiny" / "train.log"
    train_log.unlink()
    process = subprocess.Popen(snakemake_command(workdir, configfile, "--cores", "1"), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # The job opens its log first thing: kill the whole run while it trains.
    started = wait_until(lambda: train_log.exists() or process.poll() is not None, 120) and train_log.exists()
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert started and not (run_dir / "train" / "drafter").exists(), "training was not in flight when killed"
    run_snakemake(workdir, configfile, "--unlock")

    report = run_recon(workdir, configfile)
    workflow = report["sections"]["workflow"]
    assert workflow["later_stages"]["drafter"]["state"] == "missing"
    later = {"train_drafter", "export_drafter", "evaluate_summary"}
    assert later <= set(workflow["predicted_jobs"]), workflow["predicted_jobs"]
    assert later <= set(planned_jobs(workdir, configfile, options=("--rerun-incomplete",)))
    assert not report["verdict"]["next_command"].startswith("nothing to run")
    assert report["verdict"]["steps"][-1]["command"].startswith("snakemake --cores all")
    assert "Verdict: finished" not in recon.render(report)


@pytest.mark.workflow
def test_damaged_export_blocks_with_the_command_that_removes_it(run_copy):
    workdir, configfile = run_copy
    weights = workdir / "results" / "tiny" / "export" / "sglang" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (workdir / "results" / "tiny" / "evaluate" / "summary.json").write_text("{")
    report = run_recon(workdir, configfile)
    assert not report["verdict"]["ready"]
    damaged = {d["path"]: d["rule"] for d in report["sections"]["workflow"]["later_damaged"]}
    assert damaged == {"results/tiny/export/sglang": "export_drafter", "results/tiny/evaluate/summary.json": "evaluate_summary"}
    commands = [step["command"] for step in report["verdict"]["steps"]]
    assert "rm -r results/tiny/export/sglang" in commands and "rm results/tiny/evaluate/summary.json" in commands
