"""Bytes of the frozen parameters: a LoRA base in the compute dtype or quantized (QLoRA's nf4),
a frozen embedding or block in the dtype the trainable ones are held in."""

from __future__ import annotations

from zeroplan.core.layout import element_bytes
from zeroplan.core.params import ParamTensor, ParamUnit
from zeroplan.specs.finetune import BaseDtype
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import Precision, StateConvention
from zeroplan.units import ceil_div

NF4_DOUBLE_QUANT_BLOCK = 256
"""Scales per second-level block when the nf4 scales are quantized themselves (QLoRA sec. 3,
"Double Quantization": 8-bit scales in blocks of 256; torchao's scaler_block_size default,
bitsandbytes' nested blocksize)."""


# QLoRA (Dettmers et al. 2023) sec. 3: two 4-bit codes per byte and one absmax scale per block
# of B elements; with double quantization each scale is stored in 8 bits and every 256 of them
# share one second-level constant (0.5 + 1/64 + 4/(64 x 256) = 0.516 bytes per element at B = 64
# with fp32 constants, the paper's 4.127 bits). Without double quantization each scale is fp32.
# The second-level constant's width differs by library: bitsandbytes 0.48 functional.py
# quantize_4bit keeps it fp32 (QuantState.state2.absmax); torchao 0.14.1 dtypes/nf4tensor.py
# NF4Tensor.double_quantize_scalers keeps quantization_factor in the weight's dtype (bf16 in
# torchtune's recipes). Per-tensor constants (the 16-entry code, the scalers' mean, the
# 256-entry nested code) are a few hundred bytes a tensor and are left out.
def nf4_tensor_bytes(numel: int, block: int, double_quant: bool, second_level_bytes: int) -> int:
    """Bytes of one weight of ``numel`` elements stored in nf4."""
    codes = ceil_div(numel, 2)
    scales = ceil_div(numel, block)
    if not double_quant:
        return codes + 4 * scales
    return codes + scales + second_level_bytes * ceil_div(scales, NF4_DOUBLE_QUANT_BLOCK)


def nf4_second_level_bytes(request: PlanRequest) -> int:
    """Width of the double quantization's constants: the compute dtype under torchtune
    (torchao's NF4Tensor), fp32 otherwise (bitsandbytes' Linear4bit, what PEFT's QLoRA uses)."""
    if request.training.framework is Framework.torchtune:
        return request.training.precision.compute_bytes
    return 4


def frozen_element_bytes(request: PlanRequest) -> int:
    """Bytes per element of a frozen, unquantized parameter. A LoRA base keeps the dtype it was
    loaded in (FineTuneSpec.base_dtype; fp32 under fp32 training) unless the engine casts the
    module: DeepSpeed casts it to 16 bits; a frozen embedding or block of a full fine-tune keeps
    the dtype the rest of the model is held in."""
    eb = element_bytes(request.training.precision, request.convention)
    finetune = request.training.finetune
    if not finetune.is_lora or request.training.precision is Precision.fp32:
        return eb.parameter
    if request.convention is not StateConvention.fsdp2:
        return eb.compute_parameter  # deepspeed/runtime/engine.py _configure_distributed_model: module.bfloat16()
    if request.training.framework is Framework.hf and request.strategy.kind.is_fsdp and request.training.precision.is_mixed:
        # accelerate 1.10.1 fsdp2_prepare_model (zeroplan/frameworks/build.py _hf_fsdp2): with
        # mixed precision it calls model.to(torch.float32) after fully_shard, frozen base
        # included (measured: benchmarks/framework-step-records, hf LoRA, 4 bytes per element).
        return 4
    return 4 if finetune.base_dtype is BaseDtype.fp32 else eb.compute_parameter


# torchao 0.14.1 dtypes/nf4tensor.py NF4Tensor.from_tensor: besides its codes and scales each
# tensor holds the 16-entry nf4 code and the scalers' mean in the weight's dtype, which its
# fsdp_pre_all_gather sends whole and every shard keeps (measured: 34 bytes per bf16 weight on
# each rank, benchmarks/framework-step-records, torchtune QLoRA).
def nf4_replicated_bytes(request: PlanRequest) -> int:
    """Per-tensor constants every shard of an nf4 weight keeps (torchao's; bitsandbytes'
    QuantState constants are not modelled)."""
    if request.training.framework is not Framework.torchtune:
        return 0
    return (16 + 1) * request.training.precision.compute_bytes


def frozen_tensor_bytes(request: PlanRequest, tensor: ParamTensor, gathered: bool = False) -> int:
    """Bytes of one frozen tensor, whole (its sharded part; per-tensor constants apart), as
    stored, or as an all-gather brings it in (``gathered``: FSDP2 casts a parameter to its
    MixedPrecisionPolicy's param_dtype before gathering, DeepSpeed's module is 16-bit already;
    an nf4 weight is gathered as it is stored)."""
    finetune = request.training.finetune
    if tensor.quantized:
        return nf4_tensor_bytes(tensor.numel, finetune.quant_block_size, finetune.double_quant, nf4_second_level_bytes(request))
    if gathered:
        return tensor.numel * element_bytes(request.training.precision, request.convention).compute_parameter
    return tensor.numel * frozen_element_bytes(request)


def frozen_held_bytes(request: PlanRequest, units: tuple[ParamUnit, ...], num_shards: int) -> int:
    """Frozen bytes one rank holds when each unit is split ``num_shards`` ways (1: whole)."""
    replicated = nf4_replicated_bytes(request)
    return sum(ceil_div(frozen_tensor_bytes(request, t), num_shards) + (replicated if t.quantized else 0)
               for unit in units for t in unit.tensors if not t.trainable)
