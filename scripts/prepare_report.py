"""Sum the prepared shards' headers into the stage's report (rule prepare_report)."""
import logging

from eaglenest.node import joblog
from eaglenest.stages import prepare

joblog.to_file(snakemake.log[0])
report = prepare.summarize(list(snakemake.input), snakemake.output[0])
logging.info("prepare: %d samples, %d tokens in %d shards", report["samples"], report["tokens"], report["num_shards"])
