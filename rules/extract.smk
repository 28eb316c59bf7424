# Per-shard hidden-state extraction: one job, one shard file.
# What defines a shard's content: its samples (the prepared shard, whose directory is
# keyed by the settings that choose them, see eaglenest.plan.prepared_key), the target, the layers
# and the storage dtype (params). Knobs that only change speed (device, batch size,
# preflight) are read from the config by the script, so changing them never schedules
# re-extraction. The prepared shard is ancient(): prepare rewrites all its shards
# whenever it runs, and identical rewrites must not cost GPU days; consolidate
# cross-checks every hidden shard against its prepared shard as a safety net.


rule extract_hidden_states:
    input:
        prepared=ancient(prepared_path("shard-{shard}.safetensors")),
        target=target_model_input(),
    output:
        run_path("hidden", "shard-{shard}.safetensors"),
    log:
        log_path("extract", "shard-{shard}.log"),
    benchmark:
        benchmark_path("extract", "shard-{shard}.tsv")
    conda:
        "../envs/eaglenest.yaml"
    threads: config["extract"]["threads"]
    resources:
        gpu=config["extract"]["gpus_per_job"],
    params:
        target_name=config["target"]["name"],
        layer_ids=LAYER_IDS,
        dtype=config["extract"]["dtype"],
    script:
        "../scripts/extract_shard.py"
