"""Speculative decoding of one chunk of an eval set's prompts with one drafting configuration
(rule evaluate_drafting)."""
from eaglenest.stages import evaluate
from eaglenest.node import joblog

joblog.to_file(snakemake.log[0])
evaluate.evaluate_drafting(
    snakemake.config["target"]["path"],
    snakemake.input.drafter,
    snakemake.wildcards.eval_set,
    snakemake.input.prompts,
    dict(snakemake.params.drafting),
    snakemake.output.part,
    num_prompts=snakemake.params.num_prompts,
    max_new_tokens=snakemake.params.max_new_tokens,
    temperature=snakemake.params.temperature,
    seed=snakemake.params.seed,
    target_name=snakemake.params.target_name,
    device=snakemake.config["evaluate"]["device"],
    threads=snakemake.threads,
    dtype=snakemake.params.dtype,
    chunk=int(snakemake.wildcards.chunk),
    chunks=snakemake.params.chunks,
    method=snakemake.params.method,
    reference_path=snakemake.input.reference or None,
    replay_batch=snakemake.config["evaluate"]["replay_batch"],
)
