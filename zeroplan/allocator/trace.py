"""One training step's allocations and frees, in the order the CPU issues them: what the
allocator model replays (model.replay)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import ConfigDict, Field

from zeroplan.allocator.streams import Stream as Stream  # re-exported: the events' streams
from zeroplan.specs.base import Frozen


class AllocEvent(Frozen):
    """A tensor's storage is requested on a stream (DeviceCachingAllocator::malloc)."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    kind: Literal["alloc"] = "alloc"
    id: int = Field(ge=0)
    """Names the allocation until its FreeEvent; ids may be reused after it."""
    size_bytes: int = Field(gt=0)
    """Bytes requested (before the allocator's rounding)."""
    stream: int = Field(default=Stream.compute, ge=0)
    """The stream current when it was requested (its pool)."""


class FreeEvent(Frozen):
    """The storage's last reference is dropped (DeviceCachingAllocator::free)."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    kind: Literal["free"] = "free"
    id: int = Field(ge=0)


class RecordStreamEvent(Frozen):
    """Tensor.record_stream: the block is used on another stream, so after its free it stays
    unavailable until that stream's work is known to be done (recordStream, insert_events)."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    kind: Literal["record_stream"] = "record_stream"
    id: int = Field(ge=0)
    stream: int = Field(ge=0)


class SyncEvent(Frozen):
    """A point by which every stream's earlier work has finished (a synchronize, or the wait
    that precedes the next use): blocks held by recorded streams return to their pools."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    kind: Literal["sync"] = "sync"


class EmptyCacheEvent(Frozen):
    """torch.cuda.empty_cache(): cached, unsplit blocks go back to CUDA (emptyCache)."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    kind: Literal["empty_cache"] = "empty_cache"


TraceEvent = Union[AllocEvent, FreeEvent, RecordStreamEvent, SyncEvent, EmptyCacheEvent]


class AllocationTrace(Frozen):
    """A step's events in issue order, and where they came from."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    events: tuple[TraceEvent, ...]
    source: str = ""
    """What produced it (a measured run, or the planner's schedule)."""

    def requested_peak_bytes(self) -> int:
        """The most requested bytes alive at once (no rounding): the planner's allocated peak."""
        live: dict[int, int] = {}
        now = peak = 0
        for event in self.events:
            if isinstance(event, AllocEvent):
                live[event.id] = event.size_bytes
                now += event.size_bytes
                peak = max(peak, now)
            elif isinstance(event, FreeEvent):
                now -= live.pop(event.id)
        return peak
