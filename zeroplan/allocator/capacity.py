"""The OOM capacity: the smallest device memory on which the step completes under the
allocator's own retry rules, found by bisection over replays."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import ConfigDict

from zeroplan.allocator.config import AllocatorConfig
from zeroplan.allocator.device import DeviceAllocator
from zeroplan.allocator.replay import Ops, ReplayResult, compile_trace, replay, run_ops
from zeroplan.specs.base import Frozen
from zeroplan.units import MiB

if TYPE_CHECKING:
    from zeroplan.allocator.trace import AllocationTrace

CAPACITY_STEP_BYTES = 2 * MiB
"""The bisection's resolution: every segment and page is a multiple of 2 MiB, so a capacity
between two multiples behaves as the lower one (small-pool segments are 2 MiB too)."""


class AllocatorVerdict(Frozen):
    """The allocator's answer for one step and one configuration."""

    # Its validator is built on first use: `zeroplan fit` never builds one (oom_capacity, which
    # the framework measurements call, does).
    model_config = ConfigDict(defer_build=True)

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


class BandScan(Frozen):
    """Where, between two capacities, a step's replay first goes a given way."""

    # The planner builds it unvalidated (Frozen.trusted), so its validator is built on first use
    # (a caller's validation, a JSON dump), not at each command's start.
    model_config = ConfigDict(defer_build=True)

    found_bytes: int | None
    """The least capacity in the band on which the replay goes the way asked (completes, or
    runs out); None where it does on none (or the scan stopped first: ``settled`` False)."""
    settled: bool
    """The scan covered the band (it stops after a bounded number of replays)."""
    replays: int
    """Replays made."""


MAX_BAND_REPLAYS = 24
"""How many replays a band scan makes at most: each covers every capacity on which the
allocator grants and refuses the same device allocations; a band crossed by more such paths is
reported unsettled."""


def scan_band(ops: Ops, config: AllocatorConfig, low_bytes: int, high_bytes: int, completes: bool = True,
              max_replays: int = MAX_BAND_REPLAYS) -> BandScan:
    """The least capacity in [low_bytes, high_bytes] on which the replay completes (``completes``)
    or runs out, found path by path: a replay on a capacity goes the same way on every capacity
    from it up to the least one that would grant an allocation it refused
    (DeviceAllocator.path_ceiling), so the next replay is made there; none is skipped.
    Completion is not monotone in the capacity (a refusal frees the cache, and when it comes
    decides how the rest of the step packs: docs/memory-model.md, "The caching allocator"), so a
    completing capacity can lie below one that runs out, and the other way round. Garbage
    collection acts against the capacity itself and is not scanned (the caller's)."""
    capacity, replays = low_bytes, 0
    while capacity <= high_bytes:
        if replays == max_replays:
            return BandScan(found_bytes=None, settled=False, replays=replays)
        device = DeviceAllocator(config, capacity)
        replays += 1
        if (run_ops(device, ops, 0, {}) is None) is completes:
            return BandScan(found_bytes=capacity, settled=True, replays=replays)
        if device.refusals == 0:
            break  # it went as on any larger capacity: so it goes on all of them
        capacity = device.path_ceiling
    return BandScan(found_bytes=None, settled=True, replays=replays)
