"""What DeepSpeed's ZeRO optimizer keeps allocated between the micro-steps of gradient
accumulation, after the last one (what its optimizer step sees) and across steps, under the
``deepspeed`` state convention (DeepSpeed 0.19.8 defaults, grad_accum_dtype unset so the
gradients accumulate in the model dtype e).

Measured from DeepSpeed's own engine on gloo, by storage, for ZeRO-1/2/3, accumulation 1/2/4,
with and without contiguous_gradients and overlap_comm, a whole-model and a quarter-model reduce
bucket (benchmarks/deepspeed-accumulation-records, tests/test_deepspeed_accumulation.py): these
formulas equal every record to the byte. Per rank, in bytes, with B = reduce_bucket_size
(zero_bucket_elements, at most Psi: zeroplan's emitted config caps it there), e the model dtype:

| stage | between micro-steps | at the optimizer step | after the step |
| --- | --- | --- | --- |
| 1 | Psi e + B e (x2 with overlap_comm; 0 without contiguous_gradients) | P 4 | 0 |
| 2 | (the parameters overlapping this rank's partition) e | P 4 | 0 |
| 3 | B e (0 without contiguous_gradients) + (sum of ceil(numel/N)) e | that + P 4 | that |

P is the rank's fp32 partition (the master's .grad, zeroplan.core.model_states' gradient under
this convention). Every column also holds the scalars of kept_scalar_bytes.
"""

from __future__ import annotations

from bisect import bisect_right

from zeroplan.core.deepspeed_buckets import flat_group_elements
from zeroplan.core.layout import element_bytes
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import StateConvention
from zeroplan.units import ceil_div

# stage_1_and_2.py step: self._global_grad_norm = scaled_global_norm() / scale, one fp32 scalar
# kept from the first step on. stage3.py step: the same from combine_grad_norm_groups over norms
# in get_norm_dtype() (zero/utils.py: fp64 where the device has it), and inf_or_nan_tracker,
# torch.zeros(1, dtype=torch.bool), made in __init__.
STAGE12_KEPT_SCALAR_BYTES = 4
STAGE3_KEPT_SCALAR_BYTES = 8 + 1


def kept_scalar_bytes(request: PlanRequest) -> int:
    """The scalars DeepSpeed's ZeRO optimizer keeps from its first step on."""
    return STAGE3_KEPT_SCALAR_BYTES if request.strategy.kind.zero_stage == 3 else STAGE12_KEPT_SCALAR_BYTES


def _tensor_numels(request: PlanRequest) -> list[int]:
    """Trainable tensors' element counts in registration order: DeepSpeed's flat group order
    (stage_1_and_2.py flattens param_group['params'], which is model.parameters())."""
    return [t.numel for unit in rank_trainable_units(request) for t in unit.tensors if t.trainable and t.numel]


def _model_dtype_bytes(request: PlanRequest) -> int:
    return element_bytes(request.training.precision, request.convention).compute_parameter


# megatron-core 0.16.1 plans under DeepSpeed's state layout (PlanRequest.convention) but runs its
# own DistributedDataParallel and DistributedOptimizer, not DeepSpeed's engine: its gradients go
# straight into the resident grad_data buffer (distributed/param_and_grad_buffer.py, param.main_grad
# views; zeroplan.core.buffers._megatron_buffers), with no ipg bucket, no gradients left in
# autograd until backward ends and no micro-step buffers of DeepSpeed's stage_1_and_2.py.
def runs_deepspeed_engine(request: PlanRequest) -> bool:
    """Whether DeepSpeed's ZeRO engine (its buckets, epilogue and micro-step buffers) runs the
    request: its state convention, under any framework but megatron-core."""
    return request.convention is StateConvention.deepspeed and request.training.framework is not Framework.megatron


def overlap_comm(request: PlanRequest) -> bool:
    """zero_optimization.overlap_comm as DeepSpeed resolves it (config.py overlap_comm_valid:
    None means stage == 3)."""
    chosen = request.strategy.deepspeed_overlap_comm
    return request.strategy.kind.zero_stage == 3 if chosen is None else chosen


# stage_1_and_2.py / stage3.py allocate reduce_bucket_size elements whatever the model's size;
# the config zeroplan emits (zeroplan.emit.formats.deepspeed_config) and the harness set it to
# at most the trainable elements rounded up to even, which DeepSpeed requires. Hugging Face's
# configs are not capped: accelerate 1.10.1 utils/dataclasses.py DeepSpeedPlugin (no config file)
# writes no reduce_bucket_size, so DeepSpeed's 5e8 (runtime/zero/config.py) is allocated, and a
# config's "auto" becomes hidden_size^2 (transformers 4.56.2 integrations/deepspeed.py
# trainer_config_finalize), whatever the trainable count (a LoRA adapter's few millions).
def _bucket_elements(request: PlanRequest) -> int:
    if request.training.framework is Framework.hf:
        return request.strategy.zero_bucket_elements
    trainable = sum(_tensor_numels(request))
    return min(request.strategy.zero_bucket_elements, trainable + trainable % 2)


