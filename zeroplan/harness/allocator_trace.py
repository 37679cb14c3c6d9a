"""The CPU allocator's own view of live tensor bytes, from the profiler's memory events.

MemTracker sees tensors it is told about or that are created inside its window; it misses
storages refilled with ``untyped_storage().resize_`` (reference ZeRO-3's gathered units) and
buffers built before the window (DDP's gradient buckets). The allocator sees them all: with
``profile_memory=True`` each CPU allocation and free reaches the profiler with its address and
size (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter). It reports only blocks allocated
while profiling, so the trace starts before the model is built; replayed in time order, the
events then give the process's live tensor bytes at every moment, the CPU counterpart of
``torch.cuda.max_memory_allocated``.

One blind spot: the reporter only reports on threads the profiler covers, so a tensor freed
by gloo's worker thread would look live until its address is reused. ``with_unseen_frees``
frees such blocks when the collective that made them returns, or when the last operator that
used them returns; tensors zeroplan's own engine hands to a collective go through
``free_on_this_thread``, so their frees are seen.

The trace spans the whole run and is read once, at its end; steps are marked by profiler ranges.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

STEP_RANGE_PREFIX = "zeroplan::step"
_RELEASE_WAIT_S = 1.0
TOP_ALLOCATORS = 8
"""How many allocating operators the record lists at the peak (the largest by live bytes)."""


def free_on_this_thread(tensor: torch.Tensor) -> None:
    """Wait until the caller's ``tensor`` is the only holder of its storage, so that dropping
    it frees the storage on this (profiled) thread rather than on gloo's worker thread, which
    releases a finished collective's tensors a moment after ``wait()`` returns."""
    # The worker holds the tensor itself or a view of it: wait until both counts are ours
    # (the tensor once; its storage by the tensor and the ``storage`` wrapper).
    storage = tensor.untyped_storage()
    deadline = time.monotonic() + _RELEASE_WAIT_S
    while (tensor._use_count() > 1 or torch._C._storage_Use_Count(storage._cdata) > 2) and time.monotonic() < deadline:
        time.sleep(0)


@dataclass(frozen=True)
class StepAllocatorPeak:
    """One step's peak of live CPU tensor bytes, and who allocated what was live then."""

    peak_bytes: int
    live_bytes_by_operator: dict[str, int]
    """At the peak, live bytes by the operator that allocated them (the largest few)."""


@dataclass(frozen=True)
class Allocation:
    """One allocator event: a block of ``size_bytes`` at ``ptr`` (negative size: its free)."""

    time_ns: int
    size_bytes: int
    ptr: int
    operator: str
    """The operator that allocated (or freed) it."""
    collective_end_ns: int | None = None
    """If it was allocated inside a c10d collective: when that collective's call returned."""
    allocation_id: int | None = None
    """The profiler's id of the block, shared by its allocation, its free and its uses."""


@dataclass(frozen=True)
class Use:
    """An operator took the block ``allocation_id`` as an input and returned at ``end_ns``."""

    allocation_id: int
    end_ns: int
    collective: bool
    """The operator is a c10d collective."""


