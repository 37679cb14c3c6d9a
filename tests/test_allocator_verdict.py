"""The allocator model's verdict is its replay at the usable memory, and the OOM capacity shown
beside it is bisected on the side that verdict fell (docs/memory-model.md, "The caching
allocator"): completion is not monotone in the capacity."""

from __future__ import annotations

import re

import pytest

from zeroplan.allocator.capacity import CAPACITY_STEP_BYTES, bisect_capacity, completes_within, oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.planner import allocator_verdict
from zeroplan.allocator.replay import compile_trace, replay
from zeroplan.allocator.schedule import step_trace
from zeroplan.cli.fit import parse_strategies, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import checked_peak_terms, peak_allocated_bytes
from zeroplan.specs import StrategyKind
from zeroplan.units import GiB

# torchtitan's Llama-3.1-8B under FSDP2 with full recomputation at 1 x 2048 on 8 GPUs, under
# PyTorch's default allocator (not torchtitan's launch default, expandable segments): the step
# completes on 19.2-20.2 GiB, fails on 20.2-22.8 GiB and completes again higher up.
FLAGS = ("llama-3.1-8b --framework torchtitan --gpus 8 --gpu a100-40gb --micro-batch 1 --seq-len 2048 "
         "--activation-checkpointing full --allocator-conf=")
DEFAULT = parse_alloc_conf("")


@pytest.fixture(scope="module")
def step():
    base = request_from_args(build_parser().parse_args(["fit", *FLAGS.split()]))
    request = base.with_strategy(base.strategy.model_copy(update={"kind": StrategyKind.fsdp_full_shard}))
    states, terms = checked_peak_terms(request)
    ops = compile_trace(step_trace(request, states, terms))
    return request, states, terms, ops, replay(ops, DEFAULT)


