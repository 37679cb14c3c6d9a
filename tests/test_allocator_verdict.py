"""The allocator model's verdict is its replay at the usable memory, its peak what that replay
reserves (without a limit where it runs out), and the OOM capacity, bisected on request, lies
on the side that verdict fell (docs/memory-model.md, "The caching allocator"): completion is
not monotone in the capacity."""

from __future__ import annotations

import pytest

from zeroplan.allocator.capacity import CAPACITY_STEP_BYTES, bisect_capacity, oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.planner import allocator_verdict
from zeroplan.allocator.replay import compile_trace, replay
from zeroplan.allocator.schedule import step_trace
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import checked_peak_terms, peak_allocated_bytes
from zeroplan.specs import StrategyKind
from zeroplan.units import GiB

# transformers' Llama-3.1-8B under FSDP2 without recomputation at 4 x 1024 on 8 GPUs, under
# PyTorch's default allocator: the step completes on 44.6-45.8 GiB, fails on 45.9-46.9 GiB and
# completes again from 47.0 GiB.
FLAGS = ("llama-3.1-8b --framework hf --gpus 8 --gpu a100-80gb --micro-batch 4 --seq-len 1024 "
         "--activation-checkpointing none --allocator-conf=")
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
    assert unlimited.allocated_peak_bytes < 44.3 * GiB < 55 * GiB < unlimited.reserved_peak_bytes
    assert [_completes(ops, gib) for gib in (44.3, 45.0, 46.3, 46.75, 50.0)] == [False, True, False, False, True]


@pytest.mark.parametrize("trace_gib, fits", [(45.0, True), (46.3, False), (50.0, True)])
def test_the_capacity_is_bisected_on_the_side_the_verdict_fell(step, trace_gib: float, fits: bool) -> None:
    request, states, terms, ops, unlimited = step
    allocated, _ = peak_allocated_bytes(states, terms, 1)
    # The planner's allocated peak counts the largest unit for every unit: what it holds beyond
    # the schedule's own requested peak is taken off the memory the trace is replayed on (none
    # here: this step's units peak at the planner's own moment).
    shortfall = allocated - unlimited.requested_peak_bytes
    assert 0 <= shortfall < GiB
    usable = int(trace_gib * GiB) + shortfall
    exact = request.model_copy(update={"assumptions": request.assumptions.model_copy(update={"exact_capacity": True})})
    verdict = allocator_verdict(exact, states, terms, allocated, usable)
    on_gpu = replay(ops, DEFAULT, usable - shortfall)
    assert verdict.fits is fits is on_gpu.completed
    # The peak is what the replay reserved on the usable memory where it completes, else what
    # it reserves without a limit; the rest of the planner's allocated bytes on top.
    assert verdict.reserved_peak_bytes == (on_gpu if fits else unlimited).reserved_peak_bytes + shortfall
    assert (verdict.reserved_peak_bytes <= usable) is fits
    capacity = verdict.oom_capacity_bytes
    assert (capacity <= usable) is fits
    # A boundary of the trace's own: it completes there and 2 MiB below it does not.
    assert replay(ops, DEFAULT, capacity - shortfall).completed
    assert not replay(ops, DEFAULT, capacity - shortfall - CAPACITY_STEP_BYTES).completed


def test_plain_bisection_can_land_above_a_usable_memory_on_which_the_step_completes(step) -> None:
    # Why the verdict is not "oom_capacity <= usable": between the allocated and reserved peaks
    # the plain bisection finds a boundary at 47.0 GiB, above 45.0 GiB on which the step runs.
    *_, ops, unlimited = step
    plain = oom_capacity(step_trace(*step[:3]), DEFAULT).oom_capacity_bytes
    assert plain > 46.75 * GiB and _completes(ops, 45.0)
    steps = int(45.0 * GiB) // CAPACITY_STEP_BYTES
    assert bisect_capacity(ops, DEFAULT, unlimited, steps, True) <= 45.0 * GiB < plain


