"""What DeepSpeed ZeRO stages 1 and 2 put on the wire, in elements (DeepSpeed 0.19.8, defaults).

With the default config (deepspeed/runtime/zero/config.py: reduce_scatter=True,
use_multi_rank_bucket_allreduce=True, contiguous_gradients=True, reduce_bucket_size=5e8,
allgather_bucket_size=5e8, overlap_comm=False below stage 3) DeepSpeed does not reduce-scatter:

- gradients are packed into a reduce ("ipg") bucket of at most reduce_bucket_size elements and
  each bucket is *all-reduced* whole (stage_1_and_2.py: reduce_independent_p_g_buckets_and_remove_grads
  fills it; reduce_ipg_grads -> average_tensor puts every slice under the ("allreduce", group) key
  because use_multi_rank_bucket_allreduce is True; allreduce_and_scatter -> allreduce_bucket ->
  dist.all_reduce); each rank then keeps the slice of its own partition;
- the updated parameters come back with one all_gather_into_tensor of the whole flat group
  (runtime/utils.py: all_gather_dp_groups -> all_gather_into_tensor_dp_groups; the chunking by
  allgather_bucket_size is only the fallback for a backend without all_gather_into_tensor).
"""

from __future__ import annotations

import functools

from zeroplan.units import ceil_div

# deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__:
# nccl_start_alignment_factor = 2 and the flat group is padded to a multiple of that times N.
NCCL_START_ALIGNMENT_ELEMENTS = 2


# stage_1_and_2.py __init__: aligned_numel = ceil(numel / (2 * N)) * (2 * N)
# (flatten_dense_tensors_aligned; parameter_alignment is False by default, so no per-tensor padding).
def flat_group_elements(numel: int, group_size: int) -> int:
    """Elements of DeepSpeed's flat parameter group: what the step's all-gather fills."""
    alignment = NCCL_START_ALIGNMENT_ELEMENTS * group_size
    return ceil_div(numel, alignment) * alignment


# stage_1_and_2.py average_tensor cuts a gradient at the rank partitions' bounds, and
# allreduce_and_scatter appends the slices to a small bucket all-reduced as soon as its element
# count exceeds reduce_bucket_size. The slices are a head up to the first bound, whole partitions
# and a tail, so the calls are found a run of whole partitions at a time rather than slice by
# slice (a tensor spans a million partitions at 2^20 ranks; tests/test_deepspeed_buckets.py
# checks this against the slice-by-slice loop).
def _sliced_all_reduce_calls(offset: int, numel: int, partition_elements: int, cap_elements: int) -> list[int]:
    """Elements of every all-reduce of one gradient of ``numel`` elements at ``offset`` in the
    flat group, cut at partitions of ``partition_elements``, in buckets closing past ``cap_elements``."""
    calls, filled = [], 0
    position, end = offset, offset + numel
    while position < end:
        bound = (position // partition_elements + 1) * partition_elements
        if position % partition_elements == 0 and end - position >= partition_elements:
            # Whole partitions from here: the bucket closes after the k-th that passes the cap.
            whole = (end - position) // partition_elements
            needed = (cap_elements - filled) // partition_elements + 1
            taken = min(whole, needed)
            filled += taken * partition_elements
            position += taken * partition_elements
        else:
            piece = min(end, bound) - position
            filled += piece
            position += piece
        if filled > cap_elements:
            calls.append(filled)
            filled = 0
    if filled:
        calls.append(filled)
    return calls


# stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads: the ipg bucket is reduced
# before a gradient that would overflow it is added; a gradient larger than the bucket
# (extra_large_param_to_reduce) is reduced alone, cut at the partitions it spans (average_tensor).
def gradient_all_reduce_elements(
    tensor_numels: list[int], arrival_order: list[int], cap_elements: int, group_size: int,
) -> list[int]:
    """Elements of every gradient all-reduce of one reduction pass.

    ``tensor_numels`` are the parameters in the flat group's (registration) order;
    ``arrival_order`` the indices in the order their gradients reach the bucket."""
    offsets, position = [], 0
    for numel in tensor_numels:
        offsets.append(position)
        position += numel
    partition_elements = flat_group_elements(position, group_size) // group_size
    calls: list[int] = []
    bucket = 0
    for index in arrival_order:
        numel = tensor_numels[index]
        if numel == 0:
            continue
        if bucket + numel > cap_elements and bucket:
            calls.append(bucket)
            bucket = 0
        if numel > cap_elements:
            calls += _sliced_all_reduce_calls(offsets[index], numel, partition_elements, cap_elements)
            continue
        bucket += numel
    if bucket:
        calls.append(bucket)
    return calls


# ZeRO-2 and ZeRO-2 with offload fill the same buckets from the same gradients in the same
# order (a fit plans both): each pass is cut once (a 405B fit on 65,536 ranks: ~1,100 tensors
# cut at partitions of ~6,000 elements).
@functools.lru_cache(maxsize=64)
def shared_gradient_all_reduce_elements(tensor_numels: tuple[int, ...], reverse_order: bool, cap_elements: int,
                                        group_size: int) -> tuple[int, ...]:
    """gradient_all_reduce_elements of gradients arriving in registration order (or its
    reverse), once per tensors, order, cap and group."""
    order = list(range(len(tensor_numels)))
    if reverse_order:
        order.reverse()
    return tuple(gradient_all_reduce_elements(list(tensor_numels), order, cap_elements, group_size))
