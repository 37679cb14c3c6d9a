"""Step time: compute from FLOPs, communication from an alpha-beta model, host transfers for
offload, and how much communication the compute hides. docs/communication-time.md derives it."""

import functools
from typing import NamedTuple

from pydantic import ConfigDict

from zeroplan.errors import ZeroplanError

from zeroplan.core.algorithms import CollectiveTime, collective_cost
from zeroplan.core.collective import CollectiveOp
from zeroplan.core.communication import Collective, Phase
from zeroplan.core.compiled_time import compile_saved_seconds
from zeroplan.core.float8_time import float8_cast_seconds, float8_gemm_saved_seconds
from zeroplan.core.flops import StepFlops, step_flops
from zeroplan.core.deepspeed_offload_time import (
    deepspeed_offload_transfer_bytes, device_sub_group_host_pass_bytes_per_element, host_pass_bytes_per_element,
    models_offload_time, parameter_copy_in_cpu_step_bytes,
)
from zeroplan.core.layout import element_bytes
from zeroplan.core.memo import batch_keyed
from zeroplan.core.model_states import held_elements, shard_layout
from zeroplan.core.nvme import nvme_traffic
from zeroplan.core.optimizer_states import elementwise_state_bytes, is_elementwise
from zeroplan.core.deepspeed_checkpointing import exposed_host_copy_bytes
from zeroplan.core.deepspeed_partial_offload import device_partition_elements
from zeroplan.core.parallel.activations import rank_checkpointed_input_bytes
from zeroplan.core.parallel.units import rank_block_count, rank_trainable_units
from zeroplan.core.roofline.ceilings import times_memory_bound
from zeroplan.core.roofline.optimizer import TORCH_ADAM_ACCESSES_PER_ELEMENT
from zeroplan.specs.base import Frozen
from zeroplan.specs.hardware import GpuSpec, HostSpec
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.request import PerformanceAssumptions, PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import AttentionKernel, Optimizer, TrainingSpec
from zeroplan.units import FP32_BYTES


class StepTime(Frozen):
    """Seconds of one optimizer step on one GPU."""

    # The planner builds it unvalidated (Frozen.trusted), so its validator is built on first use
    # (a caller's validation, a JSON dump), not at each command's start.
    model_config = ConfigDict(defer_build=True)

    forward_compute_s: float
    """Forward passes of all micro-batches (recomputation excluded)."""
    backward_compute_s: float
    """Backward passes, recomputed forwards included."""
    communication_s: float
    """All collectives, run back to back."""
    host_transfer_s: float
    """Offload copies over the host link (PCIe), at this GPU's share of it."""
    nvme_transfer_s: float = 0.0
    """zero3-nvme / zero3-param-nvme: reads and writes of the NVMe swap files, at this GPU's
    share of the node's drive (zeroplan.core.nvme.nvme_traffic); 0 for every other strategy."""
    cpu_optimizer_s: float = 0.0
    """Offload's optimizer step on the host CPU for this GPU's partition (0 without offload);
    under DeepSpeed's CPU offload with its unscale and cast passes over host memory
    (zeroplan.core.deepspeed_offload_time)."""
    optimizer_step_s: float = 0.0
    """The optimizer step on the GPU, after the backward: a memory-bound pass at the GPU's copy
    bandwidth (zeroplan.core.roofline.optimizer) under either compute model (0 on a GPU without a
    measured bandwidth, whose flat HFU covers it), plus Muon's Newton-Schulz products
    (zeroplan.core.muon_time)."""
    memory_bound_s: float = 0.0
    """Of forward + backward compute under the flat-HFU model: the memory-bound kernels' single
    pass over their tensors at the GPU's copy bandwidth (memory_bound_time_s); 0 under the
    roofline (its terms are in compute) and on a GPU without a measured bandwidth."""
    compile_saved_s: float = 0.0
    """Of forward + backward compute under the flat-HFU model: what torch.compile's fusion saves
    (zeroplan.core.compiled_time.compile_saved_seconds), already taken off."""
    hardware_flops_utilization: float | None = None
    """The HFU the matrix products ran at (the given, calibrated or fitted default one); None
    under the roofline compute model."""
    exposed_communication_s: float
    """Communication and host transfers the compute does not hide."""
    step_without_overlap_s: float
    """Compute + communication + host transfers + optimizer steps (GPU and CPU), one after another."""
    step_with_overlap_s: float
    """Compute + exposed communication + optimizer steps (GPU and CPU)."""
    model_parallel_communication_s: float = 0.0
    """Tensor- and context-parallel collectives and pipeline sends: on the critical path, never
    hidden (Collective.blocking); included in communication_s."""
    pipeline_bubble_s: float = 0.0
    """Idle time of the pipeline schedule (zeroplan.core.parallel.pipeline.bubble_fraction of
    the busy time); 0 without pipeline parallelism."""
    collective_times: tuple[CollectiveTime, ...] = ()
    """Per collective of the step: its seconds and the NCCL algorithm it runs on."""
    executed_flops: float
    """FLOPs the GPU executes in the step (forward, backward, recomputation; zeroplan.core.flops)."""
    model_flops: float
    """FLOPs the step counts under PaLM's MFU convention (6N + 12 L a d s per token)."""
    tokens_per_s_per_gpu: float
    """Tokens of the step (micro-batch x accumulation x sequence) over step_with_overlap_s."""
    model_flops_utilization: float
    """model_flops / (step_with_overlap_s x peak bf16 FLOP/s): MFU, a fraction, communication
    and host time included."""

    @property
    def pcie_s(self) -> float:
        """The host transfers, under the name the offload literature uses (PCIe)."""
        return self.host_transfer_s

    @property
    def compute_s(self) -> float:
        return self.forward_compute_s + self.backward_compute_s


