"""evaluate.backend sglang through the real Snakefile: one server per drafting setting and a
plain one (rule evaluate_server, the launcher in serve mode), each a Snakemake service grouped
with its evaluate_sglang jobs. The server is the test suite's stand-in, started by the launcher
with the command line it builds for SGLang (EAGLENEST_SGLANG_COMMAND): it loads the drafter's
SGLang export and decodes speculatively with eaglenest.model.speculate on the tiny target,
reporting its cycles in meta_info under SGLang's keys."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, planned_jobs, run_snakemake, snakemake_command, synthetic_conversations, tiny_workflow_config
from eaglenest.sglang import launch as sglang_launch
from eaglenest.stages import evaluate_server
from test_sglang_service import assert_no_server_left, processes_mentioning, run_logs

SETTINGS = ("steps2-topk1-tokens3", "steps3-topk1-tokens4")
SUMMARY = "results/tiny/evaluate/summary.json"


def sglang_export(workdir: Path, target: Path) -> Path:
    """An untrained drafter of the tiny target in SGLang's export format (the export stage's).

    The random target answers every prompt with one token repeated (103); the drafter's draft
    token 12 is mapped to it, so that the drafter is right at some positions and wrong at
    others (found by trying: other ids accept always or never), and tau is neither 1 nor the
    depth + 1."""
    from eaglenest.model import drafter as drafter_lib
    from eaglenest.stages import export

    t2d = torch.zeros(320, dtype=torch.bool)
    t2d[:64] = True
    d2t = torch.zeros(64, dtype=torch.int64)
    d2t[12] = 103 - 12  # target id = draft id + d2t
    torch.manual_seed(1)
    drafter = drafter_lib.build_drafter(target, {"d2t": d2t, "t2d": t2d}, [1, 3, 4])
    drafter.save(workdir / "drafter")
    export.export_drafter(workdir / "drafter", target, "tiny-llama", workdir / "export" / "sglang",
                          workdir / "export" / "vllm", workdir / "export" / "report.json", dtype="bfloat16",
                          include_embed_tokens=False)
    return workdir / "export" / "sglang"


def server_run(workdir: Path, target: Path, spool: Path, **evaluate) -> Path:
    conversations = synthetic_conversations(workdir / "conversations.jsonl", 10)
    settings = {
        "drafter": str(sglang_export(workdir, target)), "sets": ["mt_bench"], "num_prompts": 3, "max_new_tokens": 12,
        "temperature": 0, "drafting": [{"steps": 2, "topk": 1, "tokens": 3}, {"steps": 3, "topk": 1, "tokens": 4}],
        "backend": "sglang", "sglang": {"concurrency": [1, 2], "profile_steps": 4},
    }
    # spool_dir is unique to the test: it marks the test's server processes.
    return tiny_workflow_config(workdir, target, conversations, evaluate={**settings, **evaluate},
                                extract={"sglang": {"spool_dir": str(spool)}})


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_llama, sglang_standin):
    workdir = tmp_path_factory.mktemp("evaluate-sglang")
    spool = workdir / "spool"
    configfile = server_run(workdir, tiny_llama, spool)
    jobs = planned_jobs(workdir, configfile, SUMMARY)
    assert jobs["evaluate_server"] == 3 and jobs["evaluate_sglang"] == 3 and jobs["evaluate_merge"] == 2, jobs
    started = time.monotonic()
    result = run_snakemake(workdir, configfile, "--cores", "2", SUMMARY, check=False)
    assert result.returncode == 0, f"{result.stderr[-6000:]}\n{run_logs(workdir)}"
    print(f"3 stand-in servers, 1 set of 3 prompts at 2 concurrencies: {time.monotonic() - started:.0f} s")
    return workdir, configfile, spool


@pytest.mark.workflow
def test_each_setting_is_served_by_its_own_speculating_server_and_summarized(evaluated):
    workdir, configfile, spool = evaluated
    results = workdir / "results" / "tiny" / "evaluate"
    logs = workdir / "logs" / "tiny" / "sglang" / "evaluate"
    servers = {name: json.loads((logs / name / "server.json").read_text()) for name in ("plain", *SETTINGS)}
    assert len({server["pid"] for server in servers.values()}) == 3
    for name in SETTINGS:
        launcher_log = (logs / name / "launcher.log").read_text()
        # The launcher gave the server SGLang's EAGLE-3 flags for this setting and the run's export.
        steps, tokens = name[5], name[-1]
        assert (f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {workdir / 'export' / 'sglang'} "
                f"--speculative-num-steps {steps} --speculative-eagle-topk 1 --speculative-num-draft-tokens {tokens}"
                ) in launcher_log, launcher_log
        assert launcher_log.count("ready: ") == 1 and "stopped: " in launcher_log
    assert "--speculative" not in (logs / "plain" / "launcher.log").read_text()
    assert_no_server_left(spool, list(servers.values()))
    # The stand-in has no /start_profile: each part says so, and its measurements stand.
    for name in ("plain", *SETTINGS):
        part = json.loads((results / "mt_bench" / name / "server.json").read_text())
        assert part["profile"]["error"].startswith("RuntimeError: ") and "start_profile" in part["profile"]["error"]
        assert len(part["runs"]) == 2

    for name in SETTINGS:
        metrics = json.loads((results / "mt_bench" / name / "metrics.json").read_text())
        assert metrics["backend"] == "sglang" and metrics["prompts"] == 3 and metrics["lossless"] is True
        assert [c["concurrency"] for c in metrics["by_concurrency"]] == [1, 2]
        assert all(c["lossless"] and c["speedup"] > 0 for c in metrics["by_concurrency"])
        # tau counts the bonus token and not the prefill's; SGLang's accept length counts both.
        assert metrics["tau"] == metrics["tokens"] / metrics["cycles"] >= 1.0
        new_tokens = sum(p["new_tokens"] for p in metrics["per_prompt"])
        assert metrics["server_accept_length"] == pytest.approx(new_tokens / metrics["cycles"])
    summary = json.loads((results / "summary.json").read_text())
    assert [(r["drafting"], r["backend"], r["concurrency"]) for r in summary["rows"]] == [
        (name, "sglang", 1) for name in SETTINGS]
    assert summary["headline"].startswith(f"tau ({SETTINGS[0]}): mt_bench ")
    assert "; speedup vs the plain SGLang server at concurrency 1: " in summary["headline"], summary["headline"]
    header, *rows = [line.split("\t") for line in (results / "summary.tsv").read_text().splitlines()]
    assert header[:10] == ["eval_set", "drafting", "method", "prompts", "tau", "acceptance_by_position", "speedup",
                           "spec_tok_per_s", "target_tok_per_s", "lossless"]
    assert [row[header.index("backend")] for row in rows] == ["sglang", "sglang"]
    assert all(row[header.index("speedup_by_concurrency")].startswith("1:") for row in rows)
    assert planned_jobs(workdir, configfile, SUMMARY) == {}


@pytest.mark.workflow
def test_the_servers_accept_length_is_the_replay_tau_on_the_same_prompts(evaluated):
    """The same prompts, drafter and settings through the transformers evaluator's replay:
    per prompt the same verify steps, accepted drafts and tokens, and the server's speculative
    output is the target's greedy output."""
    workdir, configfile, _ = evaluated
    values = yaml.safe_load(configfile.read_text())
    values["run"] = "tiny-replay"
    values["evaluate"].update(backend="transformers", method="replay", threads=1)
    replay = workdir / "replay.yaml"
    replay.write_text(yaml.safe_dump(values, sort_keys=False))
    run_snakemake(workdir, replay, "--cores", "2", "results/tiny-replay/evaluate/summary.json")
    served, replayed = (workdir / "results" / run / "evaluate" / "mt_bench" for run in ("tiny", "tiny-replay"))
    reference = json.loads((replayed / "reference" / "chunks" / "0.json").read_text())["per_prompt"]
    for name in SETTINGS:
        server, transformers = (json.loads((root / name / "metrics.json").read_text()) for root in (served, replayed))
        assert server["tau"] == transformers["tau"] and server["cycles"] == transformers["cycles"]
        assert server["acceptance_by_position"] == transformers["acceptance_by_position"]
        # Some drafts accepted, some not: a count that only says 0 or always full could not tell.
        assert 0 < server["acceptance_by_position"][0] < 1 and 1 < server["tau"] < server["drafting"]["steps"] + 1
        for one, other in zip(server["per_prompt"], transformers["per_prompt"], strict=True):
            assert one["id"] == other["id"] and one["prompt_tokens"] == other["prompt_tokens"]
            assert one["cycles"] == other["cycles"] and one["new_tokens"] == other["new_tokens"]
            assert one["accepted"] == sorted(other["accepted"]) and one["accepted_drafts"] == sum(other["accepted"])
        part = json.loads((served / name / "server.json").read_text())
        for plain, outputs in zip(reference, part["runs"][0]["per_prompt"], strict=True):
            assert outputs["output_ids"] == plain["tokens"][: plain["output_length"]], plain["id"]

    # benchmarks/sglang_serve.py: the issue's table from these two runs' files.
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sglang_serve.py"), "--workdir", str(workdir),
                             "--run", "tiny", "--replay-run", "tiny-replay", "--gpu", "cpu", "--sweep-dir", str(replayed),
                             "--out", str(workdir / "serve.json")], capture_output=True, text=True, check=True)
    table = json.loads((workdir / "serve.json").read_text())
    assert table["gpu"] == "cpu" and table["drafter"]["path"] == str(workdir / "export" / "sglang")
    assert table["drafter"]["sha256"] == hashlib.sha256(
        (workdir / "export" / "sglang" / "model.safetensors").read_bytes()).hexdigest()
    rows = {(row["drafting"], row["concurrency"]): row for row in table["serve"]}
    assert sorted(rows) == sorted((name, c) for name in ("plain", *SETTINGS) for c in (1, 2))
    for name in SETTINGS:
        served_metrics, replayed_metrics = (json.loads((root / name / "metrics.json").read_text()) for root in (served, replayed))
        row = rows[name, 1]
        assert row["replay_tau"] == replayed_metrics["tau"] and row["tau"] == served_metrics["tau"]
        assert row["accept_length"] == served_metrics["server_accept_length"] and row["prompts"] == 3
        # The stand-in is started with the launcher's default flags: CUDA graphs on.
        assert row["cuda_graph"] is True and row["attention_backend"]
    assert rows["plain", 2]["accept_length"] is None and rows["plain", 2]["tokens_per_s"] > 0
    # Each setting's cycle in plain steps at batch 1 (benchmarks/sglang_serve.py cycle_costs).
    assert sorted(table["cycle"]["settings"]) == sorted(SETTINGS) and table["cycle"]["plain_step_ms"] > 0
    # The chain search over the replayed settings: both chains when the split leaves a positive
    # rest of the cycle (the stand-in's timing decides), each with its replay tau.
    if table["cycle"].get("split", {}).get("rest_of_cycle_ms", 0) > 0:
        assert sorted(r["drafting"] for r in table["chain_search"]) == sorted(SETTINGS)
        assert all(r["replay_tau"] == round(rows[r["drafting"], 1]["replay_tau"], 3) for r in table["chain_search"])
    else:
        assert table["chain_search"] == []
    assert result.stdout.splitlines()[0].startswith("drafting\tcuda graph\tattention")


