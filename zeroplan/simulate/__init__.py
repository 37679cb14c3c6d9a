"""Simulator: real PyTorch FSDP2 / DDP code run on one process with fake tensors and a fake
process group, recording per-rank model-state bytes and every collective.

Like the harness, an independent check of the analytical planner: it imports torch,
``zeroplan.specs``, ``zeroplan.presets`` and ``zeroplan.harness``, never ``zeroplan.core``.
"""

from zeroplan.simulate.record import (
    CollectiveKind,
    CollectiveRecord,
    ModelStateBytes,
    Phase,
    SimulationRecord,
)
from zeroplan.simulate.run import simulate, simulate_request

__all__ = [
    "CollectiveKind",
    "CollectiveRecord",
    "ModelStateBytes",
    "Phase",
    "SimulationRecord",
    "simulate",
    "simulate_request",
]
