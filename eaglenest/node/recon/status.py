"""What every recon check returns: the statuses, the error recon stops on, the checkout it reads."""

from __future__ import annotations

from pathlib import Path


OK, WARN, BLOCK, NA = "ok", "warn", "block", "not applicable"
REPO = Path(__file__).resolve().parents[3]  # the checkout: eaglenest/node/recon/ is three below


class ReconError(Exception):
    """Bad input for recon (e.g. an invalid config); the CLI exits 2 with the message."""