@pytest.mark.workflow
def test_a_killed_run_measures_only_the_missing_settings(tmp_path, tiny_llama, sglang_standin):
    spool = tmp_path / "spool"
    configfile = server_run(tmp_path, tiny_llama, spool, sglang={"concurrency": [1]})
    parts = {name: tmp_path / "results" / "tiny" / "evaluate" / "mt_bench" / name / "server.json"
             for name in ("plain", *SETTINGS)}
    # --cores 1: a server's group counts its one thread, so one server runs at a time.
    process = subprocess.Popen(snakemake_command(tmp_path, configfile, "--cores", "1", SUMMARY), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    killed = False
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None:
            done = [name for name, path in parts.items() if path.exists()]
            # The launcher of a setting not measured yet runs (its --config-json names the spool):
            # the finished setting's group is done, the next one's server is up or starting.
            launchers = processes_mentioning(str(spool)).values()
            running = [name for name in parts if name not in done
                       and any(f"evaluate/{name}.json" in cmdline for cmdline in launchers)]
            if done and running:
                os.killpg(process.pid, signal.SIGKILL)  # Snakemake, its jobs and the launcher
                killed = True
                break
            time.sleep(0.05)
    finally:
        if process.poll() is None and not killed:
            os.killpg(process.pid, signal.SIGKILL)
        output = process.communicate(timeout=60)[0]
    assert killed, f"never saw one setting measured while another's server ran:\n{output[-4000:]}\n{run_logs(tmp_path)}"
    # The servers are in sessions of their own, out of reach of the kill; they die with their launchers.
    server_pids = [json.loads(path.read_text())["pid"]
                   for path in (tmp_path / "logs" / "tiny" / "sglang" / "evaluate").glob("*/server.json")]
    assert wait_for(lambda: not processes_mentioning(str(spool)) and not any(alive(pid) for pid in server_pids)), \
        "a server outlived the kill"
    finished = {name: path.read_bytes() for name, path in parts.items() if path.exists()}
    missing = [name for name in parts if name not in finished]
    assert missing
    # Servers only for the settings left to measure, none for a finished one.
    assert planned_jobs(tmp_path, configfile, SUMMARY) == {
        "evaluate_server": len(missing), "evaluate_sglang": len(missing), "evaluate_merge": 2, "evaluate_summary": 1}

    run_snakemake(tmp_path, configfile, "--unlock")
    run_snakemake(tmp_path, configfile, "--cores", "1", SUMMARY)
    for name, data in finished.items():
        assert parts[name].read_bytes() == data, name
    logs = tmp_path / "logs" / "tiny" / "sglang" / "evaluate"
    for name in missing:
        assert "ready: " in (logs / name / "launcher.log").read_text()
    assert json.loads((tmp_path / "results" / "tiny" / "evaluate" / "summary.json").read_text())["lossless"] is True
    assert planned_jobs(tmp_path, configfile, SUMMARY) == {}


@pytest.mark.workflow
def test_servers_started_by_hand_are_measured_at_their_urls_and_a_missing_url_is_refused(tmp_path, tiny_llama,
                                                                                          sglang_standin):
    """evaluate.sglang.start_server false: the user starts one server per setting with the
    launcher (--url), names them in evaluate.sglang.urls, and the workflow starts none."""
    import socket

    spool = tmp_path / "spool"
    setting = SETTINGS[0]
    configfile = server_run(tmp_path, tiny_llama, spool, drafting=[{"steps": 2, "topk": 1, "tokens": 3}],
                            sglang={"concurrency": [1], "start_server": False})

    def free_url() -> str:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return f"http://127.0.0.1:{probe.getsockname()[1]}"

    urls = {"plain": free_url(), setting: free_url()}
    values = yaml.safe_load(configfile.read_text())
    values["evaluate"]["sglang"]["urls"] = {"plain": urls["plain"]}
    configfile.write_text(yaml.safe_dump(values, sort_keys=False))
    refused = run_snakemake(tmp_path, configfile, "-n", SUMMARY, check=False)
    assert refused.returncode != 0 and f"missing: {setting}" in refused.stdout + refused.stderr, refused.stdout[-3000:]

    values["evaluate"]["sglang"]["urls"] = urls
    configfile.write_text(yaml.safe_dump(values, sort_keys=False))
    launcher = [sys.executable, "-m", "eaglenest.sglang.launch", "--configfile", str(configfile), "--mode", "serve"]
    drafting = ["--drafting-json", json.dumps({"steps": 2, "topk": 1, "tokens": 3}),
                "--draft-model", values["evaluate"]["drafter"]]
    launchers = {
        name: subprocess.Popen([*launcher, "--url", url, "--state-dir", str(tmp_path / "by-hand" / name),
                                *(drafting if name != "plain" else [])],
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        for name, url in urls.items()
    }
    try:
        assert wait_for(lambda: all((tmp_path / "by-hand" / name / "server.json").exists() for name in urls), 120), \
            {name: (tmp_path / "by-hand" / name / "launcher.log").read_text()[-2000:] for name in urls
             if (tmp_path / "by-hand" / name / "launcher.log").exists()}
        jobs = planned_jobs(tmp_path, configfile, SUMMARY)
        assert "evaluate_server" not in jobs and jobs["evaluate_sglang"] == 2, jobs
        result = run_snakemake(tmp_path, configfile, "--cores", "2", SUMMARY, check=False)
        assert result.returncode == 0, f"{result.stderr[-6000:]}\n{run_logs(tmp_path)}"
    finally:
        for process in launchers.values():
            process.terminate()
        for process in launchers.values():
            process.wait(timeout=60)
    served = json.loads((tmp_path / "by-hand" / setting / "server.json").read_text())
    assert served["url"] == urls[setting]
    results = tmp_path / "results" / "tiny" / "evaluate"
    part = json.loads((results / "mt_bench" / setting / "server.json").read_text())
    assert part["url"] == urls[setting], part["url"]
    metrics = json.loads((results / "mt_bench" / setting / "metrics.json").read_text())
    assert metrics["backend"] == "sglang" and metrics["lossless"] is True and metrics["tau"] >= 1.0
    assert not (tmp_path / "logs" / "tiny" / "sglang" / "evaluate").exists()  # no server of the workflow's own
    assert_no_server_left(spool, [served])


@pytest.mark.workflow
def test_the_gpu_serve_driver_plans_the_served_and_the_replayed_evaluation(tmp_path, tiny_llama, sglang_standin):
    """benchmarks/sglang_serve.sh with DRY_RUN=1: the configs it writes and the jobs they plan
    (the GPU run itself needs SGLang and a GPU)."""
    export = sglang_export(tmp_path, tiny_llama)
    prompts = tmp_path / "question.jsonl"
    prompts.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Another."]}) + "\n")
    environment = {**os.environ, "DRY_RUN": "1", "TARGET_DIR": str(tiny_llama), "DRAFTER": str(export),
                   "EVAL_PROMPTS": str(prompts), "WORK": str(tmp_path / "work"), "PYTHON": sys.executable,
                   "NUM_PROMPTS": "1"}
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "sglang_serve.sh"), str(tmp_path / "out")],
                            capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    served = yaml.safe_load((tmp_path / "out" / "serve.yaml").read_text())
    assert served["evaluate"]["backend"] == "sglang" and served["evaluate"]["sglang"]["concurrency"] == [1, 8, 32]
    assert [d["steps"] for d in served["evaluate"]["drafting"]] == [3, 7, 6]
    assert served["extract"]["sglang"]["extra_args"] == ["--dtype", "bfloat16", "--mem-fraction-static", "0.4"]
    replayed = yaml.safe_load((tmp_path / "out" / "serve-replay.yaml").read_text())
    assert replayed["evaluate"]["method"] == "replay" and replayed["evaluate"]["backend"] == "transformers"
    # Both runs' job tables (Snakemake may print one twice): served, then replayed.
    planned = {(parts[0], int(parts[1])) for line in (tmp_path / "out" / "steps.log").read_text().splitlines()
               if len(parts := line.split()) == 2 and parts[1].isdigit()}
    assert {("evaluate_server", 4), ("evaluate_sglang", 4), ("evaluate_merge", 3)} <= planned
    assert {("evaluate_reference", 1), ("evaluate_drafting", 3)} <= planned


def alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


def wait_for(predicate, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_the_speculative_server_command_carries_the_drafting_setting(tmp_path, monkeypatch):
    monkeypatch.delenv(sglang_launch.SERVER_COMMAND_ENV, raising=False)
    config = {"run": "r", "target": {"name": "t", "path": "/models/t", "tensor_parallel": 8}, "extract": {}}
    capture = {"tensor_parallel": 8, "mode": "serve"}
    speculative = {"draft_model": "/runs/r/export/sglang", "steps": 6, "topk": 10, "tokens": 60,
                   "extra_args": ["--speculative-draft-attention-backend", "triton"]}
    command = sglang_launch.launch_command(config, capture, python="python", speculative=speculative)
    assert command[:3] == ["python", "-m", "sglang.launch_server"]
    assert command[-12:] == [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/runs/r/export/sglang",
        "--speculative-num-steps", "6", "--speculative-eagle-topk", "10", "--speculative-num-draft-tokens", "60",
        "--speculative-draft-attention-backend", "triton"]
    plain = sglang_launch.launch_command(config, capture, python="python")
    assert not any(flag.startswith("--speculative") for flag in plain)
    with pytest.raises(ValueError, match="serve mode"):
        sglang_launch.launch_command(config, {**capture, "mode": "capture"}, speculative=speculative)
    monkeypatch.setenv(sglang_launch.SERVER_COMMAND_ENV, "apptainer exec sglang.sif python3 -m sglang.launch_server")
    wrapped = sglang_launch.launch_command(config, capture, speculative=speculative)
    assert wrapped[:6] == ["apptainer", "exec", "sglang.sif", "python3", "-m", "sglang.launch_server"]
    assert wrapped[6:] == command[3:]


def test_merge_refuses_parts_measured_at_other_concurrencies():
    def part(setting, concurrency):
        records = [{"id": "p", "category": "c", "prompt_tokens": 3, "output_ids": [1, 2], "completion_tokens": 2,
                    "seconds": 1.0, "spec_verify_ct": 1 if setting != "plain" else None,
                    "accepted_drafts": 0 if setting != "plain" else None,
                    "accept_histogram": [1] if setting != "plain" else None, "server_accept_length": None}]
        return {"backend": "sglang", "eval_set": "s", "setting": setting, "max_new_tokens": 2, "target": "t",
                "drafter": "d", "server": {}, "drafting": {"steps": 2, "topk": 1, "tokens": 3},
                "runs": [{"concurrency": c, "tokens_per_second": 2.0, "per_prompt": records} for c in concurrency]}

    metrics = evaluate_server.metrics_from_server_parts(part("steps2-topk1-tokens3", [1]), part("plain", [1]))
    assert metrics["tau"] == 1.0 and metrics["speedup"] == 1.0 and metrics["lossless"] is True
    with pytest.raises(ValueError, match="other concurrencies"):
        evaluate_server.metrics_from_server_parts(part("steps2-topk1-tokens3", [1, 8]), part("plain", [1]))


def sampled_server_regeneration_config(tmp_path, tiny_llama, run):
    """A tiny workflow's config that regenerates 20 conversations, sampled, through the server."""
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 20)
    workdir = tmp_path / "work"
    workdir.mkdir()
    return tiny_workflow_config(
        workdir, tiny_llama, conversations, run=run, data={"max_conversations": 20, "samples_per_shard": 10},
        regenerate={"enabled": True, "backend": "openai", "temperature": 0.8, "top_p": 0.95})


