"""The drafter as SGLang serves it: one table and benchmarks/results/sglang_serve_<date>.json
from a run evaluated through SGLang servers (``evaluate.backend: sglang``), beside the replay
tau of the same prompts (the same config with ``evaluate.backend: transformers``,
``evaluate.method: replay`` and another ``run`` name).

    python benchmarks/sglang_serve.py --workdir . --run smollm2-serve --replay-run smollm2-serve-replay \
        --eval-set mt_bench --out benchmarks/results/sglang_serve_2026-12-04.json

Every figure comes from the run's own files, nothing is measured here:
- ``results/<run>/evaluate/<set>/<setting>/server.json``: tokens/s per concurrency (the plain
  server's too) and the server's identity (SGLang version);
- ``.../metrics.json``: SGLang's accept length (completion tokens / verify steps) and
  eaglenest's tau per concurrency;
- ``logs/<run>/sglang/evaluate/<setting>/launcher.log``: the flags the server was started with
  (CUDA graphs, attention backend); null for servers started by hand;
- ``results/<replay run>/evaluate/<set>/<setting>/metrics.json``: the replay tau.

``cycle`` (batch 1): a speculative cycle's cost in plain decoding steps, split by two chains of
different depth into draft steps and the rest (verify, scheduler, sampling), and the speedup
bound the rest puts on each setting (``cycle_costs``).

``chain_search`` (with ``--sweep-dir``, the same drafter replayed at more chain depths, e.g.
config/h200/own-answers-drafting-sweep.yaml): each chain's expected speedup from its replay tau
and the cycle that split gives it (rest + steps x draft step), so that the fastest chain is
found from two served chains instead of serving every depth.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import subprocess
from pathlib import Path

PLAIN = "plain"


def server_flags(launcher_log: Path) -> dict:
    """CUDA graphs and the attention backend from the launcher's last ``starting:`` command line."""
    if not launcher_log.exists():
        return {"cuda_graph": None, "attention_backend": None}
    commands = [line[len("starting: "):] for line in launcher_log.read_text().splitlines() if line.startswith("starting: ")]
    if not commands:
        return {"cuda_graph": None, "attention_backend": None}
    words = shlex.split(commands[-1])
    backend = words[words.index("--attention-backend") + 1] if "--attention-backend" in words else "sglang default"
    return {"cuda_graph": "--disable-cuda-graph" not in words, "attention_backend": backend}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def drafter_identity(path: str) -> dict:
    """The served export and the sha256 of its weights (model.safetensors)."""
    weights = Path(path) / "model.safetensors"
    return {"path": path, "sha256": file_sha256(weights) if weights.exists() else None}


def gpu_name() -> str | None:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return None
    return names[0].strip() or None


def collect(workdir: Path, run: str, eval_set: str, replay_run: str | None = None, gpu: str | None = None) -> dict:
    evaluated = workdir / "results" / run / "evaluate" / eval_set
    if not (evaluated / PLAIN / "server.json").exists():
        raise FileNotFoundError(f"{evaluated / PLAIN / 'server.json'}: no plain server part; was {run!r} evaluated "
                                "with evaluate.backend sglang?")
    settings = sorted(p.name for p in evaluated.iterdir() if (p / "server.json").exists() and p.name != PLAIN)
    parts = {name: json.loads((evaluated / name / "server.json").read_text()) for name in (PLAIN, *settings)}
    rows = []
    for name, part in parts.items():
        flags = server_flags(workdir / "logs" / run / "sglang" / "evaluate" / name / "launcher.log")
        metrics = {} if name == PLAIN else json.loads((evaluated / name / "metrics.json").read_text())
        by_concurrency = {c["concurrency"]: c for c in metrics.get("by_concurrency", [])}
        replay_tau = None
        if replay_run and name != PLAIN:
            replay = workdir / "results" / replay_run / "evaluate" / eval_set / name / "metrics.json"
            replay_tau = json.loads(replay.read_text())["tau"]
        for measured in part["runs"]:
            served = by_concurrency.get(measured["concurrency"], {})
            rows.append({
                "drafting": name, **flags, "concurrency": measured["concurrency"],
                "prompts": len(measured["per_prompt"]), "max_new_tokens": part["max_new_tokens"],
                "tokens_per_s": measured["tokens_per_second"],
                "accept_length": served.get("server_accept_length"), "tau": served.get("tau"),
                "replay_tau": replay_tau, "speedup": served.get("speedup"), "lossless": served.get("lossless"),
            })
    drafter = next((part["drafter"] for part in parts.values() if part.get("drafter")), None)
    return {
        "gpu": gpu or gpu_name(), "sglang": parts[PLAIN]["server"].get("sglang_version"),
        "drafter": drafter_identity(drafter) if drafter else None, "run": run, "replay_run": replay_run,
        "eval_set": eval_set, "serve": rows,
        # SGLang's own profile of each server's decoding steps at batch 1 (evaluate.sglang.profile_steps)
        "profile": {name: part["profile"] for name, part in parts.items() if part.get("profile")},
    }


