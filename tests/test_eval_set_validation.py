"""benchmarks/eval_set_validation.py through the real Snakefile on the tiny target: an eval set's
prompts with the target's greedy references made into a run per storage dtype, every drafter
scored on every answer."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, synthetic_conversations, tiny_workflow_config

sys.path.insert(0, str(REPO / "benchmarks"))


def full_vocab_drafter(target, out, seed: int):
    """An untrained drafter of the tiny target whose draft vocabulary is all of the target's: every
    answer position counts, whatever the random target's argmax."""
    import torch

    from eaglenest.model import drafter as drafter_lib

    torch.manual_seed(seed)
    drafter = drafter_lib.build_drafter(target, {"d2t": torch.zeros(320, dtype=torch.int64),
                                                 "t2d": torch.ones(320, dtype=torch.bool)}, [2, 3, 4])
    drafter.save(out)
    return out


@pytest.mark.workflow
def test_references_become_conversations_scored_per_dtype_for_every_drafter(tmp_path, tiny_llama):
    import eval_set_validation
    from eaglenest.stages import prepare

    tokenizer = prepare.load_tokenizer(tiny_llama)
    prompts = tmp_path / "mt_bench_question.jsonl"
    texts = ["Write a poem about the sea.", "What is two plus two?", "Name three colours."]
    prompts.write_text("".join(json.dumps({"question_id": 81 + k, "category": ["writing", "math", "stem"][k],
                                           "turns": [text, "and again"]}) + "\n" for k, text in enumerate(texts)))
    answers = ["the sea is wide and the sea is deep " * 3, "four, it is four", "red green blue red green blue"]
    eos = tokenizer.eos_token_id
    chunks = tmp_path / "chunks"
    chunks.mkdir()
    # each reference as the evaluator writes it: its output (here ending at the end of sequence),
    # then the lookahead tokens decoded beyond it, which are no part of the answer
    per_prompt = []
    for k, a in enumerate(answers):
        ids = tokenizer(a, add_special_tokens=False)["input_ids"] + [eos]
        per_prompt.append({"id": f"mt_bench/{81 + k}", "output_length": len(ids), "tokens": ids + [7, 8, 9]})
    # two chunk files, read in their numeric order
    for n, part in enumerate((per_prompt[:2], per_prompt[2:])):
        (chunks / f"{n}.json").write_text(json.dumps({"eos_token_ids": [eos], "per_prompt": part}))
    workdir = tmp_path / "work"
    workdir.mkdir()
    configfile = tiny_workflow_config(workdir, tiny_llama, synthetic_conversations(tmp_path / "synthetic.jsonl", 4),
                                      consolidate={"draft_vocab_size": 320})
    drafters = [full_vocab_drafter(tiny_llama, tmp_path / f"drafter-{seed}", seed) for seed in (1, 2)]
    out = tmp_path / "validation.json"
    assert eval_set_validation.main([
        "--references", str(chunks), "--prompts", str(prompts), "--drafter", f"one={drafters[0]}",
        "--drafter", f"two={drafters[1]}", "--config", str(configfile), "--dtype", "float8_e4m3", "--dtype", "float32",
        "--cores", "2", "--directory", str(workdir), "--out", str(out),
    ]) == 0
    table = json.loads(out.read_text())
    assert table["prompts"] == 3 and table["answer_tokens"] == sum(p["output_length"] - 1 for p in per_prompt)
    assert 0 <= table["answers_token_for_token"] <= 3
    assert [(row["answers"], row["drafter"]) for row in table["rows"]] == [
        ("float8_e4m3", "one"), ("float8_e4m3", "two"), ("float32", "one"), ("float32", "two")]
    by = {(row["answers"], row["drafter"]): row for row in table["rows"]}
    for dtype in ("float8_e4m3", "float32"):
        assert by[dtype, "one"]["positions"] == by[dtype, "two"]["positions"]
        # the answer tokens, and the end of turn the chat template closes each answer with
        assert by[dtype, "one"]["positions"][0] == table["answer_tokens"] + 3
        index = json.loads((workdir / "results" / by[dtype, "one"]["run"] / "consolidated" / "index.json").read_text())
        assert index["dtype"] == dtype and index["totals"]["samples"] == 3
    # The conversations: each prompt's first turn and its reference answer, its end of sequence dropped.
    rows = [json.loads(line) for line in
            (workdir / "results" / "eval-set-validation" / "mt_bench.jsonl").read_text().splitlines()]
    assert [row["messages"][0]["content"] for row in rows] == texts
    assert [tokenizer(row["messages"][1]["content"], add_special_tokens=False)["input_ids"] for row in rows] == [
        p["tokens"][:p["output_length"] - 1] for p in per_prompt]


@pytest.mark.workflow
def test_answered_conversations_are_scored_as_they_are(tmp_path, tiny_llama):
    """--conversations: conversations the regenerate stage wrote (e.g. the target's answers to
    prompts it wrote itself) scored as they stand, every assistant turn's tokens counted."""
    import eval_set_validation

    rows = [{"sample_id": f"self:{k}", "regenerated_turns": [1],
             "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]}
            for k, (text, answer) in enumerate([("Tell me a story.", "once upon a time " * 4),
                                                ("What is rain?", "water that falls from clouds")])]
    answered = tmp_path / "shard-00000.jsonl"
    answered.write_text("".join(json.dumps(row) + "\n" for row in rows))
    workdir = tmp_path / "work"
    workdir.mkdir()
    configfile = tiny_workflow_config(workdir, tiny_llama, synthetic_conversations(tmp_path / "synthetic.jsonl", 4),
                                      consolidate={"draft_vocab_size": 320})
    drafter = full_vocab_drafter(tiny_llama, tmp_path / "drafter", 1)
    out = tmp_path / "validation.json"
    common = ["--drafter", f"one={drafter}", "--config", str(configfile), "--cores", "2", "--directory", str(workdir),
              "--out", str(out)]
    with pytest.raises(SystemExit):  # one source of answers, not both
        eval_set_validation.main(["--conversations", str(answered), "--references", str(tmp_path), *common])
    with pytest.raises(SystemExit):  # bin edges ascending, inside (0, 1)
        eval_set_validation.main(["--conversations", str(answered), "--by-confidence", "--confidence-edges", "0.9", "0.5",
                                  *common])
    assert eval_set_validation.main(["--conversations", str(answered), "--by-confidence",
                                     "--confidence-edges", "0.02", "0.5", "0.99", *common]) == 0
    table = json.loads(out.read_text())
    assert table["prompts"] == 2 and table["answers_token_for_token"] is None
    (row,) = table["rows"]
    binned = row["by_confidence"]
    assert binned["bins"] == [[0.0, 0.02], [0.02, 0.5], [0.5, 0.99], [0.99, 1.0]]
    assert [sum(step) for step in binned["positions"]] == row["positions"]
    # each bin's mean sureness lies in the bin: a random tiny target is unsure, so some bin has positions
    for (low, high), mean in zip(binned["bins"], binned["mean_sureness"][0]):
        assert mean is None or low <= mean <= high
    assert any(mean is not None for mean in binned["mean_sureness"][0])
    index = json.loads((workdir / "results" / row["run"] / "consolidated" / "index.json").read_text())
    assert index["totals"]["samples"] == 2 and row["positions"][0] > 0
    written = [json.loads(line) for line in
               (workdir / "results" / "eval-set-validation" / "shard-00000.jsonl").read_text().splitlines()]
    assert written == [{"sample_id": r["sample_id"], "messages": r["messages"]} for r in rows]
