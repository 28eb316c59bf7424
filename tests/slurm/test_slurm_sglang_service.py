"""One Slurm allocation per block of shards: the sglang_node group (rule sglang_server, a
service, and its block's extraction jobs) through profiles/slurm on the test cluster, with
the stand-in server (extract.sglang.standin) playing a tensor-parallel-8 SGLang."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import synthetic_conversations, tiny_workflow_config
from test_sglang_service import processes_mentioning

from . import local_slurm
from .profile_runs import finished_jobs, planned_through_slurm, run_through_slurm

# The launcher starts the stand-in server in place of SGLang (in the Slurm jobs too: sbatch exports
# the environment).
pytestmark = [pytest.mark.workflow, pytest.mark.usefixtures("sglang_standin")]

SHARDS = [f"{i:05d}" for i in range(4)]
BLOCK_OF = {"00000": "00000", "00001": "00000", "00002": "00001", "00003": "00001"}
TARGETS = [f"results/tiny/hidden/shard-{shard}.safetensors" for shard in SHARDS]
# The plugin names a group job's Slurm job after the group and its rules, without wildcards.
GROUP_COMMENT = "rule_sglang_node_extract_hidden_states_sglang_server"


def allocation(job_id: str) -> str:
    """What Slurm gave a job, as `scontrol show job` says (finished jobs stay for MinJobAge)."""
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True, timeout=10).stdout


def test_each_block_is_one_allocation_with_eight_gpus_for_its_server_and_shards(slurm_cluster, tmp_path_factory, tiny_llama):
    workdir = tmp_path_factory.mktemp("slurm-sglang")
    conversations = synthetic_conversations(workdir / "conversations.jsonl", 40)
    spool = workdir / "spool"
    sglang = {"shards_per_server": 2, "spool_dir": str(spool), "backoff_s": 0.1}
    configfile = tiny_workflow_config(workdir, tiny_llama, conversations, extract={"backend": "sglang", "sglang": sglang})
    config = yaml.safe_load(configfile.read_text())
    config["target"]["tensor_parallel"] = 8  # the server job asks for a whole node's GPUs, as Kimi-K2.5's
    configfile.write_text(yaml.safe_dump(config, sort_keys=False))

    jobs_before = set(finished_jobs())
    planned = planned_through_slurm(workdir, configfile)
    assert planned["sglang_server"] == 2 and planned["extract_hidden_states"] == 4
    started = time.monotonic()
    run_through_slurm(workdir, configfile, *TARGETS)
    print(f"2 blocks through Slurm: {time.monotonic() - started:.0f} s")
    jobs = {job_id: job for job_id, job in finished_jobs().items() if job_id not in jobs_before}

    groups = {job_id: job for job_id, job in jobs.items() if job["comment"] == GROUP_COMMENT}
    assert len(groups) == 2, jobs  # one sbatch per block, none per shard or per server
    outside = sorted(re.sub(r"_wildcards_.*", "", job["comment"]) for job_id, job in jobs.items() if job_id not in groups)
    assert outside == ["rule_ingest"] + ["rule_prepare"] * 4  # prepare: one job per shard
    assert {job["state"] for job in jobs.values()} == {"COMPLETED"}
    assert {job["partition"] for job in groups.values()} == {local_slurm.PARTITION}
    for job_id in groups:
        granted = allocation(job_id)
        # The group's resources: the server's 8 GPUs and 12 CPUs per GPU once, memory for
        # the server and its two clients (profiles/slurm).
        assert re.search(r"TresPerJob=gres:gpu:8\b", granted) and "NumCPUs=96 " in granted, granted
        assert f"MinMemoryNode={1_000_000 + 2 * 40_000}M" in granted, granted

    # Each block's server and both its shard jobs ran in the same allocation.
    ran_in = {}
    for block in ("00000", "00001"):
        log = (workdir / "logs" / "tiny" / "sglang" / f"block-{block}" / "launcher.log").read_text()
        (job_id,) = re.findall(r"SLURM_JOB_ID=(\S+)", log)
        assert "ready: " in log and "stopped: " in log, log
        ran_in[block] = job_id
    assert set(ran_in.values()) == set(groups)
    for shard in SHARDS:
        log = (workdir / "logs" / "tiny" / "extract" / f"shard-{shard}.log").read_text()
        assert re.findall(r"SLURM_JOB_ID=(\S+)", log) == [ran_in[BLOCK_OF[shard]]], shard
        server = json.loads((workdir / "logs" / "tiny" / "sglang" / f"block-{BLOCK_OF[shard]}" / "server.json").read_text())
        assert f"block server ready at {server['url']} " in log
    assert sorted(p.name for p in (workdir / "results" / "tiny" / "hidden").iterdir()) == [Path(t).name for t in TARGETS]
    assert not processes_mentioning(str(spool))  # no server outlived its allocation
    assert planned_through_slurm(workdir, configfile).get("sglang_server") is None
