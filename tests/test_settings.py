"""One source per fact: every default in config/schema.yaml, unknown keys refused everywhere,
planning without torch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from conftest import DEFAULT_CONFIG, REPO
from eaglenest import layout, settings
from eaglenest.stages import eval_sets, regenerate
from eaglenest.sglang import launch as sglang_launch, patch as sglang_patch


def schema_defaults(*path):
    return {key: sub["default"] for key, sub in settings.section_schema(*path)["properties"].items() if "default" in sub}


def test_code_reads_its_defaults_from_the_schema():
    from eaglenest.stages import train

    assert train.DEFAULTS == schema_defaults("train")
    assert train.DEFAULTS["token_budget"] == 8192 and train.DEFAULTS["lr"] == 1e-4
    assert vars(regenerate.Settings.from_config({})) == schema_defaults("regenerate")
    assert sglang_launch.sglang_settings({}) == schema_defaults("extract", "sglang")
    assert sglang_patch.DEFAULT_SPOOL_DIR == schema_defaults("extract", "sglang")["spool_dir"]


@pytest.mark.parametrize("section", ["train", "regenerate", "sglang"])
def test_an_unknown_key_raises_in_every_section(section):
    with pytest.raises(ValueError, match="backof_s"):
        if section == "train":
            settings.section({"backof_s": 1}, "train")
        elif section == "regenerate":
            regenerate.Settings.from_config({"backof_s": 1})
        else:
            sglang_launch.sglang_settings({"extract": {"sglang": {"backof_s": 1}}})


def test_a_bad_value_names_the_key():
    with pytest.raises(ValueError, match=r"train\.lr"):
        settings.section({"lr": -1}, "train")


@pytest.mark.integration
def test_the_layout_names_the_paths_the_rules_use():
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    paths = layout.RunLayout(config)
    assert paths.hidden_shard("00007") == f"results/{config['run']}/hidden/shard-00007.safetensors"
    assert paths.benchmark_path("train.tsv") == f"logs/{config['run']}/benchmarks/train.tsv"
    assert layout.stage_of(f"results/{config['run']}/consolidated/index.json") == "consolidate"
    assert layout.stage_of("logs/x/train.log") is None


@pytest.mark.integration
def test_planning_a_run_imports_no_torch(tmp_path):
    """snakemake -n of the default config with torch made unimportable."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from snakemake.cli import main\n"
        f"sys.argv = ['snakemake', '-n', '--snakefile', {str(REPO / 'Snakefile')!r}, '--directory', {str(tmp_path)!r},"
        f" '--configfile', {str(DEFAULT_CONFIG)!r}, '--quiet', 'rules']\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "eaglenest plan for run" in result.stderr


def test_the_demo_configs_commented_eval_set_entries_are_valid():
    """config/config.yaml shows user eval sets as comments: uncommented, they must validate."""
    text = DEFAULT_CONFIG.read_text()
    examples = [yaml.safe_load(line)[0] for line in re.findall(r"^\s*# (- \{name: .*\})$", text, re.M)]
    assert [sorted(entry) for entry in examples] == [["name", "path"], ["name", "seed", "split"]]
    config = yaml.safe_load(text)
    config["evaluate"]["sets"] += examples
    assert settings.validate_with_defaults(config) == []
    assert eval_sets.set_names(config["evaluate"]["sets"])[2:] == [entry["name"] for entry in examples]


@pytest.mark.parametrize("overlay", sorted(p.name for p in (REPO / "config" / "h200").glob("*.yaml")))
def test_every_recorded_runs_overlay_is_a_valid_config(overlay):
    """config/h200/: each run's overlay, on the base its header names, passes the schema."""
    from eaglenest.node.recon.config import load_config

    stack = ["config/h200-smollm2.yaml", "config/h200/carried-data.yaml"]
    if overlay.startswith("own-answers"):  # on the regenerated set
        stack += ["config/h200/regenerated-sampled-server.yaml", "config/h200/own-answers.yaml"]
    if overlay.startswith("regenerated") and overlay != "regenerated-sampled-server.yaml":  # the 1K arms
        stack += ["config/h200/subset-1k.yaml"]
    config = load_config(REPO, [*stack, f"config/h200/{overlay}"])
    assert config["run"] and config["target"]["name"] == "SmolLM2-135M-Instruct"
