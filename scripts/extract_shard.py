"""Extract one shard's hidden states (rule extract_hidden_states).

Content-defining values come from params; speed knobs from the config.
"""
import contextlib
import logging
import os

from eaglenest.node import gpu_slots, joblog

joblog.threads_at_least_one()  # before torch: a server's clients count no threads

import torch  # noqa: E402  (after the thread variables are fixed)

from eaglenest.stages import extract  # noqa: E402
from eaglenest.sglang import client as sglang_client, launch as sglang_launch  # noqa: E402

stream = joblog.to_file(snakemake.log[0])
# Which GPUs this job was handed (by Slurm or the local slot pool) belongs in its log.
logging.getLogger("eaglenest.stages.extract").info(
    "CUDA_VISIBLE_DEVICES=%s SLURM_JOB_ID=%s", os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("SLURM_JOB_ID")
)
settings = snakemake.config["extract"]
target = snakemake.config["target"]
if settings["backend"] == "sglang":
    # A client of the patched SGLang server (docs/sglang.md); same shard contract.
    server = settings["sglang"]
    url = server["url"]
    preflight_done = False
    if "server" in snakemake.input.keys():
        if settings["preflight"]:
            # Before waiting for the block server to load the target (minutes for Kimi).
            sglang_client.disk_preflight(
                snakemake.input.prepared,
                snakemake.output[0],
                snakemake.params.layer_ids,
                target["hidden_size"],
                target["num_layers"],
                snakemake.params.dtype,
                settings["disk_reserve_mb"] << 20,
            )
            preflight_done = True
        # Its block's server, started by Snakemake beside this job: wait until it is loaded.
        record = sglang_launch.wait_for_service(snakemake.input.server, server["startup_timeout_s"])
        url = record["url"]
        logging.getLogger("eaglenest.stages.extract").info("block server ready at %s (pid %s)", url, record["server_pid"])
    sglang_client.extract_shard_via_server(
        snakemake.input.prepared,
        snakemake.output[0],
        url=url,
        target_name=snakemake.params.target_name,
        layer_ids=snakemake.params.layer_ids,
        hidden_size=target["hidden_size"],
        num_layers=target["num_layers"],
        dtype=snakemake.params.dtype,
        spool_dir=server["spool_dir"],
        concurrency=server["concurrency"],
        samples_per_request=server["samples_per_request"],
        tokens_per_request=server["tokens_per_request"],
        tokens_in_flight=server["tokens_in_flight"],
        spool_timeout_s=server["spool_timeout_s"],
        request_timeout_s=server["request_timeout_s"],
        retries=server["retries"],
        backoff_s=server["backoff_s"],
        max_consecutive_failures=server["max_consecutive_failures"],
        check_disk=settings["preflight"] and not preflight_done,
        disk_reserve_bytes=settings["disk_reserve_mb"] << 20,
        log_stream=stream,
    )
else:
    torch.set_num_threads(snakemake.threads)
    # Snakemake counts GPUs but does not pick one: take free ones from the node's slot
    # pool (flock, released even on SIGKILL) before anything initializes CUDA.
    gpus = int(snakemake.resources.get("gpu", 0) or 0)
    slot = gpu_slots.gpu_slots(gpus) if gpus > 0 else contextlib.nullcontext()
    with slot:
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
