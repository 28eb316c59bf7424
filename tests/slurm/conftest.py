"""The session's single-node Slurm (see local_slurm.py): started once, stopped by pid at the end."""

from __future__ import annotations

import os

import pytest

from . import local_slurm


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld/slurmd and writing /etc/slurm/slurm.conf needs root")
    missing = local_slurm.missing_daemons()
    if "slurmctld" in missing:
        pytest.skip("slurmctld is not installed: run .ci/slurm-setup.sh (apt-get installs slurm-wlm and munge)")
    if missing:
        pytest.fail(f"Slurm is partly installed, missing {missing}: run .ci/slurm-setup.sh")
    cluster = local_slurm.LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
