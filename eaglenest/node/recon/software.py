"""The code and the target model: pins against what is installed, git state, the model's files."""

from __future__ import annotations

import json
import re
import subprocess
from importlib import metadata
from pathlib import Path

from eaglenest import layout, plan  # shard_header: header checks without torch
from eaglenest.formats import shard_header
from eaglenest.node.recon.status import BLOCK, NA, OK, REPO, WARN


def _pins(repo: Path) -> dict[str, str]:
    import tomllib

    pins = {}
    pyproject = repo / "pyproject.toml"
    if pyproject.exists():
        for requirement in tomllib.loads(pyproject.read_text())["project"].get("dependencies", []):
            if "==" in requirement:
                name, version = requirement.split("==", 1)
                pins[name.strip().lower()] = version.strip()
    # The node's SGLang pin lives in its own conda env file.
    for env_file in sorted((repo / "envs").glob("*.yaml")):
        for match in re.finditer(r"\bsglang(?:\[[^\]]*\])?==([\w.+-]+)", env_file.read_text()):
            pins.setdefault("sglang", match.group(1))
    return pins


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git(repo: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(["git", "--no-optional-locks", "-C", str(repo), *args],
                                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def sglang_patch_state() -> dict:
    """Whether eaglenest's SGLang patch module is part of this install, and what it says of itself."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("eaglenest.sglang.patch") is None:
        return {"state": NA, "detail": "eaglenest.sglang.patch is not part of this install"}
    try:
        module = importlib.import_module("eaglenest.sglang.patch")
    except Exception as err:  # a broken patch module is a finding, not a crash
        return {"state": "broken", "detail": f"import failed: {type(err).__name__}: {err}"}
    detail = f"patch version {getattr(module, 'PATCH_VERSION', '?')} for sglang {getattr(module, 'SGLANG_VERSION', '?')}"
    return {"state": "present", "detail": detail, "patch_version": getattr(module, "PATCH_VERSION", None),
            "for_sglang": getattr(module, "SGLANG_VERSION", None)}


def check_code(config: dict, workdir: Path, repo: Path = REPO) -> dict:
    head = _git(repo, "rev-parse", "--short", "HEAD")
    porcelain = _git(repo, "status", "--porcelain", "--untracked-files=no")
    dirty = [line[3:] for line in (porcelain or "").splitlines() if line.strip()]
    pins = _pins(repo)
    packages = {}
    mismatched = []
    for name in ("torch", "transformers", "safetensors", "snakemake", "sglang"):
        installed = _installed(name)
        pinned = pins.get(name)
        # Local version labels (2.13.0+cpu) are builds of the same release.
        matches = installed is not None and pinned is not None and installed.split("+")[0] == pinned
        packages[name] = {"installed": installed, "pinned": pinned, "matches": matches}
        if installed is not None and pinned is not None and not matches:
            mismatched.append(f"{name} {installed} (pinned {pinned})")
    patch = sglang_patch_state()
    target = check_target_model(config, workdir)
    status, steps = OK, list(target["steps"])
    if mismatched or patch["state"] == "broken":
        status = WARN
    if config["extract"]["backend"] == "sglang" and patch["state"] != "present":
        status = BLOCK
        steps.append({"command": None, "why": f"extract.backend=sglang but the SGLang patch is {patch['state']}"})
    if target["status"] == BLOCK:
        status = BLOCK
    elif target["status"] == WARN and status == OK:
        status = WARN
    git_text = f"git {head.strip()}" if head else "not a git checkout"
    if head:
        git_text += f" ({len(dirty)} modified file(s))" if dirty else " (clean)"
    checked = [n for n, p in packages.items() if p["installed"] and p["pinned"]]
    versions = f"{', '.join(mismatched)} differ from the pins" if mismatched else f"{len(checked)} pinned packages match"
    sglang = packages["sglang"]["installed"]
    summary = (f"{git_text}; {versions}; sglang {sglang or 'not installed'}; "
               f"SGLang patch {patch['state']}" + (f" ({patch['detail']})" if patch["state"] != NA else ""))
    return {"status": status, "summary": summary, "target_summary": target["summary"], "git_commit": head.strip() if head else None,
            "dirty_files": dirty, "packages": packages, "mismatched": mismatched, "sglang_patch": patch,
            "target_model": target, "steps": steps}


def safetensors_intact(path: Path) -> str | None:
    """None when the file's header is readable and its size matches; else what is wrong."""
    try:
        header_len, infos, _, size = shard_header.read_safetensors_header(path)
        shard_header.check_data_size(path, header_len, infos, size)
    except shard_header.ShardError as err:
        return err.reason
    except OSError as err:
        return f"unreadable ({err})"
    return None


def outputs_reading_target(config: dict, workdir: Path) -> str | None:
    """The run's outputs made from the target model that exist (regenerated and hidden
    shards), as words, or None."""
    paths = layout.RunLayout(config, workdir)
    found = []
    if plan.regeneration(config):
        regenerated = len(list(Path(paths.regenerated_path()).glob("shard-*.jsonl")))
        if regenerated:
            found.append(f"{regenerated} regenerated shard(s)")
    hidden = len(list(Path(paths.hidden_dir()).glob("shard-*.safetensors")))
    if hidden:
        found.append(f"{hidden} hidden-state shard(s)")
    return " and ".join(found) or None


def check_target_model(config: dict, workdir: Path) -> dict:
    """The target model directory: config, tokenizer, every weight file of the index, sizes."""
    path = Path(config["target"]["path"])
    path = path if path.is_absolute() else workdir / path
    result = {"path": str(path), "problems": [], "weight_files": 0, "weight_bytes": 0, "steps": []}
    if not path.is_dir():
        if config["target"].get("embedded"):
            result.update(status=OK, summary=f"target {path.name}: not converted yet (the workflow makes it)")
            readers = outputs_reading_target(config, workdir)
            if readers:
                # Snakemake plans every reader of an ancient() input whose producer must run
                # (docs/reruns.md): converting first keeps what was brought in.
                result.update(status=WARN, summary=f"target {path.name}: not converted yet, and {readers} exist: "
                                                   "a run that converts it would make them all again")
                result["steps"].append({"command": "snakemake --cores 4 --until convert_embedded_target",
                                        "with_configfiles": True,
                                        "why": f"convert the target before anything else, so that the {readers} "
                                               "already here are not planned again"})
        elif config["extract"]["backend"] == "sglang":
            result.update(status=NA, summary=f"target {path}: not on this machine (the SGLang server loads it)")
        else:
            result.update(status=BLOCK, summary=f"target model directory {path} does not exist")
            result["steps"].append({"command": None, "why": f"copy the target model to {path}"})
        return result
    problems = result["problems"]
    if not (path / "config.json").exists():
        problems.append("config.json missing")
    if not any((path / n).exists() for n in ("tokenizer.json", "tokenizer.model", "tiktoken.model")):
        problems.append("no tokenizer file (tokenizer.json / tokenizer.model)")
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError):
            files = []
            problems.append("model.safetensors.index.json unreadable")
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            problems.append("no *.safetensors weight files")
    for name in files:
        weight = path / name
        if not weight.exists():
            problems.append(f"weight file {name} missing")
            continue
        result["weight_files"] += 1
        result["weight_bytes"] += weight.stat().st_size
        damage = safetensors_intact(weight)
        if damage:
            problems.append(f"weight file {name}: {damage}")
    if problems:
        result["status"] = BLOCK
        result["summary"] = f"target {path.name} incomplete: {'; '.join(problems[:3])}" + (" ..." if len(problems) > 3 else "")
        result["steps"].append({"command": None, "why": f"restore the target model directory {path} ({problems[0]})"})
    else:
        result["status"] = OK
        result["summary"] = (f"target {path.name} complete: {result['weight_files']} weight file(s), "
                             f"{plan.human_bytes(result['weight_bytes'])}")
    return result
