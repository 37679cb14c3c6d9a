"""zeroplan: will it fit, with which sharding, and what will it cost in communication?

The planner's public API, loaded lazily so that importing ``zeroplan.specs`` (as the
measurement harness does) never loads the planner's formulas. Nothing here imports torch.
"""

from __future__ import annotations

import importlib

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


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zeroplan' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
