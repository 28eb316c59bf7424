"""One server per block of shards: rule sglang_server, a Snakemake service grouped with its
block's shard jobs, through the real Snakefile. The server is the stand-in
(extract.sglang.standin: a real HTTP server computing with transformers on the CPU),
started, waited on and stopped by the same launcher and rules as the patched SGLang."""

from __future__ import annotations

import json
import shlex
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
import torch
import yaml

from conftest import (
    REPO, SNAKEFILE, planned_jobs, run_snakemake, snakemake_command, synthetic_conversations, tiny_workflow_config,
    wait_until,
)
from eaglenest.stages import extract
from eaglenest.sglang import client as sglang_client, launch as sglang_launch, patch as sglang_patch
from eaglenest.formats import shards
from support.group_jobs import planned_group_jobs

# The launcher starts the stand-in server in place of SGLang.
pytestmark = pytest.mark.usefixtures("sglang_standin")

SHARDS = [f"{i:05d}" for i in range(4)]
BLOCK_OF = {"00000": "00000", "00001": "00000", "00002": "00001", "00003": "00001"}  # 2 shards per server
TARGETS = [f"results/tiny/hidden/shard-{shard}.safetensors" for shard in SHARDS]


def service_run(tmp_path: Path, tiny_llama: Path) -> tuple[Path, Path, Path]:
    """A tiny run whose 4 shards are extracted by 2 stand-in servers (blocks of 2 shards)."""
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 40)
    workdir = tmp_path / "work"
    workdir.mkdir()
    spool = tmp_path / "spool"  # unique to this test: it marks the test's server processes
    sglang = {"shards_per_server": 2, "spool_dir": str(spool), "backoff_s": 0.1}
    configfile = tiny_workflow_config(workdir, tiny_llama, conversations, extract={"backend": "sglang", "sglang": sglang})
    return workdir, configfile, spool


def run_logs(workdir: Path, tail: int = 3000) -> str:
    """The ends of the launcher and shard logs and Snakemake's error lines, for a failed run."""
    parts = []
    for log in sorted((workdir / "logs" / "tiny").glob("**/*.log")) + sorted((workdir / ".snakemake" / "log").glob("*.log")):
        text = log.read_text(errors="replace")
        if log.parent.name == "log":  # Snakemake's own: where it says what failed
            text = "\n".join(line for line in text.splitlines() if "rror" in line or "Missing" in line)
        parts.append(f"--- {log.relative_to(workdir)}\n{text[-tail:]}")
    return "\n".join(parts)


def hidden(workdir: Path, shard: str) -> Path:
    return workdir / "results" / "tiny" / "hidden" / f"shard-{shard}.safetensors"


def state_dir(workdir: Path, block: str) -> Path:
    return workdir / "logs" / "tiny" / "sglang" / f"block-{block}"


def processes_mentioning(marker: str) -> dict[int, str]:
    """Live processes (zombies excluded) whose command line or environment contains ``marker``
    (a launched server has its spool directory in its capture settings, EAGLENEST_CAPTURE)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environment = (proc / "environ").read_bytes().decode(errors="replace")
            zombie = "\nState:\tZ" in (proc / "status").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if (marker in cmdline or marker in environment) and not zombie:
            found[int(proc.name)] = cmdline
    return found


def block_server_pid(service_file: Path, spool: Path) -> int | None:
    """Pid of the server process a block's launcher started, once it runs."""
    record = sglang_launch.read_service_record(service_file)
    if record is None:
        return None
    for pid, cmdline in processes_mentioning(str(spool)).items():
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, IndexError, ValueError):
            continue
        if "standin_server.py" in cmdline and parent == record["launcher_pid"]:
            return pid
    return None


def assert_no_server_left(spool: Path, servers: list[dict]) -> None:
    """Neither a launcher nor a server of this run is alive, and no server port answers."""
    assert wait_until(lambda: not processes_mentioning(str(spool)), timeout=30), processes_mentioning(str(spool))
    for server in servers:
        assert not Path(f"/proc/{server['pid']}").exists() or "\nState:\tZ" in Path(f"/proc/{server['pid']}/status").read_text()
        address = urllib.parse.urlsplit(server["url"])
        with socket.socket() as probe:
            assert probe.connect_ex((address.hostname, address.port)) != 0, f"{server['url']} still answers"


