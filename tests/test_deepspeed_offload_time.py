"""DeepSpeed's CPU optimizer offload in the step time: the gradient copies by micro-batch, where
they run, the host passes around the CPU Adam kernel, and the pre-0.9 in-kernel parameter copy
(zeroplan.core.deepspeed_offload_time)."""

from __future__ import annotations

import pytest

from zeroplan.core.communication import Phase
from zeroplan.core.deepspeed_offload_time import (
    host_pass_bytes_per_element, stage2_gradient_bytes, stage3_gradient_bytes,
)
from zeroplan.core.timing import (
    cpu_optimizer_time_s, cpu_step_time_s, host_link_share_bytes_per_s, host_memory_bound_s, host_transfer_bytes,
    offloaded_optimizer_elements,
)
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.hosts import DGX_2
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, Framework, PerformanceAssumptions, PlanRequest, Precision, StrategyKind, StrategySpec, TrainingSpec,
    cluster_from_gpus,
)


def _request(kind: StrategyKind, accum: int = 1, precision: Precision = Precision.bf16_mixed,
             framework: Framework = Framework.zeroplan, **performance) -> PlanRequest:
    cluster = cluster_from_gpus(get_gpu("v100-32gb"), 1).model_copy(update={"host": DGX_2})
    return PlanRequest(
        model=get_model("llama-2-7b"), training=TrainingSpec(precision=precision, framework=framework),
        batch=BatchSpec(micro_batch_size=1, seq_len=1024, grad_accum_steps=accum), cluster=cluster,
        strategy=StrategySpec(kind=kind), performance=PerformanceAssumptions(**performance),
    )


def test_gradient_bytes_follow_the_copies_of_each_stage() -> None:
    # ZeRO-2: the fp32 slice down at the boundary; with accumulation every micro-batch's bf16 sum
    # down and, from the second on, the running sum up. ZeRO-3: one bf16 copy each way a micro-batch.
    assert stage2_gradient_bytes(10, 1, 2, 4) == 40
    assert stage2_gradient_bytes(10, 4, 2, 4) == 40 + 4 * 20 + 3 * 20
    assert stage3_gradient_bytes(10, 1, 2, 4) == 40 + 2 * 20
    assert stage3_gradient_bytes(10, 4, 2, 4) == 40 + 8 * 20


def test_host_passes_unscale_where_deepspeed_does() -> None:
    # Stage 2 returns early from unscale_and_clip_grads at loss scale 1 without clipping (bf16,
    # DeepSpeed's default gradient_clipping 0); fp16's loss scale and the hf stack's clipping
    # multiply the fp32 gradient (8 B); stage 3 always does, and fp16 reads the host gradient
    # buffer twice for inf/nan. The cast of the fp32 partition to bf16 is 6 B.
    assert host_pass_bytes_per_element(_request(StrategyKind.zero2_offload)) == 6
    assert host_pass_bytes_per_element(_request(StrategyKind.zero2_offload, precision=Precision.fp16_mixed)) == 14
    assert host_pass_bytes_per_element(_request(StrategyKind.zero2_offload, framework=Framework.hf)) == 14
    assert host_pass_bytes_per_element(_request(StrategyKind.zero3_offload)) == 14
    assert host_pass_bytes_per_element(_request(StrategyKind.zero3_offload, precision=Precision.fp16_mixed)) == 18


def test_the_pre_0_9_kernel_copies_the_parameters_while_it_steps() -> None:
    request = _request(StrategyKind.zero2_offload, precision=Precision.fp16_mixed)
    fused = _request(StrategyKind.zero2_offload, precision=Precision.fp16_mixed, cpu_adam_copies_parameters=True)
    elements = offloaded_optimizer_elements(request)
    host = request.cluster.host
    adam_s = cpu_step_time_s(elements, 28, host, 1)
    # Today: the cast (6 B) and the unscale (8 B) stream host memory after the kernel; the bf16
    # partition goes up in the step phase, exposed.
    assert cpu_optimizer_time_s(request) == pytest.approx(adam_s + host_memory_bound_s(elements * 14, host, 1))
    assert host_transfer_bytes(request)[Phase.step] == 2 * elements + 4 * elements  # params up, fp32 grads (no overlap_comm)
    # Before 0.9.0: no cast pass, the up-copy inside the kernel, the slower of the two.
    copy_s = 2 * elements / host_link_share_bytes_per_s(fused)
    assert cpu_optimizer_time_s(fused) == pytest.approx(max(adam_s, copy_s) + host_memory_bound_s(elements * 8, host, 1))
    assert host_transfer_bytes(fused)[Phase.step] == 4 * elements
    # The switch is ZeRO-2's: stage 3 keeps its cast and up-copy.
    three = _request(StrategyKind.zero3_offload, cpu_adam_copies_parameters=True)
    assert host_transfer_bytes(three)[Phase.step] == 2 * offloaded_optimizer_elements(three)


def test_overlap_comm_moves_zero2_gradient_copies_behind_the_backward() -> None:
    hidden = _request(StrategyKind.zero2_offload, overlap_grad_reduce=True)
    exposed = _request(StrategyKind.zero2_offload, overlap_grad_reduce=False)
    elements = offloaded_optimizer_elements(hidden)
    assert host_transfer_bytes(hidden)[Phase.backward] == 4 * elements
    assert host_transfer_bytes(exposed)[Phase.backward] == 0
    assert host_transfer_bytes(exposed)[Phase.step] == host_transfer_bytes(hidden)[Phase.step] + 4 * elements