class AllocatorTrace:
    """Profile the whole run's CPU allocations; mark each step with ``step(i)``. Disabled (on
    CUDA, whose allocator keeps its own peak), it does nothing and finds no peaks."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._profile = (
            # record_shapes: each operator's inputs name their allocations, which tells when a
            # block was last used (see with_unseen_frees).
            profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) if enabled else None
        )
        self._peaks: dict[int, StepAllocatorPeak] = {}
        self._events: list[Allocation] = []

    def __enter__(self) -> "AllocatorTrace":
        if self._profile is not None:
            self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._profile is None:
            return
        self._profile.__exit__(*exc)
        if exc[0] is None:
            self._peaks, self._events = _step_peaks(self._profile)

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        if self._profile is None:
            yield
            return
        with record_function(f"{STEP_RANGE_PREFIX}{index}"):
            yield

    def peaks(self) -> dict[int, StepAllocatorPeak]:
        """Per step index; empty until the trace has ended."""
        return dict(self._peaks)

    def events(self) -> list[Allocation]:
        """The run's allocations and frees in time order, unseen frees added (with_unseen_frees),
        as the peaks were replayed from; empty until the trace has ended."""
        return list(self._events)


def _input_allocation_ids(event) -> Iterator[int]:
    for value in event.extra_fields.inputs:
        for item in value if isinstance(value, list) else [value]:
            allocation_id = getattr(item, "allocation_id", None)
            if allocation_id is not None:
                yield allocation_id


def _step_peaks(prof: profile) -> tuple[dict[int, StepAllocatorPeak], list[Allocation]]:
    allocations, operators = [], []
    ranges: dict[int, tuple[int, int]] = {}
    cpu = torch.device("cpu")
    # The event tree in pre-order (each event before its children, siblings in order), without
    # one generator per level (a run's tree holds hundreds of thousands of events), each event
    # with its parent's name and the end of the c10d collective it runs inside (None: none);
    # reading a name or a field costs a call into the profiler, so each is read once.
    stack: list[tuple[Any, str, int | None]] = [
        (e, "(no operator)", None) for e in reversed(prof.profiler.kineto_results.experimental_event_tree())]
    while stack:
        e, parent_name, collective_end_ns = stack.pop()
        name, fields = e.name, e.extra_fields
        kind = type(fields).__name__
        if kind == "_ExtraFields_Allocation" and fields.device == cpu:
            allocations.append(Allocation(
                time_ns=e.start_time_ns, size_bytes=fields.alloc_size, ptr=fields.ptr, operator=parent_name,
                collective_end_ns=collective_end_ns, allocation_id=fields.allocation_id,
            ))
        elif kind == "_ExtraFields_TorchOp":
            operators.append(e)
        if name.startswith(STEP_RANGE_PREFIX):
            ranges[int(name[len(STEP_RANGE_PREFIX):])] = (e.start_time_ns, e.end_time_ns)
        children = e.children
        if children:
            inside_ns = e.end_time_ns if name.startswith("c10d::") else collective_end_ns
            stack.extend((child, name, inside_ns) for child in reversed(children))
    replayed = with_unseen_frees(allocations, _uses_of_handed_blocks(operators, allocations))
    return _peaks_of(replayed, ranges), replayed


def _uses_of_handed_blocks(operators: list, allocations: list[Allocation]) -> list[Use]:
    """The uses with_unseen_frees reads: every collective's, which tell the blocks handed to
    one, and the last use of each block whose last use it asks for (handed, made outside a
    collective, its free not seen). Reading an operator's inputs is most of the trace's cost,
    so the other operators are read latest end first only until each such block is met (the
    first operator met using it ends last): most of a run's operators are never read."""
    collectives = [e for e in operators if e.name.startswith("c10d::")]
    uses = [Use(allocation_id=i, end_ns=e.end_time_ns, collective=True) for e in collectives for i in _input_allocation_ids(e)]
    asked = _last_use_asked(allocations, {use.allocation_id for use in uses})
    for e in sorted(operators, key=lambda e: e.end_time_ns, reverse=True):
        if not asked:
            break
        # An operator ending after the block's address was allocated again used the later block,
        # which the profiler gives the same id (it saw no free in between): not this one's use.
        met = {i for i in asked.keys() & set(_input_allocation_ids(e)) if asked[i] is None or e.end_time_ns <= asked[i]}
        uses += [Use(allocation_id=i, end_ns=e.end_time_ns, collective=e.name.startswith("c10d::")) for i in met]
        for i in met:
            del asked[i]
    return uses


def _last_use_asked(allocations: list[Allocation], handed: set[int]) -> dict[int, int | None]:
    """The blocks whose last use with_unseen_frees reads, of those ``handed`` to a collective,
    each with when its address was next allocated (None: never), past which a use is another's."""
    ordered = sorted(allocations, key=lambda a: a.time_ns)
    following = _following_at_ptr(ordered)
    return {allocation.allocation_id: None if after is None else ordered[after].time_ns
            for allocation, after in zip(ordered, following, strict=True)
            if allocation.size_bytes > 0 and allocation.collective_end_ns is None and allocation.allocation_id in handed
            and not (after is not None and ordered[after].size_bytes < 0)}


def step_peaks(
    allocations: list[Allocation], ranges: dict[int, tuple[int, int]], uses: list[Use] = (),
) -> dict[int, StepAllocatorPeak]:
    """Each step's peak of live bytes, from allocator events, operator inputs and the steps'
    time ranges."""
    return _peaks_of(with_unseen_frees(allocations, uses), ranges)