def assert_equals_transformers_backend(workdir: Path, tmp_path: Path, shard: str) -> None:
    """The shard bit for bit as the transformers backend writes it (one sample per forward)."""
    path = hidden(workdir, shard)
    (prepared,) = (workdir / "results" / "tiny" / "prepared").rglob(path.name)
    reference = tmp_path / "transformers" / path.name
    if not reference.exists():
        target = tiny_workflow_target(workdir)
        extract.extract_shard(prepared, reference, target, "tiny-llama", [2, 3, 4], device="cpu", check_disk=False, tokens_per_batch=1)
    via_server, direct = shards.verify_shard(path, deep=True).tensors(), shards.verify_shard(reference).tensors()
    for name in shards.HIDDEN_TENSORS:
        assert torch.equal(via_server[name], direct[name]), f"{path.name}: {name}"


def tiny_workflow_target(workdir: Path) -> str:
    return yaml.safe_load((workdir / "config.yaml").read_text())["target"]["path"]


@pytest.mark.workflow
def test_each_block_gets_one_server_that_is_gone_when_its_shards_are_done(tmp_path, tiny_llama):
    workdir, configfile, spool = service_run(tmp_path, tiny_llama)
    started = time.monotonic()
    run_snakemake(workdir, configfile, "--cores", "4", *TARGETS)
    print(f"2 blocks of 2 shards through 2 stand-in servers: {time.monotonic() - started:.0f} s")

    servers = {block: json.loads((state_dir(workdir, block) / "server.json").read_text()) for block in ("00000", "00001")}
    assert servers["00000"]["pid"] != servers["00001"]["pid"]
    for block in servers:
        launcher_log = (state_dir(workdir, block) / "launcher.log").read_text()
        assert launcher_log.count("ready: ") == 1 and "stopped: " in launcher_log, launcher_log
    for shard in SHARDS:
        log = (workdir / "logs" / "tiny" / "extract" / f"shard-{shard}.log").read_text()
        # Each shard was extracted by its own block's server, which it waited for.
        assert f"block server ready at {servers[BLOCK_OF[shard]]['url']} " in log, log
        assert "backend': 'sglang'" in log
        assert_equals_transformers_backend(workdir, tmp_path, shard)
    assert_no_server_left(spool, list(servers.values()))
    assert list(spool.iterdir()) == []  # every spooled sample was consumed
    # The launcher and Snakemake both remove a service file when its group is done.
    assert not list((workdir / "results" / "tiny" / "sglang").glob("block-*"))
    assert planned_jobs(workdir, configfile, *TARGETS) == {}

    # How the servers are started is no part of a shard: another block size, other server
    # timeouts or flags plan nothing (docs/reruns.md).
    settings = yaml.safe_load(configfile.read_text())
    settings["extract"]["sglang"].update(
        shards_per_server=3, concurrency=2, startup_timeout_s=120, extra_args=["--mem-fraction-static", "0.8"]
    )
    configfile.write_text(yaml.safe_dump(settings, sort_keys=False))
    assert planned_jobs(workdir, configfile, *TARGETS) == {}
    # Shards made through servers have one input more than the transformers backend's (the
    # service), so the input trigger plans them again after a switch of backend.
    settings["extract"]["backend"] = "transformers"
    configfile.write_text(yaml.safe_dump(settings, sort_keys=False))
    assert planned_jobs(workdir, configfile, *TARGETS) == {"extract_hidden_states": 4}


