"""eaglenest as a user installs it: a wheel (not editable) in a fresh virtual environment,
outside the source checkout, runs the settings and the CLI; no product module reaches into
tests/."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import REPO


def run(command: list, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}: {result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.integration
def clone_files() -> list[str]:
    """The checkout's files as a clone has them (git's list; without git, the tree less what
    .gitignore names at the top level)."""
    try:
        listing = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                 capture_output=True, text=True)
        if listing.returncode == 0:
            return listing.stdout.splitlines()
    except FileNotFoundError:  # no git on the machine
        pass
    skipped = {".git", ".venv", "results", "resources", "logs", ".snakemake", ".pytest_cache", ".hypothesis", "build"}
    return [str(path.relative_to(REPO)) for path in REPO.rglob("*")
            if (path.is_file() or path.is_symlink()) and path.relative_to(REPO).parts[0] not in skipped
            and "__pycache__" not in path.parts and ".egg-info" not in str(path)]


def test_a_wheel_installed_in_a_fresh_environment_reads_the_schema_and_runs_the_cli(tmp_path):
    # The files a clone has, copied, so that the build's own files (build/, egg-info) stay out of the checkout.
    source = tmp_path / "source"
    listed = clone_files()
    for name in listed:
        if (REPO / name).exists() or (REPO / name).is_symlink():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name, follow_symlinks=False)
    wheels = tmp_path / "wheels"
    # No build isolation: the build backend is already in the test environment.
    run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)], tmp_path)
    (wheel,) = wheels.glob("eaglenest-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert "eaglenest/config_schema.yaml" in names
        # The link is copied in as the file itself.
        assert archive.read("eaglenest/config_schema.yaml") == (REPO / "config" / "schema.yaml").read_bytes()
        assert not [name for name in names if name.startswith("tests/") or "/support/" in name]

    fresh = tmp_path / "fresh"
    run([sys.executable, "-m", "venv", str(fresh)], tmp_path)
    python = fresh / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp_path)
    # The dependencies come from the test environment (a path entry, not its site dir: its
    # editable install of this checkout is not loaded).
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).stdout.strip())
    (site / "eaglenest-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    workdir = tmp_path / "run"
    (workdir / "config").mkdir(parents=True)
    (workdir / "config" / "config.yaml").write_text((REPO / "config" / "config.yaml").read_text())
    probe = run([str(python), "-c", (
        "import eaglenest, eaglenest.settings as s; print(eaglenest.__file__); print(s.SCHEMA_PATH); "
        "print(s.defaults('train')['lr']); print(s.section({'concurrency': 4}, 'extract', 'sglang')['spool_dir'])"
    )], workdir).stdout.splitlines()
    assert probe[0].startswith(str(site)) and probe[1].startswith(str(site)), probe
    assert probe[2:] == ["0.0001", "/dev/shm/eaglenest_hs"]

    assert "recon" in run([str(fresh / "bin" / "eaglenest"), "--help"], workdir).stdout
    recon = run([str(fresh / "bin" / "eaglenest"), "recon", "--directory", str(workdir), "--json"], workdir)
    assert '"run"' in recon.stdout or "smollm2-default" in recon.stdout


def test_the_package_schema_is_the_link_to_config_schema_not_a_copy():
    # A copy would drift from the schema the workflow validates with (a `sed -i` turns a link into one).
    link = REPO / "eaglenest" / "config_schema.yaml"
    assert link.is_symlink() and link.resolve() == (REPO / "config" / "schema.yaml").resolve()


def test_no_product_module_names_a_path_under_tests():
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "eaglenest").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"""["'/]tests["'/]|\btests/support\b""", line) and not line.lstrip().startswith("#")
    ]
    assert not offenders, offenders
