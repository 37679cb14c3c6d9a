"""What a torch release before 2.0 changes in a training step (TrainingSpec.torch_release;
docs/memory-model.md, "torch releases"). zeroplan plans torch 2.13 otherwise; two defaults that
changed in 2.0 decide the allocated peak of a loop that leaves them at their default, and the
foreach Adam/AdamW step of releases before 2.1 holds one more temporary; only those are
modelled here. Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.errors import ZeroplanError
from zeroplan.specs.finetune import check_release_range, version_tuple
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import TrainingSpec

TORCH_VERSION = "2.13"
"""The release zeroplan's formulas and measurements follow (None in TrainingSpec.torch_release)."""
TORCH_OLDEST = (1, 7)
"""torch 1.7 added the set_to_none argument to Optimizer.zero_grad and Module.zero_grad (default
False); the first release whose zero_grad the input describes."""
TORCH_NEWEST = (2, 13)

SET_TO_NONE_DEFAULT_FROM = (2, 0, 0)
"""torch 2.0.0 (pytorch/pytorch PR 92731) changed Optimizer.zero_grad's and Module.zero_grad's
default from set_to_none=False to True. Before it a loop calling ``optimizer.zero_grad()`` or
``model.zero_grad()`` (transformers' Trainer: ``model.zero_grad()``, 4.56.2 trainer.py:2575 and
2750; peft's 2022 example scripts: ``optimizer.zero_grad()``) took the set_to_none=False branch,
which torch 2.13 still has
(optim/optimizer.py Optimizer.zero_grad, nn/modules/module.py Module.zero_grad: ``detach_()`` or
``requires_grad_(False)`` on each .grad, then ``zero_()``): the gradients the first backward made
stay allocated through every later forward, and each backward accumulates into them."""

FOREACH_DEFAULT_FROM = (2, 0, 0)
"""torch 1.13 torch/optim/adamw.py and adam.py adamw()/adam(): ``if foreach is None: # Placeholder
for more complex foreach logic to be added when value is not set; foreach = False``: the
per-tensor loop unless the caller asks. torch 2.0 (torch/optim/optimizer.py
_default_to_fused_or_foreach) picks foreach for CUDA tensors."""


FOREACH_ADAM_IN_PLACE_FROM = (2, 1, 0)
"""torch 2.0.1 torch/optim/adamw.py:564-568 (_multi_tensor_adamw, capturable False; adam.py:505-507
_multi_tensor_adam alike): ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)``, then
``denom = torch._foreach_add(exp_avg_sq_sqrt, eps)``, out of place, and
``torch._foreach_addcdiv_(device_params, device_exp_avgs, denom, step_size)`` with
``exp_avg_sq_sqrt`` still bound: two state-sized temporaries alive at once. torch 2.1.0
adamw.py:576-580 (adam.py:568) adds eps in place (``torch._foreach_add_(exp_avg_sq_sqrt, eps)``)
and divides by the step size into the same list: one."""


def torch_release(training: TrainingSpec) -> tuple[int, int, int]:
    """The release planned: TrainingSpec.torch_release, else 2.13."""
    return version_tuple(training.torch_release or TORCH_VERSION)


def zero_grad_zeroes(training: TrainingSpec) -> bool:
    """Whether zero_grad() at its default zeroes the gradients in place (releases before 2.0)."""
    return torch_release(training) < SET_TO_NONE_DEFAULT_FROM


def default_loop_is_for_loop(training: TrainingSpec) -> bool:
    """Whether torch's optimizers step tensor by tensor by default (releases before 2.0)."""
    return torch_release(training) < FOREACH_DEFAULT_FROM


# torch's own zero_grad decides the gradients' life only under plain DDP and one GPU, where the
# loop calls it on torch's optimizer or the module. DeepSpeed's engine (ZeRO stages) drops its own:
# deepspeed 0.19.8 runtime/engine.py _take_model_step calls the ZeRO optimizer's zero_grad
# (stage_1_and_2.py zero_grad(set_to_none=True), stage3.py alike) or its own zero_grad
# (``param.grad = None``), and accelerate's DeepSpeedOptimizerWrapper.zero_grad is a ``pass``
# (accelerate 1.10.1 utils/deepspeed.py), whatever torch's default.
def keeps_zeroed_gradients(request: PlanRequest) -> bool:
    """Whether the step's gradients stay allocated (zeroed) from the previous step through the
    forward: a torch release before 2.0 under DDP or one GPU, the gradients stepped at the end."""
    return (zero_grad_zeroes(request.training) and request.strategy.kind is StrategyKind.ddp
            and not request.training.optimizer_in_backward)


def foreach_adam_temporaries(training: TrainingSpec) -> int:
    """How many state-sized temporaries torch's foreach Adam/AdamW step holds at once: two
    before torch 2.1, one from it on (FOREACH_ADAM_IN_PLACE_FROM)."""
    return 2 if torch_release(training) < FOREACH_ADAM_IN_PLACE_FROM else 1


def check_torch_release(training: TrainingSpec) -> None:
    """Refuse a torch version that is not a release number or lies outside what is described."""
    check_release_range("torch_release", training.torch_release, TORCH_OLDEST, TORCH_NEWEST, TORCH_VERSION)


# torch 1.x has FSDP1 alone (torch.distributed.fsdp.FullyShardedDataParallel, whose flat
# parameter's sharded gradient zero_grad would keep); zeroplan's FSDP strategies are torch 2.13's.
def check_torch_release_strategy(training: TrainingSpec, kind: StrategyKind) -> None:
    """Refuse a release before 2.0 under an FSDP strategy (its FSDP1 is not modelled)."""
    if training.torch_release is not None and zero_grad_zeroes(training) and kind.is_fsdp:
        raise ZeroplanError("torch_release", f"{training.torch_release} is modelled under ddp and the ZeRO strategies; "
                            f"{kind.value} is torch 2.13's FSDP, not torch 1.x's FSDP1 (allowed: 2.0 or later)")
