"""The OOM capacity: the smallest device memory on which the step completes under the
allocator's own retry rules, found by bisection over replays."""

from __future__ import annotations

from collections.abc import Sequence

from zeroplan.allocator.config import AllocatorConfig
from zeroplan.allocator.replay import Ops, ReplayResult, compile_trace, replay
from zeroplan.allocator.trace import AllocationTrace
from zeroplan.specs.base import Frozen
from zeroplan.units import MiB

CAPACITY_STEP_BYTES = 2 * MiB
"""The bisection's resolution: every segment and page is a multiple of 2 MiB, so a capacity
between two multiples behaves as the lower one (small-pool segments are 2 MiB too)."""


class AllocatorVerdict(Frozen):
    """The allocator's answer for one step and one configuration."""

    unlimited: ReplayResult
    """The replay with no device limit: what the allocator reserves when nothing fails."""
    oom_capacity_bytes: int
    """The smallest capacity (a multiple of 2 MiB) at which the replay completes."""


def oom_capacity(trace: AllocationTrace, config: AllocatorConfig,
                 segment_addresses: Sequence[tuple[int, int]] = (), fraction_cap: bool = False) -> AllocatorVerdict:
    """Bisect the capacity between the allocated peak (nothing can complete below it) and the
    unlimited reserved peak (a replay that never fails a cudaMalloc behaves as unlimited).
    Completion is not monotone in the capacity everywhere (docs/memory-model.md, "The caching
    allocator"): the answer completes and 2 MiB less fails, but a band further below may
    complete too. ``segment_addresses`` and ``fraction_cap`` as for replay.replay."""
    ops = compile_trace(trace)
    unlimited = replay(ops, config, None, segment_addresses)
    steps = _bisect(ops, config, *capacity_bracket(unlimited), segment_addresses, fraction_cap)
    return AllocatorVerdict(unlimited=unlimited, oom_capacity_bytes=steps * CAPACITY_STEP_BYTES)


