"""ZeRO-Infinity's NVMe offload (Rajbhandari et al. 2021; DeepSpeed offload_optimizer.device and
offload_param.device "nvme"): zero3-nvme swaps the optimizer's fp32 states to NVMe, zero3-param-nvme
the parameter partitions too (docs/memory-model.md, "ZeRO-Infinity on NVMe"; docs/communication-time.md,
"NVMe offload").

The GPU holds what zero3-offload / zero3-param-offload hold there (the states still reach it through
pinned host memory over PCIe). What changes is host RAM, now the swappers' pinned buffers only, and
the states that move to the drive, read and written once per step.

Formulas only: no torch.
"""

from __future__ import annotations

from zeroplan.core.layout import element_bytes
from zeroplan.core.optimizer_states import elementwise_state_bytes, is_elementwise
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import Optimizer
from zeroplan.units import ceil_div

FP32_BYTES = 4
"""The optimizer swapper's dtype: stage3.py _configure_tensor_swapping passes
dtype=self.master_weights_and_grads_dtype (fp32)."""
OFFLOAD_MASTER_BYTES = FP32_BYTES
"""The fp32 master partition the swapper keeps (fp32_partitioned_groups_flat)."""
OFFLOAD_GRADIENT_BYTES = FP32_BYTES
"""Its fp32 gradient (stage3.py partition_grads: grad_buffer.to(master_weights_and_grads_dtype))."""

# deepspeed 0.19.8 runtime/zero/config.py: sub_group_size: int = Field(pp_int(1e9)).
SUB_GROUP_SIZE = 1_000_000_000
# deepspeed 0.19.8 runtime/zero/offload_config.py DeepSpeedZeroOffloadOptimizerConfig.buffer_count = 4
# ("at least the number of states maintained per parameter by the optimizer ... Adam has 4").
OPTIMIZER_BUFFER_COUNT = 4
# deepspeed 0.19.8 runtime/zero/offload_config.py DeepSpeedZeroOffloadParamConfig: buffer_count = 5,
# buffer_size = 1e8 (elements), max_in_cpu = 1e9 (elements).
PARAM_BUFFER_COUNT = 5
PARAM_BUFFER_ELEMENTS = 100_000_000
PARAM_MAX_IN_CPU = 1_000_000_000
# deepspeed 0.19.8 runtime/swap_tensor/utils.py AIO_ALIGNED_BYTES = 1024, times
# aio intra_op_parallelism (constants.py AIO_INTRA_OP_PARALLELISM_DEFAULT = 1): every swap buffer's
# element count is rounded up to a multiple of 1024 bytes (_io_aligned_numel).
AIO_ALIGNED_BYTES = 1024


def io_aligned_elements(elements: int, element_bytes_: int) -> int:
    """deepspeed swap_tensor _io_aligned_numel: ``elements`` rounded up to AIO_ALIGNED_BYTES."""
    alignment = AIO_ALIGNED_BYTES // element_bytes_
    return ceil_div(elements, alignment) * alignment


# deepspeed 0.19.8 runtime/zero/stage3.py _create_fp16_sub_groups: parameters in registration
# order join a sub-group until its partition elements (param.partition_numel(), ceil(numel / N)
# under ZeRO-3) reach sub_group_size or the last parameter; each sub-group is one flat fp32
# partition the optimizer swaps in and out whole.
def sub_group_partition_elements(request: PlanRequest) -> list[int]:
    """Partition elements of each optimizer sub-group on one rank, in order."""
    shards = request.shard_group_size
    groups, current = [], 0
    for unit in rank_trainable_units(request):
        for tensor in unit.tensors:
            if not tensor.trainable:
                continue
            current += ceil_div(tensor.numel, shards)
            if current >= SUB_GROUP_SIZE:
                groups.append(current)
                current = 0
    if current:
        groups.append(current)
    return groups


def optimizer_state_bytes_per_element(optimizer: Optimizer) -> int:
    """fp32 bytes per element of the states the swapper keeps besides master and gradient
    (8 for Adam: exp_avg, exp_avg_sq); non-element-wise optimizers charged as Adam."""
    return elementwise_state_bytes(optimizer if is_elementwise(optimizer) else Optimizer.adam, FP32_BYTES)


# deepspeed 0.19.8 runtime/swap_tensor/optimizer_utils.py OptimizerSwapper.__init__:
# SwapBufferManager(num_elems=_io_aligned_numel(largest_numel), count=swap_config.buffer_count,
# dtype=fp32), pinned (new_cpu_locked_tensor), largest_numel = max(fp16_partitioned_groups_flat_numel)
# (stage3.py _configure_tensor_swapping): the largest sub-group. The default PartitionedOptimizerSwapper
# swaps one sub-group in at a time into buffer_count of them (swap_in_optimizer_state: its tensors
# + 1 gradient); PipelinedOptimizerSwapper (pipeline_read/write, off by default) draws on the same pool.
def optimizer_swap_buffer_bytes(request: PlanRequest) -> int:
    """Pinned host bytes of the optimizer swapper on one rank (0 unless zero3(-param)-nvme)."""
    if not request.strategy.kind.optimizer_on_nvme:
        return 0
    largest = max(sub_group_partition_elements(request), default=0)
    return OPTIMIZER_BUFFER_COUNT * io_aligned_elements(largest, FP32_BYTES) * FP32_BYTES


