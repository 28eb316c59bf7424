# eaglenest: train an EAGLE-3 drafter for a target LLM.
# Stages: data (assets, ingest, regenerate, prepare) -> extract -> consolidate -> train
# -> export -> evaluate; paths of every output: eaglenest/layout.py.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/extract.smk"
include: "rules/consolidate.smk"
include: "rules/train.smk"
include: "rules/export.smk"
include: "rules/evaluate.smk"


rule all:
    default_target: True
    input:
        all_targets(),
