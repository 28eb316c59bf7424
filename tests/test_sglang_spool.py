"""Spool files between the patched server and its client, the server's background writer,
and the client's batching of samples into requests."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.formats import shards
from eaglenest.sglang import client as sglang_client, patch as sglang_patch, spool
from eaglenest.stages import shard_driver


def test_a_spool_file_is_safetensors_and_reads_back_exactly(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "input_ids": torch.arange(5, dtype=torch.int64),
        "hidden": torch.randn(5, 32, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.float32),
    }
    path = tmp_path / "r-1.safetensors"
    spool.write_spool_file(path, tensors, {"rid": "r-1", "finite": "1"})
    read, metadata = spool.read_spool_file(path)
    assert metadata == {"rid": "r-1", "finite": "1"}
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor)
        # Any safetensors reader opens it.
        assert torch.equal(load_file(str(path))[name], tensor)
    assert [p.name for p in tmp_path.iterdir()] == ["r-1.safetensors"]  # no temp file left


def test_the_writer_waits_for_the_copy_checks_finiteness_and_writes_off_the_callers_thread(tmp_path):
    class SlowCopy:  # stands for the device-to-host copy's CUDA event
        def __init__(self):
            self.done = threading.Event()

        def synchronize(self):
            assert self.done.wait(5)

    copy, writer = SlowCopy(), spool.SpoolWriter(2)
    rows = torch.ones(3, 8)
    rows[1, 2] = float("nan")
    descriptor = sglang_patch.spool_prefill_rows(tmp_path, "r-2", [7, 8, 9], {"aux_hidden": rows[:, :6], "last_hidden": rows[:, 6:]},
                                                 writer, copy)
    # The descriptor is there at once; the file only once the copy is done.
    assert descriptor["num_tokens"] == 3 and not (tmp_path / "r-2.safetensors").exists()
    copy.done.set()
    path = spool.wait_for_spooled(descriptor["path"], timeout_s=5)
    _, metadata = spool.read_spool_file(path)
    assert metadata["finite"] == "0"


def test_a_write_that_fails_on_the_server_reaches_the_client_with_its_reason(tmp_path):
    writer = spool.SpoolWriter(1)
    blocked = tmp_path / "r-3.safetensors.tmp"
    blocked.mkdir()  # the temp name is taken by a directory: the server's write fails
    descriptor = sglang_patch.spool_prefill_rows(tmp_path, "r-3", [1, 2], {"aux_hidden": torch.zeros(2, 4), "last_hidden": torch.zeros(2, 2)},
                                                 writer)
    writer.flush()
    with pytest.raises(spool.SpoolError, match="could not write r-3.safetensors: IsADirectoryError"):
        spool.wait_for_spooled(descriptor["path"], timeout_s=5)
    started = time.monotonic()
    with pytest.raises(spool.SpoolError, match="did not appear within 0 s"):
        spool.wait_for_spooled(tmp_path / "never.safetensors", timeout_s=0.2)
    assert time.monotonic() - started < 2


def test_samples_go_to_requests_in_shard_order_bounded_by_samples_and_tokens():
    counts = [100, 200, 50, 5000, 10, 10, 10]
    assert sglang_client.request_groups(counts, samples_per_request=3, tokens_per_request=1000) == [[0, 1, 2], [3], [4, 5, 6]]
    assert sglang_client.request_groups(counts, samples_per_request=2, tokens_per_request=10**6) == [[0, 1], [2, 3], [4, 5], [6]]
    groups = sglang_client.request_groups(counts, samples_per_request=64, tokens_per_request=260)
    assert groups == [[0], [1, 2], [3], [4, 5, 6]]
    assert [i for group in groups for i in group] == list(range(len(counts)))


def test_requests_go_out_in_order_within_the_window_and_more_go_before_answers_are_handed_on():
    from concurrent.futures import ThreadPoolExecutor

    counts = [100, 100, 100, 300, 50, 50, 900, 10]
    groups = [[0], [1], [2], [3], [4, 5], [6], [7]]
    lock, in_flight, most, sent = threading.Lock(), [0], [0], []
    release = {number: threading.Event() for number in range(len(groups))}

    def call(group):
        tokens = sum(counts[i] for i in group)
        with lock:
            sent.append(group[0])
            in_flight[0] += tokens
            most[0] = max(most[0], in_flight[0])
        release[groups.index(group)].wait(5)
        with lock:
            in_flight[0] -= tokens
        return group

    with ThreadPoolExecutor(8) as pool:
        answers = sglang_client.windowed(pool, groups, counts, max_requests=3, max_tokens=400, call=call)
        handed_on = []
        for number in range(len(groups)):
            release[number].set()  # the server answers in the order it got them
            handed_on.append(next(answers).result())
            # The next request went out before this answer was handed on (its thread may
            # still be starting).
            deadline = time.monotonic() + 5
            while len(sent) < min(number + 2, len(groups)) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert len(sent) >= min(number + 2, len(groups))
        assert next(answers, None) is None
    assert handed_on == groups
    assert sent == [0, 1, 2, 3, 4, 6, 7]
    # 400 tokens at most, except the 900-token request, which goes alone.
    assert most[0] == 900
    with ThreadPoolExecutor(8) as pool:
        lock_free = sglang_client.windowed(pool, groups[:4], counts, max_requests=2, max_tokens=10**6, call=lambda g: g)
        assert [future.result() for future in lock_free] == groups[:4]


class _RowsBackend:
    """Answers a shard's samples in reverse order, the way a server's requests may finish."""

    device = torch.device("cpu")
    in_token_order = False

    def __init__(self, finite):
        self.finite = finite

    def target_shape(self):
        return 4, 8

    def start(self, layer_ids):
        pass

    def largest_answer(self, prepared):
        return max(prepared.token_counts)

    def hidden_states(self, prepared, layer_ids):
        offsets = prepared.tensor("offsets").tolist()
        for index in reversed(range(len(prepared.token_counts))):
            n = offsets[index + 1] - offsets[index]
            rows = torch.full((n, 8 * (len(layer_ids) + 1)), float(index), dtype=torch.bfloat16)
            yield shard_driver.StateRows(offsets[index], rows[:, :-8], rows[:, -8:], finite=self.finite)


def _prepared(tmp_path):
    path = tmp_path / "prepared" / "shard-00000.safetensors"
    path.parent.mkdir()
    rows = [{"sample_id": f"s:{i}", "input_ids": list(range(3 + i)), "loss_mask": [0] + [1] * (2 + i)} for i in range(4)]
    shards.write_prepared_shard(path, 0, rows, {"target": "tiny", "max_len": 64})
    return path


def test_answers_in_any_order_stream_into_the_same_shard_and_a_server_reported_nan_writes_nothing(tmp_path):
    prepared = _prepared(tmp_path)
    hidden = tmp_path / "hidden" / "shard-00000.safetensors"
    result = shard_driver.extract_hidden_shard(prepared, hidden, _RowsBackend(True), "tiny", [1, 2], "bfloat16", check_disk=False)
    assert result.pipeline["most_answers_waiting"] == 4  # the first rows came last
    reader = shards.verify_shard(hidden, deep=True)
    offsets = reader.tensor("offsets").tolist()
    for index in range(4):
        assert torch.all(reader.tensor("aux_hidden")[offsets[index] : offsets[index + 1]] == index)
    bad = tmp_path / "hidden" / "shard-00001.safetensors"
    with pytest.raises(ValueError, match="non-finite"):
        shard_driver.extract_hidden_shard(prepared, bad, _RowsBackend(False), "tiny", [1, 2], "bfloat16", check_disk=False)
    assert not bad.exists() and not list(bad.parent.glob("*.tmp*"))
