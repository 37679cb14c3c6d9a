"""The OOM capacity's default search (one grown replay, confirmed or galloped from) against the
oracle (bisection over whole replays): on random requests both give the same verdict, both
capacities are boundaries of the step's own trace on the verdict's side of the usable memory
(the step completes there and one 2 MiB step less fails), and where they differ completion is
not monotone in the capacity. benchmarks/allocator_capacity_sweep.py runs the same comparison
on 10,000 requests and prints how often the two capacities are the same."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from zeroplan.allocator.capacity import CAPACITY_STEP_BYTES, grown_capacity
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
def test_default_and_exact_searches_agree_on_the_verdict_and_both_find_a_boundary(seed: int) -> None:
    request, states, terms, allocated, rng = _draw(seed)
    usable = int(allocated * rng.uniform(0.98, 1.3))
    exact_request = request.model_copy(update={"assumptions": request.assumptions.model_copy(update={"exact_capacity": True})})
    fast = allocator_verdict(request, states, terms, allocated, usable)
    exact = allocator_verdict(exact_request, states, terms, allocated, usable)
    assert fast.fits is exact.fits
    if allocated > usable:
        assert fast.oom_capacity_bytes is exact.oom_capacity_bytes is None
        return
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    ops = step_ops(request, states, terms)
    shortfall = max(allocated - fast.unlimited.requested_peak_bytes, 0)
    low = fast.unlimited.allocated_peak_bytes // CAPACITY_STEP_BYTES * CAPACITY_STEP_BYTES - CAPACITY_STEP_BYTES
    for verdict in (fast, exact):
        # On the verdict's side: at most the usable memory when it fits, above it when not.
        assert (verdict.oom_capacity_bytes <= usable) is verdict.fits
        assert _is_boundary(ops, config, verdict.oom_capacity_bytes - shortfall, low)


def test_the_grown_replay_ends_where_its_own_trajectory_completes() -> None:
    request, states, terms, allocated, _ = _draw(3)
    config = parse_alloc_conf(request.assumptions.allocator_conf or "")
    ops = step_ops(request, states, terms)
    unlimited = replay(ops, config)
    start = unlimited.allocated_peak_bytes // CAPACITY_STEP_BYTES - 1
    grown = grown_capacity(ops, config, start)
    # It never needs more than the unlimited replay reserved, nor less than what was allocated.
    assert start < grown <= -(-unlimited.reserved_peak_bytes // CAPACITY_STEP_BYTES)
    grown_run = replay(ops, config, start * CAPACITY_STEP_BYTES, grow_by_bytes=CAPACITY_STEP_BYTES)
    assert grown_run.completed and grown_run.grown_capacity_bytes == grown * CAPACITY_STEP_BYTES
