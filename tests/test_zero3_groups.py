"""ZeRO++'s hpZ and MiCS (zeroplan.core.zero3_groups): their memory and collectives against
ZeRO-3 and HSDP, the refusals, and fit/compare/plan taking them only when named."""

from __future__ import annotations

import pytest

from zeroplan.cli.main import main
from zeroplan.core.buffers import resident_buffer_bytes
from zeroplan.core.collective import CollectiveOp, Phase
from zeroplan.core.communication import collectives
from zeroplan.core.model_states import model_state_bytes, unit_gather_bytes
from zeroplan.core.plan import fit
from zeroplan.core.zero3_groups import hpz_secondary_partition_bytes
from zeroplan.errors import ZeroplanError
from zeroplan.presets.models import get_model
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs import BatchSpec, PlanRequest, StateConvention, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus

MODEL = get_model("llama-2-7b")


def _request(gpu, kind, gpus=16, accum=1, convention=None, **strategy) -> PlanRequest:
    return PlanRequest(
        model=MODEL, batch=BatchSpec(grad_accum_steps=accum), training=TrainingSpec(state_convention=convention),
        cluster=cluster_from_gpus(gpu, gpus, gpus_per_node=min(8, gpus)), strategy=StrategySpec(kind=kind, **strategy),
    )


def _by(request, op, phase):
    return [c for c in collectives(request) if c.op is op and c.phase is phase]


