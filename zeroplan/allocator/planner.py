"""The allocator's verdict for one planned request: its step trace (schedule.step_trace)
replayed under the request's PYTORCH_CUDA_ALLOC_CONF (MemoryAssumptions.allocator_conf)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroplan.allocator.capacity import AllocatorVerdict, completes_within, oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.replay import compile_trace, replay
from zeroplan.allocator.schedule import step_trace
from zeroplan.specs.request import PlanRequest

if TYPE_CHECKING:
    from zeroplan.core.model_states import ModelStateBytes
    from zeroplan.core.plan import PeakTerms


def allocator_verdict(request: PlanRequest, states: "ModelStateBytes", terms: "PeakTerms",
                      allocated_peak_bytes: int) -> AllocatorVerdict:
    """Reserved peak and OOM capacity of the request's step under its allocator settings. The
    schedule's tensors can peak below the planner's ``allocated_peak_bytes`` (whose moments
    count the largest unit for every unit); what the allocator needs beyond the schedule's own
    peak is then added to the planner's peak, never taken from it."""
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    verdict = oom_capacity(step_trace(request, states, terms), config)
    shortfall = max(allocated_peak_bytes - verdict.unlimited.requested_peak_bytes, 0)
    if not shortfall:
        return verdict
    return verdict.model_copy(update={"oom_capacity_bytes": verdict.oom_capacity_bytes + shortfall})


def allocator_fits(request: PlanRequest, states: "ModelStateBytes", terms: "PeakTerms", allocated_peak_bytes: int,
                   usable_bytes: int) -> bool:
    """allocator_verdict(...).oom_capacity_bytes <= ``usable_bytes``, in one or two replays
    instead of the whole bisection (the largest-micro-batch search asks only this)."""
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    ops = compile_trace(step_trace(request, states, terms))
    unlimited = replay(ops, config, None)
    shortfall = max(allocated_peak_bytes - unlimited.requested_peak_bytes, 0)
    return completes_within(ops, config, usable_bytes - shortfall, unlimited)
