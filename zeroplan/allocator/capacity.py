"""The OOM capacity: the smallest device memory on which the step completes under the
allocator's own retry rules, found by bisection over replays."""

from __future__ import annotations

from collections.abc import Sequence

from zeroplan.allocator.config import AllocatorConfig
from zeroplan.allocator.replay import ReplayResult, compile_trace, replay
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
    Completion is assumed monotone in capacity, which the retry rules make likely, not certain.
    ``segment_addresses`` and ``fraction_cap`` as for replay.replay."""
    ops = compile_trace(trace)
    unlimited = replay(ops, config, None, segment_addresses)
    high = -(-unlimited.reserved_peak_bytes // CAPACITY_STEP_BYTES)
    low = unlimited.allocated_peak_bytes // CAPACITY_STEP_BYTES - 1
    # invariant: high completes, low does not
    while high - low > 1:
        middle = (low + high) // 2
        if replay(ops, config, middle * CAPACITY_STEP_BYTES, segment_addresses, fraction_cap).completed:
            high = middle
        else:
            low = middle
    return AllocatorVerdict(unlimited=unlimited, oom_capacity_bytes=high * CAPACITY_STEP_BYTES)


def completes_within(ops, config: AllocatorConfig, capacity_bytes: int, unlimited: ReplayResult) -> bool:
    """Whether oom_capacity(...) would come out at most ``capacity_bytes``, in at most one more
    replay: on the bisection's own 2 MiB grid, a capacity at or above the unlimited reserved peak
    completes, one below the allocated peak cannot, and between them the replay at that
    capacity decides (under the bisection's own assumption that completion is monotone)."""
    steps = capacity_bytes // CAPACITY_STEP_BYTES
    if steps >= -(-unlimited.reserved_peak_bytes // CAPACITY_STEP_BYTES):
        return True
    if steps <= unlimited.allocated_peak_bytes // CAPACITY_STEP_BYTES - 1:
        return False
    return replay(ops, config, steps * CAPACITY_STEP_BYTES).completed
