"""DeepSpeed's FP16_Optimizer at ZeRO stage 0: what a script that hands deepspeed.initialize its
own FusedAdam runs (DeepSpeed-Chat's main.py: ``AdamOptimizer = DeepSpeedCPUAdam if args.offload
else FusedAdam``, step2_reward_model_finetuning/main.py:276-279 at 3a77097, step2_dpo_finetuning
at 1842b4f alike), where zeroplan.core.deepspeed_stage0 plans FP16_UnfusedOptimizer.

runtime/engine.py _configure_fp16_optimizer wraps a fused optimizer in runtime/fp16/
fused_optimizer.py FP16_Optimizer (the logs print ``DeepSpeed Final Optimizer = FP16_Optimizer``).
Its __init__ (v0.9.0 :60-73, v0.16.2 alike) moves each parameter group's fp16 parameters into one
flat buffer and clones it to one flat fp32 master: the same bytes as the unfused wrapper's
(parameters Psi 2, master Psi 4, AdamW Psi 8). Its step differs (v0.9.0 :255-268, v0.16.2
:282-310): per group, ``_flatten_dense_tensors([p.grad.to(float32) for p in group])`` builds every
gradient's fp32 copy as a list, then their flat concatenation, while every group's fp16 gradients
are still held; the group's fp16 gradients go only after. The first group is the largest moment:
DeepSpeed-Chat's utils.py get_optimizer_grouped_parameters puts the weight-decayed tensors first
(every tensor but the biases and the norms' weights, which share the last, no-decay group).
"""

from __future__ import annotations

from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.core.deepspeed_stage0 import runs_deepspeed_stage0
from zeroplan.errors import ZeroplanError
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import Precision
from zeroplan.units import FP32_BYTES


def runs_fused_fp16_optimizer(request: PlanRequest) -> bool:
    """Whether DeepSpeed's stage 0 wraps a client FusedAdam in FP16_Optimizer (--deepspeed-fused-adam)."""
    return request.training.deepspeed_fused_adam and runs_deepspeed_stage0(request)


def check_fused_fp16_optimizer(request: PlanRequest) -> None:
    """Refuse, in one line, what the fused wrapper is not planned with. Under a ZeRO stage the ZeRO
    optimizer wraps the client optimizer itself (its bytes as planned): the flag changes nothing."""
    if not runs_fused_fp16_optimizer(request):
        return
    if request.training.precision is not Precision.fp16_mixed:
        raise ZeroplanError("deepspeed_fused_adam", f"FP16_Optimizer is planned under fp16 at stage 0, not "
                            f"{request.training.precision.value} (allowed: fp16-mixed)")
    if request.training.finetune.is_lora:
        raise ZeroplanError("deepspeed_fused_adam", "is planned for a full fine-tune (allowed: no LoRA)")


# DeepSpeed-Chat utils.py get_optimizer_grouped_parameters (1842b4f: no_decay_name_list "bias",
# "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight"): the first group is every
# trainable matrix (embeddings and linears), the one-dimensional biases and norm weights the last.
def first_group_elements(request: PlanRequest) -> int:
    """Elements of the first (weight-decayed) parameter group: every tensor of two or more dimensions."""
    return sum(t.numel for unit in rank_trainable_units(request) for t in unit.tensors if t.trainable and len(t.shape) > 1)


# fused_optimizer.py step (module docstring): at the first group's flatten, every fp16 gradient
# (Psi 2), the group's fp32 copies and their flat concatenation (G 4 each). The planner's step
# holds the fp16 gradients beside every group's flat fp32 gradient (Psi 4, as the unfused
# wrapper's fp32 copies: zeroplan.core.deepspeed_stage0.step_gradient_bytes) and the copies
# below as its temporary: the later groups' flats (4 bytes an element of the biases and norm
# weights) are counted at that moment though not yet made. FusedAdam's multi-tensor step makes
# no temporary of its own.
def step_temporary_bytes(request: PlanRequest) -> int:
    """The first group's fp32 gradient copies, alive while their flat concatenation is made."""
    return FP32_BYTES * first_group_elements(request)
