"""The shard client against a real HTTP server on 127.0.0.1: the stand-in patched server.

Each test starts the stand-in server (tests/support/standin_server.py) as its own process (a tiny random-weight
Llama computed with transformers), so crashes are real process deaths and every
request crosses a real socket.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eaglenest.stages import extract, shard_driver
from eaglenest.formats import shards
from eaglenest.sglang import client as sglang_client, patch as sglang_patch
from support import STANDIN_SERVER

TARGET = "tiny-llama"
LAYERS = [2, 3, 4]
HIDDEN = 64


def start_standin(tmp_path: Path, model: Path, *extra: str, target: str = TARGET, layers=LAYERS) -> tuple[subprocess.Popen, str, Path]:
    spool = tmp_path / "spool"
    ready = tmp_path / f"ready-{len(list(tmp_path.glob('ready-*')))}.json"
    command = [
        sys.executable, str(STANDIN_SERVER), "--model", str(model), "--target", target,
        "--layer-ids", *map(str, layers), "--spool-dir", str(spool), "--port", "0", "--ready-file", str(ready), *extra,
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if process.poll() is not None:
            raise AssertionError(f"stand-in server exited: {process.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("stand-in server did not start in 120 s")
        time.sleep(0.1)
    return process, json.loads(ready.read_text())["url"], spool


@pytest.fixture
def standin(tmp_path, tiny_llama):
    started = []

    def start(*extra, **kwargs):
        process, url, spool = start_standin(tmp_path, tiny_llama, *extra, **kwargs)
        started.append(process)
        return process, url, spool

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


@pytest.fixture
def prepared_shard(tmp_path) -> Path:
    """A prepared shard of 6 samples with random token ids of varied lengths."""
    rng = random.Random(0)
    samples = []
    for i in range(6):
        n = rng.randint(5, 90)
        samples.append({
            "sample_id": f"synthetic/{i}",
            "input_ids": [rng.randrange(3, 300) for _ in range(n)],
            "loss_mask": [rng.randint(0, 1) for _ in range(n)],
        })
    path = tmp_path / "prepared" / shards.shard_name(0)
    path.parent.mkdir()
    shards.write_prepared_shard(path, 0, samples, {"target": TARGET})
    return path


def client_kwargs(spool: Path, **overrides) -> dict:
    kwargs = dict(
        target_name=TARGET, layer_ids=LAYERS, hidden_size=HIDDEN, num_layers=7, dtype="bfloat16",
        spool_dir=str(spool), concurrency=3, samples_per_request=2, request_timeout_s=60, retries=1, backoff_s=0.05,
        max_consecutive_failures=3, check_disk=False,
    )
    kwargs.update(overrides)
    return kwargs


def assert_no_shard_left(hidden_dir: Path) -> None:
    assert not list(hidden_dir.glob("shard-*")), list(hidden_dir.iterdir())


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3"])
def test_standin_shard_equals_transformers_backend_bitwise(standin, prepared_shard, tmp_path, tiny_llama, dtype):
    """fp8 included: the client quantises each answer's rows as the transformers backend does."""
    _, url, spool = standin()
    via_server = tmp_path / "hidden-sglang" / shards.shard_name(0)
    stats = sglang_client.extract_shard_via_server(prepared_shard, via_server, url, **client_kwargs(spool, dtype=dtype))
    assert stats["samples"] == 6
    direct = tmp_path / "hidden-transformers" / shards.shard_name(0)
    # One sample per forward on both sides: padding a sample into a longer batch changes
    # the fp32 GEMM blocking and so the last bits (measured: up to 2.6e-8), not the contract.
    extract.extract_shard(prepared_shard, direct, tiny_llama, TARGET, LAYERS, dtype=dtype, device="cpu", check_disk=False,
                          tokens_per_batch=1)

    expect = {"kind": "hidden", "target": TARGET, "layer_ids": LAYERS, "dtype": dtype}
    server_shard = shards.verify_shard(via_server, deep=True, expect=expect).tensors()
    direct_shard = shards.verify_shard(direct, deep=True, expect=expect).tensors()
    names = shards.HIDDEN_TENSORS + (tuple(shards.SCALE_TENSORS.values()) if dtype == shards.FP8_DTYPE else ())
    assert set(server_shard) == set(direct_shard) == set(names)
    for name in names:
        assert torch.equal(server_shard[name].view(torch.uint8), direct_shard[name].view(torch.uint8)), name
    assert list(spool.iterdir()) == []  # every spool file was consumed


