"""The allocator's verdict for one planned request: its step trace (schedule.step_trace)
replayed under the request's PYTORCH_CUDA_ALLOC_CONF (MemoryAssumptions.allocator_conf)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroplan.allocator.capacity import AllocatorVerdict, oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.schedule import step_trace
from zeroplan.specs.request import PlanRequest

if TYPE_CHECKING:
    from zeroplan.core.model_states import ModelStateBytes
    from zeroplan.core.plan import PeakTerms


def allocator_verdict(request: PlanRequest, states: "ModelStateBytes", terms: "PeakTerms") -> AllocatorVerdict:
    """Reserved peak and OOM capacity of the request's step under its allocator settings."""
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    return oom_capacity(step_trace(request, states, terms), config)
