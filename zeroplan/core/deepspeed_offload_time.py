"""What DeepSpeed's optimizer offload (ZeRO-Offload, stage 2 and 3 offload_optimizer to the CPU,
with or without offload_param) moves over the host link and streams through host memory per
step, read from deepspeed 0.19.8 (runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py):

- the gradient copies of the backward, by micro-batch and at the accumulation boundary, and
  whether they run on the backward's own stream (exposed) or a side stream (hidden behind it);
- the host passes around the CPU Adam step (unscaling the fp32 gradient, casting the updated
  fp32 partition to the model dtype), each a pass over host memory on the step's critical path.

The CPU Adam step itself is zeroplan.core.timing.cpu_step_time_s; docs/communication-time.md
("Host transfers (offload)") derives the rest. The NVMe strategies swap their gradients and
states otherwise (zeroplan.core.nvme) and keep the older rule of zeroplan.core.timing.
"""

from __future__ import annotations

from zeroplan.core import deepspeed_partial_offload as partial
from zeroplan.core.communication import Phase, overlaps_grad_reduce
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import Precision

_MODELLED = (StrategyKind.zero2_offload, StrategyKind.zero3_offload, StrategyKind.zero3_param_offload)


def models_offload_time(request: PlanRequest) -> bool:
    """Whether the request is DeepSpeed's CPU optimizer offload this module prices (the NVMe
    variants and FSDP's CPU offload are priced in zeroplan.core.timing)."""
    return request.strategy.kind in _MODELLED and not request.training.fsdp_cpu_offload


def _model_bytes(request: PlanRequest) -> int:
    # The model dtype DeepSpeed's bit16 groups and its gradients are in (fp16/bf16, fp32 under fp32):
    # the precision's compute dtype.
    return request.training.precision.compute_bytes


# stage_1_and_2.py / stage3.py master_weights_and_grads_dtype: fp32 unless the low-precision
# master option is on, which a bf16-pure run stands for here.
def _master_bytes(request: PlanRequest) -> int:
    return 2 if request.training.precision is Precision.bf16_pure else 4


# deepspeed 0.19.8 stage_1_and_2.py copy_grads_in_partition (cpu_offload, gradient_accumulation_dtype
# the model dtype, as the engine resolves it under ZeRO: engine.py get_data_types):
#   - with more than one micro-batch a step, async_accumulate_grad_in_cpu_via_gpu every
#     micro-batch: from the second on, the accumulated gradient comes up from its host buffer
#     (accumulated_grads_in_cpu, model dtype) to temp_grad_buffer_for_gpu_offload and is added
#     on the GPU; every micro-batch, the sum goes back down (copy_gradients_to_cpu);
#   - at the boundary, async_inplace_copy_grad_to_fp32_buffer_from_gpu casts the partition's
#     slice to fp32 on the GPU (.to(master_weights_and_grads_dtype)) and copies it down into
#     single_partition_of_fp32_groups[i].grad.
# Per step over E partition elements, A micro-batches, m model bytes, f master bytes:
#   down = f E + (A > 1) A m E,   up = (A > 1) (A - 1) m E.
# (The accumulation copies move whole parameters that touch the partition: at most one
# parameter more per group boundary than E, not counted.)
def stage2_gradient_bytes(elements: int, accum: int, model_bytes: int, master_bytes: int) -> int:
    """Host-link bytes (both directions) of ZeRO-2 offload's gradient copies in one step."""
    if accum == 1:
        return master_bytes * elements
    return master_bytes * elements + accum * model_bytes * elements + (accum - 1) * model_bytes * elements


# deepspeed 0.19.8 stage3.py partition_grads (offload_optimizer: grad_partitions_flat_buffer on
# the host, in gradient_accumulation_dtype = the model dtype): at micro-step 0 the reduced
# partition is copied down (grad_buffer.copy_) and brought back up (grad_buffer.to(device)) for
# the boundary work; at later micro-steps it comes up (.to(device)), is added to, and goes back
# down. Either way one copy each direction per micro-batch; at the boundary
# _offload_grad_partition_at_boundary casts it to fp32 on the GPU and copies it down into
# fp32_partitioned_groups_flat[i].grad:
#   down = A m E + f E,   up = A m E.
def stage3_gradient_bytes(elements: int, accum: int, model_bytes: int, master_bytes: int) -> int:
    """Host-link bytes (both directions) of ZeRO-3 offload's gradient copies in one step."""
    return 2 * accum * model_bytes * elements + master_bytes * elements


# After the CPU step, the updated fp32 partition goes back to the model dtype:
# stage_1_and_2.py step: bit16_partition_buffer.copy_(fp32_partition) on the host, then
# bit16_partitions[partition_id].copy_(that buffer, non_blocking=True) up; stage3.py
# _reassign_or_swap_out_partitioned_parameters: fp16_partitioned_groups_flat.copy_(fp32 flat),
# an up-copy with a cast, which torch runs on the host before the copy (aten/src/ATen/native/
# cuda/Copy.cu copy_kernel_cuda: "Type conversions are performed on the CPU for CPU-GPU
# copies"). Under offload_param the bit16 partition lives on the host: no up-copy at the step;
# it comes up for every gather instead (forward and backward, each micro-batch:
# partition_parameters.py all_gather of a ds_tensor on the CPU).
def parameter_bytes_by_phase(request: PlanRequest, elements: int) -> dict[Phase, int]:
    """Host-link bytes of the parameter partition: up at the step, or per gather under offload_param
    (none in the step phase where the CPU Adam kernel copies them: step_copy_in_cpu_step)."""
    m, accum = _model_bytes(request), request.batch.grad_accum_steps
    if request.strategy.kind.offloads_parameters:
        return {Phase.forward: accum * m * elements, Phase.backward: accum * m * elements, Phase.step: 0}
    return {Phase.forward: 0, Phase.backward: 0, Phase.step: 0 if step_copy_in_cpu_step(request) else m * elements}


