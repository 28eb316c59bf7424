# Train the EAGLE-3 drafter on the consolidated hidden states (eaglenest.stages.train).
# params hold what decides the weights; speed and bookkeeping knobs (device, threads,
# checkpoint and log intervals) are read from the config by the script, so changing them
# plans nothing. Checkpoints live beside the output, not in it: a killed or failed job
# resumes from them instead of starting over. With train.gpus > 0 the job asks Snakemake
# for that many GPUs and runs one torchrun process per GPU (DDP).


rule train_drafter:
    input:
        index=run_path("consolidated", "index.json"),
        draft_vocab=run_path("consolidated", "draft_vocab.safetensors"),
        split=run_path("consolidated", "split.json"),
        target=target_model_input(),
        start=train_start_input(),
    output:
        drafter=directory(run_path("train", "drafter")),
        summary=report(
            run_path("train", "training_summary.json"),
            caption="../report/train.rst",
            category="Training",
        ),
    log:
        log_path("train.log"),
    benchmark:
        benchmark_path("train.tsv")
    # Training is the long pole: it starts before evaluation's reference decoding, which
    # needs only the target and could otherwise fill the cores first.
    priority: 1
    conda:
        "../envs/eaglenest.yaml"
    threads: config["train"]["threads"]
    resources:
        gpu=config["train"]["gpus"],
    params:
        target_name=config["target"]["name"],
        layer_ids=LAYER_IDS,
        dtype=config["extract"]["dtype"],
        # eaglenest.training.objective.OBJECTIVE: a new training convention retrains the drafter
        objective="ttt-rotary-t+j",
        # the settings that decide the weights (eaglenest.settings.train_content)
        hyper=settings.train_content(config["train"]),
        checkpoint_dir=run_path("train", "checkpoints"),
    script:
        "../scripts/train_drafter.py"
