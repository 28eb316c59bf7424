"""Tokenize, mask and shard the conversations (rule prepare)."""
import logging

from eaglenest import joblog, prepare

joblog.to_file(snakemake.log[0])
report = prepare.prepare(
    list(snakemake.input.conversations),
    snakemake.config["target"]["path"],
    list(snakemake.output.shards),
    snakemake.output.report,
    max_len=snakemake.params.max_len,
    target_name=snakemake.params.target_name,
)
logging.info("prepare: %d samples, %d tokens in %d shards", report["samples"], report["tokens"], report["num_shards"])
