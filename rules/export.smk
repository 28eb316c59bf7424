# Export the trained drafter for SGLang (LlamaForCausalLMEagle3) and vLLM (speculators format).


rule export_drafter:
    input:
        drafter=run_path("train", "drafter"),
        target=target_model_input(),
    output:
        sglang=directory(run_path("export", "sglang")),
        vllm=directory(run_path("export", "vllm")),
        report=report(
            run_path("export", "export_report.json"),
            caption="../report/export.rst",
            category="Export",
        ),
    log:
        log_path("export.log"),
    benchmark:
        benchmark_path("export.tsv")
    conda:
        "../envs/eaglenest.yaml"
    params:
        target_name=config["target"]["name"],
        dtype=config["export"]["dtype"],
        include_embed_tokens=config["export"]["include_embed_tokens"],
        verifier_name_or_path=config["export"]["verifier_name_or_path"],
        speculative_tokens=config["export"]["speculative_tokens"],
    script:
        "../scripts/export_drafter.py"
