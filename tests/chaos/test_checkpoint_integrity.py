"""Training checkpoints under faults, in seconds: corrupt files are skipped by name, a full
disk fails naming the file and leaves nothing a resume would read.

The whole-workflow versions are in the chaos harness (test_chaos.py).
"""

import json
import os
import subprocess

import pytest
import torch

from eaglenest.formats import atomic
from eaglenest.training import checkpoints


def state(step: int, side: int = 8) -> dict:
    return {"format": checkpoints.CHECKPOINT_FORMAT, "fingerprint": "f", "step": step,
            "weights": torch.arange(side * side, dtype=torch.float32).view(side, side) + step}


def save_steps(directory, steps, keep=2):
    directory.mkdir(exist_ok=True)
    for step in steps:
        checkpoints.save_checkpoint(directory, state(step), keep)


def test_every_kept_checkpoint_has_the_checksum_of_its_bytes(tmp_path):
    save_steps(tmp_path / "ck", [3, 6, 9])
    kept = checkpoints.checkpoint_paths(tmp_path / "ck")
    assert [p.name for p in kept] == ["step-00000006.pt", "step-00000009.pt"]
    recorded = json.loads((tmp_path / "ck" / checkpoints.CHECKSUMS_NAME).read_text())
    assert all(recorded[p.name] == checkpoints.file_sha256(p) for p in kept)
    assert checkpoints.load_latest_checkpoint(tmp_path / "ck", "f")["step"] == 9


@pytest.mark.parametrize("damage", ["flip_one_bit_in_tensor_data", "truncate", "zero_fill"])
def test_a_corrupt_newest_checkpoint_is_named_and_the_one_before_it_is_resumed(tmp_path, caplog, damage):
    save_steps(tmp_path / "ck", [3, 6])
    newest = tmp_path / "ck" / "step-00000006.pt"
    data = bytearray(newest.read_bytes())
    if damage == "flip_one_bit_in_tensor_data":
        data[data.index(state(6)["weights"].numpy().tobytes()) + 5] ^= 0x01
    elif damage == "truncate":
        del data[len(data) // 2 :]
    else:
        start = len(data) // 3
        data[start : start + 4096] = bytes(min(4096, len(data) - start))
    newest.write_bytes(bytes(data))
    if damage == "flip_one_bit_in_tensor_data":  # torch.load alone would take it
        assert torch.load(newest, weights_only=False)["step"] == 6
    resumed = checkpoints.load_latest_checkpoint(tmp_path / "ck", "f")
    assert resumed["step"] == 3 and torch.equal(resumed["weights"], state(3)["weights"])
    assert f"not resuming from checkpoint {newest}: corrupt" in caplog.text


def test_a_checkpoint_without_a_recorded_checksum_is_not_resumed(tmp_path):
    save_steps(tmp_path / "ck", [3])
    torch.save(state(6), tmp_path / "ck" / "step-00000006.pt")  # not through save_checkpoint
    assert checkpoints.load_latest_checkpoint(tmp_path / "ck", "f")["step"] == 3


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_while_checkpointing_names_the_file_and_keeps_the_last_good_one(tmp_path):
    directory = tmp_path / "ck"
    directory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(directory)], check=True)
    try:
        checkpoints.save_checkpoint(directory, state(3), 2)
        # torch's own writer reports this as "unexpected pos ..."; the message must say disk full.
        with pytest.raises(atomic.DiskFullError, match=r"disk full while writing \S+/step-00000006\.pt \([\d,]+ bytes free"):
            checkpoints.save_checkpoint(directory, state(6, side=256), 2)
        assert sorted(p.name for p in directory.iterdir()) == [checkpoints.CHECKSUMS_NAME, "step-00000003.pt"]
        assert checkpoints.load_latest_checkpoint(directory, "f")["step"] == 3
    finally:
        # Lazy: a failing torch.save's traceback may still hold the partial file open.
        subprocess.run(["umount", "--lazy", str(directory)], check=True)
