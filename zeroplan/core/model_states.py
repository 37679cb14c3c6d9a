"""Per-rank bytes of parameters, gradients and optimizer states (the ZeRO paper's "model
states", sec. 3.1), exact for a padded sharded layout, with offload to host memory."""

from zeroplan.core import deepspeed_offload, deepspeed_partial_offload, deepspeed_stage0
from zeroplan.core.dschat_dpo import reference_parameter_bytes
from zeroplan.core.deepspeed_bf16_autocast import master_copy_element_bytes
from zeroplan.core.finetune import modules_to_save
from zeroplan.core.finetune.adapter_dtype import trainable_element_bytes
from zeroplan.core.finetune.offload import offloaded_quant_constant_bytes
from zeroplan.core.finetune.storage import frozen_held_bytes, frozen_tensor_bytes
from zeroplan.core.finetune.units import trainable_view
from zeroplan.core.megatron_deepspeed import bf16_optimizer_runs, bf16_optimizer_states
from zeroplan.core.layout import (
    ElementBytes, ShardLayout, distinct_units, element_bytes, padded_unit_elements, shard_elements, tensor_shard_elements,
)
from zeroplan.core import muon
from zeroplan.core.optimizer_states import (
    ADAM_STEP_COUNTER_BYTES, elementwise_state_bytes, is_elementwise, step_counter_bytes, tensor_state_bytes,
)
from zeroplan.core.nvme import OFFLOAD_GRADIENT_BYTES, OFFLOAD_MASTER_BYTES, host_pinned_bytes
from zeroplan.core.params import ParamUnit
from zeroplan.core.parallel.units import rank_block_count, rank_parameter_units, rank_trainable_units
from zeroplan.core.profiles import fused_qkv_fewer_tensors
from zeroplan.specs.base import Frozen
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import ZeroGradientReduce
from zeroplan.specs.training import Optimizer, Precision, StateConvention
from zeroplan.core.torch_release import keeps_zeroed_gradients
from zeroplan.units import ceil_div


class ModelStateBytes(Frozen):
    """Model states of one rank."""

    parameter_bytes: int
    """Parameters resident on the GPU between steps."""
    gradient_bytes: int
    """Gradients resident on the GPU at the end of backward (fp32 copies included)."""
    optimizer_state_bytes: int
    """Optimizer states on the GPU, fp32 master copy and step counters included (the paper's
    K*Psi term)."""
    step_counter_bytes: int
    """Of those, the optimizer's per-tensor step counters (a layout detail the paper omits)."""
    host_bytes: int
    """Model states offloaded to host memory by this rank."""
    paged_optimizer_bytes: int = 0
    """Optimizer states in CUDA managed memory (TrainingSpec.paged_optimizer): outside the
    caching allocator and ``optimizer_state_bytes``, paged to the host when the GPU is full."""
    gradients_resident: bool = False
    """The gradients live in a buffer allocated once and kept (megatron-core's contiguous
    gradient buffer, zeroed between steps and never freed): alive at every moment of the step,
    not only from the end of backward."""
    gradients_kept: bool = False
    """The gradients stay allocated from one step to the next, zeroed in place by a torch release
    before 2.0 (zeroplan.core.torch_release.keeps_zeroed_gradients): alive through the forward
    and every moment as with gradients_resident, but each its own tensor, made by the first
    backward."""
    parameter_elements: int
    """Trainable parameter elements this rank stores (padding included; frozen ones are in
    parameter_bytes only)."""
    optimizer_elements: int
    """Parameter elements this rank's optimizer steps (its shard from ZeRO-1 on)."""

    @property
    def gpu_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def gpu_bytes_without_counters(self) -> int:
        """What the ZeRO paper's equations count."""
        return self.gpu_bytes - self.step_counter_bytes


def shard_layout(request: PlanRequest) -> ShardLayout:
    return ShardLayout.dim0 if request.strategy.kind.is_fsdp else ShardLayout.flat