def test_hpz_keeps_zero3_model_states_and_adds_the_secondary_partition(gpu_80gib) -> None:
    zero3, hpz = _request(gpu_80gib, StrategyKind.zero3), _request(gpu_80gib, StrategyKind.zero3_hpz)
    assert model_state_bytes(hpz) == model_state_bytes(zero3)
    assert hpz.hpz_group_size == 8 and hpz.shard_group_size == 16
    # Every unit padded for N = 16, in bf16, cut in H = 8: 1/8 of the (padded) bf16 parameters.
    secondary = sum(b // 8 for b in unit_gather_bytes(hpz, 16, 2))
    assert hpz_secondary_partition_bytes(hpz) == secondary
    assert resident_buffer_bytes(hpz) - resident_buffer_bytes(zero3) == secondary
    assert hpz_secondary_partition_bytes(zero3) == 0


def test_hpz_secondary_adds_to_deepspeeds_stage3_buffers(gpu_80gib) -> None:
    zero3 = _request(gpu_80gib, StrategyKind.zero3, convention=StateConvention.deepspeed)
    hpz = _request(gpu_80gib, StrategyKind.zero3_hpz, convention=StateConvention.deepspeed, hpz_partition_size=4)
    assert resident_buffer_bytes(hpz) - resident_buffer_bytes(zero3) == hpz_secondary_partition_bytes(hpz)
    assert hpz_secondary_partition_bytes(hpz) == sum(b // 4 for b in unit_gather_bytes(hpz, 16, 2))


@pytest.mark.parametrize("accum", [1, 3])
def test_hpz_gathers_over_all_ranks_once_then_inside_the_node(gpu_80gib, accum) -> None:
    """deepspeed 0.19.8 partition_parameters.py all_gather_coalesced takes the secondary copy
    whenever it exists: only the first forward after a step gathers over N."""
    zero3, hpz = _request(gpu_80gib, StrategyKind.zero3, accum=accum), _request(gpu_80gib, StrategyKind.zero3_hpz, accum=accum)
    (zero3_forward,) = _by(zero3, CollectiveOp.all_gather, Phase.forward)
    forward = _by(hpz, CollectiveOp.all_gather, Phase.forward)
    assert forward[0].group_size == 16 and forward[0].occurrences_per_step == 1 and forward[0].spans_nodes
    assert forward[0].buffer_bytes == zero3_forward.buffer_bytes
    if accum > 1:
        assert forward[1].group_size == 8 and forward[1].occurrences_per_step == accum - 1 and not forward[1].spans_nodes
    else:
        assert len(forward) == 1
    (backward,) = _by(hpz, CollectiveOp.all_gather, Phase.backward)
    (zero3_backward,) = _by(zero3, CollectiveOp.all_gather, Phase.backward)
    assert (backward.group_size, backward.spans_nodes, backward.occurrences_per_step) == (8, False, accum)
    assert backward.buffer_bytes == zero3_backward.buffer_bytes
    # Gradients: reduce-scattered over all N ranks as under ZeRO-3.
    assert _by(hpz, CollectiveOp.reduce_scatter, Phase.backward) == _by(zero3, CollectiveOp.reduce_scatter, Phase.backward)
    assert sum(c.sent_bytes_per_step for c in collectives(hpz)) < sum(c.sent_bytes_per_step for c in collectives(zero3))


def test_mics_is_zero3_over_its_shard_group(gpu_80gib) -> None:
    mics = _request(gpu_80gib, StrategyKind.zero3_mics, mics_shard_size=4)
    on_4 = _request(gpu_80gib, StrategyKind.zero3, gpus=4)
    assert mics.shard_group_size == 4
    assert model_state_bytes(mics) == model_state_bytes(on_4)
    assert resident_buffer_bytes(mics) == 0


@pytest.mark.parametrize("accum", [1, 2])
def test_mics_all_reduces_gradient_partitions_across_replicas_once_per_step(gpu_80gib, accum) -> None:
    """mics.py allreduce_mics_shard_grads: at the accumulation boundary, over the N/M ranks
    holding the same shard; the shard group's own collectives are ZeRO-3's over M."""
    mics = _request(gpu_80gib, StrategyKind.zero3_mics, accum=accum)
    (reduce_scatter,) = _by(mics, CollectiveOp.reduce_scatter, Phase.backward)
    assert reduce_scatter.group_size == 8 and not reduce_scatter.spans_nodes
    assert reduce_scatter.occurrences_per_step == accum
    (all_reduce,) = _by(mics, CollectiveOp.all_reduce, Phase.backward)
    assert (all_reduce.group_size, all_reduce.occurrences_per_step, all_reduce.ranks_per_node) == (2, 1, 1)
    # Each rank's partition: the reduce-scattered buffer over M.
    assert all_reduce.buffer_bytes == sum(-(-n // 8) for n, k in reduce_scatter.call_sizes for _ in range(k))
    hsdp = _request(gpu_80gib, StrategyKind.hsdp, accum=accum)
    (hsdp_all_reduce,) = _by(hsdp, CollectiveOp.all_reduce, Phase.backward)
    # The same elements (HSDP reduces in fp32 by default, MiCS in the model's bf16).
    assert hsdp_all_reduce.buffer_bytes // hsdp_all_reduce.element_bytes == all_reduce.buffer_bytes // 2
    assert hsdp_all_reduce.occurrences_per_step == accum  # HSDP reduces every micro-batch


def test_one_shard_group_has_no_replica_all_reduce(gpu_80gib) -> None:
    mics = _request(gpu_80gib, StrategyKind.zero3_mics, gpus=8)
    assert not _by(mics, CollectiveOp.all_reduce, Phase.backward)


@pytest.mark.parametrize("kind, field, flag", [(StrategyKind.zero3_hpz, "hpz_partition_size", "--hpz-partition-size"),
                                               (StrategyKind.zero3_mics, "mics_shard_size", "--mics-shard-size")])
def test_a_group_that_does_not_divide_the_ranks_is_refused(gpu_80gib, capsys, kind, field, flag) -> None:
    with pytest.raises(ZeroplanError, match=f"strategy.{field}: .*allowed: a divisor of 16"):
        _request(gpu_80gib, kind, **{field: 3})
    assert main(["fit", "llama-2-7b", "--gpus", "16", "--strategies", kind.value, flag, "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"zeroplan: error: {flag}:") and "a divisor of 16" in err


def test_model_parallelism_is_refused(gpu_80gib) -> None:
    with pytest.raises(ZeroplanError, match="data parallelism only"):
        PlanRequest(model=MODEL, cluster=cluster_from_gpus(gpu_80gib, 16, gpus_per_node=8),
                    strategy=StrategySpec(kind=StrategyKind.zero3_hpz), parallel=ParallelSpec(tp=2, sequence_parallel=True))


def test_fit_takes_them_only_when_named(gpu_80gib) -> None:
    base = _request(gpu_80gib, StrategyKind.zero3)
    assert not {StrategyKind.zero3_hpz, StrategyKind.zero3_mics} & {p.strategy for p in fit(base).plans}
    named = fit(base, [StrategyKind.zero3, StrategyKind.zero3_hpz, StrategyKind.zero3_mics])
    assert [p.strategy for p in named.plans] == [StrategyKind.zero3, StrategyKind.zero3_hpz, StrategyKind.zero3_mics]


def test_compare_shows_the_trade_off(capsys) -> None:
    assert main(["compare", "llama-2-70b", "--gpus", "16", "--gpu", "a100-80gb", "--strategies", "zero3,zero3-hpz",
                 "--detail", "--format", "json"]) == 0
    import json

    plans = {p["strategy"]: p for p in json.loads(capsys.readouterr().out)["plans"]}
    zero3, hpz = plans["zero3"], plans["zero3-hpz"]
    assert hpz["sent_bytes_per_step"] < zero3["sent_bytes_per_step"]
    assert hpz["memory"]["peak_bytes"] > zero3["memory"]["peak_bytes"]


def test_plan_searches_them_only_when_named(capsys) -> None:
    argv = ["plan", "llama-2-7b", "--gpus", "16", "--global-batch", "32", "--no-model-parallel", "--top", "40"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "zero3-hpz" not in out and "zero3-mics" not in out
    assert main(argv + ["--strategies", "zero3-hpz,zero3-mics", "--mics-shard-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "zero3-hpz" in out and "zero3-mics" in out
