"""The CI-sized chaos run: kills at random moments, a full disk, a corrupt shard, bad records.

The 20-kill version is `python -m eaglenest.chaos --kills 20 --seed 1` (docs/reliability.md).
"""

import pytest

from eaglenest import chaos

pytestmark = pytest.mark.slow


def test_pipeline_survives_kills_disk_full_corruption_and_bad_records(tmp_path):
    summary = chaos.run_chaos(tmp_path / "chaos", kills=3, seed=3, corruptions=1, bad_record_examples=120)
    table = chaos.format_table(summary)
    assert summary["faults_injected"]["kill"] == 3, table
    assert summary["samples_lost"] == 0, table
    assert summary["corrupt_outputs_consumed"] == 0, table
    assert summary["identical_final_result"], (table, summary["differing_outputs"])
    assert summary["leftovers"] == {"temp_files": [], "locks": []}, table
    assert summary["bad_records"]["all_good_arrived"] and summary["bad_records"]["counts_match"], summary["bad_records"]
    for corruption in summary["corruptions"]:
        assert corruption["refused_by_name"] and corruption["rebuilt_only_victim"] and corruption["completed"], corruption
    for disk in summary["disk_full"]:
        assert disk["clear_message"] and disk["partial_files_left"] == 0, disk
        assert disk["completed_after_space"] and disk["identical"], disk
    assert summary["ok"], table
