"""What of a GPU's memory the caching allocator may use: capacity less the CUDA context
(ClusterSpec.usable_memory_bytes) and the buffers NCCL allocates outside the allocator
(docs/frameworks.md, "Feasibility"). Nothing here imports torch."""

from __future__ import annotations

from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.units import MiB

NCCL_BUFFSIZE_BYTES = 4 * MiB
"""NCCL's default NCCL_BUFFSIZE (NCCL environment-variable documentation: 4194304)."""


# docs/frameworks.md, "Feasibility": NCCL allocates, per communicator, NCCL_BUFFSIZE for each
# channel and each peer it exchanges with (ring: two); the channel count is an assumption.
def nccl_buffer_bytes(request: PlanRequest) -> int:
    """Device bytes NCCL's buffers take outside the caching allocator (0 for the reference
    harness, whose measured runs are the baseline of the existing verdicts)."""
    if request.training.framework is Framework.zeroplan or request.cluster.world_size == 1:
        return 0
    assumptions = request.assumptions
    return NCCL_BUFFSIZE_BYTES * assumptions.nccl_channels * assumptions.nccl_peers_per_channel


def usable_memory_bytes(request: PlanRequest) -> int:
    """What the allocator may use: capacity less CUDA context and NCCL buffers."""
    return request.cluster.usable_memory_bytes - nccl_buffer_bytes(request)
