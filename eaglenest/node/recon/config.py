"""The workflow's config as Snakemake builds it: config/config.yaml, overlays, schema defaults."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable
import yaml

from eaglenest import plan, settings
from eaglenest.node.recon.status import ReconError, REPO


def _update_config(config: dict, overwrite: dict) -> None:
    """Snakemake's update_config: nested dicts merge, everything else is replaced."""
    for key, value in overwrite.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _update_config(config[key], value)
        else:
            config[key] = value


def _validate_with_defaults(config: dict, schema: dict) -> None:
    """Validate like the workflow's ``validate(config, schema=...)``: defaults filled in."""
    errors = settings.validate_with_defaults(config, schema)
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(top level)"
        raise ReconError(f"config invalid at {where}: {errors[0].message}")


def load_config(workdir: str | os.PathLike = ".", configfiles: Iterable[str] = (), repo: Path = REPO) -> dict:
    """The config exactly as the Snakefile sees it.

    ``configfile: "config/config.yaml"`` is read relative to the working directory,
    ``--configfile`` files update it (nested dicts merge), and rules/common.smk
    validates against the repository's config/schema.yaml with defaults filled in.
    """
    workdir = Path(workdir)
    config: dict = {}
    base = workdir / "config" / "config.yaml"
    configfiles = list(configfiles)
    if base.exists():
        _update_config(config, yaml.safe_load(base.read_text()) or {})
    elif not configfiles:
        raise ReconError(f"no config: {base} does not exist and no --configfile was given")
    for path in configfiles:
        path = Path(path)
        if not path.is_absolute() and not path.exists():
            path = workdir / path
        if not path.exists():
            raise ReconError(f"--configfile {path} does not exist")
        try:
            override = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ReconError(f"--configfile {path} is not valid YAML: {err}") from None
        if not isinstance(override, dict):
            raise ReconError(f"--configfile {path} must hold a mapping, not {type(override).__name__}")
        _update_config(config, override)
    checkout_schema = repo / "config" / "schema.yaml"  # the one the checkout's Snakefile validates with
    _validate_with_defaults(config, yaml.safe_load(checkout_schema.read_text()) if checkout_schema.exists() else settings.schema())
    try:
        plan.layer_ids(config)
    except ValueError as err:
        raise ReconError(str(err)) from None
    return config
