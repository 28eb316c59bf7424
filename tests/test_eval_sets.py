"""User eval sets: chats in ingest's formats and the run's held-out conversations turned into prompts,
bad records counted by reason, a set without a usable prompt refused with its path and reason."""

from __future__ import annotations

import json

import pytest

from eaglenest import settings
from eaglenest.stages import eval_sets, evaluate, ingest
from support.eval_chats import SYSTEM, user_chats


def test_user_chats_become_prompts_before_the_last_answer(tmp_path):
    chats = user_chats(tmp_path / "support.jsonl")
    report = eval_sets.read_chats("support", chats, tmp_path / "prompts.jsonl", tmp_path / "report.json")
    prompts = evaluate.load_prompts("support", tmp_path / "prompts.jsonl", None)
    assert [p["id"] for p in prompts] == [
        "support/o1", "support/o2", f"support/{ingest.content_hash(prompts[2]['messages'])}", "support/s2"]
    assert {p["category"] for p in prompts} == {"support"}
    assert prompts[0]["messages"] == [{"role": "user", "content": "How do I reset my password?"}]
    # Earlier turns stay as context; the system turn stays first.
    assert prompts[1]["messages"] == [SYSTEM, {"role": "user", "content": "My order is late."},
                                      {"role": "assistant", "content": "Which order?"},
                                      {"role": "user", "content": "Number 1234."}]
    assert [m["content"] for m in prompts[2]["messages"]] == [
        "Is there a student discount?", "Yes, 20 %.", "How do I apply?"]
    assert prompts[3]["messages"] == [{"role": "user", "content": "Cancel my plan."}]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["eval_set"] == "support" and saved["records_read"] == 8 and saved["kept"] == 4
    assert saved["rejected"] == {"duplicate_id": 1, "invalid_json": 1, "no_user_turn": 1, "unknown_role": 1}
    assert saved["repaired"] == {"dropped_leading_assistant_turn": 1}
    assert saved["files"][0]["bad_json_lines"] == [4]
    assert report.console_summary("eval set support") == (
        "eval set support: kept 4 of 8 records; rejected 4 (duplicate_id 1, invalid_json 1, no_user_turn 1, unknown_role 1)")


def test_the_prompt_is_rendered_with_the_chat_template_as_mt_bench_turns_are(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    from eaglenest.stages.prepare import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    eval_sets.read_chats("support", user_chats(tmp_path / "c.jsonl"), tmp_path / "p.jsonl", tmp_path / "r.json")
    multi_turn = evaluate.load_prompts("support", tmp_path / "p.jsonl", 2)[1]
    rendered = tokenizer.decode(prompt_ids(tokenizer, multi_turn["messages"]))
    assert rendered == tokenizer.apply_chat_template(multi_turn["messages"], tokenize=False, add_generation_prompt=True)
    assert rendered.index("My order is late.") < rendered.index("Which order?") < rendered.index("Number 1234.")
    assert "It ships today." not in rendered


@pytest.mark.parametrize("content, reason", [
    ("", "the file holds no record"),
    ('{"id": "a", "conversations": [{"from": "gpt", "value": "hello"}]}\n{"id": "b", "messages": [{"role": "system", "content": "s"}]}\n',
     "all 2 records rejected (no_user_turn 2)"),
    ('not json\n', "all 1 records rejected (invalid_json 1)"),
])
def test_a_set_without_a_usable_prompt_is_refused_with_its_path_and_reason(tmp_path, content, reason):
    chats = tmp_path / "empty.jsonl"
    chats.write_text(content)
    with pytest.raises(eval_sets.EmptyEvalSet, match="no usable prompt") as refused:
        eval_sets.read_chats("empty", chats, tmp_path / "p.jsonl", tmp_path / "r.json")
    assert str(chats) in str(refused.value) and reason in str(refused.value)
    assert not (tmp_path / "p.jsonl").exists() and not (tmp_path / "r.json").exists()


def test_a_missing_chats_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        eval_sets.read_chats("support", tmp_path / "missing.jsonl", tmp_path / "p.jsonl", tmp_path / "r.json")


def test_a_sharegpt_json_array_cut_off_mid_record_gives_its_complete_records(tmp_path):
    chats = tmp_path / "chats.json"
    whole = {"id": "a", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    chats.write_text("[" + json.dumps(whole) + ', {"id": "b", "conversations": [{"from": "hum')
    eval_sets.read_chats("cut", chats, tmp_path / "p.jsonl", tmp_path / "r.json")
    assert [p["id"] for p in eval_sets.read_prompts(tmp_path / "p.jsonl")] == ["cut/a"]
    assert json.loads((tmp_path / "r.json").read_text())["files"][0]["truncated"] is True


def held_out_run(tmp_path, count=12, val_every=3):
    conversations = tmp_path / "conversations.jsonl"
    with open(conversations, "w") as handle:
        for i in range(count):
            messages = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"},
                        {"role": "user", "content": f"follow-up {i}"}, {"role": "assistant", "content": f"more {i}"}]
            handle.write(json.dumps({"sample_id": f"src:{i}", "messages": messages}) + "\n")
    val = [f"src:{i}" for i in range(count) if i % val_every == 0]
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [f"src:{i}" for i in range(count) if i % val_every], "val": val}))
    return conversations, split, val