@pytest.mark.workflow
def test_the_gpu_round_plans_regeneration_then_the_served_drafter_with_the_carried_installs_flags(tmp_path, tiny_llama):
    """benchmarks/sglang_round.sh with DRY_RUN=1: regeneration's plan, then the serve run's,
    whose servers get the flags the carried install serves with (Triton attention, no prefill
    graphs) unless SERVER_ARGS says otherwise; the milestones the node's caller waits for."""
    configfile = sampled_server_regeneration_config(tmp_path, tiny_llama, "tiny-round-dry-run")
    export = sglang_export(tmp_path, tiny_llama)
    prompts = tmp_path / "question.jsonl"
    prompts.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Another."]}) + "\n")
    environment = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "EAGLENEST_SGLANG_COMMAND": "sglang-server",
                   "TARGET_DIR": str(tiny_llama), "DRAFTER": str(export), "EVAL_PROMPTS": str(prompts),
                   "WORK": str(tmp_path / "serve-work"), "NUM_PROMPTS": "1"}
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "sglang_round.sh"), str(out), str(configfile)],
                            capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (out / "round.log").read_text()
    assert log.index("regeneration starts") < log.index("regeneration rc=0") < log.index("serve starts") < log.index("serve rc=0")
    assert (out / "REGEN_DONE").exists() and (out / "DONE").exists()
    assert any(line.startswith("ceiling server: ") for line in (out / "regen" / "steps.log").read_text().splitlines())
    served = yaml.safe_load((out / "serve" / "serve.yaml").read_text())
    assert served["extract"]["sglang"]["extra_args"] == ["--dtype", "bfloat16", "--mem-fraction-static", "0.4",
                                                         "--attention-backend", "triton", "--sampling-backend", "pytorch",
                                                         "--disable-prefill-cuda-graph"]
    # ORDER: the served drafter first, then regeneration; a part it does not know stops the round
    out = tmp_path / "out-serve-first"
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "sglang_round.sh"), str(out), str(configfile)],
                            capture_output=True, text=True, env={**environment, "ORDER": "serve regen"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (out / "round.log").read_text()
    assert log.index("serve starts") < log.index("serve rc=0") < log.index("regeneration starts") < log.index("regeneration rc=0")
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "sglang_round.sh"), str(tmp_path / "out-bad"), str(configfile)],
                            capture_output=True, text=True, env={**environment, "ORDER": "serve train"})
    assert result.returncode == 2 and "unknown part train" in (tmp_path / "out-bad" / "round.log").read_text()
    assert not (tmp_path / "out-bad" / "DONE").exists()


