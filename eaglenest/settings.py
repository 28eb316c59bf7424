"""The config schema (config/schema.yaml) as the one source of every default.

The workflow validates its config against the schema when it loads (rules/common.smk), which
fills in every default. Code that runs outside Snakemake — the SGLang launcher, a training
worker, a test calling a stage directly — completes a partial section here, from the same
schema: a default is written down once, and an unknown key raises everywhere.

Torch-free: the planner and the launcher use it.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

# config/schema.yaml, reached through the package's link to it, so that an installed wheel
# (which copies the file in) reads the same schema as a source checkout.
SCHEMA_PATH = Path(__file__).resolve().parent / "config_schema.yaml"

# train keys that decide the weights a run ends with: the checkpoint fingerprint
# (eaglenest.stages.train.fingerprint) and the params of rule train_drafter (its rerun trigger). The other train
# keys only change speed and bookkeeping (and where the job runs).
TRAIN_CONTENT_KEYS = (
    "ttt_length", "decay", "epochs", "token_budget", "rows_per_step", "lr", "min_lr_ratio",
    "warmup_steps", "weight_decay", "max_grad_norm", "seed", "init_head_from_target", "init_from", "drafter",
)
# train keys that decide the weights too but count only when not at their schema default, so that
# adding one leaves the fingerprint and the rerun trigger of every run that does not set it as they were.
TRAIN_CONTENT_KEYS_IF_SET = ("target_temperature", "short_context_tokens", "short_context_weight")


def train_content(train: dict) -> dict:
    """The train settings that decide the weights (the fingerprint's and the rule's params)."""
    content = {key: train[key] for key in TRAIN_CONTENT_KEYS}
    schema_defaults = section_schema("train")["properties"]
    content.update({key: train[key] for key in TRAIN_CONTENT_KEYS_IF_SET
                    if key in train and train[key] != schema_defaults[key]["default"]})
    return content


# train keys that the workflow reads to place the job, not the trainer.
TRAIN_PLACEMENT_KEYS = ("gpus", "cpu_processes")


@functools.cache
def schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def section_schema(*path: str) -> dict:
    """The schema of config[path[0]][path[1]]..., e.g. section_schema("extract", "sglang")."""
    node = schema()
    for key in path:
        node = node["properties"][key]
    return node


def _defaulting_validator(node: dict):
    """A validator of ``node`` that fills in defaults as it descends, as Snakemake's
    ``validate(config, schema=...)`` does (nested objects and array items included)."""
    from jsonschema import Draft202012Validator, validators

    check_properties = Draft202012Validator.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, subschema):
        for name, property_schema in properties.items():
            if isinstance(instance, dict) and "default" in property_schema:
                instance.setdefault(name, copy.deepcopy(property_schema["default"]))
        yield from check_properties(validator, properties, instance, subschema)

    return validators.extend(Draft202012Validator, {"properties": set_defaults})(node)


def validate_with_defaults(instance: dict, node: dict | None = None) -> list:
    """Fill the defaults of ``node`` (the whole schema by default) into ``instance`` in place;
    the validation errors, sorted by where they are (empty when valid)."""
    validator = _defaulting_validator(schema() if node is None else node)
    return sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))


def defaults(*path: str) -> dict:
    """Every default of one config section (e.g. defaults("train"))."""
    instance: dict = {}
    validate_with_defaults(instance, _partial(section_schema(*path)))
    return instance


def _partial(node: dict) -> dict:
    # A section given in part is fine: its missing keys get defaults or stay absent.
    return {k: v for k, v in node.items() if k != "required"}


def section(given: dict | None, *path: str) -> dict:
    """``given`` (a whole or partial config section) checked against the schema and completed
    with its defaults; an unknown key or a bad value raises ValueError naming the section."""
    return checked(given, _partial(section_schema(*path)), ".".join(path))


def checked(given: dict | None, node: dict, name: str) -> dict:
    """``given`` checked against the schema ``node`` and completed with its defaults; an unknown
    key, a missing required one or a bad value raises ValueError naming ``name``."""
    instance = copy.deepcopy(dict(given or {}))
    errors = validate_with_defaults(instance, node)
    if errors:
        problems = "; ".join(f"{'.'.join(map(str, [name, *error.absolute_path]))}: {error.message}" for error in errors)
        raise ValueError(f"bad {name} settings: {problems} (config/schema.yaml)")
    return instance
