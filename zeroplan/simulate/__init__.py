"""Simulator: real PyTorch FSDP2 / DDP code run on one process with fake tensors and a fake
process group, recording per-rank model-state bytes and every collective.

Like the harness, an independent check of the analytical planner: it imports torch,
``zeroplan.specs``, ``zeroplan.presets`` and ``zeroplan.harness``, never ``zeroplan.core``.

The names below are imported when first used (PEP 562), not with the package: ``python -m
zeroplan.simulate`` and ``zeroplan simulate`` import this package before their argument parser
runs, and a command line the parser refuses is answered without loading torch (about 4 s).
"""

from __future__ import annotations

from importlib import import_module

_WHERE = {
    "CollectiveKind": "zeroplan.simulate.record",
    "CollectiveRecord": "zeroplan.simulate.record",
    "ModelStateBytes": "zeroplan.simulate.record",
    "Phase": "zeroplan.simulate.record",
    "SimulationRecord": "zeroplan.simulate.record",
    "simulate": "zeroplan.simulate.run",
    "simulate_request": "zeroplan.simulate.run",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'zeroplan.simulate' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
