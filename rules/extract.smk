# Per-shard hidden-state extraction: one job, one shard file.
# params hold exactly what defines a shard's content (target, layers, dtype and the
# settings that decide which samples a shard holds); knobs that only change speed
# (device, batch size, preflight) are read from the config by the script, so changing
# them never schedules re-extraction. The prepared shard is ancient(): prepare rewrites
# all its shards whenever it runs, and identical rewrites must not cost GPU days;
# consolidate cross-checks every hidden shard against its prepared shard instead.


rule extract_hidden_states:
    input:
        prepared=ancient(run_path("prepared", "shard-{shard}.safetensors")),
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
        samples=sample_selection(),
    script:
        "../scripts/extract_shard.py"
