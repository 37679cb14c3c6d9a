"""The allocator's verdict for one planned request: its step trace (schedule.step_ops)
replayed under the request's PYTORCH_CUDA_ALLOC_CONF (MemoryAssumptions.allocator_conf), at
the GPU's usable memory."""

from __future__ import annotations

import contextlib
import gc
from collections import OrderedDict
from dataclasses import dataclass, field

from zeroplan.allocator.capacity import (
    CAPACITY_STEP_BYTES, PlannedVerdict, capacity_bracket, completes_within, verdict_capacity,
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


@dataclass
class _StepReplays:
    """One request's step trace and what replaying it has answered so far."""

    ops: Ops
    unlimited: ReplayResult
    """Its replay without a device limit."""
    shortfall_bytes: int
    """What the planner's allocated peak counts beyond the schedule's own requested peak (its
    moments count the largest unit for every unit): added to what the allocator needs, never
    taken from it."""
    completes: dict[int, bool] = field(default_factory=dict)
    """Capacity (bytes, on the 2 MiB grid) -> whether the step completes on it."""

    def completes_within(self, config: AllocatorConfig, capacity_bytes: int) -> bool:
        steps = capacity_bytes // CAPACITY_STEP_BYTES
        if steps not in self.completes:
            self.completes[steps] = completes_within(self.ops, config, steps * CAPACITY_STEP_BYTES, self.unlimited)
        return self.completes[steps]


_RECENT_REPLAYS: OrderedDict[tuple, _StepReplays] = OrderedDict()
_RECENT_LIMIT = 32
"""Requests whose replays are kept: a fit asks about each strategy's step for its table, its
verdict and its largest micro-batch, which is often the same step (specs are immutable, so a
request and its allocator setting name the trace)."""


def _replayed(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms, allocated_peak_bytes: int,
              config: AllocatorConfig) -> _StepReplays:
    """The compiled step trace and its replay without a device limit, kept for the last few requests."""
    key = (request, allocated_peak_bytes, config)
    found = _RECENT_REPLAYS.get(key)
    if found is not None:
        _RECENT_REPLAYS.move_to_end(key)
        return found
    ops = step_ops(request, states, terms)
    unlimited = replay(ops, config, None)
    found = _StepReplays(ops, unlimited, max(allocated_peak_bytes - unlimited.requested_peak_bytes, 0))
    _RECENT_REPLAYS[key] = found
    if len(_RECENT_REPLAYS) > _RECENT_LIMIT:
        _RECENT_REPLAYS.popitem(last=False)
    return found


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
        step = _replayed(request, states, terms, allocated_peak_bytes, config)
        ops, unlimited, shortfall = step.ops, step.unlimited, step.shortfall_bytes
        if allocated_peak_bytes > usable_bytes:
            return PlannedVerdict(unlimited=unlimited, fits=False, oom_capacity_bytes=None)
        usable_step = (usable_bytes - shortfall) // CAPACITY_STEP_BYTES
        fits = step.completes_within(config, usable_step * CAPACITY_STEP_BYTES)
        if bisect:
            capacity = verdict_capacity(ops, config, unlimited, usable_step, fits, request.assumptions.exact_capacity)
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
        step = _replayed(request, states, terms, allocated_peak_bytes, config)
        return step.completes_within(config, usable_bytes - step.shortfall_bytes)
