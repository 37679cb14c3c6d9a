"""Where the DeepSpeed BigScience trained with in early 2022 differs from 0.19.8 under the
megatron-deepspeed profile (TrainingSpec.deepspeed_release "2022-bigscience"; docs/memory-model.md,
"DeepSpeed releases"). Read at microsoft/DeepSpeed@8eef742f0c90f7dce49861b0025f3533a4219f8e
(master on 2022-02-17, version.txt 0.6.0, the day after "bf16 is supported w. zero 1" #1779 and
the day of the BigScience tr11 prequel's 02-17 runs; the big-science branch those runs used is
not public at a named commit, so this is the nearest pinned source). File:line below are that
commit's deepspeed/runtime/... Nothing here imports torch.

- engine.py:1347-1350 _configure_zero_optimizer: "Overlap and contiguous grads are meaningless
  in stage 1 and are ignored": stage 1 runs with contiguous_gradients and overlap_comm False, so
  no ipg bucket is ever allocated (zero/stage_1_and_2.py:592 and :1902 allocate one only with
  contiguous_gradients) and nothing is copied into a gradient partition buffer (:1243-1248);
- the reduction after backward (pipe/engine.py:246-250 -> engine.py:1660-1663 reduce_gradients
  -> stage_1_and_2.py:809-813, :1197-1212 buffered_reduce_fallback -> :1327-1356
  allreduce_bucket) flattens each bucket of up to reduce_bucket_size elements into a new tensor
  and casts it to allreduce_bucket's default communication dtype, fp16, when the gradients are
  not fp16 (bf16);
- the epilogue (:646-690) keeps the partition's gradients themselves (get_flat_partition with
  return_tensor_list: views of each whole .grad) and frees the rest; the step (:1632-1709)
  first checks overflow on each of them (:1835-1840, _has_inf_or_nan :1877 x.float(): one fp32
  copy at a time), then per parameter group takes the norm (:1536 g.data.double(): one fp64
  copy at a time), flattens the group's gradients (a new 16-bit tensor) and casts the flat
  tensor to fp32 (:1694-1700) while it and the group's .grad tensors are alive, and frees those
  .grad tensors (:1709) before the next group.

Its pipeline engine keeps one more buffer slot than 0.19.8's (pipe/schedule.py:246
min(stages - stage_id + 1, micro_batches)), but each slot's inputs and outputs are freed after
their micro-batch's backward (pipe/engine.py:739, :1000), so the in-flight micro-batches, and
the bytes, are the 1F1B schedule's either way: that commit's TrainSchedule, run as it is (pure
Python), gives stage 0 of 10 eleven buffers and at most ten forwards without their backward
(stage 0 of 4: five and four; the last stage: two and one).
"""

from __future__ import annotations

from zeroplan.core.deepspeed_accumulation import _bucket_elements, _model_dtype_bytes
from zeroplan.core.deepspeed_buckets import flat_group_elements
from zeroplan.core.deepspeed_step import NORM_COPY_BYTES, runs_flat_step
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import Precision

RELEASE = "2022-bigscience"
FP32_BYTES = 4
OVERFLOW_COPY_BYTES = 4
"""stage_1_and_2.py:1877 _has_inf_or_nan: x.float().sum(), an fp32 copy of the gradient."""
COMMUNICATION_BYTES = 2
"""stage_1_and_2.py:1329 allreduce_bucket(communication_data_type=torch.float16)."""


def models_2022(request: PlanRequest) -> bool:
    """Whether the request is the 2022 DeepSpeed's ZeRO stage-1 optimizer on the GPU."""
    return (request.training.framework is Framework.megatron_deepspeed
            and request.training.deepspeed_release == RELEASE and runs_flat_step(request))


# The fork's megatron/optimizer/__init__.py get_param_groups (zeroplan.core.megatron_deepspeed
# param_group_elements): weight-decay tensors, then biases and 1-D tensors; stage_1_and_2.py
# flattens each group apart (bit16_groups) and reduces group by group (:601-604).
def group_numels(request: PlanRequest) -> list[list[int]]:
    """Each non-empty parameter group's trainable tensors' element counts, in model order."""
    decayed: list[int] = []
    no_decay: list[int] = []
    for unit in rank_trainable_units(request):
        for tensor in unit.tensors:
            if tensor.trainable and tensor.numel:
                (no_decay if len(tensor.shape) == 1 or tensor.name.endswith(".bias") else decayed).append(tensor.numel)
    return [g for g in (decayed, no_decay) if g]


def partition_pieces(numels: list[int], group_size: int) -> tuple[int, int, int]:
    """For the rank whose partition holds the most: its partition's elements, the whole .grad
    elements it keeps (every tensor overlapping it) and its largest piece of one tensor."""
    partition = flat_group_elements(sum(numels), group_size) // group_size
    best = (0, 0)
    for rank in range(group_size):
        lo, hi = rank * partition, (rank + 1) * partition
        held = largest = offset = 0
        for numel in numels:
            start, end = max(offset, lo), min(offset + numel, hi)
            if start < end:
                held += numel
                largest = max(largest, end - start)
            offset += numel
        best = max(best, (held, largest))
    return partition, best[0], best[1]


