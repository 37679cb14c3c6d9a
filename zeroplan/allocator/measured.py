"""A run as the CUDA caching allocator itself recorded it: torch.cuda.memory._record_memory_history
trimmed by benchmarks/gpu_allocator.py to [action, address, size, stream, time_us] per event,
with torch.cuda.memory_stats() at the end. Read here without torch, as a trace the model replays
(replay.replay) beside the peaks the allocator reported, so the model is checked against the
allocator it models (docs/validation.md, "The caching allocator on a GPU")."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from pydantic import Field, ValidationError

from zeroplan.allocator.trace import AllocationTrace, AllocEvent, FreeEvent
from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen

TRACE_FORMAT = "zeroplan-allocator-trace/1"
"""The trimmed-history layout benchmarks/gpu_allocator.py writes."""

_SEGMENT_GROWS = frozenset({"segment_alloc", "segment_map"})
_SEGMENT_SHRINKS = frozenset({"segment_free", "segment_unmap"})
_NOT_REPLAYED = frozenset({"free_requested", "snapshot", "oom", "user_defined"})
"""free_requested: the block stays out of the cache until free_completed (record_stream
events); the others change no block."""


class MeasuredAllocatorRun(Frozen):
    """One measured run: its allocations as a trace, and what the allocator reported."""

    case: str
    """strategy:engine, as benchmarks/gpu_allocator.py names it."""
    alloc_conf: str
    """PYTORCH_CUDA_ALLOC_CONF of the run ("" for the default allocator)."""
    torch_version: str
    device_name: str
    device_total_bytes: int = Field(gt=0)
    allocated_peak_bytes: int = Field(ge=0)
    """torch.cuda.max_memory_allocated over the whole run (memory_stats allocated_bytes.all.peak)."""
    reserved_peak_bytes: int = Field(ge=0)
    """torch.cuda.max_memory_reserved over the whole run (reserved_bytes.all.peak)."""
    requested_peak_bytes: int = Field(ge=0)
    """requested_bytes.all.peak: the same before the allocator's rounding."""
    device_alloc_calls: int = Field(ge=0)
    """num_device_alloc: cudaMalloc calls (expandable segments: page mappings)."""
    alloc_retries: int = Field(ge=0)
    trace: AllocationTrace
    segment_addresses: tuple[tuple[int, int], ...]
    """(address, size) of each cudaMalloc, in order: where CUDA placed the run's segments."""


def trace_from_events(events: list[list], source: str) -> tuple[AllocationTrace, tuple[tuple[int, int], ...]]:
    """The allocations and completed frees as a trace (streams numbered in order of first use),
    and the cudaMalloc'd segments' addresses. An address names one live block at a time, so a
    free is matched to the allocation at its address."""
    streams: dict[int, int] = {}
    live: dict[int, int] = {}
    out: list[AllocEvent | FreeEvent] = []
    segments: list[tuple[int, int]] = []
    next_id = 0
    for index, event in enumerate(events):
        action, address, size, stream = event[0], int(event[1]), int(event[2]), int(event[3])
        if action == "alloc":
            if address in live:
                raise ZeroplanError(f"{source}: events[{index}]", f"address {address} allocated twice (allowed: a freed address)")
            live[address] = next_id
            out.append(AllocEvent(id=next_id, size_bytes=size, stream=streams.setdefault(stream, len(streams))))
            next_id += 1
        elif action == "free_completed":
            if address not in live:
                raise ZeroplanError(f"{source}: events[{index}]", f"free of address {address} never allocated (allowed: a live address)")
            out.append(FreeEvent(id=live.pop(address)))
        elif action == "segment_alloc":
            segments.append((address, size))
        elif action not in _SEGMENT_GROWS | _SEGMENT_SHRINKS | _NOT_REPLAYED:
            raise ZeroplanError(f"{source}: events[{index}].action", f"{action!r} (allowed: alloc, free_requested, "
                                "free_completed, segment_alloc, segment_free, segment_map, segment_unmap, snapshot, oom)")
    return AllocationTrace(events=tuple(out), source=source), tuple(segments)


def traced_reserved_peak_bytes(events: list[list]) -> int:
    """The reserved peak the trace itself shows: segments mapped in, less those given back."""
    reserved = peak = 0
    for event in events:
        if event[0] in _SEGMENT_GROWS:
            reserved += int(event[2])
            peak = max(peak, reserved)
        elif event[0] in _SEGMENT_SHRINKS:
            reserved -= int(event[2])
    return peak


def load_measured_run(path: Path) -> MeasuredAllocatorRun:
    """Read one trimmed history (.json.gz); a file of another layout is refused by name."""
    try:
        with gzip.open(path, "rt") as handle:
            document = json.load(handle)
    except (OSError, ValueError) as error:
        raise ZeroplanError(str(path), f"not a gzip'd JSON allocator trace ({error})") from None
    if not isinstance(document, dict) or document.get("format") != TRACE_FORMAT:
        raise ZeroplanError(f"{path}: format", f"allowed: {TRACE_FORMAT}")
    if document.get("columns") != ["action", "addr", "size", "stream", "time_us"]:
        raise ZeroplanError(f"{path}: columns", "allowed: action, addr, size, stream, time_us")
    stats = document["memory_stats"]
    trace, segments = trace_from_events(document["events"], str(path))
    try:
        return MeasuredAllocatorRun(
            case=document["case"], alloc_conf=document["alloc_conf"], torch_version=document["torch_version"],
            device_name=document["device_name"], device_total_bytes=document["device_total_bytes"],
            allocated_peak_bytes=stats["allocated_bytes.all.peak"], reserved_peak_bytes=stats["reserved_bytes.all.peak"],
            requested_peak_bytes=stats["requested_bytes.all.peak"], device_alloc_calls=stats["num_device_alloc"],
            alloc_retries=stats["num_alloc_retries"], trace=trace, segment_addresses=segments,
        )
    except (KeyError, ValidationError) as error:
        raise ZeroplanError(str(path), f"missing or invalid field ({error})") from None