# Alpha-beta model (Hockney 1994; Thakur, Rabenseifner & Gropp 2005, sec. 4) per call, on the
# algorithm NCCL's tuning model picks for the call's size (zeroplan/core/algorithms.py): a ring
# takes N-1 steps (2(N-1) for all-reduce), each paying the latency alpha, plus the bytes a rank
# sends over the ring's bus bandwidth (NCCL's rings over the node's NICs: network.py).
def collective_time_s(request: PlanRequest, collective: Collective) -> float:
    """Seconds for one step's worth of ``collective``."""
    return collective_cost(request, collective).seconds


# ZeRO-Offload (Ren et al. 2021, sec. 4.2): each micro-batch's backward moves the gradient
# partition to the host, and after the CPU step the updated half-precision parameters come
# back; with parameter offload (ZeRO-Infinity) the shard also comes up for every gather. That
# rule stays for the NVMe strategies; DeepSpeed's CPU offload moves what its source copies
# (zeroplan.core.deepspeed_offload_time), FSDP2's CPU offload what fsdp_offload_transfer_bytes says.
def host_transfer_bytes(request: PlanRequest) -> dict[Phase, int]:
    """Bytes over the host link per step, by the phase they overlap with."""
    kind = request.strategy.kind
    moved = {phase: 0 for phase in Phase}
    if request.training.fsdp_cpu_offload:
        return fsdp_offload_transfer_bytes(request)
    if not kind.offloads_optimizer:
        return moved
    if models_offload_time(request):
        return deepspeed_offload_transfer_bytes(request, offloaded_optimizer_elements(request))
    eb = element_bytes(request.training.precision, request.convention)
    shard = offloaded_optimizer_elements(request)
    shard_bytes = eb.compute_parameter * shard
    accum = request.batch.grad_accum_steps
    moved[Phase.backward] = accum * shard_bytes
    moved[Phase.step] = shard_bytes
    if kind.offloads_parameters:
        moved[Phase.forward] += accum * shard_bytes
        moved[Phase.backward] += accum * shard_bytes
    return moved


# FSDP2's CPUOffloadPolicy (torch 2.13 _fully_shard/_fsdp_param.py all_gather_inputs): every
# all-gather copies the unit's sharded parameters from pinned host memory to the GPU in their
# stored dtype, once in forward and, resharded after it, again in backward; foreach_reduce
# (_fsdp_collectives.py) copies each new sharded gradient back to the host, every micro-batch
# (accumulating on the host). The optimizer then steps on the host: nothing moves after it.
def fsdp_offload_transfer_bytes(request: PlanRequest) -> dict[Phase, int]:
    """Host-link bytes per step of FSDP2 with CPUOffloadPolicy, by phase."""
    eb = element_bytes(request.training.precision, request.convention)
    shard = offloaded_optimizer_elements(request)
    accum = request.batch.grad_accum_steps
    gathers_in_backward = 0 if request.strategy.kind is StrategyKind.fsdp_shard_grad_op else 1
    return {
        Phase.forward: accum * shard * eb.parameter,
        Phase.backward: accum * shard * (gathers_in_backward * eb.parameter + eb.gradient),
        Phase.step: 0,
    }


# torch 2.13 torch/optim/adam.py: on CPU tensors AdamW takes _single_tensor_adam
# (optimizer.py _default_to_fused_or_foreach: the CPU has no foreach or fused kernels), the same
# unfused ops as on a GPU, each a pass over memory (zeroplan.core.roofline.optimizer counts them).
TORCH_CPU_ADAM_ACCESSES_PER_ELEMENT = TORCH_ADAM_ACCESSES_PER_ELEMENT


# DeepSpeed csrc/adam/cpu_adam_impl.cpp (Adam_Optimizer::Step_1, fp32 params and states): each
# element reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq back;
# 4 B each. Other element-wise optimizers read/write their own state count the same way;
# non-element-wise ones (Adafactor, 8-bit Adam) are charged as Adam (an upper bound).
def cpu_optimizer_bytes_per_element(optimizer: Optimizer) -> int:
    """Host-memory bytes read + written per parameter by one CPU optimizer step (28 for Adam)."""
    state = elementwise_state_bytes(optimizer if is_elementwise(optimizer) else Optimizer.adam, FP32_BYTES)
    read = FP32_BYTES + FP32_BYTES + state  # master param, fp32 gradient, states
    written = FP32_BYTES + state  # master param, states
    return read + written


