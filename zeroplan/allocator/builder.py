"""Building a step's allocation trace: ids issued, events appended, byte totals split into
tensors (used by the planner's schedules, schedule.py and fsdp_schedule.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, Ops
from zeroplan.allocator.rules import MIN_BLOCK_BYTES
from zeroplan.allocator.streams import Stream

if TYPE_CHECKING:
    from zeroplan.allocator.trace import AllocationTrace


_ROUND = MIN_BLOCK_BYTES - 1
_MASK = ~_ROUND
"""(size + _ROUND) & _MASK: size rounded up to a multiple of 512 (a power of two); the mask kept,
not inverted again for every allocation and free."""


def proportional_bytes(total: int, weights: list[int]) -> list[int]:
    """``total`` in integer parts proportional to ``weights``, one per weight (the remainder on
    the largest)."""
    weight_sum = sum(weights)
    if total <= 0 or weight_sum <= 0:
        return [max(total, 0)] + [0] * (len(weights) - 1) if weights else []
    parts = [total * w // weight_sum for w in weights]
    parts[max(range(len(parts)), key=weights.__getitem__)] += total - sum(parts)
    return parts


def split_bytes(total: int, weights: list[int]) -> list[int]:
    """``total`` in integer parts proportional to ``weights`` (the remainder on the largest),
    zero parts left out."""
    if total <= 0:
        return []
    if sum(weights) <= 0:
        return [total]
    return [p for p in proportional_bytes(total, weights) if p > 0]


def even_parts(total: int, count: int) -> list[int]:
    """``total`` in ``count`` nearly equal parts (zero parts left out): split_bytes with equal
    weights, whose remainder goes on the first part (the first of the largest weights), in
    closed form (a trace build asks for several: the units' parameters, optimizer states,
    gradients and step temporaries)."""
    if total <= 0:
        return []
    count = max(count, 1)
    part, remainder = divmod(total, count)
    if part == 0:
        return [remainder]
    return [part + remainder] + [part] * (count - 1)


class TraceBuilder:
    """Issues ids and records allocations and frees, already compiled (replay.Ops): the planner
    replays them as they are; ``trace`` gives the typed AllocationTrace. Every id is issued
    here and freed at most once by the schedules, which is what compile_trace would check."""

    def __init__(self) -> None:
        self.ops: Ops = []
        self.marks: list[int] = []
        """Op indices where a schedule's loop begins an iteration (and where its last ends):
        hints for fast_replay.replay_ops, which checks every period it skips itself."""
        self.next_id = 0
        self._sizes: list[int] = []
        """Each id's requested bytes (ids are issued in order, from 0)."""
        self._alive = self._alive_rounded = 0
        self.requested_peak_bytes = 0
        """The most requested bytes alive at once (what a replay's requested peak reports)."""
        self.rounded_peak_bytes = 0
        """The same with every request rounded up to a multiple of 512 bytes (rules.round_size
        without roundup_power2_divisions)."""

    def alloc(self, size: int, stream: int = Stream.compute) -> list[int]:
        """alloc_parts of one part (the schedules' most frequent call, spelled out)."""
        if size <= 0:
            return []
        ident = self.next_id
        self.next_id = ident + 1
        self.ops.append((ALLOC_OP, ident, size, int(stream)))
        self._sizes.append(size)
        alive = self._alive = self._alive + size
        rounded = self._alive_rounded = self._alive_rounded + ((size + _ROUND) & _MASK)
        if alive > self.requested_peak_bytes:
            self.requested_peak_bytes = alive
        if rounded > self.rounded_peak_bytes:
            self.rounded_peak_bytes = rounded
        return [ident]

    def alloc_parts(self, parts, stream: int = Stream.compute) -> list[int]:
        """One allocation per positive part, in order (the schedules' hot path: one loop).
        The bytes alive only grow over the call, so its peaks are the totals at its end."""
        if not parts:
            return []  # a quarter of the schedules' calls (a term of 0 bytes split into none)
        ops, sizes, stream = self.ops, self._sizes, int(stream)
        ident = self.next_id
        alive, rounded = self._alive, self._alive_rounded
        out = []
        for size in parts:
            if size <= 0:
                continue
            ops.append((ALLOC_OP, ident, size, stream))
            sizes.append(size)
            out.append(ident)
            ident += 1
            alive += size
            rounded += (size + _ROUND) & _MASK
        self.next_id = ident
        self._alive, self._alive_rounded = alive, rounded
        if alive > self.requested_peak_bytes:
            self.requested_peak_bytes = alive
        if rounded > self.rounded_peak_bytes:
            self.rounded_peak_bytes = rounded
        return out

    def mark(self) -> None:
        """A loop iteration begins (or the last one ended) here (``marks``)."""
        self.marks.append(len(self.ops))

    def free(self, idents: list[int]) -> None:
        if not idents:
            return  # a quarter of the schedules' calls (what an allocation of 0 bytes returned)
        ops, sizes = self.ops, self._sizes
        alive, rounded = self._alive, self._alive_rounded
        for ident in idents:
            ops.append((FREE_OP, ident, 0, 0))
            size = sizes[ident]
            alive -= size
            rounded -= (size + _ROUND) & _MASK
        self._alive, self._alive_rounded = alive, rounded

    def step_start(self) -> tuple[int, ...]:
        """Where a step that repeat_step may record again begins (its ``start``): op index, id,
        mark count, the bytes alive, their rounded total and the peaks so far, which start
        again from here (-1: no allocation yet) until repeat_step."""
        start = (len(self.ops), self.next_id, len(self.marks), self._alive, self._alive_rounded,
                 self.requested_peak_bytes, self.rounded_peak_bytes)
        self.requested_peak_bytes = self.rounded_peak_bytes = -1
        return start

    def once_start(self) -> tuple[int, int, int, int]:
        """Before the allocations only the first step makes (repeat_step's ``once``): op index,
        id and the step's peaks so far (-1: none), which start again from here."""
        once = len(self.ops), self.next_id, self.requested_peak_bytes, self.rounded_peak_bytes
        self.requested_peak_bytes = self.rounded_peak_bytes = -1
        return once

    def repeat_step(self, start: tuple[int, ...], once: tuple[int, int, int, int], once_end: tuple[int, int]) -> bool:
        """Record again the step recorded since ``start`` (step_start), as recording the same
        calls again would, less the allocations made between ``once`` (once_start) and
        ``once_end`` (op index and id there), which the first step alone makes and never
        frees; False, recording nothing, where the step does not qualify: it frees an id it
        did not allocate or one made once, or leaves allocated more than those. The ids are
        shifted past the step. The bytes alive follow the first step's, raised by what it
        made once until it made them: the repeat's peaks (taken at each allocation call, as
        the builder takes them) are the first step's before ``once`` raised by those bytes,
        and its own from ``once`` on."""
        op_start, id_start, mark_start, alive_start, rounded_start, requested_peak, rounded_peak = start
        op_from, id_from, requested_before, rounded_before = once
        op_to, id_to = once_end
        requested_after, rounded_after = self.requested_peak_bytes, self.rounded_peak_bytes
        self.requested_peak_bytes = max(requested_peak, requested_before, requested_after)
        self.rounded_peak_bytes = max(rounded_peak, rounded_before, rounded_after)
        ops, sizes = self.ops, self._sizes
        op_end, id_end = len(ops), self.next_id
        held = sum(sizes[id_from:id_to])
        held_rounded = sum((size + _ROUND) & _MASK for size in sizes[id_from:id_to])
        if self._alive != alive_start + held or self._alive_rounded != rounded_start + held_rounded:
            return False
        for kind, ident, _, _ in ops[op_start:op_end]:
            if kind != ALLOC_OP and (kind != FREE_OP or not id_start <= ident < id_end or id_from <= ident < id_to):
                return False
        shift = id_end - id_start
        late_shift = shift - (id_to - id_from)
        append = ops.append
        for kind, ident, size, stream in ops[op_start:op_from]:
            append((kind, ident + shift, size, stream))
        for kind, ident, size, stream in ops[op_to:op_end]:
            append((kind, ident + (shift if ident < id_from else late_shift), size, stream))
        sizes.extend(sizes[id_start:id_from])
        sizes.extend(sizes[id_to:id_end])
        self.next_id = id_end + late_shift
        removed, offset = op_to - op_from, op_end - op_start
        self.marks.extend([mark + offset - (removed if mark >= op_to else 0) for mark in self.marks[mark_start:]])
        if requested_before >= 0:
            self.requested_peak_bytes = max(self.requested_peak_bytes, requested_before + held)
            self.rounded_peak_bytes = max(self.rounded_peak_bytes, rounded_before + held_rounded)
        return True

    def largest_request_bytes(self) -> int:
        """The largest request recorded (0 where there is none)."""
        return max(self._sizes, default=0)

    def trace(self, source: str) -> AllocationTrace:
        """The recorded step as a typed trace."""
        # The typed events' module is imported here, not with the builder: the planner replays
        # the ops as they are and never makes a typed trace, and the event models' classes cost
        # about 8.6 million instructions of each command's start to create (callgrind).
        from zeroplan.allocator.trace import AllocationTrace, AllocEvent, FreeEvent

        events = [AllocEvent(id=ident, size_bytes=size, stream=stream) if kind == ALLOC_OP else FreeEvent(id=ident)
                  for kind, ident, size, stream in self.ops]
        return AllocationTrace(events=tuple(events), source=source)
