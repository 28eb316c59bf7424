"""The CI-sized chaos run: kills at random moments, a full disk during extraction and during
checkpointing, a corrupt shard, a corrupt checkpoint, a faulty SGLang server, bad records.

The full version is `python tests/support/chaos.py --kills 20 --seed 1` (docs/reliability.md);
it adds the other checkpoint damages and server faults.
"""

import os

import pytest

from support import chaos

pytestmark = pytest.mark.workflow


# The two server troubles of a node's bad night: the server dies mid-shard, and after the
# reboot the port holds another server. The slow server and the wrong answer have their own
# tests (tests/test_sglang_protocol.py) and run in the full chaos run.
CI_SERVER_FAULTS = ["server_killed_mid_shard", "server_vllm"]


def test_pipeline_survives_kills_disk_full_corruption_server_faults_and_bad_records(tmp_path):
    # 3 shards (the documented run has 5): a corruption still has untouched shards beside its
    # victim, and every pipeline run of the harness has four extraction jobs fewer. No
    # evaluation stage: 3 kills aim at ingest, extract and train (kill i of N at stage i*7/N),
    # and evaluation is not among the compared products; the documented run kills it too.
    summary = chaos.run_chaos(tmp_path / "chaos", kills=3, seed=3, corruptions=1, bad_record_examples=120,
                              samples_per_shard=14, checkpoint_corruptions=1, server_fault_names=CI_SERVER_FAULTS,
                              evaluate=False)
    table = chaos.format_table(summary)
    assert summary["faults_injected"]["kill"] == 3, table
    assert summary["samples_lost"] == 0, table
    assert summary["corrupt_outputs_consumed"] == 0, table
    assert summary["identical_final_result"], (table, summary["differing_outputs"])
    assert summary["leftovers"] == {"temp_files": [], "locks": []}, table
    assert summary["bad_records"]["all_good_arrived"] and summary["bad_records"]["counts_match"], summary["bad_records"]
    assert summary["bad_records"]["expected_rejected"]["invalid_json"] >= 1, summary["bad_records"]
    for corruption in summary["corruptions"]:
        assert corruption["refused_by_name"] and corruption["rebuilt_only_victim"] and corruption["completed"], corruption
    for disk in summary["disk_full"]:
        assert disk["clear_message"] and disk["partial_files_left"] == 0, disk
        assert disk["completed_after_space"] and disk["identical"], disk

    if os.geteuid() == 0:
        (disk,) = summary["checkpoint_disk_full"]
        assert disk["failed"] and disk["clear_message"], disk
        assert disk["partial_files_left"] == 0 and disk["unverifiable_checkpoints_left"] == [], disk
        assert disk["completed_after_space"] and disk["resumed_from"] == disk["checkpoints_left"][-1], disk
        assert disk["identical"], disk
    (checkpoint,) = summary["checkpoint_corruptions"]
    assert checkpoint["how"] == "flip", checkpoint  # the damage torch.load alone does not notice
    assert checkpoint["refused_by_name"] and not checkpoint["consumed"], checkpoint
    assert checkpoint["resumed_from_newest_intact"] and checkpoint["older_untouched"], checkpoint
    assert checkpoint["rebuilt_intact"] and checkpoint["identical"], checkpoint

    assert [fault["fault"] for fault in summary["server_faults"]] == CI_SERVER_FAULTS
    for fault in summary["server_faults"]:
        assert fault["failed"] and fault["clear_message"], fault
        assert not fault["shard_left"] and fault["partial_files_left"] == 0, fault
        assert fault["completed_after_fix"] and fault["samples_lost"] == 0, fault
        assert fault["bitwise_equal_transformers"] and fault["spool_files_left"] == [], fault
    for kind, row in summary["by_kind"].items():
        assert row["clean_failure"] is not False and row["identical_final_result"], (kind, table)
    assert summary["ok"], table