def test_a_held_out_set_is_the_validation_conversations_in_an_order_fixed_by_its_seed(tmp_path):
    conversations, split, val = held_out_run(tmp_path)
    entry = {"name": "val", "split": "val", "seed": 0}
    eval_sets.prepare_set(entry, tmp_path / "p0.jsonl", tmp_path / "r0.json", conversations, split)
    prompts = eval_sets.read_prompts(tmp_path / "p0.jsonl")
    assert sorted(p["id"] for p in prompts) == sorted(f"val/{sample_id}" for sample_id in val)
    i = prompts[0]["id"].split(":")[1]
    assert [m["content"] for m in prompts[0]["messages"]] == [f"question {i}", f"answer {i}", f"follow-up {i}"]
    # The same seed gives the same order whatever the file's order; another seed another order.
    lines = (conversations.read_text().splitlines())[::-1]
    conversations.write_text("\n".join(lines) + "\n")
    eval_sets.prepare_set(entry, tmp_path / "p0b.jsonl", tmp_path / "r0b.json", conversations, split)
    assert eval_sets.read_prompts(tmp_path / "p0b.jsonl") == prompts
    orders = set()
    for seed in range(4):
        eval_sets.prepare_set(dict(entry, seed=seed), tmp_path / "p.jsonl", tmp_path / "r.json", conversations, split)
        orders.add(tuple(p["id"] for p in eval_sets.read_prompts(tmp_path / "p.jsonl")))
    assert len(orders) > 1
    report = json.loads((tmp_path / "r0.json").read_text())
    assert report["kept"] == len(val) and report["rejected_total"] == 0


def test_a_held_out_conversation_kept_in_two_versions_is_one_prompt(tmp_path):
    # regenerate.mix_original: the split holds <id> and <id>@original; the prompt is asked once.
    conversations, split, val = held_out_run(tmp_path)
    both = json.loads(split.read_text())
    both["val"] = [version for sample_id in val for version in (sample_id, sample_id + ingest.ORIGINAL_SUFFIX)]
    split.write_text(json.dumps(both))
    eval_sets.prepare_set({"name": "val", "split": "val", "seed": 0}, tmp_path / "p.jsonl", tmp_path / "r.json",
                          conversations, split)
    assert sorted(p["id"] for p in eval_sets.read_prompts(tmp_path / "p.jsonl")) == sorted(f"val/{i}" for i in val)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["kept"] == len(val) and report["rejected_total"] == 0


def test_an_empty_validation_split_is_refused_with_what_to_change(tmp_path):
    conversations, split, _ = held_out_run(tmp_path)
    split.write_text(json.dumps({"train": ["src:0"], "val": []}))
    with pytest.raises(eval_sets.EmptyEvalSet, match=r"split of .*split.json is empty.*val_fraction"):
        eval_sets.prepare_set({"name": "val", "split": "val", "seed": 0}, tmp_path / "p.jsonl", tmp_path / "r.json",
                              conversations, split)


def test_set_entries_are_checked_and_a_set_may_take_its_own_count():
    sets = ["mt_bench", {"name": "support", "path": "s.jsonl", "num_prompts": None},
            {"name": "val", "split": "val", "num_prompts": 5}, {"name": "more", "path": "m.jsonl"}]
    assert eval_sets.set_names(sets) == ["mt_bench", "support", "val", "more"]
    assert [eval_sets.num_prompts(sets, name, 3) for name in ("mt_bench", "support", "val", "more")] == [3, None, 5, 3]
    with pytest.raises(ValueError, match="more than once: support"):
        eval_sets.set_names(sets + [{"name": "support", "path": "other.jsonl"}])
    with pytest.raises(ValueError, match="'humaneval' is a built-in set's name"):
        eval_sets.set_names([{"name": "humaneval", "path": "h.jsonl"}])


@pytest.mark.parametrize("entry, valid", [
    ({"name": "support", "path": "s.jsonl"}, True),
    ({"name": "val", "split": "val"}, True),
    ({"name": "both", "path": "s.jsonl", "split": "val"}, False),
    ({"name": "neither"}, False),
    ({"name": "a/b", "path": "s.jsonl"}, False),
    ({"name": "x", "path": "s.jsonl", "unknown": 1}, False),
    ("gsm8k", False),
])
def test_the_schema_takes_built_in_names_and_user_sets(entry, valid):
    config = {"sets": [entry]}
    errors = settings.validate_with_defaults(config, {k: v for k, v in settings.section_schema("evaluate").items()})
    assert (not errors) == valid, errors
    if valid and isinstance(entry, dict) and "split" in entry:
        assert config["sets"][0]["seed"] == 0  # the schema's default
