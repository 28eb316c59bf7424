"""Shared fixtures: tiny random-weight targets, synthetic conversations, workflow runs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEFILE = REPO / "Snakefile"
DEFAULT_CONFIG = REPO / "config" / "config.yaml"
WORDS = (
    "the quick brown fox jumps over lazy dog hello world capital France Paris add "
    "return speculative decoding draft target model verify token"
).split()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from eaglenest import tiny

    return tiny.make_tiny_target(tmp_path_factory.mktemp("tiny-llama") / "model", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    from eaglenest import tiny

    return tiny.make_tiny_target(tmp_path_factory.mktemp("tiny-qwen2") / "model", arch="qwen2")


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
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(count):
            messages = []
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 20)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))})
            handle.write(json.dumps({"id": f"{id_prefix}{i}", "messages": messages}) + "\n")
    return path


# Training and evaluation settings that take seconds on the tiny target.
TINY_TRAIN = {"epochs": 1, "token_budget": 256, "rows_per_step": 2, "ttt_length": 2, "warmup_steps": 1, "threads": 1, "checkpoint_every": 5}
TINY_EVALUATE = {"sets": ["mt_bench"], "num_prompts": 1, "max_new_tokens": 4, "drafting": [{"steps": 2, "topk": 1, "tokens": 3}], "threads": 1}


def share_resources(workdir: Path) -> None:
    """Let a test workdir use the checkout's resources/ (fetched wheels, converted model)."""
    (REPO / "resources").mkdir(exist_ok=True)
    link = workdir / "resources"
    if not link.exists() and not link.is_symlink():
        link.symlink_to(REPO / "resources")


def tiny_workflow_config(workdir: Path, target: Path, conversations: Path, **sections) -> Path:
    """Write a config for the tiny target into ``workdir``; ``sections`` update top-level keys."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["run"] = "tiny"
    config["target"] = {
        "name": "tiny-llama",
        "path": str(target),
        "embedded": None,
        "num_layers": 6,
        "hidden_size": 64,
        "vocab_size": 320,
    }
    config["data"].update(
        sources=[{"name": "synthetic", "path": str(conversations)}],
        max_conversations=40,
        samples_per_shard=10,
        max_len=256,
    )
    config["extract"].update(disk_reserve_mb=0, threads=1, tokens_per_batch=2048)
    config["consolidate"]["draft_vocab_size"] = 64
    config["train"] = dict(config.get("train", {}), **TINY_TRAIN)
    config["evaluate"] = dict(config.get("evaluate", {}), **TINY_EVALUATE)
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
    args = args or ("--cores", "2")
    result = subprocess.run(
        snakemake_command(workdir, configfile, *args),
        capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake failed ({result.returncode}):\n{result.stdout[-5000:]}\n{result.stderr[-8000:]}")
    return result


def planned_jobs(workdir: Path, configfile: Path, *extra: str) -> dict[str, int]:
    """Rule name -> job count that ``snakemake -n`` plans (empty when nothing is to be done)."""
    result = run_snakemake(workdir, configfile, "-n", "--quiet", "rules", "--", *extra)
    counts = {}
    for line in (result.stdout + result.stderr).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job", "all"):
            counts[parts[0]] = int(parts[1])
    return counts
