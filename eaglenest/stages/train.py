"""The train stage: train an EAGLE-3 drafter on consolidated hidden shards, with training-time
test (TTT). What rule train_drafter runs (scripts/train_drafter.py: :func:`launch`) and, under
torchrun, each process (``python -m eaglenest.stages.train <arguments.json>``: :func:`main`).

This module sets a run up: its settings, data, drafter (fresh, or warm-started from another
run's weights), optimizer and schedule, and the checkpoint to resume from; the pieces are in
eaglenest.training (the step and the loop: eaglenest.training.loop). Runs as one process (CPU
or one GPU) or under torchrun with DDP. A killed run resumes from its newest checkpoint and
ends with the same weights (bitwise on CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path

import torch
from torch import nn

from eaglenest import settings as settings_lib
from eaglenest.formats import atomic, shards, vocab
from eaglenest.model import drafter as drafter_lib
from eaglenest.stages.ingest import ORIGINAL_SUFFIX
from eaglenest.training import batches, checkpoints, loop
from eaglenest.training.batches import hidden_dtype_on
from eaglenest.training.launch import join_processes, resolve_device, run_under_torchrun
from eaglenest.training.objective import OBJECTIVE, TTTObjective, compile_drafter
from eaglenest.training.target_head import TargetHead

log = logging.getLogger(__name__)

# Every train setting and its default: config/schema.yaml, section train (the one source).
DEFAULTS = settings_lib.defaults("train")


def fingerprint(settings: dict, index_path, start_weights: str | None = None) -> str:
    """The run's identity: its content settings, objective, shards and, for a warm start, the
    digest of the weights it starts from (``start_weights``), not their path."""
    index = json.loads(Path(index_path).read_text())
    content = {key: value for key, value in settings_lib.train_content(settings).items() if key != "init_from"}
    content["objective"] = OBJECTIVE
    content["shards"] = [entry["checksums"] for entry in index["shards"]]
    if start_weights is not None:
        content["start_weights"] = start_weights
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


# Fields a warm start's drafter must share with the drafter this run builds.
_SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                 "vocab_size", "draft_vocab_size", "target_hidden_size", "aux_layer_ids", "rope_theta")


def warm_start(model: drafter_lib.Eagle3Drafter, source, target_path) -> str:
    """Copy the trainable weights of the drafter at ``source`` (train output, checkpoint file or
    export: eaglenest.stages.export.load_any_drafter) into ``model``; return their digest.

    The source must be this run's drafter in all but its weights: same shape, aux layers and
    draft vocabulary (d2t and t2d), else a ValueError names what differs and nothing is copied.
    One difference is taken: a source with a narrower MLP (``intermediate_size``) is widened
    into this run's, its units copied and the new units' output weights zero, so the run
    starts at exactly the source's function (:func:`widen_mlp`).
    The embedding stays the target's (frozen, and an export may not carry it)."""
    from eaglenest.stages import export  # export imports the drafter model, not train

    start = export.load_any_drafter(source, target_path)
    differ = [name for name in _SHAPE_FIELDS if getattr(start.config, name) != getattr(model.config, name)]
    widen = differ == ["intermediate_size"] and start.config.intermediate_size < model.config.intermediate_size
    differ = [] if widen else [f"{name} {getattr(start.config, name)} != {getattr(model.config, name)}"
                               for name in differ]
    if not differ and not same_draft_vocab(start, {"d2t": model.d2t, "t2d": model.t2d}):
        differ.append("d2t/t2d (the draft vocabulary) differs")
    if differ:
        raise ValueError(f"train.init_from {source}: not this run's drafter shape: {'; '.join(differ)}")
    weights = {name: t for name, t in start.trainable_state_dict().items() if name not in ("d2t", "t2d")}
    if widen:
        weights.update(widen_mlp(weights, model))
        log.info("warm start widens the MLP from %d to %d units (new units' down_proj zero)",
                 start.config.intermediate_size, model.config.intermediate_size)
    digest = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        digest.update(name.encode())
        digest.update(shards.tensor_sha256(tensor.float()).encode())
    model.load_state_dict(weights, strict=False)  # the embedding and the vocabulary buffers stay this run's
    log.info("warm start from %s (weights %s)", source, digest.hexdigest()[:16])
    return digest.hexdigest()


