"""The dtype peft leaves LoRA adapters in over an unquantized base, by release, and what follows
from it under the hf profile's plain DDP (one GPU or several, nothing casting the module): the
bytes of the trainable adapters, their gradients and optimizer states, and whether each adapter
casts its input (zeroplan.core.finetune.activations)."""

from __future__ import annotations

from zeroplan.core.layout import ElementBytes
from zeroplan.specs.finetune import PEFT_ADAPTERS_FOLLOW_BASE, PEFT_UPCASTS_ADAPTERS, BaseDtype, version_tuple
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import Precision, StateConvention, TrainingSpec
from zeroplan.units import FP32_BYTES


def adapters_follow_base(training: TrainingSpec) -> bool:
    """Whether the training's peft release leaves the adapters in the base's floating dtype
    (0.7.0 to 0.11.1: zeroplan.specs.finetune.PEFT_ADAPTERS_FOLLOW_BASE)."""
    return PEFT_ADAPTERS_FOLLOW_BASE <= version_tuple(training.finetune.peft_version) < PEFT_UPCASTS_ADAPTERS


# peft 0.4.0 tuners/lora.py:691 and 0.5.0:158 (update_layer: self.to(self.weight.device)), 0.6.0
# tuners/lora/layer.py:79-86 (update_layer runs before _replace_module hands Linear the base
# weight, and model.py _replace_module moves the adapter to the weight's device only): nn.Linear's
# fp32 adapters whatever the base's dtype. 0.7.0 layer.py:96-100 through 0.11.1 layer.py:129:
# self.to(weight.device, dtype=weight.dtype) with the base layer's floating weight, the base's
# dtype. 0.12.0 peft_model.py:159 -> tuners/tuners_utils.py:316-356 _cast_adapter_dtype (get_peft_model's
# autocast_adapter_dtype=True; 0.17.1 tuners_utils.py, 0.20.0 tuners_utils.py:590 the same):
# fp16 and bf16 adapter tensors upcast to fp32 (measured on peft 0.17.1's own modules:
# tests/test_peft_adapter_dtype.py). An fp32 base (base_dtype fp32, or fp32 training) gives fp32
# in every release.
def peft_adapter_element_bytes(request: PlanRequest) -> int:
    """Bytes per element of peft's adapter weights as get_peft_model leaves them over an
    unquantized base (before any engine casts the module)."""
    return training_adapter_element_bytes(request.training)


def training_adapter_element_bytes(training: TrainingSpec) -> int:
    """peft_adapter_element_bytes of a training spec (the report's header reads it)."""
    if training.precision is Precision.fp32 or training.finetune.base_dtype is BaseDtype.fp32:
        return FP32_BYTES
    return training.precision.compute_bytes if adapters_follow_base(training) else FP32_BYTES


def peft_plain_ddp(request: PlanRequest) -> bool:
    """Whether hf's LoRA over an unquantized base runs under plain DDP (or one GPU) outside
    DeepSpeed's engine, so that nothing casts the adapters away from peft's dtype: no engine
    cast, no FSDP MixedPrecisionPolicy; under bf16-mixed the Trainer's autocast casts per matmul."""
    training = request.training
    return (training.framework is Framework.hf and training.finetune.is_lora and not training.finetune.quantize.is_quantized
            and request.strategy.kind is StrategyKind.ddp and request.convention is not StateConvention.deepspeed
            and training.precision is not Precision.fp32)


# torch 2.13 torch/optim/adamw.py (adam.py _init_group: exp_avg and exp_avg_sq are
# torch.zeros_like(p, memory_format=torch.preserve_format)) keeps each moment in its parameter's
# dtype; autograd's AccumulateGrad makes the gradient in the parameter's dtype; the Trainer's
# DDP path and the MetaMathQA loop step the adapters themselves, so no master copy is made. Under
# plain DDP every trainable parameter is one of peft's adapters (modules_to_save copies apart:
# zeroplan.core.finetune.modules_to_save), so the trainable states are the adapters' dtype.
def trainable_element_bytes(request: PlanRequest, eb: ElementBytes) -> ElementBytes:
    """``eb`` (the precision's bytes) with the trainable states in peft's adapter dtype where
    nothing casts the adapters (peft_plain_ddp); ``eb`` itself elsewhere."""
    if not peft_plain_ddp(request):
        return eb
    a = peft_adapter_element_bytes(request)
    return ElementBytes(parameter=a, gradient=a, master=0, optimizer_dtype=a, compute_parameter=eb.compute_parameter)


# peft's LoRA Linear.forward casts the input to lora_A's dtype before each adapter (0.4.0
# tuners/lora.py:819 and 0.5.0:904 ``x = x.to(self.lora_A[...].weight.dtype)``; 0.6.0
# tuners/lora/layer.py:316, 0.11.0:566, 0.14.0:618 ``x = x.to(lora_A.weight.dtype)``; from 0.15.0
# layer.py:724 ``self._cast_input_dtype(x, lora_A.weight.dtype)``, which 0.17.1
# tuners_utils.py:1115-1130 and 0.20.0 tuners_utils.py:1777 skip where the dtypes already agree).
# Over a bf16 base, adapters of another dtype (fp32: peft_adapter_element_bytes) each make their own
# copy of the shared input; adapters in the base's dtype (0.7.0-0.11.1) multiply it as it is.
def adapters_cast_their_input(request: PlanRequest) -> bool:
    """Whether peft's adapters under plain DDP cast the block's input, each to its own copy (or,
    over an fp32 input, autocast casts it for lora_A's matmul: every release)."""
    return peft_adapter_element_bytes(request) == FP32_BYTES


# Without autocast (bf16-pure: the MetaMathQA loop's use_amp False) lora_A multiplies the cast
# input in the adapters' dtype and returns its r-wide product in it, which lora_B keeps; under
# the Trainer's autocast (bf16-mixed) both are the compute dtype's.
def peft_matmul_bytes(request: PlanRequest) -> int:
    """Bytes per element of what lora_A keeps of its input and of its r-wide output, under plain DDP."""
    training = request.training
    if training.precision.is_mixed:
        return training.precision.compute_bytes
    return peft_adapter_element_bytes(request)