def padded_unit_elements_of(request: PlanRequest, num_shards: int) -> list[int]:
    """Every unit's unsharded trainable element count after padding for ``num_shards`` shards
    (one entry per unit of rank_parameter_units; all its elements unless the fine-tune freezes
    some): what a reduce-scatter consumes, and with unit_gather_bytes what an all-gather makes."""
    layout = shard_layout(request)
    units = rank_parameter_units(request)
    key = (id(units), num_shards, layout)
    cached = _PADDED_ELEMENTS.get(key)
    if cached is not None and cached[0] is units:
        return list(cached[1])
    if len(_PADDED_ELEMENTS) > _PADDED_ELEMENTS_LIMIT:
        _PADDED_ELEMENTS.clear()
    if trainable_view(units) is units:
        padded = [padded_unit_elements(unit, num_shards, layout) for unit in units]
    else:
        padded = [padded_unit_elements(ParamUnit(name=unit.name, tensors=tuple(t for t in unit.tensors if t.trainable)),
                                       num_shards, layout) for unit in units]
    _PADDED_ELEMENTS[key] = (units, tuple(padded))
    return padded


def unit_gather_bytes(request: PlanRequest, num_shards: int, bytes_per_element: int) -> list[int]:
    """Every unit's unsharded bytes as an all-gather brings it in: its trainable elements (padded
    for ``num_shards``) at ``bytes_per_element``, its frozen tensors in their own storage
    (zeroplan.core.finetune.storage: each padded to a multiple of the shards); under FSDP with
    torchao's float8 all-gather, the Float8Linear weights at one byte (_float8_unsharded)."""
    padded = padded_unit_elements_of(request, num_shards)
    units = rank_parameter_units(request)
    if trainable_view(units) is units:
        return _float8_unsharded(request, [elements * bytes_per_element for elements in padded], bytes_per_element)
    return [elements * bytes_per_element
            + sum(num_shards * ceil_div(frozen_tensor_bytes(request, t, gathered=True), num_shards)
                  for t in unit.tensors if not t.trainable)
            for unit, elements in zip(units, padded)]


# torchao 0.14.1 float8/fsdp_utils.py WeightWithDynamicFloat8CastTensor: fsdp_pre_all_gather
# casts the shard to float8 and hands FSDP2 its _data to gather; fsdp_post_all_gather wraps the
# gathered data, uncopied, as the unsharded Float8TrainingTensor, and float8_linear.py
# matmul_with_hp_or_float8_args saves that tensor (already cast, so no bf16 weight is made) for
# backward. So a Float8Linear's unsharded storage is 1 byte an element, the unit's other
# parameters (norms) stay in the compute dtype: measured on gloo by
# benchmarks/float8_all_gather_memory.py (a 512x256 weight's all-gather output 131,072 bytes,
# float8_e4m3fn, against 262,144 in bf16; the saved weight is that storage) and, per block, by
# docs/compile-float8.md's "FSDP2 float8 all-gather" (Llama-3.1-8B 218,120,192 bytes against
# 436,224,000). The per-weight fp32 scale (4 bytes) is left out.
def _float8_unsharded(request: PlanRequest, gathered: list[int], bytes_per_element: int) -> list[int]:
    """``gathered`` (every unit in ``bytes_per_element``) with the Float8Linear weights at one
    byte where FSDP gathers them cast (TrainingSpec.float8_all_gather)."""
    if not (request.training.float8_all_gather and request.strategy.kind.is_fsdp):
        return gathered
    from zeroplan.core.float8_time import float8_gather_bytes

    return float8_gather_bytes(request, gathered, bytes_per_element)


# The planner asks for the same units' padded sizes many times per plan (collectives, buffers,
# timing), and the plan search thousands of times; the units tuples are themselves cached
# (parameter_units, rank_parameter_units), so their identity keys this cache, and the entry
# keeps the tuple alive so the identity cannot be reused.
_PADDED_ELEMENTS: dict[tuple[int, int, ShardLayout], tuple[tuple[ParamUnit, ...], tuple[int, ...]]] = {}
_PADDED_ELEMENTS_LIMIT = 4096


def held_elements(units: tuple[ParamUnit, ...], num_shards: int, layout: ShardLayout) -> int:
    """Elements a rank holds of every unit when each is split ``num_shards`` ways."""
    # Kept as _PADDED_ELEMENTS keeps its sizes: by the units' identity, the entry holding them
    # (unsharded too: DDP's states and buffers ask it of every unit of the rank, per plan).
    key = (id(units), num_shards, layout)
    known = _HELD_ELEMENTS.get(key)
    if known is not None and known[0] is units:
        return known[1]
    if len(_HELD_ELEMENTS) >= _PADDED_ELEMENTS_LIMIT:
        _HELD_ELEMENTS.clear()
    if num_shards == 1:
        held = sum(unit.numel for unit in units)
    else:
        held = sum(count * shard_elements(unit, num_shards, layout) for unit, count in distinct_units(units))
    _HELD_ELEMENTS[key] = (units, held)
    return held


