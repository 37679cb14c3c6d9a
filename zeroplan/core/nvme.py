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
from zeroplan.core.parallel.units import rank_parameter_units, rank_trainable_units
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import Optimizer
from zeroplan.units import FP32_BYTES, ceil_div

# The optimizer swapper's dtype is fp32: stage3.py _configure_tensor_swapping passes
# dtype=self.master_weights_and_grads_dtype.
OFFLOAD_MASTER_BYTES = FP32_BYTES
"""The fp32 master partition the swapper keeps (fp32_partitioned_groups_flat)."""
OFFLOAD_GRADIENT_BYTES = FP32_BYTES
"""Its fp32 gradient (stage3.py partition_grads: grad_buffer.to(master_weights_and_grads_dtype))."""

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
# partition the optimizer steps (and the NVMe swapper swaps in and out) whole.
def sub_group_tensor_elements(request: PlanRequest) -> list[list[int]]:
    """Each optimizer sub-group on one rank, in order, as its tensors' partition elements."""
    shards = request.shard_group_size
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for unit in rank_trainable_units(request):
        for tensor in unit.tensors:
            if not tensor.trainable:
                continue
            current.append(ceil_div(tensor.numel, shards))
            filled += current[-1]
            if filled >= request.strategy.deepspeed_sub_group_elements:
                groups.append(current)
                current, filled = [], 0
    if current:
        groups.append(current)
    return groups


def sub_group_partition_elements(request: PlanRequest) -> list[int]:
    """Partition elements of each optimizer sub-group on one rank, in order."""
    return [sum(group) for group in sub_group_tensor_elements(request)]


def optimizer_state_bytes_per_element(optimizer: Optimizer) -> int:
    """fp32 bytes per element of the states the swapper keeps besides master and gradient
    (8 for Adam: exp_avg, exp_avg_sq); non-element-wise optimizers charged as Adam."""
    return elementwise_state_bytes(optimizer if is_elementwise(optimizer) else Optimizer.adam, FP32_BYTES)


# deepspeed 0.19.8 runtime/swap_tensor/optimizer_utils.py OptimizerStateSwapInfo: a sub-group swaps
# its fp32 partition and each optimizer state large enough for aio (_get_state_tensors,
# is_swappable_tensor: Adam's exp_avg and exp_avg_sq, not its scalar step), and
# swap_in_optimizer_state takes one buffer more for the gradient (num_tensors() + 1).
def swap_buffers_per_sub_group(optimizer: Optimizer) -> int:
    """Pinned buffers one sub-group holds while it steps (4 for Adam: master, two states, gradient)."""
    return 1 + optimizer_state_bytes_per_element(optimizer) // FP32_BYTES + 1


# deepspeed 0.19.8 runtime/zero/stage3.py _configure_tensor_swapping: offload_optimizer
# pipeline_read or pipeline_write picks PipelinedOptimizerSwapper
# (runtime/swap_tensor/pipelined_optimizer_swapper.py). Its step loop holds, besides the sub-group
# stepping (SYNC_SWAP_IN), the next one's read (ASYNC_SWAP_IN, started by swap_in_optimizer_state
# with async_parameter = stage3.py next_swappable_fp32_partitioned_groups[i]) under pipeline_read and
# the previous one's write (ASYNC_SWAP_OUT, completed only at the next swap_out_optimizer_state)
# under pipeline_write, each with a full sub-group's buffers from the same SwapBufferManager pool;
# a pool too small fails ("ran out of swap buffers, try increasing 'buffer_count'"). With one
# sub-group there is no next one and nothing runs ahead.
def sub_groups_in_flight(request: PlanRequest) -> int:
    """Sub-groups whose swap buffers are held at once in the optimizer step (1 unpipelined)."""
    if len(sub_group_partition_elements(request)) < 2:
        return 1
    strategy = request.strategy
    return 1 + int(strategy.nvme_pipeline_read) + int(strategy.nvme_pipeline_write)


def optimizer_swap_buffer_count(request: PlanRequest) -> int:
    """offload_optimizer.buffer_count as planned: DeepSpeed's default 4, or as many buffers as the
    pipelined swapper holds at once when that is more (what --emit writes)."""
    return max(OPTIMIZER_BUFFER_COUNT,
               swap_buffers_per_sub_group(request.training.optimizer) * sub_groups_in_flight(request))


