"""Run the real Snakefile through profiles/slurm against the test cluster."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import REPO, snakemake_command, synthetic_conversations, tiny_workflow_config

from . import local_slurm

PROFILE = REPO / "profiles" / "slurm"
SHARD_COUNT = 3
# The test cluster has no accounting database: the plugin's default status command (sacct)
# would fail on every poll and the run would wait forever. The first status check comes
# after 5 s instead of the plugin's 40 s, which only makes the tiny jobs finish sooner: the
# plugin adds 10 s to the wait after every check that finds no job finished and goes back to
# this value when one has, so checks come 5, 20, 45 s after a submission. The jobs here take
# 10-20 s (two nested Snakemake starts each), 25-45 s when several share the 2 cores; with
# 2 s the checks at 2, 14, 36, 68 s come just before most of them end.
CLUSTER_ARGS = ("--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "5")


def slurm_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EAGLENEST_SLURM_PARTITION": local_slurm.PARTITION}
    # An account would be checked with sacctmgr, which needs the accounting database.
    env.pop("EAGLENEST_SLURM_ACCOUNT", None)
    return env


def new_slurm_workdir(tmp_path_factory, tiny_llama, name: str) -> tuple[Path, Path]:
    """A tiny run whose extraction asks Slurm for one GPU per shard job and whose training
    runs two torchrun processes inside its allocation. Evaluation is left out: it is the
    same kind of single-process job as export and would only lengthen the Slurm stage."""
    workdir = tmp_path_factory.mktemp(name)
    # 3 shards of 10: enough for extraction jobs side by side and for one cancelled among
    # finished ones, each job fewer a Slurm submission less.
    conversations = synthetic_conversations(workdir / "conversations.jsonl", 10 * SHARD_COUNT)
    config = tiny_workflow_config(
        workdir, tiny_llama, conversations, data={"max_conversations": 10 * SHARD_COUNT, "samples_per_shard": 10},
        extract={"gpus_per_job": 1}, train={"cpu_processes": 2},
        evaluate={"enabled": False},
    )
    return workdir, config


def slurm_command(workdir: Path, configfile: Path, *args: str, profile_flag: str = "--workflow-profile") -> list[str]:
    return snakemake_command(workdir, configfile, profile_flag, str(PROFILE), *CLUSTER_ARGS, *args)


def run_through_slurm(workdir: Path, configfile: Path, *args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(slurm_command(workdir, configfile, *args, **kwargs), capture_output=True, text=True, env=slurm_env())
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake through Slurm failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result


def planned_through_slurm(workdir: Path, configfile: Path, *targets: str, **kwargs) -> dict[str, int]:
    """Rule name -> job count that ``snakemake -n`` plans through the profile (for ``targets``)."""
    result = run_through_slurm(workdir, configfile, "-n", "--quiet", "rules", *(("--", *targets) if targets else ()), **kwargs)
    counts = {}
    for line in (result.stdout + result.stderr).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job"):
            counts[parts[0]] = int(parts[1])
    return counts


def finished_jobs() -> dict[str, dict[str, str]]:
    """Slurm job id -> partition, state, comment (rule and wildcards), start and end, for
    every job slurmctld still remembers (local_slurm's MinJobAge: an hour after it ended)."""
    fields = ("partition", "state", "comment", "start", "end")
    result = subprocess.run(
        ["squeue", "--states=all", "--noheader", "--format=%i|%P|%T|%k|%S|%e"],
        capture_output=True, text=True, check=True, timeout=10,
    )
    jobs = {}
    for line in result.stdout.splitlines():
        job_id, *values = line.split("|")
        jobs[job_id] = dict(zip(fields, values))
    return jobs
