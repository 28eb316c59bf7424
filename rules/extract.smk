# Per-shard hidden-state extraction: one job, one shard file.
# What defines a shard's content: its samples (the prepared shard, whose directory is
# keyed by the settings that choose them, see eaglenest.plan.prepared_key), the target, the layers
# and the storage dtype (params). Knobs that only change speed (device, batch size,
# preflight) are read from the config by the script, so changing them never schedules
# re-extraction. The prepared shard is ancient(): a shard's prepare job rewrites it whenever
# it runs (a re-ingested source reruns them all), and identical rewrites must not cost GPU days; consolidate
# cross-checks every hidden shard against its prepared shard as a safety net.


rule extract_hidden_states:
    input:
        unpack(block_server),
        prepared=ancient(prepared_path("shard-{shard}.safetensors")),
        target=target_model_input(),
    output:
        run_path("hidden", "shard-{shard}.safetensors"),
    log:
        log_path("extract", "shard-{shard}.log"),
    benchmark:
        benchmark_path("extract", "shard-{shard}.tsv")
    # the path to the drafter goes before evaluation's reference decoding (rules/train.smk)
    priority: 1
    group:
        SGLANG_GROUP
    conda:
        "../envs/eaglenest.yaml"
    threads: extract_threads()
    resources:
        gpu=extract_gpus(),
    params:
        target_name=config["target"]["name"],
        layer_ids=LAYER_IDS,
        dtype=config["extract"]["dtype"],
    script:
        "../scripts/extract_shard.py"


# One patched SGLang server per block of extract.sglang.shards_per_server shards
# (docs/cluster.md). A service: Snakemake starts it together with the block's shard jobs
# (its consumers, in the same group) and terminates it when the last of them is done; on
# Slurm the group is one allocation of one node. A block whose shards all exist has no
# consumer left, so a rerun starts no server for it.
rule sglang_server:
    output:
        service(run_path("sglang", "block-{block}.json")),
    log:
        launcher=log_path("sglang", "block-{block}", "launcher.log"),
        server=log_path("sglang", "block-{block}", "server.log"),
    group:
        "sglang_node"
    conda:
        "../envs/sglang.yaml"
    threads: 1
    resources:
        gpu=config["target"]["tensor_parallel"],
    params:
        state_dir=server_state_dir,
        config_json=untracked_param(server_launch_config()),
        python=untracked_param(launcher_python()),
        repo=untracked_param(workflow.basedir),
        mode=untracked_param("capture"),
    shell:
        LAUNCHER_SHELL
