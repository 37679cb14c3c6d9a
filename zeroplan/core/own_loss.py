"""The loss of a model whose own modeling code computes nn.CrossEntropyLoss on lm_head's output in
the compute dtype, with no fp32 upcast (ModelSpec.own_loss_in_compute_dtype), as Hugging Face's
Trainer runs it (docs/memory-model.md, "Batches of varying length"). Nothing here imports torch.

Qwen-1's modeling_qwen.py (trust_remote_code; QWenLMHeadModel.forward, the same in every
release of Qwen-1_8B to 72B, e.g. the mirror undefdev/Qwen-7B-Chat@04df5dd): ``lm_logits =
self.lm_head(hidden_states)`` in the module's dtype (``self.lm_head.bfloat16()`` under
``config.bf16``, which ms-swift sets from its dtype: swift/llm/utils/model.py
get_model_tokenizer_qwen at 4312aeb), ``shift_logits = lm_logits[..., :-1, :].contiguous()`` and
``CrossEntropyLoss()(shift_logits.view(-1, V), ...)``; no ``.float()``.

HF's Trainer with ``bf16=True`` (ms-swift's sft.py passes ``bf16=args.bf16``, True for a bf16
dtype) runs the forward under accelerate's ``torch.autocast`` and converts its 16-bit outputs to
fp32 (``convert_outputs_to_fp32``, accelerate ``prepare_model``). Under CUDA autocast, torch 2.1's
``cross_entropy_loss`` has no autocast kernel of its own; its composite calls
``at::log_softmax(self, class_dim, self.scalar_type())`` (aten/src/ATen/native/LossNLL.cpp
cross_entropy_loss_symint), and autocast's ``fp32_set_opt_dtype`` policy for log_softmax keeps an
explicit dtype (autocast_mode.h set_opt_dtype: "If the user has explicitly specified a dtype,
respect it"), so the log-probabilities stay bf16. ``nll_loss`` is on autocast's fp32 list
(autocast_mode.cpp ``KERNEL_CUDA(nll_loss, fp32)``): it casts them to an fp32 copy, which its
backward node keeps (NllLossBackward0 saves ``self``; LogSoftmaxBackward0 its bf16 result).
So two fp32 tensors of the shifted rows' size are ever alive at once (that copy with
accelerate's fp32 outputs, or with nll_loss_backward's fp32 gradient), where the reference
model's upcast loss holds three (zeroplan.core.activations.logits_parts).
"""

from __future__ import annotations

from zeroplan.core.deepspeed_accumulation import runs_deepspeed_engine
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import TrainingSpec
from zeroplan.units import FP32_BYTES


def runs_own_loss(model: ModelSpec, training: TrainingSpec) -> bool:
    """Whether the model's own compute-dtype loss runs: its flag, under framework hf (the other
    frameworks run their own model code)."""
    return model.own_loss_in_compute_dtype and training.framework is Framework.hf


# accelerate v0.21.0 src/accelerate/accelerator.py:408-437 sets native_amp, the flag under which
# prepare_model wraps the forward in torch.autocast and convert_outputs_to_fp32 (:1294-1309), for
# fp16 and bf16 only where distributed_type is not DEEPSPEED (transformers' Trainer before its
# accelerate backend skipped its own autocast alike: "deepspeed manages its own half precision").
# DeepSpeed's engine casts the module to 16 bits instead (zeroplan.core.uncast_loss), so the own
# loss runs as lm_head's dtype gives it: the compute-dtype ops of OPT's own loss before 4.49
# (zeroplan.core.transformers_release.opt_loss_tensors), with no fp32 copy and no fp32 outputs.
def loss_under_trainer_autocast(request: PlanRequest) -> bool:
    """Whether HF's Trainer runs the forward, and so the own loss, under accelerate's autocast:
    every strategy but DeepSpeed's engine."""
    return not runs_deepspeed_engine(request)


# The module doc's order, e the compute dtype's bytes, V the vocabulary, rows b x s (the head's
# output) and b x (s - 1) (the shifted copy and what the loss makes of it), as three moments:
# the loss's forward (the logits, their shifted copy, the bf16 log-probabilities and nll_loss's
# fp32 copy of them); accelerate's fp32 copy of the logits, made once the forward has returned and
# the shifted copy is gone, beside the bf16 logits it copies (the largest: e + e + 4 + 4 bytes a
# logit), and gone when the Trainer's compute_loss returns; the backward's first, nll_loss_backward's
# dense fp32 gradient beside the two saved tensors (the cast's and the log-softmax's bf16 gradients
# that follow are smaller). As moments the schedule allocates afresh, the second finds the first's
# segments for all but the fp32 copy of b x s rows, as the source order does. In an fp32 module
# nothing is cast: the reference loss's three tensors, in fp32.
def own_loss_tensors(model: ModelSpec, training: TrainingSpec, s: int, b: int) -> tuple[tuple[int, ...], ...]:
    """The loss's moments, the tensors each holds: its forward, accelerate's fp32 outputs, its backward."""
    e = training.precision.compute_bytes
    logits = b * s * model.vocab_size
    shifted = b * (s - 1) * model.vocab_size
    if e >= FP32_BYTES:
        return (FP32_BYTES * logits, FP32_BYTES * shifted, FP32_BYTES * shifted), (FP32_BYTES * shifted,) * 3
    forward = (e * logits, e * shifted, e * shifted, FP32_BYTES * shifted)
    outputs = (e * logits, e * shifted, FP32_BYTES * shifted, FP32_BYTES * logits)
    backward = (e * shifted, FP32_BYTES * shifted, FP32_BYTES * shifted)
    return forward, outputs, backward
