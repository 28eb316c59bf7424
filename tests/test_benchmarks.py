"""CPU smoke of the training benchmark: both steps run, the table and the JSON carry the ratio."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def test_train_throughput_times_eaglenest_and_the_eager_ceiling_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--shape", "smollm2", "--device", "cpu",
         "--ttt-length", "2", "--token-budget", "128", "--sample-len", "128", "--rows", "1", "--steps", "2",
         "--warmup", "1", "--threads", "1", "--samples-per-shard", "1", "--ceiling", "--profile", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [("ceiling" in r.get("step", "")) for r in runs] == [False, True], runs
    assert all(r["tokens_per_s"] > 0 and "error" not in r for r in runs)
    assert runs[1]["eaglenest_over_ceiling"] > 0
    profile = runs[0]["profile"]  # the operators that took the time, largest first
    assert profile and all(row["ms"] >= 0 and row["calls"] > 0 for row in profile)
    assert [row["ms"] for row in profile] == sorted((row["ms"] for row in profile), reverse=True)
    assert "x ceiling" in result.stdout


def test_train_throughput_times_two_ddp_processes_against_one_at_the_same_global_batch(tmp_path):
    """--processes 1 --processes 2: the same data and initial weights, trained in this process
    and under torchrun (gloo on a CPU); the two-process run reports its tokens/s over the
    one-process run's and how far its loss curve is from it."""
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--shape", "smollm2", "--device", "cpu",
         "--ttt-length", "2", "--token-budget", "128", "--sample-len", "64", "--rows", "2", "--steps", "4",
         "--warmup", "1", "--threads", "1", "--samples-per-shard", "4", "--processes", "1", "--processes", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r.get("processes") for r in runs] == [1, 2], runs
    one, two = runs
    assert len(one["losses"]) == len(two["losses"]) == 4
    assert two["tokens_per_s_over_one_process"] > 0
    assert two["loss_max_rel_diff_vs_one_process"] < 1e-4, (one["losses"], two["losses"])
    assert "x 1 proc" in result.stdout


def _chunk(eval_set: str, chunk: int, chunks: int, traces: dict, categories: dict | None = None) -> dict:
    return {"eval_set": eval_set, "chunk": [chunk, chunks], "device": "cpu", "dtype": "float32", "method": "replay",
            "per_prompt": [{"id": pid, "accepted": accepted, "draft_depths": [3] * len(accepted), "cycles": len(accepted),
                            "category": (categories or {}).get(pid)}
                           for pid, accepted in traces.items()]}


