"""Workflow lint, formatting, and environment files that agree with pyproject's pins."""

import subprocess
import sys
import tomllib

import pytest
import yaml

from conftest import REPO


def pins_from_pyproject() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"]) + [r for extra in project.get("optional-dependencies", {}).values() for r in extra]
    return dict(r.split("==", 1) for r in requirements)


@pytest.mark.integration
def test_snakemake_lint_is_clean():
    result = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
def test_snakefmt_leaves_the_workflow_unchanged():
    files = ["Snakefile", *sorted(str(p.relative_to(REPO)) for p in (REPO / "rules").glob("*.smk"))]
    result = subprocess.run([sys.executable, "-m", "snakefmt", "--check", *files], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_env_file_parses_and_pins_what_pyproject_pins():
    pins = pins_from_pyproject()
    env_files = sorted((REPO / "envs").glob("*.yaml"))
    assert env_files
    for env_file in env_files:
        env = yaml.safe_load(env_file.read_text())
        pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
        for requirement in pip:
            if requirement.startswith("-e"):
                continue
            name, version = requirement.split("==", 1)
            if name in pins:
                assert pins[name] == version, f"{env_file.name}: {name}=={version}, pyproject pins {pins[name]}"


def test_every_rule_file_is_included_and_every_script_is_used():
    snakefile = (REPO / "Snakefile").read_text()
    for rule_file in (REPO / "rules").glob("*.smk"):
        assert f'"rules/{rule_file.name}"' in snakefile, rule_file.name
    rules_text = "".join(p.read_text() for p in (REPO / "rules").glob("*.smk"))
    for script in (REPO / "scripts").glob("*.py"):
        assert f"../scripts/{script.name}" in rules_text, f"{script.name} is called by no rule"
