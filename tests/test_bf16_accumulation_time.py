"""DeepSpeed BF16_Optimizer's per-micro-batch fp32 gradient accumulation, timed as memory-bound
passes (zeroplan.core.bf16_accumulation_time)."""

from __future__ import annotations

import pytest

from zeroplan.core.bf16_accumulation_time import (
    CLEARED_HP_GRAD_BYTES, UPDATE_HP_GRAD_BYTES, ZEROED_GRAD_BYTES, bf16_accumulation_bytes, check_fp32_accumulation, fp32_accumulation_runs,
)
from zeroplan.core.parallel.units import rank_trainable_elements
from zeroplan.core.roofline.ceilings import gpu_ceilings
from zeroplan.core.timing import memory_bound_time_s
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, PerformanceAssumptions, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus,
)
from zeroplan.specs.training import Precision
from zeroplan.validate.rows import FLAT_RESERVE


def _request(accumulation: bool | None, kind: StrategyKind = StrategyKind.zero1,
             precision: Precision = Precision.bf16_mixed, micro_batches: int = 4) -> PlanRequest:
    return PlanRequest(model=get_model("gpt2"), training=TrainingSpec(precision=precision),
                       batch=BatchSpec(micro_batch_size=1, seq_len=1024, grad_accum_steps=micro_batches),
                       cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8), strategy=StrategySpec(kind=kind),
                       performance=PerformanceAssumptions(hardware_flops_utilization=0.5, fp32_grad_accumulation=accumulation),
                       assumptions=FLAT_RESERVE)


def test_bytes_per_element_are_the_cast_add_and_the_zeroed_grads_accumulation() -> None:
    # cast bf16 -> fp32 (2 + 4), add into the fp32 buffer (4 + 4 + 4); from the second
    # micro-batch on, foreach_zero_ (2) and AccumulateGrad's in-place add (2 + 2 + 2); after the
    # step the fp32 buffer zeroed (4).
    assert (UPDATE_HP_GRAD_BYTES, ZEROED_GRAD_BYTES, CLEARED_HP_GRAD_BYTES) == (18, 8, 4)
    assert bf16_accumulation_bytes(10, 1) == 10 * (18 + 4)
    assert bf16_accumulation_bytes(10, 4) == 10 * (4 * 18 + 3 * 8 + 4)


def test_the_step_moves_them_at_the_copy_bandwidth() -> None:
    with_it, without = _request(True), _request(None)
    assert fp32_accumulation_runs(with_it) and not fp32_accumulation_runs(without)
    added_s = sum(memory_bound_time_s(with_it)) - sum(memory_bound_time_s(without))
    expected_s = bf16_accumulation_bytes(rank_trainable_elements(with_it), 4) / gpu_ceilings(get_gpu("a100-80gb")).memory_bytes_per_s
    assert added_s == pytest.approx(expected_s, rel=1e-9)


@pytest.mark.parametrize(("kind", "precision", "named"), [
    (StrategyKind.zero1, Precision.fp16_mixed, "bf16-mixed"), (StrategyKind.zero3, Precision.bf16_mixed, "zero1"),
])
def test_where_bf16_optimizer_does_not_run_it_is_refused_in_one_line(kind, precision, named) -> None:
    with pytest.raises(ZeroplanError) as refused:
        check_fp32_accumulation(_request(True, kind, precision))
    message = str(refused.value)
    assert "performance.fp32_grad_accumulation" in message and named in message and "\n" not in message
    check_fp32_accumulation(_request(None, kind, precision))  # unset: nothing to refuse


def test_the_megatron_deepspeed_profile_runs_it_where_it_runs_bf16_optimizer() -> None:
    from zeroplan.specs.framework import Framework

    request = _request(None)
    request = request.model_copy(update={
        "training": request.training.model_copy(update={"framework": Framework.megatron_deepspeed}),
        "strategy": request.strategy.model_copy(update={"deepspeed_grad_accum_fp32": True})})
    assert fp32_accumulation_runs(request)
    off = request.model_copy(update={"performance": request.performance.model_copy(update={"fp32_grad_accumulation": False})})
    assert not fp32_accumulation_runs(off)


def test_the_2022_bigscience_release_drops_the_bf16_gradients_instead_of_zeroing_them() -> None:
    # microsoft/DeepSpeed@15293139f runtime/bf16_optimizer.py:275-278: clear_lp_grads sets each
    # .grad to None, so neither the zeroing nor AccumulateGrad's in-place add runs.
    from zeroplan.specs.framework import Framework

    assert bf16_accumulation_bytes(10, 4, drops_lp_grads=True) == 10 * (4 * 18 + 4)
    base = _request(True)
    current = base.model_copy(update={"training": base.training.model_copy(update={"framework": Framework.megatron_deepspeed})})
    current = PlanRequest.model_validate(current.model_dump())
    bigscience = PlanRequest.model_validate(current.model_copy(update={
        "training": current.training.model_copy(update={"deepspeed_release": "2022-bigscience"})}).model_dump())
    saved_s = sum(memory_bound_time_s(current)) - sum(memory_bound_time_s(bigscience))
    expected_s = (rank_trainable_elements(current) * 3 * ZEROED_GRAD_BYTES
                  / gpu_ceilings(get_gpu("a100-80gb")).memory_bytes_per_s)
    assert saved_s == pytest.approx(expected_s, rel=1e-9)
