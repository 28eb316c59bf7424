"""Write the SGLang and vLLM exports of the trained drafter (rule export_drafter)."""
import logging

from eaglenest.stages import export
from eaglenest.node import joblog

joblog.to_file(snakemake.log[0])
report = export.export_drafter(
    snakemake.input.drafter,
    snakemake.config["target"]["path"],  # an input only when the workflow builds it
    snakemake.params.target_name,
    snakemake.output.sglang,
    snakemake.output.vllm,
    snakemake.output.report,
    dtype=snakemake.params.dtype,
    include_embed_tokens=snakemake.params.include_embed_tokens,
    verifier_name_or_path=snakemake.params.verifier_name_or_path,
    speculative_tokens=snakemake.params.speculative_tokens,
)
logging.info("export: %s", report)
