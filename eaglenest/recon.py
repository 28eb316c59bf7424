"""Post-crash reconnaissance: what survived, what is running, what is broken, what to run next.

``eaglenest recon`` reads; it never kills or deletes unless given ``--fix``, and then only
the safe subset (temp files of dead writers, Snakemake locks with no Snakemake alive).

Every check returns a plain, JSON-ready dict with a ``status`` (``ok``, ``warn``,
``block`` or ``not applicable``), a one-line ``summary``, its details, and the
``steps`` (ordered commands with the reason) it asks for. :func:`recon` runs them all
and adds the verdict: the blockers, the ordered steps and one next command.

Workflow state follows the workflow's own path conventions (rules/common.smk) and
predicts what ``snakemake -n`` plans; stages that other rule files will add are found
by their output directories under results/<run>/ and reported "not applicable" while
the workflow has no rule file for them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable

import yaml

from eaglenest import atomic, layout, plan, settings, shard_header  # shard_header: header checks without torch

OK, WARN, BLOCK, NA = "ok", "warn", "block", "not applicable"
REPO = Path(__file__).resolve().parents[1]
# A GPU holding more than this much memory counts as held by its process.
HELD_MEMORY_MIB = 1024
# Below this much headroom over the preflight's need, the disk check warns.
DISK_MARGIN = 0.10
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
NVIDIA_SMI_GPU_QUERY = "index,uuid,name,memory.used,memory.total,utilization.gpu"
NVIDIA_SMI_APPS_QUERY = "gpu_uuid,pid,process_name,used_memory"


class ReconError(Exception):
    """Bad input for recon (e.g. an invalid config); the CLI exits 2 with the message."""


# --------------------------------------------------------------------------- config


def _update_config(config: dict, overwrite: dict) -> None:
    """Snakemake's update_config: nested dicts merge, everything else is replaced."""
    for key, value in overwrite.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _update_config(config[key], value)
        else:
            config[key] = value


def _validate_with_defaults(config: dict, schema: dict) -> None:
    """Validate like the workflow's ``validate(config, schema=...)``: defaults filled in."""
    errors = settings.validate_with_defaults(config, schema)
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(top level)"
        raise ReconError(f"config invalid at {where}: {errors[0].message}")


def load_config(workdir: str | os.PathLike = ".", configfiles: Iterable[str] = (), repo: Path = REPO) -> dict:
    """The config exactly as the Snakefile sees it.

    ``configfile: "config/config.yaml"`` is read relative to the working directory,
    ``--configfile`` files update it (nested dicts merge), and rules/common.smk
    validates against the repository's config/schema.yaml with defaults filled in.
    """
    workdir = Path(workdir)
    config: dict = {}
    base = workdir / "config" / "config.yaml"
    configfiles = list(configfiles)
    if base.exists():
        _update_config(config, yaml.safe_load(base.read_text()) or {})
    elif not configfiles:
        raise ReconError(f"no config: {base} does not exist and no --configfile was given")
    for path in configfiles:
        path = Path(path)
        if not path.is_absolute() and not path.exists():
            path = workdir / path
        if not path.exists():
            raise ReconError(f"--configfile {path} does not exist")
        try:
            override = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ReconError(f"--configfile {path} is not valid YAML: {err}") from None
        if not isinstance(override, dict):
            raise ReconError(f"--configfile {path} must hold a mapping, not {type(override).__name__}")
        _update_config(config, override)
    _validate_with_defaults(config, yaml.safe_load((repo / "config" / "schema.yaml").read_text()))
    try:
        plan.layer_ids(config)
    except ValueError as err:
        raise ReconError(str(err)) from None
    return config


# --------------------------------------------------------------------------- processes


