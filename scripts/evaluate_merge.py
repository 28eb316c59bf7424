"""One evaluation's metrics.json from its prompt chunks (rule evaluate_merge)."""
from eaglenest.stages import evaluate
from eaglenest.node import joblog

joblog.to_file(snakemake.log[0])
evaluate.merge_parts(list(snakemake.input.parts), snakemake.output.metrics)
