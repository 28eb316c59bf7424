"""The training loop: one optimizer step, validation, and the loop over a run's steps.

One global step: read packed rows (eaglenest.training.batches), compute the target's
distribution over the draft vocab from the stored last hidden state
(eaglenest.training.target_head), unroll the drafter ``ttt_length`` steps
(eaglenest.training.objective), and minimise sum_j decay**j * CE_j, where CE_j is the soft
cross-entropy of step j averaged over the positions that count in the whole global batch.
Under DDP a rank's loss is scaled so that DDP's gradient average equals the single-process
gradient of the same global batch.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eaglenest.formats import atomic
from eaglenest.model.drafter import Eagle3Drafter
from eaglenest.training import batches as batches_lib
from eaglenest.training import checkpoints
from eaglenest.training.batches import DeviceBatches, hidden_dtype_on, to_device
from eaglenest.training.launch import Processes
from eaglenest.training.objective import TTTObjective, step_positions
from eaglenest.training.target_head import InDraftCache, TargetHead

log = logging.getLogger(__name__)


def cosine_schedule(warmup_steps: int, total_steps: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def most_frequent_draft_id(draft_vocab: dict) -> int:
    """The draft id of the most frequent token: validation's chance level guesses it every time."""
    return int(draft_vocab["token_counts"][draft_vocab["t2d"]].argmax())


def short_context_weights(batch: dict, positions: list[torch.Tensor], tokens: int, weight: float) -> list[torch.Tensor]:
    """Per TTT step, each counted position's weight in the loss: ``weight`` where the token it
    predicts (x_{t+2+j}) has fewer than ``tokens`` tokens before it in its sample, else 1.

    A drafter serves first answers with a short context behind them (MT-bench's first turns,
    HumanEval's prompts), while most of a multi-turn sample's positions sit deep in its
    conversation, where drafting is easier (docs/training.md)."""
    context = batch["position_ids"].flatten()
    return [torch.where(context[rows + 2 + j] < tokens, float(weight), 1.0).to(torch.float32)
            for j, rows in enumerate(positions)]


def train_step(objective, head: TargetHead, batch: dict | None, local_tokens: float, decay_weights: list[float],
               trainable: list[torch.Tensor], optimizer, max_grad_norm: float, autocast, mark=None,
               after_backward=None, in_draft_cache: InDraftCache | None = None,
               short_context: tuple[int, float] | None = None):
    """One optimizer step on a batch already on the device (None: a rank with no row this step):
    the target's soft labels, the counted positions, the TTT unroll's loss, backward, gradient
    clipping, the optimizer. ``objective`` is the TTTObjective or its DDP wrapper.
    Returns (per-step results, the global counts [positions per TTT step, tokens, the loss's
    normaliser per TTT step] as a device tensor, the gradient norm). ``short_context`` (tokens,
    weight) weighs positions of a short context (:func:`short_context_weights`); each step's CE
    is then normalised by its positions' summed weight, not their number. ``mark(phase)`` is
    called as each phase is queued ("target head",
    "forward", "backward", "clip", "optimizer", "end"): benchmarks/train_step_anatomy.py times
    the phases from it. ``after_backward()`` runs once the backward pass is queued
    (DeviceBatches.prefetch: the next batch's copy then runs beside clipping and the optimizer,
    after the step's memory peak). ``in_draft_cache`` keeps the target's in-draft test of the
    samples seen (their later steps run the target head's draft block only)."""
    mark = mark or (lambda phase: None)
    length = len(decay_weights)
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    device = next(p.device for p in trainable)
    mark("target head")
    if batch is not None:
        # The target's last hidden states serve the soft labels only: gone before the
        # drafter's forward pass (0.44 GiB a step of 32,768 tokens at H 7,168).
        known = in_draft_cache.lookup(batch) if in_draft_cache is not None else None
        target_logits, in_draft = head(batch.pop("last_hidden").flatten(0, 1),
                                       None if known is None else known.flatten())
        in_draft = in_draft.view_as(batch["input_ids"])
        if in_draft_cache is not None and known is None:
            in_draft_cache.store(batch, in_draft)
        positions = step_positions(batch, in_draft, length)
        local_counts = [float(p.numel()) for p in positions] + [local_tokens]
    else:
        target_logits, positions = None, None
        local_counts = [0.0] * (length + 1)
    position_weights = None
    if short_context is not None and batch is not None:
        position_weights = short_context_weights(batch, positions, *short_context)
    global_counts = torch.tensor(local_counts, dtype=torch.float64).to(device, non_blocking=True)
    if position_weights is None:
        norms = global_counts[:length]
    else:
        norms = torch.stack([w.sum() for w in position_weights]).to(torch.float64)
    global_counts = torch.cat([global_counts, norms])
    if distributed:  # a rank without a row adds zeros
        dist.all_reduce(global_counts)
    # Normalise by the global count (or summed weight) so that DDP's mean over ranks is the
    # global-batch loss.
    step_weights = torch.stack([w * world_size / global_counts[length + 1 + j].clamp(min=1.0)
                                for j, w in enumerate(decay_weights)])
    mark("forward")
    with autocast:
        loss, results = objective(batch, target_logits, positions, step_weights, position_weights)
    mark("backward")
    loss.backward()
    if after_backward is not None:
        after_backward()
    mark("clip")
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
    mark("optimizer")
    optimizer.step()
    # Free the gradients now, not before the next backward pass: kept, they would sit through
    # the next forward pass, at its peak (3.6 GiB for the Kimi-shaped drafter,
    # benchmarks/train_memory.py).
    optimizer.zero_grad(set_to_none=True)
    mark("end")
    return results, global_counts, grad_norm


