"""The assembled answer: fits, headroom, largest micro-batch, offload, recommendation."""

from __future__ import annotations

import pytest

from zeroplan.core.plan import fit, max_micro_batch_size, memory_breakdown, plan
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    ActivationCheckpointing, BatchSpec, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus,
)
from zeroplan.units import GB, GiB


def _request(gpu, model="llama-2-70b", gpus=8, kind=StrategyKind.zero3, **training) -> PlanRequest:
    return PlanRequest(
        model=get_model(model), training=TrainingSpec(**training), batch=BatchSpec(seq_len=4096),
        cluster=cluster_from_gpus(gpu, gpus), strategy=StrategySpec(kind=kind),
    )


def test_70b_on_8x80gib_needs_offload(gpu_80gib) -> None:
    report = fit(_request(gpu_80gib, activation_checkpointing=ActivationCheckpointing.full))
    on_gpu = [p for p in report.plans if not p.strategy.offloads_optimizer]
    assert not any(p.fits for p in on_gpu)
    assert report.plan_for("zero3").memory.optimizer_state_bytes / GiB == pytest.approx(12 * 68_976_648_192 / 8 / GiB)
    offload = report.plan_for("zero3-offload")
    assert offload.fits and offload.host_bytes_per_node == pytest.approx(16 * 68_976_648_192, rel=1e-6)
    assert report.recommended in (StrategyKind.zero3_offload, StrategyKind.zero3_param_offload)
    assert report.recommended.value in report.verdict


def test_verdict_suggests_checkpointing_when_nothing_fits(gpu_80gib) -> None:
    report = fit(_request(gpu_80gib))
    assert report.recommended is None
    assert "--activation-checkpointing full" in report.verdict


def test_7b_fits_with_zero3_on_8_gpus(gpu_80gib) -> None:
    report = fit(_request(gpu_80gib, model="llama-2-7b", activation_checkpointing=ActivationCheckpointing.full))
    assert report.plan_for("zero3").fits
    assert not report.plan_for("ddp").fits  # 16 bytes x 6.7B = 100 GiB of model states


@pytest.mark.parametrize("kind", [StrategyKind.ddp, StrategyKind.zero2, StrategyKind.zero3, StrategyKind.fsdp_full_shard])
def test_max_micro_batch_is_the_boundary(gpu_80gib, kind) -> None:
    request = _request(gpu_80gib, model="llama-2-7b", kind=kind, gpus=64, activation_checkpointing=ActivationCheckpointing.full)
    best = max_micro_batch_size(request)
    usable = request.cluster.usable_memory_bytes
    if best:
        assert memory_breakdown(request.with_micro_batch(best))[0].peak_bytes <= usable
    assert memory_breakdown(request.with_micro_batch(best + 1))[0].peak_bytes > usable


def test_peak_is_max_of_backward_and_step_phases(gpu_80gib) -> None:
    memory = plan(_request(gpu_80gib, model="llama-2-7b", kind=StrategyKind.ddp)).memory
    resident = memory.parameter_bytes + memory.optimizer_state_bytes
    backward = resident + memory.temporary_bytes + max(memory.gradient_bytes, memory.activation_bytes + memory.logits_bytes)
    step = resident + memory.gradient_bytes + memory.step_temporary_bytes
    assert memory.allocated_peak_bytes == max(backward, step)
    assert memory.peak_bytes == memory.allocated_peak_bytes + memory.allocator_reserve_bytes


def test_accumulation_keeps_gradients_beside_activations(gpu_80gib) -> None:
    base = _request(gpu_80gib, model="llama-2-7b", kind=StrategyKind.ddp)
    accumulating = base.model_copy(update={"batch": BatchSpec(seq_len=4096, grad_accum_steps=2)})
    two = memory_breakdown(accumulating)[0]
    resident = two.parameter_bytes + two.optimizer_state_bytes + two.temporary_bytes
    assert two.allocated_peak_bytes == resident + two.gradient_bytes + two.activation_bytes + two.logits_bytes


def test_host_memory_limit_is_checked(gpu_80gib) -> None:
    request = _request(gpu_80gib, kind=StrategyKind.zero3_offload, activation_checkpointing=ActivationCheckpointing.full)
    small = request.model_copy(update={"cluster": request.cluster.model_copy(update={"host_memory_bytes_per_node": 512 * GB})})
    assert plan(small).host_fits is False
    assert plan(request).host_fits is None


def test_hsdp_group_must_divide(gpu_80gib) -> None:
    from zeroplan.errors import ZeroplanError

    request = _request(gpu_80gib, gpus=16)
    with pytest.raises(ZeroplanError, match="strategy.shard_group_size"):
        request.with_strategy(StrategySpec(kind=StrategyKind.hsdp, shard_group_size=3))


def test_dataframe_has_a_row_per_strategy(gpu_80gib) -> None:
    report = fit(_request(gpu_80gib, model="gpt2"))
    frame = report.to_dataframe()
    assert list(frame.index) == [k.value for k in StrategyKind]
    assert frame.loc["zero3", "peak_bytes"] == report.plan_for("zero3").memory.peak_bytes
