"""Inference servers: what listens, whether it is the patched SGLang the config names."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import urllib.error
import urllib.request

from eaglenest import plan
from eaglenest.model.draft_tree import Drafting
from eaglenest.node.recon.processes import describe_process, KIND_LABELS, read_proc_text
from eaglenest.node.recon.status import BLOCK, NA, OK, WARN


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
        text = read_proc_text(f"{proc}/net/{name}")
        if text:
            sockets.extend(parse_proc_net_tcp(text))
    owners = socket_owners({s["inode"] for s in sockets}, proc)
    for entry in sockets:
        pid = owners.get(entry["inode"])
        entry["process"] = describe_process(pid, processes) if pid else None
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
    """eaglenest.sglang.patch when this install has it (it names the marker route), else None."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("eaglenest.sglang.patch") is None:
        return None
    try:
        return importlib.import_module("eaglenest.sglang.patch")
    except Exception:  # reported by the code section; the probe falls back to plain checks
        return None


def probe_server(url: str, timeout: float = 3.0) -> dict:
    """Ask whatever listens at ``url`` who it is.

    Patched SGLang (ours): GET /eaglenest/info (eaglenest.sglang.patch.INFO_ROUTE) answers
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


# Which answers each stage can use. Extraction needs the patched server (the capture route);
# regeneration talks OpenAI chat completions, which any of these serve; evaluation reads
# SGLang's speculative meta_info from /generate, which the patched server also answers.
ACCEPTED_KINDS = {
    "extract": ("eaglenest-sglang",),
    "regenerate": ("eaglenest-sglang", "sglang", "vllm", "openai-compatible"),
    "evaluate": ("eaglenest-sglang", "sglang"),
}
RANK = {NA: 0, OK: 1, WARN: 2, BLOCK: 3}


def server_uses(config: dict, server_url: str | None = None) -> list[dict]:
    """Every stage of this config that talks to an inference server: {stage, started (the
    workflow starts its servers itself), urls (name -> URL of servers started by hand)}."""
    uses = []
    extract = config["extract"]
    if extract["backend"] == "sglang" or server_url is not None:
        started = extract.get("sglang", {}).get("start_server", True) and server_url is None
        uses.append({"stage": "extract", "started": started,
                     "what": "a server per block of shards (extract.sglang.start_server)",
                     "urls": {"extract": server_url or configured_server_url(config)}})
    regenerate = config.get("regenerate", {})
    if regenerate.get("enabled") and regenerate.get("backend") == "openai":
        uses.append({"stage": "regenerate", "started": regenerate.get("start_server", True),
                     "what": "one server for the regenerate jobs (regenerate.start_server)",
                     "urls": {"regenerate": regenerate.get("url")}})
    evaluate = config.get("evaluate", {})
    if evaluate.get("enabled") and evaluate.get("backend") == "sglang":
        sglang = evaluate.get("sglang", {})
        names = ["plain", *(Drafting.from_dict(d).name for d in evaluate.get("drafting", []))]
        uses.append({"stage": "evaluate", "started": sglang.get("start_server", True),
                     "what": "a server per drafting setting and a plain one (evaluate.sglang.start_server)",
                     "urls": {name: (sglang.get("urls") or {}).get(name) for name in names}})
    return uses


def _check_one(stage: str, name: str, url: str | None, config: dict, listeners: list[dict], timeout: float) -> dict:
    """One hand-started server: what answers at its URL and whether the stage can use it."""
    label = stage if name == stage else f"{stage} {name}"
    result = {"stage": stage, "name": name, "url": url, "probe": None, "steps": []}
    if not url:
        result.update(status=BLOCK, summary=f"{label}: the config names no server URL")
        key = "evaluate.sglang.urls." + name if stage == "evaluate" else f"{stage}.{'sglang.' if stage == 'extract' else ''}url"
        result["steps"].append({"command": None, "why": f"set {key} in the config, or let the workflow start the server"})
        return result
    probe = probe_server(url, timeout)
    result["probe"] = probe
    port = _url_port(url)
    holder = next((s["process"] for s in listeners if s["port"] == port and s["process"]), None)
    mismatch = server_mismatch(probe["info"], config) if probe["kind"] == "eaglenest-sglang" else []
    if stage != "extract":
        mismatch = []  # only extraction depends on the capture's layers and patch version
    if probe["kind"] in ACCEPTED_KINDS[stage] and not mismatch:
        served = "patched SGLang" if probe["kind"] == "eaglenest-sglang" else KIND_LABELS.get(probe["kind"], probe["kind"])
        result.update(status=OK, summary=f"{label} {url}: {served} serving {probe['model']}")
    elif probe["kind"] == "nothing":
        result.update(status=BLOCK, summary=f"{label} {url}: nothing answers")
        command = "python -m eaglenest.sglang.launch" + ("" if stage == "extract" else " --mode serve")
        result["steps"].append({"command": command, "with_configfiles": True, "why": f"start the {label} server on {url}"})
    else:
        what = {"eaglenest-sglang": f"patched SGLang for another run ({'; '.join(mismatch)})"}.get(
            probe["kind"], KIND_LABELS.get(probe["kind"], probe["kind"])
        )
        result.update(status=BLOCK, summary=f"{label} {url}: something else answers: {what}"
                      + (f" ({probe['detail']})" if probe["detail"] else ""))
        wanted = "the patched server" if stage == "extract" else "the server it needs"
        if holder:
            result["steps"].append({"command": f"kill {holder['pid']}",
                                    "why": f"stop pid {holder['pid']} ({holder['kind_label']} on port {port}), then start {wanted}"})
        else:
            result["steps"].append({"command": None, "why": f"stop what answers on {url} and start {wanted}"})
    return result


def check_servers(config: dict, processes: dict[int, dict], listeners: list[dict] | None = None,
                  server_url: str | None = None, timeout: float = 3.0) -> dict:
    """The servers of every stage that uses one (extraction, regeneration with the openai
    backend, evaluation with the sglang backend). Servers the workflow starts itself are n/a
    between runs; a server started by hand must answer at its URL and be one the stage can use."""
    listeners = listening_ports(processes) if listeners is None else listeners
    servers = [
        s for s in listeners
        if s["process"] and s["process"]["kind"] in ("eaglenest-sglang", "sglang", "vllm")
    ]
    listing = ", ".join(f"{s['process']['kind_label']} pid {s['process']['pid']} on :{s['port']}" for s in servers)
    uses = server_uses(config, server_url)
    extract_url = next((use["urls"]["extract"] for use in uses if use["stage"] == "extract"), None)
    result = {"listening_servers": servers, "url": extract_url, "backend": config["extract"]["backend"],
              "probe": None, "checked": [], "steps": []}
    parts = []
    for use in uses:
        if use["started"]:
            parts.append((NA, f"the workflow starts {use['what']}"))
            continue
        for name, url in use["urls"].items():
            one = _check_one(use["stage"], name, url, config, listeners, timeout)
            result["checked"].append(one)
            result["steps"].extend(one["steps"])
            if use["stage"] == "extract":
                result["probe"] = one["probe"]
            parts.append((one["status"], one["summary"]))
    if not parts:
        result["status"] = NA
        result["summary"] = f"extract.backend={result['backend']} needs no server; no stage uses one"
    else:
        result["status"] = max((status for status, _ in parts), key=RANK.__getitem__)
        # The worst first: the line the report shows is cut at its width.
        ordered = sorted(parts, key=lambda part: -RANK[part[0]])
        result["summary"] = "; ".join(summary for _, summary in ordered)
    if listing:
        result["summary"] += f"; found {listing}"
    return result


def _url_port(url: str) -> int | None:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    return parsed.port or {"http": 80, "https": 443}.get(parsed.scheme)
