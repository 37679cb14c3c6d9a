"""What a transformers GELU MLP's activation keeps for backward beyond F.gelu's one saved input,
where the hf profile runs transformers' own modules (ModelSpec.gelu_form). Read from
transformers' and torch's sources (each on the line above its function) and measured on
transformers' ACT2FN modules and PhiDecoderLayer on the CPU (tests/test_hf_activation.py).
Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.specs.framework import Framework
from zeroplan.specs.model import GeluForm, MlpKind, ModelSpec
from zeroplan.specs.training import Kernels, TrainingSpec
from zeroplan.units import FP32_BYTES


# transformers 4.56.2 activations.py (ACT2CLS, lines 284-290): GELUActivation (``gelu``) and PytorchGELUTanh
# (``gelu_pytorch_tanh``) call F.gelu, whose backward keeps its input alone (torch
# tools/autograd/derivatives.yaml, gelu: self), what zeroplan.core.activations.mlp_terms counts.
# The others are spelled out in Python, and autograd keeps each op's operands:
#  - NewGELUActivation (``gelu_new``, line 48) and AccurateGELUActivation (``gelu_accurate``,
#    line 129) compute
#    0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3)))): pow keeps x, tanh its result, and the
#    last product both factors, 0.5 * x and 1 + tanh(...): four tensors the size of x.
#  - ``gelu_python`` (GELUActivation._gelu_python, line 67): x * 0.5 * (1 + erf(x / sqrt(2))): erf keeps
#    x / sqrt(2), the product x * 0.5 and 1 + erf(...): three, none of them x itself.
#  - FastGELUActivation (``gelu_fast``, line 79): 0.5 * x * (1 + tanh(x * 0.7978845608 * (1 +
#    0.044715 * x * x))): (0.044715 * x) * x keeps both factors, x among them, the inner product
#    x * 0.7978845608 and 1 + 0.044715 x^2, tanh its result, the outer product 0.5 * x and
#    1 + tanh(...): seven tensors.
# Under CUDA autocast (torch 2.13 aten/src/ATen/autocast_mode.h AT_FORALL_FP32: pow's three
# overloads; tanh, erf and the arithmetic are not listed, so they follow type promotion) pow
# casts x to fp32 and keeps that copy, and everything computed from its result is fp32: in
# gelu_new and gelu_accurate x's copy, tanh's result and 1 + tanh are fp32, 0.5 * x stays in the
# compute dtype. torch's CPU autocast leaves pow in the compute dtype (measured).
def gelu_saved_bytes_per_element(form: GeluForm, compute_bytes: int, *, fp32_pow: bool) -> int:
    """Bytes the activation keeps for backward per element of its input."""
    e = compute_bytes
    if form in (GeluForm.gelu, GeluForm.gelu_pytorch_tanh):
        return e
    if form in (GeluForm.gelu_new, GeluForm.gelu_accurate):
        wide = FP32_BYTES if fp32_pow else e
        return 3 * wide + e
    if form is GeluForm.gelu_python:
        return 3 * e
    return 7 * e  # GeluForm.gelu_fast


def gelu_extra_bytes(model: ModelSpec, training: TrainingSpec, s: int, b: int, *, autocast: bool = False) -> int:
    """Bytes one block's GELU keeps beyond F.gelu's input (what mlp_terms counts for it): 0 outside
    the hf profile, which alone runs transformers' activation modules."""
    if training.framework is not Framework.hf or model.mlp is not MlpKind.gelu or model.gelu_form is GeluForm.gelu:
        return 0
    e = training.precision.compute_bytes
    fp32_pow = autocast and training.kernels is Kernels.cuda and e < FP32_BYTES
    per_element = gelu_saved_bytes_per_element(model.gelu_form, e, fp32_pow=fp32_pow) - e
    return per_element * s * b * model.ffn_hidden_size
