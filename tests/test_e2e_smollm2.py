"""End to end on the real embedded default: SmolLM2-135M-Instruct and ShareGPT from their
package wheels, through the real Snakefile (a few dozen conversations, short max_len)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from conftest import DEFAULT_CONFIG, REPO, planned_jobs, run_snakemake
from eaglenest.formats import shards

pytestmark = pytest.mark.workflow



@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("e2e")
    # Share downloaded and converted assets with the demo run in the checkout.
    (REPO / "resources").mkdir(exist_ok=True)
    os.symlink(REPO / "resources", workdir / "resources")
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["run"] = "e2e-smollm2"
    config["data"].update(max_conversations=36, samples_per_shard=12, max_len=192)
    # One thread per job, so that two jobs share the 2 cores: loading the model and decoding
    # one token at a time keep a second thread of the same job mostly idle (~30 s less).
    config["extract"].update(threads=1, disk_reserve_mb=0)
    # Both sets and both settings (a chain and a tree), at 2 prompts of 24 tokens: decoding
    # the real model on the CPU is most of this run.
    config["evaluate"].update(threads=1, num_prompts=2, max_new_tokens=24)
    config["consolidate"]["draft_vocab_size"] = 2048
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run_snakemake(workdir, path, "--cores", "2")
    return workdir, path, config


def test_all_shards_made_and_consolidated(e2e_run):
    workdir, path, config = e2e_run
    results = workdir / "results" / "e2e-smollm2"
    index = json.loads((results / "consolidated" / "index.json").read_text())
    assert index["totals"]["shards"] == 3 and index["layer_ids"] == [2, 15, 27]
    assert 0 < index["totals"]["samples"] <= 36
    for entry in index["shards"]:
        reader = shards.verify_shard(workdir / entry["path"], deep=True)
        assert reader.metadata["target"] == "SmolLM2-135M-Instruct"
        assert reader.metadata["target_hidden_size"] == 576
    assert planned_jobs(workdir, path) == {}


def test_the_truncated_sharegpt_file_yields_every_complete_conversation(e2e_run):
    workdir, _, _ = e2e_run
    report = json.loads((workdir / "results" / "e2e-smollm2" / "data" / "ingest_report.json").read_text())
    note = report["files"][0]
    assert note["records"] == 17671 and note["truncated"] is True
    assert report["kept"] == 36 and report["records_read"] == 17671


def test_stored_states_match_a_direct_forward_of_the_real_model(e2e_run):
    from transformers import AutoModelForCausalLM

    workdir, _, _ = e2e_run
    model = AutoModelForCausalLM.from_pretrained(str(workdir / "resources" / "models" / "SmolLM2-135M-Instruct"), dtype=torch.float32).eval()
    path = next((workdir / "results" / "e2e-smollm2" / "hidden").glob("shard-*.safetensors"))
    tensors = shards.ShardReader.open(path).tensors()
    start, end = int(tensors["offsets"][0]), int(tensors["offsets"][1])
    with torch.no_grad():
        states = model(input_ids=tensors["input_ids"][start:end].long()[None], output_hidden_states=True).hidden_states
    expected_aux = torch.cat([states[i][0] for i in (2, 15, 27)], dim=-1).to(torch.bfloat16)
    torch.testing.assert_close(tensors["aux_hidden"][start:end], expected_aux, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(tensors["last_hidden"][start:end], states[-1][0].to(torch.bfloat16), rtol=2e-2, atol=2e-2)
    # The loss mask marks assistant tokens of the real ChatML template.
    assert 0 < int(tensors["loss_mask"][start:end].sum()) < end - start


def test_demo_drafter_decodes_losslessly_and_reports_tau(e2e_run):
    """The drafter trained by the pipeline, speculative decoding on real SmolLM2 (greedy):
    identical tokens to the target's own greedy decoding on every prompt of both sets."""
    workdir, _, _ = e2e_run
    summary = json.loads((workdir / "results" / "e2e-smollm2" / "evaluate" / "summary.json").read_text())
    assert summary["lossless"] is True
    rows = summary["rows"]
    assert {row["eval_set"] for row in rows} == {"mt_bench", "humaneval"}
    for row in rows:
        assert row["lossless"] is True and row["tau"] >= 1.0
    assert "tau" in summary["headline"]
