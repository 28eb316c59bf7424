"""The run's outputs against the workflow's plan: what is done, missing, partial or stale."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
from pathlib import Path
from typing import Iterable

from eaglenest import layout, plan  # shard_header: header checks without torch
from eaglenest.formats import atomic, shard_header
from eaglenest.node.recon.software import safetensors_intact
from eaglenest.node.recon.status import BLOCK, NA, OK, REPO, WARN


# Later stages (written by other rule files) and the directory each fills under results/<run>/.
# Paths from eaglenest.layout, the rules' own.
LATER_STAGES = {
    "checkpoints": ("train", layout.RunLayout.checkpoint_dir),
    "drafter": ("train", layout.RunLayout.drafter_dir),
    "export": ("export", layout.RunLayout.export_path),
    "eval": ("evaluate", layout.RunLayout.evaluation_path),
}


# The jobs after consolidate whose outputs recon checks, in order: rule -> (its outputs under
# results/<run>/, the rule whose outputs it reads). A directory output counts only with its
# config.json and an intact model.safetensors: Snakemake sees the directory and plans nothing.
LATER_JOBS = {
    "train_drafter": (lambda paths: [paths.drafter_dir(), paths.training_summary()], "consolidate"),
    "export_drafter": (
        lambda paths: [paths.export_path("sglang"), paths.export_path("vllm"), paths.export_report()], "train_drafter"),
    "evaluate_summary": (
        lambda paths: [paths.evaluation_path("summary.json"), paths.evaluation_path("summary.tsv")], "train_drafter"),
}


def _run_dir(workdir: Path, config: dict) -> Path:
    return layout.RunLayout(config, workdir).run_dir


def hidden_location(config: dict, workdir: Path) -> Path:
    """Where the hidden shards are stored: extract.hidden_dir, which results/<run>/hidden links
    to once the workflow has run, else results/<run>/hidden."""
    configured = config["extract"].get("hidden_dir")
    return workdir / configured if configured else Path(layout.RunLayout(config, workdir).hidden_dir())


def _shard_name(shard_id: int) -> str:
    return layout.shard_name(shard_id)


def _mtimes(directory: Path) -> dict[str, float]:
    """File name -> mtime of every entry of ``directory`` (empty when it does not exist)."""
    try:
        with os.scandir(directory) as entries:
            return {entry.name: entry.stat().st_mtime for entry in entries}
    except FileNotFoundError:
        return {}


def _leftovers(directory: Path) -> dict[str, list[Path]]:
    """Temp files of atomic writers, keyed by the final file name they were meant to become."""
    found: dict[str, list[Path]] = {}
    if directory.is_dir():
        for path in directory.glob(f"*{atomic.TMP_MARKER}*"):
            found.setdefault(path.name.split(atomic.TMP_MARKER)[0], []).append(path)
    return found


def writer_alive(temp: Path) -> bool:
    """A temp file whose writer pid still runs is being written, not left over."""
    pid = temp.name.rsplit(atomic.TMP_MARKER, 1)[-1]
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")


def incomplete_markers(workdir: Path) -> list[dict]:
    """Outputs Snakemake marked incomplete (.snakemake/incomplete/<urlsafe-b64 path>)."""
    root = workdir / ".snakemake" / "incomplete"
    markers = []
    if not root.is_dir():
        return markers
    for directory, _, files in os.walk(root):
        for name in files:
            if name == "migration_underway":
                continue
            # Long names are split into "@"-prefixed directory levels.
            parts = list(Path(directory).relative_to(root).parts) + [name]
            encoded = "".join(part.lstrip("@") for part in parts if part != ".")
            try:
                path = base64.urlsafe_b64decode(encoded.encode()).decode()
            except (ValueError, UnicodeDecodeError):
                continue
            markers.append({"path": path, "exists": (workdir / path).exists()})
    return sorted(markers, key=lambda m: m["path"])


def _later_stage(workdir: Path, paths: layout.RunLayout, repo: Path, key: str, deep: bool = False) -> dict:
    rule_file, directory = LATER_STAGES[key]
    path = Path(directory(paths))
    # A stage exists once the Snakefile includes its rule file.
    snakefile = repo / "Snakefile"
    has_rules = snakefile.exists() and f'"rules/{rule_file}.smk"' in snakefile.read_text()
    entries = sorted(path.iterdir()) if path.is_dir() else []
    entry = {"path": str(path.relative_to(workdir)), "rules": has_rules, "files": len(entries)}
    if not entries:
        entry["state"] = "missing" if has_rules else NA
        return entry
    entry["state"] = "present"
    if key == "checkpoints":
        steps = [int(m.group(1)) for e in entries if not atomic.TMP_MARKER in e.name
                 if (m := re.search(r"(\d+)(?:\.\w+)?$", e.name))]
        entry["checkpoints"] = len(steps)
        entry["latest_step"] = max(steps) if steps else None
        entry["leftovers"] = [str(e) for e in entries if atomic.TMP_MARKER in e.name]
    if key == "drafter" and deep and (path / "model.safetensors").exists():
        from eaglenest.model.drafter import weights_problem  # imports torch, as the deep check may

        problem = weights_problem(path)
        if problem:
            entry.update(state="corrupt", problem=problem)
    return entry


def output_problem(path: Path) -> str | None:
    """What is wrong with a finished output of a later stage, from its files alone; None if fine."""
    if path.suffix in (".json", ".tsv"):
        if not path.is_file():
            return "missing"
        if path.suffix == ".json":
            try:
                json.loads(path.read_text())
            except (ValueError, OSError) as err:
                return f"not valid JSON ({err})"
        return None
    if not path.is_dir() or not any(path.iterdir()):
        return "missing"
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            return f"{name} missing"
    return safetensors_intact(path / "model.safetensors")


def _output_mtime(path: Path) -> float:
    # Snakemake dates a directory output by the timestamp file it leaves inside.
    stamp = path / ".snakemake_timestamp"
    return (stamp if stamp.exists() else path).stat().st_mtime


def later_jobs(config: dict, paths: layout.RunLayout, repo: Path, predicted: dict, marked) -> tuple[dict, list]:
    """The train, export and evaluate jobs snakemake will plan, and the damaged outputs it will not
    see (to remove first): {rule: 1}, [(rule, path, problem)]."""
    snakefile = repo / "Snakefile"
    included = snakefile.read_text() if snakefile.exists() else ""
    enabled = {
        "train_drafter": '"rules/train.smk"' in included,
        "export_drafter": '"rules/export.smk"' in included,
        "evaluate_summary": '"rules/evaluate.smk"' in included and config["evaluate"]["enabled"],
    }
    consolidated = [Path(p) for p in paths.consolidated_files()]
    inputs = {"consolidate": consolidated, "train_drafter": [Path(paths.drafter_dir())]}
    if config["evaluate"].get("drafter"):
        enabled["evaluate_summary"] = False  # evaluates a drafter trained elsewhere: not this chain
    planned, damaged = {}, []
    for rule, (outputs, upstream) in LATER_JOBS.items():
        if not enabled[rule]:
            continue
        output_paths = [Path(o) for o in outputs(paths)]
        problems = [(p, output_problem(p)) for p in output_paths]
        for path, problem in problems:
            if problem and problem != "missing":
                damaged.append((rule, path, problem))
        upstream_runs = upstream in predicted or upstream in planned
        upstream_times = [_output_mtime(p) for p in inputs.get(upstream, []) if p.exists()]
        missing = any(problem for _, problem in problems)
        newer_input = not missing and max(upstream_times, default=0.0) > min(_output_mtime(p) for p in output_paths)
        if upstream_runs or missing or newer_input or marked(output_paths):
            planned[rule] = 1
    return planned, damaged


def check_workflow(config: dict, workdir: Path, deep: bool = False, repo: Path = REPO) -> dict:
    """Shards done / missing / partial / corrupt / incomplete and what ``snakemake -n`` will plan."""
    if deep:
        from eaglenest.formats import shards  # imports torch: checksums and values need it

    paths = layout.RunLayout(config, workdir)
    run_dir = paths.run_dir
    num_shards = plan.num_shards(config)
    layer_ids = plan.layer_ids(config)
    expect = {"target": config["target"]["name"], "layer_ids": layer_ids, "dtype": config["extract"]["dtype"]}
    # Shard paths as the workflow names them (results/<run>/hidden, a link with extract.hidden_dir);
    # read where they are stored.
    hidden_dir, prepared_dir = Path(paths.hidden_dir()), Path(paths.prepared_dir())
    stored_dir = hidden_location(config, workdir)
    hidden_leftovers, prepared_leftovers = _leftovers(stored_dir), _leftovers(prepared_dir)
    incomplete = {m["path"] for m in incomplete_markers(workdir) if m["exists"]}
    prepare_report_path = prepared_dir / "prepare_report.json"
    per_shard_plan: dict[int, dict] = {}
    if prepare_report_path.exists():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            per_shard_plan = {s["shard_id"]: s for s in json.loads(prepare_report_path.read_text())["shards"]}

    # One directory scan instead of a stat per shard: 10,000 shards stay well under a second.
    hidden_mtimes, prepared_mtimes = _mtimes(stored_dir), _mtimes(prepared_dir)
    hidden_rel = str(hidden_dir.relative_to(workdir))
    rows = []
    for shard_id in range(num_shards):
        name = _shard_name(shard_id)
        hidden = os.path.join(stored_dir, name)
        rel = f"{hidden_rel}/{name}"
        row = {"shard": shard_id, "path": rel, "state": None, "samples": 0, "tokens": 0, "reason": None,
               "leftovers": [f"{hidden_rel}/{p.name}" for p in hidden_leftovers.get(name, [])]}
        row["writing"] = any(writer_alive(p) for p in hidden_leftovers.get(name, []))
        if name in hidden_mtimes:
            try:
                if deep:
                    meta = shards.verify_shard(hidden, deep=True, expect=expect).metadata
                else:
                    _, meta = shard_header.verify_header(hidden, expect)
                row["samples"], row["tokens"] = len(meta["sample_ids"]), sum(meta["token_counts"])
                row["state"] = "incomplete" if rel in incomplete else "done"
            except shard_header.ShardError as err:
                row["state"], row["reason"] = "corrupt", err.reason
        else:
            row["state"] = "partial" if row["leftovers"] else "missing"
        if row["state"] != "done":
            planned = per_shard_plan.get(shard_id)
            if planned is None and name in prepared_mtimes:
                with contextlib.suppress(shard_header.ShardError, KeyError):
                    _, meta = shard_header.read_header(prepared_dir / name)
                    planned = {"samples": len(meta["sample_ids"]), "tokens": sum(meta["token_counts"])}
            row["planned_tokens"] = planned["tokens"] if planned else None
            row["planned_samples"] = planned["samples"] if planned else None
        rows.append(row)

    by_state = {state: [r["shard"] for r in rows if r["state"] == state]
                for state in ("done", "missing", "partial", "corrupt", "incomplete")}
    # What snakemake plans: absent outputs and outputs it marked incomplete (with
    # --rerun-incomplete). A corrupt file it cannot see: recon says to remove it first.
    to_build = sorted(by_state["missing"] + by_state["partial"] + by_state["incomplete"])
    rebuild_after_rm = by_state["corrupt"]

    numbers = plan.plan(config, prepare_report_path)
    done_rows = [r for r in rows if r["state"] == "done"]
    samples_total = sum(s["samples"] for s in per_shard_plan.values()) if per_shard_plan else None
    tokens_total = numbers["tokens"]
    remaining = [r for r in rows if r["state"] != "done"]
    known = [r["planned_tokens"] for r in remaining if r.get("planned_tokens") is not None]
    if len(known) == len(remaining):
        remaining_tokens, tokens_source = sum(known), "counted by prepare"
    else:
        remaining_tokens = round(numbers["tokens"] * len(remaining) / max(num_shards, 1))
        tokens_source = numbers["tokens_source"]

    prepared_missing = [i for i in range(num_shards) if _shard_name(i) not in prepared_mtimes]
    ingest_outputs = [Path(paths.conversations()), Path(paths.ingest_report())]
    consolidate_outputs = [Path(p) for p in paths.consolidated_files()]
    source_paths = [workdir / paths.source_path(s) for s in config["data"]["sources"]]

    def stale(outputs: list[Path], input_mtimes: Iterable[float]) -> bool:
        """Snakemake's mtime trigger: an output is missing or older than an input."""
        if not all(p.exists() for p in outputs):
            return True
        oldest = min(p.stat().st_mtime for p in outputs)
        return max(input_mtimes, default=0.0) > oldest

    def mtimes(paths: list[Path]) -> list[float]:
        return [p.stat().st_mtime for p in paths if p.exists()]

    def marked(outputs) -> bool:
        return any(str(p.relative_to(workdir)) in incomplete for p in outputs)

    shard_names = {_shard_name(i) for i in range(num_shards)}
    predicted: dict[str, int] = {}
    if stale(ingest_outputs, mtimes(source_paths)) or marked(ingest_outputs):
        predicted["ingest"] = 1
    prepared_rel = str(prepared_dir.relative_to(workdir))
    # One prepare job per shard: all of them after new conversations, else the missing ones
    # and those Snakemake marked incomplete; then the report that sums their headers.
    conversations_time = max(mtimes(ingest_outputs[:1]), default=0.0)
    prepare_shards = {
        i for i in range(num_shards)
        if "ingest" in predicted or _shard_name(i) not in prepared_mtimes
        or prepared_mtimes[_shard_name(i)] < conversations_time
        or f"{prepared_rel}/{_shard_name(i)}" in incomplete
    }
    if prepare_shards:
        predicted["prepare"] = len(prepare_shards)
    report_time = prepared_mtimes.get("prepare_report.json")
    if prepare_shards or report_time is None or report_time < max(
        (t for n, t in prepared_mtimes.items() if n in shard_names), default=0.0
    ) or f"{prepared_rel}/prepare_report.json" in incomplete:
        predicted["prepare_report"] = 1
    if to_build:
        predicted["extract_hidden_states"] = len(to_build)
    consolidate_inputs = [t for n, t in hidden_mtimes.items() if n in shard_names]
    consolidate_inputs += [t for n, t in prepared_mtimes.items() if n in shard_names]
    if predicted or stale(consolidate_outputs, consolidate_inputs) or marked(consolidate_outputs):
        predicted["consolidate"] = 1

    index_state = {"path": str(consolidate_outputs[0].relative_to(workdir))}
    if consolidate_outputs[0].exists():
        try:
            totals = json.loads(consolidate_outputs[0].read_text())["totals"]
            index_state.update(state="stale" if "consolidate" in predicted else "done", totals=totals)
        except (ValueError, KeyError):
            index_state.update(state="corrupt")
    else:
        index_state["state"] = "missing"
    later = {key: _later_stage(workdir, paths, repo, key, deep) for key in LATER_STAGES}
    later_planned, later_damaged = later_jobs(config, paths, repo, predicted, marked)
    predicted.update(later_planned)

    steps = []
    corrupt_paths = [rows[i]["path"] for i in rebuild_after_rm]
    if corrupt_paths:
        steps.append({"command": "rm " + " ".join(corrupt_paths),
                      "why": f"remove {len(corrupt_paths)} corrupt shard(s) so they are rebuilt alone"})
    stale_temps = [p for r in rows for p in r["leftovers"] if not r["writing"]]
    stale_temps += [str(p.relative_to(workdir)) for ps in prepared_leftovers.values() for p in ps if not writer_alive(p)]
    if stale_temps:
        steps.append({"command": "rm " + " ".join(stale_temps),
                      "why": f"remove {len(stale_temps)} partial file(s) left by killed writers (or: eaglenest recon --fix)",
                      "safe_fix": stale_temps})
    if later["drafter"]["state"] == "corrupt":
        steps.append({"command": f"rm -r {later['drafter']['path']}",
                      "why": f"the trained drafter is corrupt ({later['drafter']['problem']}); "
                             "the rerun resumes training from its last checkpoint and writes it again"})
    for rule, path, problem in later_damaged:
        if rule == "train_drafter" and later["drafter"]["state"] == "corrupt":
            continue  # the deep check's step above says it
        rel = str(path.relative_to(workdir))
        steps.append({"command": f"rm -r {rel}" if path.is_dir() else f"rm {rel}",
                      "why": f"{rel} is damaged ({problem}); snakemake sees it exists and would not make it again"})
    if any(r["state"] == "corrupt" for r in rows) or later["drafter"]["state"] == "corrupt" or later_damaged:
        status = BLOCK
    elif predicted or stale_temps:
        status = WARN
    else:
        status = OK
    samples_done = sum(r["samples"] for r in done_rows)
    tokens_done = sum(r["tokens"] for r in done_rows)
    counts = ", ".join(f"{len(by_state[state])} {state}" for state in ("done", "missing", "partial", "corrupt"))
    if by_state["incomplete"]:
        counts += f", {len(by_state['incomplete'])} incomplete"
    summary = (f"{num_shards} shards ({'deep' if deep else 'header'} check): {counts}; "
               f"samples {samples_done:,}/{'?' if samples_total is None else format(samples_total, ',')}")
    summary += f", tokens {tokens_done:,}/{tokens_total:,}"
    if later_damaged:
        summary += "; damaged: " + ", ".join(f"{path.relative_to(workdir)} ({problem})" for _, path, problem in later_damaged)
    return {
        "status": status,
        "summary": summary,
        "run": config["run"],
        "run_dir": str(run_dir.relative_to(workdir)),
        "deep": deep,
        "num_shards": num_shards,
        "shards": rows,
        "by_state": by_state,
        "to_build": to_build,
        "rebuild_after_rm": rebuild_after_rm,
        "samples_done": samples_done,
        "samples_total": samples_total,
        "tokens_done": tokens_done,
        "tokens_total": tokens_total,
        "remaining_tokens": remaining_tokens,
        "remaining_tokens_source": tokens_source,
        "bytes_per_token": numbers["bytes_per_token"],
        "prepared_missing": prepared_missing,
        "predicted_jobs": predicted,
        "index": index_state,
        "draft_vocab": "done" if consolidate_outputs[1].exists() else "missing",
        "split": "done" if consolidate_outputs[2].exists() else "missing",
        "later_stages": later,
        "later_damaged": [{"rule": rule, "path": str(path.relative_to(workdir)), "problem": problem}
                          for rule, path, problem in later_damaged],
        "steps": steps,
    }