# deepspeed 0.19.8 runtime/zero/stage3.py _create_param_groups_fp16_flat_cpu_memory: with
# offload_param nvme the first max_in_cpu partition elements keep a pinned flat buffer on the host
# (get_accelerator().pin_memory(torch.empty(min(P, max_in_cpu), dtype))), and a sub-group that does
# not fit whole in it has none (fp16_partitioned_group_flat = None): its parameters live on NVMe.
def parameters_kept_on_host(request: PlanRequest) -> int:
    """Partition elements of the sub-groups that keep their compute-dtype parameters on the host."""
    kept = 0
    for elements in sub_group_partition_elements(request):
        if kept + elements > PARAM_MAX_IN_CPU:
            break
        kept += elements
    return kept


def parameters_on_nvme(request: PlanRequest) -> int:
    """Partition elements whose compute-dtype parameters live on NVMe (zero3-param-nvme)."""
    if not request.strategy.kind.parameters_on_nvme:
        return 0
    return sum(sub_group_partition_elements(request)) - parameters_kept_on_host(request)


# deepspeed 0.19.8 runtime/swap_tensor/partitioned_param_swapper.py AsyncPartitionedParameterSwapper
# .__init__: buffers = new_cpu_locked_tensor(aligned(buffer_size) x buffer_count, model dtype); plus
# stage3.py: _create_param_groups_fp16_flat_cpu_memory's pinned min(P, max_in_cpu) buffer (only as
# large as the sub-groups that fit it are used, but allocated whole) and, when some sub-group
# lives on NVMe, reserve_partitioned_swap_space(largest sub-group) -> a pinned buffer of that
# sub-group's aligned partitions, for writing the updated parameters back after the step.
def parameter_swap_host_bytes(request: PlanRequest) -> int:
    """Pinned host bytes of the parameter swapper on one rank (0 unless zero3-param-nvme)."""
    if not request.strategy.kind.parameters_on_nvme:
        return 0
    compute = element_bytes(request.training.precision, request.convention).compute_parameter
    pool = PARAM_BUFFER_COUNT * io_aligned_elements(PARAM_BUFFER_ELEMENTS, compute) * compute
    groups = sub_group_partition_elements(request)
    flat_cpu = min(sum(groups), PARAM_MAX_IN_CPU) * compute
    reuse = io_aligned_elements(max(groups, default=0), compute) * compute if parameters_on_nvme(request) else 0
    return pool + flat_cpu + reuse


def host_pinned_bytes(request: PlanRequest) -> int:
    """Host RAM of one rank under the NVMe strategies: the swappers' pinned buffers."""
    return optimizer_swap_buffer_bytes(request) + parameter_swap_host_bytes(request)


# The swap files (optimizer_utils.py OptimizerStateSwapInfo: the fp32 partition, its gradient and
# each optimizer state, one file each per sub-group; partitioned_param_swapper.py: one file per
# parameter partition on NVMe, in the model dtype).
def nvme_bytes(request: PlanRequest) -> int:
    """Bytes one rank keeps on NVMe: fp32 master, gradient and optimizer states of its partition,
    plus the compute-dtype parameters of the sub-groups the host does not keep."""
    kind = request.strategy.kind
    if not kind.optimizer_on_nvme:
        return 0
    elements = sum(sub_group_partition_elements(request))
    per_element = OFFLOAD_MASTER_BYTES + OFFLOAD_GRADIENT_BYTES + optimizer_state_bytes_per_element(request.training.optimizer)
    compute = element_bytes(request.training.precision, request.convention).compute_parameter
    return elements * per_element + parameters_on_nvme(request) * compute


class NvmeTraffic:
    """Bytes one rank reads from and writes to NVMe in one step, by phase."""

    def __init__(self, forward_read: int, backward_read: int, backward_write: int, step_read: int, step_write: int):
        self.forward_read = forward_read
        self.backward_read = backward_read
        self.backward_write = backward_write
        self.step_read = step_read
        self.step_write = step_write


# Per step (accumulation a):
#  - backward: the fp32 gradient partition written once, at the accumulation boundary
#    (stage3.py _swap_out_offload_fp32_gradients -> optimizer_swapper.swap_out_gradients);
#  - step: each sub-group's fp32 master, gradient and states read
#    (partitioned_optimizer_swapper.py swap_in_optimizer_state: num_tensors + 1 gradient), the
#    master and states written back (swap_out_optimizer_state);
#  - zero3-param-nvme: every NVMe parameter partition read before each forward and each backward
#    gather (partitioned_param_coordinator.py __prefetch_nvme_param_partitions, swap_in async), and
#    the updated compute-dtype parameters written after the step (stage3.py
#    _reassign_or_swap_out_partitioned_parameters -> swap_out_partitioned_params).
def nvme_traffic(request: PlanRequest) -> NvmeTraffic:
    """The step's NVMe reads and writes on one rank (zeros for every other strategy)."""
    kind = request.strategy.kind
    if not kind.optimizer_on_nvme:
        return NvmeTraffic(0, 0, 0, 0, 0)
    elements = sum(sub_group_partition_elements(request))
    states = optimizer_state_bytes_per_element(request.training.optimizer)
    compute = element_bytes(request.training.precision, request.convention).compute_parameter
    accum = request.batch.grad_accum_steps
    params = parameters_on_nvme(request) * compute
    return NvmeTraffic(
        forward_read=accum * params,
        backward_read=accum * params,
        backward_write=elements * OFFLOAD_GRADIENT_BYTES,
        step_read=elements * (OFFLOAD_MASTER_BYTES + OFFLOAD_GRADIENT_BYTES + states),
        step_write=elements * (OFFLOAD_MASTER_BYTES + states) + params,
    )
