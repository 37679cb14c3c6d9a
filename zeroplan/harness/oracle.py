"""The single-process oracle: plain AdamW on the concatenated global batch.

With equal micro-batches and a mean loss, the mean of the N per-rank losses is the global mean,
so averaged data-parallel gradients equal this run's gradients (up to rounding).
"""

from __future__ import annotations

import torch

from zeroplan.harness.data import global_batch
from zeroplan.harness.engine import make_adamw
from zeroplan.harness.model import build_model, next_token_loss
from zeroplan.specs import ModelSpec


def oracle_parameters(
    spec: ModelSpec, steps: int, world_size: int, micro_batch_size: int, seq_len: int,
    seed: int = 0, activation_checkpointing: bool = False,
) -> dict[str, torch.Tensor]:
    model = build_model(spec, seed)
    model.set_activation_checkpointing(activation_checkpointing)
    optimizer = make_adamw(list(model.parameters()))
    for step in range(steps):
        tokens, targets = global_batch(spec, step, world_size, micro_batch_size, seq_len, seed)
        next_token_loss(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}
