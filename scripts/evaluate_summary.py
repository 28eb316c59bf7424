"""Summary table, plots and headline of every evaluation job (rule evaluate_summary)."""
from eaglenest.stages import evaluate
from eaglenest.node import joblog

joblog.to_file(snakemake.log[0])
evaluate.summarize(
    list(snakemake.input.metrics),
    snakemake.input.drafter,
    snakemake.output.table,
    snakemake.output.summary,
    snakemake.output.acceptance,
    snakemake.output.tau,
    snakemake.output.training,
)