@pytest.mark.workflow
def test_killed_run_reruns_only_the_missing_shards_and_no_server_for_a_finished_block(tmp_path, tiny_llama):
    workdir, configfile, spool = service_run(tmp_path, tiny_llama)
    service_file = {block: workdir / "results" / "tiny" / "sglang" / f"block-{block}.json" for block in ("00000", "00001")}
    # --cores 1: a block's group counts its server's one thread, so one block runs at a time.
    process = subprocess.Popen(
        snakemake_command(workdir, configfile, "--cores", "1", *TARGETS), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    killed = None
    try:
        deadline = time.monotonic() + 300
        while killed is None and time.monotonic() < deadline and process.poll() is None:
            done = {shard for shard in SHARDS if hidden(workdir, shard).exists()}
            for finished, running in (("00000", "00001"), ("00001", "00000")):
                if not {s for s in SHARDS if BLOCK_OF[s] == finished} <= done:
                    continue
                if {s for s in SHARDS if BLOCK_OF[s] == running} <= done:
                    continue
                server_pid = block_server_pid(service_file[running], spool)
                if server_pid is not None:
                    os.killpg(process.pid, signal.SIGKILL)  # Snakemake, its jobs and the launcher
                    killed = (finished, running, server_pid)
                    break
            time.sleep(0.05)
    finally:
        if process.poll() is None and killed is None:
            os.killpg(process.pid, signal.SIGKILL)
        output = process.communicate(timeout=60)[0]
    assert killed, f"never saw one block finished while the other's server ran:\n{output[-4000:]}\n{run_logs(workdir)}"
    finished, running, server_pid = killed
    # The server is in a session of its own, out of reach of the kill; it dies with its
    # launcher (parent-death signal), and nothing of the run is left.
    assert wait_until(lambda: server_pid not in processes_mentioning(str(spool)), timeout=30), "the server outlived the kill"
    assert not processes_mentioning(str(spool))

    missing = [shard for shard in SHARDS if not hidden(workdir, shard).exists()]
    assert missing and all(BLOCK_OF[shard] == running for shard in missing)
    survivors = {s: (hidden(workdir, s).stat().st_mtime_ns, hidden(workdir, s).read_bytes()) for s in SHARDS if s not in missing}
    finished_launcher_log = (state_dir(workdir, finished) / "launcher.log").read_bytes()
    # One server, for the block with missing shards; none for the finished block.
    assert planned_jobs(workdir, configfile, *TARGETS) == {"sglang_server": 1, "extract_hidden_states": len(missing)}

    run_snakemake(workdir, configfile, "--unlock")  # the killed run's lock, as a user would
    run_snakemake(workdir, configfile, "--cores", "1", *TARGETS)
    for shard, (mtime, data) in survivors.items():
        assert hidden(workdir, shard).stat().st_mtime_ns == mtime and hidden(workdir, shard).read_bytes() == data, shard
    assert (state_dir(workdir, finished) / "launcher.log").read_bytes() == finished_launcher_log
    for shard in SHARDS:
        assert_equals_transformers_backend(workdir, tmp_path, shard)
    server = json.loads((state_dir(workdir, running) / "server.json").read_text())
    assert_no_server_left(spool, [server])
    assert planned_jobs(workdir, configfile, *TARGETS) == {}


@pytest.mark.workflow
def test_kimi_dry_run_plans_one_eight_gpu_server_per_block_of_shards(tmp_path):
    """config/kimi-k2.5.yaml (TP 8, 240 shards, 8 per server) through profiles/slurm: every
    block is one group job that asks for the node's 8 GPUs once, however many shards it has."""
    kimi = REPO / "config" / "kimi-k2.5.yaml"
    counts = planned_jobs(tmp_path, kimi)
    assert counts["sglang_server"] == 30 and counts["extract_hidden_states"] == 240

    every_group = planned_group_jobs(SNAKEFILE, tmp_path, kimi, REPO / "profiles" / "slurm")
    groups = [group for group in every_group if group["group"] == "sglang_node"]
    assert len(groups) == 30
    assert_kimi_evaluation_servers(counts, [group for group in every_group if group["group"] != "sglang_node"])
    blocks = set()
    for group in groups:
        assert group["group"] == "sglang_node"
        (server,) = [job for job in group["jobs"] if job["rule"] == "sglang_server"]
        clients = [job for job in group["jobs"] if job["rule"] == "extract_hidden_states"]
        block = int(server["wildcards"]["block"])
        blocks.add(block)
        assert sorted(int(job["wildcards"]["shard"]) for job in clients) == list(range(8 * block, 8 * block + 8))
        assert server["resources"]["gpu"] == 8 and all(job["resources"]["gpu"] == 0 for job in clients)
        # What the allocation asks for: the server's GPUs and CPUs once, memory for the
        # server and its 8 clients, the longest job's time.
        assert group["resources"]["gpu"] == 8
        assert group["resources"]["cpus_per_gpu"] == 12
        assert group["resources"]["mem_mb"] == 1_000_000 + 8 * 40_000
        assert group["resources"]["runtime"] == 720
        assert group["threads"] == 1  # clients count no threads: plannable with one core
    assert blocks == set(range(30))


KIMI_SETTINGS = {"plain", "steps3-topk1-tokens4", "steps7-topk1-tokens8", "steps6-topk10-tokens60"}


def assert_kimi_evaluation_servers(counts: dict, groups: list[dict]) -> None:
    """evaluate.backend sglang: one 8-GPU server per drafting setting and a plain one, each one
    group job with its setting's two eval sets (MT-bench, HumanEval) as clients."""
    assert counts["evaluate_server"] == 4 and counts["evaluate_sglang"] == 8 and counts["evaluate_merge"] == 6
    assert {group["group"] for group in groups} == {"evaluate_node"} and len(groups) == 4
    settings = set()
    for group in groups:
        (server,) = [job for job in group["jobs"] if job["rule"] == "evaluate_server"]
        clients = [job for job in group["jobs"] if job["rule"] == "evaluate_sglang"]
        settings.add(server["wildcards"]["setting"])
        assert {job["wildcards"]["setting"] for job in clients} == {server["wildcards"]["setting"]}
        assert sorted(job["wildcards"]["eval_set"] for job in clients) == ["humaneval", "mt_bench"]
        assert server["resources"]["gpu"] == 8 and group["resources"]["gpu"] == 8 and group["threads"] == 1
    assert settings == KIMI_SETTINGS


@pytest.mark.workflow
def test_shard_jobs_that_would_hold_gpus_beside_their_server_are_refused(tmp_path, tiny_llama):
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 20)
    configfile = tiny_workflow_config(tmp_path, tiny_llama, conversations, extract={"backend": "sglang", "gpus_per_job": 8})
    result = run_snakemake(tmp_path, configfile, "-n", check=False)
    assert result.returncode != 0
    assert "with extract.sglang.start_server the block's server holds target.tensor_parallel GPUs" in result.stdout + result.stderr


