"""The time of DeepSpeed BF16_Optimizer's fp32 gradient accumulation (docs/communication-time.md,
"Compute"): under DeepSpeed's pipeline engine every micro-batch's backward is bracketed by the
optimizer's own gradient bookkeeping, which a plain autograd step does not run. Its bytes are
memory-bound passes over every parameter the rank holds, once per micro-batch, timed at the
GPU's copy bandwidth with the step's other memory-bound kernels (zeroplan.core.timing.
memory_bound_time_s), so inside the pipeline's busy time and its bubble. Paths are deepspeed/...
in DeepSpeed 0.19.8 (the planner's profile); Megatron-DeepSpeed's BLOOM runs used the same
bracket (runtime/pipe/engine.py _exec_backward_pass). Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.core.megatron_deepspeed import bf16_optimizer_runs
from zeroplan.core.parallel.units import rank_trainable_elements
from zeroplan.core.roofline.operations import Operation, OpPass, memory_pass
from zeroplan.errors import ZeroplanError
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import Precision
from zeroplan.units import BF16_BYTES, FP32_BYTES

# runtime/bf16_optimizer.py _update_hp_grad: hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype)):
# the cast reads the bf16 gradient and writes an fp32 copy (2 + 4), the add reads the fp32
# buffer and the copy and writes the buffer (4 + 4 + 4). Every micro-batch (update_hp_grads
# after each backward, runtime/pipe/engine.py _exec_backward_pass).
UPDATE_HP_GRAD_BYTES = BF16_BYTES + FP32_BYTES + 3 * FP32_BYTES

# runtime/pipe/engine.py _exec_backward_pass calls clear_lp_grads() before each backward:
# torch._foreach_zero_ writes the bf16 .grad (2) where it exists, i.e. after the first
# micro-batch (zero_grad(set_to_none=True) after the step leaves it None). A defined .grad makes
# autograd's AccumulateGrad add the new gradient in place (torch/csrc/autograd/functions/
# accumulate_grad.h: variable_grad += new_grad: read 2 + 2, write 2) instead of taking it as is.
ZEROED_GRAD_BYTES = BF16_BYTES + 3 * BF16_BYTES

# The BF16_Optimizer BigScience's 2022 runs used (deepspeed_release 2022-bigscience: the
# 'Rebalancing layers' runs' optimizer, 'just written', is microsoft/DeepSpeed@15293139f on
# branch olruwase/bf16-updates-2, 2022-02-28) clears the bf16 gradients by dropping them:
# runtime/bf16_optimizer.py:275-278 clear_lp_grads sets each param.grad = None, called before
# every backward (runtime/pipe/engine.py:749-751; the last stage through BF16_Optimizer.backward,
# :204-215), so nothing is zeroed and AccumulateGrad takes each new gradient as it is (no in-place
# add): ZEROED_GRAD_BYTES is not moved. 0.19.8's clear_lp_grads(set_to_none=False) zeroes them.
DROPS_LP_GRADS_RELEASES = ("2022-bigscience",)

# runtime/bf16_optimizer.py step ends with clear_hp_grads(): the unpartitioned fp32 gradient
# buffer zeroed (flat_gradients.zero_(), 4), once per step; the engine's zero_grad
# (set_to_none=True, runtime/engine.py _take_model_step) then drops the bf16 .grad.
CLEARED_HP_GRAD_BYTES = FP32_BYTES


def fp32_accumulation_runs(request: PlanRequest) -> bool:
    """Whether the step runs BF16_Optimizer's per-micro-batch fp32 accumulation: the request's
    PerformanceAssumptions.fp32_grad_accumulation where given (a stack that ran BF16_Optimizer
    under the reference transformer: BLOOM's Megatron-DeepSpeed rows), else where the
    megatron-deepspeed profile runs BF16_Optimizer (bf16_optimizer_runs)."""
    given = request.performance.fp32_grad_accumulation
    return bf16_optimizer_runs(request) if given is None else given


def check_fp32_accumulation(request: PlanRequest) -> None:
    """Refuse, in one line, fp32 gradient accumulation where BF16_Optimizer does not run it."""
    if not request.performance.fp32_grad_accumulation:
        return
    if request.training.precision is not Precision.bf16_mixed:
        raise ZeroplanError("performance.fp32_grad_accumulation", f"is DeepSpeed's BF16_Optimizer, timed under "
                            f"bf16-mixed, not {request.training.precision.value} (allowed: false)")
    if request.strategy.kind is not StrategyKind.zero1:
        raise ZeroplanError("performance.fp32_grad_accumulation", f"is DeepSpeed's BF16_Optimizer, timed under "
                            f"zero1, not {request.strategy.kind.value} (allowed: false)")


def bf16_accumulation_bytes(elements: int, micro_batches: int, drops_lp_grads: bool = False) -> int:
    """Bytes BF16_Optimizer moves over ``elements`` parameters in a step of ``micro_batches``
    (``drops_lp_grads``: a release whose clear_lp_grads sets the bf16 gradients to None)."""
    zeroed = 0 if drops_lp_grads else (micro_batches - 1) * ZEROED_GRAD_BYTES
    return elements * (micro_batches * UPDATE_HP_GRAD_BYTES + zeroed + CLEARED_HP_GRAD_BYTES)


def drops_lp_grads(request: PlanRequest) -> bool:
    """Whether the request's BF16_Optimizer drops the bf16 gradients before each backward
    instead of zeroing them (DROPS_LP_GRADS_RELEASES)."""
    return request.training.deepspeed_release in DROPS_LP_GRADS_RELEASES


def bf16_accumulation_operations(request: PlanRequest, micro_batches: int) -> list[Operation]:
    """The rank's BF16_Optimizer accumulation passes in a step (none where it does not run)."""
    if not fp32_accumulation_runs(request):
        return []
    moved = bf16_accumulation_bytes(rank_trainable_elements(request), micro_batches, drops_lp_grads(request))
    return [memory_pass("bf16 optimizer fp32 gradient accumulation", OpPass.backward, moved, 1)]