def offloaded_optimizer_elements(request: PlanRequest) -> int:
    """Parameters whose optimizer step this GPU's rank runs on the host (its partition)."""
    return held_elements(rank_trainable_units(request), request.shard_group_size, shard_layout(request))


# ZeRO-Offload (Ren et al. 2021, sec. 5.1): the CPU step is a streaming, vectorised loop run by
# every rank of a node at once, so each rank gets 1/G of the node's memory bandwidth and cores
# (DeepSpeed's --bind_cores_to_rank splits cores that way). Time is the slower bound:
#   t_cpu = max(E * bytes_per_element / (BW_host / G), E / ((cores / G) * rate_per_core)).
def cpu_step_time_s(elements: int, bytes_per_element: int, host: HostSpec, ranks_sharing_host: int) -> float:
    """Seconds for ``elements`` parameters of a CPU optimizer step on one of ``ranks_sharing_host``
    ranks that step at once on ``host``."""
    memory_bound = host_memory_bound_s(elements * bytes_per_element, host, ranks_sharing_host)
    compute_bound = elements / (host.cores_per_node / ranks_sharing_host * host.optimizer_elements_per_core_s)
    return max(memory_bound, compute_bound)


def host_memory_bound_s(traffic_bytes: int, host: HostSpec, ranks_sharing_host: int) -> float:
    """Seconds to stream ``traffic_bytes`` through host memory on 1/G of the node's bandwidth."""
    return traffic_bytes / (host.memory_bandwidth_bytes_per_s / ranks_sharing_host)


def cpu_optimizer_time_s(request: PlanRequest) -> float:
    """Seconds of the host optimizer step for this GPU's partition (0 without optimizer offload)."""
    if request.training.fsdp_cpu_offload:
        # torch's AdamW on the host shards (non-element-wise optimizers charged as Adam). Each of
        # its per-op kernels streams memory at a FLOP or two per element, so the node's memory
        # bandwidth, shared by its ranks stepping at once, bounds it; DeepSpeed's per-core rate
        # (HostSpec.optimizer_elements_per_core_s) is its fused kernel's and does not apply.
        eb = element_bytes(request.training.precision, request.convention)
        traffic = offloaded_optimizer_elements(request) * TORCH_CPU_ADAM_ACCESSES_PER_ELEMENT * eb.parameter
        return host_memory_bound_s(traffic, request.cluster.host, request.cluster.gpus_per_node)
    if not request.strategy.kind.offloads_optimizer:
        return 0.0
    # ZeRO-Offload++'s ratio keeps some sub-groups' step on the GPU (gpu_optimizer_time_s):
    # the CPU Adam runs over the others (zeroplan.core.deepspeed_partial_offload).
    on_device = device_partition_elements(request)
    elements = offloaded_optimizer_elements(request) - on_device
    adam_s = cpu_step_time_s(
        elements,
        cpu_optimizer_bytes_per_element(request.training.optimizer),
        request.cluster.host,
        request.cluster.gpus_per_node,
    )
    if not models_offload_time(request):
        return adam_s
    # Before 0.9.0 the kernel itself copied the half-precision tiles up as it went, the copy
    # overlapping the update (zeroplan.core.deepspeed_offload_time.step_copy_in_cpu_step): the
    # slower of the two. DeepSpeed's unscale and cast passes run before and after the kernel, one
    # after another (host_pass_bytes_per_element).
    in_kernel_copy_s = parameter_copy_in_cpu_step_bytes(request, elements) / host_link_share_bytes_per_s(request)
    adam_s = max(adam_s, in_kernel_copy_s)
    pass_bytes = elements * host_pass_bytes_per_element(request)
    pass_bytes += on_device * device_sub_group_host_pass_bytes_per_element(request)
    passes = host_memory_bound_s(pass_bytes, request.cluster.host, request.cluster.gpus_per_node)
    return adam_s + passes


def checkpoint_copy_seconds(request: PlanRequest) -> float:
    """DeepSpeed's blocking checkpoint copies over this GPU's share of the host link, per step."""
    if not request.training.cpu_checkpointing:
        return 0.0
    block_input = rank_checkpointed_input_bytes(request)
    return exposed_host_copy_bytes(request, block_input, rank_block_count(request)) / host_link_share_bytes_per_s(request)


# GPUs behind one PCIe switch copy at the same time (every rank offloads in the same phase), so
# each gets 1/gpus_per_host_link of the switch's uplink (documented assumption).
def host_link_share_bytes_per_s(request: PlanRequest) -> float:
    """Host-link bandwidth one GPU gets while its neighbours copy too."""
    return request.cluster.gpu.host_link.bandwidth_bytes_per_s / request.cluster.host.gpus_per_host_link


def executed_flops_per_s(request: PlanRequest) -> float:
    """Peak bf16 FLOP/s times the hardware FLOPs utilisation (the one given, else the fitted
    default of the request's mechanism, zeroplan.core.default_efficiency): the rate executed
    FLOPs run at."""
    from zeroplan.core.default_efficiency import effective_hfu

    return request.cluster.gpu.peak_bf16_flops_per_s * effective_hfu(request)


