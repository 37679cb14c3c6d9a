"""A measured CPU run's allocations written in the layout of ``torch.cuda.memory._snapshot()``
(``zeroplan measure --memory-snapshot``), so that ``zeroplan validate --from-log`` reads the
harness's runs and a GPU run's own snapshot the same way.

torch 2.13's snapshot (torch/cuda/memory.py ``_snapshot``, c10/cuda/CUDACachingAllocator.h
``TraceEntry``) is a dict: ``segments`` (the allocator's cudaMalloc'd segments and their blocks
at the moment of the call) and ``device_traces`` (per device, the recorded events, each with
``action``, ``addr``, ``size``, ``stream``, ``time_us`` and ``frames``). The CPU allocator has no
segments and no cache, so ``segments`` is empty and the trace holds ``alloc`` and
``free_completed`` events only (a free on the CPU completes at once; there is no
``free_requested`` wait for a stream), each framed by the operator that allocated the block.
The events are the allocator trace's (zeroplan.harness.allocator_trace): the frees gloo's worker
thread makes unseen are added where that module adds them, and a block allocated at a live
address frees the one before, so a replay of this trace gives the record's allocator peaks."""

from __future__ import annotations

import pickle
from pathlib import Path

from zeroplan.atomic import write_atomic
from zeroplan.harness.allocator_trace import Allocation

CPU_DEVICE_NOTE = "zeroplan harness: CPU allocator events (no segments, no cache)"


def _entry(action: str, address: int, size: int, time_ns: int, operator: str) -> dict:
    return {"action": action, "addr": address, "size": size, "stream": 0, "time_us": time_ns // 1000,
            "frames": [{"name": operator, "filename": "", "line": 0}]}


def snapshot_of(events: list[Allocation]) -> dict:
    """The events (time order, as AllocatorTrace.events gives them) as a snapshot dict."""
    live: dict[int, Allocation] = {}
    trace: list[dict] = []
    for event in events:
        previous = live.pop(event.ptr, None)
        if previous is not None:  # freed before this event at its address, seen or not
            trace.append(_entry("free_completed", event.ptr, previous.size_bytes, event.time_ns, previous.operator))
        if event.size_bytes > 0:
            live[event.ptr] = event
            trace.append(_entry("alloc", event.ptr, event.size_bytes, event.time_ns, event.operator))
    return {"segments": [], "device_traces": [trace], "allocator_settings": {"note": CPU_DEVICE_NOTE}}


def write_snapshot(path: Path, events: list[Allocation]) -> None:
    data = pickle.dumps(snapshot_of(events), protocol=4)
    write_atomic(path, lambda temporary: temporary.write_bytes(data))
