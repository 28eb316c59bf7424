"""benchmarks/heldout_validation.py through the real Snakefile on the tiny target: a split's
held-out conversations, as written and as regenerated, each made into a run up to consolidate
with the drafters' draft vocabulary, every drafter scored on every sample of both."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, synthetic_conversations, tiny_workflow_config

sys.path.insert(0, str(REPO / "benchmarks"))


def tiny_drafter(target: Path, out: Path, seed: int) -> Path:
    """An untrained drafter of the tiny target, its draft vocabulary the first 64 target ids."""
    from eaglenest.model import drafter as drafter_lib

    t2d = torch.zeros(320, dtype=torch.bool)
    t2d[:64] = True
    torch.manual_seed(seed)
    drafter = drafter_lib.build_drafter(target, {"d2t": torch.zeros(64, dtype=torch.int64), "t2d": t2d}, [2, 3, 4])
    drafter.save(out)
    return out


@pytest.mark.workflow
def test_both_versions_of_the_held_out_conversations_are_scored_for_every_drafter(tmp_path, tiny_llama):
    import heldout_validation

    source = synthetic_conversations(tmp_path / "synthetic.jsonl", 12)
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    # The ingested conversations and a regenerated folder's shards: the same ids, other answers.
    ingested = tmp_path / "conversations.jsonl"
    ingested.write_text("".join(json.dumps({"sample_id": f"synthetic:{row['id']}", "messages": row["messages"]}) + "\n"
                                for row in rows))
    regenerated = tmp_path / "regenerated"
    regenerated.mkdir()
    for shard in range(2):
        (regenerated / f"shard-{shard:05d}.jsonl").write_text("".join(json.dumps({
            "sample_id": f"synthetic:{row['id']}",
            "messages": [dict(m, content="the target says so " * (3 + k % 4)) if m["role"] == "assistant" else m
                         for k, m in enumerate(row["messages"])]}) + "\n" for row in rows[shard::2]))
    ids = [f"synthetic:{row['id']}" for row in rows]
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": ids[:6], "val": ids[6:]}))
    workdir = tmp_path / "work"
    workdir.mkdir()
    configfile = tiny_workflow_config(workdir, tiny_llama, source)
    drafters = [tiny_drafter(tiny_llama, tmp_path / f"drafter-{seed}", seed) for seed in (1, 2)]
    out = tmp_path / "validation.json"
    assert heldout_validation.main([
        "--split", str(split), "--original", str(ingested), "--regenerated", str(regenerated / "shard-*.jsonl"),
        "--drafter", f"one={drafters[0]}", "--drafter", f"two={drafters[1]}", "--config", str(configfile),
        "--count", "4", "--samples-per-shard", "2", "--cores", "2", "--directory", str(workdir), "--out", str(out),
    ]) == 0
    table = first_table = json.loads(out.read_text())
    import heldout_eval_set

    first = [row["id"] for row in heldout_eval_set.heldout(split, ingested, 4)]
    assert table["conversation_ids"] == first and set(first) <= set(ids[6:])
    assert [(row["drafter"], row["answers"]) for row in table["rows"]] == [
        ("one", "sharegpt"), ("two", "sharegpt"), ("one", "target"), ("two", "target")]
    by = {(row["drafter"], row["answers"]): row for row in table["rows"]}
    for answers in ("sharegpt", "target"):  # the same samples for both drafters
        assert by["one", answers]["positions"] == by["two", answers]["positions"]
        assert by["one", answers]["positions"][0] > 0 and len(by["one", answers]["acc"]) == 2  # TINY_TRAIN's ttt_length
    # Other answers, other loss positions: the target's version is not ShareGPT's again.
    assert by["one", "sharegpt"]["positions"] != by["one", "target"]["positions"]
    # Each version is a run of the workflow's own: its consolidated index names every held-out conversation.
    for row in table["rows"][1::2]:
        index = json.loads((workdir / "results" / row["run"] / "consolidated" / "index.json").read_text())
        assert index["totals"]["samples"] == 4 and row["run"].startswith(f"heldout-validation-{row['answers']}-"), index
    # --offset: the next held-out conversations, none of the first ones.
    assert heldout_validation.main([
        "--split", str(split), "--original", str(ingested), "--regenerated", str(regenerated / "shard-*.jsonl"),
        "--drafter", f"one={drafters[0]}", "--config", str(configfile), "--count", "2", "--offset", "4",
        "--samples-per-shard", "2", "--cores", "2", "--directory", str(workdir), "--out", str(out),
    ]) == 0
    table = json.loads(out.read_text())
    assert table["conversation_ids"] == [row["id"] for row in heldout_eval_set.heldout(split, ingested, 6)][4:]
    assert [row["answers"] for row in table["rows"]] == ["sharegpt", "target"]
    assert not {row["run"] for row in table["rows"]} & {row["run"] for row in first_table["rows"]}  # runs of their own
