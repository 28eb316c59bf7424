"""Evaluation: eval-set readers, summary table and plots, and the workflow up to the HTML report."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import torch
import yaml

from conftest import REPO, planned_jobs, run_snakemake, synthetic_conversations, tiny_workflow_config
from eaglenest.stages import eval_sets, evaluate
from support.eval_chats import user_chats

# One built-in set (HumanEval goes through the same rules; its reader is tested on its own and in
# the real-SmolLM2 demo run), a user set and a held-out set.
SETS = ("mt_bench", "support", "heldout")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_mt_bench(path):
    categories = ["writing", "writing", "writing", "roleplay", "roleplay", "math"]
    with open(path, "w") as handle:
        for i, category in enumerate(categories):
            handle.write(json.dumps({"question_id": 81 + i, "category": category,
                                     "turns": [f"first turn {i}", f"second turn {i}"]}) + "\n")
    return path


def test_mt_bench_prompts_are_first_turns_round_robin_over_categories(tmp_path):
    prompts = evaluate.load_prompts("mt_bench", write_mt_bench(tmp_path / "question.jsonl"), 4)
    assert [p["category"] for p in prompts] == ["writing", "roleplay", "math", "writing"]
    assert [p["id"] for p in prompts] == ["mt_bench/81", "mt_bench/84", "mt_bench/86", "mt_bench/82"]
    assert prompts[0]["messages"] == [{"role": "user", "content": "first turn 0"}]


def test_humaneval_prompts_hold_the_function_to_complete(tmp_path):
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        for i in range(3):
            handle.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"doc\"\"\"\n",
                                     "entry_point": f"f{i}", "canonical_solution": "", "test": ""}) + "\n")
    prompts = evaluate.load_prompts("humaneval", path, 2)
    assert [p["id"] for p in prompts] == ["HumanEval/0", "HumanEval/1"]
    assert "def f1(x):" in prompts[1]["messages"][0]["content"]


def test_no_count_takes_every_prompt_of_each_set(tmp_path):
    prompts = evaluate.load_prompts("mt_bench", write_mt_bench(tmp_path / "question.jsonl"), None)
    assert len(prompts) == 6
    assert len({p["id"] for p in prompts}) == 6


def test_prompt_chunks_cover_every_prompt_once_in_order():
    for count in (0, 1, 5, 80, 164):
        for chunks in (1, 2, 3, 7):
            covered = [i for c in range(chunks) for i in range(count)[evaluate.prompt_slice(count, c, chunks)]]
            assert covered == list(range(count))
    with pytest.raises(ValueError, match="outside"):
        evaluate.prompt_slice(10, 3, 3)


def part(chunk, chunks, prompts, **overrides):
    base = {"eval_set": "mt_bench", "drafting": {"name": "steps3-topk1-tokens4", "steps": 3, "topk": 1, "tokens": 4},
            "chunk": [chunk, chunks], "max_new_tokens": 8, "temperature": 0, "device": "cpu", "dtype": "float32",
            "threads": 1, "target": "t", "drafter": "d", "per_prompt": prompts}
    return {**base, **overrides}


def trace(name, accepted, lossless=True, seconds=1.0):
    return {"id": name, "category": "writing", "prompt_tokens": 5, "new_tokens": sum(accepted) + len(accepted) + 1,
            "cycles": len(accepted), "accepted": accepted, "draft_depths": [3] * len(accepted), "seconds": seconds,
            "target_tokens": sum(accepted) + len(accepted) + 1, "target_seconds": 2.0, "lossless": lossless}


def test_merged_chunks_give_the_metrics_of_one_job():
    prompts = [trace("a", [0, 3, 1]), trace("b", [2, 2], lossless=False), trace("c", [1])]
    one = evaluate.metrics_from_parts([part(0, 1, prompts)])
    split = evaluate.metrics_from_parts([part(1, 2, prompts[2:], device="cuda"), part(0, 2, prompts[:2])])
    for key in ("tau", "cycles", "tokens", "acceptance_by_position", "accept_length_histogram", "lossless",
                "mismatched_prompts", "speedup", "prompts"):
        assert split[key] == one[key], key
    assert one["tau"] == (9 + 6) / 6 and one["lossless"] is False and one["mismatched_prompts"] == ["b"]
    assert [p["id"] for p in split["per_prompt"]] == ["a", "b", "c"]
    assert one["device"] == "cpu" and split["device"] == "cpu+cuda"  # chunks from two machines say so


def test_replayed_chunks_have_a_tau_but_no_speed_or_lossless_claim():
    prompts = [dict(trace("a", [0, 3, 1], lossless=None), reference_consistent=True),
               dict(trace("b", [2], lossless=None), reference_consistent=False)]
    metrics = evaluate.metrics_from_parts([part(0, 1, prompts, method="replay")])
    assert metrics["method"] == "replay" and metrics["tau"] == (6 + 4) / 4
    assert metrics["speedup"] is None and metrics["speculative_tokens_per_second"] is None
    assert metrics["lossless"] is None and metrics["reference_inconsistent_prompts"] == ["b"]
    with pytest.raises(ValueError, match="disagree on method"):
        evaluate.metrics_from_parts([part(0, 2, prompts, method="replay"), part(1, 2, prompts)])


def test_an_export_is_evaluated_with_the_weights_it_holds(tmp_path, tiny_llama):
    """evaluate.drafter may name an SGLang export (no embedding): the target lends its own."""
    from eaglenest.model import drafter as drafter_lib
    from eaglenest.stages import export

    vocab = {"d2t": torch.zeros(64, dtype=torch.int64), "t2d": torch.arange(320) < 64}
    trained = drafter_lib.build_drafter(tiny_llama, vocab, [1, 3, 4])
    trained.save(tmp_path / "drafter")
    export.export_drafter(tmp_path / "drafter", tiny_llama, "tiny", tmp_path / "sglang", tmp_path / "vllm",
                          tmp_path / "report.json", dtype="bfloat16", include_embed_tokens=False)
    _, _, loaded, _ = evaluate._load_models(tiny_llama, tmp_path / "sglang", "cpu", 1, "float32")
    for name, tensor in trained.state_dict().items():
        expected = tensor.to(torch.bfloat16).float() if tensor.is_floating_point() and name != "embed_tokens.weight" else tensor
        assert torch.equal(loaded.state_dict()[name].to(expected.dtype), expected), name


def test_merge_refuses_missing_or_mismatched_chunks():
    prompts = [trace("a", [1])]
    with pytest.raises(ValueError, match="expected 0..2 of 3"):
        evaluate.metrics_from_parts([part(0, 3, prompts), part(2, 3, prompts)])
    with pytest.raises(ValueError, match="disagree on dtype"):
        evaluate.metrics_from_parts([part(0, 2, prompts), part(1, 2, prompts, dtype="bfloat16")])


def test_asking_for_more_prompts_than_a_set_has_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has 6 prompts"):
        evaluate.load_prompts("mt_bench", write_mt_bench(tmp_path / "question.jsonl"), 7)


def metrics(eval_set, name, tau, acceptance, speedup):
    return {
        "eval_set": eval_set, "drafting": {"name": name}, "prompts": 2, "tau": tau, "cycles": 10,
        "acceptance_by_position": acceptance, "speedup": speedup, "speculative_tokens_per_second": 10.0 * speedup,
        "target_tokens_per_second": 10.0, "lossless": True,
    }


def test_summary_writes_the_table_plots_and_the_headline_of_the_first_configuration(tmp_path):
    jobs = [
        metrics("mt_bench", "steps3-topk1-tokens4", 1.75, [0.5, 0.4, None], 0.8),
        metrics("humaneval", "steps3-topk1-tokens4", 2.25, [0.7, 0.6, 0.5], 0.9),
        metrics("mt_bench", "steps4-topk4-tokens10", 2.0, [0.6, 0.5, 0.4, 0.3], 0.5),
    ]
    paths = []
    for i, job in enumerate(jobs):
        paths.append(tmp_path / f"m{i}.json")
        paths[-1].write_text(json.dumps(job))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    curve = {"train": [{"step": s, "loss": 3.0 / s, "acc": [0.1 * s, 0.05 * s]} for s in range(1, 5)],
             "val": [{"step": 4, "acc": [0.3, 0.2]}]}
    (drafter / "training_curve.json").write_text(json.dumps(curve))
    out = {name: tmp_path / name for name in ("summary.tsv", "summary.json", "acc.png", "tau.png", "train.png")}
    summary = evaluate.summarize([str(p) for p in paths], drafter, *out.values())
    assert summary["headline"] == (
        "tau (steps3-topk1-tokens4): mt_bench 1.75, humaneval 2.25; speedup vs the target alone: 0.80x, 0.90x"
    )
    table = out["summary.tsv"].read_text().splitlines()
    assert len(table) == 4 and table[1].split("\t")[:6] == [
        "mt_bench", "steps3-topk1-tokens4", "decode", "2", "1.750", "0.50 0.40 -"]
    for name in ("acc.png", "tau.png", "train.png"):
        assert out[name].read_bytes()[:8] == PNG_MAGIC
    assert json.loads(out["summary.json"].read_text())["lossless"] is True


@pytest.fixture(scope="module")
def evaluated_workdir(tmp_path_factory, tiny_llama):
    """The evaluation rules on the tiny target with an untrained drafter, real eval sets."""
    from eaglenest.model import drafter as drafter_lib

    workdir = tmp_path_factory.mktemp("evaluate")
    (REPO / "resources").mkdir(exist_ok=True)
    os.symlink(REPO / "resources", workdir / "resources")  # share the fetched eval sets
    vocab_size = 320
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:64] = True
    drafter = drafter_lib.build_drafter(tiny_llama, {"d2t": torch.zeros(64, dtype=torch.int64), "t2d": t2d}, [1, 3, 4])
    drafter.save(workdir / "drafter")
    conversations = synthetic_conversations(workdir / "conversations.jsonl", 10)
    (workdir / "data").mkdir()
    user_chats(workdir / "data" / "support_chats.jsonl")  # relative to the workflow's directory, as a user writes it
    config = tiny_workflow_config(workdir, tiny_llama, conversations, evaluate={
        "drafter": str(workdir / "drafter"), "num_prompts": 2,
        "sets": ["mt_bench", {"name": "support", "path": "data/support_chats.jsonl", "num_prompts": None}],
        "max_new_tokens": 8, "temperature": 0, "threads": 1, "prompt_chunks": 2,
        "drafting": [{"steps": 2, "topk": 1, "tokens": 3}, {"steps": 2, "topk": 2, "tokens": 4}],
    })
    # A held-out set needs the run's data half (one shard here) for consolidate's split.
    values = yaml.safe_load(config.read_text())
    values["evaluate"]["sets"].append({"name": "heldout", "split": "val", "seed": 0})
    values["consolidate"]["val_fraction"] = 0.5
    config.write_text(yaml.safe_dump(values, sort_keys=False))
    result = run_snakemake(workdir, config, "--cores", "2", "results/tiny/evaluate/summary.json")
    return workdir, config, result


@pytest.mark.workflow
def test_every_evaluation_job_is_lossless_and_the_summary_lists_it(evaluated_workdir):
    workdir, _, _ = evaluated_workdir
    results = workdir / "results" / "tiny" / "evaluate"
    for eval_set in SETS:
        for drafting in ("steps2-topk1-tokens3", "steps2-topk2-tokens4"):
            job = json.loads((results / eval_set / drafting / "metrics.json").read_text())
            # The user set takes all of its 4 good prompts (its own num_prompts: null).
            assert job["lossless"] is True and job["prompts"] == (4 if eval_set == "support" else 2)
            assert job["eval_set"] == eval_set and job["chunks"] == 2
            parts = [json.loads((results / eval_set / drafting / "chunks" / f"{i}.json").read_text()) for i in (0, 1)]
            assert [p["id"] for part in parts for p in part["per_prompt"]] == [p["id"] for p in job["per_prompt"]]
            assert job["tau"] == job["tokens"] / job["cycles"] >= 1.0
    summary = json.loads((results / "summary.json").read_text())
    assert len(summary["rows"]) == 6 and summary["headline"].startswith("tau (steps2-topk1-tokens3): mt_bench")
    assert "support" in summary["headline"] and "heldout" in summary["headline"]


@pytest.mark.workflow
def test_a_user_set_gets_its_own_rows_and_its_bad_records_are_counted(evaluated_workdir):
    workdir, _, result = evaluated_workdir
    results = workdir / "results" / "tiny" / "evaluate"
    table = [line.split("\t") for line in (results / "summary.tsv").read_text().splitlines()[1:]]
    assert [(row[0], row[1], row[3]) for row in table if row[0] == "support"] == [
        ("support", "steps2-topk1-tokens3", "4"), ("support", "steps2-topk2-tokens4", "4")]
    job = json.loads((results / "support" / "steps2-topk1-tokens3" / "metrics.json").read_text())
    assert [p["id"] for p in job["per_prompt"]][:2] == ["support/o1", "support/o2"]
    # The multi-turn chat is evaluated with its earlier turns as context.
    single, multi = job["per_prompt"][0]["prompt_tokens"], job["per_prompt"][1]["prompt_tokens"]
    assert multi > single
    report = json.loads((results / "support" / "prompt_report.json").read_text())
    assert report["kept"] == 4 and report["rejected"] == {
        "duplicate_id": 1, "invalid_json": 1, "no_user_turn": 1, "unknown_role": 1}
    assert "eaglenest: eval set support: kept 4 of 8 records; rejected 4" in result.stderr


@pytest.mark.workflow
def test_adding_a_user_set_plans_only_its_own_jobs_and_the_summary(evaluated_workdir, tmp_path):
    workdir, config, _ = evaluated_workdir
    assert planned_jobs(workdir, config, "results/tiny/evaluate/summary.json") == {}
    values = yaml.safe_load(config.read_text())
    values["evaluate"]["sets"].append({"name": "more", "path": "data/support_chats.jsonl"})
    more = tmp_path / "more.yaml"
    more.write_text(yaml.safe_dump(values, sort_keys=False))
    assert planned_jobs(workdir, more, "results/tiny/evaluate/summary.json") == {
        "evaluate_prompts": 1, "evaluate_drafting": 4, "evaluate_merge": 2, "evaluate_summary": 1}


@pytest.mark.workflow
def test_a_held_out_set_measures_the_runs_own_validation_conversations(evaluated_workdir):
    workdir, _, _ = evaluated_workdir
    run = workdir / "results" / "tiny"
    val = json.loads((run / "consolidated" / "split.json").read_text())["val"]
    job = json.loads((run / "evaluate" / "heldout" / "steps2-topk1-tokens3" / "metrics.json").read_text())
    expected = [f"heldout/{sample_id}" for sample_id in eval_sets.held_out_order(val, 0)][:2]
    assert [p["id"] for p in job["per_prompt"]] == expected and job["lossless"] is True


@pytest.mark.workflow
def test_a_user_set_without_a_usable_prompt_stops_the_run_with_its_path_and_reason(tmp_path, tiny_llama):
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 10)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "greetings.jsonl").write_text(
        json.dumps({"id": "a", "conversations": [{"from": "gpt", "value": "Hello!"}]}) + "\n")
    config = tiny_workflow_config(tmp_path, tiny_llama, conversations, evaluate={
        "sets": [{"name": "greetings", "path": "data/greetings.jsonl"}]})
    result = run_snakemake(tmp_path, config, "--cores", "1", "results/tiny/evaluate/greetings/prompts.jsonl", check=False)
    assert result.returncode != 0
    assert ("eaglenest: eval set 'greetings': no usable prompt in data/greetings.jsonl: "
            "all 1 records rejected (no_user_turn 1)") in result.stderr


@pytest.mark.workflow
def test_the_report_builds_with_the_evaluation_plots(evaluated_workdir):
    workdir, config, _ = evaluated_workdir
    run_snakemake(workdir, config, "--report", "report.html", "results/tiny/evaluate/summary.json")
    html = (workdir / "report.html").read_text(errors="replace")
    for name in ("acceptance_by_position.png", "tau.png", "training_curve.png", "summary.tsv", "prompt_report.json"):
        assert name in html
    assert "Acceptance length tau per eval set" in html


@pytest.mark.workflow
def test_replay_jobs_give_the_decoding_jobs_traces(evaluated_workdir):
    """evaluate.method replay through the workflow: one reference job per chunk, shared by both
    drafting settings, and per-prompt cycles equal to the decoding run's, on a built-in set and
    on the user's chats. (A held-out set is replayed the same way; leaving it out spares this
    run the data stages that its split needs.)"""
    workdir, config, _ = evaluated_workdir
    values = yaml.safe_load(config.read_text())
    values["run"] = "tiny-replay"
    values["evaluate"]["method"] = "replay"
    replayed_sets = ("mt_bench", "support")
    values["evaluate"]["sets"] = [entry for entry in values["evaluate"]["sets"]
                                  if (entry if isinstance(entry, str) else entry["name"]) in replayed_sets]
    replay = workdir / "replay.yaml"
    replay.write_text(yaml.safe_dump(values, sort_keys=False))
    run_snakemake(workdir, replay, "--cores", "2", "results/tiny-replay/evaluate/summary.json")
    decoded, replayed = (workdir / "results" / run / "evaluate" for run in ("tiny", "tiny-replay"))
    assert sorted(p.name for p in (replayed / "mt_bench" / "reference" / "chunks").iterdir()) == ["0.json", "1.json"]
    assert not (workdir / "results" / "tiny-replay" / "hidden").exists()  # no data stage ran
    for eval_set in replayed_sets:
        for drafting in ("steps2-topk1-tokens3", "steps2-topk2-tokens4"):
            one, other = (json.loads((root / eval_set / drafting / "metrics.json").read_text()) for root in (decoded, replayed))
            assert other["method"] == "replay" and other["speedup"] is None and other["prompts"] == one["prompts"]
            assert other["tau"] == one["tau"]
            assert [(p["id"], p["accepted"], p["draft_depths"], p["new_tokens"]) for p in other["per_prompt"]] == \
                [(p["id"], p["accepted"], p["draft_depths"], p["new_tokens"]) for p in one["per_prompt"]]
            assert other["reference_inconsistent_prompts"] == []
    summary = json.loads((replayed / "summary.json").read_text())
    assert "replayed on the target's greedy output" in summary["headline"]
