"""The plan search over model-parallel layouts (tp x cp x pp x dp) against the scalar planner."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from zeroplan.core.search import (
    BYTE_TOLERANCE, TIME_TOLERANCE_S, LayoutSpace, _at, evaluate, groups, layout_requests, scalar_evaluate,
    search,
)
from zeroplan.errors import ZeroplanError
from zeroplan.results import PlanCandidate
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, Framework, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.parallel import PIPELINE_STRATEGIES, PipelineSchedule, check_parallel


def _base(model: str, gpus: int, seq_len: int = 2048, framework: Framework = Framework.zeroplan) -> PlanRequest:
    return PlanRequest(
        model=get_model(model), cluster=cluster_from_gpus(get_gpu("h100-80gb"), gpus),
        strategy=StrategySpec(kind=StrategyKind.ddp), batch=BatchSpec(seq_len=seq_len),
        training=TrainingSpec(framework=framework),
    )


def _sample(all_groups, rng, count):
    """Groups of every kind of layout: tensor, pipeline (both schedules), context parallel."""
    kinds = {}
    for g in all_groups:
        p = g.request.parallel
        kinds.setdefault((p.tp > 1, p.pp > 1, p.pp_schedule if p.pp > 1 else None, p.cp > 1), []).append(g)
    return [g for members in kinds.values() for g in rng.sample(members, min(count, len(members)))]


@pytest.mark.parametrize("framework,seq_len", [(Framework.zeroplan, 2048), (Framework.torchtitan, 32768)],
                         ids=["zeroplan", "torchtitan-long"])
def test_vectorised_layouts_equal_the_scalar_planner_where_not_fitted(framework, seq_len) -> None:
    rng = random.Random(f"{framework.value}-{seq_len}")
    base = _base("llama-3.1-8b", 16, seq_len=seq_len, framework=framework)
    space = LayoutSpace(max_tp=4) if seq_len < 32768 else LayoutSpace(max_tp=2, pp=None)
    all_groups = [g for g in groups(base, space=space) if not g.request.parallel.is_trivial]
    # ZeRO-2 offload's host copies are not affine in the accumulation steps
    # (zeroplan.core.deepspeed_offload_time.stage2_gradient_bytes): the scalar planner times it.
    assert all_groups and not any(g.scalar_only and g.request.strategy.kind is not StrategyKind.zero2_offload
                                  for g in all_groups)
    checked = 0
    for group in _sample(all_groups, rng, 2):
        p = group.request.parallel.pp
        # Accumulations on both sides of the pipeline depth: the in-flight count's regimes.
        accum = np.array([1, rng.choice([2, 3]), max(1, p - 1), p, p + rng.randint(1, 9)], dtype=np.int64)
        micro = np.array([rng.randint(1, 6) for _ in accum], dtype=np.int64)
        peak, fits, seconds = evaluate(group, micro, accum)
        for k in range(len(micro)):
            s_peak, s_fits, s_seconds = scalar_evaluate(_at(group.request, int(micro[k]), int(accum[k])))
            assert abs(int(peak[k]) - s_peak) <= BYTE_TOLERANCE, (group.request.parallel, micro[k], accum[k])
            assert abs(float(seconds[k]) - s_seconds) <= TIME_TOLERANCE_S, (group.request.parallel, micro[k], accum[k])
            assert bool(fits[k]) == s_fits
            checked += 1
    assert checked >= 20


def test_layouts_follow_the_rules() -> None:
    base = _base("llama-2-7b", 16)
    layouts = layout_requests(base, LayoutSpace())
    seen = {(r.parallel.tp, r.parallel.pp, r.parallel.pp_schedule, r.parallel.cp) for r in layouts}
    assert (1, 1, PipelineSchedule.one_f_one_b, 1) in seen
    assert {tp for tp, *_ in seen} == {1, 2, 4, 8}
    assert any(pp > 1 and schedule is PipelineSchedule.interleaved_1f1b for _, pp, schedule, _ in seen)
    assert {cp for *_, cp in seen} == {1}  # a short sequence: no context parallelism
    for r in layouts:
        assert r.parallel.sequence_parallel == (r.parallel.tp > 1)
        assert r.parallel.stages <= r.model.num_layers
        assert r.data_parallel_size * r.parallel.model_parallel_size == 16
    long = layout_requests(_base("llama-3.1-8b", 16, seq_len=32768), LayoutSpace())
    assert {r.parallel.cp for r in long} == {1, 2, 4}
    # A framework whose model parallelism is not modelled searches as before.
    hf = layout_requests(_base("llama-2-7b", 16, framework=Framework.hf), LayoutSpace())
    assert [r.parallel.is_trivial for r in hf] == [True]


def test_the_done_when_question_answers_and_may_pick_a_model_parallel_layout(capsys) -> None:
    from zeroplan.cli.main import main

    args = ["plan", "llama-3.1-70b", "--gpus", "64", "--gpu", "h100-80gb", "--global-batch", "512", "--format", "json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layouts_searched"] > 1 and result["best"] is not None
    model = get_model("llama-3.1-70b")
    cluster = cluster_from_gpus(get_gpu("h100-80gb"), 64)
    rows = result["ranked"] + result["pareto"]
    assert any(row["tp"] > 1 or row["pp"] > 1 for row in rows)
    for row in rows:
        request = _base("llama-3.1-70b", 64, seq_len=4096)
        candidate = PlanCandidate(**row)
        # Every layout shown passes the rules, with its strategy.
        # Under the row's own batch: a pipeline's micro-batches are its accumulation steps.
        batch = request.batch.model_copy(update={"micro_batch_size": row["micro_batch_size"],
                                                 "grad_accum_steps": row["grad_accum_steps"]})
        check_parallel(candidate.parallel, model, cluster, batch, StrategyKind(row["strategy"]), request.training.framework)
        if row["pp"] > 1:
            assert row["strategy"] in PIPELINE_STRATEGIES
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == 64
        assert row["micro_batch_size"] * row["grad_accum_steps"] * row["dp"] == 512


def test_a_search_restricted_to_no_model_parallelism_is_todays(capsys) -> None:
    base = _base("llama-2-7b", 16)
    today = search(base, 128, top=8)
    restricted = search(base, 128, top=8, space=LayoutSpace(tp=1, pp=1, cp=1))
    assert restricted.ranked == today.ranked and restricted.pareto == today.pareto
    assert restricted.explanation == today.explanation
    assert restricted.configurations_evaluated == today.configurations_evaluated
    from zeroplan.cli.main import main

    common = ["plan", "gpt2", "--gpus", "8", "--global-batch", "64"]
    assert main([*common, "--tp", "1", "--pp", "1", "--cp", "1"]) == 0
    fixed = capsys.readouterr().out
    assert main([*common, "--no-model-parallel"]) == 0
    assert capsys.readouterr().out == fixed


@pytest.mark.parametrize("flags,named,allowed", [
    (["--tp", "3"], "--tp", "allowed: 1, 2, 4, 8"),
    (["--pp", "5"], "--pp", "allowed: 1, 2, 4"),
    (["--cp", "3"], "--cp", "allowed: 1, 2"),
    (["--tp", "2", "--framework", "hf"], "--tp", "allowed: 1, or --framework zeroplan or torchtitan"),
    (["--pp", "2", "--no-model-parallel"], "--pp", "allowed: 1"),
    (["--pp", "2", "--strategies", "zero3"], "strategies", "allowed under pipeline parallelism: ddp"),
    (["--pp-schedule", "gpipe"], "--pp-schedule", "choose from"),
])
def test_bad_layout_flags_are_refused_in_one_line(zeroplan_cli, flags, named, allowed) -> None:
    code, _, err = zeroplan_cli("plan", "llama-2-7b", "--gpus", "16", "--global-batch", "64", *flags)
    assert code == 2
    err = err.strip()
    assert len(err.splitlines()) == 1 and named in err and allowed in err, err


def test_a_global_batch_no_layout_splits_is_refused() -> None:
    with pytest.raises(ZeroplanError, match="global-batch"):
        search(_base("gpt2", 8, seq_len=1024), 3, space=LayoutSpace(tp=2, pp=1))


def test_a_model_parallel_candidate_is_what_plan_reports() -> None:
    from zeroplan.core.plan import plan

    from zeroplan.core.search import on_flat_reserve

    # The search judges on the flat reserve: so does the scalar plan it is checked against.
    base = on_flat_reserve(_base("llama-3.1-8b", 16))
    result = search(base, 64, top=3, space=LayoutSpace(tp=2, pp=2, pp_schedules=(PipelineSchedule.one_f_one_b,)))
    assert result.ranked
    for c in result.ranked:
        training = base.training.model_copy(update={"activation_checkpointing": c.activation_checkpointing})
        batch = base.batch.model_copy(update={"micro_batch_size": c.micro_batch_size, "grad_accum_steps": c.grad_accum_steps})
        shard = c.shard_group_size if c.strategy is StrategyKind.hsdp else None
        request = base.model_copy(update={"training": training, "batch": batch}).with_parallel(c.parallel).with_strategy(
            StrategySpec(kind=c.strategy, shard_group_size=shard))
        scalar = plan(request)
        assert c.peak_bytes == max(scalar.pipeline_rank_peak_bytes) == scalar.memory.peak_bytes
        assert c.step_time_s == pytest.approx(scalar.time.step_with_overlap_s, rel=0, abs=TIME_TOLERANCE_S)
        assert c.tokens_per_s_per_gpu == pytest.approx(scalar.time.tokens_per_s_per_gpu, rel=1e-9)
        assert c.model_flops_utilization == pytest.approx(scalar.time.model_flops_utilization, rel=1e-9)
        assert (c.tp, c.pp, c.dp) == (2, 2, 4)


@pytest.mark.parametrize("framework,schedule,runs", [
    # torch's Schedule1F1B needs a micro-batch per stage; its interleaved schedule runs 1 to 2 pp - 1.
    (Framework.zeroplan, PipelineSchedule.one_f_one_b, [False, True, True]),
    (Framework.zeroplan, PipelineSchedule.interleaved_1f1b, [True, True, True]),
    # megatron-core's 1F1B takes any count, its interleaved schedule a multiple of pp.
    (Framework.megatron, PipelineSchedule.one_f_one_b, [True, True, True]),
    (Framework.megatron, PipelineSchedule.interleaved_1f1b, [False, True, True]),
])
def test_the_search_splits_a_pipeline_as_the_frameworks_schedule_runs_it(framework, schedule, runs) -> None:
    # The search ranks only what fit plans: each accumulation count it keeps is one the request's
    # own check accepts (a megatron plan had ranked interleaved 1F1B at one micro-batch a step).
    from types import SimpleNamespace

    from zeroplan.core.search import _schedulable
    from zeroplan.specs.parallel import ParallelSpec

    base = _base("qwen3-8b", 32)
    spec = ParallelSpec(pp=2, pp_schedule=schedule, virtual_stages=2 if schedule.interleaved else 1)
    request = type(base)(**{**dict(base), "parallel": spec, "batch": base.batch.model_copy(update={"grad_accum_steps": 2}),
                            "training": base.training.model_copy(update={"framework": framework})})
    accum = np.array([1, 2, 4])
    _, [(_, kept)] = _schedulable([SimpleNamespace(request=request)], [(8 // accum, accum)], 64)
    assert kept.tolist() == accum[runs].tolist()
    for count, ran in zip(accum.tolist(), runs):
        at = request.model_copy(update={"batch": request.batch.model_copy(update={"grad_accum_steps": count})})
        if ran:
            check_parallel(at.parallel, at.model, at.cluster, at.batch, at.strategy.kind, framework)
        else:
            with pytest.raises(ZeroplanError, match="grad_accum_steps"):
                check_parallel(at.parallel, at.model, at.cluster, at.batch, at.strategy.kind, framework)
