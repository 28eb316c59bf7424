"""Shared fixtures: tiny random-weight targets, synthetic conversations, workflow runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support import tiny

REPO = Path(__file__).resolve().parents[1]
SNAKEFILE = REPO / "Snakefile"
DEFAULT_CONFIG = REPO / "config" / "config.yaml"


# ---- running the suite on two workers (pytest-xdist) -----------------------------------------------
# Each test module is one unit of work, so its module fixtures run once; modules that share a
# session fixture, or the one local Slurm cluster, form one unit together. Units start longest
# first: the Slurm tests mostly wait for the scheduler's status checks and the chaos run keeps
# both cores busy, so the two overlap instead of adding up.
SHARED_UNITS = {
    "slurm": "slurm",  # tests/slurm/*: one slurmctld per session
    "test_workflow": "finished_tiny_run",
    "test_recon": "finished_tiny_run",
}
LONGEST_FIRST = ["slurm", "test_chaos", "test_e2e_smollm2", "finished_tiny_run", "test_regenerate",
                 "test_sglang_service", "test_sglang_launch", "test_train", "test_evaluate", "test_evaluate_sglang", "test_export"]


def work_unit(path: str | Path) -> str:
    path = Path(path)
    if path.parent.name == "slurm":
        return SHARED_UNITS["slurm"]
    return SHARED_UNITS.get(path.stem, path.stem)


# ---- tiers ------------------------------------------------------------------------------------------
# unit: in-process, tiny models (`pytest -m unit`, the fast tier); integration: real processes —
# servers, torchrun, benchmark scripts, torch.compile, a wheel build; workflow: the Snakefile —
# Snakemake, Slurm, chaos, the peer environment, the real SmolLM2. A test without a tier mark is
# a unit test; one that runs Snakemake without the workflow mark fails (run_snakemake).
MARKED_TIERS = ("integration", "workflow")


def tier_of(item) -> str:
    return next((tier for tier in MARKED_TIERS if item.get_closest_marker(tier)), "unit")


def pytest_runtest_setup(item):
    os.environ["EAGLENEST_TEST_TIER"] = tier_of(item)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if tier_of(item) == "unit":
            item.add_marker(pytest.mark.unit)
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(work_unit(item.path), len(rank)), order[id(item)]))


def pytest_xdist_make_scheduler(config, log):
    """Whole units to a worker, in the order collection put them (--no-loadscope-reorder)."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid.split("::", 1)[0])

    return UnitScheduling(config, log)


@pytest.fixture(scope="module")
def sglang_standin():
    """The launcher starts the stand-in server in place of SGLang (EAGLENEST_SGLANG_COMMAND),
    for the module's tests and the workflows they run."""
    from eaglenest.sglang import launch
    from support import STANDIN_COMMAND

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(launch.SERVER_COMMAND_ENV, STANDIN_COMMAND)
        yield STANDIN_COMMAND


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny.make_tiny_target(tmp_path_factory.mktemp("tiny-llama") / "model", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return tiny.make_tiny_target(tmp_path_factory.mktemp("tiny-qwen2") / "model", arch="qwen2")


@pytest.fixture(scope="session")
def finished_tiny_run(tmp_path_factory, tiny_llama) -> tuple[Path, Path]:
    """The tiny workflow run to the end (4 hidden shards, trained, exported, evaluated): one
    run for test_workflow and test_recon, whose tests only read it or work on copies."""
    workdir = tmp_path_factory.mktemp("finished")
    conversations = synthetic_conversations(workdir / "conversations.jsonl", 40)
    configfile = tiny_workflow_config(workdir, tiny_llama, conversations)
    run_snakemake(workdir, configfile, "--cores", "2")
    return workdir, configfile


def wait_until(predicate, timeout: float, interval: float = 0.2) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def synthetic_conversations(path: Path, count: int, seed: int = 0, id_prefix: str = "c") -> Path:
    """A JSONL file of OpenAI-style multi-turn conversations with stable ids."""
    return tiny.synthetic_conversations(path, count, seed, id_prefix)


def share_resources(workdir: Path) -> None:
    """Let a test workdir use the checkout's resources/ (fetched wheels, converted model)."""
    (REPO / "resources").mkdir(exist_ok=True)
    link = workdir / "resources"
    if not link.exists() and not link.is_symlink():
        link.symlink_to(REPO / "resources")


def tiny_workflow_config(workdir: Path, target: Path, conversations: Path, **sections) -> Path:
    """Write a config for the tiny target into ``workdir``; ``sections`` update top-level keys."""
    config = tiny.workflow_config(yaml.safe_load(DEFAULT_CONFIG.read_text()), target, conversations)
    share_resources(workdir)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def snakemake_command(workdir: Path, configfile: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "snakemake",
        "--snakefile", str(SNAKEFILE),
        "--directory", str(workdir),
        "--configfile", str(configfile),
        *args,
    ]


def run_snakemake(workdir: Path, configfile: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    if os.environ.get("EAGLENEST_TEST_TIER") not in (None, "workflow"):
        raise AssertionError("this test runs Snakemake: mark it @pytest.mark.workflow (tests/conftest.py, tiers)")
    args = args or ("--cores", "2")
    result = subprocess.run(
        snakemake_command(workdir, configfile, *args),
        capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake failed ({result.returncode}):\n{result.stdout[-5000:]}\n{result.stderr[-8000:]}")
    return result


def planned_jobs(workdir: Path, configfile: Path, *extra: str, options: tuple[str, ...] = ()) -> dict[str, int]:
    """Rule name -> job count that ``snakemake -n`` plans (empty when nothing is to be done);
    ``extra``: targets, ``options``: more command-line options."""
    result = run_snakemake(workdir, configfile, "-n", *options, "--quiet", "rules", "--", *extra)
    counts = {}
    for line in (result.stdout + result.stderr).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job", "all"):
            counts[parts[0]] = int(parts[1])
    return counts
