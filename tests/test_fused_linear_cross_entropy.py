"""liger-kernel's fused linear cross-entropy under Hugging Face (torch-free): the chunk rule and
the bytes of its forward and backward, derived by hand from the allocations in liger-kernel
0.6.2 ops/fused_linear_cross_entropy.py (Triton, CUDA only: not measurable on this machine's
CPU), where it is offered, and how the planner and the plan search use it."""

from __future__ import annotations

import numpy as np
import pytest

from zeroplan.cli.main import main
from zeroplan.core.activations import logits_bytes
from zeroplan.core.framework_loss import (
    framework_logits_pieces, fsdp_head_gathered_bytes,
    fused_linear_cross_entropy_chunk_rows,
)
from zeroplan.core.plan import memory_breakdown
# search's own way to move a request to (micro-batch, accumulation).
from zeroplan.core.search import _at, evaluate, groups, scalar_evaluate
from zeroplan.errors import ZeroplanError
from zeroplan.presets.models import get_model
from zeroplan.results import PeakMoment
from zeroplan.specs import BatchSpec, Framework, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus

T, H, V = 8192 * 2, 4096, 128256
"""Tokens of llama-3.1-8b at seq 8192, micro-batch 2; its hidden size and vocabulary."""


def _request(gpu, framework=Framework.hf, kind=StrategyKind.zero3, micro_batch=2, fused=True) -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-3.1-8b"),
        training=TrainingSpec(framework=framework, fused_linear_cross_entropy=fused),
        batch=BatchSpec(seq_len=8192, micro_batch_size=micro_batch),
        cluster=cluster_from_gpus(gpu, 8), strategy=StrategySpec(kind=kind),
    )


def test_chunk_rows_follow_liger_rule() -> None:
    llama, gpt2 = get_model("llama-3.1-8b"), get_model("gpt2")
    # inc_factor = ceil(128256 / 4096) = 32; ceil(16384 / 32) = 512 is a power of two already.
    assert fused_linear_cross_entropy_chunk_rows(llama, 16384) == 512
    # ceil(1000 / 32) = 32; ceil(1100 / 32) = 35 -> 64; ceil(10 / 32) = 1.
    assert fused_linear_cross_entropy_chunk_rows(llama, 1000) == 32
    assert fused_linear_cross_entropy_chunk_rows(llama, 1100) == 64
    assert fused_linear_cross_entropy_chunk_rows(llama, 10) == 1
    # gpt2: ceil(50257 / 768) = 66; ceil(4096 / 66) = 63 -> 64.
    assert fused_linear_cross_entropy_chunk_rows(gpt2, 4096) == 64
    # One chunk never has more rows than there are tokens.
    wide = get_model("llama-3.1-8b").model_copy(update={"vocab_size": 1000})
    assert fused_linear_cross_entropy_chunk_rows(wide, 3) == 3


def test_bf16_module_pieces_match_the_source_allocations(gpu_80gib) -> None:
    # DeepSpeed ZeRO-3 casts the module to bf16: input, weight and every matmul output bf16.
    rows = 512
    kept = 2 * T * H + 2 * V * H  # grad_input, grad_weight (zeros_like, bf16)
    loss_1d = 4 * T
    weight_add = kept + loss_1d + 2 * rows * V + 2 * V * H + 4 * V * H  # logits_chunk, mm, .float()
    next_chunk = kept + loss_1d + 2 * 2 * rows * V
    backward = kept - 2 * T * H  # the head's input is freed once the forward returns
    assert framework_logits_pieces(_request(gpu_80gib)) == (weight_add, next_chunk, backward)
    assert weight_add == 4_468_310_016
    # Against HF's own loss (three fp32 s*b*V tensors): about a fifth.
    unfused = logits_bytes(get_model("llama-3.1-8b"), TrainingSpec(), 8192, 2)
    assert unfused == 12 * T * V and max(framework_logits_pieces(_request(gpu_80gib))) * 5 < unfused


def test_autocast_keeps_fp32_gradients_and_writes_bf16_matmuls(gpu_80gib) -> None:
    # DDP under autocast: fp32 parameters and final-norm output, bf16 matmul outputs.
    rows = 512
    kept = 4 * T * H + 4 * V * H
    cast = 2 * V * H  # autocast's cached bf16 copy of lm_head.weight, alive through the forward
    weight_add = kept + 4 * T + cast + 2 * rows * V + 2 * V * H + 4 * V * H
    next_chunk = kept + 4 * T + cast + 4 * rows * V
    backward = kept - 2 * T * H  # outside_layers_bytes counted the head's input in the compute dtype
    assert framework_logits_pieces(_request(gpu_80gib, kind=StrategyKind.ddp)) == (weight_add, next_chunk, backward)


