"""replay.replay made cheaper for the settings the planner replays most (no expandable
segments, no garbage collection), with the same result:

- DeviceAllocator's malloc and free fused into one loop: the same steps in the same order
  (device.py's methods, marked where each is inlined, a refused device allocation's release of
  the cache and retry included), without a method call per event, on blocks held as plain
  lists (_BLOCK_FIELDS: a list is made in about a sixth of a Block's time, and a step makes one
  at most splits); where a replay meets what the loop does not cover (a recorded stream, a
  synchronisation, an emptied cache, a refused device allocation under max_split_size, whose
  release picks blocks by size), its blocks become DeviceAllocator's Blocks (_as_blocks) and
  DeviceAllocator itself replays the rest;
- an allocation served from the cache and freed by the next op changes only the peaks: the
  block (or the front split off it) merges back into the cached block it came from, whose
  neighbours are never available (they would have merged with it);
- a loop iteration of the schedule (TraceBuilder.marks) that repeats the one before it is
  applied in one step where the allocator's state proves it would act the same
  (_apply_repeats);
- the frees after the trace's last allocation are not replayed: they change nothing a replay
  reports (_last_allocation_end).

Expandable segments without garbage collection (torchtitan's launch default) replay in a loop of
their own on DeviceAllocator's blocks and pools (_replay_expandable: malloc's and free's steps
inline, a cache miss's mapping of pages and a refused device allocation DeviceAllocator's). Every
other setting goes through replay.replay, which stays the oracle
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
from zeroplan.allocator.device import ADDRESS_ALIGN_BYTES, DeviceAllocator, _expandable_size
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, RECORD_OP, SYNC_OP, Ops, ReplayResult, replay, run_ops
from zeroplan.allocator.rules import MIN_BLOCK_BYTES, SMALL_SIZE_BYTES, allocation_size, block_may_serve, round_size
from zeroplan.allocator.state import SIZE_SHIFT, STREAM_SHIFT, Block


MAX_MISSES = 2
"""Periods checked in vain before a replay stops checking (each check copies the cached blocks'
keys): a schedule whose loop leaves cached blocks behind every iteration never repeats."""

_BLOCK_FIELDS = ("size", "ptr", "prev", "next", "allocated", "requested", "small", "stream", "key")
_FIELD_INDICES = tuple(range(len(_BLOCK_FIELDS)))
SIZE, PTR, PREV, NEXT, ALLOCATED, REQUESTED, SMALL, STREAM, KEY = _FIELD_INDICES
"""A block of the fused loop: a list of state.Block's fields that the loop reads, in this order
(the indices above), and its key in its pool while it is cached (set as it goes in, so a merge
finds it without working it out); a list, not a Block, because the loop makes one at every
split."""

FastBlock = list


def fused_applies(config: AllocatorConfig) -> bool:
    """The settings the fused loop covers: no expandable segments (their cached blocks grow
    into unmapped pages) and no garbage collection (it acts on every cache miss)."""
    return not config.expandable_segments and config.garbage_collection_threshold == 0.0


def replay_ops(ops: Ops, config: AllocatorConfig, capacity_bytes: int | None = None,
               marks: Sequence[int] = ()) -> ReplayResult:
    """replay.replay(ops, config, capacity_bytes), the fused loop and the periods between
    ``marks`` (op indices, ascending: TraceBuilder.marks) where they apply; under expandable
    segments (without garbage collection) DeviceAllocator's own blocks in one loop
    (_replay_expandable)."""
    if not fused_applies(config):
        if config.expandable_segments and config.garbage_collection_threshold == 0.0:
            return _replay_expandable(ops, config, capacity_bytes)
        return replay(ops, config, capacity_bytes)
    device = DeviceAllocator(config, capacity_bytes)
    live: dict = {}
    cached: tuple[list[FastBlock], list[FastBlock]] = ([], [])
    sizes: dict = {}
    oom = None
    handed_over = False
    start = 0
    before: _Snapshot | None = None
    misses = 0
    last = _last_allocation_end(ops)
    for end in (*marks, last):
        end = min(end, last)
        if end <= start:
            continue  # inside periods already applied
        if misses == MAX_MISSES:
            end = last  # checks stopped: the rest in one run
        peaks = device.allocated_peak, device.requested_peak, device.reserved_peak
        device.allocated_peak, device.requested_peak = device.allocated, device.requested
        device.reserved_peak = device.reserved
        stop = _run(device, ops, start, end, live, cached, sizes)
        if stop is not None:
            oom, handed_over = stop
            if handed_over:
                live = _as_blocks(device, live, cached)
                oom = run_ops(device, ops, oom, live)
        period_peaks = device.allocated_peak, device.requested_peak, device.reserved_peak
        device.allocated_peak, device.requested_peak, device.reserved_peak = map(max, peaks, period_peaks)
        if stop is not None or end == last:
            break
        after = _Snapshot(device, end)
        if before is not None:
            resumed = _apply_repeats(device, ops, before, after, period_peaks, live)
            if resumed != end:
                start, before = resumed, None
                continue
            misses += 1
        start, before = end, after
    result = _result(device, ops, oom)
    _unlink(device, live, cached, handed_over)
    return result


def _result(device: DeviceAllocator, ops: Ops, oom: int | None) -> ReplayResult:
    """What replay.replay reports of ``ops`` once ``device`` has run them (to ``oom``, the
    request that ran out, where one did)."""
    return ReplayResult.trusted(
        completed=oom is None, oom_event_index=oom, oom_request_bytes=None if oom is None else ops[oom][2],
        requested_peak_bytes=device.requested_peak, allocated_peak_bytes=device.allocated_peak,
        reserved_peak_bytes=device.reserved_peak, device_alloc_calls=device.device_allocs,
        device_free_calls=device.device_frees, alloc_retries=device.retries, device_refusals=device.refusals,
        events_replayed=len(ops) if oom is None else oom,
    )


def _last_allocation_end(ops: Ops) -> int:
    """The index past the trace's last op that is not a free: the frees after it change nothing
    a replay reports (a free never releases a segment, and it only lowers what is allocated and
    requested, so no peak moves; nothing is allocated after it, so the cache they fill is never
    searched), and the replay stops there (the step's last gradients, ~4 % of a default fit's
    events)."""
    last = len(ops)
    while last and ops[last - 1][0] == FREE_OP:
        last -= 1
    return last


def _unlink(device: DeviceAllocator, live: dict, cached: tuple[list[FastBlock], list[FastBlock]],
            blocks_made: bool) -> None:
    """Break the links between a finished replay's blocks: each segment's blocks point at each
    other (prev, next), cycles that reference counting never frees, so each replay's hundreds of
    blocks waited for Python's cyclic collector (~4 % of a default fit's time went to its
    collections); unlinked, they go with the replay. Every block is allocated (``live``) or
    cached (``cached``; once DeviceAllocator took over, ``blocks_made``, the pools' Blocks, or
    waiting on an event: pending; under expandable segments also a segment's unmapped pages)."""
    if blocks_made:
        small, large = device.small_pool, device.large_pool
        for blocks in (live.values(), small.by_key.values(), large.by_key.values(), small.unmapped.values(),
                       large.unmapped.values(), device.pending):
            for block in blocks:
                block.prev = block.next = None
        return
    for blocks in (live.values(), *cached):
        for block in blocks:
            block[PREV] = block[NEXT] = None


def _as_blocks(device: DeviceAllocator, live: dict[int, FastBlock],
               cached: tuple[list[FastBlock], list[FastBlock]]) -> dict[int, Block]:
    """The fused loop's blocks as DeviceAllocator's (the same sizes, addresses, links and
    pools; every block is allocated or cached): the allocations by id, returned, and the cached
    ones in their pools (Pool.by_key)."""
    made: dict[int, Block] = {}
    lists: list[FastBlock] = []

    def block_of(fast: FastBlock) -> Block:
        block = made.get(id(fast))
        if block is None:
            block = made[id(fast)] = Block(fast[STREAM], fast[SIZE], fast[PTR], fast[SMALL])
            block.allocated, block.requested = fast[ALLOCATED], fast[REQUESTED]
            lists.append(fast)
        return block

    blocks = {ident: block_of(fast) for ident, fast in live.items()}
    for pool, blocks_cached in zip((device.large_pool, device.small_pool), cached):
        pool.by_key = {key: block_of(fast) for key, fast in zip(pool.keys, blocks_cached)}
    for fast in lists:
        block = made[id(fast)]
        block.prev = None if fast[PREV] is None else made[id(fast[PREV])]
        block.next = None if fast[NEXT] is None else made[id(fast[NEXT])]
        fast[PREV] = fast[NEXT] = None
    return blocks


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
                   period_peaks: tuple[int, int, int], live: dict[int, FastBlock]) -> int:
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
        if block[PTR] < before.next_address or (block[PREV] is not None and id(block[PREV]) not in kept) \
                or (block[NEXT] is not None and id(block[NEXT]) not in kept):
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
        moved: dict[int, FastBlock] = {}
        shift = repeat * address_shift
        for ident, block in zip(survivors, blocks):
            copy = [block[SIZE], block[PTR] + shift, None, None, True, block[REQUESTED], block[SMALL], block[STREAM], 0]
            moved[id(block)] = copy
            live[ident + repeat * id_shift] = copy
        for block in blocks:
            copy = moved[id(block)]
            if block[PREV] is not None:
                copy[PREV] = moved[id(block[PREV])]
            if block[NEXT] is not None:
                copy[NEXT] = moved[id(block[NEXT])]
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


