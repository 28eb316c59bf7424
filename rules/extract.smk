# Per-shard hidden-state extraction: one job, one shard file.
# params hold exactly what defines a shard's content; knobs that only change speed
# (device, batch size, preflight) are read from the config by the script, so changing
# them never schedules re-extraction.


rule extract_hidden_states:
    input:
        prepared=run_path("prepared", "shard-{shard}.safetensors"),
        target=target_model_input(),
    output:
        run_path("hidden", "shard-{shard}.safetensors"),
    log:
        log_path("extract", "shard-{shard}.log"),
    benchmark:
        benchmark_path("extract", "shard-{shard}.tsv")
    params:
        target_name=config["target"]["name"],
        layer_ids=LAYER_IDS,
        dtype=config["extract"]["dtype"],
    threads: config["extract"]["threads"]
    resources:
        gpu=config["extract"]["gpus_per_job"],
    conda:
        "../envs/eaglenest.yaml"
    script:
        "../scripts/extract_shard.py"
