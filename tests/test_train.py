"""Drafter training: loader packing and shuffling, TTT targets, resume after SIGKILL, DDP."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.stages import consolidate, train
from eaglenest.formats import shards
from eaglenest.target_model import weights as target_weights
from eaglenest.training import batches, draft_loss
from eaglenest.training.batches import DeviceBatches, to_device
from eaglenest.training.objective import OBJECTIVE, TTTObjective, step_positions
from eaglenest.training.target_head import InDraftCache, TargetHead

LAYER_IDS = [1, 3, 4]
EXPECT = {"target": "tiny-llama", "layer_ids": LAYER_IDS, "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def tiny_run(tiny_llama, tmp_path_factory) -> dict:
    """Hidden shards of the tiny random Llama, made by running it, then consolidated."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-run")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    # Random init gives near-uniform next-token distributions; a larger (tied) embedding makes
    # them peaked, like a trained model's, so that there is something to learn.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(60)
    target_path = root / "target"
    model.save_pretrained(str(target_path))
    generator = torch.Generator().manual_seed(0)
    vocab_size = model.config.vocab_size
    hidden_paths, prepared_paths = [], []
    for shard_id in range(3):
        samples = []
        for k in range(6):
            length = int(torch.randint(12, 40, (1,), generator=generator))
            # a repetitive source so that a drafter has something to learn
            base = torch.randint(3, vocab_size, (4,), generator=generator)
            ids = base.repeat(length // 4 + 1)[:length].tolist()
            mask = [0] * 4 + [1] * (length - 4)
            samples.append({"sample_id": f"s:{shard_id}:{k}", "input_ids": ids, "loss_mask": mask})
        name = shards.shard_name(shard_id)
        prepared = root / "prepared" / name
        shards.write_prepared_shard(prepared, shard_id, samples, {"target": "tiny-llama"})
        aux, last = [], []
        with torch.no_grad():
            for sample in samples:
                out = model(torch.tensor([sample["input_ids"]]), output_hidden_states=True)
                aux.append(torch.cat([out.hidden_states[i][0] for i in LAYER_IDS], -1))
                last.append(out.hidden_states[-1][0])
        hidden = root / "hidden" / name
        shards.write_hidden_shard(
            hidden, shards.ShardReader.open(prepared), torch.cat(aux).bfloat16(), torch.cat(last).bfloat16(),
            {"target": "tiny-llama", "target_hidden_size": 64, "layer_ids": LAYER_IDS, "dtype": "bfloat16"},
        )
        hidden_paths.append(str(hidden))
        prepared_paths.append(str(prepared))
    out = root / "consolidated"
    consolidate.consolidate(
        hidden_paths, prepared_paths, out / "index.json", out / "draft_vocab.safetensors", out / "split.json",
        target_vocab_size=vocab_size, draft_vocab_size=64, expect=EXPECT, val_fraction=0.2, seed=0,
    )
    return {
        "index_path": str(out / "index.json"),
        "draft_vocab_path": str(out / "draft_vocab.safetensors"),
        "split_path": str(out / "split.json"),
        "target_path": str(target_path),
        "target_name": "tiny-llama",
        "expect": EXPECT,
    }


SETTINGS = {"epochs": 3, "token_budget": 64, "rows_per_step": 2, "ttt_length": 3, "lr": 3e-3, "warmup_steps": 2,
            "threads": 1, "checkpoint_every": 2, "keep_checkpoints": 2, "val_every": 0}


def arguments(run: dict, tmp_path: Path, **settings) -> dict:
    return {**run, "out_dir": str(tmp_path / "drafter"), "checkpoint_dir": str(tmp_path / "checkpoints"),
            "settings": {**SETTINGS, **settings}}


# ---- loader -----------------------------------------------------------------------------------------------


def test_epoch_packs_every_train_sample_once_within_the_token_budget(tiny_run):
    dataset = batches.open_split(tiny_run["index_path"], tiny_run["split_path"], "train", EXPECT)
    steps = batches.epoch_steps(dataset, 64, 2, seed=0, epoch=0)
    seen = [i for step in steps for row in step for i in row]
    assert sorted(seen) == list(range(len(dataset.samples)))
    assert all(sum(dataset.samples[i].length for i in row) <= 64 for step in steps for row in step)
    assert all(len(step) <= 2 for step in steps)


def test_a_sample_filter_opens_that_part_of_a_split_in_index_order(tiny_run):
    everything = batches.open_split(tiny_run["index_path"], tiny_run["split_path"], "train", EXPECT)
    firsts = batches.open_split(tiny_run["index_path"], tiny_run["split_path"], "train", EXPECT,
                                keep=lambda sample_id: sample_id.endswith(":0"))
    assert [ref.sample_id for ref in firsts.samples] == [
        ref.sample_id for ref in everything.samples if ref.sample_id.endswith(":0")] != []


def test_shuffle_is_a_function_of_seed_and_epoch(tiny_run):
    dataset = batches.open_split(tiny_run["index_path"], tiny_run["split_path"], "train", EXPECT)
    order = lambda seed, epoch: batches.epoch_steps(dataset, 64, 2, seed, epoch)  # noqa: E731
    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)


def test_sample_longer_than_the_budget_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="raise the budget"):
        batches.pack_rows([10, 80, 5], token_budget=64)


def test_packed_batch_restarts_positions_and_pads_with_no_loss(tiny_run):
    dataset = batches.open_split(tiny_run["index_path"], tiny_run["split_path"], "train", EXPECT)
    row = [0, 1]
    batch = batches.RowReader(dataset).batch([row], pad_to=100)
    first, second = (dataset.samples[i].length for i in row)
    assert batch["position_ids"][0, first].item() == 0
    assert batch["segment_ids"][0, :first].eq(0).all() and batch["segment_ids"][0, first : first + second].eq(1).all()
    assert batch["segment_ids"][0, first + second :].eq(-1).all()
    assert not batch["loss_mask"][0, first + second :].any()
    assert batch["tokens"].item() == first + second


def test_batch_padding_holds_zero_hidden_rows_whatever_the_memory_held(tiny_run, monkeypatch):
    """The loader makes its hidden tensors without zeroing them first and zeroes only the padding:
    with every new tensor's memory full of NaN, the padding (a row's tail and a whole empty row)
    is still zero, and the samples' rows are the shards' own."""
    dataset = batches.open_split(tiny_run["index_path"], tiny_run["split_path"], "train", EXPECT)
    rows = [[0, 1], [2]]
    clean = batches.RowReader(dataset).batch(rows, pad_to=100, pad_rows=3)
    real_empty = torch.empty

    def dirty_empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor.fill_(7)

    monkeypatch.setattr(torch, "empty", dirty_empty)
    dirty = batches.RowReader(dataset).batch(rows, pad_to=100, pad_rows=3)
    monkeypatch.undo()
    for name in ("aux_hidden", "last_hidden"):
        assert torch.equal(dirty[name], clean[name]), name
        for b, row in enumerate(rows + [[]]):
            used = sum(dataset.samples[i].length for i in row)
            assert not dirty[name][b, used:].any(), (name, b)
            assert dirty[name][b, :used].isfinite().all()


