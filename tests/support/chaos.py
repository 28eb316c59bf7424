"""Chaos harness: run the pipeline once cleanly, then again under faults, and compare.

    python tests/support/chaos.py --workdir /tmp/chaos --kills 20 --seed 1

Faults, each followed by what the README tells a user to do:
  * kill       SIGKILL the whole Snakemake process group at a random moment; then
               `snakemake --unlock` if the directory is locked, and rerun.
  * disk_full  the results live on a tmpfs too small for the hidden states; the run must
               fail with a clear message and leave no partial shard; then the filesystem
               grows (space is made) and the rerun completes through consolidation (the
               stages the fault touches; what follows reads only their outputs).
  * corrupt    flip a byte / truncate / zero-fill a random finished shard; the next run must
               refuse it by name; the user removes what it names and reruns; only that
               shard is rebuilt.
  * bad_records  conversations with every kind of malformed record among good ones,
                 a JSON syntax error mid-file among them.
  * disk_full_checkpoint  the train job's checkpoint directory on a tmpfs that fills while a
               checkpoint is written; the job must fail naming the file, leave no partial or
               unverifiable checkpoint; space is made; the rerun resumes from the last good one.
  * checkpoint_corrupt  flip / truncate / zero-fill the checkpoint a resume would read; the
               rerun must name it, resume from the one before it and end with the same drafter.
  * server_*   one hidden shard extracted through the stand-in SGLang server
               (tests/support/standin_server.py) with a fault switched on: it dies mid-shard, is slow,
               answers rows of the wrong shape or for other token ids, or is a vLLM server, an
               SGLang without the patch, or ours with other layers. The job must fail saying so
               and leave no shard; with a healthy server the rerun writes the shard bitwise equal
               to the transformers backend's.

Training and server faults run in copies of the finished reference directory, so that
only the stage under test runs again.

Without ``--config`` the harness builds a tiny random-weight target and synthetic
conversations, so it runs on a laptop CPU in minutes. The final outputs of the faulty
run must be bitwise identical to the reference run's; the summary table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eaglenest import layout, plan
from eaglenest.formats import atomic, shards
from eaglenest.node import recon
from support import STANDIN_SERVER

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script (python tests/support/chaos.py): find the support package
    sys.path.insert(0, str(REPO / "tests"))
LOCKED_HINT = "--unlock"
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
        config = yaml.safe_load(configfile.read_text())
        self.run_name = config["run"]
        # The rules' own paths: rooted here for reading, relative for naming Snakemake targets.
        self.layout, self.targets = layout.RunLayout(config, root=workdir), layout.RunLayout(config)

    @property
    def results(self) -> Path:
        return self.layout.run_dir

    def command(self, *args: str, targets: tuple[str, ...] = ()) -> list[str]:
        return [
            sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
            "--directory", str(self.workdir), "--configfile", str(self.configfile),
            *(args or ("--cores", str(self.cores))), *targets,
        ]

    def run(self, *args: str, targets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args, targets=targets), capture_output=True, text=True)

    def start(self) -> subprocess.Popen:
        return subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def unlock_if_stale(self, tally: Tally) -> None:
        """After a kill the dead run's lock stays: recon says `snakemake --unlock` is safe
        when no Snakemake process is alive on the directory, which the harness knows."""
        locks = self.workdir / ".snakemake" / "locks"
        if locks.is_dir() and any(locks.iterdir()):
            self.run("--unlock")
            tally.runs += 1

    def resume(self, tally: Tally, targets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        """Rerun as the README says: unlock only when Snakemake says the directory is locked."""
        tally.runs += 1
        result = self.run(targets=targets)
        if result.returncode != 0 and LOCKED_HINT in result.stdout + result.stderr and "locked" in (result.stdout + result.stderr).lower():
            self.run("--unlock")
            tally.runs += 1
            result = self.run(targets=targets)
        if result.returncode == 0:
            tally.runs_completed += 1
        return result

    def in_flight_stages(self) -> set[str]:
        """Stages with outputs Snakemake has marked incomplete (jobs running right now)."""
        stages = set()
        for marker in recon.incomplete_markers(self.workdir):
            stage = layout.stage_of(marker["path"])
            if stage is not None:
                stages.add(stage)
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
    hidden = sorted(Path(workflow.layout.hidden_dir()).glob("shard-*.safetensors"))
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
        Path(workflow.layout.hidden_dir(), name).stat().st_mtime_ns == mtime for name, mtime in before.items()
    )
    return {"victim": victim.name, "how": how, "refused_by_name": refused, "consumed": consumed,
            "rebuilt_only_victim": rebuilt_only_victim, "completed": result.returncode == 0}


def _logs(workflow: Workflow) -> str:
    log_dir = Path(workflow.layout.log_path())
    return "".join(p.read_text(errors="replace") for p in log_dir.rglob("*.log")) if log_dir.is_dir() else ""


# What a run holds before its extraction jobs start: results/<run>/ folders of ingest and prepare.
UPSTREAM_OF_EXTRACT = ("data", "prepared")


def inject_disk_full(workflow: Workflow, tally: Tally, small_bytes: int, preflight: bool, upstream: Path) -> dict:
    """Results on a tmpfs that cannot hold them; fail clearly; grow it; complete. The tmpfs
    starts with ``upstream``'s ingest and prepare outputs (a finished run's, mtimes kept, in a
    copy of that run's directory), so that the runs start with the extraction jobs the fault is
    about and take their space from what ingest and prepare left free, as a fresh run would."""
    mount_point = workflow.workdir / layout.RESULTS
    mount_point.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={small_bytes}", "tmpfs", str(mount_point)], check=True)
    try:
        for sub in UPSTREAM_OF_EXTRACT:
            shutil.copytree(upstream / sub, workflow.results / sub)
        settings = yaml.safe_load(workflow.configfile.read_text())
        settings["extract"]["preflight"] = preflight
        workflow.configfile.write_text(yaml.safe_dump(settings, sort_keys=False))
        tally.fault("disk_full_preflight" if preflight else "disk_full_write")
        targets = data_targets(workflow)
        result = workflow.resume(tally, targets=targets)
        failed = result.returncode != 0
        output = result.stdout + result.stderr + _logs(workflow)
        clear = failed and (("disk preflight" in output) if preflight else ("disk full while writing" in output))
        partial = list(mount_point.rglob(f"*{atomic.TMP_MARKER}*"))
        subprocess.run(["mount", "-o", "remount,size=512m", str(mount_point)], check=True)
        settings["extract"]["preflight"] = True
        workflow.configfile.write_text(yaml.safe_dump(settings, sort_keys=False))
        result = workflow.resume(tally, targets=targets)
        outputs = data_outputs(final_outputs(workflow))
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
    from eaglenest.stages import ingest

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
    # A record with a syntax error in the middle of the file (a missing comma): it alone is
    # rejected, the records after it still arrive.
    makers["invalid_json"] = lambda i: json.dumps({"id": f"b{i}", "conversations": []}).replace(",", "", 1)
    records, expected, good = [], {}, 0
    for i in range(examples):
        middle = i == examples // 2  # one malformed record in the middle for sure
        if not middle and rng.random() < 0.5:
            records.append({"id": f"g{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]})
            good += 1
        else:
            reason = "invalid_json" if middle else rng.choice(sorted(makers))
            records.append(makers[reason](i))
            expected[reason] = expected.get(reason, 0) + 1
    source = workdir / "bad-records.json"
    texts = [r if isinstance(r, str) else json.dumps(r) for r in records]
    source.write_text("[" + ", ".join(texts) + "]")
    report = ingest.ingest([{"name": "chaos", "path": str(source)}], workdir / "bad-out.jsonl", workdir / "bad-report.json")
    return {"records": len(records), "good": good, "kept": report.kept, "expected_rejected": expected,
            "rejected": dict(report.rejected), "all_good_arrived": report.kept == good,
            "counts_match": dict(report.rejected) == expected}


# ---- faults in late stages, each in a copy of the finished reference run ----------------------


def copy_finished_run(source: Workflow, destination: Path) -> Workflow:
    """The reference directory with Snakemake's metadata, so that a fault in training or in one
    extraction job is injected without recomputing everything before it."""
    shutil.rmtree(destination, ignore_errors=True)
    shutil.copytree(source.workdir, destination, symlinks=True, ignore=shutil.ignore_patterns("locks"))
    return Workflow(destination, destination / "config.yaml", source.cores)


class LogMarks:
    """Where each job log ended before a run, so that only what the run added is read back.
    Snakemake removes a job's old log before running the job again; a log whose first bytes
    (a timestamp) changed is a new one, all of it read."""

    HEAD = 64

    def __init__(self, workflow: Workflow):
        self.log_dir = Path(workflow.layout.log_path())
        self.ends = {path: (path.stat().st_size, self._head(path)) for path in self._logs()}

    def _logs(self) -> list[Path]:
        return sorted(self.log_dir.rglob("*.log")) if self.log_dir.is_dir() else []

    def _head(self, path: Path) -> bytes:
        with open(path, "rb") as handle:
            return handle.read(self.HEAD)

    def new_text(self) -> str:
        texts = []
        for path in self._logs():
            end, head = self.ends.get(path, (0, b""))
            start = end if end <= path.stat().st_size and self._head(path)[: len(head)] == head else 0
            with open(path, "rb") as handle:
                handle.seek(start)
                texts.append(handle.read().decode(errors="replace"))
        return "".join(texts)


def data_targets(workflow: Workflow) -> tuple[str, ...]:
    """The consolidation rule's outputs: a run through extraction and consolidation only."""
    return tuple(workflow.targets.consolidated_files())


