"""The single-process oracle: one optimizer step per step on the concatenated global batch.

With equal micro-batches and a mean loss, the mean of the K*N micro-batch losses (each rank's
K micro-batches, each backward on loss / K, gradients averaged over the N ranks) is the mean
over the global batch, so data-parallel gradients equal this run's gradients (up to rounding).
"""

from __future__ import annotations

import torch

from zeroplan.harness.data import global_batch
from zeroplan.harness.engine import make_optimizer
from zeroplan.harness.model import build_model, next_token_loss
from zeroplan.specs import ModelSpec, Optimizer


def oracle_parameters(
    spec: ModelSpec, steps: int, world_size: int, micro_batch_size: int, seq_len: int,
    seed: int = 0, activation_checkpointing: bool = False, grad_accum_steps: int = 1,
    optimizer: Optimizer = Optimizer.adamw,
) -> dict[str, torch.Tensor]:
    model = build_model(spec, seed)
    model.set_activation_checkpointing(activation_checkpointing)
    step_optimizer = make_optimizer(optimizer, list(model.parameters()))
    for step in range(steps):
        tokens, targets = global_batch(spec, step, world_size, micro_batch_size, seq_len, seed, grad_accum_steps)
        next_token_loss(model(tokens), targets).backward()
        step_optimizer.step()
        step_optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}
