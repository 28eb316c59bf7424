"""envs/node_inputs.py: a run's inputs packed into parts for an offline node, and checked before unpacking."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


def node_inputs():
    spec = importlib.util.spec_from_file_location("node_inputs", REPO / "envs" / "node_inputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A checkout with a random 'GGUF' (incompressible, so it spans parts) and a data folder."""
    root = tmp_path / "checkout"
    (root / "resources" / "wheels").mkdir(parents=True)
    (root / "resources" / "wheels" / "model.gguf").write_bytes(os.urandom(300_000))
    (root / "results" / "run" / "data").mkdir(parents=True)
    (root / "results" / "run" / "data" / "conversations.jsonl").write_text('{"id": 1}\n' * 1000)
    monkeypatch.chdir(root)
    return root


def test_packed_parts_unpack_to_the_same_bytes(checkout, tmp_path):
    tool = node_inputs()
    manifest = tool.pack(["resources/wheels/model.gguf", "results/run/data"], tmp_path / "parts", part_mib=0.1)
    assert len(manifest["parts"]) >= 3 and all(p["bytes"] <= 0.1 * (1 << 20) for p in manifest["parts"])
    node = tmp_path / "node"
    (node / "results" / "run" / "data").mkdir(parents=True)
    (node / "results" / "run" / "data" / "stale.jsonl").write_text("old")
    assert tool.unpack(tmp_path / "parts", node) == ["resources/wheels/model.gguf", "results/run/data"]
    for path in ["resources/wheels/model.gguf", "results/run/data/conversations.jsonl"]:
        assert (node / path).read_bytes() == (checkout / path).read_bytes()
    assert not (node / "results" / "run" / "data" / "stale.jsonl").exists(), "a packed folder replaces the old one"
    assert [p.name for p in node.iterdir() if p.name.startswith(".node-inputs-")] == []


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_damaged_part_is_named_and_nothing_is_unpacked(checkout, tmp_path, damage):
    tool = node_inputs()
    manifest = tool.pack(["resources/wheels/model.gguf"], tmp_path / "parts", part_mib=0.1)
    part = tmp_path / "parts" / manifest["parts"][-1]["file"]
    if damage == "missing":
        part.unlink()
    else:
        data = bytearray(part.read_bytes())
        data[0] ^= 0xFF
        part.write_bytes(bytes(data))
    node = tmp_path / "node"
    with pytest.raises(SystemExit, match=part.name):
        tool.unpack(tmp_path / "parts", node)
    assert not node.exists() or list(node.iterdir()) == []


def test_paths_outside_the_checkout_are_refused(checkout, tmp_path):
    with pytest.raises(SystemExit, match="relative to the checkout"):
        node_inputs().pack(["../elsewhere"], tmp_path / "parts", part_mib=1)


def test_the_command_line_round_trip(checkout, tmp_path):
    script = REPO / "envs" / "node_inputs.py"
    subprocess.run([sys.executable, str(script), "pack", "--out", str(tmp_path / "parts"), "--part-mib", "0.2",
                    "resources/wheels/model.gguf"], check=True, capture_output=True)
    manifest = json.loads((tmp_path / "parts" / "manifest.json").read_text())
    assert manifest["paths"] == ["resources/wheels/model.gguf"]
    subprocess.run([sys.executable, str(script), "unpack", str(tmp_path / "parts"), "--into", str(tmp_path / "node")],
                   check=True, capture_output=True)
    assert (tmp_path / "node" / "resources/wheels/model.gguf").read_bytes() == (checkout / "resources/wheels/model.gguf").read_bytes()
