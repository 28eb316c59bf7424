"""Extract one shard's hidden states (rule extract_hidden_states).

Content-defining values come from params; speed knobs from the config.
"""
import torch

from eaglenest import extract, joblog

stream = joblog.to_file(snakemake.log[0])
settings = snakemake.config["extract"]
if settings["backend"] != "transformers":
    raise SystemExit(f"extract.backend={settings['backend']!r} is not available in this release (see README)")
torch.set_num_threads(snakemake.threads)
extract.extract_shard(
    snakemake.input.prepared,
    snakemake.output[0],
    target_path=snakemake.config["target"]["path"],
    target_name=snakemake.params.target_name,
    layer_ids=snakemake.params.layer_ids,
    dtype=snakemake.params.dtype,
    device=settings["device"],
    tokens_per_batch=settings["tokens_per_batch"],
    check_disk=settings["preflight"],
    disk_reserve_bytes=settings["disk_reserve_mb"] << 20,
    expected_shape=(snakemake.config["target"]["num_layers"], snakemake.config["target"]["hidden_size"]),
    log_stream=stream,
)