def test_padded_steps_all_have_one_shape_and_the_padding_rows_change_nothing(tiny_run):
    """On CUDA every step is padded to token_budget x rows_per_step, the epoch's short last step
    too, so that the compiled step is compiled once; empty rows add no loss, hits or gradient."""
    from eaglenest.model import drafter as drafter_lib
    from eaglenest.formats import vocab

    dataset = batches.open_split(tiny_run["index_path"], tiny_run["split_path"], "train", EXPECT)
    stream = batches.StepStream(dataset, 64, 3, seed=0, epochs=2, pad_to_budget=True)
    assert any(len(rows) < 3 for _, rows in stream.schedule)  # a short step exists
    shapes = {tuple(batch["aux_hidden"].shape) for _, _, batch in stream}
    assert shapes == {(3, 64, len(LAYER_IDS) * 64)}

    reader = batches.RowReader(dataset)
    rows = batches.epoch_steps(dataset, 64, 2, seed=0, epoch=0)[0]
    draft_vocab = vocab.load_draft_vocab(tiny_run["draft_vocab_path"])
    head = TargetHead(tiny_run["target_path"], draft_vocab["t2d"], torch.device("cpu"), torch.float32)
    outcomes = []
    for pad_rows in (None, 4):
        model = drafter_lib.build_drafter(tiny_run["target_path"], draft_vocab, LAYER_IDS, target_name="tiny-llama", seed=0)
        objective = TTTObjective(model, 3)
        batch = to_device(reader.batch(rows, pad_to=64, pad_rows=pad_rows), torch.device("cpu"), torch.float32)
        target_logits, in_draft = head(batch["last_hidden"].flatten(0, 1))
        positions = step_positions(batch, in_draft.view_as(batch["input_ids"]), 3)
        results = objective(batch, target_logits, positions)
        sum(ce for ce, _, _ in results).backward()
        outcomes.append(([float(ce.detach()) for ce, _, _ in results], [int(h) for _, _, h in results],
                         model.fc.weight.grad.clone(), int(batch["tokens"])))
    (ce, hits, grad, tokens), (padded_ce, padded_hits, padded_grad, padded_tokens) = outcomes
    assert padded_hits == hits and padded_tokens == tokens
    assert padded_ce == pytest.approx(ce, rel=1e-5)
    torch.testing.assert_close(padded_grad, grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="do not fit"):
        reader.batch(rows, pad_to=64, pad_rows=1)


def test_fp8_rows_kept_by_the_loader_and_dequantized_by_to_device_equal_the_loader_s_own(tiny_run, tmp_path):
    """On CUDA the loader hands fp8 rows and their scales to the trainer, which dequantizes on
    the GPU: the same values, bit for bit, as dequantizing in the loader (float32 products
    rounded once to the hidden dtype on either device)."""
    dataset = batches.open_split(tiny_run["index_path"], tiny_run["split_path"], "train", EXPECT)
    hidden_paths, prepared_paths = [], []
    for shard_path in dataset.shard_paths:
        source = shards.ShardReader.open(shard_path)
        tensors = source.hidden_tensors()
        aux, aux_scale = shards.quantize_rows(tensors["aux_hidden"], len(LAYER_IDS))
        last, last_scale = shards.quantize_rows(tensors["last_hidden"], 1)
        out = tmp_path / "hidden" / Path(shard_path).name
        meta = {"target": "tiny-llama", "target_hidden_size": 64, "layer_ids": LAYER_IDS, "dtype": "float8_e4m3"}
        shards.write_hidden_shard(out, source, aux, last, meta, aux_scale, last_scale)
        hidden_paths.append(str(out))
        prepared_paths.append(str(Path(shard_path).parents[1] / "prepared" / Path(shard_path).name))
    vocab_size = json.loads((Path(tiny_run["target_path"]) / "config.json").read_text())["vocab_size"]
    consolidated = tmp_path / "consolidated"
    expect = {**EXPECT, "dtype": "float8_e4m3"}
    consolidate.consolidate(
        hidden_paths, prepared_paths, consolidated / "index.json", consolidated / "draft_vocab.safetensors",
        consolidated / "split.json", target_vocab_size=vocab_size, draft_vocab_size=64, expect=expect, val_fraction=0.2, seed=0,
    )
    fp8_set = batches.open_split(consolidated / "index.json", consolidated / "split.json", "train", expect)
    rows = batches.epoch_steps(fp8_set, 64, 3, seed=0, epoch=0)[0]
    plain = to_device(batches.RowReader(fp8_set).batch(rows, pad_to=64), torch.device("cpu"), torch.bfloat16)
    kept = batches.RowReader(fp8_set, keep_fp8=True).batch(rows, pad_to=64, pad_rows=4)
    assert kept["aux_hidden"].dtype == torch.float8_e4m3fn and kept["aux_hidden_scale"].shape == (4, 64, len(LAYER_IDS))
    moved = to_device(kept, torch.device("cpu"), torch.bfloat16)
    assert set(moved) == set(plain) and "aux_hidden_scale" not in moved
    for name in ("aux_hidden", "last_hidden"):
        assert moved[name].dtype == torch.bfloat16
        assert torch.equal(moved[name][:3], plain[name]), name
        assert not moved[name][3].any()  # the padding row


def first_step(tiny_run: dict, ttt_length: int):
    """The first training step of the tiny run on the CPU: (batch, draft vocab, the target's
    draft-vocabulary logits, each TTT step's counted positions)."""
    from eaglenest.formats import vocab

    dataset = batches.open_split(tiny_run["index_path"], tiny_run["split_path"], "train", EXPECT)
    rows = batches.epoch_steps(dataset, 64, 2, seed=0, epoch=0)[0]
    batch = to_device(batches.RowReader(dataset).batch(rows), torch.device("cpu"), torch.float32)
    draft_vocab = vocab.load_draft_vocab(tiny_run["draft_vocab_path"])
    head = TargetHead(tiny_run["target_path"], draft_vocab["t2d"], torch.device("cpu"), torch.float32)
    target_logits, in_draft = head(batch["last_hidden"].flatten(0, 1))
    return batch, draft_vocab, target_logits, step_positions(batch, in_draft.view_as(batch["input_ids"]), ttt_length)


