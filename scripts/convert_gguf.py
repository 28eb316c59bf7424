"""Convert the embedded GGUF target into a safetensors transformers directory (rule convert_embedded_target)."""
import logging

from eaglenest.node import assets, joblog

joblog.to_file(snakemake.log[0])
assets.convert_gguf(snakemake.input.gguf, snakemake.output[0], log=logging.info)