def _validation_batches(head: TargetHead, dataset, settings, device, hidden_dtype, rank, world_size):
    """Yield (batch, the target's logits over the draft vocab, each TTT step's counted positions)
    for this rank's rows of ``dataset``, in order: what validation scores a drafter on."""
    steps = batches_lib.epoch_steps(dataset, settings["token_budget"], settings["rows_per_step"], 0, 0, shuffle=False)
    reader = batches_lib.RowReader(dataset, keep_fp8=device.type == "cuda")
    pad_to = settings["token_budget"] if device.type == "cuda" else None
    pad_rows = batches_lib.rows_per_rank(settings["rows_per_step"], world_size) if device.type == "cuda" else None
    for rows in steps:
        mine = rows[rank::world_size]
        if not mine:
            continue
        batch = to_device(reader.batch(mine, pad_to=pad_to, pad_rows=pad_rows), device, hidden_dtype)
        target_logits, in_draft = head(batch["last_hidden"].flatten(0, 1))
        yield batch, target_logits, step_positions(batch, in_draft.view_as(batch["input_ids"]), settings["ttt_length"])


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


@torch.no_grad()
def validate(objective: TTTObjective, head: TargetHead, dataset, settings, device, hidden_dtype, top_draft_id,
             rank=0, world_size=1) -> dict:
    """Per TTT step: mean soft CE, top-1 accuracy, and the accuracy of always guessing the most
    frequent draft token (the chance level to beat), over the positions that count."""
    length = settings["ttt_length"]
    # [ce, count, hits, chance] per step, summed on the device and read once at the end.
    sums = torch.zeros(length, 4, dtype=torch.float64, device=device)
    for batch, target_logits, positions in _validation_batches(head, dataset, settings, device, hidden_dtype,
                                                               rank, world_size):
        with _autocast(device):
            results = objective(batch, target_logits, positions)
        target_ids = target_logits.argmax(-1)
        for j, (ce, count, hits) in enumerate(results):
            chance = (target_ids[positions[j] + 1 + j] == top_draft_id).sum()
            sums[j] += torch.stack([torch.as_tensor(ce, dtype=torch.float64, device=device),
                                    torch.tensor(float(count), dtype=torch.float64, device=device),
                                    hits.to(torch.float64), chance.to(torch.float64)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    sums = sums.tolist()
    counts = [sums[j][1] for j in range(length)]
    return {
        "loss": [sums[j][0] / max(counts[j], 1) for j in range(length)],
        "acc": [sums[j][2] / max(counts[j], 1) for j in range(length)],
        "chance_acc": [sums[j][3] / max(counts[j], 1) for j in range(length)],
        "positions": [int(c) for c in counts],
    }


# Bins of the target's probability of its own top token (over the draft vocabulary).
CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.9)


def confidence_edges(edges) -> tuple[float, ...]:
    """The inner edges of validate_by_confidence's bins, checked: ascending, each strictly
    between 0 and 1 (torch.bucketize gives meaningless bins otherwise)."""
    edges = tuple(float(edge) for edge in edges)
    if not edges or list(edges) != sorted(set(edges)) or not 0 < edges[0] or not edges[-1] < 1:
        raise ValueError(f"confidence bin edges {list(edges)}: ascending, each strictly between 0 and 1")
    return edges


@torch.no_grad()
def validate_by_confidence(objective: TTTObjective, head: TargetHead, dataset, settings, device, hidden_dtype,
                           edges=CONFIDENCE_EDGES) -> dict:
    """Top-1 accuracy per TTT step, split by how sure the target is of the token the drafter must
    guess: its probability of its own top token, binned at ``edges``. A flat distribution's
    argmax is hard to tell from the target's states, so a set whose target is often unsure
    validates lower with the same drafter: the shares of positions per bin tell that apart from
    a drafter that has not learned the set. One process; the drafter's logits are formed here,
    per position, beside the objective's summed hits."""
    length = settings["ttt_length"]
    edges = confidence_edges(edges)
    bounds = torch.tensor(edges, dtype=torch.float32, device=device)
    # [hits, count, summed sureness] per step and bin: the mean sureness tells two sets' positions
    # in one bin apart (a wide bin holds surer positions in one set than in the other)
    sums = torch.zeros(length, len(edges) + 1, 3, dtype=torch.float64, device=device)
    weight = objective.drafter.lm_head.weight
    for batch, target_logits, positions in _validation_batches(head, dataset, settings, device, hidden_dtype, 0, 1):
        target_ids = target_logits.argmax(-1)
        sureness = target_logits.float().softmax(-1).amax(-1)
        with _autocast(device):
            for j, normed in objective.unroll(batch):
                wanted = positions[j] + 1 + j
                guessed = (normed.flatten(0, 1)[positions[j]] @ weight.T).argmax(-1)
                bins = torch.bucketize(sureness[wanted], bounds)
                sums[j, :, 0] += torch.bincount(bins, weights=(guessed == target_ids[wanted]).double(),
                                                minlength=len(edges) + 1)
                sums[j, :, 1] += torch.bincount(bins, minlength=len(edges) + 1).double()
                sums[j, :, 2] += torch.bincount(bins, weights=sureness[wanted].double(), minlength=len(edges) + 1)
    sums = sums.tolist()
    lows = (0.0, *edges)
    highs = (*edges, 1.0)
    return {
        "bins": [[low, high] for low, high in zip(lows, highs)],
        "positions": [[int(count) for _, count, _ in step] for step in sums],
        "acc": [[hits / count if count else None for hits, count, _ in step] for step in sums],
        "share": [[count / max(sum(c for _, c, _ in step), 1) for _, count, _ in step] for step in sums],
        "mean_sureness": [[summed / count if count else None for _, count, summed in step] for step in sums],
    }


@dataclass
class TrainingRun:
    """What the loop runs on, set up (and resumed) by eaglenest.stages.train."""

    settings: dict
    processes: Processes
    model: Eagle3Drafter
    objective: TTTObjective
    ddp: nn.Module  # the objective, or its DistributedDataParallel wrapper
    head: TargetHead
    trainable: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: batches_lib.StepStream
    train_set: batches_lib.Dataset
    val_set: batches_lib.Dataset
    top_draft_id: int
    fingerprint: str
    curve: dict  # {"train": [...], "val": [...]}, a resumed run's so far
    start_step: int
    checkpoint_dir: Path
    out_dir: Path
    target_path: str
    summary_path: str | None = None


def run_steps(run: TrainingRun, log_stream=None, stop_after_steps: int | None = None) -> dict:
    """Run the steps from ``run.start_step`` on, validating and checkpointing as the settings
    say; then write out_dir/{model.safetensors, config.json, training_curve.json} and, when
    given, ``summary_path``; return the summary. ``stop_after_steps``: see
    eaglenest.stages.train.train."""
    settings, processes, model, objective, head = run.settings, run.processes, run.model, run.objective, run.head
    optimizer, scheduler, stream, curve = run.optimizer, run.scheduler, run.stream, run.curve
    train_set, val_set, start_step = run.train_set, run.val_set, run.start_step
    rank, world_size, distributed, device = processes.rank, processes.world_size, processes.distributed, processes.device
    hidden_dtype = hidden_dtype_on(device)
    total_steps = len(stream)

    def checkpoint(step: int):
        if rank == 0:
            checkpoints.save_checkpoint(run.checkpoint_dir, {
                "format": checkpoints.CHECKPOINT_FORMAT, "fingerprint": run.fingerprint, "step": step,
                "epoch": stream.schedule[min(step, total_steps - 1)][0] if total_steps else 0,
                "model": {k: v.cpu() for k, v in model.trainable_state_dict().items()},
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": checkpoints.rng_state(), "curve": curve, "drafter_config": model.config.to_dict(),
                "target_path": str(run.target_path), "settings": settings,
            }, settings["keep_checkpoints"])
        if distributed:
            dist.barrier()

    def run_validation(step: int):
        model.eval()
        result = validate(objective, head, val_set, settings, device, hidden_dtype, run.top_draft_id, rank, world_size)
        model.train()
        curve["val"].append({"step": step, **result})
        log.info("val step %d: acc per TTT position %s (chance %s)", step,
                 [round(a, 4) for a in result["acc"]], [round(a, 4) for a in result["chance_acc"]])
        return result

    from tqdm import tqdm

    progress = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=log_stream or sys.stderr,
                    disable=rank != 0, mininterval=5.0, dynamic_ncols=False)
    autocast = _autocast(device)
    length = settings["ttt_length"]
    decay_weights = [settings["decay"] ** j for j in range(length)]
    short_context = None
    if settings["short_context_tokens"] > 0 and settings["short_context_weight"] != 1.0:
        short_context = (settings["short_context_tokens"], settings["short_context_weight"])
    loop_began = time.perf_counter()
    tokens_seen, steps_done = 0, 0
    # Steps whose statistics are still on the device: (record so far, [ce x L, hits x L, counts x L,
    # tokens, loss normalisers x L, grad norm]). Read in one copy at log, validation and checkpoint
    # time, so that the step itself never waits for the device beyond the counted positions.
    pending: list[tuple[dict, torch.Tensor]] = []

    def flush_records() -> None:
        nonlocal tokens_seen
        if not pending:
            return
        stacked = torch.stack([stats for _, stats in pending])
        if distributed:  # ce and hits are per rank; counts and the gradient norm are global already
            per_rank = stacked[:, : 2 * length].contiguous()
            dist.all_reduce(per_rank)
            stacked[:, : 2 * length] = per_rank
        for (record, _), values in zip(pending, stacked.tolist()):
            counts = values[2 * length : 3 * length]
            norms = values[3 * length + 1 : 4 * length + 1]
            record.update({
                "grad_norm": values[-1],
                "loss": sum(w * values[j] / max(norms[j], 1) for j, w in enumerate(decay_weights)),
                "acc": [values[length + j] / max(counts[j], 1) for j in range(length)],
                "positions": [int(c) for c in counts], "tokens": int(values[3 * length]),
            })
            curve["train"].append(record)
            tokens_seen += record["tokens"]
        last = pending[-1][0]
        progress.set_postfix(loss=f"{last['loss']:.3f}", acc0=f"{last['acc'][0]:.3f}", refresh=False)
        log.info("step %d/%d epoch %d loss %.4f acc %s lr %.2e grad %.3f", last["step"], total_steps, last["epoch"],
                 last["loss"], [round(a, 3) for a in last["acc"]], last["lr"], last["grad_norm"])
        pending.clear()

    log.info("training %d steps (%d train samples, %d tokens; %d val samples) on %s x%d from step %d",
             total_steps, len(train_set.samples), train_set.num_tokens, len(val_set.samples), device, world_size,
             start_step)
    model.train()
    try:
        waited_before = 0.0
        step_ended = time.perf_counter()
        batches = DeviceBatches(stream, device, hidden_dtype)
        in_draft_cache = InDraftCache(train_set, device)
        for step, epoch, batch, local_tokens in batches:
            results, global_counts, grad_norm = train_step(run.ddp, head, batch, local_tokens, decay_weights,
                                                           run.trainable, optimizer, settings["max_grad_norm"], autocast,
                                                           after_backward=batches.prefetch, in_draft_cache=in_draft_cache,
                                                           short_context=short_context)
            scheduler.step()
            stats = torch.cat([
                torch.stack([torch.as_tensor(ce, device=device).detach().to(torch.float64) for ce, _, _ in results]),
                torch.stack([torch.as_tensor(h, device=device).to(torch.float64) for _, _, h in results]),
                global_counts, grad_norm.detach().to(torch.float64).reshape(1),
            ])
            now = time.perf_counter()
            # The loader's wait since the last step ended: at the top of this step, or where the
            # next batch was fetched early (DeviceBatches.prefetch).
            waited, waited_before = stream.wait_seconds - waited_before, stream.wait_seconds
            pending.append(({"step": step + 1, "epoch": epoch, "lr": scheduler.get_last_lr()[0],
                             "seconds": now - step_ended - waited, "data_wait_seconds": waited}, stats))
            step_ended = now
            steps_done += 1
            progress.update(1)
            validating = settings["val_every"] and (step + 1) % settings["val_every"] == 0 and step + 1 < total_steps
            checkpointing = (step + 1) % settings["checkpoint_every"] == 0 or step + 1 == total_steps
            stopping = stop_after_steps is not None and steps_done >= stop_after_steps
            if (step + 1) % settings["log_every"] == 0 or validating or checkpointing or stopping:
                flush_records()
            if validating:
                run_validation(step + 1)
            if checkpointing:
                checkpoint(step + 1)
            if stopping:
                return {"stopped_at": step + 1}
    finally:
        stream.close()
        progress.close()
    loop_seconds = time.perf_counter() - loop_began

    final_val = run_validation(total_steps) if (not curve["val"] or curve["val"][-1]["step"] != total_steps) \
        else curve["val"][-1]
    summary = {
        "steps": total_steps, "resumed_from_step": start_step, "processes": world_size, "device": str(device),
        "tokens_this_invocation": tokens_seen,
        "tokens_per_second": tokens_seen / loop_seconds if loop_seconds and steps_done else None,
        "data_wait_fraction": stream.wait_seconds / loop_seconds if loop_seconds and steps_done else None,
        "final_val_acc": final_val["acc"], "final_val_chance_acc": final_val["chance_acc"],
        "final_val_loss": final_val["loss"], "final_val_positions": final_val["positions"],
        "ttt_length": settings["ttt_length"], "train_tokens_per_epoch": train_set.num_tokens,
        "fingerprint": run.fingerprint,
        # This rank's most allocated at once (rank 0 writes the summary), since the process began
        # or the caller last reset the peak.
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    curve["summary"] = summary
    log.info("done: %s", json.dumps(summary))
    if rank == 0:
        model.save(run.out_dir, extra_config={"architectures": ["Eagle3Drafter"], "layer_ids_convention": "hf"})
        atomic.write_json(run.out_dir / "training_curve.json", curve)
        if run.summary_path:
            atomic.write_json(run.summary_path, summary)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return summary