def test_recomputed_steps_give_the_same_loss_and_gradients_and_do_recompute(tiny_run):
    """train.recompute_steps: every TTT step's activations are recomputed in the backward pass
    (each step runs twice), on the cache as that step saw it: same losses, hits and gradients."""
    from eaglenest.model import drafter as drafter_lib

    batch, draft_vocab, target_logits, positions = first_step(tiny_run, ttt_length=4)
    outcomes = []
    for recompute in (False, True):
        model = drafter_lib.build_drafter(tiny_run["target_path"], draft_vocab, LAYER_IDS, target_name="tiny-llama", seed=0)
        calls = []
        model.midlayer.register_forward_hook(lambda *_: calls.append(1))
        objective = TTTObjective(model, 4, attention_backend="dense", recompute_steps=recompute)
        results = objective(batch, target_logits, positions)
        forward_calls = len(calls)
        sum(w * ce for w, (ce, _, _) in zip((1.0, 0.8, 0.64, 0.51), results)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        outcomes.append(([float(ce.detach()) for ce, _, _ in results], [int(h) for _, _, h in results], grads,
                         forward_calls, len(calls)))
    (ce, hits, grads, _, calls), (re_ce, re_hits, re_grads, re_forward, re_calls) = outcomes
    assert calls == re_forward == 4 and re_calls == 8  # each step ran again in the backward pass
    assert re_hits == hits and re_ce == pytest.approx(ce, rel=1e-6)
    for name in grads:
        torch.testing.assert_close(re_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("recompute,weighted", [(False, False), (True, False), (False, True)])
def test_one_shared_head_gradient_buffer_gives_the_per_step_gradients(tiny_run, recompute, weighted):
    """step_weights: every TTT step adds its head-weight gradient, times its loss weight, to one
    float32 buffer in the forward pass (draft_loss.SharedHeadGradient) instead of keeping its
    own. Judged against autograd through each step's own gradient: same loss, CEs, hits, and
    every parameter's gradient, for an upstream gradient other than one; also with each
    position weighted (train.short_context_weight)."""
    from eaglenest.model import drafter as drafter_lib
    from eaglenest.training.loop import short_context_weights

    batch, draft_vocab, target_logits, positions = first_step(tiny_run, ttt_length=4)
    step_weights = torch.tensor([0.8 ** j / max(len(p), 1) for j, p in enumerate(positions)], dtype=torch.float64)
    position_weights = short_context_weights(batch, positions, 20, 3.0) if weighted else None
    if weighted:  # both kinds of position in every step
        assert all(0 < int((w == 3.0).sum()) < len(w) for w in position_weights)
    outcomes = []
    for shared in (False, True):
        model = drafter_lib.build_drafter(tiny_run["target_path"], draft_vocab, LAYER_IDS, target_name="tiny-llama", seed=0)
        objective = TTTObjective(model, 4, attention_backend="dense", recompute_steps=recompute, loss_chunk_rows=7)
        if shared:
            loss, results = objective(batch, target_logits, positions, step_weights, position_weights)
            assert all(not ce.requires_grad for ce, _, _ in results)
        else:
            results = objective(batch, target_logits, positions, position_weights=position_weights)
            loss = sum(w * ce for w, (ce, _, _) in zip(step_weights, results))
        (loss * 3.0).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        outcomes.append((float(loss.detach()), [float(ce) for ce, _, _ in results], [int(h) for _, _, h in results], grads))
    (loss, ce, hits, grads), (shared_loss, shared_ce, shared_hits, shared_grads) = outcomes
    assert shared_hits == hits and shared_ce == pytest.approx(ce, rel=1e-6) and shared_loss == pytest.approx(loss, rel=1e-6)
    assert set(shared_grads) == set(grads) and "lm_head.weight" in grads
    for name, grad in grads.items():  # float32 sums in another order: within 1e-6 of each gradient's scale
        scale = float(grad.abs().max())
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-5, atol=1e-6 * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert float((shared_grads[name] - grad).norm()) <= 1e-6 * float(grad.norm()), name


def test_changed_shard_is_refused_by_the_loader(tiny_run, tmp_path):
    index = json.loads(Path(tiny_run["index_path"]).read_text())
    index["shards"][0]["checksums"]["aux_hidden"] = "0" * 64
    edited = tmp_path / "index.json"
    edited.write_text(json.dumps(index))
    with pytest.raises(shards.ShardError, match="changed since consolidation"):
        batches.open_split(edited, tiny_run["split_path"], "train", EXPECT)


# ---- TTT targets ------------------------------------------------------------------------------------------


def test_positions_count_only_masked_in_vocab_tokens_of_the_same_sample():
    batch = {
        "segment_ids": torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, -1]]),
        "loss_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool),
    }
    in_draft = torch.tensor([[True, True, False, True, True, True, True, True, True, False]])
    step0, step1 = step_positions(batch, in_draft, 2)
    # step 0 at t predicts x_{t+2} with the target at t+1 as label: t=1 loses (target at 2 is
    # outside the draft vocab), t=3, 4 cross into sample 1, t=7 runs into padding
    assert step0.tolist() == [0, 2, 5, 6]
    # step 1 at t predicts x_{t+3} with the target at t+2: t=0 loses (target at 2), t=4 crosses
    assert step1.tolist() == [1, 5]


def test_target_head_never_builds_full_vocab_logits_for_more_than_a_chunk(tiny_run):
    from eaglenest.formats import vocab

    draft = vocab.load_draft_vocab(tiny_run["draft_vocab_path"])
    head = TargetHead(tiny_run["target_path"], draft["t2d"], "cpu", torch.float32, chunk_elements=320 * 4)
    assert head.chunk_rows == 4
    hidden = torch.randn(10, 64)
    logits, in_draft = head(hidden)
    full = hidden @ target_weights.load_target_rows(tiny_run["target_path"], "lm_head").T
    assert torch.equal(in_draft, draft["t2d"][full.argmax(-1)])
    torch.testing.assert_close(logits, full[:, draft["t2d"]])
    # Given the in-draft test, the same logits come from the draft block alone.
    given = torch.rand(10) < 0.5
    again, passed = head(hidden, given)
    assert passed is given and torch.equal(again, logits)


