"""`TrainConfig`: every section's keys as one flat model (the keys a user writes), the checks across sections
(config/rules.py), the run's identity (`hash()`); and `build_config`, which reports every problem of a config in one
error."""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError, model_validator

from meshtune.config.data import TEXT_FORMAT, UNPAIRED_FORMAT, DataKeys
from meshtune.config.launch import LaunchKeys
from meshtune.config.model import ModelKeys
from meshtune.config.optimization import OptimizationKeys
from meshtune.config.output import OutputKeys, WatchKeys
from meshtune.config.parallel import CrossNodeKeys, ParallelismKeys
from meshtune.config.preference import PreferenceKeys
from meshtune.config.rules import first_broken
from meshtune.config.section import MATH
from meshtune.config.speed import SpeedKeys
from meshtune.errors import ConfigError


# pydantic orders inherited fields from the last base to the first: the sections are listed last first, so the keys
# (and `meshtune train --help`) read model and method first. Each section's own checks run in that order too, then
# the rules across sections.
class TrainConfig(WatchKeys, OutputKeys, LaunchKeys, CrossNodeKeys, ParallelismKeys, SpeedKeys, OptimizationKeys,
                  PreferenceKeys, DataKeys, ModelKeys):
    """All keys of `meshtune train`. The field descriptions are the `--help` text."""

    @model_validator(mode="before")
    @classmethod
    def _pretraining_packs(cls, values: Any) -> Any:
        """stage: pt packs unless told not to, as LLaMA-Factory's pre-training does: its pieces are short documents
        and the tails of long ones."""
        if isinstance(values, dict) and values.get("stage") == "pt" and values.get("packing") is None:
            return {**values, "packing": True}
        return values

    @model_validator(mode="after")
    def _check_across_sections(self) -> "TrainConfig":
        message = first_broken(self)
        if message:
            raise ValueError(message)
        return self

    # What `auto` means for the keys whose `auto` is no run decision (those the run plan makes concrete: plan/).
    # The values stay as written: they are the run's identity (`hash()`) and what config.yaml shows.
    @property
    def named_format(self) -> str | None:
        """dataset_format, or None (auto): each file's format is detected from its records; `text` (raw text) for
        stage: pt; `unpaired` (records with a desirability tag, each file's format detected) for stage: kto."""
        if self.stage == "pt":
            return TEXT_FORMAT
        if self.stage == "kto":
            return UNPAIRED_FORMAT
        return None if self.dataset_format == "auto" else self.dataset_format

    @classmethod
    def keys_of_section(cls, title: str) -> list[str]:
        return [name for name, field in cls.model_fields.items() if field.json_schema_extra["section"] == title]

    @classmethod
    def keys_of(cls, *scopes: str) -> list[str]:
        return [name for name, field in cls.model_fields.items() if field.json_schema_extra["scope"] in scopes]

    def math(self) -> dict[str, Any]:
        """The keys of scope `math` (see Section) and their values: what the run computes, kept in checkpoints."""
        return self.model_dump(include=set(self.keys_of(MATH)))

    def hash(self) -> str:
        """Identity of the run's math, nothing about where or how it runs."""
        return math_hash(self.math())

    def write_yaml(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(self.model_dump(), sort_keys=False))


def key_default(key: str) -> Any:
    """A key's default value (None for a key without one, or not of TrainConfig)."""
    field = TrainConfig.model_fields.get(key)
    return None if field is None or field.is_required() else field.get_default(call_default_factory=True)


def math_hash(values: dict[str, Any]) -> str:
    """The hash of a run's math keys and values (`TrainConfig.math()`)."""
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def build_config(values: dict[str, Any], source: str = "config", sources: dict[str, str] | None = None,
                 problems: list[str] | None = None) -> TrainConfig:
    """Validate `values`; every problem of the config in one error, one line each, naming where the key was given
    (`sources[key]`, else `source`): unknown keys with the closest valid key, bad values with what is allowed, and
    `problems` found before (in keys of other tools)."""
    sources = sources or {}
    known = list(TrainConfig.model_fields)
    problems = list(problems or [])
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
            hint = f"; did you mean '{close[0]}'?" if close else "; `meshtune train --help` lists the keys"
            problems.append(f"{sources.get(key, source)}: unknown key '{key}'{hint}")
    try:
        config = TrainConfig(**{key: value for key, value in values.items() if key in known})
    except ValidationError as exc:
        problems += _explain(exc, source, sources)
    if problems:
        raise ConfigError("\n".join(problems))
    return config


def _explain(exc: ValidationError, source: str, sources: dict[str, str]) -> list[str]:
    lines = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        where = sources.get(key, source)
        if err["type"] == "missing":
            lines.append(f"{where}: required key '{key}' is missing ({TrainConfig.model_fields[key].description})")
        elif err["type"] == "value_error" and not key:
            lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
        else:
            hint = ""
            if key in TrainConfig.model_fields:
                hint = f" (allowed: {TrainConfig.model_fields[key].description})"
            lines.append(f"{where}: {key}={err.get('input')!r}: {err['msg'].removeprefix('Value error, ')}{hint}")
    return lines


def describe_keys() -> str:
    """Every key with its default and meaning, by section, for `meshtune train --help`."""
    rows, section = [], None
    for name, field in TrainConfig.model_fields.items():
        if field.json_schema_extra["section"] != section:
            section = field.json_schema_extra["section"]
            rows.append(f"\n{section}:")
        default = "(required)" if field.is_required() else json.dumps(field.default)
        rows.append(f"  {name:<30} {default:<12} {field.description}")
    return "\n".join(rows).lstrip("\n")
