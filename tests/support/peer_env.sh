#!/usr/bin/env bash
# Build the virtual environment that holds the independent EAGLE-3 implementation
# (speculators) used by tests/test_export_peer.py to cross-check our vLLM export.
#
# It lives outside the project's own environment on purpose: speculators pins
# transformers<=5.19 and pulls torchvision/torchaudio, none of which eaglenest wants.
#
# Idempotent and cache-friendly: a finished environment carries a stamp naming the exact
# pins; a second call with the same pins returns at once. A half-built environment (no
# stamp, e.g. after a killed install) is removed and built again.
#
#   EAGLENEST_PEER_VENV   where to build it (default ~/.cache/eaglenest/peer-speculators-0.9.0)
#   EAGLENEST_PEER_PYTHON interpreter to build it with (default python3)
# Prints the environment's python path on its last line.
set -euo pipefail

PINS="torch==2.13.0 transformers==5.19.0 speculators==0.9.0"
VENV="${EAGLENEST_PEER_VENV:-${HOME}/.cache/eaglenest/peer-speculators-0.9.0}"
PYTHON="${EAGLENEST_PEER_PYTHON:-python3}"
STAMP="${VENV}/.eaglenest-peer-complete"

if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${PINS}" && -x "${VENV}/bin/python" ]]; then
    echo "${VENV}/bin/python"
    exit 0
fi

rm -rf "${VENV}"
mkdir -p "$(dirname "${VENV}")"
"${PYTHON}" -m venv "${VENV}"
"${VENV}/bin/python" -m pip install --quiet --upgrade pip >&2
# One resolver run, so pip picks the torchvision/torchaudio that speculators names
# beside this torch; both are then removed: they fail to import beside the CPU
# torch 2.13 wheel and the cross-check never needs them.
# shellcheck disable=SC2086
"${VENV}/bin/python" -m pip install --quiet ${PINS} >&2
"${VENV}/bin/python" -m pip uninstall --yes torchvision torchaudio >&2
# The stamp is written only once the peer model really imports.
"${VENV}/bin/python" -c "from speculators.models.eagle3 import Eagle3DraftModel" >&2
echo "${PINS}" > "${STAMP}"
echo "${VENV}/bin/python"
