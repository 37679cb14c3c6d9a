"""What every config.json reader (zeroplan.presets.hf_config, zeroplan.presets.hf_families)
needs to read a field: a ModelSpec built without coercion, and a key required in one line."""

from __future__ import annotations

from typing import Any

from zeroplan.errors import ZeroplanError
from zeroplan.specs.model import ModelSpec


def strict_model_spec(**fields: Any) -> ModelSpec:
    """A ModelSpec from config.json's values without coercion: a config's "yes" is no boolean
    and "4096" no width (pydantic's strict mode; enums are built by the readers)."""
    return ModelSpec.model_validate(fields, strict=True)


def require_key(config: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` config.json has (the names a field goes by across model types);
    refused in one line, naming the first, when none is there."""
    for key in keys:
        if key in config:
            return config[key]
    raise ZeroplanError(f"config.{keys[0]}", "missing from config.json")
