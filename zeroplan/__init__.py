"""zeroplan: will it fit, with which sharding, and what will it cost in communication?

The planner's public API, loaded lazily so that importing ``zeroplan.specs`` (as the
measurement harness does) never loads the planner's formulas. Nothing here imports torch.
"""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, where: dict[str, str]):
    """A package's PEP 562 ``__getattr__`` and ``__dir__``: each name of ``where`` imported from its module when first used."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__


_EXPORTS = {
    "fit": "zeroplan.core.plan",
    "plan": "zeroplan.core.plan",
    "get_gpu": "zeroplan.presets.gpus",
    "get_model": "zeroplan.presets.models",
    "FitReport": "zeroplan.answers",
    "MemoryBreakdown": "zeroplan.results",
    "StrategyPlan": "zeroplan.results",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