def widen_mlp(weights: dict, model: drafter_lib.Eagle3Drafter) -> dict:
    """The source's MLP weights (``weights``, a narrower drafter's) grown to ``model``'s width.

    The first units are the source's; the new units keep ``model``'s initialisation for
    gate_proj and up_proj (so they get gradients) and have zero down_proj columns (so they add
    nothing yet): the widened drafter computes exactly the source's logits. Net2Net's
    function-preserving growth, the zero-output variant."""
    mlp = model.midlayer.mlp
    grown = {}
    for name, target in (("gate_proj", mlp.gate_proj.weight), ("up_proj", mlp.up_proj.weight)):
        source = weights[f"midlayer.mlp.{name}.weight"]
        grown[f"midlayer.mlp.{name}.weight"] = torch.cat([source.to(target.dtype), target.detach()[source.shape[0]:]])
    down = weights["midlayer.mlp.down_proj.weight"]
    extra = mlp.down_proj.weight.shape[1] - down.shape[1]
    grown["midlayer.mlp.down_proj.weight"] = torch.cat([down, down.new_zeros(down.shape[0], extra)], dim=1)
    return grown


def same_draft_vocab(drafter: drafter_lib.Eagle3Drafter, draft_vocab: dict) -> bool:
    """Whether the drafter's draft vocabulary (its d2t and t2d buffers) is ``draft_vocab``'s."""
    return all(torch.equal(getattr(drafter, name).cpu(), draft_vocab[name].cpu().to(getattr(drafter, name).dtype))
               for name in ("d2t", "t2d"))


def train(*args, **kwargs) -> dict:
    """Train (or resume) a drafter; see :func:`_train` for the arguments.

    Process-wide torch settings (threads, deterministic algorithms) are restored afterwards.
    """
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return _train(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(
    index_path,
    draft_vocab_path,
    split_path,
    target_path,
    out_dir,
    checkpoint_dir,
    settings: dict | None = None,
    target_name: str = "",
    expect: dict | None = None,
    log_stream=None,
    summary_path=None,
    stop_after_steps: int | None = None,
) -> dict:
    """Train (or resume) and write out_dir/{model.safetensors, config.json, training_curve.json}
    and, when given, ``summary_path`` (the curve's summary: throughput, final val accuracy).

    ``stop_after_steps`` ends the process's work after that many steps of this invocation
    without writing the final drafter (tests use it to make an interrupted run).
    """
    settings = settings_lib.section(settings, "train")  # the schema's defaults; unknown keys raise
    processes = join_processes(settings["device"])
    rank, world_size, device = processes.rank, processes.world_size, processes.device
    if settings["rows_per_step"] % world_size and rank == 0:
        log.warning("rows_per_step %d is not a multiple of %d processes: some ranks idle on some steps",
                    settings["rows_per_step"], world_size)
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    torch.set_num_threads(settings["threads"])
    if device.type == "cpu" and settings["deterministic"]:
        torch.use_deterministic_algorithms(True)
    hidden_dtype = hidden_dtype_on(device)

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if rank == 0:
        atomic.remove_stale_temps(checkpoint_dir)
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    train_set = batches.open_split(index_path, split_path, "train", expect)
    val_set = batches.open_split(index_path, split_path, "val", expect)
    draft_vocab = vocab.load_draft_vocab(draft_vocab_path)
    top_draft_id = loop.most_frequent_draft_id(draft_vocab)

    model = drafter_lib.build_drafter(
        target_path, draft_vocab, train_set.layer_ids, target_name=target_name, seed=settings["seed"],
        init_head_from_target=settings["init_head_from_target"], **settings["drafter"],
    )
    if model.config.target_hidden_size != train_set.hidden_size:
        raise ValueError(f"target hidden size {model.config.target_hidden_size} != shards' {train_set.hidden_size}")
    start_weights = warm_start(model, settings["init_from"], target_path) if settings["init_from"] else None
    run_fingerprint = fingerprint(settings, index_path, start_weights)
    model.to(device)
    head = TargetHead(target_path, draft_vocab["t2d"], device, hidden_dtype, temperature=settings["target_temperature"])
    objective = TTTObjective(model, settings["ttt_length"], settings["loss_chunk_rows"], settings["attention"],
                             settings["recompute_steps"])
    if settings["compile"] and device.type == "cuda":
        compile_drafter(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings["lr"], betas=(0.9, 0.95),
                                  weight_decay=settings["weight_decay"], fused=device.type == "cuda")
    stream = batches.StepStream(
        train_set, settings["token_budget"], settings["rows_per_step"], settings["seed"], settings["epochs"],
        rank=rank, world_size=world_size, prefetch=settings["prefetch"],
        pad_to_budget=device.type == "cuda", pin_memory=device.type == "cuda", keep_fp8=device.type == "cuda",
    )
    total_steps = len(stream)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, loop.cosine_schedule(settings["warmup_steps"], total_steps, settings["min_lr_ratio"])
    )
    curve = {"train": [], "val": []}
    start_step = 0
    state = checkpoints.load_latest_checkpoint(checkpoint_dir, run_fingerprint)
    if state is not None:
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        checkpoints.set_rng_state(state["rng"])
        curve = state["curve"]
        start_step = state["step"]
    stream.start_step = start_step
    ddp = objective
    if processes.distributed:
        ddp = nn.parallel.DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
    run = loop.TrainingRun(
        settings=settings, processes=processes, model=model, objective=objective, ddp=ddp, head=head,
        trainable=trainable, optimizer=optimizer, scheduler=scheduler, stream=stream, train_set=train_set,
        val_set=val_set, top_draft_id=top_draft_id, fingerprint=run_fingerprint, curve=curve, start_step=start_step,
        checkpoint_dir=checkpoint_dir, out_dir=out_dir, target_path=target_path, summary_path=summary_path,
    )
    return loop.run_steps(run, log_stream, stop_after_steps)


