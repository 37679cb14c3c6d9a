"""What DeepSpeed holds through backward and at its end (deepspeed 0.19.8), where the planner's
generic moments count the gradients the optimizer reads and the largest unit's buffers.

ZeRO-1 (overlap_comm off, its default below stage 3) reduces nothing in backward: every gradient
stays in autograd, full size in the model dtype, until backward ends (stage1_keeps_gradients).

ZeRO-3 (its default reduce_scatter and contiguous_gradients) at the end of backward:

- the gradient epilogue reduce-scatters what is left in the ipg bucket
  (stage3.py:1407-1411 independent_gradient_partition_epilogue -> :1648
  __reduce_and_partition_ipg_grads -> :1912 __avg_scatter_grads -> :1931
  reduce_scatter_coalesced), and reduce_scatter_coalesced copies the bucket's gradients into one
  flat, rank-interleaved buffer (comm/coalesced_collectives.py:102-122 torch.cat) unless the
  bucket is one tensor that divides evenly; that buffer is what the backend reduce-scatters;
- the first module's parameters are still gathered: its input (token ids) needs no gradient, so
  its post-backward hook never fires (runtime/zero/parameter_offload.py:497-512,
  PostBackwardFunctionModule counts only inputs that require grad) and backward_epilogue
  releases it after the gradient epilogue (stage3.py:3059-3068, release_backward_leftovers);
- no fp32 gradient partition yet: the step makes it (stage3.py:2683-2693
  _prepare_fp32_grad_for_sub_group, flatten(...).to(fp32)); until then the reduced gradients
  are in grad_partitions_flat_buffer, a resident buffer (deepspeed_accumulation.stage3_resident_bytes).

Measured on gloo (benchmarks/emitted-records/tiny-llama-zero3-deepspeed-n2, an allocator
snapshot of rank 0): at the step's peak the live blocks are the partition, the fp32 master and
AdamW's two states, the bucket and the partition buffer, the gathered embedding (12 MiB), the
flat copy (48 MiB) and gloo's own copy of it (48 MiB; zeroplan.validate.gloo), nothing else."""

from __future__ import annotations

from zeroplan.core.deepspeed_accumulation import (
    _bucket_elements, _model_dtype_bytes, _tensor_numels, overlap_comm, runs_deepspeed_engine,
)
from zeroplan.core import deepspeed_coordinator
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import StateConvention
from zeroplan.units import ceil_div


def models_epilogue(request: PlanRequest) -> bool:
    """Whether the request's end of backward is DeepSpeed ZeRO-3's epilogue as modelled here:
    plain stage 3 under DeepSpeed's own state convention (the offload, hpZ, ZeRO++ and MiCS
    variants move or quantize these buffers and keep the generic moment)."""
    return request.strategy.kind is StrategyKind.zero3 and request.convention is StateConvention.deepspeed


# stage3.py:1583-1585 reduce_independent_p_g_buckets_and_remove_grads flushes the bucket before
# a gradient that would overflow it; gradients arrive in backward, the reverse of registration.
def ipg_buckets(request: PlanRequest) -> list[list[int]]:
    """The trainable tensors' element counts bucket by bucket, in the order backward fills them:
    every bucket but the last is flushed in backward (zeroplan.core.deepspeed_reduce_stream), the
    last by the epilogue."""
    capacity = _bucket_elements(request)
    buckets: list[list[int]] = [[]]
    for numel in reversed(_tensor_numels(request)):
        if buckets[-1] and sum(buckets[-1]) + numel > capacity:
            buckets.append([])
        buckets[-1].append(numel)
    return buckets


def last_bucket_numels(request: PlanRequest) -> list[int]:
    """The trainable tensors' element counts the epilogue finds in the bucket."""
    return ipg_buckets(request)[-1]


# comm/coalesced_collectives.py:93-122: each tensor is cut into N chunks of ceil(numel / N)
# (padded), interleaved rank by rank into one torch.cat and that buffer reduce-scattered (:128);
# one tensor that divides evenly is reduce-scattered in place (a view of the bucket).
def padded_bucket_bytes(numels: list[int], group: int, element_bytes: int) -> int:
    """The buffer reduce_scatter_coalesced reduce-scatters for a bucket: each tensor padded."""
    return sum(ceil_div(numel, group) * group for numel in numels) * element_bytes


def bucket_flat_copy_bytes(numels: list[int], group: int, element_bytes: int) -> int:
    """The flat buffer reduce_scatter_coalesced makes of a bucket (0 where it need not)."""
    if len(numels) == 1 and numels[0] % group == 0:
        return 0
    return padded_bucket_bytes(numels, group, element_bytes)


def reduce_scatter_input_bytes(request: PlanRequest) -> int:
    """The buffer the epilogue's reduce-scatter reads: the last bucket, each tensor padded."""
    return padded_bucket_bytes(last_bucket_numels(request), request.shard_group_size, _model_dtype_bytes(request))


def flat_copy_bytes(request: PlanRequest) -> int:
    """The flat buffer reduce_scatter_coalesced makes of the last bucket (0 where it need not)."""
    return bucket_flat_copy_bytes(last_bucket_numels(request), request.shard_group_size, _model_dtype_bytes(request))