def test_a_target_temperature_sharpens_the_labels_and_keeps_their_argmax_and_the_in_draft_test(tiny_run):
    from eaglenest.formats import vocab

    draft = vocab.load_draft_vocab(tiny_run["draft_vocab_path"])
    # small states: the tiny target's logits on unit-scale ones reach ~80, one-hot labels already
    hidden = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    plain, in_draft = TargetHead(tiny_run["target_path"], draft["t2d"], "cpu", torch.float32)(hidden)
    sharp, sharp_in_draft = TargetHead(tiny_run["target_path"], draft["t2d"], "cpu", torch.float32,
                                       temperature=0.5)(hidden)
    torch.testing.assert_close(sharp, plain * 2)
    assert torch.equal(sharp_in_draft, in_draft) and torch.equal(sharp.argmax(-1), plain.argmax(-1))
    # every label's top probability rises (the target's top token gets more of the mass)
    assert (sharp.softmax(-1).amax(-1) > plain.softmax(-1).amax(-1)).all()


@pytest.mark.integration
def test_a_target_temperature_reaches_the_training_labels_and_the_fingerprint(tiny_run, tmp_path):
    """train.target_temperature: the same drafter (no learning at this rate) scores the same hits
    against other labels at another loss, under another fingerprint. The tiny target's labels are
    one-hot already (logits up to about 80), so it is softened here to show."""
    plain = train.train(**arguments(tiny_run, tmp_path / "plain", epochs=1, lr=1e-20))
    other = train.train(**arguments(tiny_run, tmp_path / "other", epochs=1, lr=1e-20, target_temperature=8.0))
    assert other["final_val_acc"] == plain["final_val_acc"]
    assert all(a != b for a, b in zip(other["final_val_loss"], plain["final_val_loss"]))
    assert other["fingerprint"] != plain["fingerprint"]


