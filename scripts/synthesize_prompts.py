"""Prompts the target writes itself, for one synthesized data source (rule synthesize_prompts)."""
import logging

from eaglenest.node import gpu_slots, joblog

joblog.threads_at_least_one()  # before torch: a server's clients count no threads

from eaglenest.sglang import launch as sglang_launch  # noqa: E402
from eaglenest.stages import regenerate, synthesize  # noqa: E402

joblog.to_file(snakemake.log[0])
transport = sglang_launch.served(regenerate.Settings.from_config(snakemake.config["regenerate"]), snakemake.input,
                                 snakemake.config, "synthesis")
with gpu_slots.job_slots(int(snakemake.resources.get("gpu", 0) or 0), transport.backend == "transformers"):
    report = synthesize.synthesize_prompts(
        snakemake.output.prompts,
        snakemake.output.report,
        source_name=snakemake.wildcards.source,
        settings=synthesize.Settings.from_config(snakemake.params.source["synthesize"]),
        transport=transport,
        model_path=snakemake.config["target"]["path"],
        model_name=snakemake.params.target_name,
        threads=snakemake.threads,
        concurrency=snakemake.params.in_flight,
    )
logging.info(
    "synthesize %s: %d of %d prompts kept (%d unfinished, %d looped, %d empty, %d duplicates, %d failed), %.1f s",
    snakemake.wildcards.source, report["kept"], report["requested"], report["unfinished"], report["looped"],
    report["empty"], report["duplicates"], report["failed"], report["seconds"],
)
