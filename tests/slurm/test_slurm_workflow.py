"""The real Snakefile through profiles/slurm on a real single-node Slurm (tests/slurm/local_slurm.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from eaglenest.formats import atomic

from . import local_slurm
from .profile_runs import (
    PROFILE, SHARD_COUNT, finished_jobs, new_slurm_workdir, planned_through_slurm, run_through_slurm, slurm_command,
    slurm_env,
)

SHARDS = [f"shard-{i:05d}.safetensors" for i in range(SHARD_COUNT)]
WHOLE_RUN = {"ingest": 1, "prepare": SHARD_COUNT, "prepare_report": 1, "extract_hidden_states": SHARD_COUNT, "consolidate": 1,
             "train_drafter": 1, "export_drafter": 1, "all": 1}
CONSOLIDATED = "results/tiny/consolidated/index.json"


def hidden_dir(workdir: Path) -> Path:
    return workdir / "results" / "tiny" / "hidden"


def snapshot(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(directory.glob("shard-*.safetensors"))}


def our_jobs(before: set[str]) -> dict[str, dict[str, str]]:
    return {job_id: job for job_id, job in finished_jobs().items() if job_id not in before}


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory, tiny_llama):
    workdir, config = new_slurm_workdir(tmp_path_factory, tiny_llama, "slurm-run")
    jobs_before = set(finished_jobs())
    started = time.monotonic()
    result = run_through_slurm(workdir, config)
    wall_s = time.monotonic() - started
    print(f"default pipeline through Slurm: {wall_s:.0f} s")
    return workdir, config, result, our_jobs(jobs_before)


def test_profile_keeps_the_default_rerun_policy_and_leaves_cluster_names_to_the_environment():
    slurm = yaml.safe_load((PROFILE / "config.yaml").read_text())
    default = yaml.safe_load((REPO / "profiles" / "default" / "config.yaml").read_text())
    assert slurm["executor"] == "slurm"
    assert slurm["rerun-triggers"] == default["rerun-triggers"]
    assert "code" not in slurm["rerun-triggers"]
    for key in ("slurm_partition", "slurm_account"):
        assert "os').environ.get('EAGLENEST_SLURM_" in slurm["default-resources"][key], key
        assert key not in str(slurm["set-resources"]), key


@pytest.mark.workflow
def test_default_pipeline_completes_through_slurm_in_the_partition_from_the_environment(slurm_run):
    workdir, config, result, jobs = slurm_run
    assert sorted(p.name for p in hidden_dir(workdir).iterdir()) == SHARDS
    for target in ("consolidated/index.json", "train/drafter", "train/training_summary.json"):
        assert (workdir / "results" / "tiny" / target).exists(), target
    # Every rule with work ran as a Slurm job, in the partition named by the environment
    # (the cluster's default partition is another one).
    rules = sorted(re.sub(r"_wildcards_.*", "", job["comment"]) for job in jobs.values())
    assert rules == sorted(["rule_ingest", "rule_prepare_report", "rule_consolidate", "rule_train_drafter", "rule_export_drafter"]
                           + ["rule_prepare"] * SHARD_COUNT + ["rule_extract_hidden_states"] * SHARD_COUNT)
    assert {job["state"] for job in jobs.values()} == {"COMPLETED"}
    assert {job["partition"] for job in jobs.values()} == {local_slurm.PARTITION}
    # Training ran torchrun inside its allocation.
    assert "torch.distributed.run --standalone --nproc_per_node=2" in (workdir / "logs" / "tiny" / "train.log").read_text()
    assert planned_through_slurm(workdir, config) == {}


@pytest.mark.workflow
def test_each_concurrent_extraction_job_gets_its_own_gpu_from_slurm(slurm_run):
    workdir, _, _, jobs = slurm_run
    seen = {}
    for log in sorted((workdir / "logs" / "tiny" / "extract").glob("shard-*.log")):
        found = re.findall(r"CUDA_VISIBLE_DEVICES=(\S+) SLURM_JOB_ID=(\S+)", log.read_text())
        assert len(found) == 1, f"{log.name}: {found}"
        devices, job_id = found[0]
        assert job_id in jobs, f"{log.name} ran outside this run's Slurm jobs: {job_id}"
        seen[job_id] = devices
    assert len(seen) == SHARD_COUNT
    assert set(seen.values()) <= {str(i) for i in range(local_slurm.NODE_GPUS)}

    def interval(job_id):
        return tuple(datetime.fromisoformat(jobs[job_id][key]) for key in ("start", "end"))

    overlapping = [
        (a, b) for a in seen for b in seen
        if a < b and interval(a)[0] < interval(b)[1] and interval(b)[0] < interval(a)[1]
    ]
    assert overlapping, "no two extraction jobs ran at the same time, so the GPU assignment was not tested"
    for a, b in overlapping:
        assert seen[a] != seen[b], f"Slurm jobs {a} and {b} ran at the same time on GPU {seen[a]}"


@pytest.mark.workflow
def test_dry_run_through_the_profile_plans_every_job_and_submits_nothing(slurm_cluster, tmp_path_factory, tiny_llama):
    workdir, config = new_slurm_workdir(tmp_path_factory, tiny_llama, "slurm-dry-run")
    jobs_before = set(finished_jobs())
    assert planned_through_slurm(workdir, config) == WHOLE_RUN
    # `--profile` also works; profiles/default is then layered on top of it.
    assert planned_through_slurm(workdir, config, profile_flag="--profile") == WHOLE_RUN
    dry_run = run_through_slurm(workdir, config, "-n")
    dry_run = dry_run.stdout + dry_run.stderr
    extract_resources = re.findall(r"rule extract_hidden_states:.*?resources: ([^\n]*)", dry_run, re.S)
    assert len(extract_resources) == SHARD_COUNT
    for resources in extract_resources:
        assert f"slurm_partition={local_slurm.PARTITION}," in resources and "gpu=1," in resources and "cpus_per_gpu=8" in resources
    # No new job id: jobs of earlier tests may age out of slurmctld's memory meanwhile (MinJobAge),
    # so the ids left are a subset of those before, and any submitted job would be a new one.
    assert set(finished_jobs()) <= jobs_before
    assert not (workdir / "results").exists()


@pytest.mark.workflow
def test_scancel_of_a_running_extraction_then_rerun_makes_only_the_missing_shard(slurm_run, tmp_path_factory):
    # A copy of the finished run (mtimes kept) without anything from extraction on but its first
    # shard: the same jobs from there as in a run whose first extraction job has finished,
    # without waiting for ingest, prepare and that job through Slurm again.
    workdir = tmp_path_factory.mktemp("slurm-scancel") / "w"
    shutil.copytree(slurm_run[0], workdir, symlinks=True, ignore=shutil.ignore_patterns("slurm_logs"))
    for stage in ("consolidated", "train", "export"):
        shutil.rmtree(workdir / "results" / "tiny" / stage)
    for shard in SHARDS[1:]:
        (hidden_dir(workdir) / shard).unlink()
    config = workdir / "config.yaml"
    shards_dir = hidden_dir(workdir)
    # One job at a time, so a shard is done while a later one is still running, and one more is
    # made after the cancel (keep-going). The runs go as far as consolidation: what follows
    # reads the shards as any other run does.
    process = subprocess.Popen(
        slurm_command(workdir, config, "--jobs", "1", CONSOLIDATED), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=slurm_env(), start_new_session=True,
    )
    cancelled_shard = None
    try:
        deadline = time.monotonic() + 300
        while cancelled_shard is None and time.monotonic() < deadline and process.poll() is None:
            done = {p.name for p in shards_dir.glob("shard-*.safetensors")}
            for job_id, job in finished_jobs().items():
                shard = re.fullmatch(r"rule_extract_hidden_states_wildcards_(\d{5})", job["comment"])
                if done and shard and job["state"] == "RUNNING" and f"shard-{shard[1]}.safetensors" not in done:
                    subprocess.run(["scancel", job_id], check=True, timeout=30)
                    cancelled_shard = f"shard-{shard[1]}.safetensors"
                    break
            time.sleep(0.2)
        assert cancelled_shard, "never saw a running extraction job after a finished shard"
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # keep-going: the other shards were made; the cancelled one is missing and the run failed.
    assert process.returncode != 0, output[-3000:]
    survivors = snapshot(shards_dir)
    assert sorted(survivors) == sorted(set(SHARDS) - {cancelled_shard})
    assert planned_through_slurm(workdir, config, CONSOLIDATED) == {"extract_hidden_states": 1, "consolidate": 1}
    run_through_slurm(workdir, config, CONSOLIDATED)
    after = snapshot(shards_dir)
    assert sorted(after) == SHARDS
    for name, state in survivors.items():
        assert after[name] == state, f"{name} was rebuilt although its job was not cancelled"
    assert list(workdir.glob(f"results/**/*{atomic.TMP_MARKER}*")) == []
    assert planned_through_slurm(workdir, config, CONSOLIDATED) == {}
