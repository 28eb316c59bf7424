"""Normalise conversation sources and count bad records (rule ingest)."""
import logging

from eaglenest.stages import ingest
from eaglenest.node import joblog

joblog.to_file(snakemake.log[0])
report = ingest.ingest(
    snakemake.params.sources,
    snakemake.output.conversations,
    snakemake.output.report,
    max_conversations=snakemake.params.max_conversations,
    leading_assistant=snakemake.params.leading_assistant,
)
logging.info("ingest: %s", report.to_json())
summary = report.console_summary()
if summary:
    joblog.to_console(f"{summary} (details: {snakemake.output.report})")