def attention_relative_rate(request: PlanRequest) -> float:
    """r: the rate attention's FLOPs run at over the matrix products' (zeroplan.core.attention_rate),
    1 under --attention-rate matmul."""
    if request.performance.attention_rate != "published":
        return 1.0
    from zeroplan.core.attention_rate import rate_architecture, relative_attention_rate

    training = request.training
    return relative_attention_rate(rate_architecture(request.cluster.gpu), training.attention_kernel,
                                   training.attention_implementation, request.batch.seq_len,
                                   request.model.head_size, request.model.v_head_size)


def attention_flops_per_s(request: PlanRequest, matmul_rate: float) -> float:
    """The rate attention's FLOPs run at: r x the matmul rate ('published'), the kernel's own
    published rate whatever the HFU, times its achieved-over-published efficiency
    (zeroplan.core.attention_efficiency; 'kernel'), or the matmul rate ('matmul', or a GPU
    generation and kernel the table has no row for)."""
    mode = request.performance.attention_rate
    if mode == "kernel":
        rate = _kernel_attention_flops_per_s(request.model, request.cluster.gpu, request.training, request.performance,
                                             request.batch.seq_len)
        return matmul_rate if rate is None else rate
    return matmul_rate * attention_relative_rate(request)


# The kernel's rate reads the model's head widths, the GPU generation, the kernel, the given
# efficiency and the sequence alone: kept by them (every plan's step time asks, fit's strategies
# and a sweep's micro-batches at the same few sequences).
@functools.lru_cache(maxsize=256)
def _kernel_attention_flops_per_s(model: ModelSpec, gpu: GpuSpec, training: TrainingSpec,
                                  performance: PerformanceAssumptions, seq_len: int) -> float | None:
    """attention_flops_per_s under 'kernel'; None where the table has no row for the GPU
    generation and kernel (the matmul rate then)."""
    from zeroplan.core.attention_rate import attention_rate_row, kernel_name, rate_architecture

    name = kernel_name(training.attention_kernel, training.attention_implementation)
    row = attention_rate_row(rate_architecture(gpu), name)
    if row is None:
        return None
    from zeroplan.core.attention_efficiency import kernel_attention_efficiency

    return (row.relative_at(seq_len, model.head_size, model.v_head_size)
            * row.matmul_tflops * 1e12 * kernel_attention_efficiency(performance, name))


COMPUTE_BASIS = "matmul-attention"
"""What an HFU covers (efficiency files record it): the matrix products' and attention's
executed FLOPs, the memory-bound kernels timed apart at the copy bandwidth (memory_bound_time_s).
Files of the basis before it ('all-kernels': the HFU covered every kernel, the optimizer step
included) are refused (zeroplan.calibrate.step.load_efficiency)."""


# docs/communication-time.md, "Compute": the memory-bound kernels (norms, rotary embedding,
# activation, residual adds, gradient sums, embedding and loss passes, FSDP's copies, autocast's
# casts; zeroplan.core.roofline.step.memory_bound_step) move their bytes at the GPU's copy
# bandwidth, whatever the HFU; a compiled block moves the compiled block's bytes
# (zeroplan.core.compiled_time). The optimizer step is timed apart (gpu_optimizer_time_s).
def memory_bound_time_s(request: PlanRequest) -> tuple[float, float]:
    """(forward, backward with recomputation) seconds of the memory-bound kernels; (0, 0) where
    the GPU has no measured bandwidth (times_memory_bound)."""
    # step_time asks twice of each request (its compute, then its report): while it runs the
    # last answer is kept, for that same request object (requests are immutable), in one tuple.
    last_request, last_answer = _last_memory_bound
    if request is last_request:
        return last_answer
    answer = _memory_bound_time_s(request)
    globals()["_last_memory_bound"] = (request, answer)
    return answer


_NO_MEMORY_BOUND: tuple[object, tuple[float, float]] = (None, (0.0, 0.0))
_last_memory_bound = _NO_MEMORY_BOUND
"""memory_bound_time_s's last request and answer, inside step_time (reset when it returns)."""


def _memory_bound_time_s(request: PlanRequest) -> tuple[float, float]:
    if not times_memory_bound(request):
        return 0.0, 0.0
    forward_s, backward_s, _ = _memory_bound_seconds(request)
    if softmax_inside_attention_rate(request):
        from zeroplan.core.roofline.step import eager_softmax_seconds

        softmax_forward_s, softmax_backward_s = eager_softmax_seconds(request)
        return forward_s - softmax_forward_s, backward_s - softmax_backward_s
    return forward_s, backward_s


