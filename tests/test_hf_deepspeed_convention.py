"""Hugging Face's ZeRO strategies run DeepSpeed's own engine (transformers 4.56.2
integrations/deepspeed.py deepspeed_init, accelerate 1.10.1 accelerator.py _prepare_deepspeed ->
deepspeed.initialize): the planner gives them DeepSpeed's state convention, whose model states
and buffers the DeepSpeed engine records check (benchmarks/deepspeed-records)."""

from __future__ import annotations

import pytest

from zeroplan.core.plan import peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, Framework, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus
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
    ds_states, ds_terms = peak_terms(_request(gpu_80gib, kind, Framework.zeroplan,
                                              state_convention=StateConvention.deepspeed))
    assert hf_states == ds_states
    # bf16-mixed: fp32 gradients the optimizer reads, 18 bytes a parameter over the 8 ranks' shards
    assert hf_states.gradient_bytes > peak_terms(_request(gpu_80gib, kind, Framework.zeroplan))[0].gradient_bytes
    for field in ("resident_buffers", "backward_held_buffers", "transient_buffers", "accumulated_gradients"):
        assert getattr(hf_terms, field) == getattr(ds_terms, field), field


def test_hf_refuses_a_state_convention_in_one_line(gpu_80gib) -> None:
    with pytest.raises(ZeroplanError, match="hf's own engines \\(DeepSpeed's under its ZeRO strategies\\)"):
        peak_terms(_request(gpu_80gib, StrategyKind.zero3, state_convention=StateConvention.deepspeed))
