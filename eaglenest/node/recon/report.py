"""All checks together: the verdict, the ordered steps, the text report and ``eaglenest recon``."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from pathlib import Path
from typing import Callable, Iterable

from eaglenest import plan
from eaglenest.formats import atomic
from eaglenest.node.recon.config import load_config
from eaglenest.node.recon.disk import check_disk
from eaglenest.node.recon.gpus import check_gpus, run_nvidia_smi
from eaglenest.node.recon.processes import check_snakemake, list_processes
from eaglenest.node.recon.servers import check_servers
from eaglenest.node.recon.software import check_code
from eaglenest.node.recon.status import BLOCK, NA, OK, ReconError, REPO, WARN
from eaglenest.node.recon.workflow import check_workflow, writer_alive


def snakemake_command(configfiles: list[str], workdir: Path, *args: str) -> str:
    parts = ["snakemake", *args]
    if workdir.resolve() != Path.cwd().resolve():
        parts += ["--directory", str(workdir)]
    for path in configfiles:
        parts += ["--configfile", path]
    return shlex.join(parts)


def verdict(sections: dict, configfiles: list[str], workdir: Path) -> dict:
    """Blockers first (reason, then command), then the snakemake command that resumes."""
    order = ("snakemake", "gpus", "servers", "code", "disk", "workflow")
    blockers = [f"{name}: {sections[name]['summary']}" for name in order if sections[name]["status"] == BLOCK]
    steps = []
    for name in order:
        for step in sections[name].get("steps", []):
            step = dict(step)
            if step.get("command") == "snakemake --unlock":
                step["command"] = snakemake_command(configfiles, workdir, "--unlock")
            elif step.get("with_configfiles"):
                step["command"] = shlex.join(shlex.split(step["command"]) + [
                    arg for path in configfiles for arg in ("--configfile", path)])
            steps.append(step)
    workflow, disk, smk = sections["workflow"], sections["disk"], sections["snakemake"]
    jobs = workflow["predicted_jobs"]
    if not smk["snakemake_alive"]:
        left = len(workflow["to_build"]) + len(workflow["rebuild_after_rm"])
        if left:
            # Once the corrupt shards are removed, snakemake plans them too.
            jobs = dict(jobs, extract_hidden_states=left, consolidate=1)
        if jobs:
            extra = ("--rerun-incomplete",) if smk["rerun_incomplete"] else ()
            planned = ", ".join(f"{rule} {count}" for rule, count in jobs.items())
            if left:
                why = (f"{left} shards left ({planned}), {plan.human_bytes(disk['needed_bytes'])} needed, "
                       f"{plan.human_bytes(disk['free_bytes'])} free")
            else:
                why = f"hidden states complete; to run: {planned}"
            steps.append({"command": snakemake_command(configfiles, workdir, "--cores", "all", *extra), "why": why})
    first = next((s for s in steps if s.get("command")), None)
    if blockers and steps and not steps[0].get("command"):
        next_command = f"(by hand) {steps[0]['why']}"
    elif first:
        next_command = first["command"]
    else:
        next_command = "nothing to run: every planned output, through evaluation, exists and verifies"
    return {"ready": not blockers, "blockers": blockers, "steps": steps, "next_command": next_command}


def recon(workdir: str | os.PathLike = ".", configfiles: Iterable[str] = (), deep: bool = False,
          server_url: str | None = None, repo: Path = REPO, nvidia_smi: Callable[[list[str]], str] | None = None,
          server_timeout: float = 3.0) -> dict:
    workdir = Path(workdir)
    configfiles = list(configfiles)
    config = load_config(workdir, configfiles, repo)
    processes = list_processes()
    workflow = check_workflow(config, workdir, deep=deep, repo=repo)
    gpus_needed = config["extract"]["device"] != "cpu" and bool(workflow["predicted_jobs"])
    sections = {
        "gpus": check_gpus(processes, gpus_needed, nvidia_smi or run_nvidia_smi),
        "servers": check_servers(config, processes, server_url=server_url, timeout=server_timeout),
        "workflow": workflow,
        "snakemake": check_snakemake(workdir, processes),
        "disk": check_disk(config, workdir, workflow),
        "code": check_code(config, workdir, repo),
    }
    return {"run": config["run"], "workdir": str(workdir.resolve()), "configfiles": configfiles,
            "sections": sections, "verdict": verdict(sections, configfiles, workdir)}


def fix(report: dict) -> list[str]:
    """Do the safe subset of the steps: stale temp files and stale locks, never with snakemake alive."""
    workdir = Path(report["workdir"])
    if report["sections"]["snakemake"]["snakemake_alive"]:
        return []
    done = []
    for name in ("workflow", "snakemake"):
        for step in report["sections"][name]["steps"]:
            for rel in step.get("safe_fix", []):
                path = workdir / rel
                # Re-check at the moment of deletion: a writer may have started since.
                if atomic.TMP_MARKER in path.name and writer_alive(path):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    done.append(f"removed {rel}")
    return done


SECTION_TITLES = (("gpus", "GPUs"), ("servers", "Servers"), ("workflow", "Workflow"),
                  ("snakemake", "Snakemake"), ("disk", "Disk"), ("code", "Code"))


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _later_line(workflow: dict) -> str:
    parts = [f"index {workflow['index']['state']}", f"draft vocab {workflow['draft_vocab']}", f"split {workflow['split']}"]
    for key, stage in workflow["later_stages"].items():
        state = "n/a" if stage["state"] == NA else stage["state"]
        if key == "checkpoints" and state == "present":
            state = f"{stage['checkpoints']} (step {stage['latest_step']})"
        parts.append(f"{key} {state}")
    return "; ".join(parts)


STATUS_LABELS = {OK: "ok", WARN: "warn", BLOCK: "BLOCK", NA: "n/a"}


def render(report: dict, width: int = 120) -> str:
    sections = report["sections"]
    lines = [f"eaglenest recon: run {report['run']} in {report['workdir']}"]
    for key, title in SECTION_TITLES:
        section = sections[key]
        lines.append(_shorten(f"{title:<10}{STATUS_LABELS[section['status']]:<6}{section['summary']}", width))
        if key == "workflow":
            lines.append(_shorten(f"{'':16}{_later_line(section)}", width))
            for state in ("partial", "corrupt"):
                ids = section["by_state"][state]
                if ids:
                    reasons = "; ".join(f"{section['shards'][i]['path']}: {section['shards'][i]['reason']}"
                                        if state == "corrupt" else section["shards"][i]["path"] for i in ids[:2])
                    lines.append(_shorten(f"{'':16}{state}: {reasons}" + (" ..." if len(ids) > 2 else ""), width))
        if key == "code":
            lines.append(_shorten(f"{'':16}{section['target_summary']}", width))
        if key == "gpus":
            for holder in section.get("holders", [])[:3]:
                lines.append(_shorten(f"{'':16}pid {holder['pid']} [{holder['kind_label']}] started {holder['started']}: "
                                      f"{holder['cmdline']}", width))
    result = report["verdict"]
    lines.append("")
    finished = result["ready"] and result["next_command"].startswith("nothing to run")
    lines.append("Verdict: finished" if finished else "Verdict: ready to resume" if result["ready"]
                 else f"Verdict: BLOCKED: {result['blockers'][0]}")
    for blocker in result["blockers"][1:3]:
        lines.append(_shorten(f"         also: {blocker}", width))
    if result["steps"]:
        lines.append("Next steps:")
        for number, step in enumerate(result["steps"][:6], 1):
            command = step.get("command")
            text = f"{command}   # {step['why']}" if command else f"(by hand) {step['why']}"
            lines.append(_shorten(f"  {number}. {text}", width))
    for done in report.get("fixed", [])[:4]:
        lines.append(_shorten(f"fixed: {done}", width))
    lines.append(_shorten(f"Next command: {result['next_command']}", width))
    return "\n".join(lines)


def exit_code(report: dict) -> int:
    return 0 if report["verdict"]["ready"] else 1


def main(args) -> int:
    """Entry for ``eaglenest recon`` (arguments parsed by eaglenest.cli)."""
    try:
        report = recon(args.directory, args.configfile or [], deep=args.deep, server_url=args.server_url)
        if args.fix:
            fixed = fix(report)
            if fixed:
                report = recon(args.directory, args.configfile or [], deep=args.deep, server_url=args.server_url)
            report["fixed"] = fixed
    except ReconError as err:
        print(f"eaglenest recon: {err}", file=__import__("sys").stderr)
        return 2
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    return exit_code(report)
