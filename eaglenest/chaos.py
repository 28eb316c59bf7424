"""Chaos harness: run the pipeline once cleanly, then again under faults, and compare.

    python -m eaglenest.chaos --workdir /tmp/chaos --kills 20 --seed 1

Faults, each followed by what the README tells a user to do:
  * kill       SIGKILL the whole Snakemake process group at a random moment; then
               `snakemake --unlock` if the directory is locked, and rerun.
  * disk_full  the results live on a tmpfs too small for the hidden states; the run must
               fail with a clear message and leave no partial shard; then the filesystem
               grows (space is made) and the rerun completes.
  * corrupt    flip a byte / truncate / zero-fill a random finished shard; the next run must
               refuse it by name; the user removes what it names and reruns; only that
               shard is rebuilt.
  * bad_records  conversations with every kind of malformed record among good ones.

Without ``--config`` the harness builds a tiny random-weight target and synthetic
conversations, so it runs on a laptop CPU in minutes. The final outputs of the faulty
run must be bitwise identical to the reference run's; the summary table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eaglenest import atomic, recon, shards

REPO = Path(__file__).resolve().parents[1]
LOCKED_HINT = "--unlock"
# Which stage an in-flight output belongs to, by its path under results/<run>/.
STAGE_BY_DIR = {
    "data": "ingest",
    "prepared": "prepare",
    "hidden": "extract",
    "consolidated": "consolidate",
    "train": "train",
    "export": "export",
    "evaluate": "evaluate",
}


@dataclass
class Tally:
    faults: dict = field(default_factory=dict)
    runs: int = 0
    runs_completed: int = 0
    stages_hit: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def fault(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1


class Workflow:
    """One working directory and config, driven the way a user drives it."""

    def __init__(self, workdir: Path, configfile: Path, cores: int = 2):
        self.workdir, self.configfile, self.cores = workdir, configfile, cores
        self.run_name = yaml.safe_load(configfile.read_text())["run"]

    @property
    def results(self) -> Path:
        return self.workdir / "results" / self.run_name

    def command(self, *args: str) -> list[str]:
        return [
            sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
            "--directory", str(self.workdir), "--configfile", str(self.configfile),
            *(args or ("--cores", str(self.cores))),
        ]

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), capture_output=True, text=True)

    def start(self) -> subprocess.Popen:
        return subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def unlock_if_stale(self, tally: Tally) -> None:
        """After a kill the dead run's lock stays: recon says `snakemake --unlock` is safe
        when no Snakemake process is alive on the directory, which the harness knows."""
        locks = self.workdir / ".snakemake" / "locks"
        if locks.is_dir() and any(locks.iterdir()):
            self.run("--unlock")
            tally.runs += 1

    def resume(self, tally: Tally) -> subprocess.CompletedProcess:
        """Rerun as the README says: unlock only when Snakemake says the directory is locked."""
        tally.runs += 1
        result = self.run()
        if result.returncode != 0 and LOCKED_HINT in result.stdout + result.stderr and "locked" in (result.stdout + result.stderr).lower():
            self.run("--unlock")
            tally.runs += 1
            result = self.run()
        if result.returncode == 0:
            tally.runs_completed += 1
        return result

    def in_flight_stages(self) -> set[str]:
        """Stages with outputs Snakemake has marked incomplete (jobs running right now)."""
        stages = set()
        for marker in recon.incomplete_markers(self.workdir):
            parts = Path(marker["path"]).parts
            if "results" in parts and len(parts) > parts.index("results") + 2:
                stages.add(STAGE_BY_DIR.get(parts[parts.index("results") + 2], "other"))
        return stages


def final_outputs(workflow: Workflow) -> dict[str, bytes]:
    """The run's products that must match the reference bit for bit."""
    outputs = {}
    for sub in ("hidden", "consolidated", "train/drafter", "export"):
        directory = workflow.results / sub
        if directory.is_dir():
            for path in sorted(p for p in directory.rglob("*") if p.is_file()):
                if path.suffix in (".log",) or path.name.endswith(".json") and sub == "train/drafter" and "curve" in path.name:
                    continue
                outputs[str(path.relative_to(workflow.results))] = path.read_bytes()
    return outputs


def leftovers(workflow: Workflow) -> dict[str, list[str]]:
    temps = [str(p) for p in workflow.workdir.rglob(f"*{atomic.TMP_MARKER}*")]
    locks_dir = workflow.workdir / ".snakemake" / "locks"
    locks = [str(p) for p in locks_dir.glob("*")] if locks_dir.is_dir() else []
    return {"temp_files": temps, "locks": locks}


