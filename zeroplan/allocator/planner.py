"""The allocator's verdict for one planned request: its step trace (schedule.step_ops)
replayed under the request's PYTORCH_CUDA_ALLOC_CONF (MemoryAssumptions.allocator_conf), at
the GPU's usable memory."""

from __future__ import annotations

import contextlib
import gc

from zeroplan.allocator.capacity import (
    CAPACITY_STEP_BYTES, PlannedVerdict, bisect_capacity, capacity_bracket, completes_within,
)
from zeroplan.allocator.config import AllocatorConfig, parse_alloc_conf
from zeroplan.allocator.replay import Ops, ReplayResult, replay
from zeroplan.allocator.schedule import step_ops
from zeroplan.specs.request import PlanRequest
from zeroplan.core.model_states import ModelStateBytes
from zeroplan.core.peak import PeakTerms



@contextlib.contextmanager
def _without_cyclic_gc():
    """Python's cyclic garbage collector paused while a step is traced and replayed: the trace's
    tens of thousands of events and the allocator's linked blocks set off full collections
    that cost as much as the replay itself (70B FSDP2: compile_trace 19 ms with it, 4 ms
    without); what the replay leaves is freed when the collector runs again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _replayed(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms, allocated_peak_bytes: int,
              config: AllocatorConfig) -> tuple[Ops, ReplayResult, int]:
    """The compiled step trace, its replay without a device limit, and the shortfall: what the
    planner's ``allocated_peak_bytes`` counts beyond the schedule's own requested peak (its
    moments count the largest unit for every unit). The shortfall is added to what the
    allocator needs, never taken from it."""
    ops = step_ops(request, states, terms)
    unlimited = replay(ops, config, None)
    return ops, unlimited, max(allocated_peak_bytes - unlimited.requested_peak_bytes, 0)


def allocator_verdict(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms,
                      allocated_peak_bytes: int, usable_bytes: int, bisect: bool = True) -> PlannedVerdict:
    """Reserved peak, verdict and OOM capacity of the request's step on ``usable_bytes``.

    The verdict is the replay at the usable memory itself: completion is not monotone in the
    capacity (docs/memory-model.md, "The caching allocator"), so a capacity found by bisection
    elsewhere could not decide it. The OOM capacity is then bisected on the side of the usable
    memory the verdict fell: a completing capacity at most the usable memory when the step
    fits, more than it when not, with a failing one 2 MiB below. Where the allocated peak alone
    passes the usable memory the step cannot complete, and the capacity is not bisected (None).

    Without ``bisect`` the capacity is the end of the bisection's bracket instead, one the
    verdict already decides: a capacity the step completes on (at most the usable memory) when
    it fits, one 2 MiB above the usable memory, on which it is not known to, when not (what a
    verdict needs without the table's figure: fit's suggestions); where the allocated peak
    alone passes the usable memory nothing is replayed at all."""
    if allocated_peak_bytes > usable_bytes and not bisect:
        return PlannedVerdict(unlimited=None, fits=False, oom_capacity_bytes=None)
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    with _without_cyclic_gc():
        ops, unlimited, shortfall = _replayed(request, states, terms, allocated_peak_bytes, config)
        if allocated_peak_bytes > usable_bytes:
            return PlannedVerdict(unlimited=unlimited, fits=False, oom_capacity_bytes=None)
        usable_step = (usable_bytes - shortfall) // CAPACITY_STEP_BYTES
        fits = completes_within(ops, config, usable_step * CAPACITY_STEP_BYTES, unlimited)
        if bisect:
            capacity = bisect_capacity(ops, config, unlimited, usable_step, fits)
        elif fits:
            capacity = min(capacity_bracket(unlimited)[1], usable_step) * CAPACITY_STEP_BYTES
        else:
            capacity = (usable_step + 1) * CAPACITY_STEP_BYTES
    return PlannedVerdict(unlimited=unlimited, fits=fits, oom_capacity_bytes=capacity + shortfall)


def allocator_fits(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms, allocated_peak_bytes: int,
                   usable_bytes: int) -> bool:
    """allocator_verdict(...).fits in one or two replays, without bisecting the capacity (the
    largest-micro-batch search asks only this)."""
    if allocated_peak_bytes > usable_bytes:
        return False
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    with _without_cyclic_gc():
        ops, unlimited, shortfall = _replayed(request, states, terms, allocated_peak_bytes, config)
        return completes_within(ops, config, usable_bytes - shortfall, unlimited)
