"""The CUDA streams a step's allocations are made on (each with its own cached blocks)."""

from __future__ import annotations

from enum import IntEnum


class Stream(IntEnum):
    """The CUDA streams a step allocates on. Each has its own cached blocks: a block freed on
    one is never handed to a request on another (get_free_block compares the stream)."""

    compute = 0
    all_gather = 1
    reduce_scatter = 2
    host_copy = 3
    """Where FSDP's CPU offload copies a unit's host shard to the device before its all-gather
    (FSDP1's pre-unshard stream, FSDP2's all-gather copy-in stream)."""
