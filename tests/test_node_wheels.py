"""The pinned wheel lists for a GPU node without a package index (envs/*-wheels.txt) and how
envs/sglang_wheels_download.py cuts and packs them."""

from __future__ import annotations

import importlib.util
import io
import re
import tarfile
import zipfile

import pytest

from conftest import REPO

LISTS = ["sglang-0.5.14-wheels.txt", "workflow-node-wheels.txt"]


def download_module():
    spec = importlib.util.spec_from_file_location("sglang_wheels_download", REPO / "envs" / "sglang_wheels_download.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", LISTS)
def test_a_wheel_list_pins_one_cpython_312_x86_64_build_of_each_distribution(name):
    tool = download_module()
    wheels, cuts = tool.read_list(REPO / "envs" / name)
    dists = [tool.dist_name(w) for w in wheels]
    assert len(dists) == len(set(dists)), "two versions of one distribution stop the whole install"
    for wheel in wheels:
        python, abi, platform = wheel.removesuffix(".whl").split("-")[-3:]
        assert python in ("py3", "py2.py3", "cp312", "cp310", "cp39") and abi in ("none", "abi3", "cp312"), wheel
        assert platform == "any" or "x86_64" in platform, wheel
    assert set(cuts) <= set(dists), "a cut names a distribution the list does not hold"


def test_the_workflow_list_pins_what_pyproject_pins():
    """The node runs the workflow with these; they must be the versions the project is tested with."""
    tool = download_module()
    wheels, _ = tool.read_list(REPO / "envs" / "workflow-node-wheels.txt")
    listed = {tool.dist_name(w): w.split("-")[1] for w in wheels}
    pins = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', (REPO / "pyproject.toml").read_text()))
    for dist in ("snakemake", "gguf", "jsonschema"):
        assert listed[tool.dist_name(dist)] == pins[dist], dist


def test_a_cut_removes_the_members_and_their_record_lines_and_the_archive_holds_the_rest(tmp_path):
    tool = download_module()
    source = tmp_path / "demo-1.0-py3-none-any.whl"
    record = "demo/__init__.py,sha256=x,1\ndemo/solver/osx/cbc,sha256=y,5\ndemo-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(source, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr("demo/__init__.py", "x")
        wheel.writestr("demo/solver/osx/cbc", "12345")
        wheel.writestr("demo-1.0.dist-info/RECORD", record)
    data, removed = tool.stored_wheel(source, ["demo/solver/osx/"])
    assert removed == 5
    with zipfile.ZipFile(io.BytesIO(data)) as stored:
        assert sorted(stored.namelist()) == ["demo-1.0.dist-info/RECORD", "demo/__init__.py"]
        assert all(info.compress_type == zipfile.ZIP_STORED for info in stored.infolist())
        assert "osx" not in stored.read("demo-1.0.dist-info/RECORD").decode()
    archive = tool.pack([(source.name, data)])
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:xz") as tar:
        assert tar.getnames() == [source.name] and tar.extractfile(source.name).read() == data
    assert tool.pack([(source.name, data)]) == archive  # deterministic, byte for byte


def demo_wheel(path) -> None:
    """A minimal pure-Python wheel pip installs: one module and its dist-info."""
    files = {"eaglenest_demo_mod.py": "VALUE = 7\n",
             "eaglenest_demo-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: eaglenest-demo\nVersion: 1.0\n",
             "eaglenest_demo-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "eaglenest_demo-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in {**files, "eaglenest_demo-1.0.dist-info/RECORD": record}.items():
            wheel.writestr(name, text)


def test_two_installs_into_one_directory_take_turns_and_both_end_with_the_wheels_importable(tmp_path):
    """envs/sglang_wheels_install.sh run twice at once (two jobs on a node): the second waits
    for the first, finds its stamp and installs nothing again; both import-test fine."""
    import os
    import subprocess
    import sys

    tool = download_module()
    archives = tmp_path / "archives"
    archives.mkdir()
    wheel = tmp_path / "eaglenest_demo-1.0-py3-none-any.whl"
    demo_wheel(wheel)
    (archives / "demo-wheels-1.tar.xz").write_bytes(tool.pack([(wheel.name, wheel.read_bytes())]))
    target = tmp_path / "site"
    environment = {**os.environ, "IMPORT_TEST": "eaglenest_demo_mod", "PYTHON": sys.executable}
    runs = [subprocess.Popen(["bash", str(REPO / "envs" / "sglang_wheels_install.sh"), str(archives), str(target)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment) for _ in range(2)]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert sorted("installed already" in output for output in outputs) == [False, True], outputs
    assert all("import eaglenest_demo_mod: ok" in output for output in outputs)
    assert (target / "eaglenest_demo_mod.py").read_text() == "VALUE = 7\n"