def setting_shape(name: str) -> dict | None:
    """{steps, topk, tokens} of a setting's name (``steps3-topk1-tokens4``); None for plain."""
    found = re.fullmatch(r"steps(\d+)-topk(\d+)-tokens(\d+)", name)
    return dict(zip(("steps", "topk", "tokens"), map(int, found.groups()))) if found else None


def cycle_costs(rows: list[dict], concurrency: int = 1) -> dict | None:
    """What one speculative cycle costs against a plain decoding step, from the servers' own
    tokens/s and accept lengths at ``concurrency``; the bound those costs put on the speedup.

    A plain step costs 1 / (plain tokens/s per request); a cycle accept_length / (tokens/s per
    request), everything the server does per cycle included (draft steps, verify, scheduler,
    sampling, HTTP). Two chains (top-k 1) of different depth split a cycle into its draft steps
    and the rest: cycle(s) = rest + s x draft_step, on the assumption that verifying 4 or 8
    tokens of one request costs the same (a latency-bound forward pass). ``speedup_bound`` is
    the speedup of each setting's accept length were its drafting free (cycle = rest)."""
    at = [row for row in rows if row["concurrency"] == concurrency and row["tokens_per_s"]]
    plain = next((row for row in at if row["drafting"] == PLAIN), None)
    if plain is None:
        return None
    plain_step = concurrency / plain["tokens_per_s"]
    settings = {}
    for row in at:
        shape = setting_shape(row["drafting"])
        if shape is None or not row["accept_length"]:
            continue
        cycle = row["accept_length"] * concurrency / row["tokens_per_s"]
        settings[row["drafting"]] = {**shape, "accept_length": row["accept_length"], "cycle_ms": round(cycle * 1e3, 3),
                                     "cycle_in_plain_steps": round(cycle / plain_step, 3),
                                     "speedup": round(plain_step * row["accept_length"] / cycle, 3)}
    result = {"concurrency": concurrency, "plain_step_ms": round(plain_step * 1e3, 3), "settings": settings}
    chains = sorted((v["steps"], v["cycle_ms"]) for v in settings.values() if v["topk"] == 1)
    if len(chains) >= 2 and chains[-1][0] > chains[0][0]:
        (s1, c1), (s2, c2) = chains[0], chains[-1]
        draft_step = (c2 - c1) / (s2 - s1)
        rest = c1 - s1 * draft_step
        result["split"] = {"from_chains": [s1, s2], "draft_step_ms": round(draft_step, 3), "rest_of_cycle_ms": round(rest, 3),
                           "rest_in_plain_steps": round(rest / result["plain_step_ms"], 3)}
        if rest > 0:
            for value in settings.values():
                value["speedup_bound"] = round(result["plain_step_ms"] * value["accept_length"] / rest, 3)
    return result


