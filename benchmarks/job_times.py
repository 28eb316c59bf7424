"""Wall time and peak memory of every job of one or more runs, from Snakemake's benchmark files.

    python benchmarks/job_times.py OUT.json logs/<run>/benchmarks [logs/<run>/benchmarks ...]

Each ``benchmark:`` file (logs/<run>/benchmarks/<stage>[/...].tsv) holds one line of seconds,
max RSS and more; the JSON keeps seconds and MB per job, keyed by run and the job's path
below the run, and prints a table.
"""
import csv
import json
import sys
from pathlib import Path


def job_times(run_dir: Path) -> dict:
    times = {}
    for path in sorted(run_dir.rglob("*.tsv")):
        with path.open() as handle:
            row = next(csv.DictReader(handle, delimiter="\t"))
        times[str(path.relative_to(run_dir).with_suffix(""))] = {
            "s": float(row["s"]), "max_rss_mb": float(row["max_rss"]) if row["max_rss"] != "NA" else None}
    return times


def main(out: str, *run_dirs: str) -> None:
    # logs/<run>/benchmarks: keyed by <run>
    table = {(Path(d).parent if Path(d).name == "benchmarks" else Path(d)).name: job_times(Path(d)) for d in run_dirs}
    Path(out).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{'run':<22}{'job':<58}{'seconds':>9}{'max RSS MB':>12}")
    for run, jobs in table.items():
        for job, values in jobs.items():
            rss = "-" if values["max_rss_mb"] is None else f"{values['max_rss_mb']:.0f}"
            print(f"{run:<22}{job:<58}{values['s']:>9.1f}{rss:>12}")


if __name__ == "__main__":
    main(*sys.argv[1:])
