import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglenest.stages import ingest


def good(i, first="human"):
    other = "gpt" if first == "human" else "human"
    return {"id": f"r{i}", "conversations": [{"from": first, "value": f"question {i}"}, {"from": other, "value": f"answer {i}"}]}


def run(tmp_path, sources, **kwargs):
    out, rep = tmp_path / "conversations.jsonl", tmp_path / "report.json"
    report = ingest.ingest(sources, out, rep, **kwargs)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return report, rows, json.loads(rep.read_text())


def test_truncated_sharegpt_array_keeps_every_complete_record_and_reports_truncation(tmp_path):
    text = json.dumps([good(i) for i in range(5)], indent=2)
    cut = text.rindex('"answer 4"') + 4  # inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    report, rows, on_disk = run(tmp_path, [{"name": "sg", "path": str(path)}])
    assert [r["sample_id"] for r in rows] == [f"sg:r{i}" for i in range(4)]
    note = on_disk["files"][0]
    assert note["truncated"] is True and note["records"] == 4
    assert note["unparsed_from_char"] == text.index('{\n    "id": "r4"')


def test_streaming_parse_spans_read_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest, "READ_CHUNK", 64)
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([good(i) for i in range(30)]))
    report, rows, on_disk = run(tmp_path, [{"name": "sg", "path": str(path)}])
    assert len(rows) == 30 and "truncated" not in on_disk["files"][0]