def test_nothing_is_replayed_where_the_allocated_peak_passes_the_usable_memory(step) -> None:
    request, states, terms, _, _ = step
    allocated, _ = peak_allocated_bytes(states, terms, 1)
    verdict = allocator_verdict(request, states, terms, allocated, allocated - 1)
    assert not verdict.fits and verdict.reserved_peak_bytes is None and verdict.oom_capacity_bytes is None


@pytest.mark.parametrize("flags", [
    "llama-2-70b --gpus 8 --gpu a100-80gb --activation-checkpointing full",
    "llama-3.1-8b --framework torchtitan --gpus 8 --gpu h100-80gb --micro-batch 2 --seq-len 8192 "
    "--activation-checkpointing selective-op",
    "llama-2-7b --gpus 8 --gpu a100-40gb",
])
def test_bisecting_the_capacity_changes_no_verdict_and_no_peak(flags: str) -> None:
    # --exact-capacity adds the oom-at column and nothing else: the verdict and the peaks are
    # the replays on the usable memory either way.
    from zeroplan.core.plan import fit

    args = build_parser().parse_args(["fit", *flags.split()])
    request = request_from_args(args)
    exact = request.model_copy(update={"assumptions": request.assumptions.model_copy(update={"exact_capacity": True})})
    default, bisected = fit(request, suggest=False), fit(exact, suggest=False)
    assert default.verdict == bisected.verdict and default.recommended == bisected.recommended
    assert [p.memory.peak_bytes for p in default.plans] == [p.memory.peak_bytes for p in bisected.plans]
    assert [p.max_micro_batch_size for p in default.plans] == [p.max_micro_batch_size for p in bisected.plans]
    assert all(p.memory.oom_capacity_bytes is None for p in default.plans)
    replayed = [p for p in bisected.plans if p.memory.reserved_peak_bytes is not None]
    assert replayed and all((p.memory.oom_capacity_bytes <= p.usable_memory_bytes) is p.fits for p in replayed)


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
    assert len(fitting) and (fitting["peak_bytes"] == fitting["reserved_peak_bytes"]).all()
    assert frame["oom_capacity_bytes"].isna().all()  # bisected only with --exact-capacity
    assert pd.isna(frame.loc["ddp", "reserved_peak_bytes"])  # its allocated peak alone passes the GPU
    assert frame.loc["ddp", "peak_bytes"] == frame.loc["ddp", "allocated_peak_bytes"]
    flat = fit(request_from_args(build_parser().parse_args(["fit", *flags, "--flat-reserve"])), suggest=False).to_dataframe()
    assert flat["reserved_peak_bytes"].isna().all() and flat["oom_capacity_bytes"].isna().all()


@pytest.mark.parametrize("trace_gib, fits, replays", [(45.0, True, 1), (46.5, False, 2), (30.0, False, 0)])
def test_the_default_answer_replays_once_twice_where_it_runs_out_and_not_where_alloc_passes(
        step, monkeypatch, trace_gib: float, fits: bool, replays: int) -> None:
    # One replay on the usable memory answers the verdict and the peak; a step that runs out is
    # replayed once more without a limit; one whose allocated peak alone passes is not replayed.
    import zeroplan.allocator.planner as planner

    request, states, terms, _, unlimited = step
    allocated, _ = peak_allocated_bytes(states, terms, 1)
    shortfall = allocated - unlimited.requested_peak_bytes
    usable = int(trace_gib * GiB) + shortfall
    calls = []
    monkeypatch.setattr(planner, "replay_ops", lambda ops, config, capacity=None, marks=():
                        calls.append(capacity) or replay(ops, config, capacity))
    planner.forget_replays()
    verdict = allocator_verdict(request, states, terms, allocated, usable)
    assert verdict.fits is fits and len(calls) == replays
    if replays:
        assert calls[0] == usable - shortfall and calls[1:] == [None] * (replays - 1)
