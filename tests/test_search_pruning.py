"""The plan search's branch and bound (zeroplan.core.search: memory_lower_bound,
step_time_lower_bound, peak_lower_bounds): the groups its bounds leave out change nothing the
search answers, against the exhaustive search (prune=False)."""

from __future__ import annotations

import numpy as np
import pytest

from zeroplan.core.search import (
    TIME_TOLERANCE_S, LayoutSpace, _at, _Incumbents, _schedulable, _searched_groups, _splits, evaluate, memory_lower_bound,
    pareto_indices, peak_lower_bounds, scalar_plan, search, step_time_lower_bound,
)
from zeroplan.specs import Framework, PlanRequest, StrategyKind

from search_requests import base_request


def _base(model: str, gpus: int, gpu: str = "h100-80gb", seq_len: int = 2048, framework: Framework = Framework.zeroplan,
          host_memory_bytes: int | None = None) -> PlanRequest:
    return base_request(model, gpus, gpu, seq_len, framework, host_memory_bytes)


# (model, GPUs, GPU, seq, framework, host bytes, global batch, layouts): each has groups the bound
# rules out and groups that fit.
REQUESTS = [
    ("llama-2-13b", 8, "h100-80gb", 2048, Framework.zeroplan, None, 64, LayoutSpace(max_tp=4)),
    ("llama-3.1-8b", 16, "a100-40gb", 4096, Framework.torchtitan, None, 64, LayoutSpace(max_tp=2)),
    ("llama-2-7b", 8, "a100-40gb", 2048, Framework.hf, 2**38, 32, None),
    ("llama-2-13b", 8, "a100-40gb", 4096, Framework.torchtune, None, 16, None),
]
IDS = [f"{m}-{g}-{f.value}" for m, g, _, _, f, _, _, _ in REQUESTS]


def _same_answer(pruned, exhaustive) -> None:
    """The ranking, the Pareto front and every figure shown of them; the counts of what was
    searched; of the fitting configurations, those of the groups evaluated."""
    assert pruned.best == exhaustive.best
    assert pruned.ranked == exhaustive.ranked
    assert pruned.pareto == exhaustive.pareto
    assert pruned.explanation == exhaustive.explanation and pruned.allocator_caution == exhaustive.allocator_caution
    same = ("global_batch_size", "seq_len", "num_gpus", "layouts_searched", "groups_searched", "configurations_evaluated")
    assert [getattr(pruned, name) for name in same] == [getattr(exhaustive, name) for name in same]
    assert exhaustive.configurations_bounded_out == 0
    assert pruned.configurations_fitting <= exhaustive.configurations_fitting
    if pruned.configurations_bounded_out == 0:
        assert pruned.configurations_fitting == exhaustive.configurations_fitting


@pytest.mark.parametrize("model,gpus,gpu,seq,framework,host,batch,space", REQUESTS, ids=IDS)
def test_the_pruned_search_answers_as_the_unpruned_one(model, gpus, gpu, seq, framework, host, batch, space) -> None:
    base = _base(model, gpus, gpu, seq, framework, host)
    pruned = search(base, batch, space=space)
    unpruned = search(base, batch, space=space, prune=False)
    _same_answer(pruned, unpruned)
    assert pruned.ranked and len(pruned.pareto) > 1