def _size_facts(size_bytes: int, stream: int, device: DeviceAllocator,
                blocks: tuple[list[FastBlock], list[FastBlock]]) -> tuple:
    """What the fused loop needs of a request's size on a stream (it depends on those and the
    setting alone, so each replay works it out once): the rounded size, its pool (small), the
    key get_free_block searches from (the stream's blocks of at least that size), the first key
    past the stream's, the stream's bits of a key, the segment a cache miss allocates
    (get_allocation_size), the address space that segment takes, and the pool's keys and
    blocks (``blocks``: the large pool's, the small pool's)."""
    size = round_size(size_bytes, device.config)
    small = size <= SMALL_SIZE_BYTES
    pool = device.small_pool if small else device.large_pool
    alloc_size = allocation_size(size)
    advance = -(-alloc_size // ADDRESS_ALIGN_BYTES) * ADDRESS_ALIGN_BYTES
    stream_bits = stream << STREAM_SHIFT
    return (size, small, stream_bits | (size << SIZE_SHIFT), (stream + 1) << STREAM_SHIFT, stream_bits, alloc_size,
            advance, pool.keys, blocks[small])


def _run(device: DeviceAllocator, ops: Ops, start: int, end: int, live: dict[int, FastBlock],
         cached: tuple[list[FastBlock], list[FastBlock]], sizes: dict) -> tuple[int, bool] | None:
    """Replay ops[start:end] on ``device``: DeviceAllocator.malloc and free inline, on the
    fused loop's blocks (_BLOCK_FIELDS). None where every op was applied; else (index, False)
    where the request at ``index`` ran out of memory, (index, True) where the op at ``index``
    needs DeviceAllocator itself (not applied: the module's docstring). ``cached``: the large
    and the small pool's cached blocks, each in the order of its pool's keys (which stand for
    Pool.by_key here: a list index instead of hashing a key); ``sizes``: each request size's
    _size_facts, kept between the calls of one replay."""
    # What every op reads, as locals (the cheapest names to read): the fields' indices, the
    # op kinds, the keys' shifts, the rules' sizes, bisect.
    SIZE, PTR, PREV, NEXT, ALLOCATED, REQUESTED, SMALL, STREAM, KEY = _FIELD_INDICES  # noqa: N806
    alloc_op, free_op, stream_shift, size_shift = ALLOC_OP, FREE_OP, STREAM_SHIFT, SIZE_SHIFT
    min_block, small_size, search = MIN_BLOCK_BYTES, SMALL_SIZE_BYTES, bisect_left
    config = device.config
    keys_small, keys_large = device.small_pool.keys, device.large_pool.keys
    cached_large, cached_small = cached
    split_limited, max_split = device.split_limited, config.max_split_size_bytes
    forget = live.pop
    allocated, requested, reserved = device.allocated, device.requested, device.reserved
    allocated_peak, requested_peak, reserved_peak = device.allocated_peak, device.requested_peak, device.reserved_peak
    next_address, device_allocs = device.next_address, device.device_allocs
    capacity = device.capacity
    stop = None
    last = end - 1
    for index in range(start, end):
        kind, ident, size_bytes, stream = ops[index]
        if kind == alloc_op:
            # DeviceAllocator.malloc.
            fact_key = (size_bytes, stream) if stream else size_bytes
            known = sizes.get(fact_key)
            if known is None:
                known = sizes[fact_key] = _size_facts(size_bytes, stream, device, cached)
            size, small, least, past, stream_bits, alloc_size, advance, keys, pool = known
            # get_free_block (no expandable segments: the first candidate is the block).
            at = search(keys, least)
            block = None
            slot = -1  # where a block served from the cache still sits in its pool
            if at < len(keys):
                key = keys[at]
                if key < past:
                    block = pool[at]
                    if split_limited and not block_may_serve(block[SIZE], size, config):
                        block = None
                    elif index < last and (following := ops[index + 1])[1] == ident and following[0] == free_op:
                        # Freed at once: the block (or its front, split off) merges back into what
                        # it was cut from (a cached block's neighbours are never available: they
                        # would have merged), so the cache is as it was; only the peaks move. Its
                        # free, next, finds no block (live.pop's default).
                        remaining_bytes = block[SIZE] - size
                        if small:
                            whole = remaining_bytes < min_block
                        else:
                            whole = not (size < max_split and remaining_bytes > small_size)
                        if allocated + (block[SIZE] if whole else size) > allocated_peak:
                            allocated_peak = allocated + (block[SIZE] if whole else size)
                        if requested + size_bytes > requested_peak:
                            requested_peak = requested + size_bytes
                        continue
                    else:
                        slot = at
            if block is None:
                if reserved + alloc_size > capacity:
                    if split_limited:
                        # release_available_cached_blocks acts under max_split_size: DeviceAllocator's.
                        stop = index, True
                        break
                    # _alloc_new_block: alloc_block refused; release_cached_blocks (nothing waits
                    # on an event here) cudaFrees every unsplit cached block of both pools; the
                    # retry.
                    device.refusals += 1
                    for pool_keys, pool_blocks in ((keys_large, cached_large), (keys_small, cached_small)):
                        kept_keys, kept = [], []
                        for key, unused in zip(pool_keys, pool_blocks):
                            if unused[PREV] is None and unused[NEXT] is None:
                                reserved -= unused[SIZE]
                                device.device_frees += 1
                            else:
                                kept_keys.append(key)
                                kept.append(unused)
                        pool_keys[:] = kept_keys
                        pool_blocks[:] = kept
                    device.retries += 1
                    if reserved + alloc_size > capacity:
                        device.refusals += 1
                        stop = index, False
                        break
                # alloc_block with _address and _reserve inline (no measured run's addresses here).
                reserved += alloc_size
                if reserved > reserved_peak:
                    reserved_peak = reserved
                device_allocs += 1
                block = [alloc_size, next_address, None, None, False, 0, small, stream, 0]
                next_address += advance
            # alloc_found_block.
            remaining_bytes = block[SIZE] - size
            if small:
                split = remaining_bytes >= min_block
            else:
                split = size < max_split and remaining_bytes > small_size
            if split:
                ptr = block[PTR]
                before = block[PREV]
                front = [size, ptr, before, block, True, size_bytes, small, stream, 0]
                if before is not None:
                    before[NEXT] = front
                block[PREV] = front
                ptr += size
                block[PTR] = ptr
                block[SIZE] = remaining_bytes
                key = (remaining_bytes << size_shift) | ptr
                if stream_bits:
                    key |= stream_bits
                block[KEY] = key
                # A cached block's remainder keeps its place in the pool where the key before
                # it is smaller still (its key only shrank): nothing moves in the lists.
                if slot < 0:
                    at = search(keys, key)
                    keys.insert(at, key)
                    pool.insert(at, block)
                elif slot == 0 or keys[slot - 1] < key:
                    keys[slot] = key
                else:
                    del keys[slot]
                    del pool[slot]
                    at = search(keys, key, 0, slot)
                    keys.insert(at, key)
                    pool.insert(at, block)
                block = front
                allocated += size
            else:
                if slot >= 0:
                    del keys[slot]
                    del pool[slot]
                block[ALLOCATED] = True
                block[REQUESTED] = size_bytes
                allocated += block[SIZE]
            requested += size_bytes
            if allocated > allocated_peak:
                allocated_peak = allocated
            if requested > requested_peak:
                requested_peak = requested
            live[ident] = block
        elif kind == free_op:
            # DeviceAllocator.free (no block has a recorded stream here).
            block = forget(ident, None)
            if block is None:
                continue  # freed at once (above)
            block[ALLOCATED] = False
            size = block[SIZE]
            allocated -= size
            requested -= block[REQUESTED]
            # free_block, try_merge_blocks inline (every block is mapped here).
            if block[SMALL]:
                keys, pool = keys_small, cached_small
            else:
                keys, pool = keys_large, cached_large
            ptr = block[PTR]
            before = block[PREV]
            # Where a merged neighbour's key still sits in the pool: the merged block, larger and
            # so after it in the order, takes its place where the key after it is larger still.
            slot = -1
            if before is not None and not before[ALLOCATED]:
                before_size = before[SIZE]
                ptr = before[PTR]
                slot = search(keys, before[KEY])
                block[PTR] = ptr
                size += before_size
                block[PREV] = preceding = before[PREV]
                if preceding is not None:
                    preceding[NEXT] = block
            after = block[NEXT]
            if after is not None and not after[ALLOCATED]:
                after_size = after[SIZE]
                if slot >= 0:
                    del keys[slot]
                    del pool[slot]
                slot = search(keys, after[KEY])
                block[NEXT] = following = after[NEXT]
                if following is not None:
                    following[PREV] = block
                size += after_size
            block[SIZE] = size
            key = (size << size_shift) | ptr
            if block[STREAM]:
                key |= block[STREAM] << stream_shift
            block[KEY] = key
            if slot < 0:
                at = search(keys, key)
                keys.insert(at, key)
                pool.insert(at, block)
            elif slot + 1 == len(keys) or keys[slot + 1] > key:
                keys[slot] = key
                pool[slot] = block
            else:
                del keys[slot]
                del pool[slot]
                at = search(keys, key, slot)
                keys.insert(at, key)
                pool.insert(at, block)
        else:
            # A recorded stream, a synchronisation, an emptied cache: DeviceAllocator's.
            stop = index, True
            break
    device.allocated, device.requested, device.reserved = allocated, requested, reserved
    device.allocated_peak, device.requested_peak, device.reserved_peak = allocated_peak, requested_peak, reserved_peak
    device.next_address, device.device_allocs = next_address, device_allocs
    return stop


# Expandable segments (torchtitan's launch default) keep DeviceAllocator's own Blocks and pools:
# a cache miss maps pages into the stream's segment (_alloc_new_block, find_expandable_block,
# map_block, and the release of the cache and the retry where the device refuses), which this
# loop leaves to DeviceAllocator's methods (inlined too they saved under 1 % of a torchtitan
# fit's instructions, not worth a second copy of the mapping). What it runs itself is what every other event is: malloc's
# get_free_block and alloc_found_block and free's free_block with try_merge_blocks, the same
# steps in the same order on the same objects (device.py's methods, marked where each is
# inlined), without two to four method calls an event. Without garbage collection no block's age
# is read, so it is not kept; a recorded stream, a synchronisation and an emptied cache are
# DeviceAllocator's methods on the same blocks.
def _replay_expandable(ops: Ops, config: AllocatorConfig, capacity_bytes: int | None) -> ReplayResult:
    """replay.replay(ops, config, capacity_bytes) under expandable segments and no garbage
    collection (the same result: benchmarks/allocator_fast_sweep.py)."""
    device = DeviceAllocator(config, capacity_bytes)
    live: dict[int, Block] = {}
    oom = _run_expandable(device, ops, _last_allocation_end(ops), live)
    result = _result(device, ops, oom)
    _unlink(device, live, ((), ()), True)
    return result


def _run_expandable(device: DeviceAllocator, ops: Ops, end: int, live: dict[int, Block]) -> int | None:
    """run_ops(device, ops[:end]) for expandable segments without garbage collection, malloc's
    and free's steps inline: the index of the request that ran out of memory, or None."""
    config = device.config
    small_pool, large_pool = device.small_pool, device.large_pool
    rounded = device._rounded
    split_limited = device.split_limited
    stream_shift, size_shift, small_size, min_block = STREAM_SHIFT, SIZE_SHIFT, SMALL_SIZE_BYTES, MIN_BLOCK_BYTES
    search, add = bisect_left, insort
    alloc_op, free_op = ALLOC_OP, FREE_OP
    allocated, requested = device.allocated, device.requested
    allocated_peak, requested_peak = device.allocated_peak, device.requested_peak
    forget = live.pop
    new_block = object.__new__
    oom = None
    for index in range(end):
        kind, ident, size_bytes, stream = ops[index]
        if kind == alloc_op:
            # DeviceAllocator.malloc (no garbage collection: no get_free_block clock).
            size = rounded.get(size_bytes)
            if size is None:
                size = rounded[size_bytes] = round_size(size_bytes, config)
            small = size <= small_size
            pool = small_pool if small else large_pool
            keys, by_key = pool.keys, pool.by_key
            # get_free_block, with expandable segments' walk to a later candidate that grows less.
            at = search(keys, (stream << stream_shift) | (size << size_shift) if stream else size << size_shift)
            block = None
            if at < len(keys) and keys[at] >> stream_shift == stream:
                block = by_key[keys[at]]
                if block.segment is not None:
                    following = at + 1
                    while (block.segment is not None and following < len(keys)
                           and keys[following] >> stream_shift == stream):
                        candidate = by_key[keys[following]]
                        if _expandable_size(candidate) >= _expandable_size(block):
                            break
                        block, at = candidate, following
                        following += 1
                if split_limited and not block_may_serve(block.size, size, config):
                    block = None
                else:
                    del by_key[keys[at]]
                    del keys[at]
            if block is None:
                # _alloc_new_block: alloc_block (no fraction cap, no garbage collection: pages
                # mapped at once, DeviceAllocator's own), else what it does after a refusal.
                block = device._try_allocate_expandable_block(pool, stream, size) or (
                    (device._release_available_cached_blocks(pool, stream, size)
                     and device._alloc_block(pool, stream, size, allocation_size(size), retry=False))
                    or (device._release_cached_blocks()
                        and device._alloc_block(pool, stream, size, allocation_size(size), retry=True)))
                if not block:
                    oom = index
                    break
            # alloc_found_block: under expandable segments a split wherever 512 bytes or more remain.
            remaining_bytes = block.size - size
            if remaining_bytes >= min_block:
                # The front split off: Block(...) with every slot as its __init__ sets it, then
                # allocated, without the call.
                remaining = block
                block = new_block(Block)
                block.stream, block.size, block.ptr = remaining.stream, size, remaining.ptr
                block.small, block.segment, block.mapped = remaining.small, remaining.segment, True
                block.event_count, block.stream_uses, block.gc_base = 0, (), 0
                block.prev = before = remaining.prev
                if before is not None:
                    before.next = block
                block.next = remaining
                remaining.prev = block
                remaining.ptr += size
                remaining.size = remaining_bytes
                key = (remaining_bytes << size_shift) | remaining.ptr
                if remaining.stream:
                    key |= remaining.stream << stream_shift
                add(keys, key)
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
        elif kind == free_op:
            # DeviceAllocator.free.
            block = forget(ident)
            block.allocated = False
            allocated -= block.size
            requested -= block.requested
            if block.stream_uses:
                block.event_count = len(block.stream_uses)
                block.stream_uses = ()
                device.pending.append(block)
                continue
            # free_block, try_merge_blocks inline: a freed block is mapped, so only a mapped
            # available neighbour merges (an unmapped one differs in mapped).
            pool = small_pool if block.small else large_pool
            keys, by_key = pool.keys, pool.by_key
            before, after = block.prev, block.next
            if before is not None and not before.allocated and before.mapped and not before.event_count \
                    and not before.stream_uses:
                key = (before.size << size_shift) | before.ptr
                if before.stream:
                    key |= before.stream << stream_shift
                del keys[search(keys, key)]
                del by_key[key]
                block.ptr = before.ptr
                block.prev = preceding = before.prev
                if preceding is not None:
                    preceding.next = block
                block.size += before.size
            if after is not None and not after.allocated and after.mapped and not after.event_count \
                    and not after.stream_uses:
                key = (after.size << size_shift) | after.ptr
                if after.stream:
                    key |= after.stream << stream_shift
                del keys[search(keys, key)]
                del by_key[key]
                block.next = following_block = after.next
                if following_block is not None:
                    following_block.prev = block
                block.size += after.size
            key = (block.size << size_shift) | block.ptr
            if block.stream:
                key |= block.stream << stream_shift
            add(keys, key)
            by_key[key] = block
        elif kind == RECORD_OP:
            device.record_stream(live[ident], stream)
        elif kind == SYNC_OP:
            device.synchronize()
        else:
            device.empty_cache()
    device.allocated, device.requested = allocated, requested
    device.allocated_peak, device.requested_peak = allocated_peak, requested_peak
    return oom
