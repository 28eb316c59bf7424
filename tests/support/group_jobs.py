"""The group jobs Snakemake plans for a run, with the resources it would request for each.

A dry run prints the jobs of each group but not the group's resources, which Snakemake
computes itself (a service and its consumers run at once, so their resources are added
up, runtime excepted). This builds the DAG through Snakemake's API as ``snakemake -n``
does, with the resources of a profile when one is given, and prints every group job as
JSON. Run it in a subprocess (Snakemake's API changes directory and keeps global state):

    python tests/support/group_jobs.py SNAKEFILE WORKDIR CONFIGFILE [PROFILE_DIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def planned_group_jobs(snakefile: Path, workdir: Path, configfile: Path, profile: Path | None = None) -> list[dict]:
    """[{group, jobs: [{rule, wildcards, resources}], resources}] for every group job of the plan."""
    command = [sys.executable, __file__, str(snakefile), str(workdir), str(configfile)]
    if profile is not None:
        command.append(str(profile))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"planning group jobs failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def _profile_resources(profile: Path | None) -> dict:
    """--set-resources and --default-resources as Snakemake's command line parses them."""
    if profile is None:
        return {}
    from snakemake.cli import parse_args

    _, args = parse_args(["--workflow-profile", str(profile)])
    return {"overwrite_resources": args.set_resources, "default_resources": args.default_resources}


def main(snakefile: str, workdir: str, configfile: str, profile: str | None = None) -> None:
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, Quietness, ResourceSettings

    resources = _profile_resources(Path(profile).resolve() if profile else None)
    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        workflow_api = api.workflow(
            resource_settings=ResourceSettings(cores=1, **resources),  # cores: what `snakemake -n` plans with
            config_settings=ConfigSettings(configfiles=[Path(configfile).resolve()]),
            snakefile=Path(snakefile).resolve(),
            workdir=Path(workdir).resolve(),
        )
        workflow_api.dag(DAGSettings()).execute_workflow(executor="dryrun")
        dag = workflow_api._workflow.dag  # the planned DAG; the API has no public accessor for it

        def plain(resources) -> dict:
            return {name: value for name, value in resources.items() if not name.startswith("_")}

        groups = []
        for item in dag.get_jobs_or_groups():
            if not item.is_group():
                continue
            groups.append({
                "group": item.groupid,
                "jobs": [
                    {"rule": job.rule.name, "wildcards": dict(job.wildcards.items()), "threads": job.threads,
                     "resources": plain(job.resources)}
                    for job in sorted(item.jobs, key=lambda job: (job.rule.name, str(job.wildcards)))
                ],
                "threads": item.resources["_cores"],
                "resources": plain(item.resources),
            })
    print(json.dumps(groups, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:])