def test_tau_table_pairs_runs_over_the_prompts_both_have_and_says_when_chunks_are_missing(tmp_path):
    """One run merged (metrics.json), the other with a chunk missing: the paired row uses the
    prompts both have and names the chunks it read."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import tau_table

    traces = [{"a": [3, 0], "b": [1, 1]}, {"c": [2, 2, 0]}]
    first, second = tmp_path / "first" / "evaluate", tmp_path / "second" / "evaluate"
    for run, chunks in ((first, (0, 1)), (second, (0,))):
        job = run / "mt_bench" / "steps3-topk1-tokens4"
        (job / "chunks").mkdir(parents=True)
        for c in chunks:
            (job / "chunks" / f"{c}.json").write_text(json.dumps(_chunk("mt_bench", c, 2, traces[c],
                                                                        {"a": "writing", "b": "math", "c": "writing"})))
    merged = tau_table.read_job(first / "mt_bench" / "steps3-topk1-tokens4")
    (first / "mt_bench" / "steps3-topk1-tokens4" / "metrics.json").write_text(json.dumps(merged))
    out = tmp_path / "tau.json"
    tau_table.main(str(out), str(first), str(second))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["prompts"] == 2  # a and b: c is in the first run only
    assert row["runs"]["second"]["chunks_merged"] == [1, 2]
    assert row["runs"]["first"]["tau"] == row["runs"]["second"]["tau"] == (3 + 0 + 1 + 1 + 4) / 4  # (accepted + bonus tokens) / cycles
    assert row["runs"]["second"]["minus_first"]["mean"] == 0
    # --by-category: the same row, then one per category over its own prompts (c is in one run only).
    tau_table.main("--by-category", str(out), str(first), str(second))
    rows = json.loads(out.read_text())["rows"]
    assert [r.get("category") for r in rows] == [None, "math", "writing"]
    assert rows[0]["runs"]["first"]["tau"] == row["runs"]["first"]["tau"]
    assert rows[1]["prompts"] == rows[2]["prompts"] == 1
    assert rows[1]["runs"]["first"]["tau"] == (1 + 1 + 2) / 2 and rows[2]["runs"]["second"]["tau"] == (3 + 0 + 2) / 2
    # --without-loops: refused without the first run's references; with them, a row of the
    # prompts whose reference does not fall into three copies of a span (a's does: 5..10 three times).
    with pytest.raises(SystemExit, match="no reference chunks"):
        tau_table.main("--without-loops", str(out), str(first), str(second))
    (first / "mt_bench" / "reference" / "chunks").mkdir(parents=True)
    (first / "mt_bench" / "reference" / "chunks" / "0.json").write_text(json.dumps({"per_prompt": [
        {"id": "a", "tokens": [1, 2] + [5, 6, 7, 8, 9, 10] * 3}, {"id": "b", "tokens": list(range(1, 21))}]}))
    tau_table.main("--without-loops", str(out), str(first), str(second))
    rows = json.loads(out.read_text())["rows"]
    assert [r.get("category") for r in rows] == [None, "no loop"] and rows[1]["prompts"] == 1
    assert rows[1]["runs"]["first"]["tau"] == (1 + 1 + 2) / 2  # b alone


def test_same_references_finds_every_trace_equal_and_fails_on_one_that_differs(tmp_path):
    """benchmarks/same_references.py: a drafter replayed on other references is the same only
    if every prompt's trace is; one changed acceptance, or a job missing, fails it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import same_references

    traces = {"a": [3, 0], "b": [1, 1]}
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"
    for run in (recorded, replayed):
        job = run / "mt_bench" / "steps3-topk1-tokens4"
        job.mkdir(parents=True)
        metrics = {"tau": 2.0, "per_prompt": [{"id": i, "accepted": a, "draft_depths": [3] * len(a), "cycles": len(a)}
                                              for i, a in traces.items()]}
        (job / "metrics.json").write_text(json.dumps(metrics))
    out = tmp_path / "check.json"
    assert same_references.main(["--replayed", str(replayed), "--recorded", str(recorded), "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["prompts"], row["traces_identical"]) == (2, 2)
    job = replayed / "mt_bench" / "steps3-topk1-tokens4" / "metrics.json"
    metrics = json.loads(job.read_text())
    metrics["per_prompt"][1]["accepted"] = [1, 0]
    job.write_text(json.dumps(metrics))
    assert same_references.main(["--replayed", str(replayed), "--recorded", str(recorded), "--out", str(out)]) == 1
    assert json.loads(out.read_text())["rows"][0]["traces_identical"] == 1
    job.unlink()
    assert same_references.main(["--replayed", str(replayed), "--recorded", str(recorded), "--out", str(out)]) == 1


def test_heldout_eval_set_takes_the_splits_validation_conversations_in_a_fixed_order(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import heldout_eval_set

    ids = [f"sharegpt:c{k}" for k in range(10)]
    (tmp_path / "split.json").write_text(json.dumps({"train": ids[:6], "val": ids[6:]}))
    (tmp_path / "conv.jsonl").write_text("".join(
        json.dumps({"sample_id": i, "messages": [{"role": "user", "content": i}]}) + "\n" for i in ids))
    out = tmp_path / "heldout.jsonl"
    assert heldout_eval_set.main(["--split", str(tmp_path / "split.json"), "--conversations", str(tmp_path / "conv.jsonl"),
                                  "--count", "3", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and {row["id"] for row in rows} < set(ids[6:])
    assert rows == heldout_eval_set.heldout(tmp_path / "split.json", tmp_path / "conv.jsonl", None)[:3]
    assert rows[0]["messages"] == [{"role": "user", "content": rows[0]["id"]}]
    # The same conversations from a regenerated folder's shards (several files): same ids, same
    # order, the target's answers.
    for shard, part in enumerate((ids[:5], ids[5:])):
        (tmp_path / f"shard-{shard:05d}.jsonl").write_text("".join(json.dumps(
            {"sample_id": i, "messages": [{"role": "user", "content": i}, {"role": "assistant", "content": "again"}]}) + "\n"
            for i in part))
    assert heldout_eval_set.main(["--split", str(tmp_path / "split.json"), "--conversations",
                                  str(tmp_path / "shard-00000.jsonl"), str(tmp_path / "shard-00001.jsonl"),
                                  "--count", "3", "--out", str(out)]) == 0
    regenerated = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in regenerated] == [row["id"] for row in rows]
    assert all(row["messages"][1]["content"] == "again" for row in regenerated)


def test_heldout_eval_set_splits_as_consolidation_keeps_whole_conversations_and_cuts_first_answers(tmp_path, tiny_llama):
    """Without split.json the split is consolidation's (in_validation); --whole-only drops held-out
    parts whose conversation has a part in training; --first-answer-tokens keeps the first user
    turn and its answer's first N tokens by the target's tokenizer."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import heldout_eval_set
    from transformers import AutoTokenizer

    from eaglenest.stages.consolidate import in_validation

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    answer = " ".join(f"word{k}" for k in range(60))
    ids = [f"sharegpt:c{k}_{part}" for k in range(40) for part in range(3)]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "question"},
                {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    (tmp_path / "conv.jsonl").write_text("".join(
        json.dumps({"sample_id": i, "messages": messages}) + "\n" for i in ids))
    val = {i for i in ids if in_validation(i, 0.3, 5)}
    whole = {i for i in val if all(f"{i.rsplit('_', 1)[0]}_{p}" in val for p in range(3))}
    assert val and whole < val  # both kinds of held-out part
    out = tmp_path / "heldout.jsonl"
    args = ["--conversations", str(tmp_path / "conv.jsonl"), "--val-fraction", "0.3", "--seed", "5", "--out", str(out)]
    assert heldout_eval_set.main(args) == 0
    assert {json.loads(line)["id"] for line in out.read_text().splitlines()} == val
    assert heldout_eval_set.main([*args, "--whole-only", "--first-answer-tokens", "7", "--tokenizer", str(tiny_llama)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {row["id"] for row in rows} == whole
    first = rows[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant"] and first[0]["content"] == "question"
    cut = tokenizer(answer, add_special_tokens=False)["input_ids"][:7]
    assert first[1]["content"] == tokenizer.decode(cut) and answer.startswith(first[1]["content"].strip()[:10])
    # --training takes every conversation consolidation trains on, cut the same way.
    assert heldout_eval_set.main([*args, "--training", "--first-answer-tokens", "7", "--tokenizer", str(tiny_llama)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {row["id"] for row in rows} == set(ids) - val and rows[0]["messages"][1]["content"] == tokenizer.decode(cut)
    with pytest.raises(SystemExit):  # --whole-only is a held-out selection
        heldout_eval_set.main([*args, "--training", "--whole-only"])
    with pytest.raises(SystemExit):  # a split is given one way
        heldout_eval_set.main(["--conversations", str(tmp_path / "conv.jsonl"), "--out", str(out)])


def test_train_throughput_writes_every_sample_when_fewer_than_a_shard_holds(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import train_throughput

    from eaglenest.formats import shards

    shape = train_throughput.shape_of("smollm2", None)
    hidden, prepared = train_throughput.write_shards(tmp_path, shape, samples=11, sample_len=16, per_shard=8, seed=0)
    counts = [len(shards.ShardReader.open(path).sample_ids) for path in hidden]
    assert counts == [8, 3] and len(prepared) == 2


def _curve(steps: int, epochs: int, accs: list[float]) -> dict:
    """A training curve as train writes one: epochs counted from 0, a validation every few steps."""
    per_epoch = steps // epochs
    return {
        "summary": {"steps": steps},
        "train": [{"step": s, "epoch": (s - 1) // per_epoch, "lr": 1e-3 * s / steps} for s in range(1, steps + 1)],
        "val": [{"step": (i + 1) * steps // len(accs), "acc": [a] * 7} for i, a in enumerate(accs)],
    }


def test_warm_start_chain_puts_each_run_after_the_epochs_before_it(tmp_path):
    """Run a (2 epochs of 10 steps) then run b (a gzipped curve, 1 epoch of 4 steps): b's
    validations land at epochs 2.5 and 3, and b's start is marked at epoch 2."""
    import gzip

    sys.path.insert(0, str(REPO / "benchmarks"))
    import plot_warm_start_chain

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "training_curve.json").write_text(json.dumps(_curve(20, 2, [0.1, 0.2])))
    (tmp_path / "b").mkdir()
    with gzip.open(tmp_path / "b" / "training_curve.json.gz", "wt") as handle:
        json.dump(_curve(4, 1, [0.3, 0.4]), handle)
    points, rates, starts = plot_warm_start_chain.chain([tmp_path / "a", tmp_path / "b"])
    assert [(p["run"], p["epoch"], p["acc"][0]) for p in points] == [
        ("a", 1.0, 0.1), ("a", 2.0, 0.2), ("b", 2.5, 0.3), ("b", 3.0, 0.4)]
    assert starts == [0.0, 2.0]
    assert rates[-1] == (3.0, 1e-3)
    plot_warm_start_chain.main(str(tmp_path / "chain.png"), str(tmp_path / "a"), str(tmp_path / "b"))
    assert (tmp_path / "chain.png").stat().st_size > 0


def test_train_memory_counts_the_optimizer_exactly_and_recompute_lowers_the_peak(tmp_path):
    """The memory model of a step (fake tensors, CPU): AdamW's two float32 moments of every
    trainable parameter are live at the peak, byte for byte, and train.recompute_steps keeps less
    of the forward pass alive than the plain unroll on the same rows."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import train_memory

    shape = train_memory.train_throughput.shape_of("smollm2", None)
    plain = train_memory.model_step(shape, rows=2, row_tokens=256, ttt_length=3, recompute_steps=False)
    recomputed = train_memory.model_step(shape, rows=2, row_tokens=256, ttt_length=3, recompute_steps=True)
    moments = 2 * 4 * plain["trainable_parameters"]
    assert abs(plain["live_at_peak_gib_by_phase_made"]["optimizer"] * train_memory.GIB - moments) < 1024
    assert plain["peak_gib"] * train_memory.GIB > moments + 4 * plain["trainable_parameters"]
    forward = {name: run["live_at_peak_gib_by_phase_made"].get("forward", 0.0) for name, run in
               (("plain", plain), ("recomputed", recomputed))}
    assert forward["recomputed"] < forward["plain"], forward
    assert recomputed["peak_gib"] < plain["peak_gib"]
    out = tmp_path / "memory.json"
    train_memory.main(["--shape", "smollm2", "--rows", "1", "--token-budget", "128", "--ttt-length", "2",
                       "--out", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    assert run["shape"] == "smollm2" and run["live_at_peak"][0]["gib"] >= run["live_at_peak"][-1]["gib"]
    # The operator count: each phase's, and the drafter's modules in the forward pass.
    assert set(run["operators_per_step"]) == {"target head", "forward", "backward", "next batch", "optimizer"}
    assert run["operators_per_step"]["optimizer"] <= 4  # fused AdamW, not a loop over parameters
    assert sum(run["forward_operators_by_module"].values()) == run["operators_per_step"]["forward"]
    assert run["forward_operators_by_module"]["midlayer.self_attn"] > 0


def test_compile_time_benchmark_compiles_every_ttt_step_with_no_graph_break(tmp_path):
    """benchmarks/compile_time.py, small: one graph per TTT step and one for the final norm,
    none broken, timed from an empty inductor cache, with the code of this checkout."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import compile_time

    out = tmp_path / "compile.json"
    compile_time.main(["--shape", "smollm2", "--hidden", "64", "--tokens", "16", "--ttt-length", "2", "--out", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    assert run["graphs"] == 3 and run["graph_breaks"] == 0, run
    assert 0 < run["forward_seconds"] <= run["first_step_seconds"]
    assert Path(run["eaglenest"]) == REPO


def test_train_step_anatomy_times_the_phases_the_ablations_and_the_ceiling_on_cpu(tmp_path):
    """benchmarks/train_step_anatomy.py, small, on the CPU: eaglenest's step phase by phase (the
    marks of eaglenest.training.loop.train_step), each ablation against the whole step, the ceiling step, and a
    profile of both by kind."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import train_step_anatomy

    out = tmp_path / "anatomy.json"
    train_step_anatomy.main(["--shape", "smollm2", "--device", "cpu", "--rows", "2", "--token-budget", "64",
                             "--sample-len", "32", "--ttt-length", "3", "--steps", "2", "--warmup", "1",
                             "--profile-steps", "1", "--threads", "2", "--out", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    ours = run["eaglenest"]
    assert list(ours["phase_seconds"]) == ["to device", "target head", "forward", "backward", "clip", "optimizer"]
    assert all(seconds > 0 for seconds in ours["phase_seconds"].values())
    assert sum(ours["phase_seconds"].values()) <= ours["wall_seconds_per_step"] * 1.05
    assert list(run["ceiling"]["phase_seconds"]) == ["forward", "backward", "optimizer"]
    assert set(run["ablations"]) == set(train_step_anatomy.ABLATIONS)
    for ablation in run["ablations"].values():
        assert ablation["wall_seconds_per_step"] > 0
    assert run["eaglenest_over_ceiling"] == pytest.approx(
        run["ceiling"]["wall_seconds_per_step"] / ours["wall_seconds_per_step"])
    assert ours["kernels"]["busy_seconds_per_step"] > 0 and ours["kernels"]["top"]
    # With --compile, the parts inside the compiled layer are not taken out (each would recompile it).
    assert len(train_step_anatomy.INSIDE_THE_LAYER) == 2 < len(train_step_anatomy.ABLATIONS)
    # The ablations patch only while they run.
    from eaglenest.model import kernels
    assert kernels.merge_diagonal_keys.__name__ == "merge_diagonal_keys"


def test_loss_chunk_benchmark_times_each_variant_and_checks_it_against_the_eager_chunk(tmp_path):
    """benchmarks/loss_chunk.py on the CPU: every variant of the loss chunk timed at each shape,
    with the same hits and loss as the eager chunk."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import loss_chunk

    out = tmp_path / "loss_chunk.json"
    loss_chunk.main(["--device", "cpu", "--shape", "24x300", "--warmup", "1", "--calls", "2", "--out", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert (result["rows"], result["vocab"]) == (24, 300)
    assert set(result["variants"]) == set(loss_chunk.VARIANTS)
    for run in result["variants"].values():
        assert run["ms_per_call"] > 0 and run["same_hits"] and run["loss_rel_diff"] < 1e-5
        assert run["grad_max_abs_diff"] < 1e-2


def test_loader_speed_times_the_loader_beside_a_baseline_checkout_with_the_same_batches(tmp_path):
    """benchmarks/loader_speed.py on the CPU, this checkout as its own baseline: both loaders
    timed, and their batches equal."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import loader_speed

    out = tmp_path / "loader_speed.json"
    loader_speed.main(["--shape", "smollm2", "--rows", "2", "--token-budget", "64", "--sample-len", "30",
                       "--steps", "2", "--repeats", "2", "--baseline", str(REPO), "--out", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert result["same_batches"] and result["batches_timed"] == 2
    assert result["eaglenest"]["median_ms"] > 0 and result["baseline"]["median_ms"] > 0


def test_sglang_engine_pieces_that_need_no_server_run_on_cpu(tmp_path, tiny_llama, capsys):
    """benchmarks/sglang_engine.py without SGLang: the random target, the shard subset, the
    disk ceiling, the shard comparison and the summary against the tighter ceiling."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import pyspy_profiles
    import sglang_engine
    import torch

    from eaglenest.formats import shards
    from eaglenest.stages import extract

    target = tmp_path / "random"
    assert sglang_engine.main(["random-target", "--config-dir", str(tiny_llama), "--out", str(target)]) == 0
    assert (target / "model.safetensors").exists() and (target / "tokenizer.json").exists()
    generator = torch.Generator().manual_seed(0)
    rows = [{"sample_id": f"s:{i}", "input_ids": torch.randint(5, 200, (20 + 7 * i,), generator=generator).tolist(),
             "loss_mask": [1] * (20 + 7 * i)} for i in range(5)]
    prepared = tmp_path / "prepared" / "shard-00000.safetensors"
    prepared.parent.mkdir()
    shards.write_prepared_shard(prepared, 0, rows, {"target": "tiny"})
    subset = sglang_engine.subset_shard(prepared, 3, tmp_path / "subset" / "shard-00000.safetensors")
    reader = shards.verify_shard(subset, deep=True)
    assert reader.sample_ids == ["s:0", "s:1", "s:2"] and reader.token_counts == [20, 27, 34]
    assert sglang_engine.subset_shard(prepared, 0, tmp_path / "all.safetensors") == prepared
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    disk = sglang_engine.measure_disk(subset, hidden, 3, "float8_e4m3", tmp_path)
    assert disk["tokens"] == 81 and disk["tokens_per_s"] > 0 and not list(tmp_path.glob("disk-probe-*"))
    for name in ("a", "b"):
        extract.extract_shard(subset, tmp_path / name / "shard-00000.safetensors", str(target), "random", "default",
                              device="cpu", check_disk=False)
    comparison = sglang_engine.compare_on_gpu(tmp_path / "a" / "shard-00000.safetensors",
                                              tmp_path / "b" / "shard-00000.safetensors", subset, samples=2)
    assert comparison["samples"] == 2 and comparison["tokens"] == 47 and comparison["same_samples"]
    assert all(t["min_row_cosine"] > 0.9999 and t["mean_relative_diff"] == 0 for k, t in comparison["tensors"].items()
               if "hidden" in k)
    result = {"shape": "smollm2", "target_params_b": 0.1, "ceiling": {"tokens_per_s": 400.0, "samples": 3, "tokens": 81},
              "disk": {"bfloat16": {"tokens_per_s": 300.0}}, "patched": {"bfloat16": {"tokens_per_s_written": 150.0,
                                                                                       "tokens_per_s": 151.0}},
              "transformers": {"bfloat16": {"tokens_per_s": 200.0}}}
    result["summary"] = sglang_engine.summary(result)
    row = result["summary"]["dtypes"]["bfloat16"]
    assert row["ceiling_tokens_per_s"] == 300.0 and row["ratio"] == 0.5  # the disk is the tighter ceiling here
    (tmp_path / "result.json").write_text(json.dumps(result))
    assert sglang_engine.main(["table", str(tmp_path / "result.json")]) == 0
    assert "| smollm2 | 0.1B | 3 | 81 | bfloat16 | 400 | 300 | 150 | 0.50 | 200 |" in capsys.readouterr().out
    result["patched_windows"] = [{"samples_per_request": 8, "tokens_in_flight": 131072, "tokens_per_s_written": 270.0}]
    assert sglang_engine.summary(result)["windows"] == [
        {"samples_per_request": 8, "tokens_in_flight": 131072, "patched_tokens_per_s": 270.0, "ratio": 0.9}]
    # py-spy's raw output: collapsed stacks per thread, summarized into where each thread's time goes.
    raw = tmp_path / "scheduler.txt"
    raw.write_text("thread (0x1) main;event_loop (s.py:1);forward (m.py:2) 30\n"
                   "thread (0x1) main;event_loop (s.py:1);synchronize (u.py:3) 60\n"
                   "thread (0x1) main;event_loop (s.py:1);forward (m.py:2) 10\n"
                   "thread (0x2) spool;_write (spool.py:9) 100\nnot a stack line\n")
    profile = pyspy_profiles.summarize(raw)
    assert profile["samples"] == 200
    main, spool = profile["threads"]
    assert main == {"thread": "thread (0x1) main", "share": 0.5,
                    "top": [["synchronize (u.py:3)", 0.6], ["forward (m.py:2)", 0.4]],
                    "inclusive": [["event_loop (s.py:1)", 1.0], ["synchronize (u.py:3)", 0.6], ["forward (m.py:2)", 0.4]]}
    assert spool["top"] == [["_write (spool.py:9)", 1.0]]


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_spool_path_runs_the_client_against_an_instant_server_beside_the_disk(tmp_path, packed):
    out = tmp_path / "spool.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "spool_path.py"), "--hidden", "64", "--samples", "6",
         "--samples-per-request", "4", "--concurrency", "2", "--work", str(tmp_path / "work"), "--out", str(out),
         *(["--packed"] if packed else [])],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["client"]["samples"] == 6 and report["client"]["requests"] == 2
    assert report["disk"]["tokens"] == report["client"]["tokens"] and report["ratio_to_disk"] > 0
    assert not list((tmp_path / "work" / "hidden").glob("*")), "the measured shard is removed"


def test_a_speculative_cycle_is_split_into_draft_steps_and_the_rest_by_two_chains():
    """benchmarks/sglang_serve.py cycle_costs: at batch 1, plain 700 tokens/s is a 1.43 ms step;
    chains of 3 and 7 steps whose cycles cost 4 and 6 ms cost 0.5 ms a draft step and 2.5 ms
    besides; a tree's accept length of 3.7 over those 2.5 ms bounds its speedup at 2.11x."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import sglang_serve

    def row(drafting, tokens_per_s, accept_length=None, concurrency=1):
        return {"drafting": drafting, "concurrency": concurrency, "tokens_per_s": tokens_per_s, "accept_length": accept_length}

    rows = [row("plain", 700.0), row("steps3-topk1-tokens4", 2.2 / 0.004, 2.2), row("steps7-topk1-tokens8", 2.5 / 0.006, 2.5),
            row("steps6-topk10-tokens60", 3.7 / 0.0055, 3.7), row("plain", 5000.0, concurrency=8)]
    cycle = sglang_serve.cycle_costs(rows)
    assert cycle["plain_step_ms"] == round(1000 / 700, 3)
    chain = cycle["settings"]["steps3-topk1-tokens4"]
    assert chain["cycle_ms"] == 4.0 and chain["speedup"] == round(2.2 * (1000 / 700) / 4.0, 3)
    assert cycle["split"] == {"from_chains": [3, 7], "draft_step_ms": 0.5, "rest_of_cycle_ms": 2.5,
                              "rest_in_plain_steps": round(2.5 / cycle["plain_step_ms"], 3)}
    assert cycle["settings"]["steps6-topk10-tokens60"]["speedup_bound"] == round(cycle["plain_step_ms"] * 3.7 / 2.5, 3)
    assert sglang_serve.cycle_costs([row("steps3-topk1-tokens4", 500.0, 2.0)]) is None  # no plain server
    # The chain search: a 5-step chain's cycle is 2.5 + 5 x 0.5 = 5 ms; with a replay tau of 2.5 it
    # is expected at 1.43 x 2.5 / 5 = 0.71x, behind the 3-step chain's 1.43 x 2.2 / 4 = 0.79x.
    found = sglang_serve.chain_search(cycle, {"steps3-topk1-tokens4": 2.2, "steps5-topk1-tokens6": 2.5,
                                              "steps6-topk10-tokens60": 3.9})
    assert [r["drafting"] for r in found] == ["steps3-topk1-tokens4", "steps5-topk1-tokens6"]  # chains only
    assert found[1]["expected_cycle_ms"] == 5.0
    assert found[1]["expected_speedup"] == round(cycle["plain_step_ms"] * 2.5 / 5.0, 3)
    assert found[0]["served_speedup"] == chain["speedup"] and found[1]["served_speedup"] is None
    assert sglang_serve.chain_search(None, {"steps3-topk1-tokens4": 2.2}) == []
