"""What every training engine offers the runner, and the optimizer settings they all share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

ADAMW_LR = 1e-3
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
ADAMW_WEIGHT_DECAY = 0.1


def make_adamw(params: list[torch.Tensor]) -> torch.optim.AdamW:
    """The one optimizer configuration used by every engine and by the single-process oracle.

    foreach=False keeps the per-tensor loop, whose arithmetic is elementwise: sharding a tensor
    then does not change a single update.
    """
    return torch.optim.AdamW(
        params, lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS,
        weight_decay=ADAMW_WEIGHT_DECAY, foreach=False,
    )


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


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (it has no storage of its own), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        local_tensor(value) for state in optimizer.state.values() for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


class Engine(Protocol):
    """A data-parallel training engine wrapped around one rank's model."""

    module: nn.Module
    optimizer: torch.optim.Optimizer

    def forward_backward(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Run one micro-batch forward and backward; return the loss (detached)."""
        ...

    def step(self) -> None:
        """Apply the optimizer update (and any collectives it needs)."""
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
