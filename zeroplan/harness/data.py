"""Deterministic synthetic batches: the global batch of a step, and each rank's micro-batches
of it.

A step's global batch has K*N*b rows (K micro-batches per step, N ranks, b rows per
micro-batch). Micro-batch m of rank r is rows [(m*N + r)*b, (m*N + r + 1)*b): distinct for every
(step, micro-batch, rank), and together exactly the global batch the single-process oracle
trains on. With K = 1 this is the one-micro-batch layout (rank r: rows [r*b, (r+1)*b)).
"""

from __future__ import annotations

import torch

from zeroplan.specs import ModelSpec


def global_batch(
    spec: ModelSpec, step: int, world_size: int, micro_batch_size: int, seq_len: int, seed: int = 0,
    grad_accum_steps: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets (K*N*b, s) for one step, the same on every rank."""
    # Drawn on the CPU whatever the default device (the runner builds under torch.device("cuda")
    # on a GPU), so every device sees the same tokens; the caller moves them.
    generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    rows = torch.randint(
        0, spec.vocab_size, (grad_accum_steps * world_size * micro_batch_size, seq_len + 1), generator=generator,
        device="cpu",
    )
    return rows[:, :-1], rows[:, 1:]


def rank_batch(
    spec: ModelSpec, step: int, world_size: int, rank: int, micro_batch_size: int, seq_len: int,
    seed: int = 0, micro_batch: int = 0, grad_accum_steps: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's micro-batch m of the step: rows [(m*N + r)*b, (m*N + r + 1)*b) of the global batch."""
    assert 0 <= micro_batch < grad_accum_steps and 0 <= rank < world_size
    tokens, targets = global_batch(spec, step, world_size, micro_batch_size, seq_len, seed, grad_accum_steps)
    first = (micro_batch * world_size + rank) * micro_batch_size
    rows = slice(first, first + micro_batch_size)
    return tokens[rows], targets[rows]
