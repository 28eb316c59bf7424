"""Logging for jobs that Snakemake runs through ``script:``: everything goes to the rule's log."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


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
