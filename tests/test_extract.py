import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglenest import plan
from eaglenest.stages import extract
from eaglenest.formats import shards
from eaglenest.target_model import runtime as target_runtime
from eaglenest.target_model import layer_ids as layer_id_convention


def lengths_and_ids(vocab, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (sum(lengths),), generator=generator, dtype=torch.int32)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return ids, offsets


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_hooks_capture_the_same_tensors_as_output_hidden_states(arch, request):
    model = AutoModelForCausalLM.from_pretrained(str(request.getfixturevalue(arch)), dtype=torch.float32).eval()
    layer_ids = layer_id_convention.default_layer_ids(model.config.num_hidden_layers)
    assert layer_ids == [2, 3, 4]
    layer_ids = [0, 2, 5]  # embeddings, a middle layer, the last decoder layer's input
    lengths = [17, 9, 30, 1]
    ids, offsets = lengths_and_ids(model.config.vocab_size, lengths)
    aux, last = target_runtime.capture_hidden_states(model, ids, lengths, offsets, layer_ids, torch.float32, tokens_per_batch=64)
    for i, n in enumerate(lengths):
        start, end = int(offsets[i]), int(offsets[i + 1])
        with torch.no_grad():
            reference = model(input_ids=ids[start:end].long()[None], output_hidden_states=True).hidden_states
        expected_aux = torch.cat([reference[j][0] for j in layer_ids], dim=-1)
        torch.testing.assert_close(aux[start:end], expected_aux, rtol=1e-5, atol=1e-5)
        # hidden_states[-1] of transformers is the final post-norm state.
        torch.testing.assert_close(last[start:end], reference[-1][0], rtol=1e-5, atol=1e-5)


def test_right_padded_batches_equal_one_sample_at_a_time(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    lengths = [40, 3, 25, 25, 11]
    ids, offsets = lengths_and_ids(model.config.vocab_size, lengths, seed=1)
    batched = target_runtime.capture_hidden_states(model, ids, lengths, offsets, [1, 3, 4], torch.float32, tokens_per_batch=200)
    single = target_runtime.capture_hidden_states(model, ids, lengths, offsets, [1, 3, 4], torch.float32, tokens_per_batch=1)
    for a, b in zip(batched, single):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_length_batches_group_by_length_within_the_token_budget():
    lengths = [5, 100, 7, 90, 6, 95]
    batches = target_runtime.length_batches(lengths, tokens_per_batch=200)
    assert sorted(i for batch in batches for i in batch) == list(range(6))
    assert batches[0] == [1, 5]  # the two longest together: 2 x 100 <= 200
    for batch in batches:
        assert max(lengths[i] for i in batch) * len(batch) <= 200 or len(batch) == 1


def test_layer_ids_outside_the_model_are_refused():
    with pytest.raises(ValueError, match="HF convention"):
        layer_id_convention.resolve([2, 15, 30], 30)
    assert layer_id_convention.resolve("default", 61) == [2, 30, 58]


@pytest.mark.parametrize("ids", [[15, 2, 27], [2, 15, 15]], ids=["unsorted", "repeated"])
def test_unsorted_or_repeated_layer_ids_are_refused_before_any_work(ids, tmp_path):
    """SGLang concatenates captures in layer order: such ids would scramble fc's input silently."""
    with pytest.raises(ValueError, match="sorted and unique"):
        layer_id_convention.resolve(ids, 30)
    config = {"target": {"num_layers": 30}, "extract": {"layer_ids": ids}}
    with pytest.raises(ValueError, match="sorted and unique"):
        plan.layer_ids(config)


def test_extract_shard_writes_a_verified_shard_in_storage_dtype(tmp_path, tiny_llama):
    rows = [{"sample_id": f"s:{i}", "input_ids": list(range(5, 5 + n)), "loss_mask": [1] * n} for i, n in enumerate([12, 4, 9])]
    prepared_path = tmp_path / "prepared" / "shard-00000.safetensors"
    shards.write_prepared_shard(prepared_path, 0, rows, {"target": "tiny"})
    hidden_path = tmp_path / "hidden" / "shard-00000.safetensors"
    stats = extract.extract_shard(prepared_path, hidden_path, tiny_llama, "tiny", "default", dtype="bfloat16", device="cpu")
    reader = shards.verify_shard(hidden_path, expect={"target": "tiny", "layer_ids": [2, 3, 4], "dtype": "bfloat16"})
    tensors = reader.tensors()
    assert tensors["aux_hidden"].dtype == torch.bfloat16 and tensors["aux_hidden"].shape == (25, 3 * 64)
    assert stats["bytes_per_token"] == shards.hidden_bytes_per_token(64, 3, "bfloat16")
    assert stats["tokens"] == 25


def test_extract_refuses_a_model_that_does_not_match_the_config(tmp_path, tiny_llama):
    prepared_path = tmp_path / "prepared" / "shard-00000.safetensors"
    shards.write_prepared_shard(prepared_path, 0, [{"sample_id": "a", "input_ids": [5, 6], "loss_mask": [0, 1]}], {})
    with pytest.raises(ValueError, match="num_layers, hidden_size"):
        extract.extract_shard(prepared_path, tmp_path / "hidden" / "x.safetensors", tiny_llama, "tiny", "default", device="cpu", expected_shape=(30, 576))
