"""What DeepSpeed's ZeRO stage-1/2 optimizer step allocates beside the states and the fp32
gradient partition it reads (deepspeed 0.19.8 runtime/zero/stage_1_and_2.py; docs/memory-model.md,
"4. Temporary and communication buffers"). Nothing here imports torch."""

from __future__ import annotations

from zeroplan.core.deepspeed_accumulation import runs_deepspeed_engine
from zeroplan.core.deepspeed_buckets import flat_group_elements
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.specs.request import PlanRequest

NORM_COPY_BYTES = 8
"""runtime/zero/utils.py:59-63 get_norm_dtype: gradient norms in torch.double wherever the
device has fp64 (every CUDA GPU)."""


# megatron-core's distributed optimizer (its zero1) plans under the same state convention but
# is not DeepSpeed's engine (runs_deepspeed_engine): megatron-core 0.16.1
# optimizer/distrib_optimizer.py _copy_model_grads_to_main_grads gives each main parameter shard
# its own gradient (shard_main_param.grad = shard_model_grad.float(), a new fp32 tensor per
# parameter under fp16, a view of the fp32 grad buffer under bf16), as its DDP's
# Float16OptimizerWithFloat16Params does for whole parameters (optimizer/optimizer.py
# _copy_model_grads_to_main_grads); its norm is multi_tensor_l2norm's, no fp64 copy.
def runs_flat_step(request: PlanRequest) -> bool:
    """Whether the step is DeepSpeed's ZeRO stage-1/2 optimizer's on the GPU: one flat fp32
    partition per parameter group for the master, its gradient and the states."""
    kind = request.strategy.kind
    return (runs_deepspeed_engine(request) and kind.zero_stage in (1, 2) and not kind.is_fsdp
            and not kind.offloads_optimizer)


def largest_partition_piece_elements(numels: list[int], group_size: int) -> int:
    """The most elements of one tensor inside one rank's partition: the flat group (the tensors
    in order, aligned) cut into ``group_size`` equal partitions, each tensor at their bounds."""
    partition = flat_group_elements(sum(numels), group_size) // group_size
    largest, offset = 0, 0
    for numel in numels:
        start, end = offset, offset + numel
        while start < end:
            bound = (start // partition + 1) * partition
            largest = max(largest, min(end, bound) - start)
            start = min(end, bound)
        offset = end
    return largest


# stage_1_and_2.py:2943-2960 scaled_global_norm runs first in step(), before any group's
# update: get_grad_norm_direct (stage_1_and_2.py:2684) takes torch.linalg.vector_norm of
# g.data.to(get_norm_dtype()) for each gradient of the rank's partition in turn
# (averaged_gradients: the parameters that overlap the partition, narrowed where one straddles a
# bound), so one fp64 copy is alive at a time, the largest piece's.
def norm_copy_bytes(request: PlanRequest) -> int:
    """The gradient norm's largest fp64 copy on the rank (0 where the step is not DeepSpeed's
    ZeRO-1/2 on the GPU)."""
    if not runs_flat_step(request):
        return 0
    numels = [t.numel for unit in rank_trainable_units(request) for t in unit.tensors if t.trainable and t.numel]
    return NORM_COPY_BYTES * largest_partition_piece_elements(numels, request.shard_group_size)