def data_outputs(outputs: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in outputs.items() if name.startswith(("hidden/", "consolidated/"))}


def drafter_outputs(outputs: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in outputs.items() if name.startswith("train/drafter/")}


def train_targets(workflow: Workflow) -> tuple[str, ...]:
    """The train rule's outputs: the rerun goes as far as training, not through export and evaluation."""
    return (workflow.targets.training_summary(),)


def checkpoint_dir(workflow: Workflow) -> Path:
    return Path(workflow.layout.checkpoint_dir())


def unmount_keeping_files(mount_point: Path) -> None:
    """Unmount a tmpfs and put its files back in the directory it covered."""
    keep = mount_point.with_name(mount_point.name + "-kept")
    shutil.rmtree(keep, ignore_errors=True)
    shutil.copytree(mount_point, keep)
    subprocess.run(["umount", str(mount_point)], check=True)
    shutil.rmtree(mount_point)
    keep.rename(mount_point)


def inject_checkpoint_disk_full(workflow: Workflow, tally: Tally, checkpoint_bytes: int) -> dict:
    """Checkpoints on a tmpfs with room for two and a half: training starts over, writes two,
    and fills the disk in the third (rotation removes the oldest only after the new one is in).
    The job must fail naming the file and the disk, leave no partial or unverifiable checkpoint,
    and after space is made resume from the last good checkpoint to the reference drafter."""
    from eaglenest.training import checkpoints

    shutil.rmtree(workflow.results / "train", ignore_errors=True)  # train from step 0
    mount_point = checkpoint_dir(workflow)
    mount_point.mkdir(parents=True)
    size = int(2.5 * checkpoint_bytes)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], check=True)
    try:
        tally.fault("disk_full_checkpoint")
        marks = LogMarks(workflow)
        result = workflow.resume(tally, train_targets(workflow))
        output = result.stdout + result.stderr + marks.new_text()
        message = re.search(r"disk full while writing (\S+) \([\d,]+ bytes free [^)]*\)", output)
        recorded = checkpoints.read_checksums(mount_point)
        left = checkpoints.checkpoint_paths(mount_point)
        outcome = {
            "tmpfs_bytes": size,
            "failed": result.returncode != 0,
            "message": message.group(0) if message else None,
            "clear_message": bool(message) and f"{mount_point.name}/step-" in message.group(1)
            and f"mounted at {mount_point}" in message.group(0),
            "partial_files_left": len(list(mount_point.glob(f"*{atomic.TMP_MARKER}*"))),
            "checkpoints_left": [p.name for p in left],
            "unverifiable_checkpoints_left": [p.name for p in left if checkpoints.checkpoint_problem(p, recorded)],
            "drafter_left": Path(workflow.layout.drafter_dir()).exists(),
        }
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount_point)], check=True)  # space is made
        marks = LogMarks(workflow)
        result = workflow.resume(tally, train_targets(workflow))
        resumed = re.findall(r"resuming from \S+/(step-\d+\.pt) \(step \d+\)", marks.new_text())
        outcome.update(completed_after_space=result.returncode == 0, resumed_from=resumed[-1] if resumed else None,
                       drafter=drafter_outputs(final_outputs(workflow)))
        return outcome
    finally:
        unmount_keeping_files(mount_point)


