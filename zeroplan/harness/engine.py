"""What every training engine offers the runner, and the optimizer settings they all share."""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from zeroplan.errors import ZeroplanError
from zeroplan.specs import Optimizer

ADAMW_LR = 1e-3
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
ADAMW_WEIGHT_DECAY = 0.1

# One setting per optimizer, used by every engine and by the single-process oracle. foreach=False
# keeps torch.optim's per-tensor loop, whose arithmetic is elementwise for Adam(W) and SGD:
# sharding a tensor then does not change a single update. Adafactor's is not elementwise (it
# reads whole-tensor statistics); engines_table.py says which engines may run it.
_OPTIMIZERS: dict[Optimizer, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    Optimizer.adamw: (torch.optim.AdamW, dict(lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                                             weight_decay=ADAMW_WEIGHT_DECAY, foreach=False)),
    Optimizer.adam: (torch.optim.Adam, dict(lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS, foreach=False)),
    Optimizer.sgd: (torch.optim.SGD, dict(lr=0.1, foreach=False)),
    Optimizer.sgd_momentum: (torch.optim.SGD, dict(lr=0.05, momentum=0.9, foreach=False)),
    # torch's defaults (lr 1e-2, beta2_decay -0.8, eps (None, 1e-3)); no first moment.
    Optimizer.adafactor: (torch.optim.Adafactor, dict(foreach=False)),
}


def optimizer_class_and_kwargs(kind: Optimizer) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The class and settings behind :func:`make_optimizer` (ZeroRedundancyOptimizer takes them
    apart); a one-line error for an optimizer the harness cannot build."""
    if kind not in _OPTIMIZERS:
        allowed = ", ".join(o.value for o in _OPTIMIZERS)
        raise ZeroplanError("optimizer", f"{kind.value!r} cannot be measured (allowed: {allowed})")
    cls, kwargs = _OPTIMIZERS[kind]
    return cls, dict(kwargs)


def make_optimizer(kind: Optimizer, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The one optimizer factory of every engine and of the single-process oracle."""
    cls, kwargs = optimizer_class_and_kwargs(kind)
    return cls(params, **kwargs)


def make_adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``make_optimizer(Optimizer.adamw, params)``."""
    return make_optimizer(Optimizer.adamw, params)


@dataclass(frozen=True)
class MicroBatch:
    """Which micro-batch of an optimizer step an engine's forward_backward runs."""

    index: int = 0
    count: int = 1
    """grad_accum_steps: micro-batches per optimizer step."""

    @property
    def is_last(self) -> bool:
        """The micro-batch after which gradients must be complete (synchronised)."""
        return self.index == self.count - 1


def accumulated_loss(loss: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    """What backward runs on: the micro-batch's mean loss divided by the number of micro-batches,
    so the accumulated gradient is that of the mean over the whole step (as the oracle's)."""
    return loss / micro.count if micro.count > 1 else loss


@dataclass
class ModelStateTensors:
    """The tensors that make up a rank's model states, by category, as the engine holds them."""

    parameters: list[torch.Tensor] = field(default_factory=list)
    gradients: list[torch.Tensor] = field(default_factory=list)
    optimizer_states: list[torch.Tensor] = field(default_factory=list)
    host: list[torch.Tensor] = field(default_factory=list)
    """States an offloading engine keeps in host memory (its fp32 master, gradient partition and
    optimizer states), whatever device the run's tensors are on: on a CPU-only run host and
    device are the same memory, so the engine says which side each state is on."""
    buffers: list[torch.Tensor] = field(default_factory=list)
    """Communication and staging buffers the engine keeps across the step (DeepSpeed's reduce
    buckets, stage 3's gradient partition buffer, offload's device staging buffer): the
    planner's buffers, not its gradients (docs/harness.md, "What counts as gradients")."""


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (it has no storage of its own), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def device_type() -> str:
    """The torch device type a rank computes on: cuda where there is a GPU, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def autocast_to(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """torch.autocast to ``dtype`` on this rank's device; nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type(), dtype=dtype)


def module_state_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> ModelStateTensors:
    """The rank's parameters, gradients and optimizer states (DTensors as their local shards)."""
    params = [local_tensor(p) for p in module.parameters()]
    grads = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
    return ModelStateTensors(params, grads, optimizer_state_tensors(optimizer))


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        local_tensor(value) for state in optimizer.state.values() for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


class TorchOptimizerSteps:
    """step(), zero_grad() and model_state_tensors() of an engine that steps torch's own
    ``optimizer`` over its ``module``'s parameters."""

    module: nn.Module
    optimizer: torch.optim.Optimizer

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def model_state_tensors(self) -> ModelStateTensors:
        return module_state_tensors(self.module, self.optimizer)


class Engine(Protocol):
    """A data-parallel training engine wrapped around one rank's model."""

    module: nn.Module
    optimizer: torch.optim.Optimizer

    def forward_backward(
        self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor, micro: MicroBatch = MicroBatch()
    ) -> torch.Tensor:
        """Run one micro-batch forward and backward of ``accumulated_loss`` (gradients add up
        over the step's micro-batches; the engine synchronises them per micro-batch or on the
        last one, as its docstring says); return the micro-batch's unscaled loss (detached)."""
        ...

    def step(self) -> None:
        """Apply the optimizer update (and any collectives it needs), once per step after the
        last micro-batch."""
        ...

    def zero_grad(self) -> None:
        """Free the gradients for the next step."""
        ...

    def model_state_tensors(self) -> ModelStateTensors:
        """Parameters, gradients and optimizer states this rank holds right now."""
        ...

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every full parameter by its name in the unwrapped model (a collective: all ranks call)."""
        ...