def launch_service(tmp_path: Path, model: Path) -> tuple[subprocess.Popen, Path]:
    """The launcher as rule sglang_server runs it, outside Snakemake."""
    config = {
        "run": "tiny",
        "target": {"name": "tiny-llama", "path": str(model), "num_layers": 7, "hidden_size": 64, "vocab_size": 320},
        "extract": {"layer_ids": "default", "sglang": {"spool_dir": str(tmp_path / "spool")}},
    }
    service_file = tmp_path / "block-00000.json"
    command = [
        sys.executable, "-m", "eaglenest.sglang.launch", "--service-file", str(service_file),
        "--state-dir", str(tmp_path / "state"), "--config-json", json.dumps(config),
    ]
    log = open(tmp_path / "launcher.log", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), service_file


@pytest.mark.integration
def test_launcher_as_a_service_publishes_its_server_and_stops_it_on_sigint(tmp_path, tiny_llama):
    launcher, service_file = launch_service(tmp_path, tiny_llama)
    try:
        record = sglang_launch.wait_for_service(service_file, startup_timeout_s=120)
        assert record["launcher_pid"] == launcher.pid and record["info"]["target"] == "tiny-llama"
        assert sglang_client.check_server(record["url"], "tiny-llama", [2, 3, 4], 64)["server"] == sglang_patch.SERVER_KIND
        launcher.send_signal(signal.SIGINT)  # Ctrl-C; Snakemake sends SIGTERM, tested through the workflow
        assert launcher.wait(timeout=60) == 0, (tmp_path / "launcher.log").read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not service_file.exists()
    assert_no_server_left(tmp_path / "spool", [{"pid": record["server_pid"], "url": record["url"]}])


@pytest.mark.integration
def test_shard_jobs_learn_at_once_why_their_server_did_not_start(tmp_path):
    launcher, service_file = launch_service(tmp_path, tmp_path / "no-model-here")
    started = time.monotonic()
    try:
        with pytest.raises(sglang_client.SglangServerError, match=r"the block's SGLang server failed: .*config\.json not found"):
            sglang_launch.wait_for_service(service_file, startup_timeout_s=3600)
        assert time.monotonic() - started < 60  # not the hour of the startup timeout
        assert launcher.wait(timeout=60) != 0
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.integration
def test_shard_jobs_learn_at_once_that_a_launcher_died_before_writing_its_state(tmp_path):
    """The server rules' shell first writes the service file naming itself, then execs the
    launcher: here an interpreter that cannot run it (exit 3), as in an env without eaglenest."""
    from eaglenest.sglang import SERVICE_STARTING_SHELL

    service_file = tmp_path / "block-00000.json"
    first = SERVICE_STARTING_SHELL.replace("{output:q}", shlex.quote(str(service_file)))
    first = first.replace("{{", "{").replace("}}", "}")
    shell = subprocess.Popen(["bash", "-c", f"{first} && sleep 1 && exec {sys.executable} -c 'raise SystemExit(3)'"])
    started = time.monotonic()
    try:
        with pytest.raises(sglang_client.SglangServerError, match=rf"launcher of the block's SGLang server \(pid {shell.pid}\) is gone, its record says 'starting'"):
            sglang_launch.wait_for_service(service_file, startup_timeout_s=3600, poll_s=0.2)
        assert time.monotonic() - started < 30  # not LAUNCHER_START_TIMEOUT_S
    finally:
        assert shell.wait(timeout=30) == 3