# Varied questions beside REQUESTS (models from 124M to 70B, 8 to 64 GPUs, global batches, every
# framework's strategies and checkpointing policies, host memory given or not, the ranking's
# length from 1 to 20), each searched with and without branch and bound.
VARIED = [
    ("gpt2", 8, "a100-40gb", 1024, Framework.zeroplan, None, 64, None, 10),
    ("llama-2-7b", 16, "h100-80gb", 4096, Framework.zeroplan, None, 128, LayoutSpace(), 1),
    ("llama-2-13b", 32, "a100-80gb", 4096, Framework.hf, 2**39, 256, None, 5),
    ("llama-3.1-8b", 8, "h100-80gb", 2048, Framework.hf, 2**38, 64, None, 20),
    ("llama-3.1-8b", 8, "a100-40gb", 4096, Framework.torchtune, None, 32, None, 3),
    ("llama-3.1-70b", 64, "h100-80gb", 4096, Framework.zeroplan, None, 512, LayoutSpace(), 10),
    ("llama-3.1-70b", 32, "h100-80gb", 4096, Framework.megatron, None, 64, LayoutSpace(), 10),
    ("llama-2-13b", 16, "a100-80gb", 4096, Framework.megatron_deepspeed, None, 64, LayoutSpace(), 10),
    ("llama-2-7b", 8, "a100-80gb", 2048, Framework.litgpt, None, 32, None, 10),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,gpus,gpu,seq,framework,host,batch,space,top", VARIED,
                         ids=[f"{m}-{g}-{f.value}-{b}-top{t}" for m, g, _, _, f, _, b, _, t in VARIED])
def test_branch_and_bound_answers_as_the_exhaustive_search(model, gpus, gpu, seq, framework, host, batch, space, top) -> None:
    base = _base(model, gpus, gpu, seq, framework, host)
    pruned = search(base, batch, space=space, top=top)
    _same_answer(pruned, search(base, batch, space=space, top=top, prune=False))
    assert pruned.ranked


def test_incumbents_exclude_exactly_what_can_enter_neither_the_ranking_nor_the_front() -> None:
    # Against the definition: a group is left out when adding its configurations (at their
    # bounds, or anywhere above them) changes neither the top k nor the Pareto front.
    rng = np.random.default_rng(1)
    for _ in range(300):
        found = rng.integers(1, 40)
        peaks, seconds = rng.integers(0, 12, found), rng.integers(0, 12, found).astype(float)
        top = int(rng.integers(0, 6))
        incumbents = _Incumbents(top)
        incumbents.add(peaks, seconds)
        size = int(rng.integers(1, 4))
        peak_bounds, seconds_bounds = rng.integers(0, 12, size), rng.integers(0, 12, size).astype(float)
        if not incumbents.excludes(peak_bounds, seconds_bounds):
            continue
        # Any configurations at or above the bounds, appended after the others (a group later
        # in the order) or before them (earlier): the ranking and the front keep the found ones.
        for extra in (0, 1, 3):
            p = np.concatenate([peak_bounds + rng.integers(0, extra + 1, size), peaks])
            t = np.concatenate([seconds_bounds + rng.integers(0, extra + 1, size), seconds])
            for first in (True, False):
                order_p = p if first else np.concatenate([p[size:], p[:size]])
                order_t = t if first else np.concatenate([t[size:], t[:size]])
                new = set(range(size)) if first else set(range(found, found + size))
                ranked = np.lexsort((order_p, order_t))[:top].tolist()
                front = pareto_indices(order_p, order_t).tolist()
                assert not new & set(ranked) and not new & set(front), (peaks, seconds, peak_bounds, seconds_bounds, top)


@pytest.mark.parametrize("model,gpus,gpu,seq,framework,host,batch,space", REQUESTS, ids=IDS)
def test_the_bounds_are_below_every_configuration_of_their_group(model, gpus, gpu, seq, framework, host, batch, space) -> None:
    base = _base(model, gpus, gpu, seq, framework, host)
    all_groups, _ = _searched_groups(base, batch, None, space)
    all_groups, splits = _schedulable(all_groups, _splits(all_groups, batch), batch)
    ruled_out = timed = 0
    for group, (micro, accum) in zip(all_groups, splits):
        bound = memory_lower_bound(group, accum)
        peaks = peak_lower_bounds(group, micro, accum)
        loose = step_time_lower_bound(group, micro, accum, collectives=False)
        tight = step_time_lower_bound(group, micro, accum)
        peak, fits, seconds = evaluate(group, micro, accum)
        # The bounds are on pipeline rank 0's peak; the peak reported is the rank nearest to
        # running out, each on its own usable memory: at least rank 0's less their spread.
        spread = group.usable_spread_bytes
        assert bound is None or bound - spread <= int(peak.min()), group.request.strategy.kind
        assert peaks is None or (peaks - spread <= peak).all()
        assert (loose is None) == (tight is None)
        if tight is not None:
            assert (loose <= tight).all() and (tight <= seconds).all(), group.request.strategy.kind
            timed += 1
        # And below the scalar planner's peak and step (every pipeline rank) at the group's
        # smallest split.
        k = int(np.argmin(peak))
        scalar_peak, _, scalar_time = scalar_plan(_at(group.request, int(micro[k]), int(accum[k])))
        assert bound is None or bound - spread <= scalar_peak
        assert peaks is None or peaks[k] - spread <= scalar_peak
        assert tight is None or tight[k] <= scalar_time.step_with_overlap_s
        if bound is not None and bound > group.usable_bytes:
            assert not fits.any()
            ruled_out += 1
    assert 0 < ruled_out < len(all_groups) and timed


