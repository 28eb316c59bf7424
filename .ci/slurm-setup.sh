#!/usr/bin/env bash
# Installs a single-node Slurm (Debian's slurm-wlm) and munge so that tests/slurm/ can start
# slurmctld + slurmd themselves. Idempotent: does nothing when both are already installed.
# The daemons are not started here: the test fixture writes /etc/slurm/slurm.conf, starts
# them and stops them by pid when the tests end.
set -euo pipefail

if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    echo "slurm-setup: slurmctld, slurmd and munged already installed"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "slurm-setup: needs root to apt-get install slurm-wlm munge" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq slurm-wlm munge >/dev/null
# The package creates the munge key; the test fixture refuses to start without one.
test -s /etc/munge/munge.key
echo "slurm-setup: installed $(slurmctld -V)"