def test_every_bad_record_is_counted_by_reason(tmp_path):
    records = [
        good(0),
        {"id": "missing", "conversations": [{"from": "human"}]},
        {"id": "empty", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "x"}]},
        {"id": "role", "conversations": [{"from": "bard", "value": "a"}, {"from": "gpt", "value": "b"}]},
        {"id": "nonstr", "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "b"}]},
        {"id": "onlygpt", "conversations": [{"from": "gpt", "value": "hello"}]},
        {"id": "alt", "conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]},
        {"id": "noturns", "conversations": []},
        {"nothing": 1},
        [1, 2],
        good(0),  # duplicate id
        dict(good(0), id="copy"),  # duplicate content
        good(1, first="gpt"),  # leading assistant turn, dropped -> no assistant answer left
        {"id": "lead", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(records))
    report, rows, on_disk = run(tmp_path, [{"name": "sg", "path": str(path)}])
    assert on_disk["rejected"] == {
        "duplicate_content": 1,
        "duplicate_id": 1,
        "empty_turn": 1,
        "missing_messages": 1,
        "no_assistant_turn": 1,
        "no_turns": 1,
        "no_user_turn": 1,
        "non_string_content": 1,
        "not_an_object": 1,
        "roles_not_alternating": 1,
        "turn_missing_field": 1,
        "unknown_role": 1,
    }
    assert on_disk["repaired"] == {"dropped_leading_assistant_turn": 1}  # repairs count kept records only
    assert [r["sample_id"] for r in rows] == ["sg:r0", "sg:lead"]
    assert on_disk["records_read"] == len(records) == on_disk["kept"] + on_disk["rejected_total"]
    assert rows[1]["messages"][0] == {"role": "user", "content": "q"}


def test_reject_mode_counts_conversations_that_start_with_the_assistant(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([good(0, first="gpt")]))
    _, rows, on_disk = run(tmp_path, [{"name": "sg", "path": str(path)}], leading_assistant="reject")
    assert rows == [] and on_disk["rejected"] == {"starts_with_assistant": 1}


def test_jsonl_messages_with_bad_lines_and_missing_ids(tmp_path):
    path = tmp_path / "chat.jsonl"
    lines = [
        json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        "{not json",
        json.dumps({"id": 7, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
        "",
    ]
    path.write_text("\n".join(lines))
    _, rows, on_disk = run(tmp_path, [{"name": "oa", "path": str(path)}])
    assert on_disk["rejected"] == {"invalid_json": 1}
    assert rows[0]["sample_id"].startswith("oa:") and len(rows[0]["sample_id"]) == 3 + 16
    assert rows[0]["messages"][0]["role"] == "system"
    assert rows[1]["sample_id"] == "oa:7"


def test_max_conversations_keeps_the_first_valid_ones_in_source_order(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps([good(i) for i in range(10)]))
    _, rows, on_disk = run(tmp_path, [{"name": "sg", "path": str(path)}], max_conversations=3)
    assert [r["sample_id"] for r in rows] == ["sg:r0", "sg:r1", "sg:r2"]
    assert on_disk["capped_out"] == 7


def test_missing_source_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        run(tmp_path, [{"name": "x", "path": str(tmp_path / "nope.jsonl")}])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(["id", "conversations", "messages", "from", "value", "role", "content", "x"]), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(json_values, max_size=8), cut=st.integers(min_value=0, max_value=400))
def test_fuzzed_records_never_crash_and_every_record_is_accounted_for(tmp_path, records, cut):
    text = json.dumps(records)
    path = tmp_path / "fuzz.json"
    path.write_text(text[: max(cut, 1)] if cut < len(text) else text)
    report, rows, on_disk = run(tmp_path, [{"name": "f", "path": str(path)}])
    assert on_disk["records_read"] == on_disk["kept"] + on_disk["rejected_total"]
    assert len(rows) == on_disk["kept"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(json_values.map(json.dumps), st.text(max_size=30).filter(lambda s: "\n" not in s and "\r" not in s)), max_size=8))
def test_fuzzed_jsonl_lines_never_crash(tmp_path, lines):
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(lines))
    report, rows, on_disk = run(tmp_path, [{"name": "f", "path": str(path)}])
    assert on_disk["records_read"] == on_disk["kept"] + on_disk["rejected_total"]


def sharegpt_text_with_missing_comma(count, bad):
    """A pretty-printed ShareGPT array whose record ``bad`` lacks the comma after its id."""
    texts = [json.dumps(good(i), indent=2) for i in range(count)]
    texts[bad] = texts[bad].replace(f'"r{bad}",', f'"r{bad}"', 1)
    return "[\n" + ",\n".join(texts) + "\n]\n", texts


@pytest.mark.parametrize("read_chunk", [8 << 20, 97])
def test_malformed_record_mid_file_is_rejected_alone_and_every_later_record_kept(tmp_path, monkeypatch, read_chunk):
    monkeypatch.setattr(ingest, "READ_CHUNK", read_chunk)  # 97: the bad record spans read chunks
    text, texts = sharegpt_text_with_missing_comma(8, bad=3)
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    report, rows, on_disk = run(tmp_path, [{"name": "sg", "path": str(path)}])
    assert [r["sample_id"] for r in rows] == [f"sg:r{i}" for i in range(8) if i != 3]
    assert on_disk["rejected"] == {"invalid_json": 1}
    note = on_disk["files"][0]
    assert "truncated" not in note and note["records"] == 8
    (bad,) = note["bad_json_records"]
    assert bad["record"] == 3 and bad["from_char"] == text.index(texts[3]) and bad["chars"] == len(texts[3])
    assert "delimiter" in bad["error"]
    assert on_disk["records_read"] == on_disk["kept"] + on_disk["rejected_total"]
    assert "invalid_json 1" in report.console_summary()


def test_truncated_tail_after_a_malformed_record_stays_truncated(tmp_path):
    text, texts = sharegpt_text_with_missing_comma(5, bad=1)
    cut = text.index('"answer 4"') + 3
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    _, rows, on_disk = run(tmp_path, [{"name": "sg", "path": str(path)}])
    assert [r["sample_id"] for r in rows] == ["sg:r0", "sg:r2", "sg:r3"]
    note = on_disk["files"][0]
    assert note["truncated"] is True and note["unparsed_from_char"] == text.index(texts[4])
    assert on_disk["rejected"] == {"invalid_json": 1} and on_disk["records_read"] == 4


def test_byte_order_mark_is_not_content_in_json_or_jsonl(tmp_path):
    array, lines = tmp_path / "bom.json", tmp_path / "bom.jsonl"
    array.write_text(json.dumps([good(0)]), encoding="utf-8-sig")
    lines.write_text("\n".join(json.dumps(good(i)) for i in (1, 2)), encoding="utf-8-sig")
    report, rows, on_disk = run(tmp_path, [{"name": "a", "path": str(array)}, {"name": "b", "path": str(lines)}])
    assert [r["sample_id"] for r in rows] == ["a:r0", "b:r1", "b:r2"]
    assert on_disk["rejected"] == {} and report.console_summary() is None


def test_openai_text_parts_are_joined_and_other_parts_rejected_by_their_own_reason(tmp_path):
    def chat(i, user_content):
        return {"id": i, "messages": [{"role": "user", "content": user_content}, {"role": "assistant", "content": "ok"}]}

    records = [
        chat(0, [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]),
        chat(1, [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x.png"}}]),
        chat(2, [{"type": "text", "text": 5}]),
        chat(3, []),
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    _, rows, on_disk = run(tmp_path, [{"name": "oa", "path": str(path)}])
    assert [r["messages"][0]["content"] for r in rows] == ["first\nsecond"]
    assert on_disk["rejected"] == {"non_string_content": 2, "non_text_content": 1}
