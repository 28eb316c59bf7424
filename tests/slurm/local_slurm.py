"""A real single-node Slurm for the tests: munged, slurmctld and slurmd started from a
test-owned slurm.conf and stopped by pid.

The node pretends to be one 8-GPU node of a production cluster: `SlurmdParameters=
config_overrides` lets slurmd accept the configured CPUs and memory although the machine
has fewer, and the 8 GPUs are gres entries whose device files are symlinks to /dev/null
(a count-only gres drains the node). Slurm schedules against them and sets
CUDA_VISIBLE_DEVICES per job as it would on real GPUs; with task/none nothing is enforced,
so the tiny jobs simply share the real cores.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from conftest import wait_until

# The plugin's job step strips SLURM_CONF before its inner srun, so the configuration has
# to be where every Slurm command looks by default.
SLURM_CONF = Path("/etc/slurm/slurm.conf")
GRES_CONF = Path("/etc/slurm/gres.conf")
OWNER_MARK = "# written by eaglenest tests/slurm/local_slurm.py"
# Jobs go to the GPU partition only when EAGLENEST_SLURM_PARTITION says so: the default
# partition is another one, so a test sees whether the profile read the environment.
PARTITION = "gpu"
DEFAULT_PARTITION = "cpu"
NODE_GPUS = 8
NODE_CPUS = 128
NODE_MEMORY_MB = 1_900_000  # an 8-GPU H200 node's host memory, roughly


def missing_daemons() -> list[str]:
    return [name for name in ("munged", "slurmctld", "slurmd", "sbatch", "squeue") if shutil.which(name) is None]


# MinJobAge: slurmctld remembers a finished job for an hour (the default is 5 minutes), so a
# test run through Slurm that takes longer on a busy machine still finds all of its jobs.
def slurm_conf_text(node: str, state_dir: Path) -> str:
    return f"""{OWNER_MARK}
ClusterName=eaglenest-test
SlurmctldHost={node}
SlurmUser=root
AuthType=auth/munge
StateSaveLocation={state_dir}/ctld
SlurmdSpoolDir={state_dir}/spool
SlurmctldPidFile={state_dir}/slurmctld.pid
SlurmdPidFile={state_dir}/slurmd.pid
SlurmctldLogFile={state_dir}/slurmctld.log
SlurmdLogFile={state_dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
DefMemPerCPU=1000
GresTypes=gpu
ReturnToService=2
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
MinJobAge=3600
NodeName={node} CPUs={NODE_CPUS} RealMemory={NODE_MEMORY_MB} Gres=gpu:{NODE_GPUS} State=UNKNOWN
PartitionName={DEFAULT_PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP
PartitionName={PARTITION} Nodes={node} Default=NO MaxTime=INFINITE State=UP
"""


def gres_conf_text(node: str, device_dir: Path) -> str:
    return f"{OWNER_MARK}\nAutoDetect=off\nNodeName={node} Name=gpu File={device_dir}/nvidia[0-{NODE_GPUS - 1}]\n"


@dataclass
class LocalSlurm:
    state_dir: Path
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    replaced_configs: dict[Path, bytes] = field(default_factory=dict)

    def start(self, timeout: float = 60) -> None:
        if self._controller_answers():
            raise RuntimeError("a Slurm controller already answers on this machine; stop it before the tests")
        self._write_configs()
        self._start_munged()
        logs = self.state_dir
        self.processes["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i"], stdout=open(logs / "slurmctld.out", "w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes["slurmd"] = subprocess.Popen(
            ["slurmd", "-D"], stdout=open(logs / "slurmd.out", "w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.daemon_logs()}")
            if self.node_state() == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the node never became idle (state {self.node_state()!r}):\n{self.daemon_logs()}")

    def stop(self) -> None:
        # Jobs first, so no job step outlives the daemons that could clean it up.
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            pending = [line.split()[0] for line in self.queue()]
            if pending:
                subprocess.run(["scancel", *pending], capture_output=True, timeout=30)
                wait_until(lambda: not self.queue(), timeout=30)
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for path, content in self.replaced_configs.items():
            path.write_bytes(content)
        for path in (SLURM_CONF, GRES_CONF):
            if path not in self.replaced_configs and path.exists() and path.read_text().startswith(OWNER_MARK):
                path.unlink()

    def node_state(self) -> str:
        result = subprocess.run(["sinfo", "--noheader", "--format=%T", f"--nodes={self.node}", f"--partition={PARTITION}"],
                                capture_output=True, text=True, timeout=10)
        return result.stdout.strip() if result.returncode == 0 else ""

    def queue(self) -> list[str]:
        result = subprocess.run(["squeue", "--noheader", "--format=%i %T %j"], capture_output=True, text=True, timeout=10)
        return result.stdout.split("\n")[:-1] if result.returncode == 0 else []

    def daemon_logs(self, tail: int = 40) -> str:
        text = []
        for name in ("munged.out", "slurmctld.out", "slurmctld.log", "slurmd.out", "slurmd.log"):
            path = self.state_dir / name
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                text.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(text)

    def _controller_answers(self) -> bool:
        if not SLURM_CONF.exists():
            return False
        result = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
        return "UP" in result.stdout

    def _write_configs(self) -> None:
        for sub in ("ctld", "spool", "devices"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        devices = self.state_dir / "devices"
        for index in range(NODE_GPUS):
            link = devices / f"nvidia{index}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        for path, text in ((SLURM_CONF, slurm_conf_text(self.node, self.state_dir)), (GRES_CONF, gres_conf_text(self.node, devices))):
            if path.exists() and not path.read_text().startswith(OWNER_MARK):
                self.replaced_configs[path] = path.read_bytes()
            path.write_text(text)

    def _start_munged(self) -> None:
        if not Path("/etc/munge/munge.key").exists():
            raise RuntimeError("/etc/munge/munge.key is missing: run .ci/slurm-setup.sh")
        munge = pwd.getpwnam("munge")
        # Slurm's clients look for the default socket, which munged makes under /run/munge.
        run_dir = Path("/run/munge")
        run_dir.mkdir(exist_ok=True)
        os.chown(run_dir, munge.pw_uid, munge.pw_gid)
        for sub in ("/var/lib/munge", "/var/log/munge"):
            Path(sub).mkdir(exist_ok=True)
            os.chown(sub, munge.pw_uid, munge.pw_gid)
        self.processes["munged"] = subprocess.Popen(
            ["munged", "--foreground", "--force"], user=munge.pw_uid, group=munge.pw_gid, extra_groups=[],
            stdout=open(self.state_dir / "munged.out", "w"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        if not wait_until(lambda: Path("/run/munge/munge.socket.2").exists(), timeout=20):
            raise RuntimeError(f"munged did not start:\n{self.daemon_logs()}")