# Stages in pipeline order; kills are spread over them.
KILL_STAGES = ["ingest", "prepare", "extract", "consolidate", "train", "export", "evaluate"]


def inject_kills(workflow: Workflow, count: int, reference_seconds: float, rng: random.Random, tally: Tally) -> None:
    """Kill i aims at stage KILL_STAGES[i * len / count]: the run is killed a random moment
    (0-1.5 s) after a job of that stage (or, if it is already done, of any later stage) is
    seen in flight, so the kills land in every stage rather than all during extraction."""
    for index in range(count):
        target = KILL_STAGES[min(index * len(KILL_STAGES) // max(count, 1), len(KILL_STAGES) - 1)]
        acceptable = set(KILL_STAGES[KILL_STAGES.index(target):])
        workflow.unlock_if_stale(tally)
        process = workflow.start()
        tally.runs += 1
        deadline = time.monotonic() + 2 * reference_seconds + 60
        seen: set[str] = set()
        while time.monotonic() < deadline and process.poll() is None:
            seen = workflow.in_flight_stages() & acceptable
            if seen:
                break
            time.sleep(0.05)
        if seen:
            time.sleep(rng.uniform(0.0, 1.5))
            seen |= workflow.in_flight_stages()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            tally.fault("kill")
            for stage in seen or {"startup"}:
                tally.stages_hit[stage] = tally.stages_hit.get(stage, 0) + 1
        else:
            tally.runs_completed += int(process.returncode == 0)
            tally.notes.append(f"the run finished before a {target}-or-later job was seen to kill")


def corrupt_file(path: Path, how: str, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        del data[rng.randrange(1, len(data)) :]
    elif how == "zero":
        start = rng.randrange(len(data))
        data[start : start + 4096] = bytes(min(4096, len(data) - start))
    path.write_bytes(bytes(data))


def inject_corruption(workflow: Workflow, rng: random.Random, tally: Tally) -> dict:
    """Corrupt one finished shard; the run must refuse it by name; rebuild only it."""
    hidden = sorted((workflow.results / "hidden").glob("shard-*.safetensors"))
    victim = rng.choice(hidden)
    how = rng.choice(["flip", "truncate", "zero"])
    before = {p.name: p.stat().st_mtime_ns for p in hidden if p != victim}
    corrupt_file(victim, how, rng)
    # A zero-fill or flip can land where it changes nothing checked (e.g. identical bytes);
    # verify that the harness really made a corrupt file before expecting a refusal.
    try:
        shards.verify_shard(victim, deep=True)
        tally.notes.append(f"corruption ({how}) of {victim.name} left a valid file; redone as truncate")
        corrupt_file(victim, "truncate", rng)
    except shards.ShardError:
        pass
    os.utime(victim)  # an edited file is newer: Snakemake reruns consolidate over it
    tally.fault(f"corrupt_{how}")
    result = workflow.resume(tally)
    output = result.stdout + result.stderr + _logs(workflow)
    refused = result.returncode != 0 and victim.name in output
    consumed = result.returncode == 0
    if refused:
        victim.unlink()  # what the error message tells the user to do
        result = workflow.resume(tally)
    rebuilt_only_victim = all(
        (workflow.results / "hidden" / name).stat().st_mtime_ns == mtime for name, mtime in before.items()
    )
    return {"victim": victim.name, "how": how, "refused_by_name": refused, "consumed": consumed,
            "rebuilt_only_victim": rebuilt_only_victim, "completed": result.returncode == 0}


def _logs(workflow: Workflow) -> str:
    log_dir = workflow.workdir / "logs" / workflow.run_name
    return "".join(p.read_text(errors="replace") for p in log_dir.rglob("*.log")) if log_dir.is_dir() else ""


def inject_disk_full(workflow: Workflow, tally: Tally, small_bytes: int, preflight: bool) -> dict:
    """Results on a tmpfs that cannot hold them; fail clearly; grow it; complete."""
    mount_point = workflow.workdir / "results"
    mount_point.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={small_bytes}", "tmpfs", str(mount_point)], check=True)
    try:
        settings = yaml.safe_load(workflow.configfile.read_text())
        settings["extract"]["preflight"] = preflight
        workflow.configfile.write_text(yaml.safe_dump(settings, sort_keys=False))
        tally.fault("disk_full_preflight" if preflight else "disk_full_write")
        result = workflow.resume(tally)
        failed = result.returncode != 0
        output = result.stdout + result.stderr + _logs(workflow)
        clear = failed and (("disk preflight" in output) if preflight else ("disk full while writing" in output))
        partial = list(mount_point.rglob(f"*{atomic.TMP_MARKER}*"))
        subprocess.run(["mount", "-o", "remount,size=512m", str(mount_point)], check=True)
        settings["extract"]["preflight"] = True
        workflow.configfile.write_text(yaml.safe_dump(settings, sort_keys=False))
        result = workflow.resume(tally)
        outputs = final_outputs(workflow)
        return {"failed": failed, "clear_message": clear,
                "partial_files_left": len(partial), "completed_after_space": result.returncode == 0,
                "outputs": outputs}
    finally:
        # Keep the bytes: copy them off the tmpfs before unmounting.
        keep = workflow.workdir / "results-after-disk-full"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(mount_point, keep)
        subprocess.run(["umount", str(mount_point)], check=True)


def bad_records_check(workdir: Path, rng: random.Random, examples: int) -> dict:
    """Generated conversations with every kind of malformed record: counts must match."""
    from eaglenest import ingest

    makers = {
        "turn_missing_field": lambda i: {"id": f"b{i}", "conversations": [{"from": "human"}]},
        "empty_turn": lambda i: {"id": f"b{i}", "conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": "x"}]},
        "unknown_role": lambda i: {"id": f"b{i}", "conversations": [{"from": "robot", "value": "a"}, {"from": "gpt", "value": "b"}]},
        "non_string_content": lambda i: {"id": f"b{i}", "conversations": [{"from": "human", "value": [1]}, {"from": "gpt", "value": "b"}]},
        "no_user_turn": lambda i: {"id": f"b{i}", "conversations": [{"from": "gpt", "value": f"only {i}"}]},
        "roles_not_alternating": lambda i: {"id": f"b{i}", "conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": f"b{i}"}]},
        "no_turns": lambda i: {"id": f"b{i}", "conversations": []},
        "missing_messages": lambda i: {"id": f"b{i}"},
        "not_an_object": lambda i: [i],
    }
    records, expected, good = [], {}, 0
    for i in range(examples):
        if rng.random() < 0.5:
            records.append({"id": f"g{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]})
            good += 1
        else:
            reason = rng.choice(sorted(makers))
            records.append(makers[reason](i))
            expected[reason] = expected.get(reason, 0) + 1
    source = workdir / "bad-records.json"
    source.write_text(json.dumps(records))
    report = ingest.ingest([{"name": "chaos", "path": str(source)}], workdir / "bad-out.jsonl", workdir / "bad-report.json")
    return {"records": len(records), "good": good, "kept": report.kept, "expected_rejected": expected,
            "rejected": dict(report.rejected), "all_good_arrived": report.kept == good,
            "counts_match": dict(report.rejected) == expected}


def tiny_setup(workdir: Path, conversations: int) -> Path:
    """A tiny random target and synthetic conversations; returns the config path."""
    from eaglenest import tiny

    target = tiny.make_tiny_target(workdir / "target")
    source = tiny.synthetic_conversations(workdir / "conversations.jsonl", conversations)
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    # Frequent checkpoints make kills during training count.
    config = tiny.workflow_config(base, target, source, run="chaos", max_conversations=conversations,
                                  samples_per_shard=8, checkpoint_every=3)
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_chaos(workdir: Path, kills: int, seed: int, configfile: Path | None = None, disk_full: bool = True,
              corruptions: int = 1, bad_record_examples: int = 200, conversations: int = 40) -> dict:
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    if configfile is None:
        configfile = tiny_setup(workdir / "inputs", conversations)
    tally = Tally()
    reference_dir, chaos_dir = workdir / "reference", workdir / "faulty"
    for directory in (reference_dir, chaos_dir):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        if (REPO / "resources").is_dir():
            os.symlink(REPO / "resources", directory / "resources")
    reference = Workflow(reference_dir, Path(shutil.copy(configfile, reference_dir / "config.yaml")))
    started = time.monotonic()
    result = reference.run()
    if result.returncode != 0:
        raise RuntimeError(f"reference run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    reference_seconds = time.monotonic() - started
    expected = final_outputs(reference)

    faulty = Workflow(chaos_dir, Path(shutil.copy(configfile, chaos_dir / "config.yaml")))
    inject_kills(faulty, kills, reference_seconds, rng, tally)
    result = faulty.resume(tally)
    if result.returncode != 0:
        tally.notes.append(f"resume after kills failed: {result.stderr[-2000:]}")
    corruption_results = [inject_corruption(faulty, rng, tally) for _ in range(corruptions)]
    observed = final_outputs(faulty)
    disk_full_results = []
    if disk_full and os.geteuid() == 0:
        disk_dir = workdir / "disk-full"
        shutil.rmtree(disk_dir, ignore_errors=True)
        disk_dir.mkdir()
        if (REPO / "resources").is_dir():
            os.symlink(REPO / "resources", disk_dir / "resources")
        disk = Workflow(disk_dir, Path(shutil.copy(configfile, disk_dir / "config.yaml")))
        hidden_bytes = sum(len(v) for k, v in expected.items() if k.startswith("hidden/"))
        for preflight in (True, False):
            outcome = inject_disk_full(disk, tally, max(hidden_bytes // 2, 1 << 20), preflight)
            outcome["identical"] = outcome.pop("outputs") == expected
            disk_full_results.append(outcome)
    elif disk_full:
        tally.notes.append("disk-full faults skipped: mounting a tmpfs needs root")
    bad = bad_records_check(workdir, rng, bad_record_examples)
    reference_samples = json.loads((reference.results / "consolidated" / "index.json").read_text())["totals"]["samples"]
    index_path = faulty.results / "consolidated" / "index.json"
    faulty_samples = json.loads(index_path.read_text())["totals"]["samples"] if index_path.exists() else 0
    summary = {
        "command": " ".join(["python -m eaglenest.chaos", f"--kills {kills}", f"--seed {seed}"]),
        "reference_seconds": round(reference_seconds, 1),
        "faults_injected": tally.faults,
        "kills_by_stage_in_flight": tally.stages_hit,
        "runs": tally.runs,
        "runs_completed": tally.runs_completed,
        "samples_lost": reference_samples - faulty_samples,
        "corrupt_outputs_consumed": sum(c["consumed"] for c in corruption_results),
        "corruptions": corruption_results,
        "disk_full": disk_full_results,
        "bad_records": bad,
        "leftovers": leftovers(faulty),
        "identical_final_result": observed == expected,
        "differing_outputs": sorted(set(k for k in expected if observed.get(k) != expected[k]) | (set(observed) - set(expected))),
        "notes": tally.notes,
    }
    summary["ok"] = (
        summary["identical_final_result"]
        and summary["samples_lost"] == 0
        and summary["corrupt_outputs_consumed"] == 0
        and all(c["refused_by_name"] and c["rebuilt_only_victim"] and c["completed"] for c in corruption_results)
        and all(d["clear_message"] and d["partial_files_left"] == 0 and d["completed_after_space"] and d["identical"] for d in disk_full_results)
        and bad["all_good_arrived"] and bad["counts_match"]
        and not summary["leftovers"]["temp_files"] and not summary["leftovers"]["locks"]
    )
    atomic.write_json(workdir / "chaos-summary.json", summary)
    return summary


def format_table(summary: dict) -> str:
    rows = [
        ("faults injected", ", ".join(f"{k}={v}" for k, v in sorted(summary["faults_injected"].items()))),
        ("kills by stage in flight", ", ".join(f"{k}={v}" for k, v in sorted(summary["kills_by_stage_in_flight"].items())) or "-"),
        ("runs / completed", f"{summary['runs']} / {summary['runs_completed']}"),
        ("samples lost", str(summary["samples_lost"])),
        ("corrupt outputs consumed", str(summary["corrupt_outputs_consumed"])),
        ("disk full: clear failure, no partial file, identical after space", ", ".join(
            "yes" if d["clear_message"] and d["partial_files_left"] == 0 and d["identical"] else "NO" for d in summary["disk_full"]) or "-"),
        ("bad records: good arrived, counts match", f"{summary['bad_records']['all_good_arrived']}, {summary['bad_records']['counts_match']}"),
        ("temp files / locks left", f"{len(summary['leftovers']['temp_files'])} / {len(summary['leftovers']['locks'])}"),
        ("identical final result", "yes" if summary["identical_final_result"] else "NO"),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eaglenest.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("chaos-run"))
    parser.add_argument("--config", type=Path, default=None, help="workflow config (default: a tiny random target)")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--corruptions", type=int, default=3)
    parser.add_argument("--no-disk-full", action="store_true")
    parser.add_argument("--bad-records", type=int, default=500)
    args = parser.parse_args(argv)
    summary = run_chaos(args.workdir, args.kills, args.seed, args.config, disk_full=not args.no_disk_full,
                        corruptions=args.corruptions, bad_record_examples=args.bad_records)
    print(format_table(summary))
    print(f"summary: {args.workdir / 'chaos-summary.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