def _read_proc_text(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read().decode(errors="replace")
    except OSError:
        return None


def _boot_time() -> float:
    for line in (_read_proc_text("/proc/stat") or "").splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def list_processes(proc: str = "/proc") -> dict[int, dict]:
    """pid -> {cmdline, ppid, cwd, started} for every process this user may read."""
    ticks = os.sysconf("SC_CLK_TCK")
    boot = _boot_time()
    processes = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        pid = int(entry)
        raw = _read_proc_text(f"{proc}/{pid}/cmdline")
        stat = _read_proc_text(f"{proc}/{pid}/stat")
        if raw is None or stat is None:
            continue
        # Fields after the ")" that ends the command name: state ppid ... starttime (22nd).
        fields = stat.rsplit(")", 1)[-1].split()
        try:
            cwd = os.readlink(f"{proc}/{pid}/cwd")
        except OSError:
            cwd = None
        processes[pid] = {
            "pid": pid,
            "cmdline": [part for part in raw.split("\0") if part],
            "ppid": int(fields[1]) if len(fields) > 1 else 0,
            "cwd": cwd,
            "started": boot + int(fields[19]) / ticks if len(fields) > 19 else None,
        }
    return processes


def process_kind(cmdline: list[str] | str) -> str:
    """What a process is, from its command line (SGLang/vLLM workers rename themselves)."""
    text = (" ".join(cmdline) if isinstance(cmdline, list) else cmdline).lower()
    if "eaglenest" in text and ("sglang" in text or " serve" in text):
        return "eaglenest-sglang"
    if "sglang" in text:
        return "sglang"
    if "vllm" in text:
        return "vllm"
    if "eaglenest" in text and "train" in text or re.search(r"\.snakemake/scripts/\S*train", text):
        return "eaglenest-train"
    if "extract_shard" in text or "eaglenest" in text and "extract" in text:
        return "eaglenest-extract"
    if is_snakemake(cmdline if isinstance(cmdline, list) else shlex.split(cmdline)):
        return "snakemake"
    return "unknown"


KIND_LABELS = {
    "eaglenest-sglang": "patched SGLang (eaglenest)",
    "sglang": "plain SGLang",
    "vllm": "vLLM",
    "eaglenest-train": "eaglenest training",
    "eaglenest-extract": "eaglenest extraction",
    "snakemake": "Snakemake",
    "unknown": "unknown",
}
OURS = {"eaglenest-sglang", "eaglenest-train", "eaglenest-extract"}


def kind_with_parents(pid: int, processes: dict[int, dict]) -> str:
    """A process's kind; workers spawned by our SGLang launcher inherit its kind."""
    info = processes.get(pid)
    if info is None:
        return "unknown"
    kind = process_kind(info["cmdline"])
    seen, parent = {pid}, info["ppid"]
    while parent in processes and parent not in seen and kind in ("sglang", "unknown"):
        if process_kind(processes[parent]["cmdline"]) == "eaglenest-sglang":
            return "eaglenest-sglang"
        seen.add(parent)
        parent = processes[parent]["ppid"]
    return kind


def is_snakemake(cmdline: list[str]) -> bool:
    """The snakemake command itself, not the job scripts it runs from .snakemake/scripts."""
    names = [os.path.basename(part) for part in cmdline[:2]]
    if "snakemake" in names:
        return True
    return any(a == "-m" and b == "snakemake" for a, b in zip(cmdline, cmdline[1:]))


def snakemake_directory(info: dict) -> Path | None:
    """The working directory a snakemake process works on (--directory/-d, else its cwd)."""
    cmdline = info["cmdline"]
    for i, part in enumerate(cmdline):
        if part in ("--directory", "-d") and i + 1 < len(cmdline):
            value = Path(cmdline[i + 1])
            return value if value.is_absolute() or info["cwd"] is None else Path(info["cwd"]) / value
        if part.startswith("--directory="):
            value = Path(part.split("=", 1)[1])
            return value if value.is_absolute() or info["cwd"] is None else Path(info["cwd"]) / value
    return Path(info["cwd"]) if info["cwd"] else None


def _describe_process(pid: int, processes: dict[int, dict]) -> dict:
    info = processes.get(pid, {})
    started = info.get("started")
    kind = kind_with_parents(pid, processes) if info else "unknown"
    return {
        "pid": pid,
        "kind": kind,
        "kind_label": KIND_LABELS[kind],
        "cmdline": " ".join(info.get("cmdline", [])) or None,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else None,
    }


# --------------------------------------------------------------------------- GPUs


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]" (MIG, some drivers)


