"""The target's greedy output for one chunk of an eval set's prompts, for replay
(rule evaluate_reference)."""
from eaglenest.stages import evaluate
from eaglenest.node import joblog

joblog.to_file(snakemake.log[0])
evaluate.decode_reference(
    snakemake.config["target"]["path"],  # an input only when the workflow builds it
    snakemake.wildcards.eval_set,
    snakemake.input.prompts,
    snakemake.output.part,
    num_prompts=snakemake.params.num_prompts,
    max_new_tokens=snakemake.params.max_new_tokens,
    lookahead=snakemake.params.lookahead,
    target_name=snakemake.params.target_name,
    device=snakemake.params.device,
    threads=snakemake.threads,
    dtype=snakemake.params.dtype,
    chunk=int(snakemake.wildcards.chunk),
    chunks=snakemake.params.chunks,
)
