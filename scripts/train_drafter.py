"""Train the drafter (rule train_drafter); several processes run under torchrun (DDP).

Content-defining values come from params; speed and bookkeeping knobs from the config.
"""
from eaglenest.node import joblog
from eaglenest.stages import train
from eaglenest.settings import TRAIN_CONTENT_KEYS, TRAIN_CONTENT_KEYS_IF_SET, TRAIN_PLACEMENT_KEYS

stream = joblog.to_file(snakemake.log[0])
settings = snakemake.config["train"]
speed_knobs = [key for key in settings
               if key not in (*TRAIN_CONTENT_KEYS, *TRAIN_CONTENT_KEYS_IF_SET, *TRAIN_PLACEMENT_KEYS)]
gpus = settings["gpus"]
train.launch(
    {
        "index_path": snakemake.input.index,
        "draft_vocab_path": snakemake.input.draft_vocab,
        "split_path": snakemake.input.split,
        "target_path": snakemake.config["target"]["path"],
        "out_dir": snakemake.output.drafter,
        "checkpoint_dir": snakemake.params.checkpoint_dir,
        "summary_path": snakemake.output.summary,
        "target_name": snakemake.params.target_name,
        "expect": {
            "target": snakemake.params.target_name,
            "layer_ids": list(snakemake.params.layer_ids),
            "dtype": snakemake.params.dtype,
        },
        "settings": {
            **snakemake.params.hyper,
            **{key: settings[key] for key in speed_knobs},
            "device": "cuda" if gpus else settings["device"],
            "threads": snakemake.threads,
        },
        "log_stream": stream,
    },
    processes=gpus or settings["cpu_processes"],
)