@pytest.mark.workflow
def test_the_regenerate_jobs_share_one_server_that_the_workflow_starts_in_serve_mode(tmp_path, tiny_llama):
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 20)
    workdir = tmp_path / "work"
    workdir.mkdir()
    spool = tmp_path / "spool"  # marks this test's server processes
    configfile = tiny_workflow_config(
        workdir, tiny_llama, conversations,
        data={"max_conversations": 20, "samples_per_shard": 10},
        extract={"sglang": {"spool_dir": str(spool)}},
        regenerate={"enabled": True, "backend": "openai", "max_new_tokens": 8, "concurrency": 2, "temperature": 0.8,
                    "top_p": 0.95},
    )
    report_path = workdir / "results" / "tiny" / "regenerated"
    jobs = planned_jobs(workdir, configfile, "regenerate_report")
    assert jobs["regenerate_server"] == 1 and jobs["regenerate"] == 2, jobs
    # benchmarks/sglang_regenerate.py notes when the workflow's server is ready (the GPU run's clock).
    bench = [sys.executable, str(REPO / "benchmarks" / "sglang_regenerate.py")]
    ready_file = tmp_path / "ready.txt"
    watcher = subprocess.Popen([*bench, "watch", "--record", str(workdir / "results" / "tiny" / "sglang" / "regenerate.json"),
                                "--out", str(ready_file)])
    try:
        run_snakemake(workdir, configfile, "--cores", "2", "regenerate_report")
        assert watcher.wait(timeout=30) == 0
    finally:
        watcher.kill()

    (report_file,) = report_path.rglob("regenerate_report.json")
    report = json.loads(report_file.read_text())
    assert report["regenerated"] > 0 and report["failed"] == 0, report
    assert report["regenerated"] + report["beyond_max_len"] == report["turns"], report  # every turn accounted for
    logs = workdir / "logs" / "tiny"
    server = json.loads((logs / "sglang" / "regenerate" / "server.json").read_text())
    # A server that generates: its identity says so, and no extract job would take it for a capture server.
    assert server["info"]["mode"] == "serve" and server["info"]["target"] == "tiny-llama"
    launcher_log = (logs / "sglang" / "regenerate" / "launcher.log").read_text()
    assert launcher_log.count("ready: ") == 1 and "stopped: " in launcher_log, launcher_log
    for shard in ("00000", "00001"):
        log = (logs / "regenerate" / f"shard-{shard}.log").read_text()
        assert f"regeneration server ready at {server['url']} " in log, log
    assert_no_server_left(spool, [server])
    # The GPU run's row: every turn accounted for, the server's generated tokens beside the kept ones.
    summary = tmp_path / "regenerate.json"
    subprocess.run([*bench, "summary", "--workdir", str(workdir), "--run", "tiny", "--ready", str(ready_file),
                    "--out", str(summary)], check=True)
    row = json.loads(summary.read_text())["regenerate"]
    assert row["shards_done"] == 2 and row["accounted"] and row["regenerated"] == report["regenerated"], row
    assert row["generated_tokens"] >= row["new_tokens"] > 0 and row["seconds"] > 0 and row["generated_tokens_per_s"] > 0, row
    # A rerun with every regenerated shard in place starts no server.
    assert planned_jobs(workdir, configfile, "regenerate_report") == {}