@pytest.mark.integration
def test_rows_quantised_in_the_server_make_the_same_fp8_shard_as_the_client_does(standin, prepared_shard, tmp_path):
    """A server started for an fp8 run (capture settings' storage_dtype) quantises the rows
    before their copy to the host (patch.quantized_rows, the function SGLang 0.5.14's patch
    calls on the GPU); the client splits them: the shard is the client-quantised one, byte
    for byte. A bf16 run refuses such a server with the reason."""
    _, url, spool = standin()
    client_side = tmp_path / "client-quantised" / shards.shard_name(0)
    sglang_client.extract_shard_via_server(prepared_shard, client_side, url, **client_kwargs(spool, dtype=shards.FP8_DTYPE))
    _, url, spool = standin("--storage-dtype", "float8_e4m3")
    assert sglang_client.identify_server(url)["storage_dtype"] == "float8_e4m3"
    server_side = tmp_path / "server-quantised" / shards.shard_name(0)
    sglang_client.extract_shard_via_server(prepared_shard, server_side, url, **client_kwargs(spool, dtype=shards.FP8_DTYPE))
    expect = {"kind": "hidden", "dtype": shards.FP8_DTYPE}
    client_tensors = shards.verify_shard(client_side, deep=True, expect=expect).tensors()
    server_tensors = shards.verify_shard(server_side, deep=True, expect=expect).tensors()
    assert set(server_tensors) == set(client_tensors)
    for name in client_tensors:
        assert torch.equal(server_tensors[name].view(torch.uint8), client_tensors[name].view(torch.uint8)), name
    bf16 = tmp_path / "bf16" / shards.shard_name(0)
    with pytest.raises(sglang_client.SglangServerError, match="quantised sample .* to fp8; this run stores bfloat16"):
        sglang_client.extract_shard_via_server(prepared_shard, bf16, url, **client_kwargs(spool))
    assert_no_shard_left(bf16.parent)


def test_a_non_finite_row_quantised_in_the_server_stays_visible_to_the_client():
    import math

    rows = torch.randn(3, 4 * 8)
    rows[1, 5] = math.nan
    rows[2, 30] = math.inf
    stored = sglang_patch.split_quantized_rows(sglang_patch.quantized_rows(rows, 8), hidden_size=8, num_aux_layers=3)
    assert stored["aux_hidden"].shape == (3, 24) and stored["last_hidden_scale"].shape == (3, 1)
    # An infinity shows in its row's scale, a NaN as a NaN byte; the other rows stay clean.
    assert not torch.isfinite(stored["last_hidden_scale"][2]).all() and torch.isfinite(stored["aux_hidden_scale"]).all()
    assert not shards.all_finite(stored["aux_hidden"][1:2]) and shards.all_finite(stored["aux_hidden"][0:1])
    assert sglang_patch.FP8_STORAGE == shards.FP8_DTYPE


@pytest.mark.integration
def test_standin_fp8_shard_holds_the_transformers_states_quantised_per_token_and_layer(standin, prepared_shard, tmp_path, tiny_llama):
    """Independent of both backends' storage code: the server's fp8 shard is quantize_rows of
    the float32 states the transformers backend stores, so a cast without quantising fails."""
    _, url, spool = standin()
    fp8 = tmp_path / "hidden-sglang" / shards.shard_name(0)
    sglang_client.extract_shard_via_server(prepared_shard, fp8, url, **client_kwargs(spool, dtype=shards.FP8_DTYPE))
    full = tmp_path / "hidden-float32" / shards.shard_name(0)
    extract.extract_shard(prepared_shard, full, tiny_llama, TARGET, LAYERS, dtype="float32", device="cpu", check_disk=False,
                          tokens_per_batch=1)

    reader = shards.verify_shard(fp8, deep=True, expect={"dtype": shards.FP8_DTYPE})
    assert reader.infos["aux_hidden"]["dtype"] == "F8_E4M3" and reader.infos["aux_hidden_scale"]["shape"] == [reader.num_tokens, 3]
    stored, states = reader.tensors(), shards.ShardReader.open(full).tensors()
    for name, groups in (("aux_hidden", len(LAYERS)), ("last_hidden", 1)):
        quantized, scale = shards.quantize_rows(states[name], groups)
        assert torch.equal(stored[name].view(torch.uint8), quantized.view(torch.uint8)), name
        assert torch.equal(stored[shards.SCALE_TENSORS[name]], scale), name


@pytest.mark.integration
@pytest.mark.parametrize("check_disk", [True, False], ids=["with-preflight", "without-preflight"])
def test_a_bad_dtype_is_refused_before_any_request_is_served(standin, prepared_shard, tmp_path, check_disk):
    # --exit-after 0: the server dies on the first /generate it receives.
    process, url, spool = standin("--exit-after", "0")
    hidden = tmp_path / "hidden" / shards.shard_name(0)
    with pytest.raises(ValueError, match=r"extract.dtype 'bf16' is not a storage dtype; choose one of \[.*'float8_e4m3'"):
        sglang_client.extract_shard_via_server(prepared_shard, hidden, url, **client_kwargs(spool, dtype="bf16", check_disk=check_disk))
    assert process.poll() is None  # still up: no request reached it
    assert_no_shard_left(hidden.parent)