def _completes(ops, gib: float) -> bool:
    return replay(ops, DEFAULT, int(gib * GiB) // CAPACITY_STEP_BYTES * CAPACITY_STEP_BYTES).completed


def test_completion_is_not_monotone_in_the_capacity(step) -> None:
    *_, ops, unlimited = step
    assert unlimited.allocated_peak_bytes < 19 * GiB < 26 * GiB < unlimited.reserved_peak_bytes
    assert [_completes(ops, gib) for gib in (19.0, 19.5, 21.0, 22.5, 25.0)] == [False, True, False, False, True]


@pytest.mark.parametrize("trace_gib, fits", [(19.5, True), (21.0, False), (25.0, True)])
def test_the_capacity_is_bisected_on_the_side_the_verdict_fell(step, trace_gib: float, fits: bool) -> None:
    request, states, terms, ops, unlimited = step
    allocated, _ = peak_allocated_bytes(states, terms, 1)
    # The planner's allocated peak counts the largest unit for every unit: what it holds beyond
    # the schedule's own requested peak is taken off the memory the trace is replayed on.
    shortfall = allocated - unlimited.requested_peak_bytes
    assert 0 < shortfall < GiB
    usable = int(trace_gib * GiB) + shortfall
    verdict = allocator_verdict(request, states, terms, allocated, usable)
    assert verdict.fits is fits is completes_within(ops, DEFAULT, usable - shortfall, unlimited)
    capacity = verdict.oom_capacity_bytes
    assert (capacity <= usable) is fits
    # A boundary of the trace's own: it completes there and 2 MiB below it does not.
    assert replay(ops, DEFAULT, capacity - shortfall).completed
    assert not replay(ops, DEFAULT, capacity - shortfall - CAPACITY_STEP_BYTES).completed


def test_plain_bisection_can_land_above_a_usable_memory_on_which_the_step_completes(step) -> None:
    # Why the verdict is not "oom_capacity <= usable": between the allocated and reserved peaks
    # the plain bisection finds a boundary at 22.9 GiB, above 19.5 GiB on which the step runs.
    *_, ops, unlimited = step
    plain = oom_capacity(step_trace(*step[:3]), DEFAULT).oom_capacity_bytes
    assert plain > 22.5 * GiB and _completes(ops, 19.5)
    steps = int(19.5 * GiB) // CAPACITY_STEP_BYTES
    assert bisect_capacity(ops, DEFAULT, unlimited, steps, True) <= 19.5 * GiB < plain


def test_no_capacity_is_bisected_where_the_allocated_peak_passes_the_usable_memory(step) -> None:
    request, states, terms, _, unlimited = step
    allocated, _ = peak_allocated_bytes(states, terms, 1)
    verdict = allocator_verdict(request, states, terms, allocated, allocated - 1)
    assert not verdict.fits and verdict.oom_capacity_bytes is None
    assert verdict.unlimited.reserved_peak_bytes == unlimited.reserved_peak_bytes


def _unranged(verdict: str) -> str:
    return re.sub(r"borderline: \d+-\d+ %", "borderline: N-M %", verdict)


@pytest.mark.parametrize("flags", [
    "llama-2-70b --gpus 8 --gpu a100-80gb --activation-checkpointing full",
    "llama-3.1-8b --framework torchtitan --gpus 8 --gpu h100-80gb --micro-batch 2 --seq-len 8192 "
    "--activation-checkpointing selective-op",
    "llama-2-7b --gpus 8 --gpu a100-40gb",
    # On one node HSDP sends what full sharding sends: the recommendation compares their peaks.
    "llama-3.1-8b --framework torchtitan --gpus 8 --gpu h100-80gb --strategies fsdp-full-shard,hsdp",
])
def test_a_fit_without_capacities_gives_the_same_verdict(flags: str) -> None:
    # fit's suggestions plan without bisecting OOM capacities; the verdict and every fits column
    # must be the full fit's, which is what a user who takes the suggestion is shown.
    from zeroplan.core.plan import fit

    args = build_parser().parse_args(["fit", *flags.split()])
    request = request_from_args(args)
    strategies = parse_strategies(args.strategies)
    full, quick = fit(request, strategies, suggest=False), fit(request, strategies, suggest=False, capacities=False)
    # The words are the same; a borderline range is the usable memory over the step's peak, which
    # unbisected is an upper bound of the bisected one (below), so only its figures may differ.
    assert _unranged(quick.verdict) == _unranged(full.verdict) and quick.recommended == full.recommended
    assert [p.fits for p in quick.plans] == [p.fits for p in full.plans]
    assert [p.max_micro_batch_size for p in quick.plans] == [p.max_micro_batch_size for p in full.plans]
    for q, f in zip(quick.plans, full.plans):
        # Unbisected, a fitting step's peak is a capacity it completes on, at or above its own.
        if f.fits and f.memory.oom_capacity_bytes is not None:
            assert f.memory.peak_bytes <= q.memory.peak_bytes <= q.usable_memory_bytes


def test_the_suggested_change_reads_as_the_fit_of_that_change() -> None:
    from zeroplan.core.plan import fit

    flags = "llama-2-70b --gpus 8 --gpu a100-80gb".split()
    suggested = fit(request_from_args(build_parser().parse_args(["fit", *flags])))
    changed = fit(request_from_args(build_parser().parse_args(["fit", *flags, "--activation-checkpointing", "full"])))
    assert suggested.verdict.endswith(f" With --activation-checkpointing full: {changed.verdict}")


def test_the_dataframe_carries_the_allocator_columns_as_integers() -> None:
    import pandas as pd

    from zeroplan.core.plan import fit

    flags = "llama-2-70b --gpus 8 --gpu a100-80gb --activation-checkpointing full".split()
    frame = fit(request_from_args(build_parser().parse_args(["fit", *flags])), suggest=False).to_dataframe()
    assert str(frame["oom_capacity_bytes"].dtype) == "Int64" and str(frame["reserved_peak_bytes"].dtype) == "Int64"
    fitting = frame[frame["fits"]]
    assert len(fitting) and (fitting["peak_bytes"] == fitting["oom_capacity_bytes"]).all()
    assert pd.isna(frame.loc["ddp", "oom_capacity_bytes"])  # its allocated peak alone passes the GPU
    assert frame.loc["ddp", "peak_bytes"] == frame.loc["ddp", "allocated_peak_bytes"]
    flat = fit(request_from_args(build_parser().parse_args(["fit", *flags, "--flat-reserve"])), suggest=False).to_dataframe()
    assert flat["reserved_peak_bytes"].isna().all() and flat["oom_capacity_bytes"].isna().all()