_HELD_ELEMENTS: dict[tuple[int, int, ShardLayout], tuple[tuple[ParamUnit, ...], int]] = {}


def stepped_tensors(request: PlanRequest, sharded: bool) -> int:
    """Tensors the optimizer steps on one rank: one flat shard per unit in the reference ZeRO
    layout, every parameter tensor otherwise (DDP, FSDP2's per-parameter shards)."""
    units = rank_trainable_units(request)
    if sharded and shard_layout(request) is ShardLayout.flat:
        return len(units)
    fused = fused_qkv_fewer_tensors(request, rank_block_count(request)) if request.training.finetune.trains_everything else 0
    return sum(len(unit.tensors) for unit in units) - fused


def largest_tensor_shard_elements(request: PlanRequest) -> int:
    """Elements of the largest trainable parameter tensor's shard on one rank (padding included)."""
    layout, num_shards = shard_layout(request), request.shard_group_size
    return max(tensor_shard_elements(tensor, num_shards, layout)
               for unit in rank_trainable_units(request) for tensor in unit.tensors)


# DeepSpeed 0.19.8 hands its optimizer one flat fp32 partition per parameter group (and
# sub-group): stage_1_and_2.py single_partition_of_fp32_groups, the group flattened and aligned
# (flat_group_elements) split N ways; stage3.py fp32_partitioned_groups_flat, each parameter's
# partition (ceil(ds_numel / N)) concatenated, one sub-group while sub_group_size (1e9 by
# default) holds the partition. torch's single-tensor AdamW makes its temporaries that size.
def deepspeed_flat_partition_elements(request: PlanRequest) -> int:
    from zeroplan.core.deepspeed_buckets import flat_group_elements

    numels = [t.numel for unit in rank_trainable_units(request) for t in unit.tensors if t.trainable]
    group = request.shard_group_size
    if request.strategy.kind.zero_stage == 3:
        return sum(ceil_div(n, group) for n in numels)
    return flat_group_elements(sum(numels), group) // group


def largest_optimizer_tensor_elements(request: PlanRequest) -> int:
    """Elements of the largest tensor the optimizer steps on one rank: a unit's flat shard
    where ZeRO flattens each unit (the fp32 master of zeroplan/harness/zero.py's FlatUnit),
    whole parameters under ZeroRedundancyOptimizer (it assigns tensors to ranks whole), else one
    parameter's shard (FSDP2's DTensor shards; DDP's tensors, N = 1)."""
    if request.strategy.zero_gradient_reduce is ZeroGradientReduce.ddp_buckets:
        return max(tensor.numel for unit in rank_trainable_units(request) for tensor in unit.tensors)
    if request.convention is StateConvention.deepspeed and request.strategy.kind.zero_stage and not request.strategy.kind.is_fsdp:
        return deepspeed_flat_partition_elements(request)
    if request.strategy.kind.zero_stage and shard_layout(request) is ShardLayout.flat:
        return max(shard_elements(unit, request.shard_group_size, ShardLayout.flat) for unit in rank_trainable_units(request))
    return largest_tensor_shard_elements(request)


def optimizer_bytes(request: PlanRequest, elements: int, num_shards: int, eb: ElementBytes) -> int:
    """Optimizer-state bytes for ``elements`` held elements (master copy and step counters
    not included)."""
    optimizer = request.training.optimizer
    if is_elementwise(optimizer):
        return elements * elementwise_state_bytes(optimizer, eb.optimizer_dtype)
    if optimizer is Optimizer.muon:
        # Muon's momentum beside AdamW's two states, where check_muon allows them (zeroplan.core.muon).
        if request.convention is StateConvention.deepspeed:
            return muon.deepspeed_state_bytes(request, eb.compute_parameter, eb.optimizer_dtype)
        return muon.torch_state_bytes(request, eb.optimizer_dtype)
    # Factored and block-quantised states do not split element by element; a rank holds 1/N
    # of the whole (rounded up). Documented in docs/memory-model.md as an approximation.
    units = rank_trainable_units(request)
    whole = sum(tensor_state_bytes(t, optimizer, eb.optimizer_dtype) for u in units for t in u.tensors)
    return ceil_div(whole, num_shards)


