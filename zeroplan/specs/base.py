"""The base class of every spec and result: frozen, validated, no unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from zeroplan.errors import ZeroplanError


class Frozen(BaseModel):
    """Immutable pydantic model; a misspelled key is an error that names it."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


def first_error(error: ValidationError, prefix: str = "") -> ZeroplanError:
    """Turn pydantic's multi-line report into one line naming the first bad field."""
    detail = error.errors()[0]
    original = detail.get("ctx", {}).get("error")
    if isinstance(original, ZeroplanError):
        return original
    location = ".".join(str(part) for part in detail["loc"]) or "input"
    field = f"{prefix}.{location}" if prefix else location
    message = detail["msg"]
    if detail["type"] == "extra_forbidden":
        message = "unknown field"
    return ZeroplanError(field, message)
