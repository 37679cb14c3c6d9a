"""pydantic's plugin loader for a process in which every plugin is disabled, without the imports
of the discovery it does not run.

pydantic builds each model's validator through plugin/_schema_validator.py
create_schema_validator, which imports plugin/_loader.py for its get_plugins; that module imports
importlib.metadata at its top (for entry_points), and importlib.metadata imports email, zipfile,
csv and their dependencies: 51 M instructions of `zeroplan fit llama-2-70b`'s 971 M (callgrind),
for discovery that get_plugins skips where PYDANTIC_DISABLE_PLUGINS is '__all__', '1' or 'true'
(pydantic 2.14 plugin/_loader.py). Registered in its place (``install``) only there, and only
before pydantic's own module is imported, it answers as pydantic's does there: no plugins."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, MutableMapping
from types import ModuleType
from typing import Any

LOADER = "pydantic.plugin._loader"
"""The module pydantic's create_schema_validator imports get_plugins from."""

DISABLED = ("__all__", "1", "true")
"""PYDANTIC_DISABLE_PLUGINS values with which pydantic's get_plugins loads no plugin at all."""

# Names pydantic's loader module defines, for anything that reads them from this one.
PYDANTIC_ENTRY_POINT_GROUP = "pydantic"
_plugins: dict[str, Any] | None = None
_loading_plugins = False


def get_plugins() -> Iterable[Any]:
    """No plugins: what pydantic's get_plugins returns where every plugin is disabled."""
    return ()


def install(environ: Mapping[str, str], modules: MutableMapping[str, ModuleType] = sys.modules) -> bool:
    """Stand this module in for pydantic's plugin loader where ``environ`` disables every plugin
    and pydantic has not imported its loader yet; True where it did."""
    if environ.get("PYDANTIC_DISABLE_PLUGINS") not in DISABLED or LOADER in modules:
        return False
    modules[LOADER] = sys.modules[__name__]
    return True
