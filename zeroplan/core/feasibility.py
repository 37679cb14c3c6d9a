"""What of a GPU's memory the caching allocator may use: capacity less the CUDA context
(ClusterSpec.usable_memory_bytes) and the buffers of the NCCL communicators the rank opens, which
NCCL allocates outside the allocator (zeroplan.core.communicators; docs/memory-model.md, "Memory
outside the allocator"). Nothing here imports torch."""

from __future__ import annotations

from zeroplan.core.communicators import communicators
from zeroplan.specs.request import PlanRequest


# docs/memory-model.md, "Memory outside the allocator": one term per communicator, each from
# NCCL v2.28.3-1's buffer sizes (zeroplan.core.nccl_buffers).
def nccl_buffer_bytes(request: PlanRequest) -> int:
    """Device bytes the rank's NCCL communicators hold outside the caching allocator (0 for the
    reference harness, whose measured runs are the baseline of the existing verdicts)."""
    return sum(c.bytes for c in communicators(request))


def usable_memory_bytes(request: PlanRequest) -> int:
    """What the allocator may use: capacity less CUDA context and NCCL buffers."""
    return request.cluster.usable_memory_bytes - nccl_buffer_bytes(request)
