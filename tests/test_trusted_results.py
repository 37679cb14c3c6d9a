"""Frozen.trusted builds the planner's results (each plan, its breakdown, step time and collectives, the allocator's verdict)
without validating them: what validation would build from the same values, type for type (an
int field never holding a bool or a float, a tuple never a list), over fit's results for three
stacks, under the caching-allocator model and the flat reserve."""

from __future__ import annotations

import pytest

from zeroplan.allocator.planner import PlannedVerdict
from zeroplan.core.plan import fit
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.results import MemoryBreakdown, StrategyPlan
from zeroplan.specs import BatchSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.base import Frozen


def _same(trusted: object, validated: object) -> bool:
    """Equal, and of the same type at every level (1 == 1.0 == True in Python, not here)."""
    if type(trusted) is not type(validated):
        return False
    if isinstance(trusted, Frozen):
        return (trusted.model_fields_set == validated.model_fields_set and list(trusted.__dict__) == list(validated.__dict__)
                and all(_same(trusted.__dict__[name], validated.__dict__[name]) for name in trusted.__dict__))
    if isinstance(trusted, tuple):
        return len(trusted) == len(validated) and all(map(_same, trusted, validated))
    return trusted == validated


def _validated(result: Frozen) -> Frozen:
    return type(result)(**{name: getattr(result, name) for name in result.model_fields_set})


@pytest.mark.parametrize(("framework", "allocator_conf"), [("zeroplan", ""), ("hf", None), ("torchtitan", "")])
def test_fits_results_are_what_validation_builds(framework: str, allocator_conf: str | None) -> None:
    request = PlanRequest(model=get_model("tinyllama-1.1b"), cluster=cluster_from_gpus(get_gpu("a100-40gb"), 4),
                          strategy=StrategySpec(kind="zero3"), batch=BatchSpec(seq_len=2048, micro_batch_size=4),
                          training=TrainingSpec(framework=framework)).with_allocator_conf(allocator_conf)
    for plan in fit(request, suggest=False, largest_micro_batch=False).plans:
        assert _same(plan, _validated(plan)) and _same(plan.memory, _validated(plan.memory))
        assert plan.time is not None and _same(plan.time, _validated(plan.time))
        assert plan.collectives and all(_same(c, _validated(c)) for c in plan.collectives)
        assert plan.time.collective_times and all(_same(c, _validated(c)) for c in plan.time.collective_times)


def test_model_parallel_collectives_are_what_validation_builds() -> None:
    """make_collective builds every collective unvalidated, collective_layout each one's layout
    and collective_cost its price: the tensor-, sequence- and pipeline-parallel ones too (a layout of tp 2 with
    sequence parallelism, pp 2, interleaved)."""
    from zeroplan.core.communication import collectives
    from zeroplan.specs.parallel import ParallelSpec

    request = PlanRequest(model=get_model("tinyllama-1.1b"), cluster=cluster_from_gpus(get_gpu("a100-40gb"), 8),
                          strategy=StrategySpec(kind="zero1"), batch=BatchSpec(seq_len=2048, micro_batch_size=2, grad_accum_steps=4),
                          training=TrainingSpec(framework="torchtitan"),
                          parallel=ParallelSpec(tp=2, sequence_parallel=True, pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2))
    from zeroplan.core.algorithms import collective_cost, collective_layout

    found = collectives(request)
    assert any(c.blocking for c in found) and all(_same(c, _validated(c)) for c in found)
    layouts = [collective_layout(request, c) for c in found]
    assert all(_same(layout, _validated(layout)) for layout in layouts)
    prices = [collective_cost(request, c) for c in found]
    assert all(_same(price, _validated(price)) for price in prices)


def test_a_verdict_is_what_validation_builds_and_a_bad_field_is_refused() -> None:
    verdict = PlannedVerdict.trusted(fits=True, reserved_peak_bytes=3 << 30)
    assert _same(verdict, PlannedVerdict(fits=True, reserved_peak_bytes=3 << 30))
    with pytest.raises(ValueError, match="reserved_peak_bytes"):
        PlannedVerdict.trusted(fits=True)
    with pytest.raises(ValueError, match="unknown"):
        MemoryBreakdown.trusted(unknown=1)
    with pytest.raises(ValueError):
        StrategyPlan.trusted()


def test_memory_passes_are_what_validation_builds() -> None:
    from zeroplan.core.roofline.operations import OpPass, memory_pass, step_operations

    model = get_model("tinyllama-1.1b")
    operations = step_operations(model, TrainingSpec(activation_checkpointing="full"), 4, 2048, 2, 2, memory_only=True)
    operations.append(memory_pass("optimizer step", OpPass.optimizer, 12.5, 1))
    assert operations and all(_same(op, _validated(op)) for op in operations)
    with pytest.raises(ValueError, match="moved_bytes"):
        memory_pass("norms", OpPass.forward, -1, 1)


def test_tensor_parallel_units_are_what_validation_builds(monkeypatch) -> None:
    """_rank_unit builds a tensor-parallel rank's units and tensors unvalidated."""
    from zeroplan.core.param_tensors import ParamTensor, ParamUnit
    from zeroplan.core.parallel import tensor
    from zeroplan.core.params import parameter_units

    monkeypatch.setattr(tensor, "_RANK_UNITS", {})  # built here, not kept from another test
    units = tensor.tensor_parallel_units(parameter_units(get_model("tinyllama-1.1b")), 2)
    assert len(units) > 2
    for unit in units:
        validated = ParamUnit(name=unit.name, tensors=tuple(
            ParamTensor(name=t.name, shape=t.shape, shard_group_divisor=t.shard_group_divisor, trainable=t.trainable,
                        quantized=t.quantized) for t in unit.tensors))
        assert _same(unit, validated)
        assert all(t.numel == validated_t.numel for t, validated_t in zip(unit.tensors, validated.tensors))
    # A tensor's other fields are its own on the rank: a frozen, quantized one stays so.
    kept = ParamUnit(name="block.0", tensors=(
        ParamTensor(name="attention.q.weight", shape=(64, 64), trainable=False, quantized=True, shard_group_divisor=2),))
    assert kept.tensors[0].numel == 4096  # cached before the split
    (split,) = tensor.tensor_parallel_units((kept,), 2)[0].tensors
    assert (split.shape, split.numel) == ((32, 64), 2048)
    assert (split.trainable, split.quantized, split.shard_group_divisor) == (False, True, 2)
