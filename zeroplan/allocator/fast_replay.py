"""replay.replay made cheaper for the settings the planner replays most (no expandable
segments, no garbage collection), with the same result:

- DeviceAllocator's malloc and free fused into one loop: the same steps in the same order
  (device.py's methods, marked where each is inlined), without a method call per event; every
  rare path (a new segment, a retry, a recorded stream) goes through DeviceAllocator itself;
- an allocation served from the cache and freed by the next op changes only the peaks: the
  block (or the front split off it) merges back into the cached block it came from, whose
  neighbours are never available (they would have merged with it);
- a loop iteration of the schedule (TraceBuilder.marks) that repeats the one before it is
  applied in one step where the allocator's state proves it would act the same
  (_apply_repeats).

Every other setting goes through replay.replay, which stays the oracle
(MemoryAssumptions.exact_allocator); benchmarks/allocator_fast_sweep.py compares the two.

Why a repeated period may be applied in one step. Let a period (the ops between two marks)
free only what it allocates itself and record no stream, and let the cached blocks (every
pool's keys: stream, size, address) be the same at its end as at its start, with no device
allocation refused and nothing released. Then every block it leaves allocated lies in a
segment it created (a block carved from an older cached block would have changed that block's
key), those segments hold nothing else, and no later allocation or free in a period like it
touches them. The next period, with the same ops (ids shifted), therefore meets the same
cached blocks; it differs from this one only in where its new segments land, past every
earlier one by the same shift, which keeps every comparison of cached blocks (size, then
address) as it was. So it allocates the same, leaves the same cached blocks, and its segments
are this one's moved by the shift; its device allocations are refused (and then act
differently) only once the reserved bytes at its peak pass the capacity, which is checked
before a period is applied. benchmarks/allocator_fast_sweep.py compares the results with the
oracle's."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

from zeroplan.allocator.config import AllocatorConfig
from zeroplan.allocator.device import ADDRESS_ALIGN_BYTES, DeviceAllocator
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, RECORD_OP, SYNC_OP, Ops, ReplayResult, replay
from zeroplan.allocator.rules import MIN_BLOCK_BYTES, SMALL_SIZE_BYTES, allocation_size, block_may_serve, round_size
from zeroplan.allocator.state import SIZE_SHIFT, STREAM_SHIFT, Block


MAX_MISSES = 2
"""Periods checked in vain before a replay stops checking (each check copies the cached blocks'
keys): a schedule whose loop leaves cached blocks behind every iteration never repeats."""


def fused_applies(config: AllocatorConfig) -> bool:
    """The settings the fused loop covers: no expandable segments (their cached blocks grow
    into unmapped pages) and no garbage collection (it acts on every cache miss)."""
    return not config.expandable_segments and config.garbage_collection_threshold == 0.0


def replay_ops(ops: Ops, config: AllocatorConfig, capacity_bytes: int | None = None,
               marks: Sequence[int] = ()) -> ReplayResult:
    """replay.replay(ops, config, capacity_bytes), the fused loop and the periods between
    ``marks`` (op indices, ascending: TraceBuilder.marks) where they apply."""
    if not fused_applies(config):
        return replay(ops, config, capacity_bytes)
    device = DeviceAllocator(config, capacity_bytes)
    live: dict[int, Block] = {}
    sizes: dict[int, tuple[int, bool, int]] = {}
    oom = None
    start = 0
    before: _Snapshot | None = None
    misses = 0
    for end in (*marks, len(ops)):
        if end <= start:
            continue  # inside periods already applied
        if misses == MAX_MISSES:
            end = len(ops)  # checks stopped: the rest in one run
        peaks = device.allocated_peak, device.requested_peak, device.reserved_peak
        device.allocated_peak, device.requested_peak = device.allocated, device.requested
        device.reserved_peak = device.reserved
        oom = _run(device, ops, start, end, live, sizes)
        period_peaks = device.allocated_peak, device.requested_peak, device.reserved_peak
        device.allocated_peak, device.requested_peak, device.reserved_peak = map(max, peaks, period_peaks)
        if oom is not None or end == len(ops):
            break
        after = _Snapshot(device, end)
        if before is not None:
            resumed = _apply_repeats(device, ops, before, after, period_peaks, live)
            if resumed != end:
                start, before = resumed, None
                continue
            misses += 1
        start, before = end, after
    result = ReplayResult(
        completed=oom is None, oom_event_index=oom, oom_request_bytes=None if oom is None else ops[oom][2],
        requested_peak_bytes=device.requested_peak, allocated_peak_bytes=device.allocated_peak,
        reserved_peak_bytes=device.reserved_peak, device_alloc_calls=device.device_allocs,
        device_free_calls=device.device_frees, alloc_retries=device.retries, device_refusals=device.refusals,
        events_replayed=len(ops) if oom is None else oom,
    )
    _unlink(device, live)
    return result


def _unlink(device: DeviceAllocator, live: dict[int, Block]) -> None:
    """Break the links between a finished replay's blocks: each segment's blocks point at each
    other (prev, next), cycles that reference counting never frees, so each replay's hundreds of
    blocks waited for Python's cyclic collector (~4 % of a default fit's time went to its
    collections); unlinked, they go with the replay. Every block is allocated (``live``),
    cached (a pool's) or waiting on an event (pending)."""
    for blocks in (live.values(), device.small_pool.by_key.values(), device.large_pool.by_key.values(), device.pending):
        for block in blocks:
            block.prev = block.next = None


class _Snapshot:
    """What a period's check compares: the allocator's cached blocks and counters at an op."""

    __slots__ = ("index", "small_keys", "large_keys", "reserved", "allocated", "requested", "next_address",
                 "device_allocs", "untouched")

    def __init__(self, device: DeviceAllocator, index: int) -> None:
        self.index = index
        self.small_keys = list(device.small_pool.keys)
        self.large_keys = list(device.large_pool.keys)
        self.reserved, self.allocated, self.requested = device.reserved, device.allocated, device.requested
        self.next_address = device.next_address
        self.device_allocs = device.device_allocs
        self.untouched = (device.refusals, device.retries, device.device_frees)
        """What a period that may be repeated in one step leaves as it was (no refusal, no
        retry, nothing released)."""


def _apply_repeats(device: DeviceAllocator, ops: Ops, before: _Snapshot, after: _Snapshot,
                   period_peaks: tuple[int, int, int], live: dict[int, Block]) -> int:
    """Where the replay resumes after the period ops[before.index:after.index]: past every
    repeat of it that follows and that the state proves acts as it did (the module's
    docstring), applied here; else at its end."""
    start, end = before.index, after.index
    length = end - start
    if (after.untouched != before.untouched or device.pending or after.large_keys != before.large_keys
            or after.small_keys != before.small_keys):
        return end
    survivors = _survivors(ops, start, end)
    if survivors is None:
        return end
    first_alloc = next(i for i in range(start, end) if ops[i][0] == ALLOC_OP)
    if first_alloc + length >= len(ops):
        return end
    id_shift = ops[first_alloc + length][1] - ops[first_alloc][1]
    blocks = [live[ident] for ident in survivors]
    kept = set(map(id, blocks))
    for block in blocks:
        # What the docstring proves, checked: every block the period leaves allocated lies in a
        # segment it created, among blocks it left allocated.
        if block.ptr < before.next_address or (block.prev is not None and id(block.prev) not in kept) \
                or (block.next is not None and id(block.next) not in kept):
            return end
    address_shift = device.next_address - before.next_address
    reserved_step = after.reserved - before.reserved
    capacity = device.capacity
    reserved_rise = period_peaks[2] - before.reserved
    repeats = 0
    at = end
    while at + length <= len(ops) and before.reserved + (repeats + 1) * reserved_step + reserved_rise <= capacity \
            and _repeats(ops, at - length, at, id_shift):
        repeats += 1
        at += length
    if repeats == 0:
        return end
    # The repeated periods' allocated blocks, each period's moved by the address shift.
    for repeat in range(1, repeats + 1):
        moved: dict[int, Block] = {}
        shift = repeat * address_shift
        for ident, block in zip(survivors, blocks):
            copy = Block(block.stream, block.size, block.ptr + shift, block.small)
            copy.allocated = True
            copy.requested = block.requested
            moved[id(block)] = copy
            live[ident + repeat * id_shift] = copy
        for block in blocks:
            copy = moved[id(block)]
            if block.prev is not None:
                copy.prev = moved[id(block.prev)]
            if block.next is not None:
                copy.next = moved[id(block.next)]
    allocated_step, requested_step = after.allocated - before.allocated, after.requested - before.requested
    device.next_address += repeats * address_shift
    device.reserved += repeats * reserved_step
    device.allocated += repeats * allocated_step
    device.requested += repeats * requested_step
    device.device_allocs += repeats * (after.device_allocs - before.device_allocs)
    # Each repeat's peaks are the period's, raised by its start: the largest at the first or last.
    for repeat in (1, repeats):
        device.allocated_peak = max(device.allocated_peak, period_peaks[0] + repeat * allocated_step)
        device.requested_peak = max(device.requested_peak, period_peaks[1] + repeat * requested_step)
        device.reserved_peak = max(device.reserved_peak, period_peaks[2] + repeat * reserved_step)
    return at


def _survivors(ops: Ops, start: int, end: int) -> list[int] | None:
    """The ids the period ops[start:end] allocates and leaves allocated, in order; None where it
    frees what it did not allocate, records a stream, synchronises or allocates nothing."""
    alive: dict[int, None] = {}
    for kind, ident, _, _ in ops[start:end]:
        if kind == ALLOC_OP:
            alive[ident] = None
        elif kind != FREE_OP or ident not in alive:
            return None
        else:
            del alive[ident]
    return list(alive) if len(alive) or any(op[0] == ALLOC_OP for op in ops[start:end]) else None


def _repeats(ops: Ops, start: int, end: int, id_shift: int) -> bool:
    """Whether the ops from ``end`` on repeat ops[start:end], ids shifted by ``id_shift``."""
    length = end - start
    for offset in range(length):
        kind, ident, size, stream = ops[start + offset]
        if ops[end + offset] != (kind, ident + id_shift, size, stream):
            return False
    return True


def _run(device: DeviceAllocator, ops: Ops, start: int, end: int, live: dict[int, Block],
         sizes: dict[int, tuple[int, bool, int]]) -> int | None:
    """Replay ops[start:end] on ``device``: DeviceAllocator.malloc and free inline. The index
    of the request that ran out of memory, or None. ``sizes``: each request size seen, its
    rounded size, pool (small) and rounded size shifted into a cached block's key, kept
    between the calls of one replay (they depend on the size and the setting alone)."""
    config = device.config
    small_pool, large_pool = device.small_pool, device.large_pool
    split_limited, max_split = device.split_limited, config.max_split_size_bytes
    forget = live.pop
    by_key_small, by_key_large = small_pool.by_key, large_pool.by_key
    keys_small, keys_large = small_pool.keys, large_pool.keys
    allocated, requested = device.allocated, device.requested
    allocated_peak, requested_peak = device.allocated_peak, device.requested_peak
    capacity = device.capacity
    # A block is available to merge when free, with no outstanding event and no recorded
    # stream (state.available); until a stream is recorded in this replay no block has either,
    # and being free decides it.
    plain = device.stream_records == 0
    oom = None
    last = end - 1
    skip = -1
    for index in range(start, end):
        if index == skip:
            continue
        kind, ident, size_bytes, stream = ops[index]
        if kind == ALLOC_OP:
            # DeviceAllocator.malloc.
            known = sizes.get(size_bytes)
            if known is None:
                rounded = round_size(size_bytes, config)
                known = sizes[size_bytes] = (rounded, rounded <= SMALL_SIZE_BYTES, rounded << SIZE_SHIFT)
            size, small, shifted = known
            if small:
                keys, by_key = keys_small, by_key_small
            else:
                keys, by_key = keys_large, by_key_large
            # get_free_block (no expandable segments: the first candidate is the block).
            at = bisect_left(keys, (stream << STREAM_SHIFT) | shifted)
            block = None
            if at < len(keys):
                key = keys[at]
                if key >> STREAM_SHIFT == stream:
                    block = by_key[key]
                    if split_limited and not block_may_serve(block.size, size, config):
                        block = None
                    elif index < last and (following := ops[index + 1])[1] == ident and following[0] == FREE_OP:
                        # Freed at once: the block (or its front, split off) merges back into what
                        # it was cut from (a cached block's neighbours are never available: they
                        # would have merged), so the cache is as it was; only the peaks move.
                        remaining_bytes = block.size - size
                        if small:
                            whole = remaining_bytes < MIN_BLOCK_BYTES
                        else:
                            whole = not (size < max_split and remaining_bytes > SMALL_SIZE_BYTES)
                        if allocated + (block.size if whole else size) > allocated_peak:
                            allocated_peak = allocated + (block.size if whole else size)
                        if requested + size_bytes > requested_peak:
                            requested_peak = requested + size_bytes
                        skip = index + 1
                        continue
                    else:
                        del by_key[key]
                        del keys[at]
            if block is None:
                alloc_size = allocation_size(size)
                reserved = device.reserved + alloc_size
                if reserved <= capacity:
                    # alloc_block with _address and _reserve inline (no measured run's addresses here).
                    device.reserved = reserved
                    if reserved > device.reserved_peak:
                        device.reserved_peak = reserved
                    device.device_allocs += 1
                    ptr = device.next_address
                    device.next_address = ptr + -(-alloc_size // ADDRESS_ALIGN_BYTES) * ADDRESS_ALIGN_BYTES
                    block = Block(stream, alloc_size, ptr, small)
                else:
                    # A refusal: alloc_block refuses it again (and counts it), then the retries.
                    pool = small_pool if small else large_pool
                    block = device._alloc_new_block(pool, stream, size, alloc_size)
                    if not block:
                        oom = index
                        break
            # alloc_found_block.
            remaining_bytes = block.size - size
            if small:
                split = remaining_bytes >= MIN_BLOCK_BYTES
            else:
                split = size < max_split and remaining_bytes > SMALL_SIZE_BYTES
            if split:
                remaining = block
                ptr = remaining.ptr
                block = Block(stream, size, ptr, small)
                block.prev = before = remaining.prev
                if before is not None:
                    before.next = block
                block.next = remaining
                remaining.prev = block
                ptr += size
                remaining.ptr = ptr
                remaining.size = remaining_bytes
                key = (stream << STREAM_SHIFT) | (remaining_bytes << SIZE_SHIFT) | ptr
                insort(keys, key)
                by_key[key] = remaining
            block.allocated = True
            block.requested = size_bytes
            allocated += block.size
            requested += size_bytes
            if allocated > allocated_peak:
                allocated_peak = allocated
            if requested > requested_peak:
                requested_peak = requested
            live[ident] = block
        elif kind == FREE_OP:
            # DeviceAllocator.free.
            block = forget(ident)
            block.allocated = False
            size = block.size
            allocated -= size
            requested -= block.requested
            if not plain and block.stream_uses:
                block.event_count = len(block.stream_uses)
                block.stream_uses = ()
                device.pending.append(block)
                continue
            # free_block, try_merge_blocks inline (every block is mapped here).
            if block.small:
                keys, by_key = keys_small, by_key_small
            else:
                keys, by_key = keys_large, by_key_large
            stream = block.stream << STREAM_SHIFT
            ptr = block.ptr
            before = block.prev
            if before is not None and not before.allocated and (plain or (not before.event_count and not before.stream_uses)):
                before_size = before.size
                key = stream | (before_size << SIZE_SHIFT) | before.ptr
                del keys[bisect_left(keys, key)]
                del by_key[key]
                ptr = block.ptr = before.ptr
                size += before_size
                block.prev = preceding = before.prev
                if preceding is not None:
                    preceding.next = block
            after = block.next
            if after is not None and not after.allocated and (plain or (not after.event_count and not after.stream_uses)):
                after_size = after.size
                key = stream | (after_size << SIZE_SHIFT) | after.ptr
                del keys[bisect_left(keys, key)]
                del by_key[key]
                block.next = following = after.next
                if following is not None:
                    following.prev = block
                size += after_size
            block.size = size
            key = stream | (size << SIZE_SHIFT) | ptr
            insort(keys, key)
            by_key[key] = block
        elif kind == RECORD_OP:
            device.record_stream(live[ident], stream)
            plain = False
        elif kind == SYNC_OP:
            device.synchronize()
        else:
            device.empty_cache()
    device.allocated, device.requested = allocated, requested
    device.allocated_peak, device.requested_peak = allocated_peak, requested_peak
    return oom