# deepspeed/runtime/zero/stage_1_and_2.py: stage 1 reduces its gradients in backward at the
# accumulation boundary (reduce_ready_partitions_and_remove_grads) and keeps only its partition
# (copy_grads_in_partition, then _clear_param_grad_only), as stage 2 does, so the gradient its
# step reads is the fp32 partition at any accumulation; the full gradients that add up between
# micro-steps are zeroplan.core.deepspeed_accumulation's (measured by the harness's DeepSpeed
# engine: docs/harness.md, benchmarks/deepspeed-accumulation-records).
def _deepspeed_stage1_reduces_in_backward(request: PlanRequest) -> bool:
    return request.strategy.kind.zero_stage == 1 and request.convention is StateConvention.deepspeed


def model_state_bytes(request: PlanRequest) -> ModelStateBytes:
    if request.training.framework is Framework.megatron:
        # megatron-core's gradient buffer and distributed optimizer (zeroplan.core.megatron,
        # imported here: a request of another framework never loads it).
        from zeroplan.core.megatron import megatron_model_state_bytes

        states = megatron_model_state_bytes(request)
        return ModelStateBytes(
            parameter_bytes=states.parameter_bytes, gradient_bytes=states.gradient_bytes,
            optimizer_state_bytes=states.optimizer_state_bytes, step_counter_bytes=0, host_bytes=0,
            parameter_elements=states.buffer_elements, optimizer_elements=states.optimizer_elements,
            gradients_resident=True,
        )
    if bf16_optimizer_runs(request):
        # DeepSpeed's BF16_Optimizer: bf16 flat groups and the parameters' bf16 gradients beside
        # partitioned fp32 master and Adam states (zeroplan.core.megatron_deepspeed); its
        # unpartitioned fp32 gradient buffer is a resident buffer (zeroplan.core.buffers).
        # Under fp16 the fork runs DeepSpeed's ZeRO stage-1 optimizer, the deepspeed convention below.
        bf16 = bf16_optimizer_states(request)
        return ModelStateBytes(
            parameter_bytes=bf16.parameter_bytes, gradient_bytes=bf16.gradient_bytes,
            optimizer_state_bytes=bf16.optimizer_state_bytes, step_counter_bytes=0, host_bytes=0,
            parameter_elements=sum(bf16.group_elements), optimizer_elements=bf16.partition_elements,
        )
    kind = request.strategy.kind
    stage = kind.zero_stage
    # peft's adapters in their own dtype where nothing casts them (zeroplan.core.finetune.adapter_dtype).
    eb = trainable_element_bytes(request, element_bytes(request.training.precision, request.convention))
    # Only trainable parameters have gradients, optimizer states and master copies; frozen
    # ones (zeroplan.core.finetune) are stored once, sharded by ZeRO-3 and FSDP like the rest
    # (deepspeed/runtime/zero/partition_parameters.py partitions every parameter; FSDP2's
    # fully_shard shards every parameter of the module, requires_grad or not).
    all_units = rank_parameter_units(request)
    units = rank_trainable_units(request)
    num_shards = request.shard_group_size
    layout = shard_layout(request)
    full = held_elements(units, 1, layout)
    shard = held_elements(units, num_shards, layout)
    frozen = 0 if units is all_units else frozen_held_bytes(request, all_units, num_shards if stage >= 3 else 1)

    parameter_elements = shard if stage >= 3 else full
    gradient_elements = shard if stage >= 2 or _deepspeed_stage1_reduces_in_backward(request) else full
    optimizer_elements = shard if stage >= 1 else full
    optimizer_shards = num_shards if stage >= 1 else 1

    parameter = parameter_elements * eb.parameter + frozen
    gradient = gradient_elements * eb.gradient
    counters = step_counter_bytes(request.training.optimizer, stepped_tensors(request, sharded=stage >= 1))
    if request.training.optimizer is Optimizer.muon and request.convention is not StateConvention.deepspeed:
        # torch.optim.AdamW's 0-dim step per tensor it steps; Muon keeps none, and DeepSpeed's
        # FusedAdam counts in a Python int (ops/adam/fused_adam.py state['step']).
        counters = ADAM_STEP_COUNTER_BYTES * muon.adamw_stepped_tensors(request)
    # DeepSpeed's stage 0 clones an fp32 master only under fp16 and bf16 (zeroplan.core.deepspeed_stage0).
    master = 0 if deepspeed_stage0.runs_deepspeed_stage0(request) and request.training.precision is Precision.fp32 else eb.master
    # DeepSpeed's bf16 master-weights mode keeps a separate bf16 master (zeroplan.core.deepspeed_bf16_autocast).
    master += master_copy_element_bytes(request)
    optimizer = optimizer_elements * master + optimizer_bytes(request, optimizer_elements, optimizer_shards, eb) + counters
    if request.training.finetune.modules_to_save:
        # PEFT's trainable copies beside the adapters, in the dtype of the module each copies
        # (zeroplan.core.finetune.modules_to_save; DDP only: check_saved_module_training).
        copy_counters = modules_to_save.copy_step_counter_bytes(request)
        parameter += modules_to_save.copy_parameter_bytes(request)
        gradient += modules_to_save.copy_gradient_bytes(request)
        optimizer += modules_to_save.copy_optimizer_state_bytes(request) + copy_counters
        counters += copy_counters
    if request.training.optimizer_in_backward:
        # torchtune 0.6.1 training/memory.py register_optim_in_bwd_hooks: each parameter's hook
        # steps its optimizer and zero_grad()s it (set_to_none) as soon as FSDP2 assigns the
        # reduced gradient (torch 2.13 _fully_shard/_fsdp_collectives.py foreach_reduce calls
        # the sharded parameter's post-accumulate-grad hooks): none is left at backward's end.
        gradient = 0
    paged = 0
    if request.training.paged_optimizer:
        # The large tensors' states leave the allocator, and bitsandbytes keeps them in fp32
        # whatever the parameters' dtype (its 32-bit optimizers) or blockwise 8-bit.
        optimizer -= paged_state_bytes(request, optimizer_shards, eb.optimizer_dtype)
        paged = paged_state_bytes(request, optimizer_shards, BNB_STATE_DTYPE_BYTES)
    host = 0
    if kind.offloads_optimizer:
        # ZeRO-Offload (Ren et al. 2021, sec. 4.1): the host holds fp32 master weights, optimizer
        # states and fp32 gradients, and runs the optimizer step. The gradient partition streams
        # to the host as it is reduced; nothing stays on the GPU.
        # Under ZeRO-Offload++'s ratio the GPU sub-groups keep their fp32 master, gradient and
        # AdamW states on the GPU (zeroplan.core.deepspeed_partial_offload), the gradient made
        # once before the first step and kept, so counted with the resident states.
        on_device = deepspeed_partial_offload.device_partition_elements(request)
        on_host = optimizer_elements - on_device
        host = on_host * (OFFLOAD_MASTER_BYTES + OFFLOAD_GRADIENT_BYTES)
        host += optimizer_bytes(request, on_host, optimizer_shards, eb) + counters
        # DeepSpeed's host staging buffers (zeroplan.core.deepspeed_offload).
        host += deepspeed_offload.host_staging_bytes(request)
        gradient = 0
        optimizer = deepspeed_partial_offload.device_state_bytes(request)
        counters = 0
    if kind.offloads_parameters:
        host += parameter
        parameter = 0
    if kind.optimizer_on_nvme:
        # ZeRO-Infinity on NVMe: those states live on the drive (zeroplan.core.nvme.nvme_bytes);
        # the host keeps only the swappers' pinned buffers.
        host = host_pinned_bytes(request)
    if request.training.fsdp_cpu_offload:
        # torch 2.13 distributed/fsdp/_fully_shard/_fsdp_api.py CPUOffloadPolicy: the sharded
        # parameters (_fsdp_param.py _init_sharded_param: padded_sharded_param.cpu()) and the
        # sharded gradients (_fsdp_collectives.py foreach_reduce: new_sharded_grad.to("cpu"))
        # live on the host, so the optimizer's states, created beside its parameters, do too.
        # A bitsandbytes base's quantization constants are attributes the offload does not move
        # (zeroplan.core.finetune.offload): they stay on the GPU.
        kept = offloaded_quant_constant_bytes(request)
        host += parameter - kept + gradient + optimizer
        parameter = kept
        gradient = optimizer = counters = 0
    from zeroplan.core.fairseq import fp16_optimizer_state_bytes, runs_fp16_optimizer

    if runs_fp16_optimizer(request):
        # fairseq's FP16Optimizer under DDP (zeroplan.core.fairseq): fp16 model, flat fp32 master
        # and gradient; the states are Adam's on the master, as counted above.
        parameter, gradient, optimizer = fp16_optimizer_state_bytes(
            parameter_elements, optimizer_bytes(request, optimizer_elements, optimizer_shards, eb) + counters)
    # DeepSpeed-Chat's DPO keeps a frozen reference model beside the policy (zeroplan.core.dschat_dpo).
    parameter += reference_parameter_bytes(request)
    return ModelStateBytes(
        parameter_bytes=parameter,
        gradient_bytes=gradient,
        optimizer_state_bytes=optimizer,
        step_counter_bytes=counters,
        host_bytes=host,
        parameter_elements=parameter_elements,
        optimizer_elements=optimizer_elements,
        paged_optimizer_bytes=paged,
        gradients_kept=gradient > 0 and keeps_zeroed_gradients(request),
    )


