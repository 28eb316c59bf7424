"""Extraction through the patched SGLang server beside SGLang's own prefill speed, on one GPU.

For one target shape, in one run on one machine:

1. ``ceiling``: a plain SGLang server (no plugin, no capture) with the patched server's
   flags, fed the same prepared shard in the same requests (``samples_per_request``,
   ``concurrency``), prefill only (``max_new_tokens`` 1, radix cache off): its tokens/s is
   the engine's own prefill speed;
2. ``disk``: the same number of rows written through the shard writer (fsynced), the other
   bound of a job that ends with its shard on disk;
3. ``patched``: the patched server started by ``eaglenest.sglang.launch``, the shard extracted
   by the workflow's own client (``extract_shard_via_server``) in each storage dtype;
4. ``transformers``: the transformers backend on the same shard and weights (the embedded
   default's path), and the comparison of its rows with SGLang's within bf16 noise (the noise
   measured on the same rows: transformers bf16 against float32).

The target's weights are random (``random-target``: a transformers model built from a config
and saved), so SGLang and transformers compute the same model without carrying gigabytes of
weights to the GPU node.

    python benchmarks/sglang_engine.py random-target --shape llama8b --config-dir SMOL --out /tmp/llama8b
    python benchmarks/sglang_engine.py extract --target-dir /tmp/llama8b --prepared SHARD --samples 256 \\
        --work /tmp/work --site /tmp/site --out benchmarks/results/sglang_engine_llama8b.json
    python benchmarks/sglang_engine.py table benchmarks/results/sglang_engine_*.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import pyspy_profiles  # noqa: E402  (beside this file)

# The shape of the second target: Llama-3.1-8B's dimensions (its config.json on the hub),
# with SmolLM2's rope settings (no long-context scaling), which change no cost of a 2,048-token prefill.
SHAPES = {
    "llama8b": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")
# Known to serve on the H200 image with the carried 0.5.14 install (docs/sglang.md).
SERVER_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def write_json(path, payload) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------- inputs


def cmd_random_target(options) -> int:
    """A transformers model of ``--shape`` (or of ``--config-dir`` itself) with random
    weights, saved in bfloat16 beside the tokenizer files of ``--config-dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(options.config_dir)
    for key, value in SHAPES.get(options.shape, {}).items():
        setattr(config, key, value)
    config.torch_dtype = "bfloat16"
    torch.manual_seed(options.seed)
    started = time.perf_counter()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = Path(options.out)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(options.config_dir) / name).exists():
            shutil.copy(Path(options.config_dir) / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    log(f"random {options.shape} target: {params / 1e9:.2f}B parameters in {out} ({time.perf_counter() - started:.0f} s)")
    (out / "eaglenest_params.json").write_text(json.dumps({"params": params, "shape": options.shape}))
    return 0


def subset_shard(prepared: Path, samples: int, out: Path) -> Path:
    """The first ``samples`` samples of a prepared shard (0 = all of it)."""
    from eaglenest.formats import shards

    reader = shards.ShardReader.open(prepared)
    if samples <= 0 or samples >= len(reader.token_counts):
        return prepared
    ids, mask, offsets = reader.tensor("input_ids"), reader.tensor("loss_mask"), reader.tensor("offsets").tolist()
    rows = [{"sample_id": reader.sample_ids[i], "input_ids": ids[offsets[i]:offsets[i + 1]].tolist(),
             "loss_mask": mask[offsets[i]:offsets[i + 1]].tolist()} for i in range(samples)]
    out.parent.mkdir(parents=True, exist_ok=True)
    shards.write_prepared_shard(out, reader.metadata.get("shard_id", 0), rows,
                                {k: v for k, v in reader.metadata.items() if k not in
                                 ("kind", "shard_id", "sample_ids", "token_counts", "loss_token_counts", "checksums",
                                  "format", "format_version")})
    return out


# ------------------------------------------------------------------------------- servers


class Server:
    """One server process group; stopped as a whole."""

    def __init__(self, name: str, command: list[str], env: dict, logs: Path):
        self.name, self.log_path = name, logs / f"server-{name}.log"
        logs.mkdir(parents=True, exist_ok=True)
        self.handle = open(self.log_path, "w")
        log(f"start {name}: {' '.join(command)}")
        self.process = subprocess.Popen(command, stdout=self.handle, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=REPO)
        self.started = time.perf_counter()

    def wait(self, url: str, timeout_s: float) -> float:
        while time.perf_counter() - self.started < timeout_s:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"server {self.name} exited ({self.process.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(url, timeout=3) as response:
                    if response.status == 200:
                        boot = time.perf_counter() - self.started
                        log(f"{self.name} ready after {boot:.0f} s")
                        return boot
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server {self.name} not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        self.handle.close()
        log(f"stopped {self.name}")


def measure_patched(options, result: dict, work: Path, env: dict, logs: Path, prepared: Path, warmup: Path,
                    layer_ids: list[int], hf: dict, dtype: str, first: bool, port: int) -> None:
    """Step 3 for one storage dtype: the patched server its run starts, the workflow's client
    on the shard (profiled for the first dtype), then the other client windows (first dtype)."""
    from eaglenest.sglang import client as sglang_client

    url = f"http://127.0.0.1:{port}"
    config_path = work / f"patched-config-{dtype}.json"
    config_path.write_text(json.dumps(launcher_config(options, url, dtype)))
    state = work / f"patched-state-{dtype}"
    patched = Server(f"patched-{dtype}", [sys.executable, "-m", "eaglenest.sglang.launch", "--config-json",
                                          config_path.read_text(), "--state-dir", str(state)], env, logs)
    client = dict(url=url, target_name=options.target_name, layer_ids=layer_ids, hidden_size=hf["hidden_size"],
                  num_layers=hf["num_hidden_layers"], spool_dir=options.spool_dir, concurrency=options.concurrency,
                  samples_per_request=options.samples_per_request, tokens_in_flight=options.tokens_in_flight,
                  check_disk=False, dtype=dtype)
    try:
        result.setdefault("patched_boot_s", {})[dtype] = round(patched.wait(url + "/eaglenest/info", 900), 1)
        sglang_client.extract_shard_via_server(warmup, work / f"warmup-hidden-{dtype}" / "shard-00000.safetensors", **client)
        path = work / f"sglang-{dtype}" / "shard-00000.safetensors"
        profiles = start_profiles(patched, options.profile_s, work / "profiles") if first else []
        started = time.perf_counter()
        stats = sglang_client.extract_shard_via_server(prepared, path, **client)
        stats["wall_s"] = round(time.perf_counter() - started, 3)
        result["patched"][dtype] = stats
        log(f"patched {dtype}: {stats}")
        if profiles:
            result["profile"] = pyspy_profiles.finish(profiles)
        if dtype != "bfloat16":
            path.unlink()
        if first:
            # The same server and shard with other client windows: SAMPLES_PER_REQUEST:TOKENS_IN_FLIGHT.
            result["patched_windows"] = []
            for window in options.windows:
                samples_per_request, tokens_in_flight = (int(x) for x in window.split(":"))
                path = work / "sglang-window" / "shard-00000.safetensors"
                started = time.perf_counter()
                stats = sglang_client.extract_shard_via_server(
                    prepared, path, **{**client, "samples_per_request": samples_per_request, "tokens_in_flight": tokens_in_flight})
                stats.update(wall_s=round(time.perf_counter() - started, 3), samples_per_request=samples_per_request,
                             tokens_in_flight=tokens_in_flight)
                result["patched_windows"].append(stats)
                log(f"patched window {window}: {stats}")
                path.unlink()
        capture_lines = [line for line in (state / "server.log").read_text(errors="replace").splitlines()
                         if "eaglenest capture" in line]
        result.setdefault("patched_capture_log", {})[dtype] = capture_lines[:4]
    finally:
        patched.stop()


def server_env(site: str | None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               SGLANG_DISABLE_REQUEST_LOGGING="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, str(REPO), env.get("PYTHONPATH")) if p)
    return env


def common_flags(options) -> list[str]:
    return [*SERVER_FLAGS, "--mem-fraction-static", str(options.mem_fraction)]


def plain_command(options, port: int) -> list[str]:
    """The patched server's command (eaglenest.sglang.launch) without the capture: no plugin,
    no --enable-return-hidden-states; the same prefill batching and CUDA graphs."""
    from eaglenest.sglang import launch

    config = launcher_config(options, f"http://127.0.0.1:{port}")
    capture = launch.capture_settings(config)
    command = launch.launch_command(config, capture, sys.executable, sglang_version=options.sglang_version)
    capture_flags = {"--enable-return-hidden-states", "--enable-return-aux-hidden-states"}
    return [arg for arg in command if arg not in capture_flags]


def launcher_config(options, url: str, dtype: str = "bfloat16") -> dict:
    """The run's config as the launcher reads it; ``dtype`` the run's extract.dtype (an fp8 run's
    server quantises the rows itself)."""
    hf = json.loads((Path(options.target_dir) / "config.json").read_text())
    return {
        "run": "sglang-engine",
        "target": {"name": options.target_name, "path": str(Path(options.target_dir).resolve()),
                   "num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"], "tensor_parallel": 1},
        "extract": {"layer_ids": "default", "backend": "sglang", "dtype": dtype, "sglang": {
            "url": url, "spool_dir": options.spool_dir, "startup_timeout_s": 900, "prefill_tokens": options.prefill_tokens,
            "samples_per_request": options.samples_per_request, "concurrency": options.concurrency,
            "tokens_in_flight": options.tokens_in_flight, "writer_threads": options.writer_threads, "extra_args": common_flags(options)}},
    }


# ------------------------------------------------------------------------------- profile


def server_processes(server: "Server") -> dict:
    """{role: pid} of a server's processes: SGLang names them by setproctitle
    (``sglang::scheduler...``, ``sglang::detokenizer``: ``managers/scheduler.py:4148`` and
    ``managers/detokenizer_manager.py:487`` in 0.5.14); the launching process holds the HTTP
    server and the tokenizer manager."""
    import psutil

    found = {"http": server.process.pid}
    try:
        for child in psutil.Process(server.process.pid).children(recursive=True):
            name = " ".join(child.cmdline()[:1]) or child.name()
            if "sglang::" in name:
                found[name.split("sglang::", 1)[1].split()[0]] = child.pid
            elif "sglang.launch_server" in " ".join(child.cmdline()):
                found["http"] = child.pid  # the launcher's child (eaglenest.sglang.launch)
    except psutil.Error:
        pass
    return found


def start_profiles(server: "Server", seconds: float, out_dir: Path) -> list:
    """py-spy on each of the server's processes and on this one (the client) for ``seconds``
    (``pyspy_profiles.record``); nothing when py-spy is not installed."""
    return pyspy_profiles.record({**server_processes(server), "client": os.getpid()}, seconds, out_dir)


# ------------------------------------------------------------------------------- measurements


def measure_ceiling(url: str, prepared: Path, options) -> dict:
    """Prefill-only throughput of a plain server on the shard's samples, sent as the
    extraction client sends them (same requests, same window of requests and tokens in
    flight), after one warm-up request."""
    from eaglenest.formats import shards
    from eaglenest.sglang.client import request_groups, windowed

    reader = shards.ShardReader.open(prepared)
    ids, offsets = reader.tensor("input_ids"), reader.tensor("offsets").tolist()
    groups = request_groups(list(reader.token_counts), options.samples_per_request, 131072)
    sampling = {"max_new_tokens": 1, "temperature": 0.0}

    def post(group):
        body = {"input_ids": [ids[offsets[i]:offsets[i + 1]].tolist() for i in group], "sampling_params": sampling}
        request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            answers = json.loads(response.read())
        return sum(a["meta_info"]["prompt_tokens"] for a in answers)

    post(groups[0])  # warm-up
    started = time.perf_counter()
    with ThreadPoolExecutor(options.concurrency) as pool:
        answers = windowed(pool, groups, list(reader.token_counts), options.concurrency, options.tokens_in_flight, post)
        prompt_tokens = sum(future.result() for future in answers)
    seconds = time.perf_counter() - started
    return {"samples": len(reader.token_counts), "tokens": reader.num_tokens, "prompt_tokens_counted": prompt_tokens,
            "requests": len(groups), "seconds": round(seconds, 3), "tokens_per_s": round(reader.num_tokens / seconds, 1)}


def measure_disk(prepared: Path, hidden_size: int, aux_layers: int, dtype: str, work: Path) -> dict:
    """The shard writer alone: the shard's rows (already in host memory) to a published,
    fsynced shard on the work disk, as the extraction client streams them (one answer per
    64 samples' worth of rows)."""
    import torch

    from eaglenest.formats import shards
    from eaglenest.stages import shard_driver

    reader = shards.ShardReader.open(prepared)
    total = reader.num_tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random rows of 8B shapes take minutes on CPU
    aux = torch.randn(total, aux_layers * hidden_size, dtype=torch.bfloat16, device=device)
    last = torch.randn(total, hidden_size, dtype=torch.bfloat16, device=device)
    meta = {"target": "disk-probe", "target_hidden_size": hidden_size, "layer_ids": list(range(aux_layers)), "dtype": dtype}
    stored = {name: t.cpu() for name, t in shard_driver.to_storage(aux, last, dtype, aux_layers).items()}
    del aux, last
    path = work / f"disk-probe-{dtype}.safetensors"
    offsets = reader.tensor("offsets").tolist()
    started = time.perf_counter()
    streamed = shard_driver._StreamedShard(path, reader, meta, None)
    for first in range(0, len(offsets) - 1, 64):
        a, b = offsets[first], offsets[min(first + 64, len(offsets) - 1)]
        streamed.put(a, {name: tensor[a:b] for name, tensor in stored.items()})
    streamed.close()
    seconds = time.perf_counter() - started
    size = path.stat().st_size
    path.unlink()
    return {"dtype": dtype, "tokens": total, "bytes": size, "seconds": round(seconds, 3),
            "gb_per_s": round(size / seconds / 1e9, 3), "tokens_per_s": round(total / seconds, 1)}


def compare_on_gpu(reference: Path, candidate: Path, prepared: Path, samples: int = 0) -> dict:
    """sglang_h200.shard_comparison, computed on the GPU where there is one (an 8B shard is
    tens of GB in float32)."""
    import torch

    import sglang_h200
    from eaglenest.formats import shards

    ref_reader, cand_reader = shards.ShardReader.open(reference), shards.ShardReader.open(candidate)
    prepared_reader = shards.ShardReader.open(prepared)
    samples = samples if 0 < samples < len(prepared_reader.sample_ids) else len(prepared_reader.sample_ids)
    rows_compared = int(prepared_reader.tensor("offsets")[samples])  # the first ``samples`` samples' rows
    result = {"samples": samples, "tokens": rows_compared,
              "same_samples": ref_reader.sample_ids == cand_reader.sample_ids == prepared_reader.sample_ids,
              "same_token_counts": ref_reader.token_counts == cand_reader.token_counts == prepared_reader.token_counts,
              "tensors": {}}
    for name in ("input_ids", "loss_mask"):
        result["tensors"][name] = {"equal": bool(torch.equal(ref_reader.tensor(name), cand_reader.tensor(name)))}
    ref, cand = ({name: t[:rows_compared] for name, t in shards.dequantize(r.tensors(["aux_hidden", "last_hidden"])).items()}
                 for r in (ref_reader, cand_reader))
    hidden = ref["last_hidden"].shape[1]
    pairs = {"last_hidden": (ref["last_hidden"], cand["last_hidden"])}
    for layer in range(ref["aux_hidden"].shape[1] // hidden):
        columns = slice(layer * hidden, (layer + 1) * hidden)
        pairs[f"aux_hidden[{layer}]"] = (ref["aux_hidden"][:, columns], cand["aux_hidden"][:, columns])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, (a, b) in pairs.items():
        rows = []
        for start in range(0, a.shape[0], 131072):  # bounded GPU memory
            rows.append((a[start:start + 131072].to(device), b[start:start + 131072].to(device)))
        stats = [sglang_h200.compare_tensors(x, y) for x, y in rows]
        worst = min(range(len(stats)), key=lambda i: stats[i]["min_row_cosine"])
        result["tensors"][name] = {
            "min_row_cosine": stats[worst]["min_row_cosine"],
            "worst_row": stats[worst]["worst_row"] + worst * 131072,
            "rows_below_cosine": sum(s["rows_below_cosine"] for s in stats),
            "mean_relative_diff": float(sum(s["mean_relative_diff"] * x.shape[0] for s, (x, _) in zip(stats, rows)) / a.shape[0]),
        }
    return result


def noise_on_gpu(target_dir: str, prepared: Path, tokens_per_batch: int, samples: int) -> dict:
    """transformers bf16 against float32 on the shard's first ``samples`` samples (0: all;
    sglang_h200's noise step)."""
    import types

    import sglang_h200

    out = prepared.parent / "noise.json"
    options = types.SimpleNamespace(target_dir=target_dir, prepared=str(prepared), rows="", samples=samples or 10**9, device="cuda",
                                    threads=4, tokens_per_batch=tokens_per_batch, out=str(out))
    sglang_h200.cmd_noise(options)
    return json.loads(out.read_text())


def cmd_extract(options) -> int:
    if options.site:  # jsonschema for the config's defaults; the node's own torch and transformers stay first
        sys.path.append(options.site)
    import torch

    import sglang_h200
    from eaglenest.stages import extract
    from eaglenest.target_model import layer_ids as layer_id_convention

    work = Path(options.work)
    work.mkdir(parents=True, exist_ok=True)
    hf = json.loads((Path(options.target_dir) / "config.json").read_text())
    params = json.loads((Path(options.target_dir) / "eaglenest_params.json").read_text())["params"] \
        if (Path(options.target_dir) / "eaglenest_params.json").exists() else None
    layer_ids = layer_id_convention.resolve("default", hf["num_hidden_layers"])
    prepared = subset_shard(Path(options.prepared), options.samples, work / "prepared" / "shard-00000.safetensors")
    warmup = subset_shard(Path(options.prepared), 8, work / "warmup" / "shard-00000.safetensors")
    result = {"gpu": torch.cuda.get_device_name(0), "sglang": options.sglang_version, "shape": options.shape,
              "target_params_b": round(params / 1e9, 2) if params else None, "layer_ids": layer_ids,
              "hidden_size": hf["hidden_size"], "settings": {k: getattr(options, k) for k in (
                  "samples_per_request", "concurrency", "tokens_in_flight", "prefill_tokens", "writer_threads",
                  "mem_fraction")},
              "dtypes": options.dtypes, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    logs, env = work / "logs", server_env(options.site)

    def save():
        write_json(options.out, result)

    # 1. the engine alone
    plain = Server("plain", plain_command(options, 30020), env, logs)
    try:
        result["plain_boot_s"] = round(plain.wait("http://127.0.0.1:30020/health", 900), 1)
        result["ceiling"] = measure_ceiling("http://127.0.0.1:30020", prepared, options)
        log(f"ceiling: {result['ceiling']}")
    finally:
        plain.stop()
    save()
    # 2. the disk
    result["disk"] = {dtype: measure_disk(prepared, hf["hidden_size"], len(layer_ids), dtype, work) for dtype in options.dtypes}
    log(f"disk: {result['disk']}")
    save()
    # 3. the patched server and the workflow's client: one server per storage dtype, started
    # as that run's launcher starts it (an fp8 run's server quantises the rows on the GPU)
    result["patched"] = {}
    for index, dtype in enumerate(options.dtypes):
        measure_patched(options, result, work, env, logs, prepared, warmup, layer_ids, hf, dtype, first=index == 0,
                        port=30021 + index)
        save()
    # 4. the transformers backend on the same weights, and the comparison in bf16
    result["transformers"] = {}
    for dtype in options.dtypes:
        path = work / f"transformers-{dtype}" / "shard-00000.safetensors"
        stats = extract.extract_shard(prepared, path, options.target_dir, options.target_name, layer_ids, dtype=dtype,
                                      device="cuda", tokens_per_batch=options.tokens_per_batch, check_disk=False)
        result["transformers"][dtype] = stats
        log(f"transformers {dtype}: {stats}")
        save()
        if dtype != "bfloat16":
            path.unlink()
    if "bfloat16" in options.dtypes:
        sglang_shard = work / "sglang-bfloat16" / "shard-00000.safetensors"
        transformers_shard = work / "transformers-bfloat16" / "shard-00000.safetensors"
        result["verify_sglang"] = sglang_h200.consolidate_check(
            str(sglang_shard), str(prepared), options.target_name, layer_ids, "bfloat16", hf["vocab_size"], work / "consolidate")
        result["comparison"] = compare_on_gpu(transformers_shard, sglang_shard, prepared, options.noise_samples)
        save()
        sglang_shard.unlink()
        transformers_shard.unlink()
        result["noise"] = noise_on_gpu(options.target_dir, prepared, options.tokens_per_batch, options.noise_samples)
        result["noise_check"] = sglang_h200.noise_check(result["comparison"], result["noise"])
        log(f"within bf16 noise: {result['noise_check']['within_bf16_noise']}")
    result["summary"] = summary(result)
    save()
    print(json.dumps(result["summary"], indent=1))
    return 0


def summary(result: dict) -> dict:
    """The issue's row for this target: patched against the tighter of prefill and disk."""
    rows = {}
    prefill = result["ceiling"]["tokens_per_s"]
    for dtype, stats in result.get("patched", {}).items():
        disk = result["disk"][dtype]["tokens_per_s"]
        ceiling = min(prefill, disk)
        patched = stats["tokens_per_s_written"]
        rows[dtype] = {
            "ceiling_prefill_tokens_per_s": prefill, "ceiling_disk_tokens_per_s": disk, "ceiling_tokens_per_s": ceiling,
            "patched_tokens_per_s": patched, "patched_requests_tokens_per_s": stats["tokens_per_s"],
            "ratio": round(patched / ceiling, 3),
            "transformers_tokens_per_s": result.get("transformers", {}).get(dtype, {}).get("tokens_per_s"),
        }
    first = result.get("dtypes", ["bfloat16"])[0]
    windows = [{"samples_per_request": w["samples_per_request"], "tokens_in_flight": w["tokens_in_flight"],
                "patched_tokens_per_s": w["tokens_per_s_written"],
                "ratio": round(w["tokens_per_s_written"] / min(prefill, result["disk"][first]["tokens_per_s"]), 3)}
               for w in result.get("patched_windows", [])]
    return {"shape": result["shape"], "target_params_b": result["target_params_b"], "samples": result["ceiling"]["samples"],
            "tokens": result["ceiling"]["tokens"], "dtypes": rows, "windows": windows,
            "within_bf16_noise": result.get("noise_check", {}).get("within_bf16_noise")}


def cmd_table(options) -> int:
    print("| shape | params | samples | tokens | dtype | prefill ceiling | disk ceiling | patched | ratio | transformers |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for path in options.results:
        s = json.loads(Path(path).read_text())["summary"]
        for dtype, row in s["dtypes"].items():
            print(f"| {s['shape']} | {s['target_params_b']}B | {s['samples']:,} | {s['tokens']:,} | {dtype} | "
                  f"{row['ceiling_prefill_tokens_per_s']:,.0f} | {row['ceiling_disk_tokens_per_s']:,.0f} | "
                  f"{row['patched_tokens_per_s']:,.0f} | {row['ratio']:.2f} | {row['transformers_tokens_per_s'] or 0:,.0f} |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    random_target = sub.add_parser("random-target")
    random_target.add_argument("--config-dir", required=True, help="a model directory: config.json and tokenizer files")
    random_target.add_argument("--shape", default="smollm2", help=f"smollm2 (the config as it is) or one of {sorted(SHAPES)}")
    random_target.add_argument("--seed", type=int, default=0)
    random_target.add_argument("--out", required=True)
    ext = sub.add_parser("extract")
    ext.add_argument("--target-dir", required=True)
    ext.add_argument("--target-name", default="random-target")
    ext.add_argument("--shape", default="smollm2")
    ext.add_argument("--prepared", required=True)
    ext.add_argument("--samples", type=int, default=0, help="the shard's first N samples (0: all)")
    ext.add_argument("--dtypes", nargs="+", default=["bfloat16", "float8_e4m3"])
    ext.add_argument("--work", required=True)
    ext.add_argument("--site", default=None, help="where the SGLang wheels are installed (PYTHONPATH of the servers)")
    ext.add_argument("--sglang-version", default="0.5.14")
    ext.add_argument("--spool-dir", default="/dev/shm/eaglenest_engine")
    ext.add_argument("--samples-per-request", type=int, default=2)
    ext.add_argument("--tokens-in-flight", type=int, default=32768)
    ext.add_argument("--windows", nargs="*", default=[],
                     help="more client windows to measure on the same server, SAMPLES_PER_REQUEST:TOKENS_IN_FLIGHT each")
    ext.add_argument("--profile-s", type=float, default=8.0, help="py-spy duration on the server's processes")
    ext.add_argument("--concurrency", type=int, default=16)
    ext.add_argument("--prefill-tokens", type=int, default=8192)
    ext.add_argument("--writer-threads", type=int, default=4)
    ext.add_argument("--mem-fraction", type=float, default=0.5)
    ext.add_argument("--tokens-per-batch", type=int, default=65536, help="transformers backend")
    ext.add_argument("--noise-samples", type=int, default=0,
                     help="compare SGLang with transformers, and measure bf16 noise, on the first N samples (0: all)")
    ext.add_argument("--out", required=True)
    table = sub.add_parser("table")
    table.add_argument("results", nargs="+")
    options = parser.parse_args(argv)
    return {"random-target": cmd_random_target, "extract": cmd_extract, "table": cmd_table}[options.command](options)


if __name__ == "__main__":
    raise SystemExit(main())
