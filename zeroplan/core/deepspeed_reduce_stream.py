"""What DeepSpeed ZeRO-3 allocates on its reduce-and-partition stream (deepspeed 0.14.2 and 0.19.8,
the hf profile's releases): the caching allocator keeps a stream's blocks apart, so these make
segments of their own beside the compute stream's.

The stream is a stream of its own where overlap_comm is on (stage3.py:227-228 at v0.14.2,
:340-341 at 0.19.8: ``get_accelerator().Stream() if overlap_comm else default_stream()``;
overlap_comm defaults to on at stage 3, zeroplan.core.deepspeed_accumulation.overlap_comm). In its
context:

- each flush of the ipg bucket in backward (stage3.py:1221-1224 at v0.14.2, a bucket reduced before
  a gradient that would overflow it) runs __reduce_and_partition_ipg_grads (:1265 ``with
  get_accelerator().stream(self.reduce_and_partition_stream)``), whose __avg_scatter_grads
  (reduce_scatter true by default) calls reduce_scatter_coalesced: one flat, rank-interleaved
  torch.cat of the bucket's gradients, each padded to N chunks (comm/coalesced_collectives.py
  :100-122 at v0.14.2), none where the bucket is one tensor that divides evenly
  (zeroplan.core.deepspeed_epilogue.bucket_flat_copy_bytes, whose flat_copy_bytes counts the last
  bucket's, flushed by the epilogue);
- under fp16 the step's overflow check (stage3.py:2138-2143 at v0.14.2, :3009-3014 at 0.19.8,
  has_overflow: ``torch.isinf(self.grad_partitions_flat_buffer).any()``, then ``torch.isnan``)
  makes a bool tensor of the whole gradient partition, twice, one after the other.

Measured on DeepSpeed 0.14.2's own engine (benchmarks/deepspeed_zero3_fp16_streams.py, each
allocation put on the stream its call runs in on CUDA): the reduce stream reserves 1.90 GiB at
Llama-3-8B's widths (8 blocks, 8 ranks) where the planner put nothing there."""

from __future__ import annotations

from zeroplan.core.deepspeed_accumulation import _model_dtype_bytes, _tensor_numels, overlap_comm
from zeroplan.core.deepspeed_epilogue import bucket_flat_copy_bytes, flat_copy_bytes, ipg_buckets, models_epilogue
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import Precision
from zeroplan.specs.request import PlanRequest
from zeroplan.units import ceil_div

OVERFLOW_CHECK_ELEMENT_BYTES = 1
"""torch.isinf / torch.isnan's output: one bool per element."""


# stage3.py:227-228 at v0.14.2 (:340-341 at 0.19.8): a stream of its own only under overlap_comm.
def models_reduce_stream(request: PlanRequest) -> bool:
    """Whether the request's ZeRO-3 reduction runs on a stream of its own as modelled here: plain
    stage 3 under DeepSpeed's engine (deepspeed_epilogue.models_epilogue) in the hf profile, with
    overlap_comm on."""
    return (models_epilogue(request) and request.training.framework is Framework.hf and overlap_comm(request))


# stage3.py:1221-1224 at v0.14.2 (reduce_independent_p_g_buckets_and_remove_grads), :1265 (the flush
# in the reduce stream's context); its flat copy comm/coalesced_collectives.py:100-122 at v0.14.2.
def backward_flushes(request: PlanRequest) -> tuple[tuple[int, int], ...]:
    """Each bucket flush in backward before the epilogue's, as (trainable elements whose gradients
    had arrived when it ran, its flat copy's bytes); gradients arrive in the reverse of
    registration. () where models_reduce_stream does not apply."""
    if not models_reduce_stream(request):
        return ()
    group, element_bytes = request.shard_group_size, _model_dtype_bytes(request)
    flushes: list[tuple[int, int]] = []
    arrived = 0
    for bucket in ipg_buckets(request)[:-1]:
        arrived += sum(bucket)
        flushes.append((arrived, bucket_flat_copy_bytes(bucket, group, element_bytes)))
    return tuple(flushes)


# stage3.py:1082-1084 at v0.14.2 (independent_gradient_partition_epilogue) -> :1265: the epilogue's
# flush runs in the reduce stream's context too; measured on 0.14.2's own engine with one and
# with eight gloo ranks (benchmarks/deepspeed_zero3_fp16_streams.py), its torch.cat is made there.
def epilogue_copy_bytes(request: PlanRequest) -> int:
    """The epilogue's flat copy of the last bucket, made on the reduce stream (0 where
    models_reduce_stream does not apply or the bucket needs none)."""
    if not models_reduce_stream(request):
        return 0
    return flat_copy_bytes(request)


# stage3.py:2138-2143 at v0.14.2, :3009-3014 at 0.19.8 (has_overflow under fp16's loss scaler).
def overflow_check_bytes(request: PlanRequest) -> int:
    """The bool tensor has_overflow makes of the gradient partition (fp16 only; 0 elsewhere)."""
    if not models_reduce_stream(request) or request.training.precision is not Precision.fp16_mixed:
        return 0
    group = request.shard_group_size
    return sum(ceil_div(numel, group) for numel in _tensor_numels(request)) * OVERFLOW_CHECK_ELEMENT_BYTES


# stage3.py:1221-1224 at v0.14.2: the flush runs in the hook of the gradient that overflows the bucket.
def flushes_by_block(request: PlanRequest, blocks: int) -> tuple[tuple[int, ...], ...]:
    """backward_flushes' flat copies grouped by the block whose backward makes them, the last
    block first (backward's order): a flush runs when the gradient that overflows the bucket
    arrives, so in the backward of that gradient's module (the head's and the embedding's with
    the nearest block's). () where there are none."""
    flushes = backward_flushes(request)
    if not any(size for _, size in flushes):
        return ()
    from zeroplan.core.parallel.units import rank_trainable_units

    starts: list[tuple[int, int]] = []
    arrived, position = 0, -1
    for unit in reversed(rank_trainable_units(request)):
        if unit.name.startswith("block."):
            position += 1
        starts.append((arrived, min(max(position, 0), blocks - 1)))
        arrived += sum(t.numel for t in unit.tensors if t.trainable)
    out: list[list[int]] = [[] for _ in range(blocks)]
    for at, size in flushes:
        block = next(position for start, position in reversed(starts) if start <= at)
        if size:
            out[block].append(size)
    return tuple(map(tuple, out))
