"""Verify shards, write the index, draft vocab and split (rule consolidate)."""
import logging

from eaglenest.stages import consolidate
from eaglenest.node import joblog

joblog.to_file(snakemake.log[0])
index = consolidate.consolidate(
    list(snakemake.input.hidden),
    list(snakemake.input.prepared),
    snakemake.output.index,
    snakemake.output.draft_vocab,
    snakemake.output.split,
    target_vocab_size=snakemake.params.target_vocab_size,
    draft_vocab_size=snakemake.params.draft_vocab_size,
    expect={
        "target": snakemake.params.target_name,
        "layer_ids": list(snakemake.params.layer_ids),
        "dtype": snakemake.params.dtype,
    },
    val_fraction=snakemake.params.val_fraction,
    seed=snakemake.params.seed,
    threads=snakemake.threads,
    # the file rules/common.smk found (draft_vocab_source), or none
    draft_vocab_from=next(iter(snakemake.input.draft_vocab_from), None),
)
logging.info("consolidated: %s", index["totals"])
