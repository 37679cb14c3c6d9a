"""The loss of a loop that calls torch's nn.CrossEntropyLoss on the logits the model returns,
with no fp32 upcast of its own (TrainingSpec.uncast_loss; docs/memory-model.md section 3, "Logits
and loss"), as DeepSpeedExamples' training/bf16_master_weight train.py (@ac3800b) does:
``logits = model_engine(input_ids); loss = loss_fn(logits.view(-1, V), labels.view(-1))``.

torch 2.13 aten/src/ATen/native/LossNLL.cpp cross_entropy_loss_symint calls
``at::log_softmax(self, class_dim, self.scalar_type())``: the log-softmax is in the logits' own
dtype, and so are nll_loss_backward's gradient and _log_softmax_backward_data's (SoftMax.cpp
writes its grad_input in grad_output's dtype). DeepSpeed's bf16 engine casts the module itself
(engine.py _cast_module_mixed_precision) and runs no autocast unless ``torch_autocast`` is
enabled, so the three tensors are bf16 there. Under CUDA autocast (the reference model's DDP
autocast, DeepSpeed's torch_autocast) ``log_softmax`` is on AT_FORALL_FP32_SET_OPT_DTYPE and
``nll_loss`` on AT_FORALL_FP32 (aten/src/ATen/autocast_mode.h): fp32, as the upcast makes them.
Measured on DeepSpeed 0.19.8's own engine on gloo (benchmarks/deepspeed_bf16mw_step.py
--torch-linear --shape 254m --gpus 4 --record, benchmarks/deepspeed-bf16mw-records): at the
baseline's peak, _log_softmax, nll_loss_backward and _log_softmax_backward_data are one bf16
logits-sized tensor each.

This module does not import torch."""

from __future__ import annotations

from zeroplan.core.deepspeed_bf16_autocast import runs_bf16_autocast
from zeroplan.errors import ZeroplanError
from zeroplan.specs.request import PlanRequest
from zeroplan.units import FP32_BYTES


def loss_element_bytes(request: PlanRequest) -> int:
    """Bytes of one element of the loss's log-softmax and its two gradients: the logits' dtype
    under uncast_loss outside autocast, else fp32."""
    training = request.training
    if not training.uncast_loss or request.runs_under_autocast or runs_bf16_autocast(request):
        return FP32_BYTES
    return training.precision.compute_bytes


def uncast_logits_parts(request: PlanRequest) -> tuple[int, int, int]:
    """The loss's three tensors at its backward (the saved log-softmax, nll_loss_backward's
    gradient, _log_softmax_backward_data's), each of loss_element_bytes."""
    sbv = request.batch.seq_len * request.batch.micro_batch_size * request.model.vocab_size
    tensor = loss_element_bytes(request) * sbv
    return tensor, tensor, tensor


def check_uncast_loss(request: PlanRequest) -> None:
    """uncast_loss replaces the reference model's decoder loss: refused beside flash-attn's fused
    loss, which replaces it too, and for an encoder-decoder, whose loss is its own
    (zeroplan.core.encoder_decoder)."""
    if not request.training.uncast_loss:
        return
    if request.training.fused_cross_entropy:
        raise ZeroplanError("uncast_loss", "is torch's own cross-entropy, not flash-attn's fused one "
                            "(allowed: uncast_loss or fused_cross_entropy, not both)")
    if request.model.is_encoder_decoder:
        raise ZeroplanError("uncast_loss", "is planned for a decoder's loss, not an encoder-decoder's (allowed: false)")