# flash-attention benchmarks/benchmark_flash_attention.py, attention_pytorch: the published eager
# ('Pytorch') rate (zeroplan.core.attention_rate) times the whole standard attention, both batched
# products and the causal mask's add, the softmax and the dropout over the materialised scores.
# Where eager attention's FLOPs run at that rate ('published', or 'kernel' with a row for the GPU
# generation), its softmax passes are inside the rate, not a memory-bound kernel beside it.
def softmax_inside_attention_rate(request: PlanRequest) -> bool:
    """Whether the request's eager attention is timed at the published eager rate, which covers
    its softmax (so memory_bound_time_s leaves the softmax passes out)."""
    if request.performance.attention_rate == "matmul" or request.training.attention_kernel is not AttentionKernel.eager:
        return False
    from zeroplan.core.attention_rate import attention_rate_row, rate_architecture

    return attention_rate_row(rate_architecture(request.cluster.gpu), AttentionKernel.eager.value) is not None


# docs/communication-time.md, "Compute": t = matmul FLOPs / (peak x HFU) + attention FLOPs /
# (peak x HFU x r) + memory-bound bytes / copy bandwidth (memory_bound_time_s; under
# torch.compile the compiled block's bytes). The plan search fits it per group from two
# micro-batch sizes (some memory-bound passes cost the same whatever the micro-batch: FSDP's
# copies, autocast's casts) through this same function.
def compute_time_s(flops: StepFlops, request: PlanRequest) -> tuple[float, float]:
    """(forward, backward) seconds of compute: executed FLOPs over executed_flops_per_s, the
    attention core's at its relative rate r, plus the memory-bound kernels at the copy
    bandwidth, or, under the roofline compute model, the request's kernels against the GPU's
    ceilings. ``flops`` must be the request's (rank_flops)."""
    if request.performance.compute_model == "roofline":
        from zeroplan.core.roofline.step import roofline_step

        step = roofline_step(request)
        return step.forward_s, step.backward_s
    return _flat_compute_time_s(flops, request, executed_flops_per_s(request))


def _flat_compute_time_s(flops: StepFlops, request: PlanRequest, rate: float) -> tuple[float, float]:
    """compute_time_s under the flat-HFU model, ``rate`` the request's executed_flops_per_s."""
    if request.performance.attention_rate == "matmul":
        forward, backward = flops.forward_flops / rate, flops.backward_flops / rate
    else:
        attention_rate = attention_flops_per_s(request, rate)
        forward = (flops.forward_flops - flops.attention_forward_flops) / rate + flops.attention_forward_flops / attention_rate
        backward = (flops.backward_flops - flops.attention_backward_flops) / rate + flops.attention_backward_flops / attention_rate
    memory_forward_s, memory_backward_s = memory_bound_time_s(request)
    saved_forward_s, saved_backward_s = compile_saved_seconds(request)
    # float8 (zeroplan.core.float8_time): the converted products at the fp8 peak, their casts
    # at the copy bandwidth.
    fp8_forward_s, fp8_backward_s = float8_gemm_saved_seconds(request, rate)
    cast_forward_s, cast_backward_s = float8_cast_seconds(request)
    return (max(0.0, forward + memory_forward_s - saved_forward_s - fp8_forward_s + cast_forward_s),
            max(0.0, backward + memory_backward_s - saved_backward_s - fp8_backward_s + cast_backward_s))


def gpu_optimizer_time_s(request: PlanRequest) -> float:
    """The GPU's optimizer step: a memory-bound pass (zeroplan.core.roofline.optimizer) at the
    copy bandwidth under either compute model (none where the GPU has no measured bandwidth: the
    flat HFU then covers it; none where the optimizer steps on the host), plus Muon's
    Newton-Schulz products at the request's matrix-product rate."""
    # Muon's Newton-Schulz products (zeroplan.core.muon_time) add to the step's memory traffic
    # under either model: they are not among the executed FLOPs the HFU covers.
    return _optimizer_traffic_s(request) + newton_schulz_seconds(request)


def _optimizer_traffic_s(request: PlanRequest) -> float:
    """The optimizer step's memory-bound pass: the roofline's, or at the copy bandwidth where the
    GPU has a measured one (else 0: the flat HFU covers it)."""
    if request.performance.compute_model == "roofline":
        from zeroplan.core.roofline.step import roofline_step

        return roofline_step(request).optimizer_s
    return _memory_bound_seconds(request)[2] if times_memory_bound(request) else 0.0


# Muon's Newton-Schulz products (zeroplan.core.muon_time) run at the rate the request gives every
# matrix product: under the roofline the GPU's achievable matmul ceiling (the same MAMF its
# forward and backward products take, zeroplan.core.roofline.ceilings), else peak x the request's
# HFU (executed_flops_per_s). DeepSpeed's Gram iteration runs in fp16, whose dense peak is bf16's
# on A100, H100 and H200.
def newton_schulz_seconds(request: PlanRequest) -> float:
    """Seconds of one step's Newton-Schulz products on the busiest rank (0 without Muon)."""
    if request.training.optimizer is not Optimizer.muon:
        return 0.0  # rank_newton_schulz_flops' 0, without importing it at every plan's step time
    from zeroplan.core.muon_time import rank_newton_schulz_flops

    flops = rank_newton_schulz_flops(request)
    if not flops:
        return 0.0
    if request.performance.compute_model == "roofline":
        from zeroplan.core.roofline.ceilings import gpu_ceilings

        return flops / gpu_ceilings(request.cluster.gpu).matmul_flops_per_s
    return flops / executed_flops_per_s(request)