def test_target_head_in_draft_test_breaks_ties_as_the_full_vocabulary_argmax(tmp_path):
    """The in-draft test from the two blocks' maxima equals t2d[argmax] of the full-vocabulary
    logits, ties included: the first maximum in target-id order wins, draft or not."""
    from safetensors.torch import save_file

    vocab_size, hidden = 12, 4
    rows = torch.randn(vocab_size, hidden) * 0.1
    rows[2] = rows[7] = torch.tensor([5.0, 0, 0, 0])  # 2 (not draft) and 7 (draft) tie; so do 9 (draft) and 10 (not)
    rows[9] = rows[10] = torch.tensor([0, 5.0, 0, 0])
    save_file({"lm_head.weight": rows}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": hidden, "vocab_size": vocab_size}))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[[0, 3, 7, 9]] = True
    head = TargetHead(tmp_path, t2d, "cpu", torch.float32)
    x = torch.cat([torch.randn(200, hidden), rows[[2, 9, 7, 10]]])  # the last four: the tied rows win
    full = x @ rows.T
    _, in_draft = head(x)
    assert torch.equal(in_draft, t2d[full.argmax(-1)])
    assert in_draft[-4:].tolist() == [False, True, False, True]


def test_in_draft_cache_answers_once_every_sample_of_a_batch_was_seen():
    """InDraftCache: no answer while a sample of the batch is new; after a batch stored its
    test, a batch of the same samples (packed otherwise) reads the same bits, False on padding."""
    from types import SimpleNamespace

    dataset = SimpleNamespace(samples=[SimpleNamespace(length=n) for n in (3, 2, 4)])
    cache = InDraftCache(dataset, torch.device("cpu"))

    def batch(rows):  # rows of sample indices, packed into rows of 6 tokens
        index = torch.full((len(rows), 6), -1)
        position = torch.zeros(len(rows), 6, dtype=torch.int64)
        for b, row in enumerate(rows):
            at = 0
            for sample in row:
                n = dataset.samples[sample].length
                index[b, at:at + n], position[b, at:at + n] = sample, torch.arange(n)
                at += n
        return {"sample_index": index, "position_ids": position, "samples": tuple(s for row in rows for s in row)}

    first = batch([[0, 1], [2]])
    assert cache.lookup(first) is None
    bits = torch.tensor([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    cache.store(first, bits)
    again = cache.lookup(batch([[1, 0], [2]]))
    # sample 1's two tokens, then sample 0's three; sample 2's four; padding False
    assert again.tolist() == [[True, False, True, False, True, False], [False, True, True, False, False, False]]
    assert cache.lookup({**batch([[0]]), "samples": (0, 5)}) is None  # a sample not seen yet


# ---- training, checkpoints, resume -------------------------------------------------------------------------


def test_training_lowers_the_loss_and_writes_the_drafter(tiny_run, tmp_path):
    summary = train.train(**arguments(tiny_run, tmp_path, epochs=6))
    curve = json.loads((tmp_path / "drafter" / "training_curve.json").read_text())
    losses = [r["loss"] for r in curve["train"]]
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3])
    assert len(curve["val"][-1]["acc"]) == 3 and summary["final_val_acc"] == curve["val"][-1]["acc"]
    assert 0 <= summary["data_wait_fraction"] < 1
    names = set(load_file(str(tmp_path / "drafter" / "model.safetensors")))
    assert {"embed_tokens.weight", "fc.weight", "lm_head.weight", "d2t", "t2d"} <= names
    checkpoints = sorted((tmp_path / "checkpoints").glob("step-*.pt"))
    assert len(checkpoints) == 2  # rotation kept the newest two
    # the last checkpoint is the final drafter (its embedding reloaded from the target)
    from eaglenest.model.drafter import Eagle3Drafter

    final = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    restored = Eagle3Drafter.from_checkpoint(checkpoints[-1]).state_dict()
    assert all(torch.equal(restored[name], final[name]) for name in final)


def test_checkpoints_of_other_settings_are_refused(tiny_run, tmp_path):
    train.train(**arguments(tiny_run, tmp_path, epochs=1))
    with pytest.raises(ValueError, match="other training settings"):
        train.train(**arguments(tiny_run, tmp_path, epochs=1, lr=1e-4))


def test_warm_start_begins_at_the_earlier_drafter_s_weights_and_is_its_own_run(tiny_run, tmp_path):
    from eaglenest.stages import export

    first = train.train(**arguments(tiny_run, tmp_path / "first", epochs=2))
    earlier = tmp_path / "first" / "drafter"
    earlier_weights = final_weights(earlier)
    # An export of it (bf16, no embedding) is a starting point too; both start at the same values.
    exported = tmp_path / "export"
    export.export_drafter(earlier, tiny_run["target_path"], "tiny-llama", exported / "sglang", exported / "vllm",
                          exported / "report.json", dtype="float32", include_embed_tokens=False)
    for source in (earlier, exported / "sglang"):
        run_dir = tmp_path / f"warm-{source.name}"
        train.train(**arguments(tiny_run, run_dir, epochs=1, lr=1e-20, init_from=str(source)))
        # lr 1e-20 moves no float32 weight: they stay where they started, the earlier drafter, not a fresh init
        warm = final_weights(run_dir / "drafter")
        assert all(torch.equal(warm[name], earlier_weights[name]) for name in earlier_weights), source
    fresh = tmp_path / "fresh"
    train.train(**arguments(tiny_run, fresh, epochs=1, lr=1e-20))
    assert not torch.equal(final_weights(fresh / "drafter")["fc.weight"], earlier_weights["fc.weight"])
    # Its validation starts where the earlier run ended, above the fresh drafter's.
    warm_curve = json.loads((tmp_path / "warm-drafter" / "drafter" / "training_curve.json").read_text())
    assert warm_curve["val"][-1]["acc"] == first["final_val_acc"]
    # A checkpoint of the fresh run (other starting weights, same settings) is refused.
    with pytest.raises(ValueError, match="other training settings"):
        train.train(**arguments(tiny_run, fresh, epochs=1, lr=1e-20, init_from=str(earlier)))


@pytest.mark.integration
def test_validating_a_saved_drafter_gives_its_training_run_s_final_validation(tiny_run, tmp_path):
    summary = train.train(**arguments(tiny_run, tmp_path, epochs=2))
    keys = ("index_path", "draft_vocab_path", "split_path", "target_path")
    again = train.validate_drafter(tmp_path / "drafter", *(tiny_run[key] for key in keys), settings=SETTINGS,
                                   expect=EXPECT)
    assert again["acc"] == summary["final_val_acc"] and again["positions"] == summary["final_val_positions"]
    # The node's command line: the run directory, the configs' train section, a JSON out.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import validate_drafter

    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"train": SETTINGS, "data": {"max_len": 64}}))
    out = tmp_path / "validation.json"
    assert validate_drafter.main(["--run", str(Path(tiny_run["index_path"]).parents[1]), "--drafter",
                                  str(tmp_path / "drafter"), "--target", tiny_run["target_path"],
                                  "--config", str(config), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["acc"] == summary["final_val_acc"]
    # A part of the split: this run keeps no original answers beside the target's, so "others"
    # is all of it and "original" is refused with the reason.
    others = train.validate_drafter(tmp_path / "drafter", *(tiny_run[key] for key in keys), settings=SETTINGS,
                                    expect=EXPECT, samples="others")
    assert others["acc"] == summary["final_val_acc"]
    with pytest.raises(ValueError, match="that the sample filter keeps"):
        train.validate_drafter(tmp_path / "drafter", *(tiny_run[key] for key in keys), settings=SETTINGS,
                               expect=EXPECT, samples="original")
    # Every sample of the run (a run of held-out conversations only): the train and val parts
    # together, position counts adding up.
    parts = [train.validate_drafter(tmp_path / "drafter", *(tiny_run[key] for key in keys), settings=SETTINGS,
                                    expect=EXPECT, split=split) for split in ("train", "all")]
    assert [a + b for a, b in zip(parts[0]["positions"], again["positions"])] == parts[1]["positions"]
    assert validate_drafter.main(["--run", str(Path(tiny_run["index_path"]).parents[1]), "--drafter",
                                  str(tmp_path / "drafter"), "--target", tiny_run["target_path"], "--config",
                                  str(config), "--split-part", "all", "--device", "cpu", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["positions"] == parts[1]["positions"]
    # Another draft vocabulary (one token swapped for one outside it) is refused, not scored.
    from eaglenest.formats import vocab

    other = vocab.load_draft_vocab(tiny_run["draft_vocab_path"])
    t2d, inside, outside = other["t2d"].clone(), int(other["t2d"].nonzero()[0]), int((~other["t2d"]).nonzero()[0])
    t2d[inside], t2d[outside] = False, True
    d2t = t2d.nonzero().squeeze(-1) - torch.arange(int(t2d.sum()))
    vocab.save_draft_vocab(tmp_path / "other_vocab.safetensors", d2t, t2d, other["token_counts"], {})
    with pytest.raises(ValueError, match="draft vocabulary is not the run's"):
        train.validate_drafter(tmp_path / "drafter", tiny_run["index_path"], tmp_path / "other_vocab.safetensors",
                               tiny_run["split_path"], tiny_run["target_path"], settings=SETTINGS)


@pytest.mark.integration
def test_accuracy_by_the_targets_sureness_adds_up_to_the_validation_it_splits(tiny_run, tmp_path):
    """by_confidence forms the drafter's guesses itself, position by position: its bins hold every
    counted position once and their hits add up to the objective's summed hits."""
    train.train(**arguments(tiny_run, tmp_path, epochs=2))
    keys = ("index_path", "draft_vocab_path", "split_path", "target_path")
    result = train.validate_drafter(tmp_path / "drafter", *(tiny_run[key] for key in keys), settings=SETTINGS,
                                    expect=EXPECT, by_confidence=True)
    binned = result["by_confidence"]
    assert binned["bins"][0] == [0.0, 0.3] and binned["bins"][-1] == [0.9, 1.0]
    assert len(binned["acc"]) == len(result["acc"]) == SETTINGS["ttt_length"]
    for step, (acc, positions) in enumerate(zip(result["acc"], result["positions"])):
        counts = binned["positions"][step]
        assert sum(counts) == positions > 0
        hits = sum(a * c for a, c in zip(binned["acc"][step], counts) if a is not None)
        assert hits == pytest.approx(acc * positions, abs=1e-6)
        assert sum(binned["share"][step]) == pytest.approx(1.0)
        assert all((a is None) == (c == 0) for a, c in zip(binned["acc"][step], counts))


def test_warm_start_from_a_drafter_of_another_shape_is_refused_before_training(tiny_run, tmp_path):
    other = tmp_path / "other"
    train.train(**{**arguments(tiny_run, other, epochs=1), "settings": {
        **SETTINGS, "epochs": 1, "drafter": {"num_key_value_heads": 1}}})
    with pytest.raises(ValueError, match="num_key_value_heads 1 != "):
        train.train(**arguments(tiny_run, tmp_path / "run", epochs=1, init_from=str(other / "drafter")))
    assert not (tmp_path / "run" / "drafter").exists()


def test_warm_start_widens_a_narrower_mlp_to_the_same_function_and_refuses_narrowing(tiny_run, tmp_path):
    from eaglenest.model.drafter import Eagle3Drafter

    narrow = tmp_path / "narrow"
    first = train.train(**{**arguments(tiny_run, narrow, epochs=2), "settings": {
        **SETTINGS, "epochs": 2, "drafter": {"intermediate_size": 8}}})
    start = final_weights(narrow / "drafter")
    wide_run = tmp_path / "wide"
    train.train(**arguments(tiny_run, wide_run, epochs=1, lr=1e-20, init_from=str(narrow / "drafter"),
                            drafter={"intermediate_size": 24}))
    wide = final_weights(wide_run / "drafter")
    assert wide["midlayer.mlp.down_proj.weight"].shape[1] == 24
    for name in ("gate_proj", "up_proj"):
        grown = wide[f"midlayer.mlp.{name}.weight"]
        assert torch.equal(grown[:8], start[f"midlayer.mlp.{name}.weight"])
        assert grown[8:].abs().max() > 0  # the new units are initialised, so they learn
    assert torch.equal(wide["midlayer.mlp.down_proj.weight"][:, :8], start["midlayer.mlp.down_proj.weight"])
    assert wide["midlayer.mlp.down_proj.weight"][:, 8:].abs().max() < 1e-15
    # The same function: its first validation is the narrow run's last, and so are its logits.
    curve = json.loads((wide_run / "drafter" / "training_curve.json").read_text())
    assert curve["val"][-1]["acc"] == first["final_val_acc"]
    narrow_model = Eagle3Drafter.from_checkpoint(narrow / "drafter")
    wide_model = Eagle3Drafter.from_checkpoint(wide_run / "drafter")
    ids = torch.randint(0, narrow_model.config.vocab_size, (2, 9))
    hidden = torch.randn(2, 9, 3 * narrow_model.config.target_hidden_size)
    with torch.no_grad():
        assert torch.allclose(narrow_model(ids, hidden)[0], wide_model(ids, hidden)[0], atol=1e-6)
    # Narrowing would drop units: refused.
    with pytest.raises(ValueError, match="intermediate_size 24 != 8"):
        train.train(**{**arguments(tiny_run, tmp_path / "back", epochs=1), "settings": {
            **SETTINGS, "epochs": 1, "init_from": str(wide_run / "drafter"), "drafter": {"intermediate_size": 8}}})


def run_worker(args: dict, args_file: Path, env=None) -> subprocess.Popen:
    args_file.write_text(json.dumps(args))
    return subprocess.Popen([sys.executable, "-m", "eaglenest.stages.train", str(args_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def final_weights(directory: Path) -> dict:
    return load_file(str(directory / "model.safetensors"))


@pytest.mark.integration
def test_run_killed_with_sigkill_resumes_to_bitwise_identical_weights(tiny_run, tmp_path):
    settings = {"epochs": 6, "checkpoint_every": 3, "keep_checkpoints": 3}
    whole = arguments(tiny_run, tmp_path / "whole", **settings)
    assert run_worker(whole, tmp_path / "whole.json").wait(timeout=600) == 0

    killed = arguments(tiny_run, tmp_path / "killed", **settings)
    worker = run_worker(killed, tmp_path / "killed.json")
    checkpoints = Path(killed["checkpoint_dir"])
    deadline = time.time() + 300
    while not list(checkpoints.glob("step-*.pt")) and time.time() < deadline:
        time.sleep(0.05)
    assert worker.poll() is None, "the run finished before it could be killed"
    # Killed right after its first checkpoint, so between checkpoints and before the end even
    # on an idle machine (a fixed sleep here let a fast run finish first).
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    assert not (Path(killed["out_dir"]) / "model.safetensors").exists()
    resumed_from = max(int(p.stem.split("-")[1]) for p in checkpoints.glob("step-*.pt"))
    assert run_worker(killed, tmp_path / "killed.json").wait(timeout=600) == 0

    expected, got = final_weights(Path(whole["out_dir"])), final_weights(Path(killed["out_dir"]))
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    curve = json.loads((Path(killed["out_dir"]) / "training_curve.json").read_text())
    assert curve["summary"]["resumed_from_step"] == resumed_from > 0
    assert [r["step"] for r in curve["train"]] == list(range(1, curve["summary"]["steps"] + 1))


def test_two_gloo_processes_follow_the_one_process_loss_trajectory(tiny_run, tmp_path):
    settings = {"epochs": 2, "rows_per_step": 4}
    one = arguments(tiny_run, tmp_path / "one", **settings)
    train.launch(one, processes=1)
    two = arguments(tiny_run, tmp_path / "two", **settings)
    env_backup = dict(os.environ)
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        train.launch(two, processes=2)
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    curve_one = json.loads((Path(one["out_dir"]) / "training_curve.json").read_text())
    curve_two = json.loads((Path(two["out_dir"]) / "training_curve.json").read_text())
    assert curve_two["summary"]["processes"] == 2
    losses_one = torch.tensor([r["loss"] for r in curve_one["train"]])
    losses_two = torch.tensor([r["loss"] for r in curve_two["train"]])
    assert len(losses_one) == len(losses_two) > 3
    torch.testing.assert_close(losses_two, losses_one, rtol=1e-4, atol=1e-5)
    assert [r["positions"] for r in curve_one["train"]] == [r["positions"] for r in curve_two["train"]]
    w1, w2 = final_weights(Path(one["out_dir"])), final_weights(Path(two["out_dir"]))
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-3, atol=1e-5, msg=name)


def test_rule_params_hold_exactly_the_settings_that_decide_the_weights():
    import re

    from eaglenest import settings

    rule = (Path(__file__).resolve().parents[1] / "rules" / "train.smk").read_text()
    assert re.search(r"hyper=([\w.]+)\(config\[\"train\"\]\)", rule).group(1) == "settings.train_content"
    # Every content key is a train setting of the schema, and the defaults are the schema's.
    content_keys = {*settings.TRAIN_CONTENT_KEYS, *settings.TRAIN_CONTENT_KEYS_IF_SET}
    assert content_keys <= set(train.DEFAULTS) == set(settings.section_schema("train")["properties"])
    # A key that counts only when set: absent at its default (the runs that never set it keep
    # their fingerprint and params), present otherwise.
    for key in settings.TRAIN_CONTENT_KEYS_IF_SET:
        default = train.DEFAULTS[key]
        changed = default / 2 if default else 512
        assert key not in settings.train_content(train.DEFAULTS)
        assert settings.train_content({**train.DEFAULTS, key: changed})[key] == changed
    assert re.search(r'objective="([^"]+)"', rule).group(1) == OBJECTIVE


@pytest.mark.workflow
def test_workflow_trains_the_drafter_under_torchrun_with_two_gloo_processes(tiny_llama, tmp_path):
    from conftest import run_snakemake, synthetic_conversations, tiny_workflow_config

    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 30)
    configfile = tiny_workflow_config(
        tmp_path, tiny_llama, conversations,
        train={"epochs": 1, "token_budget": 256, "rows_per_step": 2, "ttt_length": 2, "warmup_steps": 1,
               "cpu_processes": 2, "threads": 1, "checkpoint_every": 2},
    )
    summary_path = tmp_path / "results" / "tiny" / "train" / "training_summary.json"
    run_snakemake(tmp_path, configfile, "--cores", "2", str(summary_path.relative_to(tmp_path)))
    summary = json.loads(summary_path.read_text())
    assert summary["processes"] == 2 and len(summary["final_val_acc"]) == 2
    drafter_dir = summary_path.parent / "drafter"
    assert {"model.safetensors", "config.json", "training_curve.json"} <= {p.name for p in drafter_dir.iterdir()}
    assert list((summary_path.parent / "checkpoints").glob("step-*.pt"))
    log = (tmp_path / "logs" / "tiny" / "train.log").read_text()
    assert "torch.distributed.run" in log and "val step" in log


def plain_step_loss(normed, weight, target_logits):
    """The step's loss as autograd computes it from the formula: -sum p log softmax(x W^T)."""
    logits = normed @ weight.T
    return -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum(), logits


@pytest.mark.parametrize("chunk_rows", [1000, 8, 1])
def test_head_soft_cross_entropy_equals_autograd_of_the_plain_formula(chunk_rows):
    """Loss, hits and both gradients (input and head weight) of the fused one-pass loss equal
    autograd's on the plain formula, in float64, whole or in chunks, under an upstream scale
    (the step's weight in the objective)."""
    generator = torch.Generator().manual_seed(3)
    rows, hidden, vocab = 37, 16, 29
    normed = torch.randn(rows, hidden, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.randn(rows, vocab, generator=generator, dtype=torch.float64)
    target_ids = target.argmax(-1)
    plain, logits = plain_step_loss(normed, weight, target)
    expected = torch.autograd.grad(plain * 0.37, (normed, weight))
    fused, hits = draft_loss.head_soft_cross_entropy(normed, weight, target, target_ids, chunk_rows)
    got = torch.autograd.grad(fused * 0.37, (normed, weight))
    assert int(hits) == int((logits.argmax(-1) == target_ids).sum())
    assert fused.dtype == torch.float32  # the loss accumulates in float32
    torch.testing.assert_close(fused, plain.float(), rtol=1e-6, atol=1e-6)
    for fused_grad, plain_grad in zip(got, expected):
        assert fused_grad.dtype == torch.float64
        torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-5, atol=1e-7)  # float32 inside


@pytest.mark.parametrize("chunk_rows", [1000, 8])
def test_row_weights_weigh_each_rows_loss_and_gradient(chunk_rows):
    """train.short_context_weight: the fused loss with row weights r is sum_i r_i CE_i, and its
    gradients (input and head weight) are autograd's of that plain formula; the hits stay a
    count of rows."""
    generator = torch.Generator().manual_seed(4)
    rows, hidden, vocab = 29, 12, 23
    normed = torch.randn(rows, hidden, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.randn(rows, vocab, generator=generator, dtype=torch.float64)
    row_weights = torch.where(torch.rand(rows, generator=generator) < 0.4, 3.0, 1.0).to(torch.float64)
    logits = normed @ weight.T
    per_row = -(torch.softmax(target, -1) * torch.log_softmax(logits, -1)).sum(-1)
    plain = (per_row * row_weights).sum()
    expected = torch.autograd.grad(plain * 0.37, (normed, weight))
    fused, hits = draft_loss.head_soft_cross_entropy(normed, weight, target, target.argmax(-1), chunk_rows,
                                                     row_weights=row_weights)
    got = torch.autograd.grad(fused * 0.37, (normed, weight))
    assert int(hits) == int((logits.argmax(-1) == target.argmax(-1)).sum())
    torch.testing.assert_close(fused, plain.float(), rtol=1e-6, atol=1e-6)
    unweighted, _ = draft_loss.head_soft_cross_entropy(normed, weight, target, target.argmax(-1), chunk_rows)
    assert float(fused) > float(unweighted) * 1.2  # the weights did count
    for fused_grad, plain_grad in zip(got, expected):  # float32 inside, weights of 3 in the sums
        torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-5, atol=1e-6)


def test_short_context_weights_follow_the_predicted_tokens_place_in_its_sample():
    """Step j at t predicts x_{t+2+j}: its weight is the short-context weight while that token has
    fewer than ``tokens`` tokens before it in its own sample (position ids restart per sample)."""
    from eaglenest.training.loop import short_context_weights

    batch = {"position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])}
    positions = [torch.tensor([0, 1, 2, 3, 6, 7]), torch.tensor([0, 1, 2, 6])]
    step0, step1 = short_context_weights(batch, positions, 4, 2.5)
    # step 0: predicted tokens at 2, 3, 4, 5, 8, 9 -> places 2, 3, 4, 5, 2, 3
    assert step0.tolist() == [2.5, 2.5, 1.0, 1.0, 2.5, 2.5]
    # step 1: predicted tokens at 3, 4, 5, 9 -> places 3, 4, 5, 3
    assert step1.tolist() == [2.5, 1.0, 1.0, 2.5] and step1.dtype == torch.float32


def test_train_step_normalises_a_weighted_loss_by_the_summed_weight(tiny_run):
    """train_step with short_context (tokens, weight): each step's CE is divided by its positions'
    summed weight, so one weight for every position changes nothing; a weight on part of them
    changes the update; the logged counts stay the positions."""
    from eaglenest.model import drafter as drafter_lib
    from eaglenest.training import loop

    batch, draft_vocab, _, _ = first_step(tiny_run, ttt_length=3)
    updates, counts = [], []
    for short_context in (None, (10**6, 3.0), (20, 3.0)):
        model = drafter_lib.build_drafter(tiny_run["target_path"], draft_vocab, LAYER_IDS, target_name="tiny-llama", seed=0)
        head = TargetHead(tiny_run["target_path"], draft_vocab["t2d"], torch.device("cpu"), torch.float32)
        objective = TTTObjective(model, 3, attention_backend="dense")
        trainable = [p for p in model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in trainable]
        optimizer = torch.optim.SGD(trainable, lr=1.0)
        _, global_counts, _ = loop.train_step(objective, head, dict(batch), float(batch["tokens"]), [1.0, 0.8, 0.64],
                                              trainable, optimizer, 1e9, torch.autocast("cpu", enabled=False),
                                              short_context=short_context)
        updates.append(torch.cat([(b - p.detach()).flatten() for b, p in zip(before, trainable)]))
        counts.append(global_counts.tolist())
    plain, everywhere, part = updates
    # float32 sums of three times the terms: within 1e-5 of the update's scale
    torch.testing.assert_close(everywhere, plain, rtol=1e-4, atol=1e-5 * float(plain.abs().max()))
    assert float((part - plain).norm()) > 1e-3 * float(plain.norm())
    assert counts[0][:4] == counts[1][:4] == counts[2][:4]  # positions per step, tokens
    assert counts[0][4:] == counts[0][:3] and counts[1][4:] == [3.0 * c for c in counts[0][:3]]


@pytest.mark.integration
def test_compiled_loss_chunk_equals_the_eager_chunk_for_any_row_count():
    """train.compile runs a loss chunk's elementwise part (draft_loss.soft_ce_chunk_per_row: the
    loss, the hits, the gradient in the logits' bf16) compiled, for every row count alike. Compiled here by inductor on the CPU: the same hits, the loss within float32
    rounding, the gradient within one bf16 step."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(draft_loss.soft_ce_chunk_per_row, dynamic=True)
    generator = torch.Generator().manual_seed(5)
    for rows in (13, 40):
        logits = (torch.randn(rows, 300, generator=generator) * 4).to(torch.bfloat16)
        target = (torch.randn(rows, 300, generator=generator) * 4).to(torch.bfloat16)
        target_ids = target.float().argmax(-1)
        target_ids[:3] = logits[:3].float().argmax(-1)  # a few hits at least
        eager = draft_loss.soft_ce_chunk(logits, target, target_ids, True)
        fused = compiled(logits, target, target_ids, True)
        assert int(fused[1]) == int(eager[1]) == int((logits.argmax(-1) == target_ids).sum()) >= 3
        torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=1e-4)
        assert fused[2].dtype == eager[2].dtype == torch.bfloat16
        torch.testing.assert_close(fused[2].float(), eager[2].float(), rtol=8e-3, atol=1e-5)
        no_grad = compiled(logits, target, target_ids, False)
        assert no_grad[2] is None and int(no_grad[1]) == int(eager[1])


def test_head_soft_cross_entropy_keeps_no_logits_and_skips_the_gradient_without_grad():
    """Without a gradient (validation) nothing is kept for a backward pass; a frozen head gets
    no weight gradient while the input still gets its own."""
    normed, weight = torch.randn(5, 4, requires_grad=True), torch.randn(7, 4)
    target = torch.randn(5, 7)
    with torch.no_grad():
        total, _ = draft_loss.head_soft_cross_entropy(normed, weight, target, target.argmax(-1), 2)
    assert total.grad_fn is None
    total, _ = draft_loss.head_soft_cross_entropy(normed, weight, target, target.argmax(-1), 2)
    (grad_input,) = torch.autograd.grad(total, (normed,))
    (plain_grad,) = torch.autograd.grad(plain_step_loss(normed, weight, target)[0], (normed,))
    torch.testing.assert_close(grad_input, plain_grad, rtol=1e-5, atol=1e-6)


def test_device_batches_yield_every_step_once_in_order_whether_or_not_the_step_prefetched():
    """DeviceBatches: a step that prefetches (as train_step does once its backward pass is
    queued) takes the next batch early; a step that does not leaves it to the next iteration.
    Either way every (step, epoch, batch) comes once, in order, with its tokens; a rank's empty
    step (None) passes through; a prefetch past the end ends the iteration."""
    host = [(step, 0, None if step == 2 else {"tokens": torch.tensor(10 + step), "aux_hidden": torch.full((1, 2, 3), step),
                                              "last_hidden": torch.full((1, 2, 1), step)})
            for step in range(5)]
    device_batches = DeviceBatches(iter(host), torch.device("cpu"), torch.float32)
    seen = []
    for n, (step, epoch, batch, tokens) in enumerate(device_batches):
        seen.append((step, None if batch is None else int(batch["aux_hidden"][0, 0, 0]), tokens))
        if n % 2 == 0:  # steps 0, 2 and 4 prefetch; 4's finds the end
            device_batches.prefetch()
            device_batches.prefetch()  # a second call takes nothing more
    assert seen == [(0, 0, 10.0), (1, 1, 11.0), (2, None, 0.0), (3, 3, 13.0), (4, 4, 14.0)]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_device_batches_move_the_loader_s_real_batches_prefetched_or_not(tiny_run, device):
    """The loader's own batches (tensors and the host-side ``samples`` tuple) through
    DeviceBatches, every other step prefetched on the copy stream (on a GPU): each batch
    equals to_device's of the same host batch, and ``samples`` passes through."""
    dataset = batches.open_split(tiny_run["index_path"], tiny_run["split_path"], "train", EXPECT)
    reader = batches.RowReader(dataset)
    steps = batches.epoch_steps(dataset, 64, 2, seed=0, epoch=0)
    host = [(n, 0, reader.batch(rows, pad_to=64, pad_rows=2)) for n, rows in enumerate(steps)]
    assert len(host) >= 3 and all(isinstance(batch["samples"], tuple) for _, _, batch in host)
    device_batches = DeviceBatches(iter(host), torch.device(device), torch.float32)
    for n, (step, _, moved, tokens) in enumerate(device_batches):
        expected = to_device(host[step][2], torch.device(device), torch.float32)
        assert moved.keys() == expected.keys() and moved["samples"] == host[step][2]["samples"]
        for key, value in expected.items():
            if torch.is_tensor(value):
                assert value.device.type == device and torch.equal(moved[key], value), key
        assert tokens == float(host[step][2]["tokens"])
        if n % 2 == 0:
            device_batches.prefetch()
    assert step == len(host) - 1


def test_later_epochs_reading_the_in_draft_cache_train_the_same_weights_as_computing_it(tiny_run, tmp_path, monkeypatch):
    """Three epochs: from the second on every batch's in-draft test comes from InDraftCache
    (the target head runs its draft block only). The weights and the curve equal, bit for bit,
    a run that computes the test at every step."""
    used = []
    lookup = InDraftCache.lookup

    def counted(self, batch):
        known = lookup(self, batch)
        used.append(known is not None)
        return known

    monkeypatch.setattr(InDraftCache, "lookup", counted)
    cached = train.train(**arguments(tiny_run, tmp_path / "cached"))
    assert any(used) and not all(used)  # the first epoch computes, later epochs read
    monkeypatch.setattr(InDraftCache, "lookup", lambda self, batch: None)
    computed = train.train(**arguments(tiny_run, tmp_path / "computed"))
    first = load_file(str(tmp_path / "cached" / "drafter" / "model.safetensors"))
    second = load_file(str(tmp_path / "computed" / "drafter" / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert cached["final_val_acc"] == computed["final_val_acc"]
