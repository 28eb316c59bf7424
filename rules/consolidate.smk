# Verify every shard, index them, build the draft vocabulary and the train/val split.


rule consolidate:
    input:
        hidden=hidden_shards(),
        prepared=prepared_shards(),
        draft_vocab_from=draft_vocab_source(),
    output:
        index=report(
            run_path("consolidated", "index.json"),
            caption="../report/consolidate.rst",
            category="Hidden states",
        ),
        draft_vocab=run_path("consolidated", "draft_vocab.safetensors"),
        split=run_path("consolidated", "split.json"),
    log:
        log_path("consolidate.log"),
    benchmark:
        benchmark_path("consolidate.tsv")
    # the path to the drafter goes before evaluation's reference decoding (rules/train.smk)
    priority: 1
    conda:
        "../envs/eaglenest.yaml"
    threads: config["consolidate"]["threads"]
    params:
        target_name=config["target"]["name"],
        target_vocab_size=config["target"]["vocab_size"],
        layer_ids=LAYER_IDS,
        dtype=config["extract"]["dtype"],
        draft_vocab_size=config["consolidate"]["draft_vocab_size"],
        val_fraction=config["consolidate"]["val_fraction"],
        seed=config["consolidate"]["seed"],
    script:
        "../scripts/consolidate.py"


# The data half alone (assets, ingest, prepare, extract, consolidate), e.g. before the
# training node is free: `snakemake --cores all hidden_states`.
rule hidden_states:
    input:
        hidden_shards(),
        rules.consolidate.output,