# DeepSpeed ZeRO-2 offload's host copies run every micro-batch only when a step accumulates
# (zeroplan.core.deepspeed_offload_time.stage2_gradient_bytes), which the sweep fits apart from
# one micro-batch a step: its groups are swept, every bound stays below the scalar planner's peak
# and step at each split (1 to 8 accumulation steps), and the pruned search answers as the
# exhaustive one.
@pytest.mark.parametrize("framework", [Framework.zeroplan, Framework.hf], ids=lambda f: f.value)
def test_the_bounds_hold_for_zero2_offload_at_every_accumulation(framework) -> None:
    base = _base("llama-2-7b", 8, "a100-40gb", 2048, framework, 2**38)
    strategies = (StrategyKind.zero2_offload,)
    all_groups, _ = _searched_groups(base, 64, strategies, None)
    all_groups, splits = _schedulable(all_groups, _splits(all_groups, 64), 64)
    for group, (micro, accum) in zip(all_groups, splits):
        assert group.request.strategy.kind is StrategyKind.zero2_offload and int(accum.max()) == 8
        bound = memory_lower_bound(group, accum)
        peaks = peak_lower_bounds(group, micro, accum)
        tight = step_time_lower_bound(group, micro, accum)
        peak, _, seconds = evaluate(group, micro, accum)
        assert not group.scalar_only
        for k in range(len(micro)):
            scalar_peak, _, scalar_time = scalar_plan(_at(group.request, int(micro[k]), int(accum[k])))
            assert peak[k] == scalar_peak and abs(seconds[k] - scalar_time.step_with_overlap_s) <= TIME_TOLERANCE_S
            assert bound <= scalar_peak and peaks[k] <= scalar_peak
            assert tight[k] <= scalar_time.step_with_overlap_s
    pruned = search(base, 64, strategies, top=2, answer_pareto=False)
    _same_answer(pruned, search(base, 64, strategies, top=2, prune=False, answer_pareto=False))
    assert any(c.grad_accum_steps > 1 for c in pruned.ranked)


def test_incumbents_answer_after_an_addition_as_if_built_afresh() -> None:
    # excludes keeps the ranking time and the fastest-by-peak between additions: one asked
    # before an addition must not answer from the configurations found before it.
    rng = np.random.default_rng(2)
    for _ in range(200):
        top = int(rng.integers(0, 5))
        kept = _Incumbents(top)
        all_peaks, all_seconds = np.zeros(0, dtype=np.int64), np.zeros(0)
        for _ in range(int(rng.integers(1, 5))):
            found = int(rng.integers(1, 8))
            peaks, seconds = rng.integers(0, 12, found), rng.integers(0, 12, found).astype(float)
            kept.add(peaks, seconds)
            all_peaks, all_seconds = np.concatenate([all_peaks, peaks]), np.concatenate([all_seconds, seconds])
            fresh = _Incumbents(top)
            fresh.add(all_peaks, all_seconds)
            for _ in range(3):
                size = int(rng.integers(1, 4))
                peak_bounds, seconds_bounds = rng.integers(0, 12, size), rng.integers(0, 12, size).astype(float)
                assert kept.excludes(peak_bounds, seconds_bounds) == fresh.excludes(peak_bounds, seconds_bounds)
