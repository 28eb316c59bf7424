"""Regenerate one shard's assistant turns with the target (rule regenerate).

The shard's answers are defined by the settings in the directory key; device, batch
sizes, URL and concurrency come from the config and only change speed.
"""
import logging

from eaglenest.node import gpu_slots, joblog

joblog.threads_at_least_one()  # before torch: a server's clients count no threads

from eaglenest.sglang import launch as sglang_launch  # noqa: E402
from eaglenest.stages import regenerate  # noqa: E402

joblog.to_file(snakemake.log[0])
settings = sglang_launch.served(regenerate.Settings.from_config(snakemake.config["regenerate"]), snakemake.input,
                                snakemake.config, "regeneration")
# Same slot pool as extraction: Snakemake counts GPUs but does not pick one.
with gpu_slots.job_slots(int(snakemake.resources.get("gpu", 0) or 0), settings.backend == "transformers"):
    report = regenerate.regenerate_shard(
        snakemake.input.conversations,
        snakemake.output.conversations,
        snakemake.output.report,
        shard_id=int(snakemake.wildcards.shard),
        num_shards=snakemake.params.num_shards,
        model_path=snakemake.config["target"]["path"],
        model_name=snakemake.params.target_name,
        settings=settings,
        max_len=snakemake.params.max_len,
        threads=snakemake.threads,
    )
logging.info(
    "regenerate shard %s: %d/%d turns regenerated, %d failed, %d beyond max_len, %d conversations dropped, %.1f s",
    snakemake.wildcards.shard, report["regenerated"], report["turns"], report["failed"],
    report["beyond_max_len"], len(report["dropped_conversations"]), report["seconds"],
)
