"""What of a GPU's memory the caching allocator may use: capacity less the CUDA context
(ClusterSpec.usable_memory_bytes) and the buffers of the NCCL communicators the rank opens, which
NCCL allocates outside the allocator (zeroplan.core.communicators; docs/memory-model.md, "Memory
outside the allocator"). Nothing here imports torch."""

from __future__ import annotations

from zeroplan.core.communicators import communicators, opens_communicators
from zeroplan.core.memo import batch_keyed
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


# Each pipeline rank opens its own communicators (a middle stage one per neighbour, the tied
# embedding's ranks one more: zeroplan.core.communicators), which read the layout, the strategy
# and the framework's releases, not the batch nor the checkpointing policy: the plan search's
# groups of one layout and strategy (one per policy) share one answer (core/memo.py answers a
# call that reads either on the whole request instead).
@batch_keyed(training_but=("activation_checkpointing",))
def pipeline_usable_bytes(request: PlanRequest) -> tuple[int, ...]:
    """usable_memory_bytes of every pipeline rank, rank 0 first (the request's own alone
    without a pipeline)."""
    if request.parallel.pp == 1:
        return (usable_memory_bytes(request),)
    if not opens_communicators(request):
        return (request.cluster.usable_memory_bytes,) * request.parallel.pp  # no rank holds NCCL buffers
    return tuple(usable_memory_bytes(request.at_pipeline_rank(rank)) for rank in range(request.parallel.pp))