def parse_gpu_query(text: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-gpu=<NVIDIA_SMI_GPU_QUERY> --format=csv,noheader,nounits``."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 6:
            raise ValueError(f"unexpected nvidia-smi --query-gpu line: {line!r}")
        index, uuid, name, used, total, utilisation = fields
        gpus.append(
            {
                "index": int(index),
                "uuid": uuid,
                "name": name,
                "memory_used_mib": _number(used),
                "memory_total_mib": _number(total),
                "utilization_pct": _number(utilisation),
            }
        )
    return gpus


def parse_apps_query(text: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-compute-apps=<NVIDIA_SMI_APPS_QUERY> --format=csv,noheader,nounits``."""
    apps = []
    for line in text.splitlines():
        if not line.strip() or line.strip().lower().startswith("no running"):
            continue
        # The process name may itself hold commas; uuid, pid and memory do not.
        uuid, pid, rest = (part.strip() for part in line.split(",", 2))
        name, used = (part.strip() for part in rest.rsplit(",", 1))
        apps.append({"gpu_uuid": uuid, "pid": int(pid), "process_name": name, "used_memory_mib": _number(used)})
    return apps


def _run_nvidia_smi(args: list[str]) -> str:
    result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    if result.returncode != 0:
        raise RuntimeError((result.stderr or result.stdout).strip() or f"nvidia-smi exited {result.returncode}")
    return result.stdout


def gpu_report(gpus: list[dict], apps: list[dict], processes: dict[int, dict], gpus_needed: bool) -> dict:
    """Per GPU: memory, utilisation, holders; flags idle holders and foreign processes."""
    by_uuid = {gpu["uuid"]: dict(gpu, processes=[], idle_holder=False) for gpu in gpus}
    holders: dict[int, dict] = {}
    for app in apps:
        gpu = by_uuid.get(app["gpu_uuid"])
        if gpu is None:
            continue
        described = _describe_process(app["pid"], processes)
        if described["cmdline"] is None:
            described["cmdline"] = app["process_name"]
            described["kind"] = process_kind(app["process_name"])
            described["kind_label"] = KIND_LABELS[described["kind"]]
        gpu["processes"].append(dict(described, used_memory_mib=app["used_memory_mib"]))
        holder = holders.setdefault(app["pid"], dict(described, gpus=[], used_memory_mib=0.0))
        holder["gpus"].append(gpu["index"])
        holder["used_memory_mib"] += app["used_memory_mib"] or 0.0
    for gpu in by_uuid.values():
        used = gpu["memory_used_mib"] or 0
        gpu["idle_holder"] = used > HELD_MEMORY_MIB and gpu["utilization_pct"] == 0
    rows = sorted(by_uuid.values(), key=lambda g: g["index"])
    idle = [g["index"] for g in rows if g["idle_holder"]]
    foreign = [h for h in holders.values() if h["kind"] not in OURS and h["used_memory_mib"] > HELD_MEMORY_MIB]
    steps, status = [], OK
    for holder in foreign:
        what = f"{holder['kind_label']} on {len(holder['gpus'])} GPU(s), {holder['used_memory_mib'] / 1024:.1f} GiB"
        if gpus_needed:
            status = BLOCK
            steps.append({"command": f"kill {holder['pid']}", "why": f"stop pid {holder['pid']} ({what}): the GPUs are needed"})
        else:
            status = WARN if status == OK else status
    if idle and status == OK:
        status = WARN
    parts = [f"{len(rows)} GPU(s)"]
    if idle:
        parts.append(f"memory held at 0 % utilisation on GPU {','.join(map(str, idle))}")
    for holder in holders.values():
        parts.append(f"pid {holder['pid']} {holder['kind_label']} on GPU {','.join(map(str, holder['gpus']))}")
    if not holders:
        parts.append("no processes")
    return {
        "status": status,
        "summary": "; ".join(parts),
        "gpus": rows,
        "holders": list(holders.values()),
        "foreign_holders": [h["pid"] for h in foreign],
        "steps": steps,
    }


def check_gpus(processes: dict[int, dict], gpus_needed: bool, run: Callable[[list[str]], str] = _run_nvidia_smi) -> dict:
    if shutil.which("nvidia-smi") is None and run is _run_nvidia_smi:
        return {"status": NA, "summary": "no nvidia-smi on this machine: no GPU visible", "gpus": [], "steps": []}
    try:
        gpus = parse_gpu_query(run([f"--query-gpu={NVIDIA_SMI_GPU_QUERY}", "--format=csv,noheader,nounits"]))
        apps = parse_apps_query(run([f"--query-compute-apps={NVIDIA_SMI_APPS_QUERY}", "--format=csv,noheader,nounits"]))
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as err:
        return {"status": NA, "summary": f"nvidia-smi failed: {err}", "gpus": [], "steps": []}
    return gpu_report(gpus, apps, processes, gpus_needed)


# --------------------------------------------------------------------------- servers


def parse_proc_net_tcp(text: str) -> list[dict]:
    """Listening sockets of /proc/net/tcp or tcp6: address, port and socket inode."""
    listening = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != "0A":  # 0A = TCP_LISTEN
            continue
        address_hex, port_hex = fields[1].split(":")
        raw = bytes.fromhex(address_hex)
        if len(raw) == 4:
            address = socket.inet_ntop(socket.AF_INET, raw[::-1])
        else:
            # tcp6 stores four host-order 32-bit words.
            words = struct.unpack("<4I", raw)
            address = socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))
        listening.append({"address": address, "port": int(port_hex, 16), "inode": int(fields[9])})
    return listening


def socket_owners(inodes: set[int], proc: str = "/proc") -> dict[int, int]:
    """socket inode -> pid, for the processes whose fds this user may read."""
    owners = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"{proc}/{entry}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"{proc}/{entry}/fd/{fd}")
                    if target.startswith("socket:["):
                        inode = int(target[8:-1])
                        if inode in inodes:
                            owners[inode] = int(entry)
    return owners


def listening_ports(processes: dict[int, dict], proc: str = "/proc") -> list[dict]:
    sockets = []
    for name in ("tcp", "tcp6"):
        text = _read_proc_text(f"{proc}/net/{name}")
        if text:
            sockets.extend(parse_proc_net_tcp(text))
    owners = socket_owners({s["inode"] for s in sockets}, proc)
    for entry in sockets:
        pid = owners.get(entry["inode"])
        entry["process"] = _describe_process(pid, processes) if pid else None
    return sockets


def configured_server_url(config: dict) -> str | None:
    """The SGLang server URL the extract rule uses (extract.sglang.url)."""
    return (config["extract"].get("sglang") or {}).get("url")


def _get_json(url: str, timeout: float) -> tuple[int | None, object, dict]:
    """(HTTP status, parsed JSON body or None, headers); raises URLError when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status, body, headers = response.status, response.read(1 << 20), dict(response.headers)
    except urllib.error.HTTPError as err:
        status, body, headers = err.code, err.read(1 << 20), dict(err.headers or {})
    try:
        return status, json.loads(body), headers
    except (ValueError, UnicodeDecodeError):
        return status, None, headers


def _patch_module():
    """eaglenest.sglang_patch when this install has it (it names the marker route), else None."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("eaglenest.sglang_patch") is None:
        return None
    try:
        return importlib.import_module("eaglenest.sglang_patch")
    except Exception:  # reported by the code section; the probe falls back to plain checks
        return None


def probe_server(url: str, timeout: float = 3.0) -> dict:
    """Ask whatever listens at ``url`` who it is.

    Patched SGLang (ours): GET /eaglenest/info (eaglenest.sglang_patch.INFO_ROUTE) answers
    ``server: eaglenest-sglang-capture`` with target, layers and patch version. Plain
    SGLang: ``/get_model_info`` has ``model_path``. vLLM: ``/v1/models`` entries are
    ``owned_by: vllm``.
    """
    patch = _patch_module()
    info_route = getattr(patch, "INFO_ROUTE", "/eaglenest/info")
    server_kind = getattr(patch, "SERVER_KIND", "eaglenest-sglang-capture")
    base = url.rstrip("/")
    found: dict = {"url": url, "answers": False, "kind": "nothing", "model": None, "info": None, "detail": None}
    responses = {}
    for path in (info_route, "/get_model_info", "/v1/models", "/version"):
        try:
            responses[path] = _get_json(base + path, timeout)
        except (urllib.error.URLError, OSError) as err:
            if not responses:
                found["detail"] = f"nothing answers: {getattr(err, 'reason', err)}"
                return found
    found["answers"] = True
    info = responses.get(info_route, (None, None, {}))[1]
    model_info = responses.get("/get_model_info", (None, None, {}))[1]
    models = responses.get("/v1/models", (None, None, {}))[1]
    served = []
    if isinstance(models, dict) and isinstance(models.get("data"), list):
        served = [m for m in models["data"] if isinstance(m, dict)]
    if isinstance(info, dict) and info.get("server") == server_kind:
        found.update(kind="eaglenest-sglang", info=info, model=info.get("target"))
    elif isinstance(model_info, dict) and "model_path" in model_info:
        found.update(kind="sglang", model=model_info["model_path"])
    elif served:
        owners = {m.get("owned_by") for m in served}
        kind = "vllm" if "vllm" in owners else "sglang" if "sglang" in owners else "openai-compatible"
        found.update(kind=kind, model=served[0].get("root") or served[0].get("id"))
    else:
        status, _, headers = next(iter(responses.values()))
        found.update(kind="other", detail=f"HTTP {status}, server {headers.get('Server', '?')!r}")
    return found


def server_mismatch(info: dict, config: dict) -> list[str]:
    """How a patched server differs from this run (target, HF layer ids, hidden size, patch version)."""
    patch = _patch_module()
    expected = {
        "target": config["target"]["name"],
        "layer_ids": plan.layer_ids(config),
        "hidden_size": config["target"]["hidden_size"],
    }
    if patch is not None:
        expected["patch_version"] = patch.PATCH_VERSION
    return [f"{key} {info.get(key)!r} != {value!r}" for key, value in expected.items() if info.get(key) != value]


def check_servers(config: dict, processes: dict[int, dict], listeners: list[dict] | None = None,
                  server_url: str | None = None, timeout: float = 3.0) -> dict:
    listeners = listening_ports(processes) if listeners is None else listeners
    servers = [
        s for s in listeners
        if s["process"] and s["process"]["kind"] in ("eaglenest-sglang", "sglang", "vllm")
    ]
    listing = ", ".join(f"{s['process']['kind_label']} pid {s['process']['pid']} on :{s['port']}" for s in servers)
    url = server_url or configured_server_url(config)
    backend = config["extract"]["backend"]
    result = {"listening_servers": servers, "url": url, "backend": backend, "probe": None, "steps": []}
    if backend != "sglang" and server_url is None:
        result["status"] = NA
        result["summary"] = f"extract.backend={backend} needs no server" + (f"; found {listing}" if listing else "")
        return result
    if config["extract"].get("sglang", {}).get("start_server", True) and server_url is None:
        # Rule sglang_server starts one per block of shards on a free port; none runs between runs.
        result["status"] = NA
        result["summary"] = "the workflow starts a server per block of shards (extract.sglang.start_server)" + (
            f"; found {listing}" if listing else ""
        )
        return result
    if not url:
        result["status"] = BLOCK
        result["summary"] = "extract.backend=sglang but the config names no server URL"
        result["steps"].append({"command": None, "why": "set the SGLang server URL in the config"})
        return result
    probe = probe_server(url, timeout)
    result["probe"] = probe
    port = _url_port(url)
    holder = next((s["process"] for s in listeners if s["port"] == port and s["process"]), None)
    mismatch = server_mismatch(probe["info"], config) if probe["kind"] == "eaglenest-sglang" else []
    if probe["kind"] == "eaglenest-sglang" and not mismatch:
        result["status"] = OK
        result["summary"] = f"{url}: patched SGLang serving {probe['model']}"
    elif probe["kind"] == "nothing":
        result["status"] = BLOCK
        result["summary"] = f"{url}: nothing answers"
        result["steps"].append({"command": "python -m eaglenest.sglang_launch", "with_configfiles": True,
                                "why": f"start the patched SGLang server on {url}"})
    else:
        what = {"eaglenest-sglang": f"patched SGLang for another run ({'; '.join(mismatch)})"}.get(
            probe["kind"], KIND_LABELS.get(probe["kind"], probe["kind"])
        )
        result["status"] = BLOCK
        result["summary"] = f"{url}: something else answers: {what}" + (f" ({probe['detail']})" if probe["detail"] else "")
        if holder:
            result["steps"].append({"command": f"kill {holder['pid']}",
                                    "why": f"stop pid {holder['pid']} ({holder['kind_label']} on port {port}), then start the patched server"})
        else:
            result["steps"].append({"command": None, "why": f"stop what answers on {url} and start the patched server"})
    if listing:
        result["summary"] += f"; found {listing}"
    return result


def _url_port(url: str) -> int | None:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    return parsed.port or {"http": 80, "https": 443}.get(parsed.scheme)


# --------------------------------------------------------------------------- workflow


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


def _writer_alive(temp: Path) -> bool:
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
        from eaglenest.drafter import weights_problem  # imports torch, as the deep check may

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
    return _safetensors_intact(path / "model.safetensors")


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
        from eaglenest import shards  # imports torch: checksums and values need it

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
        row["writing"] = any(_writer_alive(p) for p in hidden_leftovers.get(name, []))
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
    source_paths = [workdir / s["path"] for s in config["data"]["sources"]]

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
    stale_temps += [str(p.relative_to(workdir)) for ps in prepared_leftovers.values() for p in ps if not _writer_alive(p)]
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


# --------------------------------------------------------------------------- snakemake leftovers


def check_snakemake(workdir: Path, processes: dict[int, dict]) -> dict:
    locks_dir = workdir / ".snakemake" / "locks"
    locks = sorted(str(p.relative_to(workdir)) for p in locks_dir.glob("*.lock")) if locks_dir.is_dir() else []
    markers = incomplete_markers(workdir)
    resolved = workdir.resolve()
    alive = []
    for pid, info in processes.items():
        if pid == os.getpid() or not is_snakemake(info["cmdline"]):
            continue
        directory = snakemake_directory(info)
        with contextlib.suppress(OSError):
            if directory is not None and directory.resolve() == resolved:
                alive.append(_describe_process(pid, processes))
    steps = []
    existing_marked = [m["path"] for m in markers if m["exists"]]
    if alive:
        status = BLOCK
        pids = ", ".join(str(p["pid"]) for p in alive)
        summary = f"snakemake alive on this directory (pid {pids}); {len(locks)} lock file(s)"
        steps.append({"command": None,
                      "why": f"snakemake pid {pids} is still running here: wait for it, or stop it with kill -INT {alive[0]['pid']}"})
    elif locks:
        status = BLOCK
        summary = f"{len(locks)} stale lock file(s), no snakemake process alive: --unlock is safe"
        steps.append({"command": "snakemake --unlock", "why": f"{len(locks)} stale lock(s), no snakemake process alive",
                      "safe_fix": locks})
    else:
        status = OK
        summary = "no locks"
    if markers:
        summary += f"; {len(markers)} incomplete marker(s)"
    if existing_marked:
        summary += f" ({len(existing_marked)} on existing files: --rerun-incomplete)"
        status = WARN if status == OK else status
    return {"status": status, "summary": summary, "locks": locks, "incomplete": markers,
            "rerun_incomplete": bool(existing_marked), "snakemake_alive": alive, "steps": steps}


# --------------------------------------------------------------------------- disk


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(config: dict, workdir: Path, workflow: dict) -> dict:
    """Free space where the hidden shards go vs what the extract preflight will ask for."""
    location = _existing_ancestor(hidden_location(config, workdir))
    free = shutil.disk_usage(location).free
    shards_left = len(workflow["to_build"]) + len(workflow["rebuild_after_rm"])
    needed = workflow["remaining_tokens"] * workflow["bytes_per_token"]
    reserve = config["extract"]["disk_reserve_mb"] << 20
    text = (f"{shards_left} shards left need {plan.human_bytes(needed)} + reserve {plan.human_bytes(reserve)}, "
            f"{plan.human_bytes(free)} free at {location}")
    result = {"location": str(location), "free_bytes": free, "needed_bytes": needed, "reserve_bytes": reserve,
              "shards_left": shards_left, "tokens_source": workflow["remaining_tokens_source"],
              "checkpoints": "not applicable (no training stage yet)"
              if not workflow["later_stages"]["checkpoints"]["rules"] else "not estimated", "steps": []}
    if needed + reserve > free:
        result["status"] = BLOCK
        result["summary"] = f"too small: {text}"
        result["steps"].append({"command": None, "why": f"free {plan.human_bytes(needed + reserve - free)} on "
                                f"{location} (the extract preflight will refuse)"})
    elif (needed + reserve) * (1 + DISK_MARGIN) > free:
        result["status"], result["summary"] = WARN, f"less than {DISK_MARGIN:.0%} margin: {text}"
    else:
        result["status"], result["summary"] = OK, text
    return result


# --------------------------------------------------------------------------- code and environment


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

    if importlib.util.find_spec("eaglenest.sglang_patch") is None:
        return {"state": NA, "detail": "eaglenest.sglang_patch is not part of this install"}
    try:
        module = importlib.import_module("eaglenest.sglang_patch")
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


def _safetensors_intact(path: Path) -> str | None:
    """None when the file's header is readable and its size matches; else what is wrong."""
    try:
        header_len, infos, _, size = shard_header.read_safetensors_header(path)
        shard_header.check_data_size(path, header_len, infos, size)
    except shard_header.ShardError as err:
        return err.reason
    except OSError as err:
        return f"unreadable ({err})"
    return None


def check_target_model(config: dict, workdir: Path) -> dict:
    """The target model directory: config, tokenizer, every weight file of the index, sizes."""
    path = Path(config["target"]["path"])
    path = path if path.is_absolute() else workdir / path
    result = {"path": str(path), "problems": [], "weight_files": 0, "weight_bytes": 0, "steps": []}
    if not path.is_dir():
        if config["target"].get("embedded"):
            result.update(status=OK, summary=f"target {path.name}: not converted yet (the workflow makes it)")
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
        damage = _safetensors_intact(weight)
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


# --------------------------------------------------------------------------- verdict


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
        "gpus": check_gpus(processes, gpus_needed, nvidia_smi or _run_nvidia_smi),
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
                if atomic.TMP_MARKER in path.name and _writer_alive(path):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    done.append(f"removed {rel}")
    return done


# --------------------------------------------------------------------------- output

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
