import os
import stat

import pytest
import torch

from eaglenest.formats import shards


def make_hidden_shard(tmp_path, name="shard-00000.safetensors", samples=3, hidden=8):
    counts = [5, 3, 7][:samples]
    prepared_path = tmp_path / "prepared" / name
    rows = [
        {"sample_id": f"s:{i}", "input_ids": list(range(10 + i, 10 + i + n)), "loss_mask": [0, 1] * (n // 2) + [1] * (n % 2)}
        for i, n in enumerate(counts)
    ]
    shards.write_prepared_shard(prepared_path, 0, rows, {"target": "t", "max_len": 16})
    prepared = shards.ShardReader.open(prepared_path)
    total = sum(counts)
    torch.manual_seed(0)
    aux = torch.randn(total, 3 * hidden).to(torch.bfloat16)
    last = torch.randn(total, hidden).to(torch.bfloat16)
    path = tmp_path / "hidden" / name
    meta = {"target": "t", "target_hidden_size": hidden, "layer_ids": [2, 3, 4], "dtype": "bfloat16"}
    shards.write_hidden_shard(path, prepared, aux, last, meta)
    return path, aux, last


def test_hidden_shard_round_trip_keeps_tensors_and_header(tmp_path):
    path, aux, last = make_hidden_shard(tmp_path)
    reader = shards.verify_shard(path, deep=True, expect={"layer_ids": [2, 3, 4], "target": "t"})
    tensors = reader.tensors()
    assert torch.equal(tensors["aux_hidden"], aux) and torch.equal(tensors["last_hidden"], last)
    assert reader.sample_ids == ["s:0", "s:1", "s:2"] and reader.token_counts == [5, 3, 7]
    assert tensors["offsets"].tolist() == [0, 5, 8, 15]
    assert reader.metadata["kind"] == "hidden" and reader.metadata["format_version"] == shards.FORMAT_VERSION
    assert list(tmp_path.glob("**/*.tmp-*")) == []


def test_flipped_byte_is_found_by_the_deep_check_only(tmp_path):
    path, _, _ = make_hidden_shard(tmp_path)
    infos, _ = shards.read_header(path)
    data = bytearray(path.read_bytes())
    data[infos["last_hidden"]["file_offset"] + 7] ^= 0x01
    path.write_bytes(bytes(data))
    shards.verify_shard(path, deep=False)
    with pytest.raises(shards.ShardError, match="checksum mismatch in last_hidden"):
        shards.verify_shard(path, deep=True)


def test_truncated_file_is_found_by_the_fast_check(tmp_path):
    path, _, _ = make_hidden_shard(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(shards.ShardError, match="truncated"):
        shards.verify_shard(path, deep=False)
    path.write_bytes(data[:5])
    with pytest.raises(shards.ShardError, match="shorter than a safetensors header"):
        shards.verify_shard(path, deep=False)


def test_zero_filled_header_is_rejected(tmp_path):
    path, _, _ = make_hidden_shard(tmp_path)
    data = bytearray(path.read_bytes())
    data[8:200] = bytes(192)
    path.write_bytes(bytes(data))
    with pytest.raises(shards.ShardError):
        shards.verify_shard(path, deep=False)


def test_header_mismatch_with_expected_layers_is_reported(tmp_path):
    path, _, _ = make_hidden_shard(tmp_path)
    with pytest.raises(shards.ShardError, match="layer_ids"):
        shards.verify_shard(path, deep=False, expect={"layer_ids": [1, 2, 3]})


def test_non_finite_hidden_values_are_rejected(tmp_path):
    prepared_path = tmp_path / "p.safetensors"
    shards.write_prepared_shard(prepared_path, 0, [{"sample_id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]}], {})
    aux = torch.zeros(2, 6, dtype=torch.bfloat16)
    aux[1, 2] = float("nan")
    path = tmp_path / "h.safetensors"
    meta = {"target": "t", "target_hidden_size": 2, "layer_ids": [0, 1, 2], "dtype": "bfloat16"}
    shards.write_hidden_shard(path, shards.ShardReader.open(prepared_path), aux, torch.zeros(2, 2, dtype=torch.bfloat16), meta)
    with pytest.raises(shards.ShardError, match="non-finite"):
        shards.verify_shard(path)


def test_empty_shard_is_valid(tmp_path):
    path = tmp_path / "empty.safetensors"
    shards.write_prepared_shard(path, 3, [], {})
    reader = shards.verify_shard(path)
    assert reader.sample_ids == [] and reader.num_tokens == 0


def test_bytes_per_token_matches_the_planner():
    from eaglenest import plan

    assert shards.hidden_bytes_per_token(576, 3, "bfloat16") == plan.bytes_per_token(576, 3, "bfloat16") == 4613
    assert plan.bytes_per_token(7168, 3, "bfloat16") == 57349


def test_finite_check_finds_fp8_nan_patterns_and_bf16_infinities_in_any_chunk():
    values = torch.randn(1000, 8)
    fp8 = values.to(torch.float8_e4m3fn)
    assert shards.all_finite(fp8, rows_per_chunk=64)
    for pattern in (0x7F, 0xFF):  # e4m3fn's only NaNs, positive and negative
        damaged = fp8.clone()
        damaged.view(torch.uint8)[777, 3] = pattern
        assert not shards.all_finite(damaged, rows_per_chunk=64)
    bf16 = values.to(torch.bfloat16)
    assert shards.all_finite(bf16, rows_per_chunk=64)
    bf16[999, 7] = float("inf")
    assert not shards.all_finite(bf16, rows_per_chunk=64)


def test_a_starting_job_removes_only_its_own_stale_temps(tmp_path):
    """Shard jobs share a directory: one job's cleanup must not delete the file another
    job is writing at that moment (seen with 8 extraction jobs on one node)."""
    from eaglenest.formats import atomic

    mine = tmp_path / f"shard-00001.safetensors{atomic.TMP_MARKER}111"
    running = tmp_path / f"shard-00002.safetensors{atomic.TMP_MARKER}222"
    for path in (mine, running):
        path.write_bytes(b"partial")
    assert atomic.remove_stale_temps(tmp_path, "shard-00001.safetensors") == [mine]
    assert running.exists() and not mine.exists()


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_a_published_shard_has_the_mode_the_umask_gives_not_safetensors_0600(tmp_path, mask):
    from eaglenest.formats import atomic
    from safetensors.torch import save_file

    previous = os.umask(mask)
    try:
        assert atomic.umask() == mask
        with atomic.atomic_path(tmp_path / "x.safetensors") as tmp:
            save_file({"a": torch.zeros(2)}, str(tmp))
        atomic.write_text(tmp_path / "x.json", "{}")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "x.json").stat().st_mode) == 0o666 & ~mask