# Which samples of a validation split to score: all, only the original answers kept beside the
# target's (``<id>@original``, regenerate.mix_original), or every other sample.
SAMPLE_FILTERS = {
    "all": None,
    "original": lambda sample_id: sample_id.endswith(ORIGINAL_SUFFIX),
    "others": lambda sample_id: not sample_id.endswith(ORIGINAL_SUFFIX),
}


def validate_drafter(drafter_path, index_path, draft_vocab_path, split_path, target_path, settings: dict | None = None,
                     expect: dict | None = None, samples: str = "all", split: str = "val",
                     by_confidence: bool = False, confidence_edges=None) -> dict:
    """``validate`` of any saved drafter (train output, checkpoint file or export) on a run's
    validation split, in eager mode: what the training curve's validation measured, recomputed
    outside the training process (e.g. to check a compiled run's figures). ``samples``
    (SAMPLE_FILTERS) scores a part of the split: a mixed run's split holds both versions of
    each held-out conversation, so "original" is held-out ShareGPT and "others" the held-out
    answers of the target, for any drafter whose run held out the same conversations.
    ``split`` "all" scores every sample of the run: a run made of held-out conversations only
    (benchmarks/heldout_validation.py). ``by_confidence`` adds the accuracy split by how sure the
    target is of each token (``loop.validate_by_confidence``, its bins' inner edges
    ``confidence_edges``, default ``loop.CONFIDENCE_EDGES``) as "by_confidence"."""
    from eaglenest.stages import export

    settings = settings_lib.section(settings, "train")
    device = resolve_device(settings["device"], 0)
    hidden_dtype = hidden_dtype_on(device)
    val_set = batches.open_split(index_path, split_path, split, expect, keep=SAMPLE_FILTERS[samples])
    draft_vocab = vocab.load_draft_vocab(draft_vocab_path)
    top_draft_id = loop.most_frequent_draft_id(draft_vocab)
    model = export.load_any_drafter(drafter_path, target_path)
    if not same_draft_vocab(model, draft_vocab):
        raise ValueError(f"{drafter_path}: its draft vocabulary is not the run's ({draft_vocab_path})")
    model = model.to(device).eval()
    head = TargetHead(target_path, draft_vocab["t2d"], device, hidden_dtype)
    objective = TTTObjective(model, settings["ttt_length"], settings["loss_chunk_rows"], settings["attention"])
    result = loop.validate(objective, head, val_set, settings, device, hidden_dtype, top_draft_id)
    if by_confidence:
        result["by_confidence"] = loop.validate_by_confidence(objective, head, val_set, settings, device, hidden_dtype,
                                                              confidence_edges or loop.CONFIDENCE_EDGES)
    return result


def launch(arguments: dict, processes: int = 1) -> None:
    """Run ``train(**arguments)``; with processes > 1 under torchrun (DDP), one per GPU or CPU worker."""
    if processes <= 1:
        train(**arguments)
        return
    run_under_torchrun("eaglenest.stages.train", arguments, processes)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="eaglenest drafter training worker (one torchrun rank)")
    parser.add_argument("arguments", help="JSON file with the arguments of eaglenest.stages.train.train")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(**json.loads(Path(args.arguments).read_text()))


if __name__ == "__main__":
    main()