CHECKPOINT_DAMAGE = ["flip", "truncate", "zero"]


def inject_checkpoint_corruption(workflow: Workflow, how: str, rng: random.Random, tally: Tally) -> dict:
    """Corrupt the newest checkpoint of a job that was killed after writing it and before
    writing the drafter; the rerun must name it, resume from the one before it (only the steps
    after that are redone, the older file untouched) and end with the reference drafter."""
    from eaglenest.training import checkpoints

    directory = checkpoint_dir(workflow)
    saved = checkpoints.checkpoint_paths(directory)
    victim, older = saved[-1], saved[:-1]
    shutil.rmtree(workflow.layout.drafter_dir())
    Path(workflow.layout.training_summary()).unlink()
    corrupt_file(victim, how, rng)
    if checkpoints.checkpoint_problem(victim, checkpoints.read_checksums(directory)) is None:
        tally.notes.append(f"corruption ({how}) of {victim.name} left its bytes unchanged; redone as truncate")
        corrupt_file(victim, "truncate", rng)
    before = {p.name: p.stat().st_mtime_ns for p in older}
    tally.fault(f"checkpoint_corrupt_{how}")
    marks = LogMarks(workflow)
    result = workflow.resume(tally, train_targets(workflow))
    log_text = marks.new_text()
    resumed = re.findall(r"resuming from \S+/(step-\d+\.pt) \(step \d+\)", log_text)
    resumed_from = resumed[-1] if resumed else None
    return {
        "victim": victim.name, "how": how,
        "refused_by_name": re.search(rf"not resuming from checkpoint \S*{re.escape(victim.name)}: corrupt", log_text) is not None,
        "resumed_from": resumed_from,
        "resumed_from_newest_intact": resumed_from == (older[-1].name if older else None),
        "consumed": resumed_from == victim.name,
        "older_untouched": all(
            (directory / name).exists() and (directory / name).stat().st_mtime_ns == mtime for name, mtime in before.items()
        ),
        "rebuilt_intact": checkpoints.checkpoint_problem(victim, checkpoints.read_checksums(directory)) is None,
        "completed": result.returncode == 0,
        "drafter": drafter_outputs(final_outputs(workflow)),
    }


