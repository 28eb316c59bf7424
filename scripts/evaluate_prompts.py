"""A user eval set's prompts and its report of rejected records (rule evaluate_prompts)."""
from eaglenest.stages import eval_sets
from eaglenest.node import joblog

joblog.to_file(snakemake.log[0])
entry = dict(snakemake.params.entry)
try:
    report = eval_sets.prepare_set(
        entry,
        snakemake.output.prompts,
        snakemake.output.report,
        conversations_path=snakemake.input.get("conversations"),
        split_path=snakemake.input.get("split"),
    )
except (eval_sets.EmptyEvalSet, FileNotFoundError) as refused:
    joblog.to_console(str(refused))
    raise
summary = report.console_summary(f"eval set {entry['name']}")
if summary:
    joblog.to_console(f"{summary} (details: {snakemake.output.report})")
