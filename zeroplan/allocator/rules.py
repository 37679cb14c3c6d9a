"""The allocator's size rules, one function each, with the function of
c10/cuda/CUDACachingAllocator.cpp (source.ALLOCATOR_SOURCE) it follows on the line above."""

from __future__ import annotations

from zeroplan.allocator.config import LARGE_BUFFER_BYTES, ROUNDUP_INTERVALS, AllocatorConfig
from zeroplan.units import MiB

MIN_BLOCK_BYTES = 512
"""kMinBlockSize: every size is rounded to at least 512 bytes."""
SMALL_SIZE_BYTES = 1 * MiB
"""kSmallSize: the largest request served from the small pool."""
SMALL_BUFFER_BYTES = 2 * MiB
"""kSmallBuffer: the segment the small pool cudaMallocs (and its expandable page)."""
MIN_LARGE_ALLOC_BYTES = 10 * MiB
"""kMinLargeAlloc: requests below it (and above 1 MiB) get a 20 MiB segment."""
ROUND_LARGE_BYTES = 2 * MiB
"""kRoundLarge: larger segments are rounded up to 2 MiB."""
LARGE_PAGE_BYTES = LARGE_BUFFER_BYTES
"""The large pool's expandable-segment page (ExpandableSegment's segment_size_, kLargeBuffer)."""


# AllocatorConfig::roundup_power2_divisions(size) (c10/core/AllocatorConfig.cpp): interval
# index log2(size) - log2(1 MiB), clamped to [0, 15].
def divisions_for(size: int, config: AllocatorConfig) -> int:
    """The divisions configured for the power-of-two interval holding ``size``."""
    index = min(max(size.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)
    return config.roundup_power2_divisions[index]


# roundup_power2_next_division: split [2^k, 2^(k+1)) into `divisions` equal steps and round
# up to the next step; a power of two stays; a step below 1 byte rounds to 2^(k+1).
def roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


# round_size: below 512 bytes -> 512; with divisions > 1 and size > 512 * divisions, the
# power-of-two division; else the next multiple of 512.
def round_size(size: int, config: AllocatorConfig) -> int:
    if size < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    divisions = divisions_for(size, config)
    if divisions > 1 and size > MIN_BLOCK_BYTES * divisions:
        return roundup_power2_next_division(size, divisions)
    return -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


# get_allocation_size: small -> 2 MiB segment; below 10 MiB -> 20 MiB; else rounded to 2 MiB.
def allocation_size(size: int) -> int:
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


# get_free_block: a request below max_split_size never takes an oversize block; a request at
# or above it takes one only if the block is less than max_non_split_rounding larger.
def block_may_serve(block_size: int, size: int, config: AllocatorConfig) -> bool:
    limit = config.max_split_size_bytes
    if size < limit and block_size >= limit:
        return False
    return not (size >= limit and block_size >= size + config.max_non_split_rounding_bytes)


def page_bytes(small: bool) -> int:
    """An expandable segment's page: kSmallBuffer for the small pool, kLargeBuffer for the large
    (find_expandable_block's segment_size)."""
    return SMALL_BUFFER_BYTES if small else LARGE_PAGE_BYTES
