"""Replay a step's allocation trace through the allocator model at a device capacity."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import ConfigDict

from zeroplan.allocator.config import AllocatorConfig
from zeroplan.allocator.device import DeviceAllocator
from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen

if TYPE_CHECKING:
    from zeroplan.allocator.trace import AllocationTrace

ALLOC_OP, FREE_OP, RECORD_OP, SYNC_OP, EMPTY_OP = range(5)
"""The kinds of a compiled op (the first field of each Ops tuple)."""

Ops = list[tuple[int, int, int, int]]
"""A trace compiled to (kind, id, size_bytes, stream) tuples, so a bisection replays it fast."""


class ReplayResult(Frozen):
    """What the allocator did over one step."""

    # The planner builds it unvalidated (Frozen.trusted), so its validator is built on first use
    # (a caller's validation, a JSON dump), not at each command's start.
    model_config = ConfigDict(defer_build=True)

    completed: bool
    """Every request was served (no out-of-memory)."""
    oom_event_index: int | None = None
    """The event whose request failed even after freeing the cache and retrying."""
    oom_request_bytes: int | None = None
    """What that request asked for."""
    requested_peak_bytes: int
    """The most requested bytes alive at once (what the planner's allocated peak counts)."""
    allocated_peak_bytes: int
    """The most bytes of allocated blocks at once (torch.cuda.max_memory_allocated: sizes
    after rounding)."""
    reserved_peak_bytes: int
    """The most bytes of segments at once (torch.cuda.max_memory_reserved)."""
    device_alloc_calls: int
    """cudaMalloc calls (expandable segments: page mappings)."""
    device_free_calls: int
    """cudaFree calls (expandable segments: page unmappings)."""
    alloc_retries: int
    """Requests that needed every cached block freed first (num_alloc_retries)."""
    events_replayed: int
    device_refusals: int = 0
    """Device allocations (cudaMalloc, page mappings) refused for want of capacity; 0: the
    replay went exactly as it would on any larger device (garbage collection aside, which acts
    against the capacity itself)."""


def compile_trace(trace: AllocationTrace) -> Ops:
    """The trace as tuples; an id freed before it is allocated (or allocated twice) is refused."""
    # The typed events' module is imported where a typed trace is read, not with the replay: the
    # planner's traces are ops already (zeroplan.allocator.builder), and the event models'
    # classes cost about 8.6 million instructions of each command's start to create (callgrind).
    from zeroplan.allocator.trace import AllocEvent, EmptyCacheEvent, FreeEvent, RecordStreamEvent

    ops: Ops = []
    live: set[int] = set()
    for index, event in enumerate(trace.events):
        if isinstance(event, AllocEvent):
            if event.id in live:
                raise ZeroplanError(f"trace.events[{index}]", f"id {event.id} is allocated twice (allowed: an id not alive)")
            live.add(event.id)
            ops.append((ALLOC_OP, event.id, event.size_bytes, event.stream))
        elif isinstance(event, (FreeEvent, RecordStreamEvent)):
            if event.id not in live:
                raise ZeroplanError(f"trace.events[{index}]", f"id {event.id} is not allocated (allowed: an allocated id)")
            if isinstance(event, FreeEvent):
                live.discard(event.id)
                ops.append((FREE_OP, event.id, 0, 0))
            else:
                ops.append((RECORD_OP, event.id, 0, event.stream))
        elif isinstance(event, EmptyCacheEvent):
            ops.append((EMPTY_OP, 0, 0, 0))
        else:
            ops.append((SYNC_OP, 0, 0, 0))
    return ops


def run_ops(device: DeviceAllocator, ops: Ops, start: int, live: dict[int, object]) -> int | None:
    """ops[start:] run through ``device``, ``live`` the blocks alive by id (filled and emptied as
    the ops go): the index of the request that ran out of memory, or None."""
    malloc, free = device.malloc, device.free
    for index in range(start, len(ops)):
        kind, ident, size, stream = ops[index]
        if kind == ALLOC_OP:
            block = malloc(size, stream)
            if block is None:
                return index
            live[ident] = block
        elif kind == FREE_OP:
            free(live.pop(ident))
        elif kind == RECORD_OP:
            device.record_stream(live[ident], stream)
        elif kind == SYNC_OP:
            device.synchronize()
        else:
            device.empty_cache()
    return None


def _ops_of(trace: object) -> Ops:
    """replay's ops of what is not a list already: a typed trace compiled, anything else as
    given (the typed events' module imported here, as compile_trace imports it)."""
    from zeroplan.allocator.trace import AllocationTrace

    return compile_trace(trace) if isinstance(trace, AllocationTrace) else trace  # type: ignore[return-value]


def replay(trace: AllocationTrace | Ops, config: AllocatorConfig, capacity_bytes: int | None = None,
           segment_addresses: Sequence[tuple[int, int]] = (), fraction_cap: bool = False) -> ReplayResult:
    """Run the trace through DeviceAllocator; ``capacity_bytes`` None: no device limit;
    ``segment_addresses``: where a measured run's cudaMalloc calls landed (measured.py);
    ``fraction_cap``: the capacity is a set_per_process_memory_fraction limit (DeviceAllocator)."""
    ops = trace if isinstance(trace, list) else _ops_of(trace)
    device = DeviceAllocator(config, capacity_bytes, segment_addresses, fraction_cap)
    oom_index = run_ops(device, ops, 0, {})
    return ReplayResult.trusted(
        completed=oom_index is None, oom_event_index=oom_index,
        oom_request_bytes=None if oom_index is None else ops[oom_index][2],
        requested_peak_bytes=device.requested_peak, allocated_peak_bytes=device.allocated_peak,
        reserved_peak_bytes=device.reserved_peak, device_alloc_calls=device.device_allocs,
        device_free_calls=device.device_frees, alloc_retries=device.retries, device_refusals=device.refusals,
        events_replayed=len(ops) if oom_index is None else oom_index,
    )