@pytest.mark.workflow
def test_the_targets_own_prompts_come_from_a_server_of_their_own_then_the_regenerate_server_answers_them(
        tmp_path, tiny_llama):
    """A synthesized source through the workflow's servers: rule synthesize_server serves rule
    synthesize_prompts and is stopped before ingest; then the regenerate jobs' server answers
    the prompts with the rest. Neither server is started again by a rerun."""
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 10)
    workdir = tmp_path / "work"
    workdir.mkdir()
    spool = tmp_path / "spool"
    configfile = tiny_workflow_config(
        workdir, tiny_llama, conversations,
        data={"max_conversations": 30, "samples_per_shard": 15},
        extract={"sglang": {"spool_dir": str(spool)}},
        regenerate={"enabled": True, "backend": "openai", "api": "generate", "max_new_tokens": 8, "concurrency": 2,
                    "temperature": 0.8, "top_p": 0.95},
    )
    config = yaml.safe_load(configfile.read_text())
    config["data"]["sources"].append({"name": "self", "synthesize": {"count": 20, "max_new_tokens": 64}})
    configfile.write_text(yaml.safe_dump(config))
    jobs = planned_jobs(workdir, configfile, "regenerate_report")
    assert {k: jobs[k] for k in ("synthesize_server", "synthesize_prompts", "ingest", "regenerate_server", "regenerate")} == {
        "synthesize_server": 1, "synthesize_prompts": 1, "ingest": 1, "regenerate_server": 1, "regenerate": 2}, jobs
    run_snakemake(workdir, configfile, "--cores", "2", "regenerate_report")
    logs = workdir / "logs" / "tiny"
    servers = [json.loads((logs / "sglang" / name / "server.json").read_text()) for name in ("synthesize", "regenerate")]
    for name in ("synthesize", "regenerate"):
        launcher_log = (logs / "sglang" / name / "launcher.log").read_text()
        assert launcher_log.count("ready: ") == 1 and "stopped: " in launcher_log, launcher_log
    assert f"synthesis server ready at {servers[0]['url']} " in (logs / "synthesize" / "self.log").read_text()
    assert_no_server_left(spool, servers)
    made = json.loads((workdir / "results" / "tiny" / "data" / "synthesized" / "self.report.json").read_text())
    (report_file,) = (workdir / "results" / "tiny" / "regenerated").rglob("regenerate_report.json")
    report = json.loads(report_file.read_text())
    assert made["backend"] == "openai" and made["kept"] > 0 and report["open_ended"] == made["kept"], (made, report)
    assert report["failed"] == 0 and report["regenerated"] + report["beyond_max_len"] == report["turns"], report
    assert planned_jobs(workdir, configfile, "regenerate_report") == {}


@pytest.mark.workflow
def test_the_gpu_regeneration_driver_plans_the_ceiling_server_and_the_workflows_regeneration(tmp_path, tiny_llama):
    """benchmarks/sglang_regenerate.sh with DRY_RUN=1: the plain server it would start for the
    ceiling (the launcher's serve-mode flags, no eaglenest code) and the jobs the workflow plans."""
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 20)
    workdir = tmp_path / "work"
    workdir.mkdir()
    configfile = tiny_workflow_config(
        workdir, tiny_llama, conversations, run="tiny-regenerate-dry-run",
        data={"max_conversations": 20, "samples_per_shard": 10},
        regenerate={"enabled": True, "backend": "openai", "temperature": 0.8, "top_p": 0.95},
        # The stand-in answers each request of the config's flags 0.3 s late, so the sweep's entry
        # (which takes the delay away) is the faster, whatever else the machine is doing.
        extract={"sglang": {"extra_args": ["--mem-fraction-static", "0.5", "--delay-s", "0.3"]}},
    )
    environment = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "EAGLENEST_SGLANG_COMMAND": "sglang-server",
                   "PYTHONPATH": str(REPO), "CEILING_SWEEP": "--scheduler-recv-interval 16;--enable-prefill-delayer "
                   "--cuda-graph-max-bs-decode 512@512;SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT=1 --scheduler-recv-interval 16@1008"}
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "sglang_regenerate.sh"), str(tmp_path / "out"), str(configfile)],
                            capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = (tmp_path / "out" / "steps.log").read_text()
    server, *sweep = [line for line in steps.splitlines() if line.startswith("ceiling server: ")]
    # One plain server per CEILING_SWEEP entry, each with the config's flags and its own; an
    # entry's NAME=VALUE words are its server's environment, not flags.
    assert [line.removeprefix(server).split() for line in sweep] == [
        ["--scheduler-recv-interval", "16"], ["--enable-prefill-delayer", "--cuda-graph-max-bs-decode", "512"],
        ["--scheduler-recv-interval", "16"]]
    servers = [line for line in steps.splitlines() if line.startswith("ceiling server")]
    assert servers[-1] == "ceiling server environment: SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT=1"
    assert sum(line.startswith("ceiling server environment: ") for line in servers) == 1
    # By default the ceiling keeps as many requests in flight as the workflow: 32 per shard job
    # (regenerate.concurrency's default), both shard jobs side by side.
    in_flight = [line.split()[-1] for line in steps.splitlines() if line.startswith("ceiling requests in flight: ")]
    assert in_flight == ["64", "512", "1008"]
    command = server.split()[2:]
    assert command[0] == "sglang-server" and "--port" in command and command[command.index("--port") + 1] == "30030"
    assert command[command.index("--served-model-name") + 1] == "tiny-llama"
    assert "--mem-fraction-static" in command and "--enable-return-hidden-states" not in command
    planned = {(parts[0], int(parts[1])) for line in steps.splitlines() if len(parts := line.split()) == 2 and parts[1].isdigit()}
    assert {("regenerate_server", 1), ("regenerate", 2), ("regenerate_report", 1)} <= planned, steps
    assert not any(rule in {rule for rule, _ in planned} for rule in ("prepare", "extract_hidden_states")), steps


