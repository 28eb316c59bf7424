"""How `snakemake -n` of the workflow grows with the shard count, beside a plain Snakefile.

    python benchmarks/dag_scaling.py --shards 1000 10000 40000 --out benchmarks/results/dag_scaling.json

For each shard count N: the demo config with max_conversations = 10 N and samples_per_shard 10
(N shards), planned in an empty working directory with `snakemake -n -q rules`; then a plain
Snakefile with the same number of jobs and rules and the same shape (one producer and one
consumer per shard, the jobs that read every shard, the rest single jobs; see plain_snakefile),
planned the same way. The ratio of
the two wall times is what to read (goal: within 1.5x at 10,000 shards); absolute seconds depend
on the machine. `--earlier-release COMMIT` also plans that release's workflow (its single prepare
job had one output per shard, so its planning time grew with the square of N) at the counts up
to `--earlier-max-shards`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SAMPLES_PER_SHARD = 10


def plain_snakefile(shards: int, singles: int, extra_rules: int) -> str:
    """A Snakefile of the workflow's shape and size with nothing else in it: a producer and a
    consumer per shard (both `script:` rules, as the workflow's are), the consumers also targets
    of `all`, one job reading every producer's and consumer's file, one reading every producer's,
    and ``singles`` single jobs spread over ``extra_rules`` more rules (the same rule count)."""
    text = f"""
SHARDS = [f"{{i:05d}}" for i in range({shards})]
SINGLES = {list(range(singles))!r}
EXTRA = {extra_rules}


rule all:
    input:
        expand("consumed/shard-{{shard}}.txt", shard=SHARDS),
        "gathered.txt",
        "report.txt",
        [f"single{{n % EXTRA}}/{{n}}.txt" for n in SINGLES],


rule produce:
    output:
        "produced/shard-{{shard}}.txt",
    script:
        "touch.py"


rule consume:
    input:
        "produced/shard-{{shard}}.txt",
    output:
        "consumed/shard-{{shard}}.txt",
    script:
        "touch.py"


rule gather:
    input:
        expand("consumed/shard-{{shard}}.txt", shard=SHARDS),
        expand("produced/shard-{{shard}}.txt", shard=SHARDS),
    output:
        "gathered.txt",
    script:
        "touch.py"


rule report:
    input:
        expand("produced/shard-{{shard}}.txt", shard=SHARDS),
    output:
        "report.txt",
    script:
        "touch.py"
"""
    for k in range(extra_rules):
        text += f"""

rule single{k}:
    output:
        "single{k}/{{n}}.txt",
    script:
        "touch.py"
"""
    return text


def rule_count(configfile: Path, workdir: Path) -> int:
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
               "--configfile", str(configfile), "--list-rules"]
    listed = subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()
    return len([name for name in listed if re.fullmatch(r"\w+", name)])


def dry_run(snakefile: Path, workdir: Path, configfile: Path | None = None) -> tuple[float, int]:
    """Wall seconds of `snakemake -n -q rules` and the number of jobs it plans."""
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), "--directory", str(workdir),
               "-n", "-q", "rules", "--cores", "1"]
    if configfile is not None:
        command += ["--configfile", str(configfile)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    total = re.search(r"^total\s+(\d+)$", result.stdout + result.stderr, re.M)
    return seconds, int(total.group(1))


def shard_config(directory: Path, shards: int) -> Path:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["data"]["max_conversations"] = shards * SAMPLES_PER_SHARD
    config["data"]["samples_per_shard"] = SAMPLES_PER_SHARD
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def earlier_checkout(directory: Path, commit: str) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "Snakefile", "rules", "scripts", "config",
                              "envs", "report", "profiles"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive.stdout, check=True)
    return directory / "Snakefile"


def measure(shards: int, scratch: Path, earlier: Path | None) -> dict:
    case = scratch / f"n{shards}"
    (case / "eaglenest").mkdir(parents=True)
    configfile = shard_config(case, shards)
    ours, jobs = dry_run(REPO / "Snakefile", case / "eaglenest", configfile)
    plain_dir = case / "plain"
    plain_dir.mkdir()
    # Of the total: 2 per shard, gather, report and `all` itself.
    singles = jobs - (2 * shards + 3)
    extra_rules = max(1, rule_count(configfile, case / "eaglenest") - 5)
    (plain_dir / "Snakefile").write_text(plain_snakefile(shards, singles, extra_rules))
    (plain_dir / "touch.py").write_text("from pathlib import Path\nPath(snakemake.output[0]).touch()\n")
    plain, plain_jobs = dry_run(plain_dir / "Snakefile", plain_dir)
    row = {"shards": shards, "jobs": jobs, "plain_jobs": plain_jobs, "plain_rules": extra_rules + 5, "eaglenest_s": round(ours, 2),
           "plain_s": round(plain, 2), "ratio": round(ours / plain, 2)}
    if earlier is not None:
        (case / "earlier").mkdir()
        seconds, _ = dry_run(earlier, case / "earlier", configfile)
        row["earlier_release_s"] = round(seconds, 2)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[1000, 10000, 40000])
    parser.add_argument("--earlier-release", help="commit of an earlier release to plan beside (git archive)")
    parser.add_argument("--earlier-max-shards", type=int, default=10000,
                        help="plan the earlier release only up to this many shards (it grows quadratically)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dag-scaling-") as scratch:
        scratch = Path(scratch)
        earlier = None
        if args.earlier_release:
            (scratch / "release").mkdir()
            earlier = earlier_checkout(scratch / "release", args.earlier_release)
        print(f"{'shards':>7} {'jobs':>7} {'eaglenest s':>12} {'plain s':>8} {'ratio':>6} {'earlier release s':>18}")
        for shards in args.shards:
            row = measure(shards, scratch, earlier if shards <= args.earlier_max_shards else None)
            rows.append(row)
            earlier_s = row.get("earlier_release_s")
            print(f"{row['shards']:>7} {row['jobs']:>7} {row['eaglenest_s']:>12.2f} {row['plain_s']:>8.2f} "
                  f"{row['ratio']:>6.2f} {'-' if earlier_s is None else f'{earlier_s:.2f}':>18}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "python benchmarks/dag_scaling.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "samples_per_shard": SAMPLES_PER_SHARD,
            "earlier_release": args.earlier_release,
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
