#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv with the pinned software.
# torch comes first as the CPU wheel: an unpinned torch would pull several GB of CUDA.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e '.[test]'
