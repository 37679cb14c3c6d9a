"""A ``torch.cuda.memory._snapshot()`` pickle read without torch (``zeroplan validate --from-log
FILE.pickle``): the dict torch 2.13 returns (torch/cuda/memory.py ``_snapshot``;
c10/cuda/CUDACachingAllocator.h ``SegmentInfo``, ``BlockInfo``, ``TraceEntry``), pickled with
``pickle.dump(torch.cuda.memory._snapshot(), f)`` after ``torch.cuda.memory._record_memory_history()``,
or written by ``zeroplan measure --memory-snapshot`` (zeroplan.harness.snapshot).

Figures read:

- allocated: the peak of a replay of ``device_traces`` (``alloc`` adds a block's size,
  ``free_completed`` takes it away: the allocator's allocated_bytes counter falls when the block
  is freed, not when the free is requested while a stream still uses it). The trace is a ring
  buffer (``max_entries``): when it began after blocks that were still live, the replay is
  anchored on the segments' ``allocated_size`` at the snapshot (peak = allocated at the end +
  the replay's highest point - its last);
- reserved: the peak of a replay of the segment events (``segment_alloc``/``segment_map`` add,
  ``segment_free``/``segment_unmap`` take away), anchored the same way on the segments'
  ``total_size``; with no segment event in the trace, the segments' total at the snapshot,
  which is not a peak (said in the note);
- active: the segments' ``active_size`` at the snapshot (not a peak).

The pickle is read with an unpickler that takes no class, function or module: the snapshot is
dicts, lists, strings and numbers, and anything else is refused (a pickle can run code)."""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path

from zeroplan.errors import ZeroplanError

STACK = "torch.cuda.memory._snapshot()"
PICKLE_START = b"\x80"
"""Pickle protocols 2 and above begin with the PROTO opcode."""


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}; a memory snapshot holds only plain data")


def is_pickle(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(1) == PICKLE_START
    except OSError:
        return False


def load_snapshot(path: Path) -> dict:
    try:
        data = path.read_bytes()
        snapshot = _DataOnly(io.BytesIO(data)).load()
    except OSError as error:
        raise ZeroplanError("--from-log", f"cannot read {str(path)!r}: {error.strerror or error}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as error:
        raise ZeroplanError("--from-log", f"{str(path)!r} is a pickle but not a memory snapshot: {error}") from None
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("device_traces", []), list) \
            or not isinstance(snapshot.get("segments", []), list) or not ({"device_traces", "segments"} & set(snapshot)):
        raise ZeroplanError("--from-log", f"{str(path)!r} is a pickle but not torch.cuda.memory._snapshot()'s dict "
                                          "(allowed: a dict with segments and device_traces)")
    return snapshot


def _replay(trace: list[dict], grows: set[str], shrinks: set[str], path: Path) -> tuple[int, int, int] | None:
    """(highest, last, events) of the running total over ``trace``; None if no event counts."""
    total = highest = counted = 0
    for entry in trace:
        action = entry.get("action") if isinstance(entry, dict) else None
        if action in grows or action in shrinks:
            size = entry.get("size")
            if not isinstance(size, int) or size < 0:
                raise ZeroplanError("--from-log", f"{str(path)!r}: a {action} trace entry without a byte size: {entry!r:.120}")
            total += size if action in grows else -size
            highest = max(highest, total)
            counted += 1
    return (highest, total, counted) if counted else None


def _segments_sum(segments: list, key: str) -> int | None:
    values = [s.get(key) for s in segments if isinstance(s, dict)]
    return sum(v for v in values if isinstance(v, int)) if values else None


@dataclass(frozen=True)
class SnapshotFigure:
    figure: str
    """allocated, reserved or active."""
    bytes: int
    events: int
    """How many trace entries (or segments) it was read from."""
    note: str


def read_snapshot(path: Path) -> list[SnapshotFigure]:
    """The figures of a snapshot pickle: see the module docstring."""
    snapshot = load_snapshot(path)
    traces = snapshot.get("device_traces", [])
    if len(traces) > 1 and sum(1 for t in traces if t) > 1:
        raise ZeroplanError("--from-log", f"{str(path)!r} traces {sum(1 for t in traces if t)} devices; give one "
                                          "rank's snapshot (allowed: one device's events)")
    trace = next((t for t in traces if t), [])
    segments = snapshot.get("segments", [])
    result: list[SnapshotFigure] = []
    allocated_end = _segments_sum(segments, "allocated_size")
    blocks = _replay(trace, {"alloc"}, {"free_completed"}, path)
    if blocks is not None:
        highest, last, count = blocks
        peak, note = highest, "peak of the device_traces replay (alloc, free_completed)"
        if allocated_end is not None and allocated_end != last:
            peak = allocated_end + highest - last
            note += f"; anchored on the segments' allocated_size at the snapshot ({allocated_end} bytes)"
        result.append(SnapshotFigure("allocated", peak, count, note))
    elif allocated_end is not None:
        result.append(SnapshotFigure("allocated", allocated_end, len(segments),
                                       "the segments' allocated_size at the snapshot, not a peak (no trace recorded)"))
    reserved_end = _segments_sum(segments, "total_size")
    reserved = _replay(trace, {"segment_alloc", "segment_map"}, {"segment_free", "segment_unmap"}, path)
    if reserved is not None:
        highest, last, count = reserved
        base = (reserved_end - last) if reserved_end is not None else 0
        result.append(SnapshotFigure("reserved", base + highest, count,
                                       "peak of the segment events' replay" + (" anchored on the segments' total_size"
                                                                               if base else "")))
    elif reserved_end:
        result.append(SnapshotFigure("reserved", reserved_end, len(segments),
                                       "the segments' total_size at the snapshot, not a peak"))
    active = _segments_sum(segments, "active_size")
    if active:
        result.append(SnapshotFigure("active", active, len(segments),
                                       "the segments' active_size at the snapshot, not a peak"))
    if not result:
        raise ZeroplanError("--from-log", f"{str(path)!r}: the snapshot has no allocation event and no segment "
                                          "(allowed: a snapshot taken after _record_memory_history(), or with live segments)")
    return result
