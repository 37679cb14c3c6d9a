"""Simulator: real PyTorch FSDP2 / DDP code run on one process with fake tensors and a fake
process group, recording per-rank model-state bytes and every collective.

Like the harness, an independent check of the analytical planner: it imports torch,
``zeroplan.specs``, ``zeroplan.presets`` and ``zeroplan.harness``, never ``zeroplan.core``.

The names below are imported when first used (PEP 562), not with the package: ``python -m
zeroplan.simulate`` and ``zeroplan simulate`` import this package before their argument parser
runs, and a command line the parser refuses is answered without loading torch (about 4 s).
"""

from __future__ import annotations

from zeroplan import lazy_exports

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
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