PAGED_MIN_ELEMENTS = 100_000
"""bitsandbytes 0.50.2 optim/optimizer.py get_state_buffer: a tensor of fewer elements keeps its
states in an ordinary torch.zeros_like (the caching allocator), a larger one in get_paged."""


BNB_STATE_DTYPE_BYTES = 4
"""bitsandbytes 0.50.2 optim/optimizer.py Optimizer2State/Optimizer1State.init_state: a 32-bit
optimizer's states are get_state_buffer(p, dtype=torch.float32), whatever p's dtype."""


def flat_stepped_elements(request: PlanRequest) -> list[int] | None:
    """The element count of each flat tensor the optimizer steps on one rank where ZeRO hands
    it flat partitions instead of the parameters: DeepSpeed's one partition per parameter group
    (deepspeed_flat_partition_elements; stage_1_and_2.py line 584 sets each group's params to
    [single_partition_of_fp32_groups[i]], stage3.py line 1260 to [fp32_param] of its sub-group),
    the reference engine's flat shard of each unit (zeroplan/harness/zero.py FlatUnit; as
    largest_optimizer_tensor_elements reads them); None where it steps the parameters (or their
    shards) themselves."""
    kind = request.strategy.kind
    if not kind.zero_stage or kind.is_fsdp or request.strategy.zero_gradient_reduce is ZeroGradientReduce.ddp_buckets:
        return None
    if request.convention is StateConvention.deepspeed:
        return [deepspeed_flat_partition_elements(request)]
    if shard_layout(request) is ShardLayout.flat:
        return [shard_elements(unit, request.shard_group_size, ShardLayout.flat) for unit in rank_trainable_units(request)]
    return None