def chain_search(cycle: dict | None, sweep_tau: dict[str, float]) -> list[dict]:
    """Every chain (top-k 1) setting of ``sweep_tau`` (setting name -> replay tau) with its
    expected cycle and speedup from ``cycle``'s split, fastest first; [] without a split."""
    split = (cycle or {}).get("split")
    if not split or split["rest_of_cycle_ms"] <= 0:
        return []
    rows = []
    for name, tau in sweep_tau.items():
        shape = setting_shape(name)
        if shape is None or shape["topk"] != 1:
            continue
        cycle_ms = split["rest_of_cycle_ms"] + shape["steps"] * split["draft_step_ms"]
        served = cycle["settings"].get(name)
        rows.append({"drafting": name, "steps": shape["steps"], "replay_tau": round(tau, 3),
                     "expected_cycle_ms": round(cycle_ms, 3),
                     "expected_speedup": round(cycle["plain_step_ms"] * tau / cycle_ms, 3),
                     "served_speedup": served["speedup"] if served else None})
    return sorted(rows, key=lambda row: -row["expected_speedup"])


def sweep_taus(sweep_dir: Path) -> dict[str, float]:
    """Setting name -> tau of every setting evaluated under ``sweep_dir`` (<run>/evaluate/<set>)."""
    return {p.parent.name: json.loads(p.read_text())["tau"] for p in sorted(sweep_dir.glob("steps*/metrics.json"))}


def format_table(result: dict) -> str:
    header = ("drafting", "cuda graph", "attention", "in flight", "prompts", "tokens/s", "speedup", "accept length",
              "tau", "replay tau")
    lines = ["\t".join(header)]

    def number(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"

    for row in result["serve"]:
        lines.append("\t".join([
            row["drafting"], str(row["cuda_graph"]), str(row["attention_backend"]), str(row["concurrency"]),
            str(row["prompts"]), number(row["tokens_per_s"], 1), number(row["speedup"]), number(row["accept_length"], 3),
            number(row["tau"], 3), number(row["replay_tau"], 3),
        ]))
    return "\n".join(lines)


def format_profile(profiles: dict) -> str:
    """Per server, milliseconds per step (a speculative cycle, or a plain decode step) by stage."""
    lines = ["server\tsteps\twall ms\tGPU busy ms\tCPU ms by span\tGPU ms by span"]
    for name, profile in profiles.items():
        if "error" in profile:
            lines.append(f"{name}\t{profile['error']}")
            continue
        cpu = ", ".join(f"{span} {ms:.3f}" for span, ms in profile["cpu_ms_per_step"].items() if ms)
        gpu = ", ".join(f"{span} {ms:.3f}" for span, ms in profile["gpu_ms_per_step"].items())
        lines.append(f"{name}\t{profile['steps']}\t{profile['wall_ms_per_step']:.3f}\t"
                     f"{profile['gpu_busy_ms_per_step']:.3f}\t{cpu}\t{gpu}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("."), help="the workflow's directory")
    parser.add_argument("--run", required=True, help="the run evaluated with evaluate.backend sglang")
    parser.add_argument("--replay-run", default=None, help="the same prompts replayed by the transformers evaluator")
    parser.add_argument("--eval-set", default="mt_bench")
    parser.add_argument("--gpu", default=None, help="the device name (default: nvidia-smi's)")
    parser.add_argument("--sweep-dir", type=Path, default=None,
                        help="results/<run>/evaluate/<set> of the same drafter replayed at more chain depths")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    options = parser.parse_args(argv)
    result = collect(options.workdir, options.run, options.eval_set, options.replay_run, options.gpu)
    result["cycle"] = cycle_costs(result["serve"])
    print(format_table(result))
    if result["cycle"]:
        print(json.dumps(result["cycle"], indent=1))
    if options.sweep_dir:
        result["chain_search"] = chain_search(result["cycle"], sweep_taus(options.sweep_dir))
        print("chain: expected speedup (replay tau / expected cycle), fastest first")
        for row in result["chain_search"]:
            print(f"  {row['drafting']}: {row['expected_speedup']}x (tau {row['replay_tau']}, "
                  f"{row['expected_cycle_ms']} ms; served {row['served_speedup']})")
    if result["profile"]:
        print(format_profile(result["profile"]))
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
