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