def _memory_bound_seconds(request: PlanRequest) -> tuple[float, float, float]:
    """zeroplan.core.roofline.step.memory_bound_seconds, its module imported when first asked
    for (a GPU without a measured bandwidth never needs it) and kept: an import statement costs
    each plan's step time as much as the answer it reaches, kept by the roofline."""
    function = _ROOFLINE_MEMORY_BOUND[0]
    if function is None:
        from zeroplan.core.roofline.step import memory_bound_seconds as function

        _ROOFLINE_MEMORY_BOUND[0] = function
    return function(request)


_ROOFLINE_MEMORY_BOUND: list = [None]
"""zeroplan.core.roofline.step.memory_bound_seconds once imported (_memory_bound_seconds)."""


# The HFU at which the planner's compute lasts what a published MFU says the step lasts (PaLM,
# Appendix B: MFU x peak x step = model FLOPs), the memory-bound kernels and the optimizer step
# at the copy bandwidth: executed / (peak x HFU) = model / (peak x MFU) - t_memory.
def hfu_from_mfu(request: PlanRequest, model_flops_utilization: float) -> float | None:
    """The HFU a published MFU implies for ``request`` (every FLOP at it: attention rate matmul);
    None where the memory-bound time alone outlasts the step (no HFU <= 1 reproduces it)."""
    flops = rank_flops(request)
    peak = request.cluster.gpu.peak_bf16_flops_per_s
    memory_s = sum(memory_bound_time_s(request)) + gpu_optimizer_time_s(request)
    flops_s = flops.model_flops / (peak * model_flops_utilization) - memory_s
    hfu = flops.executed_flops / (peak * flops_s) if flops_s > 0 else None
    return hfu if hfu is not None and hfu <= 1 else None


