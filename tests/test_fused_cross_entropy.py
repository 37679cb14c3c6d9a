"""flash-attn's fused cross-entropy as the reference model's loss (torch-free): the bytes of its
backward, derived by hand from the allocations in flash-attn's ops/triton/cross_entropy.py
(Triton, CUDA only: not measurable on this machine's CPU), where it is offered, how the planner,
the allocator model, the plan search and the roofline use it, and what it does to the published
runs that used it."""

from __future__ import annotations

import numpy as np
import pytest

from zeroplan.allocator.fsdp_schedule import loss_allocations
from zeroplan.cli.main import main
from zeroplan.core.activations import logits_bytes
from zeroplan.core.fused_cross_entropy import fused_cross_entropy_bytes, fused_cross_entropy_parts
from zeroplan.core.plan import checked_peak_terms, memory_breakdown
from zeroplan.core.roofline.operations import OpKind, OpPass
from zeroplan.core.roofline.step import roofline_step
# search's own way to move a request to (micro-batch, accumulation).
from zeroplan.core.search import _at, evaluate, groups, scalar_evaluate
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.results import PeakMoment
from zeroplan.specs import (
    BatchSpec, Framework, PerformanceAssumptions, PlanRequest, Precision, StrategyKind, StrategySpec, TrainingSpec,
    cluster_from_gpus,
)
from zeroplan.specs.parallel import ParallelSpec

S, B, V = 4096, 2, 128256
"""Sequence, micro-batch and vocabulary of the llama-3.1-8b requests below."""


def _request(gpu, fused=True, framework=Framework.zeroplan, kind=StrategyKind.zero3, micro_batch=B,
             precision=Precision.bf16_mixed, parallel=None, compute_model="hfu") -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-3.1-8b"),
        training=TrainingSpec(framework=framework, fused_cross_entropy=fused, precision=precision),
        batch=BatchSpec(seq_len=S, micro_batch_size=micro_batch),
        cluster=cluster_from_gpus(gpu, 8), strategy=StrategySpec(kind=kind),
        parallel=parallel or ParallelSpec(), performance=PerformanceAssumptions(compute_model=compute_model),
    )


@pytest.mark.parametrize("precision, element", [(Precision.bf16_mixed, 2), (Precision.fp32, 4)])
def test_backward_holds_the_logits_their_gradient_and_a_row_of_lse(gpu_80gib, precision, element) -> None:
    # Saved logits in the compute dtype, the fp32 lse per row, dlogits = empty_like(logits).
    rows = S * B
    parts = fused_cross_entropy_parts(_request(gpu_80gib, precision=precision))
    assert parts == (element * rows * V, 4 * rows, element * rows * V)
    assert fused_cross_entropy_bytes(_request(gpu_80gib, precision=precision)) == sum(parts)


def test_the_fit_peak_falls_by_the_loss_difference(gpu_80gib) -> None:
    fused, _ = memory_breakdown(_request(gpu_80gib))
    unfused, _ = memory_breakdown(_request(gpu_80gib, fused=False))
    assert fused.peak_moment is unfused.peak_moment is PeakMoment.loss_backward
    assert unfused.logits_bytes == logits_bytes(get_model("llama-3.1-8b"), TrainingSpec(), S, B)
    assert fused.logits_bytes == 2 * 2 * S * B * V + 4 * S * B
    assert unfused.allocated_peak_bytes - fused.allocated_peak_bytes == unfused.logits_bytes - fused.logits_bytes


def test_the_allocator_model_allocates_the_three_tensors(gpu_80gib) -> None:
    request = _request(gpu_80gib, kind=StrategyKind.fsdp_full_shard)
    _, terms = checked_peak_terms(request)
    assert loss_allocations(request, terms) == [list(fused_cross_entropy_parts(request))]
    unfused = _request(gpu_80gib, fused=False, kind=StrategyKind.fsdp_full_shard)
    _, terms = checked_peak_terms(unfused)
    assert len(loss_allocations(unfused, terms)[0]) == 3 and sum(loss_allocations(unfused, terms)[0]) == terms.logits


def test_tensor_parallel_ranks_hold_their_vocabulary_columns(gpu_80gib) -> None:
    whole = memory_breakdown(_request(gpu_80gib, kind=StrategyKind.fsdp_full_shard))[0].logits_bytes
    split = memory_breakdown(_request(gpu_80gib, kind=StrategyKind.fsdp_full_shard, parallel=ParallelSpec(tp=2)))[0]
    assert split.logits_bytes < whole
    assert split.logits_bytes == pytest.approx(whole / 2, rel=1e-3)


@pytest.mark.parametrize("framework", [Framework.torchtitan, Framework.hf, Framework.torchtune])
def test_refused_where_the_framework_models_its_own_loss(gpu_80gib, framework) -> None:
    with pytest.raises(ZeroplanError, match="fused_cross_entropy.*only with framework zeroplan") as error:
        memory_breakdown(_request(gpu_80gib, framework=framework, kind=StrategyKind.fsdp_full_shard))
    assert "\n" not in str(error.value)


def test_the_search_plans_fused_groups_as_the_scalar_planner_does(gpu_80gib) -> None:
    base = _request(gpu_80gib, kind=StrategyKind.ddp, micro_batch=1)
    for group in groups(base)[:4]:
        micro, accum = np.array([1, 3]), np.array([1, 2])
        peak, _, _ = evaluate(group, micro, accum)
        assert [int(p) for p in peak] == [scalar_evaluate(_at(group.request, 1, 1))[0],
                                          scalar_evaluate(_at(group.request, 3, 2))[0]]



def test_the_roofline_moves_the_logits_once_forward_and_twice_backward() -> None:
    h100 = get_gpu("h100-80gb")

    def loss_bytes(fused: bool, op_pass: OpPass) -> float:
        step = roofline_step(_request(h100, fused=fused, compute_model="roofline"))
        return sum(t.operation.moved_bytes for t in step.terms
                   if t.operation.name == "cross-entropy" and t.operation.op_pass is op_pass
                   and t.operation.kind is OpKind.memory)

    tokens_logits = S * B * V
    assert loss_bytes(True, OpPass.forward) == 2 * tokens_logits
    assert loss_bytes(True, OpPass.backward) == 2 * 2 * tokens_logits
    assert loss_bytes(False, OpPass.backward) > loss_bytes(True, OpPass.backward)


@pytest.mark.parametrize("command", ["fit", "compare", "plan"])
def test_cli_flag(capsys, command) -> None:
    args = [command, "--detail", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "4096", "--fused-cross-entropy"]
    args += ["--global-batch", "16"] if command == "plan" else ["--micro-batch", "2", "--strategies", "zero3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert command != "fit" or "fused cross-entropy (flash-attn)" in out
    assert main([*args, "--framework", "torchtitan"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "fused_cross_entropy" in err
