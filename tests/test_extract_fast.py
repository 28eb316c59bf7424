"""The fast extraction path: packed rows, streamed shard writes, fp8 storage."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglenest import plan
from eaglenest.stages import extract, shard_driver
from eaglenest.formats import shards
from eaglenest.target_model import runtime as target_runtime
from eaglenest.target_model import layer_ids as layer_id_convention
from support import tiny

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [17, 9, 30, 1, 64, 3, 40]


def write_prepared(tmp_path, lengths=LENGTHS, vocab=320, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = [
        {
            "sample_id": f"src:{i}\"é\\",  # quotes, backslash and non-ASCII reach the header
            "input_ids": torch.randint(3, vocab, (n,), generator=generator).tolist(),
            "loss_mask": [i % 2] * n,
        }
        for i, n in enumerate(lengths)
    ]
    path = tmp_path / "prepared" / "shard-00000.safetensors"
    shards.write_prepared_shard(path, 0, rows, {"target": "tiny", "max_len": 128})
    return path


def load(path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3"])
def test_extracted_shard_is_bitwise_equal_to_the_simple_path_in_fp32_on_cpu(tmp_path, tiny_llama, dtype, layout):
    """packed rows stream to disk in token order; padded samples come out of order and are gathered first."""
    prepared_path = write_prepared(tmp_path)
    model = load(tiny_llama)
    extracted = tmp_path / "extracted" / "shard-00000.safetensors"
    stats = extract.extract_shard(prepared_path, extracted, tiny_llama, "tiny", "default", dtype=dtype, tokens_per_batch=70, model=model,
                                  layout=layout)
    assert stats["layout"] == layout and (layout == "padded" or stats["batches"] > 2)

    # The simple driver over the same rows, whole shard in memory, one-shot writer.
    prepared = shards.ShardReader.open(prepared_path)
    tensors = prepared.tensors()
    layer_ids = layer_id_convention.default_layer_ids(model.config.num_hidden_layers)
    aux, last = target_runtime.capture_hidden_states(
        model, tensors["input_ids"], prepared.token_counts, tensors["offsets"], layer_ids, torch.float32, 70, layout=layout
    )
    rows = shard_driver.to_storage(aux, last, dtype, len(layer_ids))
    scales = {n: rows[n] for n in shards.SCALE_TENSORS.values() if n in rows}
    simple = tmp_path / "simple" / "shard-00000.safetensors"
    meta = {"target": "tiny", "target_hidden_size": 64, "layer_ids": layer_ids, "dtype": dtype}
    shards.write_hidden_shard(simple, prepared, rows["aux_hidden"], rows["last_hidden"], meta, **scales)

    assert extracted.read_bytes() == simple.read_bytes()
    shards.verify_shard(extracted, deep=True, expect={"dtype": dtype, "layer_ids": layer_ids})


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_packed_rows_give_the_states_of_one_sample_at_a_time(arch, request, tmp_path):
    model = load(request.getfixturevalue(arch))
    assert target_runtime.resolve_layout(model, "auto") == "packed"
    prepared = shards.ShardReader.open(write_prepared(tmp_path))
    tensors = prepared.tensors()
    args = (model, tensors["input_ids"], prepared.token_counts, tensors["offsets"], [0, 2, 5], torch.float32)
    packed = target_runtime.capture_hidden_states(*args, tokens_per_batch=100, layout="packed")
    single = target_runtime.capture_hidden_states(*args, tokens_per_batch=1, layout="padded")
    for a, b in zip(packed, single):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_reruns_write_identical_files(tmp_path, tiny_llama):
    prepared_path = write_prepared(tmp_path)
    first, second = tmp_path / "a" / "shard-00000.safetensors", tmp_path / "b" / "shard-00000.safetensors"
    for out in (first, second):
        extract.extract_shard(prepared_path, out, tiny_llama, "tiny", "default", device="cpu", tokens_per_batch=50)
    assert first.read_bytes() == second.read_bytes()


def test_packed_batches_are_consecutive_and_within_the_budget():
    lengths = [5, 100, 7, 90, 6, 95, 300]
    batches = target_runtime.packed_batches(lengths, tokens_per_batch=200)
    assert [list(b) for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]  # 300 > budget: alone
    assert target_runtime.packed_batches([], 10) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3"])
def test_streaming_writer_is_byte_identical_to_the_one_shot_writer(tmp_path, dtype):
    prepared = shards.ShardReader.open(write_prepared(tmp_path))
    total, hidden = prepared.num_tokens, 8
    generator = torch.Generator().manual_seed(1)
    aux = torch.randn(total, 3 * hidden, generator=generator) * torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(hidden)
    last = torch.randn(total, hidden, generator=generator)
    rows = shard_driver.to_storage(aux, last, dtype, 3)
    meta = {"target": "t", "target_hidden_size": hidden, "layer_ids": [1, 2, 3], "dtype": dtype}
    scales = {n: rows[n] for n in shards.SCALE_TENSORS.values() if n in rows}
    shards.write_hidden_shard(tmp_path / "one.safetensors", prepared, rows["aux_hidden"], rows["last_hidden"], meta, **scales)
    writer = shards.HiddenShardWriter(tmp_path / "streamed.safetensors", prepared, meta)
    for start, stop in [(0, 1), (1, 60), (60, total)]:
        writer.append_rows({name: tensor[start:stop] for name, tensor in rows.items()})
    writer.close()
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()


def test_fp8_halves_the_bytes_and_readers_get_floats_back(tmp_path, tiny_llama):
    assert shards.hidden_bytes_per_token(576, 3, "float8_e4m3") == plan.bytes_per_token(576, 3, "float8_e4m3") == 2325
    assert shards.hidden_bytes_per_token(576, 3, "float8_e4m3") / shards.hidden_bytes_per_token(576, 3, "bfloat16") < 0.51
    prepared_path = write_prepared(tmp_path)
    model = load(tiny_llama)
    paths = {d: tmp_path / d / "shard-00000.safetensors" for d in ("float32", "float8_e4m3")}
    for dtype, path in paths.items():
        extract.extract_shard(prepared_path, path, tiny_llama, "tiny", "default", dtype=dtype, model=model)
    reference = shards.ShardReader.open(paths["float32"]).hidden_tensors(dtype=torch.float32)
    reader = shards.verify_shard(paths["float8_e4m3"], deep=True)
    assert reader.infos["aux_hidden"]["dtype"] == "F8_E4M3" and reader.infos["aux_hidden_scale"]["shape"] == [reader.num_tokens, 3]
    restored = reader.hidden_tensors(dtype=torch.float32)
    for name in ("aux_hidden", "last_hidden"):
        error = (restored[name] - reference[name]).norm() / reference[name].norm()
        # e4m3 keeps 3 mantissa bits: about 2 % relative error, never much more.
        assert 0.005 < error < 0.04, (name, float(error))
    rows = reader.hidden_tensors(5, 9)
    assert rows["aux_hidden"].shape == (4, 3 * 64) and rows["aux_hidden"].dtype == torch.bfloat16


def test_fp8_quantization_keeps_small_layers_and_zero_rows(tmp_path):
    rows = torch.cat([torch.randn(4, 16) * 1e-3, torch.randn(4, 16) * 1e3], dim=1)
    rows[2] = 0
    quantized, scale = shards.quantize_rows(rows, 2)
    assert scale.shape == (4, 2) and bool((scale > 0).all())
    restored = shards.dequantize_rows(quantized, scale, torch.float32)
    assert torch.equal(restored[2], torch.zeros(32))
    small = (restored[:, :16] - rows[:, :16]).norm() / rows[:, :16].norm()
    assert small < 0.04  # a shared scale would have flushed these to zero


def test_a_cpu_quantises_row_blocks_to_the_same_bytes_as_the_whole_answer():
    torch.manual_seed(0)
    rows = (torch.randn(3 * shards.CPU_QUANTIZE_ROWS + 5, 3 * 16) * torch.tensor([1e-3, 1.0, 1e3]).repeat_interleave(16)).bfloat16()
    blocked, blocked_scale = shards.quantize_rows(rows, 3)
    # The one-pass arithmetic, row by row: what the GPU computes, and the CPU computed before.
    grouped = rows.reshape(rows.shape[0], 3, 16).float()
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / shards.FP8_MAX, torch.ones_like(amax))
    whole = (grouped / scale).clamp_(-shards.FP8_MAX, shards.FP8_MAX).to(torch.float8_e4m3fn).reshape(rows.shape)
    assert torch.equal(blocked.view(torch.uint8), whole.view(torch.uint8))
    assert torch.equal(blocked_scale, scale.reshape(rows.shape[0], 3))


def test_non_finite_states_abort_and_leave_no_file(tmp_path, tiny_llama):
    prepared_path = write_prepared(tmp_path)
    model = load(tiny_llama)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))
    out = tmp_path / "hidden" / "shard-00000.safetensors"
    with pytest.raises(ValueError, match="non-finite"):
        extract.extract_shard(prepared_path, out, tiny_llama, "tiny", "default", model=model)
    assert list(out.parent.iterdir()) == []


def test_sliding_window_models_fall_back_to_padded_rows(tmp_path):
    config = tiny.tiny_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert target_runtime.resolve_layout(model, "auto") == "padded"
    with pytest.raises(ValueError, match="cannot run packed rows"):
        target_runtime.resolve_layout(model, "packed")


def test_varlen_kernel_signature_is_understood():
    kernel = target_runtime._varlen_kernel()
    if kernel is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    function, causal, _ = kernel
    assert callable(function) and causal in ({"is_causal": True}, {"window_size": (-1, 0)})


@pytest.mark.integration
def test_throughput_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "result.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "extract_throughput.py"), "--smoke", "--out", str(out), "--workdir", str(tmp_path / "work")],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    row = result["shapes"][0]
    for key in ("forward_only", "extract_fast", "extract_fast_fp8", "extract_simple", "naive_output_hidden_states"):
        assert row[key]["tokens_per_s"] > 0, key
    assert row["disk_write"]["bytes_per_s"] > 0
    assert row["fp8_reconstruction_error"]["aux_hidden"] < 0.05
    assert row["extract_fast"]["verified"] is True
    assert 0 < row["extract_fast"]["ratio_to_tighter_ceiling"]


def test_disk_preflight_refuses_before_the_target_loads(tmp_path, tiny_llama):
    # The target's config.json without its weights: loading it would fail, the preflight
    # needs only the shape and must refuse first.
    shape_only = tmp_path / "config-only"
    shape_only.mkdir()
    (shape_only / "config.json").write_bytes((tiny_llama / "config.json").read_bytes())
    hidden = tmp_path / "hidden" / "shard-00000.safetensors"
    with pytest.raises(shard_driver.InsufficientDiskError, match="disk preflight: the 1 missing hidden shards"):
        extract.extract_shard(write_prepared(tmp_path), hidden, shape_only, "tiny", "default", device="cpu",
                              disk_reserve_bytes=1 << 60)
    assert list(hidden.parent.iterdir()) == []


def test_a_bad_dtype_is_refused_before_the_target_loads(tmp_path):
    hidden = tmp_path / "hidden" / "shard-00000.safetensors"
    # No target at this path: reading its config first would fail with another error.
    with pytest.raises(ValueError, match=r"extract.dtype 'fp8' is not a storage dtype"):
        extract.extract_shard(write_prepared(tmp_path), hidden, tmp_path / "no-target", "tiny", "default", dtype="fp8", device="cpu")
    assert not hidden.parent.exists()
