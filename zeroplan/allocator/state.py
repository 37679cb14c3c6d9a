"""The allocator's blocks and pools: address-linked blocks of a segment, and per pool the
cached free blocks ordered as BlockComparatorSize orders them (stream, size, address), kept
in a sorted list so best fit is one bisection (c10/cuda/CUDACachingAllocator.cpp,
source.ALLOCATOR_SOURCE)."""

from __future__ import annotations

from bisect import bisect_left, insort


STREAM_SHIFT, SIZE_SHIFT = 128, 64
"""A cached block's key is one integer, stream << 128 | size << 64 | ptr: ordered as the tuple
(stream, size, ptr) is (sizes and addresses are below 2**64), and compared faster."""
SIZE_MASK = (1 << 64) - 1


class Segment:
    """An expandable segment: reserved address space mapped page by page (ExpandableSegment)."""

    __slots__ = ("base", "size", "page", "stream", "small")

    def __init__(self, base: int, size: int, page: int, stream: int, small: bool) -> None:
        self.base, self.size, self.page, self.stream, self.small = base, size, page, stream, small


class Block:
    """struct Block: a piece of a segment, allocated, cached or (expandable) unmapped."""

    __slots__ = ("stream", "size", "ptr", "small", "allocated", "prev", "next", "mapped", "segment",
                 "event_count", "stream_uses", "gc_base", "requested")

    def __init__(self, stream: int, size: int, ptr: int, small: bool, segment: Segment | None = None) -> None:
        self.stream, self.size, self.ptr, self.small, self.segment = stream, size, ptr, small, segment
        self.allocated = False
        self.mapped = True
        self.prev: Block | None = None
        self.next: Block | None = None
        self.event_count = 0
        self.stream_uses: set[int] | tuple[()] = ()
        """The other streams it was used on since allocated (a set once one is recorded; the
        empty tuple until then, cheaper to make for the many blocks that never are)."""
        self.gc_base = 0
        self.requested = 0

    # Block::is_split
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    # Block::splice: link this block between before and after.
    def splice(self, before: Block | None, after: Block | None) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


# The allocatable lambda of find_expandable_block and try_merge_blocks' guard: free, no
# outstanding events, no recorded streams.
def available(block: Block | None) -> bool:
    return block is not None and not block.allocated and block.event_count == 0 and not block.stream_uses


class Pool:
    """struct BlockPool: cached (free, mapped) blocks by size, unmapped blocks by address."""

    __slots__ = ("small", "keys", "by_key", "unmapped_keys", "unmapped", "gc_calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[int] = []
        """The key (STREAM_SHIFT) of every cached block, sorted (BlockComparatorSize)."""
        self.by_key: dict[int, Block] = {}
        self.unmapped_keys: list[tuple[int, int]] = []
        """(stream, ptr) of every unmapped block, sorted (BlockComparatorAddress)."""
        self.unmapped: dict[int, Block] = {}
        self.gc_calls = 0
        """get_free_blocks_call_count: the clock of garbage collection's block ages."""

    # BlockPool::insert_into_blocks: the block's age starts now.
    def insert(self, block: Block) -> None:
        block.gc_base = self.gc_calls
        key = (block.stream << STREAM_SHIFT) | (block.size << SIZE_SHIFT) | block.ptr
        insort(self.keys, key)
        self.by_key[key] = block

    def remove(self, block: Block) -> None:
        """Take a cached block out (before its size or address changes)."""
        keys = self.keys
        key = (block.stream << STREAM_SHIFT) | (block.size << SIZE_SHIFT) | block.ptr
        del keys[bisect_left(keys, key)]
        del self.by_key[key]

    def insert_unmapped(self, block: Block) -> None:
        insort(self.unmapped_keys, (block.stream, block.ptr))
        self.unmapped[block.ptr] = block

    def remove_unmapped(self, block: Block) -> None:
        keys = self.unmapped_keys
        del keys[bisect_left(keys, (block.stream, block.ptr))]
        del self.unmapped[block.ptr]

    def unmapped_of(self, stream: int) -> list[Block]:
        """The stream's unmapped blocks, lowest address first."""
        keys = self.unmapped_keys
        start = bisect_left(keys, (stream, -1))
        out = []
        for key in keys[start:]:
            if key[0] != stream:
                break
            out.append(self.unmapped[key[1]])
        return out