# DeepSpeed 0.3.0-0.8.x stage2.py step: with DeepSpeedCPUAdam, optimizer.step(fp16_param_groups=...),
# and csrc/adam/cpu_adam.cpp (v0.3.0 Step, dev_params) casts each tile to half precision in a
# double buffer and launches its copy to the GPU on the current stream while the next tile is
# updated: the up-copy overlaps the kernel and no cast pass runs (0.9.0, #3097, disabled it).
def step_copy_in_cpu_step(request: PlanRequest) -> bool:
    """Whether the parameters' up-copy after the step runs inside the CPU Adam kernel."""
    return request.performance.cpu_adam_copies_parameters and request.strategy.kind is StrategyKind.zero2_offload


def parameter_copy_in_cpu_step_bytes(request: PlanRequest, elements: int) -> int:
    """Host-link bytes the CPU Adam kernel copies up while it runs (0 unless step_copy_in_cpu_step)."""
    return _model_bytes(request) * elements if step_copy_in_cpu_step(request) else 0


# Where the backward's gradient copies run: stage_1_and_2.py reduce_ipg_grads puts
# copy_grads_in_partition on the reduction side stream with overlap_comm, else on the current
# stream ("copy_grad_stream is disabled because of race with reduce"), so without overlap_comm
# the backward waits for them; stage3.py __reduce_and_partition_ipg_grads runs partition_grads
# on reduce_and_partition_stream. Copies that block are charged to the step phase, which
# zeroplan.core.timing.exposed_communication_s adds in full.
def gradient_copies_hidden(request: PlanRequest) -> bool:
    """Whether the backward's gradient copies to the host run beside the backward's compute."""
    return request.strategy.kind.zero_stage == 3 or overlaps_grad_reduce(request)


def deepspeed_offload_transfer_bytes(request: PlanRequest, elements: int) -> dict[Phase, int]:
    """Bytes over the host link per step by the phase they overlap with, for ``elements``
    partition elements of this rank (models_offload_time requests)."""
    m, f, accum = _model_bytes(request), _master_bytes(request), request.batch.grad_accum_steps
    gradient_bytes = (stage2_gradient_bytes if request.strategy.kind.zero_stage == 2 else stage3_gradient_bytes)(
        elements, accum, m, f)
    # ZeRO-Offload++'s GPU sub-groups (zeroplan.core.deepspeed_partial_offload): their gradients
    # still pass through the host buffer, but their fp32 copy and the step's cast stay on the GPU.
    gradient_bytes -= partial.device_fp32_gradient_bytes(request, f)
    moved = parameter_bytes_by_phase(request, elements)
    up_not_made, down_made = partial.device_parameter_step_bytes(request, m, f)
    moved[Phase.step] += down_made - up_not_made
    moved[Phase.backward if gradient_copies_hidden(request) else Phase.step] += gradient_bytes
    return moved


# The host passes of the step besides the CPU Adam kernel, each streaming the partition:
#   - unscale: stage3.py unscale_and_clip_grads always multiplies the fp32 gradient by
#     1/combined_scale (read + write f); stage_1_and_2.py returns early when gradient_clipping
#     is 0 and the loss scale 1, so there only under fp16 (dynamic loss scale) or with clipping
#     (Hugging Face's Trainer: max_grad_norm 1.0 fills DeepSpeed's gradient_clipping "auto";
#     DeepSpeed's own default is 0);
#   - the cast of the updated fp32 partition to the model dtype on the host (read f, write m),
#     stage 2's bit16_partition_buffer.copy_ and stage 3's copy_ with a cast (above);
#   - fp16 at stage 3: the overflow check reads the host gradient buffer twice (stage3.py
#     has_overflow, torch.isinf(grad_partitions_flat_buffer).any() and torch.isnan(...)).
def host_pass_bytes_per_element(request: PlanRequest) -> int:
    """Host-memory bytes per partition element of the step's passes around the CPU Adam kernel."""
    m, f = _model_bytes(request), _master_bytes(request)
    stage3 = request.strategy.kind.zero_stage == 3
    fp16 = request.training.precision is Precision.fp16_mixed
    unscales = stage3 or fp16 or request.training.framework is Framework.hf
    cast = 0 if step_copy_in_cpu_step(request) else f + m
    return (2 * f if unscales else 0) + cast + overflow_read_bytes_per_element(request)


# stage3.py:3013-3018 has_overflow (fp16): torch.isinf / torch.isnan of grad_partitions_flat_buffer, the host
# buffer every parameter's gradient passes through, whatever device its sub-group steps on.
def overflow_read_bytes_per_element(request: PlanRequest) -> int:
    """Host-memory bytes per partition element of the fp16 overflow check at stage 3."""
    stage3 = request.strategy.kind.zero_stage == 3
    return 2 * _model_bytes(request) if stage3 and request.training.precision is Precision.fp16_mixed else 0


# ZeRO-Offload++'s GPU sub-groups (zeroplan.core.deepspeed_partial_offload) step on the GPU, but the
# host still reads their gradients in the overflow check, and under offload_param casts their
# updated fp32 master into the host's model-dtype partition (stage3.py:2857, read f, write m).
def device_sub_group_host_pass_bytes_per_element(request: PlanRequest) -> int:
    """Host-memory bytes per element of a GPU sub-group's step."""
    cast = _master_bytes(request) + _model_bytes(request) if request.strategy.kind.offloads_parameters else 0
    return overflow_read_bytes_per_element(request) + cast
