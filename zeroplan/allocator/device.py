"""DeviceCachingAllocator's malloc and free (c10/cuda/CUDACachingAllocator.cpp at
source.ALLOCATOR_SOURCE), on a device of a given capacity. Each method follows the function
named on the line above it; what the model assumes beyond the source is said where it acts."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

from zeroplan.allocator.config import AllocatorConfig, UNLIMITED
from zeroplan.allocator.rules import (
    MIN_BLOCK_BYTES, SMALL_SIZE_BYTES, allocation_size, block_may_serve, page_bytes, round_size,
)
from zeroplan.allocator.state import SIZE_MASK, SIZE_SHIFT, STREAM_SHIFT, Block, Pool, Segment, available

ADDRESS_ALIGN_BYTES = 2**21
"""Where the model places a new segment: past every earlier one, 2 MiB aligned. Addresses only
break ties between equal-sized cached blocks (BlockComparatorSize); cudaMalloc's real
addresses are unknowable, so this order is an assumption."""

EXPANDABLE_ADDRESS_SPACE_BYTES = 2**46
"""Address space reserved for one expandable segment. The allocator reserves 9/8 of the GPU's
memory (find_expandable_block); a larger reservation only matters once pages were unmapped in
the middle of a segment, so the model takes one that never runs out (an assumption)."""


class DeviceAllocator:
    """One device's caching allocator: ``capacity_bytes`` is what cudaMalloc (or cuMemCreate)
    may take in all, None for no limit (the model assumes the driver can place any request
    that fits in the free bytes)."""

    def __init__(self, config: AllocatorConfig, capacity_bytes: int | None = None,
                 segment_addresses: Sequence[tuple[int, int]] = (), fraction_cap: bool = False) -> None:
        self.config = config
        self.fraction_cap = fraction_cap
        """The capacity is a set_per_process_memory_fraction limit on a device with room beyond
        it (how benchmarks/gpu_allocator.py measures an OOM capacity), not the device's own size:
        alloc_block refuses a request whose whole rounded size would pass it, and pages then
        map without a further check."""
        self._recorded_segments = list(reversed(segment_addresses))
        """(address, size) of the cudaMalloc calls a measured run made, next one last: a replay
        of that run places its segments where CUDA did (see _address)."""
        self.capacity = UNLIMITED if capacity_bytes is None else capacity_bytes
        self.small_pool = Pool(small=True)
        self.large_pool = Pool(small=False)
        self.pending: list[Block] = []
        """Freed blocks waiting on a recorded stream's event (cuda_events)."""
        self.next_address = ADDRESS_ALIGN_BYTES
        # garbage_collect_cached_blocks runs only when a memory fraction is set
        # (set_per_process_memory_fraction): the model assumes it is whenever a threshold is.
        self.gc_enabled = config.garbage_collection_threshold > 0.0
        self.allocated = self.requested = self.reserved = 0
        self.allocated_peak = self.requested_peak = self.reserved_peak = 0
        self.device_allocs = self.device_frees = self.retries = 0
        self.refusals = 0
        """Device allocations refused for want of capacity: with none, a replay went exactly as
        it would without a device limit (no cache was released to retry)."""
        self.path_floor = 0
        """The most the device held just after any device allocation it granted (reserved bytes
        after the segment or pages): on any capacity from it up to path_ceiling (excluded) every
        grant and refusal goes the same way, so the replay is the same (garbage collection,
        which acts against the capacity itself, aside)."""
        self.path_ceiling = UNLIMITED
        """The least the device would have held after any allocation it refused: the least
        capacity on which that one is granted and the replay takes another path."""
        self.stream_records = 0
        """record_stream calls so far: until one, no block has a recorded stream or an
        outstanding event (fast_replay's merges test being free alone)."""
        self._rounded: dict[int, int] = {}
        """round_size of every request size seen (it depends on the size and config only)."""
        self.split_limited = config.max_split_size_bytes != UNLIMITED
        self._max_split = config.max_split_size_bytes
        self._expandable = config.expandable_segments
        """max_split_size is set: an oversize cached block may refuse a request (block_may_serve,
        which without it serves every request)."""

    # --- addresses -------------------------------------------------------------------------
    def _address(self, size: int) -> int:
        # Replaying a measured run: CUDA's own address for this segment, while the replay asks
        # for the segments the run made, in its order; from the first that differs, the model's.
        if self._recorded_segments:
            ptr, recorded_size = self._recorded_segments[-1]
            if recorded_size == size:
                self._recorded_segments.pop()
                return ptr
            self._recorded_segments = []
        ptr = self.next_address
        self.next_address += -(-size // ADDRESS_ALIGN_BYTES) * ADDRESS_ALIGN_BYTES
        return ptr

    def _reserve(self, size: int) -> None:
        self.reserved += size
        if self.reserved > self.reserved_peak:
            self.reserved_peak = self.reserved

    # --- malloc ----------------------------------------------------------------------------
    # DeviceCachingAllocator::malloc: round, pick the pool, search the cache; else (after
    # garbage collection) allocate a segment; on failure free oversize cached blocks and retry,
    # then free every unsplit cached block and retry; else out of memory (None). get_free_block
    # and alloc_found_block are inline here (each marked): the replay's hot path.
    def malloc(self, size_bytes: int, stream: int) -> Block | None:
        # A step asks for few distinct sizes, many times each: each is rounded once.
        size = self._rounded.get(size_bytes)
        if size is None:
            size = self._rounded[size_bytes] = round_size(size_bytes, self.config)
        small = size <= SMALL_SIZE_BYTES  # get_pool: sizes up to kSmallSize go to the small pool
        pool = self.small_pool if small else self.large_pool

        # get_free_block: the smallest cached block of the stream at least `size` large; with
        # expandable segments the search moves on while a later candidate could grow less; an
        # oversize block serves only within max_split_size / max_non_split_rounding.
        if self.gc_enabled:
            pool.gc_calls += 1
        keys = pool.keys
        index = bisect_left(keys, (stream << STREAM_SHIFT) | (size << SIZE_SHIFT))
        block = None
        if index < len(keys) and keys[index] >> STREAM_SHIFT == stream:
            block = pool.by_key[keys[index]]
            if block.segment is not None:
                following = index + 1
                while block.segment is not None and following < len(keys) and keys[following] >> STREAM_SHIFT == stream:
                    candidate = pool.by_key[keys[following]]
                    if _expandable_size(candidate) >= _expandable_size(block):
                        break
                    block, index = candidate, following
                    following += 1
            if self.split_limited and not block_may_serve(block.size, size, self.config):
                block = None
            else:
                # The block's key is at ``index``: taken out without a second search (Pool.remove).
                del pool.by_key[keys[index]]
                del keys[index]

        if block is None:
            if self.gc_enabled:
                self._garbage_collect()
            block = self._alloc_new_block(pool, stream, size, allocation_size(size))
            if not block:
                return None

        # alloc_found_block: split off the front `size` bytes where should_split says so (the
        # small pool and expandable segments whenever 512 bytes or more would remain; the large
        # pool below max_split_size when more than 1 MiB, kSmallSize, would); the remainder goes
        # back to the cache.
        remaining_bytes = block.size - size
        if small or self._expandable:
            split = remaining_bytes >= MIN_BLOCK_BYTES
        else:
            split = size < self._max_split and remaining_bytes > SMALL_SIZE_BYTES
        if split:
            remaining = block
            block = Block(remaining.stream, size, remaining.ptr, remaining.small, remaining.segment)
            block.prev = before = remaining.prev
            if before is not None:
                before.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size = remaining_bytes
            # pool.insert, inline on the hot path.
            remaining.gc_base = pool.gc_calls
            key = (remaining.stream << STREAM_SHIFT) | (remaining_bytes << SIZE_SHIFT) | remaining.ptr
            insort(keys, key)
            pool.by_key[key] = remaining
        block.allocated = True
        block.requested = size_bytes
        allocated = self.allocated = self.allocated + block.size
        requested = self.requested = self.requested + size_bytes
        if allocated > self.allocated_peak:
            self.allocated_peak = allocated
        if requested > self.requested_peak:
            self.requested_peak = requested
        return block

    # malloc's path when no cached block fits: alloc_block, else release_available_cached_blocks
    # and alloc_block again, else release_cached_blocks and alloc_block once more (the retry).
    def _alloc_new_block(self, pool: Pool, stream: int, size: int, alloc_size: int) -> Block | None:
        return (
            self._alloc_block(pool, stream, size, alloc_size, retry=False)
            or (self._release_available_cached_blocks(pool, stream, size)
                and self._alloc_block(pool, stream, size, alloc_size, retry=False))
            or (self._release_cached_blocks()
                and self._alloc_block(pool, stream, size, alloc_size, retry=True))
        )

    # alloc_block: a new segment of alloc_size by cudaMalloc, or (expandable segments) pages
    # mapped into the stream's segment; fails when the device has no room.
    def _alloc_block(self, pool: Pool, stream: int, size: int, alloc_size: int, retry: bool) -> Block | None:
        if retry:
            self.retries += 1
        if (self.fraction_cap or self.gc_enabled) and not self._grants(alloc_size):
            return None  # the set_fraction check, made before any mapping
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, stream, size)
        if not self._grants(alloc_size):
            return None
        self._reserve(alloc_size)
        self.device_allocs += 1
        return Block(stream, alloc_size, self._address(alloc_size), pool.small)

    # The capacity test of alloc_block (cudaMalloc, or the set_fraction check) and of
    # ExpandableSegment::map (cuMemCreate): the device has room for ``size_bytes`` more.
    def _grants(self, size_bytes: int) -> bool:
        after = self.reserved + size_bytes
        if after > self.capacity:
            self.refusals += 1
            if after < self.path_ceiling:
                self.path_ceiling = after
            return False
        if after > self.path_floor:
            self.path_floor = after
        return True

    # --- free ------------------------------------------------------------------------------
    # DeviceCachingAllocator::free: a block used on other streams waits for their events
    # (insert_events); any other goes straight back to the cache.
    def free(self, block: Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        if block.stream_uses:
            block.event_count = len(block.stream_uses)
            block.stream_uses = ()
            self.pending.append(block)
        else:
            self._free_block(block)

    # recordStream: uses on the allocation stream need no event.
    def record_stream(self, block: Block, stream: int) -> None:
        self.stream_records += 1
        if stream != block.stream:
            if block.stream_uses:
                block.stream_uses.add(stream)
            else:
                block.stream_uses = {stream}

    # synchronize_and_free_events (and process_events once every event has completed): the
    # model's events complete only at a synchronisation, a conservative reading of a CPU that
    # runs ahead of the GPU.
    def synchronize(self) -> None:
        pending, self.pending = self.pending, []
        for block in pending:
            block.event_count = 0
            self._free_block(block)

    # emptyCache: release_cached_blocks, which synchronises every event first.
    def empty_cache(self) -> None:
        self._release_cached_blocks()

    # free_block: merge with free neighbours of the same segment, then cache.
    def _free_block(self, block: Block) -> None:
        pool = self.small_pool if block.small else self.large_pool
        # The neighbours are tested here first: most are allocated, and the call costs more
        # than the test (try_merge_blocks tests them again).
        before, after = block.prev, block.next
        if before is not None and not before.allocated:
            self._try_merge(block, before, pool)
        if after is not None and not after.allocated:
            self._try_merge(block, after, pool)
        # pool.insert, inline on the hot path.
        block.gc_base = pool.gc_calls
        key = (block.stream << STREAM_SHIFT) | (block.size << SIZE_SHIFT) | block.ptr
        insort(pool.keys, key)
        pool.by_key[key] = block

    # try_merge_blocks: absorb a free neighbour (both mapped or both unmapped).
    def _try_merge(self, dst: Block, src: Block | None, pool: Pool) -> int:
        # available(src), inline on the hot path.
        if src is None or src.allocated or src.event_count or src.stream_uses or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            # pool.remove, inline on the hot path.
            key = (src.stream << STREAM_SHIFT) | (src.size << SIZE_SHIFT) | src.ptr
            keys = pool.keys
            del keys[bisect_left(keys, key)]
            del pool.by_key[key]
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # --- releasing cached memory -----------------------------------------------------------
    # release_block: cudaFree a whole cached segment.
    def _release_block(self, block: Block, pool: Pool) -> None:
        pool.remove(block)
        self.reserved -= block.size
        self.device_frees += 1

    # release_available_cached_blocks: with max_split_size set, cudaFree the smallest oversize
    # cached block that covers the request, or else the largest ones until their sum does.
    def _release_available_cached_blocks(self, pool: Pool, stream: int, size: int) -> bool:
        limit = self.config.max_split_size_bytes
        if limit == UNLIMITED:
            return False
        target = max(size, limit)
        keys = pool.keys
        index = bisect_left(keys, (stream << STREAM_SHIFT) | (target << SIZE_SHIFT))
        if index < len(keys) and keys[index] >> STREAM_SHIFT == stream:
            block = pool.by_key[keys[index]]
            if block.is_split():
                return False  # never cudaFree part of a segment (cannot happen unsplit)
            self._release_block(block, pool)
            return True
        released = 0
        index -= 1
        while released < target and index >= 0 and (keys[index] >> SIZE_SHIFT) & SIZE_MASK >= limit \
                and keys[index] >> STREAM_SHIFT == stream:
            block = pool.by_key[keys[index]]
            if block.is_split():
                break
            released += block.size
            self._release_block(block, pool)
            index -= 1
        return released >= target

    # release_cached_blocks: synchronise every event, then free every unsplit cached block of
    # both pools (release_blocks); expandable segments unmap their free pages instead.
    def _release_cached_blocks(self) -> bool:
        self.synchronize()
        for pool in (self.large_pool, self.small_pool):
            to_unmap = []
            for key in list(pool.keys):
                block = pool.by_key[key]
                if block.segment is not None:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(block, pool)
            for block in to_unmap:
                self._unmap_block(block, pool)
                if not block.mapped and not block.is_split():
                    pool.remove_unmapped(block)  # release_expandable_segment
        return True

    # garbage_collect_cached_blocks: above threshold x allowed memory, cudaFree unsplit large
    # cached blocks at least as old as the average (age = get_free_block calls since cached),
    # again and again until the excess is reclaimed or nothing more is freed.
    def _garbage_collect(self) -> None:
        threshold = int(self.config.garbage_collection_threshold * self.capacity)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self.large_pool
        clock = pool.gc_calls
        freeable = [pool.by_key[k] for k in pool.keys if not pool.by_key[k].is_split()]
        total_age = sum(clock - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            average = total_age / count
            freed = False
            for key in list(pool.keys):
                block = pool.by_key.get(key)
                if block is None or block.is_split() or clock - block.gc_base < average:
                    continue
                freed = True
                reclaimed += block.size
                total_age -= clock - block.gc_base
                count -= 1
                self._release_block(block, pool)

    # --- expandable segments ---------------------------------------------------------------
    # find_expandable_block: the lowest-address unmapped range of the stream (with the free
    # block just before it) that, with what follows, has room for `size`; else a new segment.
    def _find_expandable_block(self, pool: Pool, stream: int, size: int) -> Block:
        for candidate in pool.unmapped_of(stream):
            if available(candidate.prev):
                candidate = candidate.prev
            room, walk = 0, candidate
            while room < size and available(walk):
                room += walk.size
                walk = walk.next
            if room >= size:
                return candidate
        page = page_bytes(pool.small)
        base = self._address(EXPANDABLE_ADDRESS_SPACE_BYTES)
        segment = Segment(base, EXPANDABLE_ADDRESS_SPACE_BYTES, page, stream, pool.small)
        block = Block(stream, segment.size, base, pool.small, segment)
        block.mapped = False
        pool.insert_unmapped(block)
        return block

    # map_block and ExpandableSegment::map: map whole pages from the block's start to cover
    # `size` (all or none: cuMemCreate failing releases the pages just made); the rest stays
    # unmapped; the mapped block merges with free neighbours and is cached.
    def _map_block(self, block: Block, size: int, pool: Pool) -> bool:
        segment = block.segment
        page = segment.page
        offset = block.ptr - segment.base
        begin = offset // page
        end = -(-(offset + size) // page)
        mapped = (end - begin) * page
        # Under a fraction cap the device itself has room: alloc_block's check on the whole
        # request was the only one, and the pages map even where they pass the cap.
        if mapped == 0:
            return False
        if not self.fraction_cap and not self._grants(mapped):
            return False
        pool.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.stream, block.size - mapped, block.ptr + mapped, block.small, segment)
            rest.mapped = False
            rest.splice(block, block.next)
            pool.insert_unmapped(rest)
            block.size = mapped
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)
        self._reserve(mapped)
        self.device_allocs += 1
        return True

    # try_allocate_expandable_block: map pages until the candidate covers `size`.
    def _try_allocate_expandable_block(self, pool: Pool, stream: int, size: int) -> Block | None:
        candidate = self._find_expandable_block(pool, stream, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            following = candidate.next
            if not self._map_block(following, min(size - candidate.size, following.size), pool):
                return None
            candidate = following
        pool.remove(candidate)
        return candidate

    # unmap_block and ExpandableSegment::unmap: unmap the whole pages inside a cached block;
    # the partial pages at either end stay mapped as cached blocks of their own.
    def _unmap_block(self, block: Block, pool: Pool) -> None:
        segment = block.segment
        page = segment.page
        offset = block.ptr - segment.base
        begin = -(-offset // page)
        end = (offset + block.size) // page
        if begin >= end:
            return
        pool.remove(block)
        start = segment.base + begin * page
        length = (end - begin) * page
        before = start - block.ptr
        if before > 0:
            head = Block(block.stream, before, block.ptr, block.small, segment)
            head.splice(block.prev, block)
            pool.insert(head)
        after = block.size - before - length
        if after > 0:
            tail = Block(block.stream, after, start + length, block.small, segment)
            tail.splice(block, block.next)
            pool.insert(tail)
        block.ptr, block.size, block.mapped = start, length, False
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert_unmapped(block)
        self.reserved -= length
        self.device_frees += 1


# get_free_block's expandable_size: a cached block followed by unmapped space can grow into it.
def _expandable_size(block: Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)
