"""A real small filesystem (tmpfs mounted by the test) fills up during extraction."""

import os
import subprocess

import pytest

from eaglenest.formats import atomic, shards
from eaglenest.stages import extract, shard_driver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], check=True)
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


@pytest.fixture
def big_prepared_shard(tmp_path):
    # 3,000 tokens x 517 B/token (tiny target, H=64) = 1.5 MB: more than the 1 MB disk.
    rows = [{"sample_id": f"s:{i}", "input_ids": [5 + (j % 200) for j in range(300)], "loss_mask": [1] * 300} for i in range(10)]
    path = tmp_path / "prepared" / "shard-00000.safetensors"
    shards.write_prepared_shard(path, 0, rows, {"target": "tiny"})
    return path


@pytest.mark.integration
def test_preflight_refuses_with_needed_and_free_bytes(small_disk, big_prepared_shard, tiny_llama):
    hidden = small_disk / "hidden" / "shard-00000.safetensors"
    with pytest.raises(shard_driver.InsufficientDiskError) as error:
        extract.extract_shard(big_prepared_shard, hidden, tiny_llama, "tiny", "default", device="cpu")
    message = str(error.value)
    needed = 3000 * shards.hidden_bytes_per_token(64, 3, "bfloat16")
    assert f"need {needed:,} bytes" in message and "bytes free" in message
    assert list(hidden.parent.iterdir()) == []


@pytest.mark.integration
def test_disk_full_during_write_leaves_no_partial_shard(small_disk, big_prepared_shard, tiny_llama):
    hidden = small_disk / "hidden" / "shard-00000.safetensors"
    with pytest.raises(atomic.DiskFullError, match="disk full while writing .*shard-00000.safetensors"):
        extract.extract_shard(big_prepared_shard, hidden, tiny_llama, "tiny", "default", device="cpu", check_disk=False)
    assert list(hidden.parent.iterdir()) == []


def test_stale_temp_files_of_a_killed_writer_are_removed_on_the_next_run(tmp_path):
    directory = tmp_path / "hidden"
    directory.mkdir()
    leftover = directory / f"shard-00003.safetensors{atomic.TMP_MARKER}4242"
    leftover.write_bytes(b"partial")
    keep = directory / "shard-00001.safetensors"
    keep.write_bytes(b"done")
    assert atomic.remove_stale_temps(directory) == [leftover]
    assert sorted(p.name for p in directory.iterdir()) == ["shard-00001.safetensors"]
