"""The matrix products of Muon's Newton-Schulz orthogonalisation in one optimizer step: the FLOPs
each matrix costs under the code that runs it and the matrices each rank orthogonalises;
zeroplan.core.timing.newton_schulz_seconds times them (docs/communication-time.md). Counted
against torch's and DeepSpeed's own functions by tests/test_muon_time.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroplan.core import muon

if TYPE_CHECKING:
    from zeroplan.specs.request import PlanRequest

NS_STEPS = 5
"""torch 2.13 torch/optim/_muon.py DEFAULT_NS_STEPS; deepspeed 0.19.8 original_muon.py muon_update's
ns_steps default (stage_1_and_2.py get_flat_partition passes none)."""
GRAM_RESTART_AT = 2
"""deepspeed 0.19.8 original_muon.py zeropower_via_gram_newtonschulz: restart_at = 2."""


def _product_flops(rows: int, inner: int, cols: int) -> int:
    """A (rows x inner) @ (inner x cols) product: one multiply and one add per term."""
    return 2 * rows * inner * cols


# torch 2.13 torch/optim/_muon.py _zeropower_via_newtonschulz: the bf16 copy is transposed to its
# short side s (X is s x l); each of ns_steps iterations makes the Gram matrix X @ X.T (s x l by
# l x s), addmm(A, A, A) (s x s by s x s) and addmm(X, B, X) (s x s by s x l). deepspeed 0.19.8
# original_muon.py zeropower_via_newtonschulz5 (ns_method "standard") runs the same three products.
def newton_schulz_flops(shape: tuple[int, ...], steps: int = NS_STEPS) -> int:
    short, long = sorted(shape[-2:])
    return steps * (_product_flops(short, long, short) + _product_flops(short, short, short)
                    + _product_flops(short, short, long))


# deepspeed 0.19.8 original_muon.py zeropower_via_gram_newtonschulz (muon_update's default
# ns_method "gram", in fp16 on a GPU): a square matrix takes the standard iteration; otherwise,
# with X s x l, R = X @ X.mT once, then per iteration Z = b R + c R @ R, Q = a Q + Z @ Q (from the
# second iteration after each start), R advanced by two s x s products except before a restart
# and after the last iteration; the restart re-forms X = Q @ X and R = X @ X.mT; the result Q @ X.
def gram_newton_schulz_flops(shape: tuple[int, ...], steps: int = NS_STEPS, restart_at: int = GRAM_RESTART_AT) -> int:
    short, long = sorted(shape[-2:])
    if short == long:
        return newton_schulz_flops(shape, steps)
    square = _product_flops(short, short, short)
    wide = _product_flops(short, long, short)
    flops = wide
    started = False
    for i in range(steps):
        if i == restart_at and i != 0:
            flops += 2 * wide
            started = False
        flops += square + (square if started else 0)
        started = True
        if i < steps - 1 and i + 1 != restart_at:
            flops += 2 * square
    return flops + wide


# Which rank orthogonalises which matrix. torch 2.13 _muon.py Muon.step under DDP: every rank
# holds every gradient (all-reduced) and steps every matrix (replicated work). deepspeed 0.19.8
# runtime/zero/stage_1_and_2.py get_flat_partition: each rank runs muon_update on every whole
# parameter of params_in_partition, the Muon matrices meeting its partition of the group
# (zeroplan.core.muon); the fullest rank sets the step.
def rank_newton_schulz_flops(request: PlanRequest) -> int:
    """Newton-Schulz FLOPs of one step on the busiest rank (0 without Muon)."""
    from zeroplan.specs.training import Optimizer, StateConvention

    if request.training.optimizer is not Optimizer.muon:
        return 0

    matrices, _ = muon.split_tensors(request)
    if request.convention is StateConvention.deepspeed:
        ordered = muon.deepspeed_muon_order(matrices)
        return max(muon.deepspeed_whole_sum_by_rank([t.numel for t in ordered],
                                                    [gram_newton_schulz_flops(t.shape) for t in ordered],
                                                    request.shard_group_size))
    return sum(newton_schulz_flops(t.shape) for t in matrices)

