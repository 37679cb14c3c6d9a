"""ZeRO-Offload++'s Twin-Flow (DeepSpeed zero_optimization.offload_optimizer.ratio below 1.0,
StrategySpec.offload_optimizer_ratio): under ZeRO-3's optimizer offload to the CPU, the first
sub-groups of a rank's partition stay on the GPU, stepped there by a torch AdamW, and only the
rest go to the host for DeepSpeedCPUAdam. Read from deepspeed 0.19.8 runtime/zero/stage3.py:

- :1100-1108 ``subgroup_to_device``: of n sub-groups (zeroplan.core.nvme.sub_group_partition_elements),
  sub-group i goes to the CPU iff i >= int((1 - ratio) * n). With one sub-group (sub_group_size's
  default 1e9 holds most partitions) int((1 - ratio) * 1) = 0: everything is offloaded;
- :1156-1159 the fp32 master partition of each sub-group is made on its device; :1338-1342 its fp32
  gradient, once, before the first step, kept across steps (the offload never frees it: :2735);
  the optimizer's states are made beside the master by the optimizer that steps it;
- :1249-1258 ``_optimizer_step``: the host sub-groups' step is the CPU Adam's, the others' the
  backup optimizer's, torch.optim.AdamW (:313-325), in sub-group order;
- :1443-1457 ``_offload_grad_partition_at_boundary``: every parameter's reduced gradient still
  goes through the host buffer (grad_partitions_flat_buffer on the offload device, :791), but a
  GPU sub-group's fp32 copy is made on the GPU;
- :2854-2858 ``_reassign_or_swap_out_partitioned_parameters``: the updated fp32 partition is cast
  into the sub-group's model-dtype partition, on the GPU, or (offload_param) on the host.

Formulas only: no torch.
"""

from __future__ import annotations

from zeroplan.core.nvme import sub_group_partition_elements
from zeroplan.core.optimizer_states import elementwise_state_bytes
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import PARTIAL_OFFLOAD_KINDS
from zeroplan.specs.training import Optimizer
from zeroplan.units import FP32_BYTES


# stage3.py:1104-1108: `if i >= int((1 - self.partial_offload) * sub_group_size)` -> 'cpu', where
# sub_group_size is the number of sub-groups (len(self.fp16_partitioned_groups_flat), :1102).
def first_host_sub_group(sub_groups: int, ratio: float) -> int:
    """The index of the first sub-group DeepSpeed puts on the host: the ones before stay on the GPU."""
    return int((1 - ratio) * sub_groups)


# The ratio is read only under PARTIAL_OFFLOAD_KINDS (StrategySpec refuses it elsewhere; a spec
# copied to another kind, as fit and the plan search copy the base request's knobs, keeps it
# unread there).
def device_sub_group_elements(request: PlanRequest) -> list[int]:
    """Partition elements of each sub-group kept on the GPU, in order (none without a ratio)."""
    ratio = request.strategy.offload_optimizer_ratio
    if ratio is None or request.strategy.kind not in PARTIAL_OFFLOAD_KINDS:
        return []
    groups = sub_group_partition_elements(request)
    return groups[:first_host_sub_group(len(groups), ratio)]


def device_partition_elements(request: PlanRequest) -> int:
    """Partition elements whose fp32 master, gradient and states stay on the GPU."""
    return sum(device_sub_group_elements(request))


# stage3.py:1156-1159 converted = fp16 flat .to(subgroup_to_device[i], dtype=master_weights_and_grads_dtype)
# and its clone (the master); :1342 grad = the zeroed buffer .to(subgroup_to_device[i]) (the fp32
# gradient); :313-325 the GPU sub-groups' optimizer is always torch.optim.AdamW (backup_optimizer,
# whatever the run's own: it must be DeepSpeedCPUAdam, :316); torch 2.13 torch/optim/adamw.py
# (adam.py _init_group): exp_avg and exp_avg_sq zeros_like(param), fp32 beside the fp32 master;
# its step counter a host scalar (capturable and fused are off), nothing on the GPU.
def device_state_bytes_per_element(request: PlanRequest) -> int:
    """GPU bytes per element of a GPU sub-group: fp32 master, fp32 gradient, the AdamW's states
    (the backup AdamW's, not the run's optimizer: without a ratio, where an optimizer DeepSpeed
    cannot pair with a GPU AdamW is planned, no element is on the GPU)."""
    return FP32_BYTES + FP32_BYTES + elementwise_state_bytes(Optimizer.adamw, FP32_BYTES)


def device_state_bytes(request: PlanRequest) -> int:
    """The GPU sub-groups' fp32 master, gradient and optimizer states on one rank, kept from the
    engine's start on."""
    return device_partition_elements(request) * device_state_bytes_per_element(request)


# torch 2.13 torch/optim/adam.py:790 (_multi_tensor_adam, the foreach step torch picks for CUDA
# tensors, optimizer.py _default_to_fused_or_foreach): exp_avg_sq_sqrt = torch._foreach_sqrt(...),
# one fp32 temporary the size of what it steps; stage3.py:1256-1258 hands the backup AdamW one
# sub-group's master at a time.
def device_step_temporary_bytes(request: PlanRequest) -> int:
    """The GPU AdamW's temporary: the largest GPU sub-group's square-root copy."""
    return max(device_sub_group_elements(request), default=0) * FP32_BYTES


# stage3.py:1456-1457: fp32_grad_tensor.copy_(grad_buffer.to(fp32)) with both on the GPU for a GPU
# sub-group: the f E down-copy of zeroplan.core.deepspeed_offload_time.stage3_gradient_bytes is not made.
def device_fp32_gradient_bytes(request: PlanRequest, master_bytes: int) -> int:
    """Host-link bytes of the boundary's fp32 gradient copy that the GPU sub-groups do not make."""
    return device_partition_elements(request) * master_bytes


# stage3.py:2857-2858 fp16_partitioned_groups_flat[i].data.copy_(fp32_partitioned_groups_flat[i].data):
# without offload_param both on the GPU (no up-copy); under offload_param the model-dtype partition
# lives on the host, so the fp32 master goes down and torch casts it there (aten/src/ATen/native/
# cuda/Copy.cu copy_kernel_cuda: "Type conversions are performed on the CPU for CPU-GPU copies").
def device_parameter_step_bytes(request: PlanRequest, model_bytes: int, master_bytes: int) -> tuple[int, int]:
    """(the up-copy bytes the GPU sub-groups do not make, the down-copy bytes they make) at the step."""
    elements = device_partition_elements(request)
    if request.strategy.kind.offloads_parameters:
        return 0, elements * master_bytes
    return elements * model_bytes, 0


# stage3.py:2979-2988 unscale_and_clip_grads: fp32 gradient .mul_(1 / combined_scale) (read and write f);
# :1256-1258 the AdamW step (zeroplan.core.roofline.optimizer's unfused Adam accesses); :2857 the cast of
# the master into the model-dtype partition (read f, write m) on the GPU unless offload_param puts
# that partition on the host.
def device_step_extra_bytes_per_element(request: PlanRequest, model_bytes: int, master_bytes: int) -> int:
    """GPU-memory bytes per element of a GPU sub-group's step besides the AdamW's own passes."""
    cast = 0 if request.strategy.kind.offloads_parameters else master_bytes + model_bytes
    return 2 * master_bytes + cast
