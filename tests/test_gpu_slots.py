"""The GPU slot pool, with fake device ids and real processes (no GPU needed)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eaglenest.node import gpu_slots

# A job: take a slot of the pool, record which device it saw and when, hold it a while.
JOB = """
import json, os, sys, time
from eaglenest.node import gpu_slots
lock_dir, devices, record, hold_s = sys.argv[1], sys.argv[2].split(","), sys.argv[3], float(sys.argv[4])
with gpu_slots.gpu_slots(1, devices, lock_dir):
    start = time.monotonic()
    time.sleep(hold_s)
    seen = os.environ["CUDA_VISIBLE_DEVICES"]
    end = time.monotonic()
with open(record, "a") as handle:
    handle.write(json.dumps({"device": seen, "start": start, "end": end}) + "\\n")
"""

# A holder that reports once it holds its slot, then sleeps until killed.
HOLDER = """
import sys, time
from eaglenest.node import gpu_slots
slots = gpu_slots.acquire(1, sys.argv[2].split(","), sys.argv[1])
print(slots.cuda_visible_devices, flush=True)
time.sleep(600)
"""


@pytest.mark.integration
def test_jobs_never_share_a_slot_and_all_of_them_run(tmp_path):
    devices = ["0", "1"]
    record = tmp_path / "record.jsonl"
    jobs = [
        subprocess.Popen([sys.executable, "-c", JOB, str(tmp_path / "locks"), ",".join(devices), str(record), "0.4"])
        for _ in range(5)
    ]
    assert [job.wait(timeout=60) for job in jobs] == [0] * 5
    runs = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(runs) == 5
    assert {run["device"] for run in runs} <= set(devices)
    for device in devices:
        spans = sorted((r["start"], r["end"]) for r in runs if r["device"] == device)
        for (_, end), (next_start, _) in zip(spans, spans[1:]):
            assert next_start >= end, f"two jobs held GPU {device} at once: {spans}"
    # Two slots, five jobs of 0.4 s: both slots were used at the same time.
    assert len({run["device"] for run in runs}) == 2


@pytest.mark.integration
def test_a_slot_held_by_a_killed_job_is_free_again(tmp_path):
    lock_dir = tmp_path / "locks"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_dir), "7"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "7"
        with pytest.raises(gpu_slots.NoFreeSlotError, match="no 1 free GPU slot"):
            gpu_slots.acquire(1, ["7"], lock_dir, timeout_s=0.5)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    started = time.monotonic()
    slots = gpu_slots.acquire(1, ["7"], lock_dir, timeout_s=5)
    assert slots.devices == ["7"] and time.monotonic() - started < 2
    slots.release()


def test_a_busy_device_is_skipped_and_visible_devices_are_exported(tmp_path, monkeypatch):
    lock_dir = tmp_path / "locks"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    first = gpu_slots.acquire(1, None, lock_dir)  # the pool is the parent's CUDA_VISIBLE_DEVICES
    assert first.devices == ["4"]
    with gpu_slots.gpu_slots(2, None, lock_dir, timeout_s=1) as slots:
        assert slots.devices == ["5", "6"]
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"
    first.release()


def test_waiting_for_two_slots_holds_none_meanwhile(tmp_path):
    lock_dir = tmp_path / "locks"
    busy = gpu_slots.acquire(1, ["0"], lock_dir)
    with pytest.raises(gpu_slots.NoFreeSlotError):
        gpu_slots.acquire(2, ["0", "1"], lock_dir, timeout_s=0.3)
    # The waiter gave device 1 back, so a one-GPU job still gets it.
    single = gpu_slots.acquire(1, ["0", "1"], lock_dir, timeout_s=0.3)
    assert single.devices == ["1"]
    single.release()
    busy.release()


def test_asking_for_more_gpus_than_the_pool_has_is_refused(tmp_path):
    with pytest.raises(ValueError, match="pool has 2"):
        gpu_slots.acquire(3, ["0", "1"], tmp_path)


@pytest.mark.integration
def test_command_line_runs_a_command_on_a_held_slot(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "eaglenest.node.gpu_slots", "--devices", "3", "--lock-dir", str(tmp_path), "--",
         sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "3"


def test_each_slurm_allocation_has_its_own_pool(monkeypatch, tmp_path):
    monkeypatch.delenv(gpu_slots.LOCK_DIR_ENV, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert gpu_slots.default_lock_dir().name == "eaglenest-gpu-slots-slurm-4242"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert gpu_slots.default_lock_dir().name == "eaglenest-gpu-slots"
    monkeypatch.setenv(gpu_slots.LOCK_DIR_ENV, str(tmp_path))
    assert gpu_slots.default_lock_dir() == tmp_path


def test_a_client_job_that_counts_no_threads_gets_one_for_openmp(monkeypatch):
    from eaglenest.node import joblog

    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    monkeypatch.setenv("MKL_NUM_THREADS", "0")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    joblog.threads_at_least_one()
    assert [os.environ[v] for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")] == ["1", "1", "4"]
