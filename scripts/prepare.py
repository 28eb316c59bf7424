"""Tokenize, mask and write one shard (rule prepare).

The shard count comes from the config, not params: it is part of the prepared directory's
key, and params that a run prepared before per-shard prepare did not record would plan
every prepare job again.
"""
import logging

from eaglenest import plan
from eaglenest.node import joblog
from eaglenest.stages import prepare

joblog.to_file(snakemake.log[0])
stats = prepare.prepare_shard(
    list(snakemake.input.conversations),
    snakemake.config["target"]["path"],
    snakemake.output[0],
    shard_id=int(snakemake.wildcards.shard),
    num_shards=plan.num_shards(snakemake.config),
    max_len=snakemake.params.max_len,
    target_name=snakemake.params.target_name,
    originals_paths=list(snakemake.input.originals),
    # from the config, not params, as the shard count (see above)
    original_share=snakemake.config["regenerate"]["original_share"],
    share_seed=snakemake.config["regenerate"]["seed"],
)
logging.info("prepare: %s", stats)
