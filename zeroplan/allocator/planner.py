"""The allocator's verdict for one planned request: its step trace (schedule.step_ops)
replayed under the request's PYTORCH_CUDA_ALLOC_CONF (MemoryAssumptions.allocator_conf) on
the GPU's usable memory.

One replay answers: on the usable memory itself, the step either completes, and its reserved
peak is what torch.cuda.max_memory_reserved would report on that GPU (below the device's
memory even where the allocator had to free its cache and retry), or runs out. Only a step that
runs out needs a second replay, without a device limit, for what it would reserve on a GPU
large enough. The OOM capacity (the least memory on which the step completes) is bisected
only on request (MemoryAssumptions.exact_capacity): a dozen replays, the oracle."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from zeroplan.allocator.capacity import CAPACITY_STEP_BYTES, bisect_capacity
from zeroplan.allocator.config import AllocatorConfig, parse_alloc_conf
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, Ops, ReplayResult, replay
from zeroplan.allocator.schedule import step_ops
from zeroplan.core.collector import cyclic_gc_paused
from zeroplan.core.model_states import ModelStateBytes
from zeroplan.core.peak import PeakTerms
from zeroplan.specs.base import Frozen
from zeroplan.specs.request import PlanRequest


class PlannedVerdict(Frozen):
    """The allocator's answer for a planned step on a GPU's usable memory."""

    fits: bool
    """The replay on the usable memory completes."""
    reserved_peak_bytes: int | None
    """What the step reserves at its peak, the planner's allocated bytes beyond the schedule's
    included: on the usable memory where it completes there (at most the usable memory), else
    without a device limit (more than the usable memory); None where nothing was replayed (the
    allocated peak alone passes the usable memory)."""
    oom_capacity_bytes: int | None = None
    """With MemoryAssumptions.exact_capacity, the bisected OOM capacity on the verdict's side of
    the usable memory (a capacity the step completes on with 2 MiB less failing); else None."""


@dataclass
class _StepReplays:
    """One request's step trace and the replays made of it so far."""

    ops: Ops
    shortfall_bytes: int
    """What the planner's allocated peak counts beyond the schedule's own requested peak (its
    moments count the largest unit for every unit): added to what the allocator needs, never
    taken from it."""
    config: AllocatorConfig
    results: dict[int | None, ReplayResult] = field(default_factory=dict)
    """Device capacity in bytes (None: no limit) -> the replay on it."""

    def on(self, capacity_bytes: int | None) -> ReplayResult:
        found = self.results.get(capacity_bytes)
        if found is None:
            found = self.results[capacity_bytes] = replay(self.ops, self.config, capacity_bytes)
        return found


_RECENT_REPLAYS: OrderedDict[tuple, _StepReplays] = OrderedDict()
_RECENT_LIMIT = 32
"""Requests whose replays are kept: a plan asks about its step for its breakdown and again for
its largest micro-batch, which is often the same step (specs are immutable, so a request and
its allocator setting name the trace)."""


def _step(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms, allocated_peak_bytes: int) -> _StepReplays:
    """The compiled step trace, kept for the last few requests."""
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    key = (request, allocated_peak_bytes, config)
    found = _RECENT_REPLAYS.get(key)
    if found is not None:
        _RECENT_REPLAYS.move_to_end(key)
        return found
    ops = step_ops(request, states, terms)
    requested_peak = _requested_peak_bytes(ops)
    found = _StepReplays(ops, max(allocated_peak_bytes - requested_peak, 0), config)
    _RECENT_REPLAYS[key] = found
    if len(_RECENT_REPLAYS) > _RECENT_LIMIT:
        _RECENT_REPLAYS.popitem(last=False)
    return found


def _requested_peak_bytes(ops: Ops) -> int:
    """The most requested bytes alive at once over the trace (what a replay's requested peak
    reports, without replaying)."""
    sizes: dict[int, int] = {}
    alive = peak = 0
    for kind, ident, size, _ in ops:
        if kind == ALLOC_OP:
            sizes[ident] = size
            alive += size
            if alive > peak:
                peak = alive
        elif kind == FREE_OP:
            alive -= sizes.pop(ident)
    return peak


def allocator_verdict(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms,
                      allocated_peak_bytes: int, usable_bytes: int) -> PlannedVerdict:
    """Verdict and reserved peak of the request's step on ``usable_bytes`` (the module's
    docstring); where the allocated peak alone passes the usable memory nothing is replayed."""
    if allocated_peak_bytes > usable_bytes:
        return PlannedVerdict(fits=False, reserved_peak_bytes=None)
    # The trace's tens of thousands of events and the allocator's linked blocks would set off
    # full collections that cost as much as the replay itself (70B FSDP2: compile_trace 19 ms
    # with the collector, 4 ms without).
    with cyclic_gc_paused():
        step = _step(request, states, terms, allocated_peak_bytes)
        capacity = usable_bytes - step.shortfall_bytes
        on_gpu = step.on(capacity)
        # Where the step completes, the replay never failed a request: a step that runs out
        # reserved more than the usable memory without a limit (it completes identically on any
        # capacity at least its unlimited reserved peak).
        reserved = on_gpu if on_gpu.completed else step.on(None)
        oom_capacity = None
        if request.assumptions.exact_capacity:
            unlimited = step.on(None)
            oom_capacity = bisect_capacity(step.ops, step.config, unlimited, capacity // CAPACITY_STEP_BYTES,
                                           on_gpu.completed) + step.shortfall_bytes
    return PlannedVerdict(fits=on_gpu.completed, reserved_peak_bytes=reserved.reserved_peak_bytes + step.shortfall_bytes,
                          oom_capacity_bytes=oom_capacity)


def allocator_fits(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms, allocated_peak_bytes: int,
                   usable_bytes: int) -> bool:
    """allocator_verdict(...).fits in one replay (the largest-micro-batch search asks only this)."""
    if allocated_peak_bytes > usable_bytes:
        return False
    with cyclic_gc_paused():
        step = _step(request, states, terms, allocated_peak_bytes)
        return step.on(usable_bytes - step.shortfall_bytes).completed
