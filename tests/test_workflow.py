"""The real Snakefile on a tiny random-weight target: planning, reruns, crashes, corruption."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import (
    REPO, planned_jobs, run_snakemake, snakemake_command, synthetic_conversations, tiny_workflow_config, wait_until,
)
from eaglenest.formats import atomic
from eaglenest.stages import prepare

pytestmark = pytest.mark.workflow

SHARDS = [f"shard-{i:05d}.safetensors" for i in range(4)]
# The crash and corruption tests concern the data half; stopping there keeps them short.
DATA_HALF = ("hidden_states",)
UPSTREAM_OF_EXTRACT = {"ingest", "prepare"}


def hidden_dir(workdir: Path) -> Path:
    return workdir / "results" / "tiny" / "hidden"


def snapshot(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(directory.glob("shard-*.safetensors"))}


def new_workdir(tmp_path_factory, tiny_llama, name: str, **sections) -> tuple[Path, Path]:
    workdir = tmp_path_factory.mktemp(name)
    conversations = synthetic_conversations(workdir / "conversations.jsonl", 40)
    return workdir, tiny_workflow_config(workdir, tiny_llama, conversations, **sections)


@pytest.fixture(scope="module")
def finished_run(finished_tiny_run):
    return finished_tiny_run


def test_finished_run_has_every_shard_and_plans_nothing(finished_run):
    workdir, config = finished_run
    assert sorted(p.name for p in hidden_dir(workdir).iterdir()) == SHARDS
    assert planned_jobs(workdir, config) == {}


def test_cosmetic_changes_plan_no_extraction(finished_run, tmp_path):
    workdir, config = finished_run
    script = REPO / "scripts" / "extract_shard.py"
    stat = script.stat()
    settings = yaml.safe_load(config.read_text())
    settings["extract"].update(tokens_per_batch=77, device="cpu", preflight=False, threads=2, disk_reserve_mb=5)
    cosmetic = tmp_path / "cosmetic.yaml"
    cosmetic.write_text(yaml.safe_dump(settings))
    try:
        # A newer adapter script (the `code` rerun trigger) and speed-only settings.
        os.utime(script, (stat.st_atime, time.time() + 60))
        assert planned_jobs(workdir, cosmetic) == {}
    finally:
        os.utime(script, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    settings["consolidate"]["draft_vocab_size"] = 32
    later_stage = tmp_path / "later.yaml"
    later_stage.write_text(yaml.safe_dump(settings))
    planned = planned_jobs(workdir, later_stage)
    assert planned["consolidate"] == 1 and "extract_hidden_states" not in planned
    assert not UPSTREAM_OF_EXTRACT & set(planned)


def test_content_changes_plan_every_shard_again(finished_run, tmp_path):
    workdir, config = finished_run
    for section, key, value in [("extract", "dtype", "float16"), ("extract", "layer_ids", [1, 2, 3]), ("data", "max_len", 200)]:
        settings = yaml.safe_load(config.read_text())
        settings[section][key] = value
        changed = tmp_path / f"{key}.yaml"
        changed.write_text(yaml.safe_dump(settings))
        assert planned_jobs(workdir, changed).get("extract_hidden_states") == 4, key


def test_deleting_one_shard_plans_exactly_that_shard_and_its_dependents(tmp_path_factory, tiny_llama, finished_run):
    workdir, config = finished_run  # the config's sources stay where they are
    copy = tmp_path_factory.mktemp("deleted") / "w"
    shutil.copytree(workdir, copy, symlinks=True)
    (hidden_dir(copy) / SHARDS[2]).unlink()
    planned = planned_jobs(copy, config)
    # That shard, then everything downstream of the shards (consolidate, train, ...), nothing upstream.
    assert planned["extract_hidden_states"] == 1 and planned["consolidate"] == 1
    assert not UPSTREAM_OF_EXTRACT & set(planned)
    assert planned_jobs(copy, config, *DATA_HALF) == {"extract_hidden_states": 1, "consolidate": 1, "hidden_states": 1}


def test_corrupt_shard_is_detected_and_only_it_is_rebuilt(tmp_path_factory, tiny_llama, finished_run):
    reference_dir, config = finished_run
    workdir = tmp_path_factory.mktemp("corrupt") / "w"
    shutil.copytree(reference_dir, workdir, symlinks=True)
    victim = hidden_dir(workdir) / SHARDS[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    failed = run_snakemake(workdir, config, "--cores", "2", *DATA_HALF, check=False)
    assert failed.returncode != 0
    log = (workdir / "logs" / "tiny" / "consolidate.log").read_text()
    assert f"{victim.relative_to(workdir)}: checksum mismatch" in log
    assert f"rm {victim.relative_to(workdir)}" in log
    before = snapshot(hidden_dir(workdir))
    victim.unlink()
    assert planned_jobs(workdir, config, *DATA_HALF) == {"extract_hidden_states": 1, "consolidate": 1, "hidden_states": 1}
    run_snakemake(workdir, config, "--cores", "2", *DATA_HALF)
    after = snapshot(hidden_dir(workdir))
    for name in SHARDS:
        if name != SHARDS[1]:
            assert after[name] == before[name], name
    assert after[SHARDS[1]][2] == (hidden_dir(reference_dir) / SHARDS[1]).read_bytes()


def test_rerun_after_sigkill_during_extraction_makes_only_missing_shards(tmp_path_factory, tiny_llama, finished_run):
    reference_dir, _ = finished_run
    workdir, config = new_workdir(tmp_path_factory, tiny_llama, "killed")
    shards_dir = hidden_dir(workdir)
    process = subprocess.Popen(
        snakemake_command(workdir, config, "--cores", "1", *DATA_HALF),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        # Kill once the first shard is done and the next extraction job has started.
        started = wait_until(
            lambda: len(list(shards_dir.glob("shard-*.safetensors"))) >= 1
            and len(list((workdir / "logs" / "tiny" / "extract").glob("*.log"))) >= 2,
            timeout=240,
        )
        assert started, "extraction never got going"
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    survivors = snapshot(shards_dir)
    assert 1 <= len(survivors) < 4
    # The user's way back: run again; unlock only if snakemake says the directory is locked.
    rerun = run_snakemake(workdir, config, "--cores", "2", *DATA_HALF, check=False)
    if rerun.returncode != 0 and "--unlock" in rerun.stderr + rerun.stdout:
        run_snakemake(workdir, config, "--unlock")
        rerun = run_snakemake(workdir, config, "--cores", "2", *DATA_HALF, check=False)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    after = snapshot(shards_dir)
    for name, state in survivors.items():
        assert after[name] == state, f"{name} was rebuilt although it survived the crash"
    assert sorted(after) == SHARDS
    for name in SHARDS:
        assert after[name][2] == (hidden_dir(reference_dir) / name).read_bytes(), f"{name} differs from the uninterrupted run"
    assert list(workdir.glob(f"results/**/*{atomic.TMP_MARKER}*")) == []
    assert planned_jobs(workdir, config, *DATA_HALF) == {}


def test_bad_config_key_and_value_fail_with_a_clear_message(tmp_path, tiny_llama):
    conversations = synthetic_conversations(tmp_path / "c.jsonl", 4)
    config = tiny_workflow_config(tmp_path, tiny_llama, conversations, extract={"dtype": "int8"})
    result = run_snakemake(tmp_path, config, "-n", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "'int8' is not one of" in output and "['extract']['dtype']" in output
    settings = yaml.safe_load(config.read_text())
    settings["extract"]["dtype"] = "bfloat16"
    settings["extract"]["tokens_per_batchh"] = 4
    config.write_text(yaml.safe_dump(settings))
    result = run_snakemake(tmp_path, config, "-n", check=False)
    assert result.returncode != 0 and "'tokens_per_batchh' was unexpected" in result.stdout + result.stderr


def test_production_config_plans_the_whole_job_without_the_model(tmp_path):
    # The README's readable dry run: the plan line and the job table, no job's paths.
    result = run_snakemake(tmp_path, REPO / "config" / "kimi-k2.5.yaml", "-n", "-q", "rules")
    assert "240 shards" in result.stderr and "57,349 B/token" in result.stderr and "TB of hidden states" in result.stderr
    output = result.stdout + result.stderr
    assert re.search(r"^extract_hidden_states\s+240$", output, re.M) and "shard-00001" not in output
    assert len(output) < 5000, len(output)
    counts = planned_jobs(tmp_path, REPO / "config" / "kimi-k2.5.yaml")
    assert counts["extract_hidden_states"] == 240 and counts["consolidate"] == 1


def test_a_drafter_trained_beside_a_run_reuses_its_data_and_leaves_the_run_alone(finished_run, tmp_path):
    """benchmarks/train_beside.sh: a second drafter on the run's extracted states, in a
    sibling working directory; an overlay that would change the data is refused."""
    import sys

    source, config = finished_run
    workdir = tmp_path / "run"  # a copy: the arm's workflow leaves its marker in the linked hidden dir
    shutil.copytree(source, workdir, symlinks=True)
    run_train = workdir / "results" / "tiny" / "train"
    before = {p: p.stat().st_mtime_ns for p in run_train.rglob("*") if p.is_file()}
    shards_before = snapshot(hidden_dir(workdir))
    lr = tmp_path / "lr.yaml"
    lr.write_text("train:\n  lr: 0.001\n")
    data = tmp_path / "data.yaml"
    data.write_text("data:\n  max_len: 200\n")
    ready = tmp_path / "READY"
    ready.touch()
    env = {**os.environ, "RUN_ROOT": str(workdir), "READY": str(ready), "WAIT_S": "5", "CORES": "2",
           "SNAKEMAKE": f"{sys.executable} -m snakemake"}

    def beside(name, overlay):
        out = tmp_path / name
        result = subprocess.run(["bash", str(REPO / "benchmarks" / "train_beside.sh"), str(out), str(config), str(overlay)],
                                capture_output=True, text=True, env=env)
        return result, out

    result, out = beside("refused", data)
    assert result.returncode == 2 and "refused: the plan would make" in (out / "beside.log").read_text()
    assert not (out / "results" / "tiny" / "train").exists()
    result, out = beside("arm", lr)
    log = (out / "beside.log").read_text()
    assert result.returncode == 0, log + result.stderr[-3000:]
    assert "planned: export_drafter train_drafter" in log and (out / "DONE").read_text().strip() == "0"
    arm = out / "results" / "tiny"
    assert (arm / "export" / "sglang" / "config.json").exists()
    assert (arm / "hidden").is_symlink() and not (arm / "train").is_symlink()
    arm_weights = (arm / "train" / "drafter" / "model.safetensors").read_bytes()
    assert arm_weights != (run_train / "drafter" / "model.safetensors").read_bytes()
    assert {p: p.stat().st_mtime_ns for p in run_train.rglob("*") if p.is_file()} == before
    # the run's shards read, not touched; the arm's workflow named itself in the linked directory
    assert snapshot(hidden_dir(workdir)) == shards_before
    assert (hidden_dir(workdir) / ".eaglenest-hidden-states").exists()


@pytest.mark.parametrize("side_by_side", ["0", "1"])
def test_arms_train_on_the_data_in_place_without_remaking_what_made_it(finished_run, tmp_path, side_by_side):
    """benchmarks/train_arms.sh: the run's drafter and an arm trained on the data in place, one
    after the other or (SIDE_BY_SIDE=1) at once. Its source is newer than the ingested
    conversations, so a plain rerun would ingest and prepare again; the arms' Snakemake allows
    neither and reads what is there."""
    import sys

    source, _ = finished_run
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir, symlinks=True)
    settings = yaml.safe_load((workdir / "config.yaml").read_text())
    settings["data"]["sources"][0]["path"] = str(workdir / "conversations.jsonl")
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(settings))
    os.utime(workdir / "conversations.jsonl")  # what made the data "changed" after it
    assert {"ingest", "prepare"} <= set(planned_jobs(workdir, config))
    for stage in ("train", "export"):
        shutil.rmtree(workdir / "results" / "tiny" / stage)
    prepared = {p: p.stat().st_mtime_ns for p in (workdir / "results" / "tiny" / "prepared").rglob("*") if p.is_file()}
    shards_before = snapshot(hidden_dir(workdir))
    arm = tmp_path / "lr.yaml"
    arm.write_text("train:\n  lr: 0.001\n")
    out = tmp_path / "arms"
    env = {**os.environ, "RUN_ROOT": str(workdir), "CORES": "2", "ARM_CORES": "1",
           "SNAKEMAKE": f"{sys.executable} -m snakemake", "SIDE_BY_SIDE": side_by_side}
    data = tmp_path / "data.yaml"
    data.write_text("data:\n  max_len: 200\n")
    refused = subprocess.run(["bash", str(REPO / "benchmarks" / "train_arms.sh"), str(tmp_path / "refused"), str(config),
                              "--", str(arm), str(data)], capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and "sets data" in refused.stderr and not (tmp_path / "refused" / "times.tsv").exists()
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "train_arms.sh"), str(out), str(config), "--", str(arm)],
                            capture_output=True, text=True, env=env)
    log = (out / "arms.log").read_text()
    assert result.returncode == 0 and (out / "DONE").read_text().strip() == "0", log + result.stderr[-3000:]
    assert [line.split("\t")[0] for line in (out / "times.tsv").read_text().splitlines()][0] == "data"
    steps = [line.split("\t")[0] for line in (out / "times.tsv").read_text().splitlines()]
    assert sorted(steps[1:]) == ["arm-lr", "control"]
    if side_by_side == "0":  # the arm starts once the control has ended
        assert steps[1:] == ["control", "arm-lr"] and log.index("end control") < log.index("start arm-lr")
    else:  # the arm starts before the control ends
        assert log.index("start arm-lr") < log.index("end control")
    assert "Nothing to be done" in (out / "data.log").read_text()
    control = workdir / "results" / "tiny" / "train" / "drafter" / "model.safetensors"
    arm_weights = out / "arm-lr" / "results" / "tiny" / "train" / "drafter" / "model.safetensors"
    assert (workdir / "results" / "tiny" / "export" / "sglang" / "config.json").exists()
    assert (out / "arm-lr" / "results" / "tiny" / "export" / "sglang" / "config.json").exists()
    assert control.read_bytes() != arm_weights.read_bytes()
    assert {p: p.stat().st_mtime_ns for p in (workdir / "results" / "tiny" / "prepared").rglob("*") if p.is_file()} == prepared
    assert snapshot(hidden_dir(workdir)) == shards_before


def test_hidden_states_moved_to_extract_hidden_dir_are_not_made_again(finished_run, tmp_path):
    source, _ = finished_run
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir, symlinks=True)
    settings = yaml.safe_load((workdir / "config.yaml").read_text())
    nvme = tmp_path / "nvme" / "hidden"
    settings["extract"]["hidden_dir"] = str(nvme)
    moved = workdir / "moved.yaml"
    moved.write_text(yaml.safe_dump(settings))
    # Not moved yet: refused with the command that moves them, nothing touched.
    refused = run_snakemake(workdir, moved, "-n", check=False)
    assert refused.returncode != 0 and "mv results/tiny/hidden/*" in refused.stdout + refused.stderr
    assert sorted(p.name for p in hidden_dir(workdir).iterdir()) == SHARDS
    before = snapshot(hidden_dir(workdir))
    nvme.parent.mkdir()
    shutil.move(hidden_dir(workdir), nvme)  # keeps the mtimes, as mv does
    assert planned_jobs(workdir, moved) == {}
    assert hidden_dir(workdir).is_symlink() and hidden_dir(workdir).resolve() == nvme
    assert {name: state[1:] for name, state in snapshot(nvme).items()} == {n: s[1:] for n, s in before.items()}


@pytest.fixture(scope="module")
def refused_run(tmp_path_factory, tiny_llama) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """One shard's run that fails: a malformed source record, then a disk preflight that refuses,
    with extract.hidden_dir an empty directory."""
    root = tmp_path_factory.mktemp("refused")
    empty = root / "nvme"
    workdir, configfile = new_workdir_at(root / "run", tiny_llama, conversations=10,
                                         extract={"hidden_dir": str(empty), "disk_reserve_mb": 1 << 40})
    with open(workdir / "conversations.jsonl", "a") as source:
        source.write('{"id": "broken" "messages": []}\n')
    result = run_snakemake(workdir, configfile, "--cores", "1", "results/tiny/hidden/shard-00000.safetensors", check=False)
    return workdir, empty, result


def test_empty_extract_hidden_dir_fails_a_refused_job_without_a_snakemake_traceback(refused_run):
    workdir, empty, result = refused_run
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "disk preflight" in (workdir / "logs" / "tiny" / "extract" / "shard-00000.log").read_text()
    snakemake_end = output[output.index("Exiting because a job execution failed"):]
    assert "Traceback" not in snakemake_end and "NotADirectoryError" not in output, snakemake_end
    assert [p.name for p in empty.iterdir()] == [".eaglenest-hidden-states"]


def test_ingest_rejections_reach_the_snakemake_console(refused_run):
    _, _, result = refused_run
    # The job's log goes to a file; this line must reach the console as well.
    assert "eaglenest: ingest: kept 10 of 11 records; rejected 1 (invalid_json 1)" in result.stderr


# The last release whose prepare was a single job with one output per shard.
SINGLE_PREPARE_RELEASE = "5f797d104215ad159fe124ac699ed4315786c3fa"


def test_run_prepared_by_the_single_prepare_job_plans_no_prepare_or_extraction(tmp_path, tiny_llama):
    # The earlier release comes from this checkout's history; a shallow clone has none.
    present = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", SINGLE_PREPARE_RELEASE + "^{commit}"],
                             capture_output=True)
    if present.returncode != 0:
        pytest.skip(f"needs commit {SINGLE_PREPARE_RELEASE[:7]} in the checkout's history (a shallow clone lacks it)")
    earlier = tmp_path / "earlier-release"
    earlier.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", SINGLE_PREPARE_RELEASE, "Snakefile", "rules", "scripts",
                              "config", "envs", "report", "profiles", "eaglenest"], capture_output=True)
    assert archive.returncode == 0, archive.stderr.decode()
    subprocess.run(["tar", "-x", "-C", str(earlier)], input=archive.stdout, check=True)
    workdir, configfile = new_workdir_at(tmp_path / "run", tiny_llama, conversations=20)  # 2 shards
    # The earlier release's workflow and library make the data half. Run from the earlier
    # release: `python -m` puts the working directory ahead of PYTHONPATH, and from this
    # checkout it would import this checkout's package under the earlier workflow.
    env = {**os.environ, "PYTHONPATH": str(earlier), "PYTHONUNBUFFERED": "1"}
    command = snakemake_command(workdir, configfile, "--cores", "2", *DATA_HALF)
    command[command.index(str(REPO / "Snakefile"))] = str(earlier / "Snakefile")
    made = subprocess.run(command, capture_output=True, text=True, env=env, cwd=earlier)
    assert made.returncode == 0, made.stderr[-4000:]
    assert (workdir / "logs" / "tiny" / "prepare.log").exists()  # the single job ran
    assert planned_jobs(workdir, configfile, *DATA_HALF) == {}
    # Without its report (e.g. deleted), the report is rebuilt from the earlier shards' headers.
    report_path = next(workdir.glob("results/tiny/prepared/*/prepare_report.json"))
    earlier_report = json.loads(report_path.read_text())
    report_path.unlink()
    assert planned_jobs(workdir, configfile, str(report_path.relative_to(workdir))) == {"prepare_report": 1}
    rebuilt = prepare.summarize(sorted(report_path.parent.glob("shard-*.safetensors")), tmp_path / "rebuilt.json")
    assert rebuilt["shards_without_drop_counts"] == [0, 1]
    assert rebuilt["shards"] == earlier_report["shards"] and rebuilt["tokens"] == earlier_report["tokens"]


def new_workdir_at(workdir: Path, target: Path, conversations: int, **sections) -> tuple[Path, Path]:
    workdir.mkdir()
    source = synthetic_conversations(workdir / "conversations.jsonl", conversations)
    return workdir, tiny_workflow_config(workdir, target, source, data={"max_conversations": conversations}, **sections)

