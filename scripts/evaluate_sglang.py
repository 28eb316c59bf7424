"""One eval set through one SGLang evaluation server (rule evaluate_sglang)."""
from eaglenest.stages import evaluate_server
from eaglenest.node import joblog

joblog.to_file(snakemake.log[0])
evaluate_server.evaluate_on_server(
    snakemake.config["target"]["path"],
    snakemake.wildcards.eval_set,
    snakemake.input.prompts,
    snakemake.wildcards.setting,
    dict(snakemake.params.drafting) if snakemake.params.drafting else None,
    snakemake.output.part,
    num_prompts=snakemake.params.num_prompts,
    max_new_tokens=snakemake.params.max_new_tokens,
    concurrency=list(snakemake.params.concurrency),
    target_name=snakemake.params.target_name,
    drafter=snakemake.params.drafter,
    service_file=snakemake.input.get("server"),
    url=snakemake.params.url,
    startup_timeout_s=snakemake.config["extract"]["sglang"]["startup_timeout_s"],
    timeout_s=snakemake.config["evaluate"]["sglang"]["timeout_s"],
    profile_steps=snakemake.params.profile_steps,
)
