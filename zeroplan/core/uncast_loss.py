"""The loss of a loop that calls torch's nn.CrossEntropyLoss on the logits the model returns,
with no fp32 upcast of its own (TrainingSpec.uncast_loss; docs/memory-model.md section 3, "Logits
and loss"), as DeepSpeedExamples' training/bf16_master_weight train.py (@ac3800b) does:
``logits = model_engine(input_ids); loss = loss_fn(logits.view(-1, V), labels.view(-1))``.

torch 2.13 aten/src/ATen/native/LossNLL.cpp cross_entropy_loss_symint calls
``at::log_softmax(self, class_dim, self.scalar_type())``: the log-softmax is in the logits' own
dtype, and so are nll_loss_backward's gradient and _log_softmax_backward_data's (SoftMax.cpp
writes its grad_input in grad_output's dtype). DeepSpeed's bf16 engine casts the module itself
(engine.py _cast_module_mixed_precision) and runs no autocast unless ``torch_autocast`` is
enabled, so the three tensors are bf16 there. Measured on DeepSpeed 0.19.8's own engine on gloo
(benchmarks/deepspeed_bf16mw_step.py --torch-linear --shape 254m --gpus 4 --record,
benchmarks/deepspeed-bf16mw-records): at the baseline's peak, _log_softmax, nll_loss_backward and
_log_softmax_backward_data are one bf16 logits-sized tensor each.

Under CUDA autocast (the reference model's DDP autocast; DeepSpeed's torch_autocast, inside which
train.py also takes its loss) the cast is not the CPU's. cross_entropy_loss has no AutocastCUDA
kernel (torch 2.13's dispatcher lists AutocastCPU alone for it: autocast_mode.cpp
TORCH_LIBRARY_IMPL(aten, AutocastCPU) ``KERNEL_CPU(cross_entropy_loss, fp32)``; the CUDA lists,
autocast_mode.h AT_FORALL_FP32 and AT_FORALL_FP32_SET_OPT_DTYPE, hold no cross_entropy_loss, as
torch 2.1's KERNEL_CUDA lines do not), so its composite runs: ``log_softmax`` is on
AT_FORALL_FP32_SET_OPT_DTYPE, whose wrapper passes ``set_opt_dtype(at::kFloat, dtype)``, which
keeps the explicit dtype cross_entropy_loss gives it ("If the user has explicitly specified a
dtype, respect it"): the log-probabilities stay 16-bit. ``nll_loss`` is on AT_FORALL_FP32:
cached_cast makes an fp32 copy of them, which NllLossBackward0 saves (derivatives.yaml
nll_loss_forward: ``self``) beside LogSoftmaxBackward0's 16-bit result. The backward's first
moment is nll_loss_backward's dense fp32 gradient beside those two: e + 4 + 4 bytes a logit, not
the upcast's 12; the fp32 copy goes when that node has run (engine.cpp release_variables), before
the 16-bit gradients (ToCopyBackward0's cast, _log_softmax_backward_data's) are made. The gloo
record's fp32 tensors are CPU autocast's order: its list casts cross_entropy_loss to fp32 as a
whole. Reproduced on the CPU with the ops CUDA's dispatch makes of it
(benchmarks/cuda_autocast_loss_tensors.py): saved, the bf16 log-softmax and the fp32 copy; at
the backward's peak, the copy, nll_loss_backward's fp32 gradient and the bf16 log-softmax, 2.5
fp32 logit blocks where CPU autocast's order holds 3.

This module does not import torch."""

from __future__ import annotations

from zeroplan.core.deepspeed_bf16_autocast import runs_bf16_autocast
from zeroplan.errors import ZeroplanError
from zeroplan.specs.request import PlanRequest
from zeroplan.units import FP32_BYTES


def loss_element_bytes(request: PlanRequest) -> int:
    """Bytes of one element of the loss's log-softmax: the logits' dtype under uncast_loss, with
    or without CUDA autocast (which keeps cross_entropy_loss's explicit dtype), else fp32."""
    training = request.training
    return training.precision.compute_bytes if training.uncast_loss else FP32_BYTES


def runs_cuda_autocast(request: PlanRequest) -> bool:
    """Whether the uncast loss runs under CUDA autocast: DDP's with fp32 parameters, or
    DeepSpeed's torch_autocast."""
    return request.runs_under_autocast or runs_bf16_autocast(request)


def uncast_logits_parts(request: PlanRequest) -> tuple[int, int, int]:
    """The loss's three tensors at its backward's first moment, in the order they are made: the
    saved log-softmax (the logits' dtype); then, outside autocast, nll_loss_backward's gradient and
    _log_softmax_backward_data's, in that dtype too; under CUDA autocast nll_loss's saved fp32 copy
    of the log-softmax and nll_loss_backward's fp32 gradient (module doc)."""
    sbv = request.batch.seq_len * request.batch.micro_batch_size * request.model.vocab_size
    log_softmax = loss_element_bytes(request) * sbv
    if runs_cuda_autocast(request) and log_softmax != FP32_BYTES * sbv:
        return log_softmax, FP32_BYTES * sbv, FP32_BYTES * sbv
    return log_softmax, log_softmax, log_softmax


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