# stage_1_and_2.py:1632-1745 step, in order: overflow check over every kept gradient, then per
# group the fp64 norm copies, the flat 16-bit copy and its fp32 cast (the group's .grad tensors
# still alive, the earlier groups' fp32 partitions made), then the fused optimizer on the fp32
# partitions (apex FusedAdam: no state-sized temporary).
def step_peak_bytes(request: PlanRequest) -> int:
    """The most the 2022 step holds beyond the model's parameters and optimizer states."""
    e = _model_dtype_bytes(request)
    groups = [partition_pieces(numels, request.shard_group_size) for numels in group_numels(request)]
    held = [e * h for _, h, _ in groups]
    moments = [sum(held) + OVERFLOW_COPY_BYTES * max((piece for _, _, piece in groups), default=0)]
    made = 0
    for i, (partition, _, piece) in enumerate(groups):
        alive = sum(held[i:]) + made
        moments += [alive + NORM_COPY_BYTES * piece, alive + (e + FP32_BYTES) * partition]
        made += FP32_BYTES * partition
    return max(moments + [made])


def step_temporary_bytes(request: PlanRequest) -> int:
    """PeakTerms.step_temporary: the step's peak beyond the fp32 gradient partition the
    optimizer-step moment already counts (the model states' gradients)."""
    fp32_partition = FP32_BYTES * sum(partition_pieces(n, request.shard_group_size)[0] for n in group_numels(request))
    return max(step_peak_bytes(request) - fp32_partition, 0)


# stage_1_and_2.py:809-813 flushes the bucket before a gradient that would overflow it (the
# bucket runs on across groups, :601-604), and :1197-1212 hands it whole to
# buffered_reduce_fallback, whose allreduce_bucket (:1333) flattens it and casts a bf16 flat
# tensor to fp16 (:1340-1341).
def reduce_copy_bytes(request: PlanRequest) -> int:
    """PeakTerms.backward_end_buffers: the largest bucket's flat copy (and its fp16 cast)."""
    capacity = _bucket_elements(request)
    largest = bucket = 0
    for numel in (n for numels in group_numels(request) for n in numels):
        if bucket and bucket + numel > capacity:
            bucket = 0
        bucket += numel
        largest = max(largest, bucket)
    e = _model_dtype_bytes(request)
    cast = COMMUNICATION_BYTES if request.training.precision is not Precision.fp16_mixed else 0
    return (e + cast) * largest


# Which rank the allocator's replay takes: the step's largest single allocations are the fp32 and
# fp64 copies of a rank's largest piece (check_overflow, get_grad_norm_direct), made after the
# activations' blocks are freed but too large for them, so the rank with the largest piece (the
# first data-parallel rank of the first stage, whose partition opens with the word embedding)
# reserves the most; partition_pieces' rank, which keeps the most .grad bytes, sets the
# allocated peak.
def partition_tensor_pieces(numels: list[int], group_size: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """For the rank whose partition holds the largest piece of one tensor (then the most kept
    .grad elements): its partition's elements, the indices of the tensors whose whole .grad it
    keeps and each one's piece inside the partition."""
    partition = flat_group_elements(sum(numels), group_size) // group_size
    best: tuple[tuple[int, int], tuple[int, ...], tuple[int, ...]] = ((-1, -1), (), ())
    for rank in range(group_size):
        lo, hi = rank * partition, (rank + 1) * partition
        kept: list[int] = []
        pieces: list[int] = []
        offset = 0
        for index, numel in enumerate(numels):
            start, end = max(offset, lo), min(offset + numel, hi)
            if start < end:
                kept.append(index)
                pieces.append(end - start)
            offset += numel
        score = (max(pieces, default=0), sum(numels[i] for i in kept))
        if score > best[0]:
            best = (score, tuple(kept), tuple(pieces))
    return partition, best[1], best[2]


# The step's allocations in their order, tensor by tensor (what step_peak_bytes takes the moments
# of; the allocator's schedule replays them, zeroplan.allocator.schedule): every 16-bit .grad is
# its own tensor, made by the first micro-batch's backward; the epilogue's zero_grad
# (stage_1_and_2.py:690) frees those outside the partition; check_overflow (:1640, :1835-1840,
# :1877) makes and drops an fp32 copy of every kept piece, group after group; then per group
# (:1676-1709) get_grad_norm_direct's fp64 copy of every piece (:1536), one at a time, the flat
# 16-bit partition (:1694-1700), its fp32 cast (kept as the fp32 partition's .grad), the flat
# copy dropped and the group's .grad tensors freed (:1709); the fp32 partitions go after the
# optimizer's step.
def step_allocations(request: PlanRequest) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...],
                                                      tuple[tuple[int, int, tuple[int, ...]], ...]]:
    """(every .grad's bytes in model order, the indices of those the step keeps, each group's
    kept indices, per group (flat 16-bit bytes, fp32 partition bytes, its pieces' elements)),
    for partition_tensor_pieces' rank."""
    e = _model_dtype_bytes(request)
    grads: list[int] = []
    kept: list[int] = []
    group_kept: list[tuple[int, ...]] = []
    groups: list[tuple[int, int, tuple[int, ...]]] = []
    for numels in group_numels(request):
        partition, indices, pieces = partition_tensor_pieces(numels, request.shard_group_size)
        base = len(grads)
        grads += [e * n for n in numels]
        kept += [base + i for i in indices]
        group_kept.append(tuple(base + i for i in indices))
        groups.append((e * partition, FP32_BYTES * partition, pieces))
    return tuple(grads), tuple(kept), tuple(group_kept), tuple(groups)