def capacity_bracket(unlimited: ReplayResult) -> tuple[int, int]:
    """(low, high) in units of CAPACITY_STEP_BYTES from the replay without a device limit: at
    ``low``, below the allocated peak, nothing completes; at ``high``, the reserved peak rounded
    up, the step completes as it did unlimited."""
    return (unlimited.allocated_peak_bytes // CAPACITY_STEP_BYTES - 1,
            -(-unlimited.reserved_peak_bytes // CAPACITY_STEP_BYTES))


def _bisect(ops: Ops, config: AllocatorConfig, low: int, high: int,
            segment_addresses: Sequence[tuple[int, int]] = (), fraction_cap: bool = False) -> int:
    """The least step count in (low, high] that completes with one less failing, given that
    ``high`` completes and ``low`` does not (capacities in units of CAPACITY_STEP_BYTES)."""
    while high - low > 1:
        middle = (low + high) // 2
        if replay(ops, config, middle * CAPACITY_STEP_BYTES, segment_addresses, fraction_cap).completed:
            high = middle
        else:
            low = middle
    return high


class PlannedVerdict(Frozen):
    """The allocator's answer for a planned step on a GPU's usable memory
    (zeroplan.allocator.planner.allocator_verdict)."""

    unlimited: ReplayResult | None
    """The replay with no device limit: what the allocator reserves when nothing fails; None
    where nothing was replayed (a verdict without its figures, the allocated peak alone past
    the usable memory)."""
    fits: bool
    """The replay at the usable memory completes."""
    oom_capacity_bytes: int | None
    """A capacity that completes with 2 MiB less failing, on the verdict's side of the usable
    memory; None where the allocated peak alone passes it (not bisected)."""


def bisect_capacity(ops: Ops, config: AllocatorConfig, unlimited: ReplayResult, usable_steps: int, fits: bool) -> int:
    """The OOM capacity bisected on the verdict's side of ``usable_steps`` (the usable memory
    in units of CAPACITY_STEP_BYTES, whose replay completed when ``fits``): between the
    allocated peak and it when the step fits, between it and the unlimited reserved peak when
    not. The verdict then never contradicts the capacity shown beside it."""
    low, high = _verdict_side(unlimited, usable_steps, fits)
    return _bisect(ops, config, low, high) * CAPACITY_STEP_BYTES


def _verdict_side(unlimited: ReplayResult, usable_steps: int, fits: bool) -> tuple[int, int]:
    """The bracket (low fails, high completes, in steps) on the verdict's side of the usable memory."""
    low, high = capacity_bracket(unlimited)
    return (low, min(high, usable_steps)) if fits else (max(low, usable_steps), high)


def grown_capacity(ops: Ops, config: AllocatorConfig, start_steps: int) -> int:
    """The capacity, in steps, one replay ends at when its device starts at ``start_steps`` and
    grows whenever a request fails even after the allocator freed its cache and retried, by
    what the request's segment needs (a step at a time under expandable segments; replay's
    grow_by_bytes): the least capacity that carries this one trajectory through. A replay fixed
    at that capacity takes another trajectory (it frees its cache at other moments), so this is
    a candidate for the boundary, which verdict_capacity checks."""
    result = replay(ops, config, start_steps * CAPACITY_STEP_BYTES, grow_by_bytes=CAPACITY_STEP_BYTES)
    return result.grown_capacity_bytes // CAPACITY_STEP_BYTES


def verdict_capacity(ops: Ops, config: AllocatorConfig, unlimited: ReplayResult, usable_steps: int, fits: bool,
                     exact: bool = False) -> int:
    """The OOM capacity on the verdict's side of ``usable_steps``: a capacity the step completes
    on with one step less failing, as bisect_capacity finds. With ``exact``, bisection over the
    side (the oracle). By default the search starts from the candidate of one grown replay
    (grown_capacity) instead: two fixed replays confirm it in most steps (three replays where
    bisection takes a dozen); otherwise the search gallops from it, doubling its stride, to
    the nearest change from failing to completing and bisects there. Where completion is not
    monotone in the capacity the two searches can end on different boundaries
    (docs/memory-model.md, "The caching allocator")."""
    low, high = _verdict_side(unlimited, usable_steps, fits)
    if exact or low + 1 >= high:
        return _bisect(ops, config, low, high) * CAPACITY_STEP_BYTES
    grown = min(max(grown_capacity(ops, config, low + 1), low + 1), high)
    return _bisect(ops, config, *_bracket_near(ops, config, grown, low, high)) * CAPACITY_STEP_BYTES


def _bracket_near(ops: Ops, config: AllocatorConfig, start: int, low: int, high: int) -> tuple[int, int]:
    """(failing, completing) capacities in steps, within [low, high] (``low`` known to fail,
    ``high`` to complete) and around the change from failing to completing nearest ``start``:
    probes from ``start`` at strides 1, 2, 4, ... towards the side that decides."""
    if _completes(ops, config, start):
        completing, stride = start, 1
        while True:
            probe = max(start - stride, low)
            if probe == low or not _completes(ops, config, probe):
                return probe, completing
            completing, stride = probe, stride * 2
    failing, stride = start, 1
    while True:
        probe = min(start + stride, high)
        if probe == high or _completes(ops, config, probe):
            return failing, probe
        failing, stride = probe, stride * 2


def _completes(ops: Ops, config: AllocatorConfig, steps: int) -> bool:
    return replay(ops, config, steps * CAPACITY_STEP_BYTES).completed


def completes_within(ops, config: AllocatorConfig, capacity_bytes: int, unlimited: ReplayResult) -> bool:
    """Whether the step completes on ``capacity_bytes``, rounded down to the bisection's 2 MiB
    grid, in at most one more replay: at or above the bracket's high end it completes, at or
    below its low end it cannot, and between them the replay at that capacity decides."""
    steps = capacity_bytes // CAPACITY_STEP_BYTES
    low, high = capacity_bracket(unlimited)
    if steps >= high:
        return True
    if steps <= low:
        return False
    return replay(ops, config, steps * CAPACITY_STEP_BYTES).completed
