"""Hugging Face's ZeRO strategies run DeepSpeed's own engine (transformers 4.56.2
integrations/deepspeed.py deepspeed_init, accelerate 1.10.1 accelerator.py _prepare_deepspeed ->
deepspeed.initialize): the planner gives them DeepSpeed's state convention, whose model states
and buffers the DeepSpeed engine records check (benchmarks/deepspeed-records)."""

from __future__ import annotations

import pytest

from zeroplan.core.deepspeed_accumulation import _bucket_elements
from zeroplan.core.hf_deepspeed import hf_auto_strategy
from zeroplan.core.plan import peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec,
    Framework,
    PlanRequest,
    StrategyKind,
    StrategySpec,
    TrainingSpec,
    cluster_from_gpus,
)
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.training import StateConvention

_DEEPSPEED_KINDS = (StrategyKind.zero1, StrategyKind.zero2, StrategyKind.zero3, StrategyKind.zero2_offload,
                    StrategyKind.zero3_offload)


def _request(gpu, kind: StrategyKind, framework: Framework = Framework.hf, **training) -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-2-7b"), training=TrainingSpec(framework=framework, **training),
        batch=BatchSpec(seq_len=1024), cluster=cluster_from_gpus(gpu, 8), strategy=StrategySpec(kind=kind),
    )


@pytest.mark.parametrize("kind", _DEEPSPEED_KINDS)
def test_hf_zero_strategies_run_deepspeeds_layout(gpu_80gib, kind) -> None:
    assert _request(gpu_80gib, kind).convention is StateConvention.deepspeed


@pytest.mark.parametrize("kind", [StrategyKind.ddp, StrategyKind.fsdp_full_shard])
def test_hf_torch_strategies_keep_their_layout(gpu_80gib, kind) -> None:
    assert _request(gpu_80gib, kind).convention is StateConvention.fsdp2


@pytest.mark.parametrize("kind", [StrategyKind.zero2, StrategyKind.zero3])
def test_hf_zero_states_and_buffers_are_deepspeeds(gpu_80gib, kind) -> None:
    # The same model states and buffer terms as a request that names DeepSpeed's convention
    # itself (the layout the DeepSpeed engine records measure); only activations may differ.
    hf_states, hf_terms = peak_terms(_request(gpu_80gib, kind))
    # hf runs DeepSpeed's own stage-3 defaults where the strategy sets none (zeroplan.core.deepspeed_coordinator).
    named = _request(gpu_80gib, kind, Framework.zeroplan, state_convention=StateConvention.deepspeed)
    named = named.with_strategy(named.strategy.model_copy(update={
        "deepspeed_prefetch_bucket_elements": 5 * 10**7, "deepspeed_max_live_parameters": 10**9,
        "deepspeed_max_reuse_distance": 10**9, "deepspeed_param_persistence_threshold": 10**5}))
    ds_states, ds_terms = peak_terms(named)
    assert hf_states == ds_states
    # bf16-mixed: fp32 gradients the optimizer reads, 18 bytes a parameter over the 8 ranks' shards
    assert hf_states.gradient_bytes > peak_terms(_request(gpu_80gib, kind, Framework.zeroplan))[0].gradient_bytes
    for field in ("resident_buffers", "backward_held_buffers", "transient_buffers", "accumulated_gradients"):
        assert getattr(hf_terms, field) == getattr(ds_terms, field), field


def test_hf_refuses_a_state_convention_in_one_line(gpu_80gib) -> None:
    """hf's engines decide the layout; deepspeed names DeepSpeed's stage 0 (ddp) and no FSDP."""
    with pytest.raises(ZeroplanError, match="hf's own engines \\(DeepSpeed's under its ZeRO strategies\\)"):
        peak_terms(_request(gpu_80gib, StrategyKind.zero3, state_convention=StateConvention.zero))
    with pytest.raises(ZeroplanError, match="DeepSpeed's stage 0"):
        _request(gpu_80gib, StrategyKind.fsdp_full_shard, state_convention=StateConvention.deepspeed)


def test_hf_reduce_bucket_is_the_configured_size_not_the_adapters(gpu_80gib) -> None:
    # Measured (benchmarks/hf_deepspeed_buckets.py): accelerate's DeepSpeedPlugin runs DeepSpeed's
    # 5e8-element bucket for a 115,008-element model; zeroplan's own emitted config caps it.
    lora = {"finetune": FineTuneSpec(lora_rank=8)}
    hf = _request(gpu_80gib, StrategyKind.zero3, **lora)
    capped = _request(gpu_80gib, StrategyKind.zero3, Framework.zeroplan, **lora)
    assert _bucket_elements(hf) == 500_000_000
    assert _bucket_elements(capped) < 500_000_000


def test_hf_auto_settings_follow_the_hidden_size(gpu_80gib) -> None:
    request = _request(gpu_80gib, StrategyKind.zero3)
    auto = hf_auto_strategy(request.strategy, request.model)
    # llama-2-7b, h 4096: h^2, int(0.9 h^2), 10 h (trainer_config_finalize; the measured tiny
    # model's h 64 gave 4,096, 3,686 and 640).
    assert (auto.zero_bucket_elements, auto.deepspeed_prefetch_bucket_elements,
            auto.deepspeed_param_persistence_threshold) == (16_777_216, 15_099_494, 40_960)
    assert hf_auto_strategy(StrategySpec(kind=StrategyKind.zero2), request.model).deepspeed_prefetch_bucket_elements is None
    smaller = peak_terms(request.with_strategy(auto))[1]
    assert smaller.resident_buffers < peak_terms(request)[1].resident_buffers