# ---- a faulty SGLang server: the real stand-in (support.standin_server) with its fault switches -


SLOW_SERVER_DELAY_S = 3.0  # the slow server's answer time; the job's request timeout is 1 s


SAMPLES_PER_REQUEST = 2  # several requests per shard, so that a server can die between two of them


def server_faults(samples_in_shard: int, layer_ids: list[int]) -> dict[str, tuple[list[str], str]]:
    """Fault name -> (stand-in switches, what the extract job's failure must say)."""
    requests_in_shard = -(-samples_in_shard // SAMPLES_PER_REQUEST)
    other_layers = [layer_ids[0] - 1 if layer_ids[0] > 0 else layer_ids[0] + 1, *layer_ids[1:]]
    return {
        "server_killed_mid_shard": (["--exit-after", str(max(1, requests_in_shard // 2))],
                                    r"SGLang server at \S+ failed \d+ requests in a row"),
        "server_slow": (["--delay-s", str(SLOW_SERVER_DELAY_S)], r"failed \d+ requests in a row \(last: samples? \d+(-\d+)?: \w+: timed out\)"),
        "server_shape_mismatch": (["--drop-rows", "2"], r"returned \{[^}]*\} for sample \d+ of \d+ tokens"),
        "server_content_mismatch": (["--wrong-ids"], r"computed sample \d+ on other token ids than were sent"),
        "server_vllm": (["--impersonate", "vllm"], r"is a vLLM OpenAI server serving \[[^]]*\]"),
        "server_unpatched_sglang": (["--impersonate", "sglang"], r"is an SGLang server without the eaglenest patch"),
        "server_other_layers": (["--layer-ids", *map(str, other_layers)], r"does not match this run \(layer_ids: server has"),
    }


SERVER_FAULT_NAMES = list(server_faults(2, [0, 1, 2]))


class StandinServer:
    """The stand-in server (standin_server.py) as its own process on a free port; stop() ends it."""

    def __init__(self, workdir: Path, config: dict, spool_dir: Path, switches: list[str]):
        ready = workdir / f"standin-ready-{time.monotonic_ns()}.json"
        layer_args = [] if "--layer-ids" in switches else ["--layer-ids", *map(str, plan.layer_ids(config))]
        self.process = subprocess.Popen(
            [sys.executable, str(STANDIN_SERVER), "--model", str(workdir / config["target"]["path"]),
             "--target", config["target"]["name"], *layer_args, "--spool-dir", str(spool_dir),
             "--port", "0", "--ready-file", str(ready), *switches],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stand-in server did not start: {self.process.stderr.read()[-3000:]}")
            time.sleep(0.1)
        self.url = json.loads(ready.read_text())["url"]
        ready.unlink()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def use_server(workflow: Workflow, url: str, spool_dir: Path, request_timeout_s: float = 60) -> None:
    """Point extraction at the server, with retries short enough for a test."""
    settings = yaml.safe_load(workflow.configfile.read_text())
    settings["extract"]["backend"] = "sglang"
    settings["extract"]["sglang"] = {
        "url": url, "start_server": False, "spool_dir": str(spool_dir), "concurrency": 2,
        "samples_per_request": SAMPLES_PER_REQUEST, "request_timeout_s": request_timeout_s,
        "retries": 1, "backoff_s": 0.05, "max_consecutive_failures": 2,
    }
    workflow.configfile.write_text(yaml.safe_dump(settings, sort_keys=False))


def inject_server_faults(reference: Workflow, workdir: Path, names: list[str], rng: random.Random, tally: Tally) -> list[dict]:
    """One hidden shard re-extracted through the stand-in server, once per fault: the job must
    fail saying what is wrong, leave no shard, no temp file and no spool file; then, with the
    fault removed (a healthy server), the rerun writes the shard bitwise equal to the
    transformers backend's (one sample per forward on both sides, as the server computes)."""
    from eaglenest.stages import extract

    workflow = copy_finished_run(reference, workdir)
    config = yaml.safe_load(workflow.configfile.read_text())
    hidden_dir = Path(workflow.layout.hidden_dir())
    victim = rng.choice(sorted(hidden_dir.glob("shard-*.safetensors")))
    prepared = Path(workflow.layout.prepared_path(victim.name))
    samples = shards.verify_shard(prepared, deep=True).metadata["sample_ids"]
    direct = workdir / "transformers-backend" / victim.name
    extract.extract_shard(prepared, direct, workdir / config["target"]["path"], config["target"]["name"], plan.layer_ids(config),
                          dtype=config["extract"]["dtype"], device="cpu", tokens_per_batch=1, check_disk=False)
    expected = shards.verify_shard(direct, deep=True).tensors()
    spool_dir = workdir / "spool"
    spool_dir.mkdir()
    target = (str(victim.relative_to(workflow.workdir)),)
    healthy = StandinServer(workdir, config, spool_dir, [])
    results = []
    try:
        for name in names:
            switches, expected_message = server_faults(len(samples), plan.layer_ids(config))[name]
            victim.unlink()
            faulty = StandinServer(workdir, config, spool_dir, switches)
            try:
                use_server(workflow, faulty.url, spool_dir, request_timeout_s=1 if name == "server_slow" else 60)
                tally.fault(name)
                runs_before, completed_before = tally.runs, tally.runs_completed
                marks = LogMarks(workflow)
                result = workflow.resume(tally, target)
                output = result.stdout + result.stderr + marks.new_text()
                if name == "server_slow":
                    # The late answers land now, as they would on a server that stays up.
                    time.sleep(SLOW_SERVER_DELAY_S + 0.5)
            finally:
                faulty.stop()
            message = re.search(expected_message + r"[^\n]*", output)  # the whole line, for the report
            outcome = {
                "fault": name, "shard": victim.name, "switches": switches, "failed": result.returncode != 0,
                "message": message.group(0)[:500] if message else None, "clear_message": message is not None,
                "shard_left": victim.exists(),
                "partial_files_left": len(list(hidden_dir.glob(f"*{atomic.TMP_MARKER}*"))),
                # Late answers to requests the job gave up on land after it ended.
                "spool_files_after_failure": len(list(spool_dir.iterdir())),
            }
            use_server(workflow, healthy.url, spool_dir)  # the fault removed
            result = workflow.resume(tally, target)
            outcome["completed_after_fix"] = result.returncode == 0
            outcome["spool_files_left"] = sorted(p.name for p in spool_dir.iterdir())
            if victim.exists():
                rebuilt = shards.verify_shard(victim, deep=True)
                outcome["samples_lost"] = len(set(samples) - set(rebuilt.metadata["sample_ids"]))
                got = rebuilt.tensors()
                outcome["bitwise_equal_transformers"] = all(torch_equal(got[k], expected[k]) for k in shards.HIDDEN_TENSORS)
                outcome["file_equal_transformers"] = victim.read_bytes() == direct.read_bytes()
            else:
                outcome["samples_lost"], outcome["bitwise_equal_transformers"] = len(samples), False
            outcome["runs"], outcome["runs_completed"] = tally.runs - runs_before, tally.runs_completed - completed_before
            results.append(outcome)
    finally:
        healthy.stop()
    return results


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def tiny_setup(workdir: Path, conversations: int, samples_per_shard: int = 8, evaluate: bool = True) -> Path:
    """A tiny random target and synthetic conversations; returns the config path.
    ``evaluate`` False: the pipeline ends at the export (evaluation is not among the products
    compared with the reference, so it is only a stage to kill)."""
    from support import tiny

    target = tiny.make_tiny_target(workdir / "target")
    source = tiny.synthetic_conversations(workdir / "conversations.jsonl", conversations)
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    # Frequent checkpoints make kills during training count.
    config = tiny.workflow_config(base, target, source, run="chaos", max_conversations=conversations,
                                  samples_per_shard=samples_per_shard, checkpoint_every=3)
    config["evaluate"]["enabled"] = evaluate
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def new_workdir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    if (REPO / "resources").is_dir():
        os.symlink(REPO / "resources", path / "resources")
    return path


def counted(tally: Tally, inject) -> dict:
    """Run one injection and note how many Snakemake runs it took and how many completed."""
    runs, completed = tally.runs, tally.runs_completed
    outcome = inject()
    outcome["runs"], outcome["runs_completed"] = tally.runs - runs, tally.runs_completed - completed
    return outcome


class KindTable:
    """Per fault kind: injected, runs / completed, samples lost, corrupt outputs consumed,
    a clean failure (clear message, nothing partial, the user's way back works; None where
    the fault has no failure of its own) and an identical final result."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def add(self, kind: str, outcome: dict, *, clean: bool | None, identical: bool, samples_lost: int = 0,
            consumed: int = 0, injected: int = 1) -> None:
        row = self.rows.setdefault(kind, {"injected": 0, "runs": 0, "runs_completed": 0, "samples_lost": 0,
                                          "corrupt_outputs_consumed": 0, "clean_failure": clean,
                                          "identical_final_result": True})
        row["injected"] += injected
        row["runs"] += outcome.get("runs", 0)
        row["runs_completed"] += outcome.get("runs_completed", 0)
        row["samples_lost"] += samples_lost
        row["corrupt_outputs_consumed"] += int(consumed)
        if clean is not None:
            row["clean_failure"] = bool(row["clean_failure"]) and clean
        row["identical_final_result"] = row["identical_final_result"] and identical


def run_chaos(workdir: Path, kills: int, seed: int, configfile: Path | None = None, disk_full: bool = True,
              corruptions: int = 1, bad_record_examples: int = 200, conversations: int = 40, samples_per_shard: int = 8,
              checkpoint_disk_full: bool = True, checkpoint_corruptions: int = 1,
              server_fault_names: list[str] | None = None, evaluate: bool = True) -> dict:
    """``server_fault_names``: None for all of SERVER_FAULT_NAMES, [] for none; ``evaluate``:
    whether the tiny pipeline (no ``configfile``) ends with its evaluation stage."""
    from eaglenest.training import checkpoints

    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    if configfile is None:
        configfile = tiny_setup(workdir / "inputs", conversations, samples_per_shard, evaluate)
    server_fault_names = SERVER_FAULT_NAMES if server_fault_names is None else server_fault_names
    unknown = sorted(set(server_fault_names) - set(SERVER_FAULT_NAMES))
    if unknown:
        raise ValueError(f"unknown server faults {unknown}; known: {SERVER_FAULT_NAMES}")
    tally, kinds = Tally(), KindTable()
    reference_dir, chaos_dir = new_workdir(workdir / "reference"), new_workdir(workdir / "faulty")
    reference = Workflow(reference_dir, Path(shutil.copy(configfile, reference_dir / "config.yaml")))
    started = time.monotonic()
    result = reference.run()
    if result.returncode != 0:
        raise RuntimeError(f"reference run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    reference_seconds = time.monotonic() - started
    expected = final_outputs(reference)

    faulty = Workflow(chaos_dir, Path(shutil.copy(configfile, chaos_dir / "config.yaml")))

    def kill_phase() -> dict:
        inject_kills(faulty, kills, reference_seconds, rng, tally)
        resumed = faulty.resume(tally)
        if resumed.returncode != 0:
            tally.notes.append(f"resume after kills failed: {resumed.stderr[-2000:]}")
        return {}

    kill_outcome = counted(tally, kill_phase)
    corruption_results = [counted(tally, lambda: inject_corruption(faulty, rng, tally)) for _ in range(corruptions)]
    observed = final_outputs(faulty)
    for corruption in corruption_results:
        name = f"hidden/{corruption['victim']}"
        corruption["identical"] = observed.get(name) == expected[name]
    disk_full_results = []
    if disk_full and os.geteuid() == 0:
        # A copy of the reference directory: its Snakemake records with the ingest and prepare
        # outputs that each case puts on its tmpfs (inject_disk_full).
        disk = copy_finished_run(reference, workdir / "disk-full")
        hidden_bytes = sum(len(v) for k, v in expected.items() if k.startswith("hidden/"))
        for preflight in (True, False):
            outcome = counted(tally, lambda: inject_disk_full(disk, tally, max(hidden_bytes // 2, 1 << 20), preflight,
                                                              reference.results))
            outcome["identical"] = outcome.pop("outputs") == data_outputs(expected)
            outcome["kind"] = "disk_full_preflight" if preflight else "disk_full_write"
            disk_full_results.append(outcome)
    elif disk_full:
        tally.notes.append("disk-full faults skipped: mounting a tmpfs needs root")

    # Training: a full disk while a checkpoint is written, then corrupt checkpoints.
    reference_drafter = drafter_outputs(expected)
    checkpoint_disk_full_results, checkpoint_corruption_results = [], []
    if checkpoint_disk_full or checkpoint_corruptions:
        trainer = copy_finished_run(reference, workdir / "train-faults")
        if checkpoint_disk_full and os.geteuid() == 0:
            checkpoint_bytes = checkpoints.checkpoint_paths(checkpoint_dir(reference))[-1].stat().st_size
            outcome = counted(tally, lambda: inject_checkpoint_disk_full(trainer, tally, checkpoint_bytes))
            outcome["identical"] = outcome.pop("drafter") == reference_drafter
            checkpoint_disk_full_results.append(outcome)
        elif checkpoint_disk_full:
            tally.notes.append("checkpoint disk-full fault skipped: mounting a tmpfs needs root")
        for index in range(checkpoint_corruptions):
            how = CHECKPOINT_DAMAGE[index % len(CHECKPOINT_DAMAGE)]
            outcome = counted(tally, lambda: inject_checkpoint_corruption(trainer, how, rng, tally))
            outcome["identical"] = outcome.pop("drafter") == reference_drafter
            checkpoint_corruption_results.append(outcome)
    server_results = []
    if server_fault_names:
        server_results = inject_server_faults(reference, workdir / "server-faults", server_fault_names, rng, tally)

    bad = bad_records_check(workdir, rng, bad_record_examples)
    reference_samples = json.loads(Path(reference.layout.consolidated("index.json")).read_text())["totals"]["samples"]
    index_path = Path(faulty.layout.consolidated("index.json"))
    faulty_samples = json.loads(index_path.read_text())["totals"]["samples"] if index_path.exists() else 0
    pipeline_identical = observed == expected

    kinds.add("kill", kill_outcome, clean=None, identical=pipeline_identical,
              samples_lost=reference_samples - faulty_samples, injected=tally.faults.get("kill", 0))
    for c in corruption_results:
        kinds.add(f"corrupt_{c['how']}", c, clean=c["refused_by_name"] and c["rebuilt_only_victim"] and c["completed"],
                  identical=c["identical"], consumed=c["consumed"])
    for d in disk_full_results:
        kinds.add(d["kind"], d, clean=d["failed"] and d["clear_message"] and d["partial_files_left"] == 0
                  and d["completed_after_space"], identical=d["identical"])
    for d in checkpoint_disk_full_results:
        kinds.add("disk_full_checkpoint", d, identical=d["identical"],
                  clean=d["failed"] and d["clear_message"] and d["partial_files_left"] == 0
                  and not d["unverifiable_checkpoints_left"] and not d["drafter_left"] and d["completed_after_space"],
                  consumed=d["resumed_from"] in d["unverifiable_checkpoints_left"])
    for c in checkpoint_corruption_results:
        kinds.add(f"checkpoint_corrupt_{c['how']}", c, identical=c["identical"], consumed=c["consumed"],
                  clean=c["refused_by_name"] and c["resumed_from_newest_intact"] and c["older_untouched"]
                  and c["rebuilt_intact"] and c["completed"])
    for f in server_results:
        kinds.add(f["fault"], f, identical=f["bitwise_equal_transformers"], samples_lost=f["samples_lost"],
                  consumed=f["shard_left"],
                  clean=f["failed"] and f["clear_message"] and not f["shard_left"] and f["partial_files_left"] == 0
                  and not f["spool_files_left"] and f["completed_after_fix"])

    left = {"temp_files": [], "locks": []}
    for directory in (chaos_dir, workdir / "train-faults", workdir / "server-faults"):
        if directory.is_dir():
            for key, paths in leftovers(Workflow(directory, configfile)).items():
                left[key] += paths
    summary = {
        "command": " ".join(["python tests/support/chaos.py", f"--kills {kills}", f"--seed {seed}"]),
        "reference_seconds": round(reference_seconds, 1),
        "faults_injected": tally.faults,
        "kills_by_stage_in_flight": tally.stages_hit,
        "runs": tally.runs,
        "runs_completed": tally.runs_completed,
        "samples_lost": sum(row["samples_lost"] for row in kinds.rows.values()),
        "corrupt_outputs_consumed": sum(row["corrupt_outputs_consumed"] for row in kinds.rows.values()),
        "by_kind": kinds.rows,
        "corruptions": corruption_results,
        "disk_full": disk_full_results,
        "checkpoint_disk_full": checkpoint_disk_full_results,
        "checkpoint_corruptions": checkpoint_corruption_results,
        "server_faults": server_results,
        "bad_records": bad,
        "leftovers": left,
        "identical_final_result": all(row["identical_final_result"] for row in kinds.rows.values()),
        "differing_outputs": sorted(set(k for k in expected if observed.get(k) != expected[k]) | (set(observed) - set(expected))),
        "notes": tally.notes,
    }
    summary["ok"] = (
        summary["identical_final_result"]
        and summary["samples_lost"] == 0
        and summary["corrupt_outputs_consumed"] == 0
        and all(row["clean_failure"] is not False for row in kinds.rows.values())
        and bad["all_good_arrived"] and bad["counts_match"]
        and not left["temp_files"] and not left["locks"]
    )
    atomic.write_json(workdir / "chaos-summary.json", summary)
    return summary


def _yes(value) -> str:
    return "-" if value is None else ("yes" if value else "NO")


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
    overall = "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
    header = ("fault kind", "injected", "runs / completed", "samples lost", "corrupt consumed", "clean failure", "identical result")
    lines = [header] + [
        (kind, str(row["injected"]), f"{row['runs']} / {row['runs_completed']}", str(row["samples_lost"]),
         str(row["corrupt_outputs_consumed"]), _yes(row["clean_failure"]), _yes(row["identical_final_result"]))
        for kind, row in summary["by_kind"].items()
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    per_kind = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)
    return f"{overall}\n\n{per_kind}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/support/chaos.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("chaos-run"))
    parser.add_argument("--config", type=Path, default=None, help="workflow config (default: a tiny random target)")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--corruptions", type=int, default=3, help="hidden shards to corrupt")
    parser.add_argument("--no-disk-full", action="store_true", help="skip the full disk during extraction")
    parser.add_argument("--no-checkpoint-disk-full", action="store_true", help="skip the full disk during checkpointing")
    parser.add_argument("--checkpoint-corruptions", type=int, default=3,
                        help="training checkpoints to corrupt (flip, truncate, zero-fill in turn)")
    parser.add_argument("--server-faults", default="all",
                        help=f"comma-separated, 'all' or 'none': {', '.join(SERVER_FAULT_NAMES)}")
    parser.add_argument("--bad-records", type=int, default=500)
    args = parser.parse_args(argv)
    names = {"all": None, "none": []}.get(args.server_faults, [n for n in args.server_faults.split(",") if n])
    summary = run_chaos(args.workdir, args.kills, args.seed, args.config, disk_full=not args.no_disk_full,
                        corruptions=args.corruptions, bad_record_examples=args.bad_records,
                        checkpoint_disk_full=not args.no_checkpoint_disk_full,
                        checkpoint_corruptions=args.checkpoint_corruptions, server_fault_names=names)
    print(format_table(summary))
    print(f"summary: {args.workdir / 'chaos-summary.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
