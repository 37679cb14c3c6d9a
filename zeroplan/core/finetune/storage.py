"""Bytes of the frozen parameters: a LoRA base in the compute dtype or quantized (QLoRA's nf4,
LLM.int8), a frozen embedding or block in the dtype the trainable ones are held in."""

from __future__ import annotations

from zeroplan.core.layout import element_bytes
from zeroplan.core.params import ParamTensor, ParamUnit
from zeroplan.core.finetune.units import TARGET_WEIGHT, VERA_BUFFER_NAMES
from zeroplan.specs.finetune import BaseDtype, Quantization, fused_modules
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
def nf4_tensor_bytes(numel: int, block: int, double_quant: bool, second_level_bytes: int) -> int:
    """Bytes of one weight of ``numel`` elements in nf4: codes, scales and second-level constants
    (the per-tensor constants apart: nf4_layout)."""
    codes, scales = nf4_codes_and_scales(numel, block, double_quant, second_level_bytes)
    return codes + scales


def nf4_codes_and_scales(numel: int, block: int, double_quant: bool, second_level_bytes: int) -> tuple[int, int]:
    codes = ceil_div(numel, 2)
    scales = ceil_div(numel, block)
    if not double_quant:
        return codes, 4 * scales
    return codes, scales + second_level_bytes * ceil_div(scales, NF4_DOUBLE_QUANT_BLOCK)


# How each library lays one nf4 weight out, measured (benchmarks/framework-parameter-records):
# - torchao 0.14.1 dtypes/nf4tensor.py NF4Tensor (torchtune's QLoRA) is the parameter itself:
#   its codes, int8 scalers and quantization_factor (in the weight's dtype, bf16) are what FSDP2
#   shards and gathers (its fsdp_pre_all_gather); every shard keeps the 16-entry nf4 code and
#   the scalers' mean, 17 values of the weight's dtype.
# - bitsandbytes 0.50.2 (transformers' QLoRA: Linear4bit) stores only the packed codes as the
#   Params4bit parameter (in bnb_4bit_quant_storage, which FSDP shards and gathers); the
#   QuantState beside it is a plain attribute every rank keeps whole: the uint8 absmax per block,
#   with double quantization its fp32 absmax per 256 (state2.absmax), a 256-entry fp32 nested
#   code and an fp32 offset, and the 16-entry fp32 nf4 code (1,092 bytes of constants per weight;
#   without double quantization the fp32 absmax per block and the 64-byte code).
BNB_CONSTANT_BYTES = {True: 4 * 16 + 4 * 256 + 4, False: 4 * 16}
"""bitsandbytes QuantState constants per weight, by double quantization: code, state2.code, offset."""


# LLM.int8 (Dettmers et al. 2022, sec. 3.1 vector-wise quantization) as bitsandbytes 0.50.2 stores
# a weight (nn/modules.py Int8Params._quantize, functional.py int8_vectorwise_quant): one int8 code
# per element, the parameter's data, and SCB, the fp32 absmax of each output row, an attribute
# beside it (measured: benchmarks/framework-parameter-records, hf int8).
def int8_layout(tensor: ParamTensor) -> tuple[int, int]:
    """(bytes of the int8 codes, bytes of the fp32 row scales) of one int8 weight."""
    return tensor.numel, 4 * tensor.shape[0]


# auto-gptq 0.4.2 nn_modules/qlinear/qlinear_cuda_old.py QuantLinear.__init__ (lines 47-67), the
# module transformers' GPTQConfig(bits=4, disable_exllama=True) builds for a checkpoint with
# desc_act false (utils/import_utils.py:41-45), registers as buffers: qweight, int32 of shape
# (in // 32 * bits, out), eight 4-bit codes a word; qzeros, int32 (ceil(in / group_size),
# out // 32 * bits), eight 4-bit zero points a word; scales, fp16 (ceil(in / group_size), out);
# g_idx, int32 (in,); and an fp16 bias (out,) where the linear has one (the model's frozen bias,
# counted with the other frozen tensors). Nothing is a parameter, so no engine shards it.
GPTQ_BITS = 4