def test_fsdp_adds_the_gathered_head_at_each_moment(gpu_80gib) -> None:
    fsdp = _request(gpu_80gib, kind=StrategyKind.fsdp_full_shard)
    plain = framework_logits_pieces(_request(gpu_80gib))
    root = fsdp_head_gathered_bytes(fsdp, prefetched=False)
    with_prefetch = fsdp_head_gathered_bytes(fsdp)
    assert 0 < root < with_prefetch
    got = framework_logits_pieces(fsdp)
    assert got == (plain[0] + root, plain[1] + root, plain[2] + with_prefetch)


def test_one_chunk_has_no_next_chunk_moment(gpu_80gib) -> None:
    tiny = _request(gpu_80gib).model_copy(update={"batch": BatchSpec(seq_len=16, micro_batch_size=1)})
    assert fused_linear_cross_entropy_chunk_rows(tiny.model, 16) == 1  # ceil(16 / 32) = 1
    assert len(framework_logits_pieces(tiny)) == 3
    model = tiny.model.model_copy(update={"vocab_size": 4096})  # inc_factor 1: one chunk of 16 rows
    one = tiny.model_copy(update={"model": model})
    assert len(framework_logits_pieces(one)) == 2


@pytest.mark.parametrize("framework", [Framework.zeroplan, Framework.torchtitan, Framework.torchtune])
def test_refused_where_the_framework_does_not_offer_it(gpu_80gib, framework) -> None:
    kind = StrategyKind.fsdp_full_shard
    with pytest.raises(ZeroplanError, match="fused_linear_cross_entropy.*only with framework hf"):
        memory_breakdown(_request(gpu_80gib, framework=framework, kind=kind))


def test_the_fit_peak_falls_by_the_loss_difference(gpu_80gib) -> None:
    fused, _ = memory_breakdown(_request(gpu_80gib))
    unfused, _ = memory_breakdown(_request(gpu_80gib, fused=False))
    assert fused.peak_moment is unfused.peak_moment is PeakMoment.loss_backward
    assert unfused.allocated_peak_bytes - fused.allocated_peak_bytes == unfused.logits_bytes - fused.logits_bytes


def test_the_search_plans_fused_groups_with_the_scalar_planner(gpu_80gib) -> None:
    base = _request(gpu_80gib, kind=StrategyKind.ddp, micro_batch=1)
    pieces = [framework_logits_pieces(_request(gpu_80gib, micro_batch=b))[0] for b in (1, 2, 5)]
    # Not affine in the micro-batch (the chunk is a power of two), so no coefficients are fitted.
    assert pieces[2] - pieces[0] != 4 * (pieces[1] - pieces[0])
    for group in groups(base)[:3]:
        assert group.scalar_only
        micro, accum = np.array([1, 3]), np.array([1, 2])
        peak, _, _ = evaluate(group, micro, accum)
        assert [int(p) for p in peak] == [scalar_evaluate(_at(group.request, 1, 1))[0], scalar_evaluate(_at(group.request, 3, 2))[0]]



@pytest.mark.parametrize("command", ["fit", "compare"])
def test_cli_flag(capsys, command) -> None:
    args = [command, "--detail", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--micro-batch", "2", "--seq-len", "8192",
            "--strategies", "zero3", "--fused-linear-cross-entropy"]
    assert main([*args, "--framework", "hf"]) == 0
    out = capsys.readouterr().out
    assert command == "compare" or "fused linear cross-entropy (liger)" in out  # compare shows no numerics
    assert main([*args, "--framework", "torchtune"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "fused_linear_cross_entropy" in err


def test_plan_cli_flag(capsys) -> None:
    code = main(["plan", "llama-3.1-8b", "--framework", "hf", "--gpus", "8", "--gpu", "h100-80gb", "--global-batch", "16",
                 "--seq-len", "4096", "--strategies", "zero3", "--fused-linear-cross-entropy"])
    assert code == 0 and capsys.readouterr().out


def test_the_whole_step_runner_refuses_it() -> None:
    pytest.importorskip("torch")
    from zeroplan.frameworks.step import check_step
    from zeroplan.specs import Precision

    training = TrainingSpec(framework=Framework.hf, precision=Precision.bf16_mixed, fused_linear_cross_entropy=True)
    with pytest.raises(ZeroplanError, match="fused_linear_cross_entropy.*CUDA"):
        check_step(Framework.hf, StrategyKind.fsdp_full_shard, training, 2, 0)
