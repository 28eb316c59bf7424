"""Carry a run's inputs to a GPU node that reaches no model hub or package index, in parts.

    python envs/node_inputs.py pack --out .node-inputs [--part-mib 60] PATH [PATH ...]
    python envs/node_inputs.py unpack .node-inputs [--into .]

The wheels travel with envs/sglang_wheels_download.py; this packs the rest a run reads on the
node, relative to the checkout: the embedded target's GGUF (``resources/wheels/``), the eval
sets (``resources/eval/``), a drafter export to serve, ingested conversations
(``results/<run>/data/``, with config/h200/carried-data.yaml). ``pack`` writes one xz tar
stream cut into ``inputs.tar.xz.part-NNN`` files of at most ``--part-mib`` each and a
``manifest.json`` (the paths, each part's size and sha256). ``unpack`` checks every part
against the manifest before it reads one, unpacks into a temporary folder beside the
destination, then renames each packed path into place: a missing or damaged part is named
and nothing is written.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

PART_PREFIX = "inputs.tar.xz.part-"


class PartWriter(io.RawIOBase):
    """A write-only stream cut into files of at most ``part_bytes``, hashed as they are written."""

    def __init__(self, out: Path, part_bytes: int):
        self.out, self.part_bytes = out, part_bytes
        self.parts: list[dict] = []
        self._file = None

    def writable(self) -> bool:
        return True

    def _next_part(self) -> None:
        self._close_part()
        name = f"{PART_PREFIX}{len(self.parts):03d}"
        self._file = open(self.out / name, "wb")
        self._digest = hashlib.sha256()
        self.parts.append({"file": name, "bytes": 0})

    def _close_part(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1]["sha256"] = self._digest.hexdigest()
            self._file = None

    def write(self, data) -> int:
        view = memoryview(data)
        while view:
            if self._file is None or self.parts[-1]["bytes"] == self.part_bytes:
                self._next_part()
            take = min(len(view), self.part_bytes - self.parts[-1]["bytes"])
            self._file.write(view[:take])
            self._digest.update(view[:take])
            self.parts[-1]["bytes"] += take
            view = view[take:]
        return len(data)

    def close(self) -> None:
        self._close_part()
        super().close()


def pack(paths: list[str], out: Path, part_mib: float) -> dict:
    for path in paths:
        if Path(path).is_absolute() or ".." in Path(path).parts or not Path(path).exists():
            raise SystemExit(f"{path}: give an existing path relative to the checkout")
    out.mkdir(parents=True, exist_ok=True)
    # an earlier pack's manifest goes first: a pack that dies midway leaves parts without one
    (out / "manifest.json").unlink(missing_ok=True)
    for stale in out.glob(f"{PART_PREFIX}*"):
        stale.unlink()
    writer = PartWriter(out, max(1, int(part_mib * (1 << 20))))
    with lzma.open(writer, "wb", preset=6) as compressed, tarfile.open(fileobj=compressed, mode="w") as tar:
        for path in paths:
            tar.add(path)
    writer.close()
    manifest = {"paths": paths, "parts": writer.parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check_parts(folder: Path) -> dict:
    """The manifest, once every part it names is present with its size and sha256."""
    manifest_path = folder / "manifest.json"
    if not manifest_path.exists():
        raise SystemExit(f"{manifest_path}: missing (written by `node_inputs.py pack`)")
    manifest = json.loads(manifest_path.read_text())
    for part in manifest["parts"]:
        path = folder / part["file"]
        if not path.exists():
            raise SystemExit(f"{path}: missing ({len(manifest['parts'])} parts in all); nothing unpacked")
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        if path.stat().st_size != part["bytes"] or digest != part["sha256"]:
            raise SystemExit(f"{path}: {path.stat().st_size} bytes, sha256 {digest}; the manifest says "
                             f"{part['bytes']} bytes, {part['sha256']}; nothing unpacked")
    return manifest


class PartReader(io.RawIOBase):
    """The parts read back as one stream."""

    def __init__(self, files: list[Path]):
        self._files = iter(files)
        self._file = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self._file is None:
                path = next(self._files, None)
                if path is None:
                    return 0
                self._file = open(path, "rb")
            count = self._file.readinto(buffer)
            if count:
                return count
            self._file.close()
            self._file = None


def unpack(folder: Path, into: Path) -> list[str]:
    manifest = check_parts(folder)
    into.mkdir(parents=True, exist_ok=True)
    reader = io.BufferedReader(PartReader([folder / part["file"] for part in manifest["parts"]]))
    with tempfile.TemporaryDirectory(dir=into, prefix=".node-inputs-") as staging:
        with lzma.open(reader, "rb") as compressed, tarfile.open(fileobj=compressed, mode="r|") as tar:
            # the "data" filter refuses links out of the folder and absolute names (Python >= 3.11.4)
            tar.extractall(staging, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        for path in manifest["paths"]:
            target = into / path
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            Path(staging, path).replace(target)
    return manifest["paths"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pack_parser = commands.add_parser("pack", help="pack PATHs into parts and manifest.json")
    pack_parser.add_argument("--out", type=Path, required=True)
    pack_parser.add_argument("--part-mib", type=float, default=60.0, help="largest part (default %(default)s MiB)")
    pack_parser.add_argument("paths", nargs="+")
    unpack_parser = commands.add_parser("unpack", help="check the parts, then unpack them")
    unpack_parser.add_argument("folder", type=Path)
    unpack_parser.add_argument("--into", type=Path, default=Path("."))
    options = parser.parse_args(argv)
    if options.command == "pack":
        manifest = pack(options.paths, options.out, options.part_mib)
        total = sum(part["bytes"] for part in manifest["parts"]) / (1 << 20)
        print(f"{options.out}: {len(manifest['parts'])} parts, {total:.1f} MiB", file=sys.stderr)
    else:
        for path in unpack(options.folder, options.into):
            print(f"unpacked {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