def _peaks_of(events: list[Allocation], ranges: dict[int, tuple[int, int]]) -> dict[int, StepAllocatorPeak]:
    """Each step's peak over ``events`` already in time order with their unseen frees."""
    totals = [total for _, total in _replay(events)]
    peaks = {}
    for index, (start_ns, end_ns) in ranges.items():
        inside = [i for i, a in enumerate(events) if start_ns <= a.time_ns <= end_ns]
        if not inside:
            peaks[index] = StepAllocatorPeak(peak_bytes=0, live_bytes_by_operator={})
            continue
        peak_index = max(inside, key=lambda i: totals[i])
        peaks[index] = StepAllocatorPeak(
            peak_bytes=totals[peak_index], live_bytes_by_operator=_live_by_operator(events[: peak_index + 1])
        )
    return peaks


# The reporter only reports on threads the profiler is enabled on (memoryProfilingEnabled() is
# thread-local in c10/core/CPUAllocator.cpp), so a free made by gloo's worker thread never
# appears. The worker drops a finished collective's tensors; where it holds the last reference
# (a temporary gloo made inside the call: a reduce-scatter copies its input and all-reduces the
# copy; or a buffer the caller has let go, as FSDP2 does with an all-gather's output once it is
# copied out) the block is freed there. Such a block is taken as freed when the collective that
# made it returns, or else, if it was handed to a collective, when the last operator that used
# it returns; unless its address is used again before. Having seen no free, the profiler gives
# the next block allocated at that address the same allocation id, so only the uses before that
# allocation are the block's own (torch 2.13's FSDP2 root all-gather output on 2 gloo ranks: a
# later block's uses kept the 24 MiB output live through the head's backward, 12.75
# MiB over the peak that FSDPMemTracker saw). A block never handed to a collective whose free
# is not seen (an optimizer state) is live to the end.
def with_unseen_frees(allocations: list[Allocation], uses: list[Use] = ()) -> list[Allocation]:
    """The events in time order, plus a free for every collective's block whose own free was
    not seen (see above)."""
    ordered = sorted(allocations, key=lambda a: a.time_ns)
    use_ends: dict[int, list[int]] = defaultdict(list)
    handed: set[int] = set()
    for use in uses:
        use_ends[use.allocation_id].append(use.end_ns)
        if use.collective:
            handed.add(use.allocation_id)
    following = _following_at_ptr(ordered)
    added = []
    for index, allocation in enumerate(ordered):
        if allocation.size_bytes <= 0:
            continue
        after = following[index]
        if after is not None and ordered[after].size_bytes < 0:
            continue  # its free was seen
        freed_ns = allocation.collective_end_ns
        if freed_ns is None and allocation.allocation_id in handed:
            # Its own uses only: a block allocated at its address later carries its id too
            # (the profiler saw no free between them), and its uses come after that allocation.
            reused_ns = None if after is None else ordered[after].time_ns
            freed_ns = max((end for end in use_ends[allocation.allocation_id] if reused_ns is None or end <= reused_ns),
                           default=None)
        if freed_ns is None:
            continue  # live until its address is used again
        if after is not None and ordered[after].time_ns < freed_ns:
            continue  # reused before: the replay frees it there
        added.append(Allocation(time_ns=freed_ns, size_bytes=-allocation.size_bytes,
                                ptr=allocation.ptr, operator=allocation.operator))
    return sorted(ordered + added, key=lambda a: a.time_ns)


def _following_at_ptr(ordered: list[Allocation]) -> list[int | None]:
    """For each event of ``ordered`` (time order), the index of the next event at its address."""
    next_at_ptr: dict[int, int] = {}
    following: list[int | None] = [None] * len(ordered)
    for index in range(len(ordered) - 1, -1, -1):
        following[index] = next_at_ptr.get(ordered[index].ptr)
        next_at_ptr[ordered[index].ptr] = index
    return following


# Replayed by address, the live set does not drift even where a free is missing: a block
# allocated again at a live address was freed unseen in between.
def _replay(allocations: list[Allocation]) -> Iterator[tuple[dict[int, Allocation], int]]:
    live: dict[int, Allocation] = {}
    total = 0
    for allocation in allocations:
        previous = live.pop(allocation.ptr, None)
        if previous is not None:
            total -= previous.size_bytes
        if allocation.size_bytes > 0:
            live[allocation.ptr] = allocation
            total += allocation.size_bytes
        yield live, total


def _live_by_operator(allocations: list[Allocation]) -> dict[str, int]:
    live: dict[int, Allocation] = {}
    for live, _ in _replay(allocations):
        pass
    by_operator: dict[str, int] = defaultdict(int)
    for allocation in live.values():
        by_operator[allocation.operator] += allocation.size_bytes
    largest = sorted(by_operator.items(), key=lambda kv: -kv[1])[:TOP_ALLOCATORS]
    return dict(largest)
