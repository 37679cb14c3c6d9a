"""What DeepSpeed ZeRO-3 holds at the end of backward (deepspeed 0.19.8, its default
reduce_scatter and contiguous_gradients), where the planner's generic end of backward counts the
largest unit gathered twice and the gradients the optimizer reads:

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

from zeroplan.core.deepspeed_accumulation import _bucket_elements, _model_dtype_bytes, _tensor_numels
from zeroplan.core.deepspeed_prefetch import _gathered_bytes, _modules, _persistent
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
def last_bucket_numels(request: PlanRequest) -> list[int]:
    """The trainable tensors' element counts the epilogue finds in the bucket."""
    capacity = _bucket_elements(request)
    bucket: list[int] = []
    for numel in reversed(_tensor_numels(request)):
        if bucket and sum(bucket) + numel > capacity:
            bucket = []
        bucket.append(numel)
    return bucket


# comm/coalesced_collectives.py:93-122: each tensor is cut into N chunks of ceil(numel / N)
# (padded), interleaved rank by rank into one torch.cat and that buffer reduce-scattered (:128);
# one tensor that divides evenly is reduce-scattered in place (a view of the bucket).
def reduce_scatter_input_bytes(request: PlanRequest) -> int:
    """The buffer the epilogue's reduce-scatter reads: the last bucket, each tensor padded."""
    group = request.shard_group_size
    return sum(ceil_div(numel, group) * group for numel in last_bucket_numels(request)) * _model_dtype_bytes(request)


def flat_copy_bytes(request: PlanRequest) -> int:
    """The flat buffer reduce_scatter_coalesced makes of the last bucket (0 where it need not)."""
    numels = last_bucket_numels(request)
    if len(numels) == 1 and numels[0] % request.shard_group_size == 0:
        return 0
    return reduce_scatter_input_bytes(request)


def first_module_gathered_bytes(request: PlanRequest) -> int:
    """The first module's gathered parameters (its persistent ones are counted with the
    parameters, never gathered per step)."""
    tensors = [t for t in _modules(request)[0][1] if not _persistent(request, t)]
    return sum(_gathered_bytes(request, t, _model_dtype_bytes(request)) for t in tensors)


def epilogue_buffer_bytes(request: PlanRequest) -> int:
    """Beyond the resident bucket and partition buffer: the flat copy and the first module."""
    return flat_copy_bytes(request) + first_module_gathered_bytes(request)
