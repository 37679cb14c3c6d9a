"""The vectorised plan search against the scalar planner it is built from."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest

from zeroplan.core.search import (
    BYTE_TOLERANCE, TIME_TOLERANCE_S, LayoutSpace, _at, batch_splits, evaluate, groups, pareto_indices, scalar_evaluate, search,
)
from zeroplan.core.communication import collectives
from zeroplan.core.timing import step_time
from zeroplan.errors import ZeroplanError
from zeroplan.specs import Framework, PlanRequest, StrategyKind, StrategySpec

from search_requests import base_request


def _base(model: str, gpus: int, gpu: str = "h100-80gb", seq_len: int = 1024, framework: Framework = Framework.zeroplan,
          host_memory_bytes: int | None = None) -> PlanRequest:
    return base_request(model, gpus, gpu, seq_len, framework, host_memory_bytes)


BASES = [
    ("llama-2-7b", 16, Framework.zeroplan, None),
    ("gpt2", 8, Framework.zeroplan, 2**36),
    ("llama-2-13b", 32, Framework.torchtitan, None),
    ("llama-2-7b", 8, Framework.torchtune, None),
    ("llama-2-70b", 64, Framework.hf, 2**40),
]


@pytest.mark.parametrize("model,gpus,framework,host", BASES, ids=lambda v: str(v))
def test_vectorised_equals_scalar_on_random_configurations(model, gpus, framework, host) -> None:
    rng = random.Random(f"{model}-{gpus}-{framework.value}")
    base = _base(model, gpus, framework=framework, host_memory_bytes=host)
    checked = 0
    for group in groups(base):
        # The coefficients held where checked, ZeRO-2 offload's too (its gradient copies are
        # affine in the accumulation steps from 2 on, not through 1: fitted apart).
        assert not group.scalar_only, group.request.strategy.kind
        micro = np.array([rng.randint(1, 64) for _ in range(3)], dtype=np.int64)
        accum = np.array([rng.choice([1, 1, 2, 3, 8, 17]) for _ in range(3)], dtype=np.int64)
        peak, fits, seconds = evaluate(group, micro, accum)
        for k in range(len(micro)):
            s_peak, s_fits, s_seconds = scalar_evaluate(_at(group.request, int(micro[k]), int(accum[k])))
            assert abs(int(peak[k]) - s_peak) <= BYTE_TOLERANCE
            assert abs(float(seconds[k]) - s_seconds) <= TIME_TOLERANCE_S
            assert bool(fits[k]) == s_fits
            checked += 1
    assert checked >= 3 * 3


def test_batch_splits_multiply_to_the_global_batch() -> None:
    micro, accum = batch_splits(24 * 8, 8)
    assert sorted(micro.tolist()) == [1, 2, 3, 4, 6, 8, 12, 24]
    assert set((micro * accum * 8).tolist()) == {192}
    with pytest.raises(ZeroplanError, match="global-batch"):
        batch_splits(100, 8)


def test_pareto_front_is_not_dominated() -> None:
    rng = np.random.default_rng(0)
    peak, seconds = rng.integers(0, 50, 200), rng.integers(0, 50, 200).astype(float)
    front = set(pareto_indices(peak, seconds).tolist())
    points = set(zip(peak.tolist(), seconds.tolist()))
    for i in range(200):
        dominated = any(p <= peak[i] and t <= seconds[i] and (p, t) != (peak[i], seconds[i]) for p, t in points)
        if i in front:
            assert not dominated
        elif not dominated:  # an equal point is on the front instead
            assert any((peak[j], seconds[j]) == (peak[i], seconds[i]) for j in front)
    assert len({(peak[j], seconds[j]) for j in front}) == len(front)


def _candidate_step_time(base: PlanRequest, c):
    """The scalar planner's StepTime for a search candidate's configuration."""
    training = base.training.model_copy(update={"activation_checkpointing": c.activation_checkpointing})
    batch = base.batch.model_copy(update={"micro_batch_size": c.micro_batch_size, "grad_accum_steps": c.grad_accum_steps})
    strategy = StrategySpec(kind=c.strategy, shard_group_size=c.shard_group_size if c.strategy is StrategyKind.hsdp else None)
    request = base.model_copy(update={"training": training, "batch": batch, "strategy": strategy})
    return step_time(request, tuple(collectives(request)))


def test_search_ranks_by_time_and_matches_a_brute_force_over_the_scalar_planner() -> None:
    base = _base("llama-2-7b", 8, seq_len=4096)
    result = search(base, 64, top=5)
    brute = []
    for group in groups(base):
        micro, accum = batch_splits(64, 8)
        for b, a in zip(micro.tolist(), accum.tolist()):
            peak, fits, seconds = scalar_evaluate(_at(group.request, b, a))
            if fits:
                brute.append((seconds, peak))
    brute.sort()
    # The exhaustive search counts every fitting configuration; branch and bound (the default)
    # those of the groups it evaluated, the same ranking.
    exhaustive = search(base, 64, top=5, prune=False)
    assert exhaustive.configurations_fitting == len(brute) and exhaustive.configurations_bounded_out == 0
    assert result.ranked == exhaustive.ranked
    assert result.configurations_fitting <= len(brute)
    assert [c.step_time_s for c in result.ranked] == pytest.approx([t for t, _ in brute[:5]], rel=0, abs=TIME_TOLERANCE_S)
    assert [c.peak_bytes for c in result.ranked] == [p for _, p in brute[:5]]
    assert result.best == result.ranked[0]
    for c in result.ranked:
        assert c.micro_batch_size * c.grad_accum_steps * 8 == 64
        assert c.peak_bytes <= c.usable_memory_bytes
        assert c.tokens_per_s_per_gpu == pytest.approx(c.micro_batch_size * c.grad_accum_steps * 4096 / c.step_time_s)
        # The candidate's MFU is the scalar planner's StepTime.model_flops_utilization.
        scalar = _candidate_step_time(base, c)
        assert c.model_flops_utilization == pytest.approx(scalar.model_flops_utilization, rel=1e-9)
        assert c.tokens_per_s_per_gpu == pytest.approx(scalar.tokens_per_s_per_gpu, rel=1e-9)
    times = [c.step_time_s for c in result.pareto]
    peaks = [c.peak_bytes for c in result.pareto]
    assert peaks == sorted(peaks) and times == sorted(times, reverse=True)
    assert result.best.strategy.value in result.explanation


def test_framework_profile_limits_strategies_and_policies() -> None:
    base = _base("llama-2-7b", 8, framework=Framework.torchtune)
    kinds = {g.request.strategy.kind for g in groups(base)}
    policies = {g.request.training.activation_checkpointing.value for g in groups(base)}
    assert kinds == {StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op}
    # torchtune 0.6.1 offers selective-layer too (at the request's interval, 2 by default).
    assert policies == {"none", "full", "selective-layer"}
    with pytest.raises(ZeroplanError, match="strategies"):
        search(base, 8, (StrategyKind.zero2,))


def test_a_selective_layer_interval_past_the_blocks_is_not_searched() -> None:
    base = _base("llama-2-7b", 8, framework=Framework.torchtune)
    shallow = base.model_copy(update={"model": base.model.model_copy(update={"num_layers": 1})})
    assert {g.request.training.activation_checkpointing.value for g in groups(shallow)} == {"none", "full"}


def test_hsdp_groups_divide_the_gpus() -> None:
    sizes = sorted(g.request.shard_group_size for g in groups(_base("gpt2", 16)) if g.request.strategy.kind is StrategyKind.hsdp)
    assert sorted(set(sizes)) == [2, 4, 8]


def test_nothing_fits_says_so() -> None:
    result = search(_base("llama-2-70b", 1, gpu="a100-40gb"), 1, (StrategyKind.ddp, StrategyKind.zero3))
    assert result.best is None and result.ranked == () and "Nothing fits" in result.explanation


def test_frame_has_one_row_per_ranked_configuration() -> None:
    result = search(_base("gpt2", 8), 64, top=4)
    frame = result.to_dataframe()
    assert len(frame) == len(result.ranked) == 4
    assert list(frame["step_time_s"]) == [c.step_time_s for c in result.ranked]


def test_cli_plan_prints_a_table_and_a_recommendation(capsys) -> None:
    from zeroplan.cli.main import main

    assert main(["plan", "gpt2", "--gpus", "8", "--global-batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "Pareto front" in out and "Best:" in out


@pytest.mark.parametrize("caught_by", ["group check", "verification of the shown rows"])
def test_a_sweep_that_disagrees_with_the_scalar_planner_falls_back_to_it(monkeypatch, caught_by) -> None:
    import zeroplan.core.search as search_module

    base = _base("llama-2-7b", 8, seq_len=4096)
    honest = search(base, 64, top=5)
    exhaustive = search(base, 64, top=5, prune=False)
    real = search_module._peaking

    def skewed(group, allocated, class_seconds, host_ok):
        # Every sweep and every group's check pass through _peaking (the peaking rank class).
        peak, fits, seconds = real(group, allocated, class_seconds, host_ok)
        if caught_by != "group check" and allocated.shape[1] == 1:  # the group's own check passes
            return peak, fits, seconds
        return peak, fits, seconds * (1 + 1e-3 * np.arange(1, seconds.size + 1))  # wrong, and it changes the order

    monkeypatch.setattr(search_module, "_peaking", skewed)
    fallback = search(base, 64, top=5)
    scalar_groups = [g.scalar_only for g in search_module.groups(base)]
    assert all(scalar_groups) == (caught_by == "group check")
    assert [(c.step_time_s, c.peak_bytes) for c in fallback.ranked] == [(c.step_time_s, c.peak_bytes) for c in honest.ranked]
    if caught_by == "group check":
        # Every group answered by the scalar planner, whose times the bounds hold for too: the
        # same groups bounded out.
        assert (fallback.configurations_fitting, fallback.configurations_bounded_out) == (
            honest.configurations_fitting, honest.configurations_bounded_out)
    else:
        # The scalar planner ranks every group the memory bound leaves, none bounded out.
        assert fallback.configurations_bounded_out == 0
        assert fallback.configurations_fitting == exhaustive.configurations_fitting


def test_plan_command_runs_with_torch_blocked() -> None:
    import subprocess

    program = (
        "import sys; sys.modules['torch'] = None\n"
        "from zeroplan.cli.main import main\n"
        "assert main(['plan', 'gpt2', '--global-batch', '16', '--format', 'json']) == 0\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_plan_table_splits_each_step_into_compute_exposed_communication_and_host(capsys) -> None:
    # The ZeRO trade-off at a glance: each ranked configuration's step time in its parts.
    from zeroplan.cli.main import main

    assert main(["plan", "--detail", "llama-3.1-70b", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "16", "--format", "json"]) == 0
    import json

    ranked = json.loads(capsys.readouterr().out)["ranked"]
    offloaded = [c for c in ranked if c["strategy"].endswith("offload")]
    assert ranked and offloaded and all(c["compute_s"] > 0 for c in ranked)
    assert all(c["cpu_optimizer_s"] > 0 and c["host_transfer_s"] > 0 for c in offloaded)
    for c in ranked:
        # The parts add up to the step, the model-parallel collectives and the bubble included.
        parts = ("compute_s", "model_parallel_communication_s", "pipeline_bubble_s", "exposed_communication_s",
                 "cpu_optimizer_s", "optimizer_step_s")
        assert sum(c[name] for name in parts) == pytest.approx(c["step_time_s"], rel=1e-9)
    assert main(["plan", "--detail", "llama-3.1-70b", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "compute  exposed" in out or "compute  mp-comm  bubble  exposed" in out


@pytest.mark.parametrize("gpu, compiled", [("a100-80gb", True), ("h100-80gb", False), ("b200", False)])
def test_the_search_times_the_memory_bound_kernels_as_the_scalar_planner(gpu, compiled) -> None:
    # Under the flat HFU the memory-bound kernels run at the copy bandwidth
    # (zeroplan.core.timing.memory_bound_time_s), some once per micro-batch whatever its size
    # (FSDP's copies): compute is affine in the micro-batch, not proportional to it, and the
    # search's two-point fit gives the planner's step where it was not fitted. A GPU without a
    # measured bandwidth (b200) has its HFU cover every kernel: proportional.
    from zeroplan.core.search import _build_group, _vectorised, on_flat_reserve

    base = on_flat_reserve(_base("llama-2-7b", 16, gpu=gpu, seq_len=2048, framework=Framework.torchtitan))
    request = base.model_copy(update={"strategy": StrategySpec(kind=StrategyKind.fsdp_full_shard),
                                      "training": base.training.model_copy(update={"compile": compiled})})
    group = _build_group(request)
    assert not group.scalar_only
    per_pass = group.forward_s_per_pass + group.backward_s_per_pass
    assert per_pass > 1e-4 if gpu != "b200" else abs(per_pass) < 1e-12
    for micro, accum in ((1, 1), (3, 2), (7, 5)):
        _, _, seconds = _vectorised(group, np.array([micro]), np.array([accum]))
        at = _at(request, micro, accum)
        assert float(seconds[0]) == pytest.approx(step_time(at, tuple(collectives(at))).step_with_overlap_s,
                                                  abs=TIME_TOLERANCE_S)


def test_the_front_s_own_rows_are_asked_of_the_allocator_model_only_where_they_are_shown() -> None:
    # zeroplan plan's first screen shows the ranked rows alone (answer_pareto=False): the same
    # ranking and front, the ranked rows' answers on the front's rows they share, the others
    # left unasked (allocator_fits None) instead of replayed for nothing.
    base = _base("gpt2", 8)
    shown = search(base, 8, top=1)
    first_screen = search(base, 8, top=1, answer_pareto=False)
    assert first_screen.ranked == shown.ranked and first_screen.best == shown.best
    assert len(first_screen.pareto) == len(shown.pareto) and any(c not in shown.ranked for c in shown.pareto)
    assert all(c.allocator_fits is not None for c in shown.pareto)
    for asked, left in zip(shown.pareto, first_screen.pareto):
        if asked in shown.ranked:
            assert left == asked
        else:
            assert left == asked.model_copy(update={"allocator_fits": None, "allocator_peak_bytes": None})


# DeepSpeed ZeRO-2 offload copies each micro-batch's gradients to the host only when a step
# accumulates (zeroplan.core.deepspeed_offload_time.stage2_gradient_bytes: f E at one micro-batch,
# (f - m) E + 2 a m E past it): the sweep fits one micro-batch and more apart, and answers as the
# scalar planner at every accumulation, with the copies hidden (overlap_comm) or exposed, the
# CPU Adam kernel's in-step copy or the cast after it, the reference model and the hf stack
# (which unscales on the host), tensor parallel or not.
@pytest.mark.parametrize("framework,overlap,in_step_copy,tp", [
    (Framework.zeroplan, None, False, 1),
    (Framework.zeroplan, True, True, 2),
    (Framework.hf, False, False, 1),
], ids=lambda v: str(v))
def test_zero2_offload_is_swept_and_answers_as_the_scalar_planner_at_every_accumulation(framework, overlap, in_step_copy, tp) -> None:
    base = _base("gpt2", 8, framework=framework, host_memory_bytes=2**36)
    performance = base.performance.model_copy(update={"overlap_grad_reduce": overlap, "cpu_adam_copies_parameters": in_step_copy})
    base = base.model_copy(update={"performance": performance})
    space = None if tp == 1 else LayoutSpace(tp=tp, pp=1)
    offload = groups(base, strategies=(StrategyKind.zero2_offload,), space=space)
    assert offload and all(g.request.parallel.tp == tp for g in offload)
    micro = np.array([1, 3, 2, 5, 1, 4, 2], dtype=np.int64)
    accum = np.array([1, 2, 3, 4, 6, 9, 32], dtype=np.int64)
    for group in offload:
        assert not group.scalar_only
        peak, fits, seconds = evaluate(group, micro, accum)
        for k in range(len(micro)):
            s_peak, s_fits, s_seconds = scalar_evaluate(_at(group.request, int(micro[k]), int(accum[k])))
            assert abs(int(peak[k]) - s_peak) <= BYTE_TOLERANCE
            assert abs(float(seconds[k]) - s_seconds) <= TIME_TOLERANCE_S, (int(accum[k]), float(seconds[k]), s_seconds)
            assert bool(fits[k]) == s_fits


def test_the_sweep_s_in_flight_chunks_are_the_planner_s_at_every_accumulation() -> None:
    # The sweep takes every accumulation of a group at once (numpy's minimum and maximum).
    from zeroplan.core.parallel.pipeline import in_flight_chunks
    from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule

    accum = np.arange(1, 70, dtype=np.int64)
    schedules = set()
    for schedule in PipelineSchedule:
        for pp, virtual in ((2, 1), (4, 1), (4, 2), (8, 3)):
            try:
                parallel = ParallelSpec(pp=pp, pp_schedule=schedule, virtual_stages=virtual)
            except ZeroplanError:
                continue  # a schedule that runs other virtual stages
            schedules.add(schedule)
            for rank in range(pp):
                swept = in_flight_chunks(parallel, rank, accum, minimum=np.minimum, maximum=np.maximum)
                assert np.broadcast_to(swept, accum.shape).tolist() == [in_flight_chunks(parallel, rank, a) for a in accum.tolist()]
    assert schedules == set(PipelineSchedule)


def test_fsdp1s_gathered_root_keeps_its_activation_terms_apart_from_the_other_strategies() -> None:
    # Under FSDP1 (StrategySpec.fsdp1_root_stays_gathered) the reference model's full-shard rank
    # holds its gathered root at the loss, which ddp and the ZeRO stages do not: the sweep's
    # shared micro-batch terms must not carry one strategy's to the other.
    base = _base("llama-2-7b", 16)
    base = base.with_strategy(base.strategy.model_copy(update={"fsdp1_root_stays_gathered": True}))
    micro, accum = np.array([1, 4, 9], dtype=np.int64), np.array([1, 2, 8], dtype=np.int64)
    kinds = set()
    for group in groups(base):
        kinds.add(group.request.strategy.kind)
        peak, fits, seconds = evaluate(group, micro, accum)
        for k in range(len(micro)):
            s_peak, s_fits, s_seconds = scalar_evaluate(_at(group.request, int(micro[k]), int(accum[k])))
            assert abs(int(peak[k]) - s_peak) <= BYTE_TOLERANCE, group.request.strategy.kind
            assert bool(fits[k]) == s_fits
    assert {StrategyKind.ddp, StrategyKind.fsdp_full_shard} <= kinds
