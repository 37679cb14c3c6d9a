"""The buffers of torch's ring attention, the context parallelism of torchtitan 9dec370 (the
release of its published CP rows): what a block's backward holds beyond the plain SDPA's while
the ring passes K, V and their gradients round the cp ranks."""

from __future__ import annotations

from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import TrainingSpec

FP32_BYTES = 4


def runs_ring_attention(request: PlanRequest) -> bool:
    """Whether the request's context parallelism is torch's ring attention over SDPA: torchtitan
    9dec370 with cp > 1 (train.py -> utils.py:171-193 create_context_parallel_ctx: torch's
    set_rotate_method(job_config's rotate method), then context_parallel());
    torchtitan 0.3.0 all-gathers K and V under FlexAttention instead:
    FrameworkProfile.context_parallel_gathers_kv)."""
    return request.parallel.cp > 1 and torchtitan_sdpa_ring(request.training)


def torchtitan_sdpa_ring(training: TrainingSpec) -> bool:
    """Whether torchtitan's context parallelism is the SDPA ring (9dec370) rather than 0.3.0's
    FlexAttention all-gather."""
    return training.framework is Framework.torchtitan and training.torchtitan_release == "9dec370"


# torch distributed/tensor/experimental/_context_parallel/_attention.py (torch 2.13; the same
# functions in the 2025 torch/distributed/tensor/experimental/_attention.py): under
# context_parallel() DTensor dispatches aten._scaled_dot_product_flash_attention_backward to
# _templated_ring_attention_backward, with 9dec370's rotate method "allgather"
# (config_manager.py experimental.context_parallel_rotate_method) and load balancing on. It
# all-gathers the concatenated local K and V once (_AllGatherRotater: cp x 2 X kept to its end,
# X one local q's bytes, k and v having every query head after 9dec370's repeat_kv), keeps fp32
# accumulators of dq, dk and dv, passes the fp32 dK/dV concatenation round the ring by
# all-to-all (_AllToAllRotater) and merges the round-robin halves with torch.cat
# (_partial_update). torch 1963fc8's own file (the runs' torch) was not read; 9dec370's call of
# set_rotate_method ("allgather" or "alltoall") shows it had both rotaters. Measured on torch's
# own functions on a fake process group, every storage recorded
# (benchmarks/cp_ring_attention_buffers.py, any head count and local length): at the largest
# rank the backward peaks at (2 cp + 26.5) X plus 1.5 fp32 logsumexps, against the plain flash
# backward's 3 X (dq, dk, dv), at cp 2, 4, 8 and 16 alike. Its forward, rerun by the
# recomputing block, peaks lower: (2 cp + 11) X. Counted whole on top of the block's backward
# moment, which also holds the recomputed MLP's tensors, gone by the attention's backward: an
# over-count of at most those.
def ring_attention_backward_extra_bytes(request: PlanRequest) -> int:
    """What one block's attention backward holds under the ring beyond the plain flash kernel's
    dq, dk and dv (0 without the ring, and for a non-16-bit compute dtype, whose SDPA is not the
    flash kernel measured)."""
    if not runs_ring_attention(request):
        return 0
    compute = request.training.precision.compute_bytes
    if compute != 2:
        return 0
    parallel, model, batch = request.parallel, request.model, request.batch
    heads = model.num_heads // parallel.tp
    local_tokens = batch.micro_batch_size * (batch.seq_len // parallel.cp)
    x = compute * local_tokens * heads * model.head_size
    logsumexp = FP32_BYTES * local_tokens * heads
    return (2 * parallel.cp * x + 53 * x // 2 + 3 * logsumexp // 2) - 3 * x
