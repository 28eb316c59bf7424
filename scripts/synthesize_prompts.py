"""Prompts the target writes itself, for one synthesized data source (rule synthesize_prompts)."""
import contextlib
import dataclasses
import logging

from eaglenest.node import gpu_slots, joblog

joblog.threads_at_least_one()  # before torch: a server's clients count no threads

from eaglenest.sglang import launch as sglang_launch  # noqa: E402
from eaglenest.stages import regenerate, synthesize  # noqa: E402

joblog.to_file(snakemake.log[0])
transport = regenerate.Settings.from_config(snakemake.config["regenerate"])
if "server" in snakemake.input.keys():
    # The server rule synthesize_server started beside this job: wait until it is loaded.
    timeout_s = snakemake.config["extract"]["sglang"]["startup_timeout_s"]
    record = sglang_launch.wait_for_service(snakemake.input.server, timeout_s)
    transport = dataclasses.replace(transport, url=record["url"])
    logging.info("synthesis server ready at %s (pid %s)", record["url"], record["server_pid"])
gpus = int(snakemake.resources.get("gpu", 0) or 0)
slot = gpu_slots.gpu_slots(gpus) if gpus > 0 and transport.backend == "transformers" else contextlib.nullcontext()
with slot:
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
