"""The CPU allocator trace: the replay of allocator events, and the real profiler behind it."""

from __future__ import annotations

import threading
import time

import torch

from zeroplan.harness.allocator_trace import (
    Allocation, AllocatorTrace, Use, free_on_this_thread, step_peaks, with_unseen_frees,
)

MiB = 2**20


def _alloc(t: int, size: int, ptr: int, op: str = "aten::empty", collective_end_ns: int | None = None,
           allocation_id: int | None = None) -> Allocation:
    return Allocation(time_ns=t, size_bytes=size, ptr=ptr, operator=op, collective_end_ns=collective_end_ns,
                      allocation_id=allocation_id)


def test_replay_finds_the_peak_and_who_allocated_what_was_live():
    events = [
        _alloc(1, 100, 0xA, "aten::mm"), _alloc(2, 50, 0xB, "aten::add"), _alloc(3, -100, 0xA),
        _alloc(4, 30, 0xC, "aten::mm"), _alloc(5, -50, 0xB), _alloc(6, -30, 0xC),
    ]
    peak = step_peaks(events, {0: (1, 6)})[0]
    assert peak.peak_bytes == 150
    assert peak.live_bytes_by_operator == {"aten::mm": 100, "aten::add": 50}


def test_a_step_only_sees_its_own_window_but_counts_what_was_live_before():
    events = [_alloc(1, 100, 0xA), _alloc(5, 20, 0xB), _alloc(6, -20, 0xB), _alloc(9, 70, 0xC)]
    peaks = step_peaks(events, {0: (4, 7), 1: (8, 10)})
    assert peaks[0].peak_bytes == 120
    assert peaks[1].peak_bytes == 170


def test_an_address_allocated_again_was_freed_unseen_in_between():
    events = [_alloc(1, 100, 0xA), _alloc(2, 60, 0xA)]  # the free of the first block is missing
    assert step_peaks(events, {0: (1, 2)})[0].peak_bytes == 100


def test_a_collective_temporary_without_a_seen_free_is_freed_when_the_call_returns():
    events = [_alloc(1, 40, 0xA, "aten::empty_strided", collective_end_ns=3), _alloc(5, 10, 0xB)]
    replayed = with_unseen_frees(events)
    assert [(a.time_ns, a.size_bytes) for a in replayed] == [(1, 40), (3, -40), (5, 10)]
    assert step_peaks(events, {0: (4, 6)})[0].peak_bytes == 10


def test_a_collective_temporary_whose_free_was_seen_is_left_alone():
    events = [_alloc(1, 40, 0xA, collective_end_ns=3), _alloc(2, -40, 0xA), _alloc(4, 8, 0xA)]
    assert len(with_unseen_frees(events)) == 3