def gptq_layout(request: PlanRequest, tensor: ParamTensor) -> tuple[int, int]:
    """(qweight bytes, qzeros + scales + g_idx bytes) of one gptq-int4 weight (out x in). A fused
    module (Qwen-1's c_attn: zeroplan.specs.finetune.linear_modules) is one QuantLinear: its one
    g_idx is counted with its first projection."""
    out_features, in_features = tensor.shape
    group = request.training.finetune.gptq_group_size
    words_per_row = 32 // GPTQ_BITS
    qweight = 4 * (in_features // 32 * GPTQ_BITS) * out_features
    groups = ceil_div(in_features, group)
    qzeros = 4 * groups * (out_features // words_per_row)
    scales = 2 * groups * out_features
    g_idx = 4 * in_features if _first_of_its_module(request, tensor) else 0
    return qweight, qzeros + scales + g_idx


def _first_of_its_module(request: PlanRequest, tensor: ParamTensor) -> bool:
    for module in fused_modules(request.model, request.training.framework):
        names = [TARGET_WEIGHT[t] for t in module]
        if tensor.name in names:
            return tensor.name == names[0]
    return True


def quantized_layout(request: PlanRequest, tensor: ParamTensor) -> tuple[int, int]:
    """(bytes sharded with the parameter, bytes every shard keeps whole) of one quantized weight."""
    if request.training.finetune.quantize is Quantization.int8:
        return int8_layout(tensor)
    if request.training.finetune.quantize is Quantization.gptq_int4:
        return gptq_layout(request, tensor)
    return nf4_layout(request, tensor)


def nf4_layout(request: PlanRequest, tensor: ParamTensor) -> tuple[int, int]:
    """(bytes sharded with the parameter, bytes every shard keeps whole) of one nf4 weight."""
    finetune = request.training.finetune
    if request.training.framework is Framework.torchtune:
        e = request.training.precision.compute_bytes
        return nf4_tensor_bytes(tensor.numel, finetune.quant_block_size, finetune.double_quant, e), 17 * e
    codes, scales = nf4_codes_and_scales(tensor.numel, finetune.quant_block_size, finetune.double_quant, 4)
    return codes, scales + BNB_CONSTANT_BYTES[finetune.double_quant]


def hf_runs_fsdp1(request: PlanRequest) -> bool:
    """hf under accelerate's FSDP1 (fsdp_version 1: StrategySpec.fsdp1_root_stays_gathered)."""
    return request.training.framework is Framework.hf and request.strategy.fsdp1_root_stays_gathered


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
    if finetune.hf_casts_rest_to_fp32(request.training.framework):
        # peft 0.17.1 utils/other.py prepare_model_for_kbit_training, which transformers' QLoRA
        # recipe calls, casts every parameter that is not 4- or 8-bit (embeddings, head, norms) to
        # fp32 (measured: benchmarks/framework-parameter-records, hf QLoRA).
        return 4
    if (request.training.framework is Framework.hf and request.strategy.kind.is_fsdp and request.training.precision.is_mixed
            and not hf_runs_fsdp1(request)):
        # accelerate 1.10.1 fsdp2_prepare_model (zeroplan/frameworks/build.py _hf_fsdp2): with
        # mixed precision it calls model.to(torch.float32) after fully_shard, frozen base
        # included (measured: benchmarks/framework-step-records, hf LoRA, 4 bytes per element).
        return 4
    # accelerate 1.10.1 accelerator.py lines 1916-1956 (fsdp_version 1) upcasts to fp32 only a
    # flat parameter that requires grad: with use_orig_params a unit of frozen weights keeps the
    # dtype they were loaded in (measured: benchmarks/framework-fsdp1-step-records, hf LoRA, the
    # sharded base 2 bytes per element).
    return 4 if finetune.base_dtype is BaseDtype.fp32 else eb.compute_parameter


# peft 51c2ff6 tuners/tuners_utils.py:2243-2288 cast_adapter_dtype (get_peft_model's
# autocast_adapter_dtype=True, the MetaMathQA harness's default) upcasts every bf16 or fp16
# tensor of a tuner layer's ParameterDicts and BufferDicts to fp32, frozen ones included:
# LoRA-FA's lora_A (frozen after the cast by create_lorafa_optimizer) and VeRA's shared vera_A and
# vera_B (tuners_utils.py:1732-1770 first moves them to the base layer's device and dtype, then
# the cast replaces the one shared entry once). Measured: tests/test_peft_variants.py.
def frozen_adapter_tensor(tensor: ParamTensor) -> bool:
    """Whether ``tensor`` is a frozen part of an adapter (LoRA-FA's lora_a, VeRA's buffers)."""
    return tensor.name in VERA_BUFFER_NAMES or tensor.name.endswith(".lora_a.weight")


FROZEN_ADAPTER_ELEMENT_BYTES = 4
"""Bytes per element of a frozen adapter tensor under PEFT (fp32: frozen_adapter_tensor)."""


def frozen_tensor_bytes(request: PlanRequest, tensor: ParamTensor, gathered: bool = False) -> int:
    """Bytes of one frozen tensor's sharded part, whole (quantized_layout keeps the rest apart), as
    stored, or as an all-gather brings it in (``gathered``: FSDP2 casts a parameter to its
    MixedPrecisionPolicy's param_dtype before gathering, DeepSpeed's module is 16-bit already;
    a quantized weight is gathered as it is stored)."""
    if tensor.quantized:
        return quantized_layout(request, tensor)[0]
    if frozen_adapter_tensor(tensor):
        # Planned under hf's plain DDP only (zeroplan.specs.finetune.check_adapter_variant_training).
        return tensor.numel * FROZEN_ADAPTER_ELEMENT_BYTES
    if gathered:
        return tensor.numel * element_bytes(request.training.precision, request.convention).compute_parameter
    return tensor.numel * frozen_element_bytes(request)


def frozen_held_bytes(request: PlanRequest, units: tuple[ParamUnit, ...], num_shards: int) -> int:
    """Frozen bytes one rank holds when each unit is split ``num_shards`` ways (1: whole)."""
    total = 0
    for unit in units:
        for t in unit.tensors:
            if t.trainable:
                continue
            total += ceil_div(frozen_tensor_bytes(request, t), num_shards)
            if t.quantized:
                total += quantized_layout(request, t)[1]
    return total
