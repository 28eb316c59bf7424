import json

import pytest

from eaglenest.stages import prepare
from eaglenest.formats import shards
from support.tiny import make_tokenizer

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the quick fox"},
    {"role": "user", "content": "and then?"},
    {"role": "assistant", "content": "jumps over the lazy dog"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def masked_text(tokenizer, ids, mask):
    runs, current = [], []
    for token, bit in zip(ids, mask):
        if bit:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_loss_mask_covers_exactly_each_assistant_turn_and_its_end_marker(tokenizer):
    ids, mask = prepare.tokenize_with_mask(tokenizer, CONVERSATION)
    assert masked_text(tokenizer, ids, mask) == ["the quick fox<|im_end|>", "jumps over the lazy dog<|im_end|>"]
    assert ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]


def test_loss_mask_with_default_system_turn_added_by_template(tokenizer):
    ids, mask = prepare.tokenize_with_mask(tokenizer, CONVERSATION[1:3])
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a tiny test model.")
    assert masked_text(tokenizer, ids, mask) == ["the quick fox<|im_end|>"]


def test_shard_of_depends_on_the_sample_id_only():
    ids = [f"src:{i}" for i in range(500)]
    forward = {i: prepare.shard_of(i, 7) for i in ids}
    backward = {i: prepare.shard_of(i, 7) for i in reversed(ids)}
    assert forward == backward
    assert set(forward.values()) == set(range(7))


def write_jsonl(path, conversations):
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))


def conversations(n, start=0):
    return [
        {"sample_id": f"s:{i}", "messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "the answer " * (i % 5 + 1)}]}
        for i in range(start, start + n)
    ]


def run_prepare(tmp_path, tiny_llama, rows, num_shards=4, max_len=64, name="p"):
    source = tmp_path / f"{name}.jsonl"
    write_jsonl(source, rows)
    paths = [str(p) for p in prepare.shard_paths(tmp_path / name, num_shards)]
    report = prepare.prepare(source, tiny_llama, paths, tmp_path / f"{name}-report.json", max_len=max_len, target_name="tiny")
    members = {}
    for shard_id, path in enumerate(paths):
        reader = shards.verify_shard(path)
        for sample_id in reader.sample_ids:
            members[sample_id] = shard_id
    return report, members, paths


def test_every_sample_lands_in_exactly_one_shard_and_adding_conversations_moves_none(tmp_path, tiny_llama):
    _, before, _ = run_prepare(tmp_path, tiny_llama, conversations(40), name="before")
    _, after, _ = run_prepare(tmp_path, tiny_llama, conversations(15, start=40)[:7] + conversations(40) + conversations(8, start=55), name="after")
    assert len(before) == 40
    assert all(after[sample_id] == shard for sample_id, shard in before.items())
    assert len(after) == 55


def test_truncation_to_max_len_and_drop_when_no_assistant_token_survives(tmp_path, tiny_llama):
    rows = conversations(3) + [{"sample_id": "s:long", "messages": [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "y"}]}]
    report, members, paths = run_prepare(tmp_path, tiny_llama, rows, max_len=90)
    assert report["dropped"] == {"no_assistant_tokens_within_max_len": 1}
    assert "s:long" not in members
    assert report["truncated_to_max_len"] >= 1
    for path in paths:
        assert all(count <= 90 for count in shards.ShardReader.open(path).token_counts)


def test_prepared_shards_carry_counts_that_add_up(tmp_path, tiny_llama):
    report, _, paths = run_prepare(tmp_path, tiny_llama, conversations(12))
    total = 0
    for entry, path in zip(report["shards"], paths):
        reader = shards.ShardReader.open(path)
        tensors = reader.tensors()
        assert entry["tokens"] == reader.num_tokens == tensors["input_ids"].numel()
        assert entry["loss_tokens"] == int(tensors["loss_mask"].sum())
        total += entry["samples"]
    assert total == report["samples"] == 12