# deepspeed 0.19.8 runtime/swap_tensor/optimizer_utils.py OptimizerSwapper.__init__:
# SwapBufferManager(num_elems=_io_aligned_numel(largest_numel), count=swap_config.buffer_count,
# dtype=fp32), pinned (new_cpu_locked_tensor), largest_numel = max(fp16_partitioned_groups_flat_numel)
# (stage3.py _configure_tensor_swapping): the largest sub-group. The default PartitionedOptimizerSwapper
# swaps one sub-group in at a time into buffer_count of them (swap_in_optimizer_state: its tensors
# + 1 gradient); PipelinedOptimizerSwapper draws on the same pool, buffer_count as planned
# (optimizer_swap_buffer_count).
def optimizer_swap_buffer_bytes(request: PlanRequest) -> int:
    """Pinned host bytes of the optimizer swapper on one rank (0 unless zero3(-param)-nvme)."""
    if not request.strategy.kind.optimizer_on_nvme:
        return 0
    largest = max(sub_group_partition_elements(request), default=0)
    return optimizer_swap_buffer_count(request) * io_aligned_elements(largest, FP32_BYTES) * FP32_BYTES


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


# deepspeed 0.19.8 runtime/zero/partition_parameters.py _partition_param: each parameter partition
# bound for NVMe takes one of the parameter swapper's buffers (param_swapper.get_buffer, which
# asserts numel <= buffer_size: "More elements ... than buffer size"), so offload_param.buffer_size
# must hold the largest partition (ceil(numel / N), _aligned_size // world): the plan takes
# DeepSpeed's 1e8 or that partition if larger (what --emit writes; a 70B model's 262M-element
# embedding on one GPU needs it).
def parameter_buffer_elements(request: PlanRequest) -> int:
    """offload_param.buffer_size as planned, in elements."""
    shards = request.shard_group_size
    largest = max((ceil_div(t.numel, shards) for unit in rank_parameter_units(request) for t in unit.tensors), default=0)
    return max(PARAM_BUFFER_ELEMENTS, largest)


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
    pool = PARAM_BUFFER_COUNT * io_aligned_elements(parameter_buffer_elements(request), compute) * compute
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


# Each sub-group's share of the step traffic (nvme_traffic's step_read and step_write, split as
# DeepSpeed moves them: swap_in_optimizer_state reads a sub-group's master, gradient and states,
# swap_out_optimizer_state writes its master and states; under zero3-param-nvme a sub-group that
# is not kept on the host also writes its compute-dtype parameters back, stage3.py
# _reassign_or_swap_out_partitioned_parameters, before its release).
def sub_group_step_bytes(request: PlanRequest) -> list[tuple[int, int, int]]:
    """(partition elements, bytes read, bytes written) of each sub-group in the optimizer step."""
    states = optimizer_state_bytes_per_element(request.training.optimizer)
    compute = element_bytes(request.training.precision, request.convention).compute_parameter
    on_host = parameters_kept_on_host(request) if request.strategy.kind.parameters_on_nvme else None
    result, seen = [], 0
    for elements in sub_group_partition_elements(request):
        params = elements * compute if on_host is not None and seen >= on_host else 0
        seen += elements
        result.append((elements, elements * (OFFLOAD_MASTER_BYTES + OFFLOAD_GRADIENT_BYTES + states),
                       elements * (OFFLOAD_MASTER_BYTES + states) + params))
    return result


# The optimizer step over the sub-groups, in the order of stage3.py step(): _prepare_sub_group
# (swap_in_optimizer_state: wait for this sub-group's read; under pipeline_read start the next
# one's), the CPU step, _release_sub_group (swap_out_optimizer_state: under pipeline_write first
# wait for the previous write, then start this one's without waiting, except for the last
# sub-group, which has no next swappable group, async_swap False; otherwise write and wait).
# Reads and writes go through separate aio handles (read_aio_handle, write_aio_handle), taken
# here at the drive's read and write bandwidths at once (a drive that shares one budget between
# them overlaps less). ``read_s``, ``cpu_s``, ``write_s`` are per sub-group, in order.
def pipelined_step_s(read_s: list[float], cpu_s: list[float], write_s: list[float],
                     pipeline_read: bool, pipeline_write: bool) -> float:
    """Seconds from the first read to the last write of the optimizer step's sub-groups."""
    count = len(read_s)
    now = 0.0  # when the loop reaches the next _prepare_sub_group
    read_done = read_s[0] if count else 0.0  # the first read is always synchronous
    write_done = 0.0
    for i in range(count):
        has_next = i + 1 < count
        start = max(now, read_done)  # this sub-group's read has landed
        begin = max(start + cpu_s[i], write_done)  # a pending async write completes first
        write_done = begin + write_s[i]
        now = begin if pipeline_write and has_next else write_done
        if has_next:  # the next read: started at this one's start, or at the next prepare
            read_done = (start if pipeline_read else now) + read_s[i + 1]
    return max(now, write_done)
