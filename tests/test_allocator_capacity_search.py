"""The allocator model's default answer against the oracle on random requests: the default
replays the step once on the usable memory (and once without a limit where it runs out); the
oracle (MemoryAssumptions.exact_capacity) also bisects the OOM capacity. Both give the same
verdict; the default peak is at most the usable memory exactly when the step fits, never below
the bisected capacity where the step reserved freely, and the capacity is a boundary of the
step's own trace on the verdict's side of the usable memory (the step completes there and one
2 MiB step less fails). benchmarks/allocator_capacity_sweep.py runs the same comparison on
10,000 requests and prints how far the default peak lies from the capacity."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from zeroplan.allocator.capacity import CAPACITY_STEP_BYTES
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.planner import allocator_verdict
from zeroplan.allocator.replay import replay
from zeroplan.allocator.schedule import step_ops
from zeroplan.core.peak import peak_allocated_bytes
from zeroplan.core.plan import checked_peak_terms

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from allocator_capacity_sweep import random_request  # noqa: E402

SEEDS = range(40)


def _draw(seed: int):
    rng = random.Random(seed)
    request = None
    while request is None:
        request = random_request(rng)
        try:
            states, terms = checked_peak_terms(request) if request is not None else (None, None)
        except Exception:  # noqa: BLE001 - a draw the planner refuses is drawn again
            request = None
    allocated, _ = peak_allocated_bytes(states, terms, request.batch.grad_accum_steps)
    return request, states, terms, allocated, rng


def _is_boundary(ops, config, capacity_bytes: int, low_bytes: int) -> bool:
    """The step completes on ``capacity_bytes`` and fails one step less (or that is below the
    allocated peak, where nothing completes)."""
    below = capacity_bytes - CAPACITY_STEP_BYTES
    return replay(ops, config, capacity_bytes).completed and (below < low_bytes or not replay(ops, config, below).completed)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_default_and_the_oracle_agree_on_the_verdict_and_the_peak_keeps_its_rule(seed: int) -> None:
    request, states, terms, allocated, rng = _draw(seed)
    usable = int(allocated * rng.uniform(0.98, 1.3))
    exact_request = request.model_copy(update={"assumptions": request.assumptions.model_copy(update={"exact_capacity": True})})
    default = allocator_verdict(request, states, terms, allocated, usable)
    exact = allocator_verdict(exact_request, states, terms, allocated, usable)
    assert default.fits is exact.fits and default.oom_capacity_bytes is None
    if allocated > usable:
        assert default.reserved_peak_bytes is exact.reserved_peak_bytes is exact.oom_capacity_bytes is None
        return
    assert default.reserved_peak_bytes == exact.reserved_peak_bytes
    assert (default.reserved_peak_bytes <= usable) is default.fits
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    ops = step_ops(request, states, terms)
    unlimited = replay(ops, config)
    shortfall = max(allocated - unlimited.requested_peak_bytes, 0)
    if unlimited.reserved_peak_bytes + shortfall <= usable:
        # Nothing ever failed on the usable memory: it reserved what it reserves without a limit,
        # and the least memory it completes on is no more than that.
        assert default.reserved_peak_bytes == unlimited.reserved_peak_bytes + shortfall >= exact.oom_capacity_bytes
    low = unlimited.allocated_peak_bytes // CAPACITY_STEP_BYTES * CAPACITY_STEP_BYTES - CAPACITY_STEP_BYTES
    # The capacity lies on the verdict's side: at most the usable memory when it fits, above it when not.
    assert (exact.oom_capacity_bytes <= usable) is exact.fits
    assert _is_boundary(ops, config, exact.oom_capacity_bytes - shortfall, low)
