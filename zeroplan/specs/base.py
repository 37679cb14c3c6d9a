"""The base class of every spec and result: frozen, validated, no unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from zeroplan.errors import ZeroplanError


class Frozen(BaseModel):
    """Immutable pydantic model; a misspelled key is an error that names it."""

    # The fields' docstrings document the source; pydantic is not asked to read them
    # (use_attribute_docstrings parses every class's source at import: about 50 ms of each
    # command's start, for descriptions nothing reads).
    model_config = ConfigDict(frozen=True, extra="forbid")


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
