import json

import pytest
import torch

from eaglenest.stages import consolidate
from eaglenest.formats import shards, vocab


def test_draft_vocab_takes_the_most_frequent_tokens_in_ascending_id_order():
    counts = torch.tensor([0, 5, 1, 9, 0, 5, 2])
    d2t, t2d = vocab.build_draft_vocab(counts, 4)
    assert vocab.draft_to_target(d2t).tolist() == [1, 3, 5, 6]
    assert d2t.tolist() == [1, 2, 3, 3]
    assert t2d.tolist() == [False, True, False, True, False, True, True]


def test_draft_vocab_fills_unseen_ids_in_order_when_few_tokens_were_seen():
    counts = torch.tensor([0, 0, 3, 0, 0])
    d2t, t2d = vocab.build_draft_vocab(counts, 3)
    assert vocab.draft_to_target(d2t).tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        vocab.build_draft_vocab(counts, 6)


def test_validation_split_is_a_function_of_the_sample_id():
    ids = [f"s:{i}" for i in range(2000)]
    first = [consolidate.in_validation(i, 0.1, 0) for i in ids]
    assert first == [consolidate.in_validation(i, 0.1, 0) for i in ids]
    assert 150 < sum(first) < 250
    assert first != [consolidate.in_validation(i, 0.1, 1) for i in ids]


def fake_pair(tmp_path, shard_id, ids, hidden=4):
    name = shards.shard_name(shard_id)
    prepared = tmp_path / "prepared" / name
    rows = [{"sample_id": f"s:{shard_id}:{k}", "input_ids": seq, "loss_mask": [1] * len(seq)} for k, seq in enumerate(ids)]
    shards.write_prepared_shard(prepared, shard_id, rows, {"target": "t"})
    total = sum(len(s) for s in ids)
    meta = {"target": "t", "target_hidden_size": hidden, "layer_ids": [0, 1, 2], "dtype": "bfloat16"}
    path = tmp_path / "hidden" / name
    shards.write_hidden_shard(path, shards.ShardReader.open(prepared), torch.zeros(total, 3 * hidden, dtype=torch.bfloat16), torch.zeros(total, hidden, dtype=torch.bfloat16), meta)
    return str(path), str(prepared)


def run_consolidate(tmp_path, pairs, name="consolidated", **options):
    out = tmp_path / name
    return consolidate.consolidate(
        [h for h, _ in pairs], [p for _, p in pairs], out / "index.json", out / "draft_vocab.safetensors", out / "split.json",
        target_vocab_size=16, draft_vocab_size=4, expect={"target": "t", "layer_ids": [0, 1, 2], "dtype": "bfloat16"},
        **options,
    )


def test_index_counts_and_vocab_from_loss_tokens(tmp_path):
    pairs = [fake_pair(tmp_path, 0, [[1, 2, 3], [3, 3]]), fake_pair(tmp_path, 1, [[7, 3, 9, 9]])]
    index = run_consolidate(tmp_path, pairs)
    assert index["totals"] == {"shards": 2, "samples": 3, "tokens": 9, "loss_tokens": 9, "bytes": index["totals"]["bytes"]}
    saved = vocab.load_draft_vocab(tmp_path / "consolidated" / "draft_vocab.safetensors")
    assert vocab.draft_to_target(saved["d2t"]).tolist() == [1, 2, 3, 9]
    split = json.loads((tmp_path / "consolidated" / "split.json").read_text())
    assert sorted(split["train"] + split["val"]) == ["s:0:0", "s:0:1", "s:1:0"]


def test_corrupt_and_stale_shards_are_all_named_with_the_fix(tmp_path):
    pairs = [fake_pair(tmp_path, i, [[1, 2, 3]]) for i in range(3)]
    infos, _ = shards.read_header(pairs[1][0])
    data = bytearray(open(pairs[1][0], "rb").read())
    data[infos["aux_hidden"]["file_offset"]] ^= 0xFF
    open(pairs[1][0], "wb").write(bytes(data))
    # shard 2's prepared input changed after extraction: the hidden shard is stale
    shards.write_prepared_shard(pairs[2][1], 2, [{"sample_id": "s:2:0", "input_ids": [4, 4, 4], "loss_mask": [1, 1, 1]}], {})
    with pytest.raises(consolidate.ConsolidationError) as error:
        run_consolidate(tmp_path, pairs)
    message = str(error.value)
    assert "2 hidden shard(s) failed" in message
    assert "shard-00001.safetensors: checksum mismatch in aux_hidden" in message
    assert "shard-00002.safetensors: token ids differ" in message
    assert f"rm {pairs[1][0]} {pairs[2][0]}" in message
    assert not (tmp_path / "consolidated" / "index.json").exists()


def test_a_run_can_keep_an_earlier_runs_draft_vocabulary(tmp_path):
    """consolidate.draft_vocab_from: other data, the earlier run's d2t/t2d (what a warm start
    needs), the coverage measured on this run's loss tokens."""
    from safetensors.torch import save_file

    earlier = run_consolidate(tmp_path, [fake_pair(tmp_path, 0, [[1, 2, 3], [3, 3]]), fake_pair(tmp_path, 1, [[7, 3, 9, 9]])])
    earlier_vocab = tmp_path / "consolidated" / "draft_vocab.safetensors"
    other = tmp_path / "other"
    pairs = [fake_pair(other, 0, [[4, 4, 5], [6, 4]]), fake_pair(other, 1, [[3, 3, 11, 12]])]
    built = run_consolidate(other, pairs, name="built")
    assert vocab.draft_to_target(vocab.load_draft_vocab(other / "built" / "draft_vocab.safetensors")["d2t"]).tolist() == [3, 4, 5, 6]
    kept = run_consolidate(other, pairs, name="kept", draft_vocab_from=str(earlier_vocab))
    saved = vocab.load_draft_vocab(other / "kept" / "draft_vocab.safetensors")
    assert vocab.draft_to_target(saved["d2t"]).tolist() == [1, 2, 3, 9]
    assert kept["draft_vocab"]["from"] == str(earlier_vocab) and earlier["draft_vocab"].get("from") is None
    assert kept["draft_vocab"]["loss_token_coverage"] == round(2 / 9, 6) < built["draft_vocab"]["loss_token_coverage"]
    # An export's directory works the same (its model.safetensors holds d2t and t2d).
    export = tmp_path / "export"
    export.mkdir()
    save_file({"d2t": saved["d2t"], "t2d": saved["t2d"], "lm_head.weight": torch.zeros(4, 2)}, str(export / "model.safetensors"))
    assert [t.tolist() for t in vocab.read_draft_vocab_of(export, 16, 4)] == [saved["d2t"].tolist(), saved["t2d"].tolist()]
    # Another size, or a d2t that does not match its t2d, is refused with the reason.
    with pytest.raises(ValueError, match="a draft vocabulary of 4 over 16 target tokens, this run has 5 over 16"):
        vocab.read_draft_vocab_of(earlier_vocab, 16, 5)
    broken = saved["t2d"].clone()
    broken[0] = True
    save_file({"d2t": saved["d2t"], "t2d": broken}, str(tmp_path / "broken.safetensors"))
    with pytest.raises(ValueError, match="do not name the same target tokens"):
        vocab.read_draft_vocab_of(tmp_path / "broken.safetensors", 16, 4)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        vocab.read_draft_vocab_of(tmp_path / "consolidated", 16, 4)