@pytest.mark.workflow
def test_the_gpu_regeneration_driver_sweeps_server_flags_and_runs_the_workflow_with_the_fastest(tmp_path, tiny_llama,
                                                                                               sglang_standin):
    """benchmarks/sglang_regenerate.sh end to end against the stand-in server, in a copy of the
    checkout (the driver works in its checkout): one plain server per flag set answers the
    ceiling, the fastest's flags and requests in flight reach the workflow's own server
    through an overlay, every turn is accounted for, and the regenerated folder is packed."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns(".git", ".venv", "results", "logs", "docs", "resources",
                                                              ".snakemake", "__pycache__", ".*"))
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 16)
    configfile = tiny_workflow_config(
        repo, tiny_llama, conversations, run="tiny-regenerate-driver",
        data={"max_conversations": 16, "samples_per_shard": 8},
        regenerate={"enabled": True, "backend": "openai", "temperature": 0.8, "top_p": 0.95, "max_new_tokens": 6,
                    "concurrency": 2, "api": "generate", "stream": True, "repetition_stop": 3},
        # The stand-in answers each request of the config's flags 0.3 s late, so the sweep's entry
        # (which takes the delay away) is the faster, whatever else the machine is doing.
        extract={"sglang": {"extra_args": ["--mem-fraction-static", "0.5", "--delay-s", "0.3"]}},
    )
    python = [sys.executable, "-m", "snakemake", "--snakefile", str(repo / "Snakefile"), "--directory", str(repo)]
    subprocess.run([*python, "--cores", "1", "--configfile", str(configfile), "--until", "ingest", "-q"], check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(repo)})
    out = tmp_path / "out"
    environment = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(repo), "CORES": "2", "CEILING_PROMPTS": "8",
                   "CEILING_CONCURRENCY": "2", "PART_MIB": "1", "CEILING_PROFILE_AFTER_S": "0",
                   "CEILING_CPU_AFTER_S": "0", "CEILING_CPU_S": "0.3", "CPU_SAMPLE_AFTER_S": "0", "CPU_SAMPLE_S": "1",
                   "METRICS_EVERY_S": "0.5", "WORKFLOW_CLIENT_INTERVALS": "2 5",
                   "CEILING_SWEEP": "SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT=1 --enable-prefill-delayer "
                                    "--scheduler-recv-interval 16 --delay-s 0@4"}
    result = subprocess.run(["bash", str(repo / "benchmarks" / "sglang_regenerate.sh"), str(out), str(configfile)],
                            capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, (out / "steps.log").read_text()[-3000:] + result.stderr[-3000:]
    ceiling = json.loads((out / "ceiling.json").read_text())
    env = {"SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT": "1"}
    assert [(entry["server_flags"], entry["server_env"], entry["concurrency"]) for entry in ceiling["sweep"]] == [
        ([], {}, 2), (["--enable-prefill-delayer", "--scheduler-recv-interval", "16", "--delay-s", "0"], env, 4)]
    # The entry's environment reached its plain server alone.
    assert f"stand-in: SGLang environment {env}" in (out / "ceiling-server-1.log").read_text()
    assert "SGLang environment" not in (out / "ceiling-server-0.log").read_text()
    assert all(entry["tokens_per_s"] > 0 and "schedule" in entry for entry in ceiling["sweep"])
    assert ceiling["tokens_per_s"] == max(entry["tokens_per_s"] for entry in ceiling["sweep"])
    picked_flags = ["--mem-fraction-static", "0.5", "--delay-s", "0", "--enable-prefill-delayer", "--scheduler-recv-interval", "16"]
    assert ceiling["server_flags"] == ceiling["sweep"][1]["server_flags"]
    overlay = yaml.safe_load((out / "server-flags.yaml").read_text())
    assert overlay["extract"]["sglang"]["extra_args"] == picked_flags  # the entry's --delay-s in the config's place
    assert overlay["extract"]["sglang"]["env"] == ceiling["server_env"]
    # The workflow's server was started with the picked flags and environment (extract.sglang.env).
    server_log = (repo / "logs" / "tiny-regenerate-driver" / "sglang" / "regenerate" / "server.log").read_text()
    assert f"stand-in: SGLang environment {env}" in server_log
    (ignored,) = [line for line in server_log.splitlines() if "ignoring SGLang flags" in line]
    assert ignored.rstrip("]").endswith(", ".join(repr(flag) for flag in picked_flags if flag not in ("--delay-s", "0")))
    # Every server froze its garbage collector once ready (extract.sglang.freeze_gc, the default):
    # the plain ones as the launcher freezes the workflow's.
    steps = (out / "steps.log").read_text()
    assert "plain server 0: garbage collector frozen" in steps and "plain server 1: garbage collector frozen" in steps
    state = repo / "logs" / "tiny-regenerate-driver" / "sglang" / "regenerate"
    assert json.loads((state / "server.json").read_text())["gc_frozen"] is True
    summary = json.loads((out / "sglang_regenerate.json").read_text())["regenerate"]
    assert summary["shards_done"] == 2 and summary["accounted"] and summary["regenerated"] > 0
    assert summary["ceiling_tokens_per_s"] == ceiling["tokens_per_s"] and "schedule" in summary
    # Each plain server was asked for SGLang's profile once its ceiling's load had started (the
    # client's mark); the stand-in has no profiler, which each result records while the run goes on.
    for label in (0, 1):
        profiled = json.loads((out / f"profile-ceiling-{label}.json").read_text())
        assert "start_profile" in profiled["error"] and profiled["counted_from"] == str(out / f"ceiling-{label}.load-started")
        assert (out / f"ceiling-{label}.load-started").exists()
    # The cores each part kept busy: sampled in every ceiling's load and in the workflow's run.
    # The delayed ceiling's load (8 requests, 2 at a time, each 0.3 s late) outlasts the sample: its client is in it.
    for label in (0, 1):
        sampled = json.loads((out / f"cpu-ceiling-{label}.json").read_text())
        assert sampled["seconds"] >= 0.3 and isinstance(sampled["parts"], list), sampled
    sampled = json.loads((out / "cpu-ceiling-0.json").read_text())
    assert "ceiling client" in [part["role"] for part in sampled["parts"]], sampled
    assert summary["cpu"]["seconds"] >= 1 and isinstance(summary["cpu"]["parts"], list)
    # Every server here was started with --enable-metrics and scraped until it stopped: the
    # ceilings' (every 5 s: at least once) and the workflow's, whose series reaches the summary.
    for label in (0, 1):
        scraped = json.loads((out / f"metrics-ceiling-{label}.json").read_text())
        assert scraped["series"] and "sglang:num_running_reqs" in scraped["series"][0], scraped
    scraped = json.loads((out / "metrics-workflow.json").read_text())
    assert scraped["series"] and "ended" in scraped, scraped
    assert summary["server_metrics"]["last"] == scraped["series"][-1]
    # The clients' account beside the server's: what they kept in flight over the run.
    assert summary["client"]["shards"] == 2 and 0 < summary["client"]["mean_in_flight"] <= 4, summary["client"]
    # The stage's own client on the config's plain server, beside its ceiling and out of the
    # flags' pick, once per stream interval; the one that kept the most tokens a second sets the
    # workflow's regenerate.stream_interval.
    clients = {interval: json.loads((out / f"client-workflow-i{interval}.json").read_text()) for interval in (2, 5)}
    for interval, client in clients.items():
        assert (client["client"], client["prompts"], sum(client["finish_reasons"].values())) == ("workflow", 8, 8)
        assert client["generated_tokens"] > 0 and "failed" not in client["finish_reasons"]
        assert client["streamed"] and client["stream_interval"] == interval
    fastest = max(clients, key=lambda interval: clients[interval]["kept_tokens_per_s"])
    assert overlay["regenerate"]["stream_interval"] == fastest
    # The packed folder holds the shards and their reports (a rerun's inputs).
    listing = subprocess.run(f"cat {out}/regenerated.tar.xz.part-* | tar -tJf -", shell=True, capture_output=True, text=True,
                             check=True).stdout.split()
    assert sum(name.endswith(".report.json") for name in listing) == 2 and sum(name.endswith(".jsonl") for name in listing) == 2
