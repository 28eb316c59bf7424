"""Sum the shard reports of the regeneration stage (rule regenerate_report)."""
import logging

from eaglenest.node import joblog
from eaglenest.stages import regenerate

joblog.to_file(snakemake.log[0])
summary = regenerate.summarize(list(snakemake.input), snakemake.output[0])
logging.info("regenerated %d of %d assistant turns, %d failed", summary["regenerated"], summary["turns"], summary["failed"])
