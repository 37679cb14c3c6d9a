"""flash-attn's fused cross-entropy as the reference model's loss (TrainingSpec.fused_cross_entropy):
what it holds at its largest moment, tensor by tensor. Read from flash-attn's source, not
measured: its kernels are Triton or CUDA and do not run on the CPU (docs/memory-model.md section 3,
"Logits and loss"). Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.specs.request import PlanRequest
from zeroplan.units import FP32_BYTES


# flash-attn 2.x flash_attn/ops/triton/cross_entropy.py CrossEntropyLoss: the forward reads the
# logits as given, in the compute dtype (no fp32 copy), writes fp32 losses, lse and z_losses of
# one element per row, and saves (logits, lse, labels); its backward allocates
# dlogits = torch.empty_like(logits). The CUDA extension of the 1.0 releases holds the same
# (csrc/xentropy/xentropy_kernel.cu: fp32 losses and max_log_sum_exp per row from bf16 or fp16
# logits, and host_softmax_xentropy_backward's gI = inplace ? logits : at::empty_like(logits)).
# The gradient is written in place only with inplace_backward=True, which
# flash_attn.losses.cross_entropy.CrossEntropyLoss leaves False and llm-foundry's
# ComposerMPTCausalLM (llmfoundry/models/mpt/modeling_mpt.py, loss_fn 'fused_crossentropy' by
# default) does not set. So the loss's backward holds the saved logits, the per-row lse and the
# logits' gradient at once, which is larger than its forward (logits and three per-row fp32
# vectors). The labels are left out, as the reference loss leaves out its own.
def fused_cross_entropy_parts(request: PlanRequest) -> tuple[int, int, int]:
    """The loss's backward moment: (saved logits, fp32 log-sum-exp per row, logits' gradient)."""
    rows = request.batch.seq_len * request.batch.micro_batch_size
    logits = request.training.precision.compute_bytes * rows * request.model.vocab_size
    return logits, FP32_BYTES * rows, logits


def fused_cross_entropy_bytes(request: PlanRequest) -> int:
    """The fused loss's largest moment (affine in the micro-batch, as the plan search needs)."""
    return sum(fused_cross_entropy_parts(request))