def paged_state_bytes(request: PlanRequest, num_shards: int, state_dtype_bytes: int) -> int:
    """The optimizer-state bytes of the tensors (their shard on this rank) of at least
    PAGED_MIN_ELEMENTS elements, with element-wise states of ``state_dtype_bytes``: what a
    paged optimizer puts in CUDA managed memory on one rank. bitsandbytes tests the size of the
    tensor it steps, which under ZeRO's flat partitions is the partition
    (flat_stepped_elements), not a parameter."""
    optimizer = request.training.optimizer
    flat = flat_stepped_elements(request) if is_elementwise(optimizer) else None
    if flat is not None:
        return sum(elements * elementwise_state_bytes(optimizer, state_dtype_bytes)
                   for elements in flat if elements >= PAGED_MIN_ELEMENTS)
    layout = shard_layout(request)
    paged = 0
    for unit in rank_trainable_units(request):
        for tensor in unit.tensors:
            elements = tensor_shard_elements(tensor, num_shards, layout)
            if elements < PAGED_MIN_ELEMENTS:
                continue
            optimizer = request.training.optimizer
            paged += (elements * elementwise_state_bytes(optimizer, state_dtype_bytes) if is_elementwise(optimizer)
                      else ceil_div(tensor_state_bytes(tensor, optimizer, state_dtype_bytes), num_shards))
    return paged
