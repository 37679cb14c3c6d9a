"""Flat-buffer arithmetic of the reference ZeRO layout (torch-free, so the docs and tests can
state it without a process group)."""

from __future__ import annotations

from zeroplan.units import ceil_div


def padded_numel(numel: int, world_size: int) -> int:
    """A unit's flat buffer length: its element count rounded up to a multiple of N."""
    return ceil_div(numel, world_size) * world_size


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the contiguous shard that ``rank`` owns in the padded flat buffer."""
    shard = padded_numel(numel, world_size) // world_size
    return rank * shard, (rank + 1) * shard