def test_the_profiler_counts_every_cpu_tensor_including_resized_storages():
    with AllocatorTrace() as trace:
        kept = torch.empty(MiB // 4)  # 1 MiB, alive through the step
        with trace.step(0):
            a = torch.empty(MiB // 2)  # 2 MiB
            b = torch.empty(0)
            b.untyped_storage().resize_(3 * MiB)  # a storage refilled in place: 3 MiB more
            del a, b
        with trace.step(1):
            c = torch.empty(MiB // 8)  # 0.5 MiB
            del c
    peaks = trace.peaks()
    assert kept.numel() == MiB // 4
    assert peaks[0].peak_bytes == 6 * MiB
    assert peaks[1].peak_bytes == MiB + MiB // 2


def test_a_disabled_trace_records_nothing():
    with AllocatorTrace(enabled=False) as trace:
        with trace.step(0):
            torch.empty(16)
    assert trace.peaks() == {}


def test_free_on_this_thread_waits_for_another_holder_so_the_free_is_seen():
    with AllocatorTrace() as trace:
        with trace.step(0):
            t = torch.empty(MiB // 2)  # 2 MiB
            holder = [t.view(2, -1)]  # another tensor on the same storage, as a worker would hold

            def release_later() -> None:
                time.sleep(0.05)
                holder.clear()

            thread = threading.Thread(target=release_later)
            thread.start()
            free_on_this_thread(t)
            del t
            thread.join()
        with trace.step(1):
            d = torch.empty(MiB // 4)  # 1 MiB; the 2 MiB block must no longer count
            del d
    assert trace.peaks()[1].peak_bytes == MiB




def test_a_block_handed_to_a_collective_and_freed_unseen_dies_after_its_last_use():
    # Block 1 went to a collective, was last used by an operator ending at 3, and its free was
    # not seen; block 2 (an optimizer state made in step 0) was never freed and stays live.
    events = [
        _alloc(2, 24, 0xA, "aten::empty", allocation_id=1), _alloc(2, 8, 0xB, "aten::zeros_like", allocation_id=2),
        _alloc(6, 1, 0xC, allocation_id=3),
    ]
    uses = [Use(allocation_id=1, end_ns=2, collective=True), Use(allocation_id=1, end_ns=3, collective=False)]
    peaks = step_peaks(events, {0: (1, 4), 1: (5, 7)}, uses)
    assert peaks[0].peak_bytes == 32
    assert peaks[1].peak_bytes == 9


def test_a_later_block_at_the_same_address_does_not_lend_its_uses_to_the_earlier_one():
    # FSDP2's all-gather output (block 1, 24 bytes) goes to a collective, is copied out by an
    # operator ending at 3 and freed unseen by gloo's worker thread; a 6-byte block allocated at
    # its address at 10 gets the same id from the profiler (no free seen between them) and is
    # used until 12. The first block dies at 3, not at 10 where its address is used again.
    events = [
        _alloc(2, 24, 0xA, allocation_id=1), _alloc(5, 2, 0xB, allocation_id=2),
        _alloc(10, 6, 0xA, "aten::empty_strided", allocation_id=1), _alloc(13, -6, 0xA, allocation_id=1),
    ]
    uses = [Use(allocation_id=1, end_ns=2, collective=True), Use(allocation_id=1, end_ns=3, collective=False),
            Use(allocation_id=1, end_ns=12, collective=False)]
    peaks = step_peaks(events, {0: (4, 6)}, uses)
    assert peaks[0].peak_bytes == 2


def test_the_snapshot_trace_replays_to_the_allocator_peak() -> None:
    """zeroplan.harness.snapshot: the events as torch.cuda.memory._snapshot()'s device trace; a
    block allocated at a live address frees the one before (as _replay does), so the replay of
    the written trace peaks where the allocator trace's does."""
    from zeroplan.harness.allocator_trace import Allocation, _replay
    from zeroplan.harness.snapshot import snapshot_of

    events = [Allocation(time_ns=1000, size_bytes=100, ptr=1, operator="aten::empty"),
              Allocation(time_ns=2000, size_bytes=50, ptr=2, operator="aten::mul"),
              Allocation(time_ns=3000, size_bytes=-100, ptr=1, operator="aten::empty"),
              Allocation(time_ns=4000, size_bytes=70, ptr=2, operator="aten::add")]  # 2's free unseen
    snapshot = snapshot_of(events)
    assert snapshot["segments"] == []
    (trace,) = snapshot["device_traces"]
    assert [(e["action"], e["addr"], e["size"]) for e in trace] == [
        ("alloc", 1, 100), ("alloc", 2, 50), ("free_completed", 1, 100), ("free_completed", 2, 50), ("alloc", 2, 70)]
    assert trace[0]["frames"][0]["name"] == "aten::empty" and trace[0]["time_us"] == 1
    total = highest = 0
    for entry in trace:
        total += entry["size"] if entry["action"] == "alloc" else -entry["size"]
        highest = max(highest, total)
    assert highest == max(t for _, t in _replay(events)) == 150
