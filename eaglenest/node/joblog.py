"""Logging for jobs that Snakemake runs through ``script:``: everything goes to the rule's log."""

from __future__ import annotations

import logging
import sys
import os
from pathlib import Path


def threads_at_least_one() -> None:
    """A client of a server counts no threads (rules/common.smk, extract_threads), which
    Snakemake exports as OMP_NUM_THREADS=0 and the like; OpenMP rejects 0 loudly. Call
    before torch is imported."""
    for variable, value in list(os.environ.items()):
        if variable.endswith("_THREADS") and value == "0":
            os.environ[variable] = "1"


def to_file(log_path: str):
    """Send logging, warnings and stderr to ``log_path``; returns the open stream (for tqdm)."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    stream = open(log_path, "a", buffering=1, encoding="utf-8")
    sys.stderr = stream
    logging.basicConfig(
        stream=stream,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    logging.captureWarnings(True)
    return stream


def to_console(message: str) -> None:
    """A warning that also reaches the Snakemake console, not only the job's log: to_file
    sends stderr to the log, the interpreter's own stderr is still the console's."""
    logging.getLogger("eaglenest").warning(message)
    print(f"eaglenest: {message}", file=sys.__stderr__, flush=True)