@pytest.mark.integration
def test_client_refuses_a_vllm_server_on_the_port(standin, prepared_shard, tmp_path):
    _, url, spool = standin("--impersonate", "vllm")
    hidden = tmp_path / "hidden" / shards.shard_name(0)
    with pytest.raises(sglang_client.SglangServerError, match=r"vLLM OpenAI server serving \['tiny-llama'\]"):
        sglang_client.extract_shard_via_server(prepared_shard, hidden, url, **client_kwargs(spool))
    assert_no_shard_left(hidden.parent)


@pytest.mark.integration
def test_client_refuses_an_sglang_server_without_the_patch(standin, prepared_shard, tmp_path):
    _, url, spool = standin("--impersonate", "sglang")
    with pytest.raises(sglang_client.SglangServerError, match="SGLang server without the eaglenest patch"):
        sglang_client.extract_shard_via_server(prepared_shard, tmp_path / "hidden" / "shard-00000.safetensors", url, **client_kwargs(spool))


@pytest.mark.integration
def test_client_refuses_a_patched_server_with_other_layers_or_target(standin, prepared_shard, tmp_path):
    _, url, spool = standin(layers=[1, 3, 4])
    with pytest.raises(sglang_client.SglangServerError, match=r"layer_ids: server has \[1, 3, 4\], config wants \[2, 3, 4\]"):
        sglang_client.check_server(url, TARGET, LAYERS, HIDDEN)
    with pytest.raises(sglang_client.SglangServerError, match="target: server has 'tiny-llama', config wants 'Kimi-K2.5'"):
        sglang_client.check_server(url, "Kimi-K2.5", [1, 3, 4], HIDDEN)


@pytest.mark.integration
def test_client_refuses_a_server_started_to_generate(standin, prepared_shard, tmp_path):
    _, url, spool = standin("--mode", "serve")
    hidden = tmp_path / "hidden" / shards.shard_name(0)
    with pytest.raises(sglang_client.SglangServerError, match=r"mode: server has 'serve', config wants 'capture'"):
        sglang_client.extract_shard_via_server(prepared_shard, hidden, url, **client_kwargs(spool))
    assert_no_shard_left(hidden.parent)


def test_client_names_the_url_when_no_server_listens(prepared_shard, tmp_path):
    with pytest.raises(sglang_client.SglangServerError, match=r"no server answers at http://127.0.0.1:9"):
        sglang_client.check_server("http://127.0.0.1:9", TARGET, LAYERS, HIDDEN)


@pytest.mark.integration
def test_server_dying_mid_shard_fails_cleanly_without_partial_shard(standin, prepared_shard, tmp_path):
    process, url, spool = standin("--exit-after", "3")
    hidden = tmp_path / "hidden" / shards.shard_name(0)
    with pytest.raises(sglang_client.SglangServerError, match=rf"SGLang server at {url} failed 3 requests in a row"):
        sglang_client.extract_shard_via_server(prepared_shard, hidden, url, **client_kwargs(spool, concurrency=1, retries=5,
                                                                                                     samples_per_request=1))
    assert process.wait(timeout=10) == 3  # it really died
    assert_no_shard_left(hidden.parent)
    assert list(hidden.parent.iterdir()) == []  # no temp file either
    assert list(spool.iterdir()) == []  # the 3 answered samples' spool files were consumed


@pytest.mark.integration
def test_slow_server_times_out_with_a_clear_error(standin, prepared_shard, tmp_path):
    _, url, spool = standin("--delay-s", "3")
    hidden = tmp_path / "hidden" / shards.shard_name(0)
    with pytest.raises(sglang_client.SglangServerError, match=r"timed out"):
        sglang_client.extract_shard_via_server(
            prepared_shard, hidden, url, **client_kwargs(spool, request_timeout_s=0.5, concurrency=2, max_consecutive_failures=2)
        )
    assert_no_shard_left(hidden.parent)


@pytest.mark.integration
def test_shape_mismatch_from_the_server_is_refused(standin, prepared_shard, tmp_path):
    _, url, spool = standin("--drop-rows", "2")
    hidden = tmp_path / "hidden" / shards.shard_name(0)
    with pytest.raises(sglang_client.SglangServerError, match=r"returned .* for sample \d+ of \d+ tokens; expected aux \(\d+, 192\) and last \(\d+, 64\)"):
        sglang_client.extract_shard_via_server(prepared_shard, hidden, url, **client_kwargs(spool))
    assert_no_shard_left(hidden.parent)
    assert list(spool.iterdir()) == []


def test_disk_preflight_refuses_before_the_server_is_asked(prepared_shard, tmp_path):
    # No server listens at the URL: a client asking it first would fail with "no server answers".
    hidden = tmp_path / "hidden" / shards.shard_name(0)
    with pytest.raises(shard_driver.InsufficientDiskError, match="disk preflight"):
        sglang_client.extract_shard_via_server(
            prepared_shard, hidden, url="http://127.0.0.1:9",
            **client_kwargs(tmp_path / "spool", check_disk=True, disk_reserve_bytes=1 << 60),
        )
    assert_no_shard_left(hidden.parent)