@pytest.mark.workflow
def test_the_own_answers_round_plans_regeneration_with_the_gc_sweep_and_no_served_drafter(tmp_path, tiny_llama):
    """benchmarks/own_answers_round.sh with DRY_RUN=1: sglang_round.sh's regeneration only, its
    ceiling swept with Python's own --gc-threshold beside the config's, and the training it would
    start named in the log, not run; DONE at the end."""
    configfile = sampled_server_regeneration_config(tmp_path, tiny_llama, "tiny-own-answers-dry-run")
    environment = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "EAGLENEST_SGLANG_COMMAND": "sglang-server",
                   "REGEN_CONFIGS": str(configfile)}
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "own_answers_round.sh"), str(out)],
                            capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (out / "round.log").read_text()
    assert log.index("regeneration starts") < log.index("regeneration rc=0") < log.index("dry run: training")
    assert "config/h200/own-answers-seed1.yaml" in log and "serve starts" not in log
    assert (out / "DONE").exists()
    steps = (out / "regen" / "steps.log").read_text().splitlines()
    assert any(line.startswith("ceiling server: ") and line.endswith("--gc-threshold 700 10 10") for line in steps)
    # the training's Snakemake: a target right after its options stays a target, wherever run.sh puts one
    command = re.search(r'SNAKEMAKE="([^"]*)"', log).group(1).split()
    assert command[:3] == ["python3", "-m", "snakemake"]
    from snakemake.cli import get_argument_parser
    parsed = get_argument_parser().parse_args(command[3:] + ["resources/models/target", "--cores", "4"])
    assert parsed.targets == ["resources/models/target"]
    assert {getattr(trigger, "name", trigger).lower() for trigger in parsed.rerun_triggers} == {"mtime"}