# deepspeed 0.19.8 runtime/zero/stage_1_and_2.py setup_buckets: at the first gradient hook of a
# backward, with contiguous_gradients, each ipg bucket gets torch.empty(reduce_bucket_size) in
# the reduction dtype (the model dtype unless grad_accum_dtype differs), and a second one with
# overlap_comm ("double buffers"). The epilogue's _release_ipg_buffers clears them, but stage 1
# runs no epilogue at a micro-step that is not the boundary (engine.py backward: the reduction
# hooks return at once, reduce_ready_partitions_and_remove_grads tests the boundary), so they
# stay from the first micro-step to the last.
def stage12_bucket_bytes(request: PlanRequest) -> int:
    if not request.strategy.deepspeed_contiguous_gradients:
        return 0
    copies = 2 if overlap_comm(request) else 1
    return copies * _bucket_elements(request) * _model_dtype_bytes(request)


# stage_1_and_2.py reduce_ready_partitions_and_remove_grads: stage 1 (partition_gradients false)
# reduces only at the accumulation boundary, so every parameter's .grad (the model dtype, full
# size) accumulates in autograd until the last micro-step, beside the buckets above.
def stage1_between_micro_steps_bytes(request: PlanRequest) -> int:
    return sum(_tensor_numels(request)) * _model_dtype_bytes(request) + stage12_bucket_bytes(request)


# stage_1_and_2.py get_partition_info: a parameter is in rank r's partition when its range in
# the flat group meets [r P, (r + 1) P), P = the aligned group / N (flat_group_elements).
def _partition_parameter_elements(numels: list[int], group_size: int, rank: int) -> int:
    partition = flat_group_elements(sum(numels), group_size) // group_size
    start, end = rank * partition, (rank + 1) * partition
    total, offset = 0, 0
    for numel in numels:
        if offset < end and offset + numel > start:
            total += numel
        offset += numel
    return total


def _largest_partition_parameter_elements(numels: list[int], group_size: int) -> int:
    """The largest rank's :func:`_partition_parameter_elements`. A rank whose partition lies
    inside one tensor holds that tensor alone, so only the ranks where a tensor starts or the
    group ends are summed (O(tensors log tensors) rather than O(N tensors) at 2^20 ranks)."""
    partition = flat_group_elements(sum(numels), group_size) // group_size
    starts, offset = [], 0
    for numel in numels:
        starts.append(offset)
        offset += numel
    ranks = {min(s // partition, group_size - 1) for s in starts} | {max(offset - 1, 0) // partition}
    best = max(numels, default=0)
    for rank in ranks:
        lo, hi = rank * partition, (rank + 1) * partition
        first = max(bisect_right(starts, lo) - 1, 0)
        total, index = 0, first
        while index < len(numels) and starts[index] < hi:
            if starts[index] + numels[index] > lo:
                total += numels[index]
            index += 1
        best = max(best, total)
    return best


# stage_1_and_2.py, stage 2 at a micro-step: reduce_ipg_grads -> copy_grads_in_partition moves
# the gradient of every parameter in this rank's partition, whole, into grads_in_partition
# (torch.empty of their summed numel, the model dtype) and points param.grad at it (without
# contiguous_gradients param.grad itself is kept for those parameters; the others' are freed);
# independent_gradient_partition_epilogue keeps those gradients in all_grad_tensors (accumulated
# into with add_ at later micro-steps) until the boundary's get_flat_partition. The buckets are
# released by the epilogue at every micro-step.
def stage2_between_micro_steps_bytes(request: PlanRequest, rank: int | None = None) -> int:
    """``rank`` None: the largest rank's."""
    numels, group = _tensor_numels(request), request.shard_group_size
    elements = (_largest_partition_parameter_elements(numels, group) if rank is None
                else _partition_parameter_elements(numels, group, rank))
    return elements * _model_dtype_bytes(request)


# deepspeed 0.19.8 runtime/zero/stage3.py __init__ (after initialize_optimizer_states): with
# contiguous_gradients one ipg bucket per communication dtype, torch.empty(reduce_bucket_size),
# and grad_partitions_flat_buffer, torch.zeros(sum of param.partition_numel()) in
# gradient_accumulation_dtype, both allocated once and never freed; partition_grads copies
# (micro_step_id 0) or adds each reduced partition into it, so accumulation allocates nothing
# more. partition_numel is ceil(ds_numel / N) (partition_parameters.py pads each parameter).
def stage3_resident_bytes(request: PlanRequest) -> int:
    e = _model_dtype_bytes(request)
    group = request.shard_group_size
    bucket = _bucket_elements(request) * e if request.strategy.deepspeed_contiguous_gradients else 0
    return bucket + sum(ceil_div(numel, group) for numel in _tensor_numels(request)) * e


def between_micro_steps_bytes(request: PlanRequest, rank: int | None = None) -> int:
    """Gradient, bucket and scalar bytes DeepSpeed holds after a micro-step that is not the
    boundary (from the second step on)."""
    stage = request.strategy.kind.zero_stage
    if stage == 1:
        held = stage1_between_micro_steps_bytes(request)
    elif stage == 2:
        held = stage2_between_micro_steps_bytes(request, rank)
    else:
        held = stage3_resident_bytes(request)
    return held + kept_scalar_bytes(request)


def resident_bytes(request: PlanRequest) -> int:
    """Gradient, bucket and scalar bytes DeepSpeed holds across steps."""
    held = stage3_resident_bytes(request) if request.strategy.kind.zero_stage == 3 else 0
    return held + kept_scalar_bytes(request)


def accumulated_bytes(request: PlanRequest) -> int:
    """What an earlier micro-step leaves for the next beyond the resident bytes: the peak's
    accumulated-gradient term under the deepspeed convention (zeroplan.core.peak)."""
    return between_micro_steps_bytes(request) - resident_bytes(request)
