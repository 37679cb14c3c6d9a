"""The gradients DeepSpeed ZeRO-3's optimizer step holds beside the resident states
(deepspeed 0.19.8 runtime/zero/stage3.py). Nothing here imports torch.

step() (stage3.py:2910-2927) updates one optimizer sub-group at a time (the partition cut at
sub_group_size elements, zeroplan.core.nvme.sub_group_tensor_elements):
_prepare_fp32_grad_for_sub_group (:2683-2697) flattens the sub-group's reduced gradients, views
of grad_partitions_flat_buffer in the model dtype (:1424-1427), with _flatten_dense_tensors (a
torch.cat of two or more tensors, a view of one) and casts the flat copy to fp32, both alive while
the cast runs; _release_sub_group (:2731-2736) drops the fp32 gradient before the next
sub-group's is made. So the step holds the largest sub-group's flat copy and fp32 gradient, not
the whole partition's fp32 gradient.

DeepSpeed cuts each optimizer parameter group into sub-groups on its own (stage3.py
_create_fp16_sub_groups per param_group); the sub-groups here are cut from every trainable
tensor in registration order, as one group: a Trainer's no-decay group (norms and biases, a few
MiB) counts with the weights beside it."""

from __future__ import annotations

from zeroplan.core.deepspeed_bf16_autocast import step_cast_element_bytes
from zeroplan.core.deepspeed_accumulation import _model_dtype_bytes, runs_deepspeed_engine
from zeroplan.core.deepspeed_step import NORM_COPY_BYTES
from zeroplan.core.nvme import sub_group_tensor_elements
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.specs.request import PlanRequest
from zeroplan.units import FP32_BYTES, ceil_div


def steps_by_sub_group(request: PlanRequest) -> bool:
    """Whether the step is DeepSpeed ZeRO-3's on the GPU (its states on the device)."""
    kind = request.strategy.kind
    return (runs_deepspeed_engine(request) and kind.zero_stage == 3 and not kind.is_fsdp
            and not kind.offloads_optimizer and not kind.optimizer_on_nvme)


# stage3.py:2686-2687: self.flatten(self.averaged_gradients[i]).to(fp32): the flat copy in the
# model dtype (none for one tensor: a view), and the fp32 cast (none where the model dtype is fp32).
def sub_group_step_parts(elements: list[int], model_dtype_bytes: int, cast_bytes: int | None = None) -> tuple[int, int]:
    """What one sub-group's step makes: its flat gradient copy's bytes and its cast's to the
    master's dtype (``cast_bytes`` a element; None: fp32's, none where the model dtype is fp32)."""
    flat = model_dtype_bytes if len(elements) > 1 else 0
    cast = (FP32_BYTES if model_dtype_bytes != FP32_BYTES else 0) if cast_bytes is None else cast_bytes
    return sum(elements) * flat, sum(elements) * cast


def sub_group_steps(request: PlanRequest) -> tuple[tuple[int, int], ...]:
    """Each sub-group's (flat copy, fp32 cast) bytes, in the order the step makes and frees them
    (what the caching-allocator model's trace allocates); empty where the step is not DeepSpeed
    ZeRO-3's on the GPU."""
    if not steps_by_sub_group(request):
        return ()
    e = _model_dtype_bytes(request)
    cast = step_cast_element_bytes(request, e)
    return tuple(sub_group_step_parts(group, e, cast) for group in sub_group_tensor_elements(request))


# stage3.py:2029 at v0.14.2 (step: _get_norm_groups :1837-1844 before any sub-group's update) ->
# get_grad_norm_direct :1745-1749: ``g.to(device).double().norm(2)`` for each gradient partition in
# averaged_gradients (each parameter's partition of ceil(numel / N) elements, a view of
# grad_partitions_flat_buffer), one at a time; 0.13.3 :1749 the same, 0.19.8 :2457
# ``.to(get_norm_dtype())``, fp64 wherever the device has it. DeepSpeed 0.14.2's own engine on one
# gloo rank (benchmarks/deepspeed_zero3_fp16_streams.py --world 1) makes an fp64 copy of the
# head's and the embedding's gradient partitions on the compute stream as its step starts.
def norm_copy_bytes(request: PlanRequest) -> int:
    """The gradient norm's largest fp64 copy: of the largest parameter's partition (0 where the
    step is not DeepSpeed ZeRO-3's on the GPU)."""
    if not steps_by_sub_group(request):
        return 0
    group = request.shard_group_size
    numels = [t.numel for unit in rank_trainable_units(request) for t in unit.tensors if t.trainable and t.numel]
    return NORM_COPY_BYTES * max((ceil_div(numel, group) for numel in numels), default=0)


def step_gradient_bytes(request: PlanRequest) -> int | None:
    """PeakTerms.step_gradients: the largest sub-group's flat copy and fp32 gradient, alive at
    the step's peak; None where the step is not DeepSpeed ZeRO-3's on the GPU."""
    if not steps_by_sub_group(request):
        return None
    return max((flat + cast for flat, cast in sub_group_steps(request)), default=0)