def first_module_gathered_bytes(request: PlanRequest) -> int:
    """The first module's gathered parameters (its persistent ones are counted with the
    parameters, never gathered per step; none on one rank, which gathers nothing:
    zeroplan.core.deepspeed_one_rank)."""
    from zeroplan.core.deepspeed_one_rank import gathers_nothing

    if gathers_nothing(request):
        return 0
    return deepspeed_coordinator.first_module_gathered_bytes(request, _model_dtype_bytes(request))


def epilogue_buffer_bytes(request: PlanRequest) -> int:
    """Beyond the resident bucket and partition buffer: the flat copy and the first module."""
    return flat_copy_bytes(request) + first_module_gathered_bytes(request)


# runtime/zero/stage_1_and_2.py:2284-2291 process_gradients reduces a gradient in its hook only
# with partition_gradients (stage 2) or overlap_comm; otherwise the engine reduces every
# gradient once backward has ended (engine.py:3085-3097 allreduce_gradients ->
# stage_1_and_2.py:958-978 reduce_gradients). Measured (benchmarks/deepspeed-records, zero1
# fp32, an allocator snapshot of rank 0): the head's gradient is alive at the first block's
# backward, beside the bucket setup_buckets made at its hook.
def stage1_keeps_gradients(request: PlanRequest) -> bool:
    """Whether DeepSpeed leaves the gradients in autograd until backward ends: ZeRO-1 run by
    its engine (runs_deepspeed_engine) without overlap_comm."""
    return request.strategy.kind is StrategyKind.zero1 and runs_deepspeed_engine(request) and not overlap_comm(request)


# stage_1_and_2.py:3256-3281 setup_buckets allocates the ipg bucket(s) only while
# ready_for_gradients is False, which only _release_ipg_buffers (:924-932) sets, called from
# independent_gradient_partition_epilogue (:1061); stage 1 runs that epilogue only at the
# accumulation boundary (engine.py:3082-3092 allreduce_gradients). So the bucket the first
# micro-step's first hook made is the one every later micro-step reduces through: what
# deepspeed_accumulation.stage12_bucket_bytes counts between micro-steps, not a second one made
# in the last micro-step's backward. Measured (DeepSpeed 0.19.8 on gloo, zero1 fp32 accumulation
# 2, tiny-llama): the step's peak stays below the carried bucket plus a new one.
def stage1_carries_bucket(request: PlanRequest) -> bool:
    """Whether, under accumulation, ZeRO-1's backward reduces through the bucket the earlier
    micro-steps carry (PeakTerms.accumulated_gradients) rather than allocating its own."""
    strategy = request.strategy
    return (strategy.kind is StrategyKind.zero1 and runs_deepspeed_engine(request)
            and strategy.deepspeed_contiguous_gradients and request.batch.grad_accum_steps > 1
            and not request.training.optimizer_in_backward)


def stage1_gradient_bytes(request: PlanRequest) -> int:
    """Every trainable gradient, full size in the model dtype: what ZeRO-1 holds as backward ends."""
    return sum(_tensor_numels(request)) * _model_dtype_bytes(request)


def _after_block_numels(request: PlanRequest) -> list[int]:
    """The trainable tensors after the last block (final norm, head): their gradients are made
    before the first block's backward."""
    units = rank_trainable_units(request)
    last_block = max((i for i, unit in enumerate(units) if unit.name.startswith("block.")), default=len(units) - 1)
    return [t.numel for unit in units[last_block + 1:] for t in unit.tensors if t.trainable and t.numel]


# stage_1_and_2.py:1455-1461 (contiguous_gradients): a hook that reduces copies the gradient into
# the bucket and points param.grad at the copy, so autograd's gradient goes once copied; the
# first hook (the head's, stage_1_and_2.py:2287 setup_buckets) allocates the bucket beside it.
# Measured (benchmarks/deepspeed-records zero2 fp32, an allocator snapshot of rank 0): the
# step's peak is that allocation, with the head's 12 MiB gradient and the activations alive.
def early_gradient_bytes(request: PlanRequest) -> int:
    """Gradients alive at the first block's backward under DeepSpeed ZeRO-1/2 (its engine):
    ZeRO-1 without overlap_comm at one micro-batch a step keeps all those after the blocks; a
    stage that reduces in its hooks holds the largest of them while copying it into the bucket;
    0 elsewhere (ZeRO-1 accumulating carries its full gradients already)."""
    kind = request.strategy.kind
    if not runs_deepspeed_engine(request) or kind not in (StrategyKind.ddp, StrategyKind.zero1, StrategyKind.zero2,
                                                           StrategyKind.zero2_offload):
        return 0
    numels = _after_block_numels(request)
    # Stage 0 (kind ddp under the convention) reduces only once backward ends, as ZeRO-1 does.
    if stage1_keeps_gradients(request) or kind is StrategyKind.ddp:
        return sum(numels) * _model_dtype_bytes(request) if request.batch.grad_accum_steps == 1 else 0
    if not request.strategy.deepspeed_contiguous_gradients:
        return 0
    return max(numels, default=0) * _model_dtype_bytes(request)