# PaLM (Chowdhery et al. 2022), Appendix B: MFU = model FLOPs per second achieved / peak.
def model_flops_utilization(model_flops: float, step_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs over (step seconds x peak FLOP/s)."""
    return model_flops / (step_s * peak_flops_per_s)


def exposed_communication_s(forward_s, backward_s, collective_s, host_s, maximum=max, nvme_s=None):
    """Seconds of collectives and host copies not hidden behind compute: each phase's link
    time past that phase's compute, plus everything in the step phase. ``collective_s`` and
    ``host_s`` (and, under the NVMe strategies, ``nvme_s``) map each Phase to seconds. The plan
    search sweeps numpy arrays through this same rule with ``maximum=np.maximum`` (the planner
    itself stays free of numpy at start-up)."""
    forward_busy = maximum(collective_s[Phase.forward], host_s[Phase.forward])
    backward_busy = maximum(collective_s[Phase.backward], host_s[Phase.backward])
    step = collective_s[Phase.step] + host_s[Phase.step]
    if nvme_s is not None:
        forward_busy = maximum(forward_busy, nvme_s[Phase.forward])
        backward_busy = maximum(backward_busy, nvme_s[Phase.backward])
        step = step + nvme_s[Phase.step]
    return (
        maximum(0.0, forward_busy - forward_s)
        + maximum(0.0, backward_busy - backward_s)
        + step
    )


# ZeRO-Infinity on NVMe (zeroplan.core.nvme.nvme_traffic for the bytes). The node's ranks swap at
# once, so each gets 1/G of the drive's read and write bandwidth (as host_memory_bound_s shares
# the host's memory). Parameter reads are prefetched ahead of their gathers (deepspeed 0.19.8
# partitioned_param_coordinator.py __prefetch_nvme_param_partitions, swap_in(async_op=True)) and
# the gradient partition is written while backward runs, so forward and backward NVMe time hides
# behind that phase's compute as the other links do (the slowest link counts). The optimizer
# swapper is not pipelined by default (offload_optimizer pipeline_read/pipeline_write False):
# PartitionedOptimizerSwapper.swap_in_optimizer_state reads each sub-group and waits, the CPU
# step runs, swap_out_optimizer_state writes and waits (aio_handle.wait()), so the step phase's
# reads and writes add to the step in full, besides the CPU optimizer's time; pipelined, only
# what nvme_step_exposed_s leaves.
def nvme_time_by_phase(request: PlanRequest) -> dict[Phase, float]:
    """Seconds of NVMe reads and writes per phase on one GPU's share of the node's drive."""
    traffic = nvme_traffic(request)
    ranks = request.cluster.gpus_per_node
    read = request.cluster.host.nvme_read_bytes_per_s / ranks
    write = request.cluster.host.nvme_write_bytes_per_s / ranks
    return {
        Phase.forward: traffic.forward_read / read,
        Phase.backward: traffic.backward_read / read + traffic.backward_write / write,
        Phase.step: traffic.step_read / read + traffic.step_write / write,
    }


# The step phase's NVMe time not hidden behind the CPU optimizer step. Unpipelined (DeepSpeed's
# default) that is all of it; with offload_optimizer pipeline_read / pipeline_write it is the
# pipelined optimizer swapper's span (zeroplan.core.nvme.pipelined_step_s, sub-group by sub-group:
# reads and writes at this GPU's share of the drive, the CPU step split in proportion to each
# sub-group's elements) less the CPU step, which step_time adds on its own.
def nvme_step_exposed_s(request: PlanRequest, step_transfer_s: float, cpu_s: float) -> float:
    """Seconds the optimizer step's NVMe reads and writes add to the step."""
    from zeroplan.core.nvme import pipelined_step_s, sub_group_step_bytes

    strategy = request.strategy
    if not (strategy.nvme_pipeline_read or strategy.nvme_pipeline_write):
        return step_transfer_s
    groups = sub_group_step_bytes(request)
    ranks = request.cluster.gpus_per_node
    read = request.cluster.host.nvme_read_bytes_per_s / ranks
    write = request.cluster.host.nvme_write_bytes_per_s / ranks
    elements = sum(e for e, _, _ in groups) or 1
    span = pipelined_step_s([r / read for _, r, _ in groups], [cpu_s * e / elements for e, _, _ in groups],
                            [w / write for _, _, w in groups], strategy.nvme_pipeline_read, strategy.nvme_pipeline_write)
    return max(0.0, span - cpu_s)


# Model parallelism divides each replica's work among tp x cp x pp ranks, taken as evenly
# (the pipeline's stages and the head's share are not balanced here).
def rank_flops(request: PlanRequest) -> StepFlops:
    """step_flops of the request's replica, per rank of its model-parallel group."""
    flops = step_flops(request)
    ranks = request.parallel.model_parallel_size
    if ranks == 1:
        return flops
    return StepFlops(forward_flops=flops.forward_flops / ranks, backward_flops=flops.backward_flops / ranks,
                     recompute_flops=flops.recompute_flops / ranks, model_flops=flops.model_flops / ranks,
                     attention_forward_flops=flops.attention_forward_flops / ranks,
                     attention_backward_flops=flops.attention_backward_flops / ranks)


# The step's collectives (each carries its sizes), host copies, CPU optimizer step, NVMe traffic,
# pipeline bubble share and HFU read of the batch its accumulation alone: kept per request with
# its batch cut to that (zeroplan.core.memo: a read of another batch field is answered uncached),
# so the micro-batches and sequences of one strategy (fit, a sweep, the largest micro-batch
# search) share them and step_time computes only what the batch's shape changes.
class _BatchFreeTerms(NamedTuple):
    """step_time's terms that do not change with the micro-batch or the sequence."""

    costs: tuple[CollectiveTime, ...]
    by_phase: dict[Phase, float]
    """Non-blocking collective seconds by phase."""
    blocking_s: float
    host_by_phase: dict[Phase, float]
    communication_s: float
    host_s: float
    cpu_s: float
    nvme_s: float
    nvme_exposed: dict[Phase, float] | None
    """NVMe seconds by phase as exposed (the step's after the CPU step); None without NVMe."""
    bubble: float
    hfu: float | None
    """The flat-HFU model's HFU; None under the roofline."""


@batch_keyed("grad_accum_steps")
def _batch_free_terms(request: PlanRequest, collectives: tuple[Collective, ...]) -> _BatchFreeTerms:
    """step_time's terms that do not change with the micro-batch or the sequence."""
    from zeroplan.core.parallel.pipeline import bubble_fraction

    by_phase = {phase: 0.0 for phase in Phase}
    costs = tuple(collective_cost(request, collective) for collective in collectives)
    blocking_s = 0.0
    for collective, cost in zip(collectives, costs, strict=True):
        if collective.blocking:
            blocking_s += cost.seconds
        else:
            by_phase[cost.phase] += cost.seconds
    host_link = host_link_share_bytes_per_s(request)
    host_by_phase = {phase: moved / host_link for phase, moved in host_transfer_bytes(request).items()}
    communication_s = sum(by_phase.values()) + blocking_s
    host_s = sum(host_by_phase.values())
    cpu_s = cpu_optimizer_time_s(request)
    nvme_by_phase = nvme_time_by_phase(request) if request.strategy.kind.optimizer_on_nvme else None
    nvme_s = sum(nvme_by_phase.values()) if nvme_by_phase else 0.0
    nvme_exposed = None
    if nvme_by_phase is not None:
        nvme_exposed = {**nvme_by_phase, Phase.step: nvme_step_exposed_s(request, nvme_by_phase[Phase.step], cpu_s)}
    bubble = float(bubble_fraction(request.parallel, request.batch.grad_accum_steps))
    from zeroplan.core.default_efficiency import effective_hfu

    hfu = effective_hfu(request) if request.performance.compute_model != "roofline" else None
    return _BatchFreeTerms(costs, by_phase, blocking_s, host_by_phase, communication_s, host_s, cpu_s, nvme_s, nvme_exposed,
                           bubble, hfu)


def step_time(request: PlanRequest, collectives: tuple[Collective, ...]) -> StepTime:
    if request.model.is_encoder_decoder:
        # The FLOPs and the roofline's operations are one stack's at one length (zeroplan.core.flops,
        # zeroplan.core.roofline): an encoder-decoder's memory is planned, its step is not timed.
        raise ZeroplanError("model", f"{request.model.name} is an encoder-decoder, whose step time is not modelled "
                                     "(its memory is; allowed: a model with one stack for step times and the plan search)")

    flops = rank_flops(request)
    (costs, by_phase, blocking_s, host_by_phase, communication_s, host_s, cpu_s, nvme_s, nvme_exposed, bubble,
     hfu) = _batch_free_terms(request, tuple(collectives))
    flat = hfu is not None
    # executed_flops_per_s, from the same HFU.
    forward_s, backward_s = (_flat_compute_time_s(flops, request, request.cluster.gpu.peak_bf16_flops_per_s * hfu) if flat
                             else compute_time_s(flops, request))
    gpu_optimizer_s = gpu_optimizer_time_s(request)
    # Forward gathers hide behind forward compute, backward collectives and gradient offload
    # behind backward compute (each link runs its own copies, so the slower one counts); what
    # runs after backward (ZeRO-1/2's parameter all-gather, parameters back from the host) is
    # exposed. The CPU step waits for the last gradient and the parameters wait for it
    # (DeepSpeed's default; its delayed parameter update, ZeRO-Offload sec. 5.2, is opt-in and
    # not modelled), so cpu_s adds to the step in full; the GPU's own optimizer step (roofline
    # model) likewise runs after the last gradient is reduced.
    exposed = exposed_communication_s(forward_s, backward_s, by_phase, host_by_phase, nvme_s=nvme_exposed)
    # DeepSpeed's checkpoint copies to and from the host that the compute waits for
    # (zeroplan.core.deepspeed_checkpointing): exposed, with the host transfers.
    checkpoint_copy_s = checkpoint_copy_seconds(request)
    exposed += checkpoint_copy_s
    host_s += checkpoint_copy_s
    # The pipeline idles a fraction of its busy time: compute and the collectives compute waits on.
    bubble_s = bubble * (forward_s + backward_s + blocking_s)
    step_s = forward_s + backward_s + blocking_s + bubble_s + exposed + cpu_s + gpu_optimizer_s
    batch = request.batch
    tokens = batch.micro_batch_size * batch.grad_accum_steps * batch.seq_len / request.parallel.model_parallel_size
    memory_bound_s = float(sum(memory_bound_time_s(request))) if flat else 0.0
    globals()["_last_memory_bound"] = _NO_MEMORY_BOUND
    # Built unvalidated (Frozen.trusted): every value is the planner's own, each float field's
    # made a float as validation makes it (some terms are ints: 0 where a link moves nothing).
    return StepTime.trusted(
        memory_bound_s=memory_bound_s,
        compile_saved_s=float(sum(compile_saved_seconds(request))) if flat else 0.0,
        hardware_flops_utilization=None if hfu is None else float(hfu),
        forward_compute_s=float(forward_s),
        backward_compute_s=float(backward_s),
        communication_s=float(communication_s),
        host_transfer_s=float(host_s),
        nvme_transfer_s=float(nvme_s),
        cpu_optimizer_s=float(cpu_s),
        optimizer_step_s=float(gpu_optimizer_s),
        exposed_communication_s=float(exposed),
        step_without_overlap_s=float(forward_s + backward_s + communication_s + host_s + nvme_s + cpu_s + gpu_optimizer_s + bubble_s),
        step_with_overlap_s=float(step_s),
        model_parallel_communication_s=float(blocking_s),
        pipeline_bubble_s=float(bubble_s),
        collective_times=costs,
        executed_flops=float(flops.executed_flops),
        model_flops=float(flops.model_flops),
        tokens_per_s_per_gpu=float(tokens / step_s),
        model_flops_utilization=float(model_flops_utilization(flops.model_flops, step_s, request.cluster.gpu.peak_bf16_flops_per_s)),
    )


COLLECTIVE_SHORT_NAMES: dict[CollectiveOp, str] = {
    CollectiveOp.all_reduce: "AR", CollectiveOp.all_gather: "AG", CollectiveOp.reduce_scatter: "RS",
    CollectiveOp.broadcast: "BC", CollectiveOp.send: "P2P", CollectiveOp.all_to_all: "A2A",
}
"""The compare table's name for each collective op (its legend spells them out); every op has one."""


def nccl_algorithms(time: StepTime) -> str:
    """The NCCL algorithms of a step's collective ops, e.g. 'AR nvls*, AG ring' (* = some at an
    achievable busbw); ops in the order they first appear, algorithms by first use."""
    by_op: dict[str, list[str]] = {}
    achievable: set[str] = set()
    for cost in time.collective_times:
        short = COLLECTIVE_SHORT_NAMES[cost.op]
        names = by_op.setdefault(short, [])
        names += [a.value for a in cost.algorithms if a.value not in names]
        if cost.bandwidth_basis == "achievable":
            achievable.add(short)
    return ", ".join(f"{op} {'+'.join(names)}{'*' if op in achievable else ''}" for op, names in by_op.items()) or "-"
