"""Deterministic synthetic batches: the global batch of a step, and each rank's slice of it."""

from __future__ import annotations

import torch

from zeroplan.specs import ModelSpec


def global_batch(
    spec: ModelSpec, step: int, world_size: int, micro_batch_size: int, seq_len: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets (N*b, s) for one step, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows = torch.randint(
        0, spec.vocab_size, (world_size * micro_batch_size, seq_len + 1), generator=generator
    )
    return rows[:, :-1], rows[:, 1:]


def rank_batch(
    spec: ModelSpec, step: int, world_size: int, rank: int, micro_batch_size: int, seq_len: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's micro-batch: rows [r*b, (r+1)*b) of the global batch."""
    tokens, targets = global_batch(spec, step, world_size, micro_batch_size, seq_len, seed)
    rows = slice(rank * micro_batch_size, (rank + 1) * micro_batch_size)
    return tokens[rows], targets[rows]
