"""torchtitan 9dec370's FSDP2 wrapping (--torchtitan-release 9dec370): embedding, final norm and
output projection in the root unit, kept gathered through the step; the last block not resharded
after forward (torchtitan 9dec370 parallelisms/parallelize_llama.py apply_fsdp)."""

from __future__ import annotations

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.framework_loss import fsdp_head_gathered_bytes
from zeroplan.core.profiles import check_framework_request, fsdp_separates_embedding_and_head
from zeroplan.errors import ZeroplanError
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, Framework, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus

H, V = 4096, 128256
"""Llama-3.1-8B's hidden size and vocabulary."""
BLOCK_ELEMENTS = 2 * H * H + 2 * H * (H // 4) + 3 * H * 14336 + 2 * H
"""One Llama-3.1-8B block: q and o (h x h), k and v (h x h/4), the SwiGLU MLP (3 x h x 14336), two norms."""


def _request(gpu, release: str | None) -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-3.1-8b"),
        training=TrainingSpec(framework=Framework.torchtitan, unchunked_loss=True, torchtitan_release=release),
        batch=BatchSpec(seq_len=8192, micro_batch_size=2),
        cluster=cluster_from_gpus(gpu, 8), strategy=StrategySpec(kind=StrategyKind.fsdp_full_shard),
    )


def test_the_root_unit_holds_embedding_and_head(gpu_80gib) -> None:
    assert fsdp_separates_embedding_and_head(_request(gpu_80gib, None))
    assert not fsdp_separates_embedding_and_head(_request(gpu_80gib, "9dec370"))


def test_the_loss_backward_holds_the_root_and_the_last_block(gpu_80gib) -> None:
    # 0.3.0: the [norm, lm_head] unit alone; 9dec370: the root (embedding, norm, head) and the
    # last block, not resharded after forward, in bf16 (8 shards divide every size here).
    # Measured: torchtitan 0.3.0's model sharded as 9dec370's apply_fsdp on 8 fake ranks holds
    # 2,537,578,496 bytes of unsharded parameters at its peak (FSDPMemTracker 'unsharded_param';
    # benchmarks/torchtitan_release_step.py), the second figure here.
    head = V * H * 2
    assert fsdp_head_gathered_bytes(_request(gpu_80gib, None)) == head + H * 2
    assert fsdp_head_gathered_bytes(_request(gpu_80gib, "9dec370")) == 2 * head + H * 2 + BLOCK_ELEMENTS * 2


def test_9dec370s_spelled_out_rms_norm_keeps_an_fp32_copy_and_the_bf16_output(gpu_80gib) -> None:
    # 9dec370 models/norms.py RMSNorm: _norm(x.float()).type_as(x) * weight saves the fp32 x and
    # the bf16 output (and the fp32 per-token rsqrt); 0.3.0's nn.RMSNorm (F.rms_norm's fused CUDA
    # kernel) the bf16 input and the fp32 rstd.
    from zeroplan.core.activations import norm_bytes

    sb = 8192 * 2
    old, new = (_request(gpu_80gib, release) for release in (None, "9dec370"))
    assert norm_bytes(new.model, new.training, 8192, 2) == (4 + 2) * sb * H + 4 * sb
    assert norm_bytes(new.model, new.training, 8192, 2) - norm_bytes(old.model, old.training, 8192, 2) == 4 * sb * H


@pytest.mark.parametrize(("training", "field"), [
    (TrainingSpec(framework=Framework.hf, torchtitan_release="9dec370"), "torchtitan_release"),
    (TrainingSpec(framework=Framework.torchtitan, unchunked_loss=True, torchtitan_release="1.0"), "torchtitan_release"),
    (TrainingSpec(framework=Framework.torchtitan, torchtitan_release="9dec370"), "torchtitan_release"),
])
def test_refused(training, field) -> None:
    with pytest.raises(ZeroplanError, match=field):
        check_framework_request(training)


def test_the_flag_implies_the_unchunked_loss() -> None:
    args = build_parser().parse_args(["fit", "llama-3.1-8b", "--framework", "torchtitan", "--torchtitan-release", "9dec370"])
    training = request_from_args(args, StrategyKind.fsdp_full_shard).training
    assert training.torchtitan_release == "9dec370" and training.unchunked_loss


def _events(request: PlanRequest):
    from zeroplan.core.plan import memory_breakdown, peak_terms
    from zeroplan.allocator.schedule import step_trace

    trace = step_trace(request, *peak_terms(request))
    return trace, memory_breakdown(request)[0].allocated_peak_bytes


@pytest.mark.parametrize("release", [None, "9dec370"])
def test_the_schedule_gathers_the_head_once_a_step_and_runs_the_loss_tensor_by_tensor(gpu_80gib, release) -> None:
    # The steps torchtitan runs (benchmarks/torchtitan_release_step.py on fake tensors): the
    # unit holding the head (9dec370's root: embedding, norm, head; 0.3.0's [norm, lm_head]) is
    # all-gathered once a step, never again for the loss's backward; the loss's bf16 logits,
    # fp32 upcast and log-softmax, then in backward two fp32 gradients and the bf16 one, each its
    # own allocation; the requested peak still the planner's allocated peak.
    from zeroplan.allocator.trace import AllocEvent, Stream

    request = _request(gpu_80gib, release)
    request = request.model_copy(update={"model": request.model.model_copy(update={"num_layers": 4})})
    trace, allocated = _events(request)
    head = V * H * 2 + H * 2  # the output projection and the final norm, bf16 (8 shards divide them)
    unit = head + V * H * 2 if release else head  # 9dec370: the embedding too
    gathers = [e.size_bytes for e in trace.events if isinstance(e, AllocEvent) and e.stream == Stream.all_gather]
    assert gathers.count(unit) == 2  # two steps
    sbv = 2 * 8192 * V
    large = [e.size_bytes for e in trace.events if isinstance(e, AllocEvent) and e.size_bytes in (2 * sbv, 4 * sbv)]
    assert large == 2 * [2 * sbv, 4 * sbv, 4 * sbv, 4 * sbv, 4 * sbv, 2 * sbv]
    assert trace.requested_peak_bytes() == allocated


@pytest.mark.slow
@pytest.mark.parametrize("release", ["0.3.0", "9dec370"])
def test_the_schedule_reserves_what_torchtitans_own_step_reserves(release) -> None:
    # torchtitan's own step on fake tensors (4 of Llama-3.1-8B's blocks, 8 ranks, full
    # recomputation, 1 x 32768, the unchunked loss), every storage replayed under expandable
    # segments, against the planner's FSDP2 schedule replayed the same way: 64.30 / 66.20 GiB
    # against 62.66 / 64.83 (the schedule with the loss as one moment: 54.85 / 57.40).
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/install-frameworks installs it)")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import torchtitan_release_step as release_step

    from zeroplan.core.plan import memory_breakdown
    from zeroplan.frameworks import step as step_module

    model = get_model("llama-3.1-8b").model_copy(update={"num_layers": 4})
    training = step_module.step_training(Framework.torchtitan, "full").model_copy(update={"unchunked_loss": True})
    builder = release_step.build_9dec370 if release == "9dec370" else step_module.build
    original = step_module.build
    step_module.build = builder
    try:
        record = step_module.run_step(model, StrategyKind.fsdp_full_shard, training, BatchSpec(micro_batch_size=1, seq_len=32768),
                                      8, allocator_conf=release_step.ALLOC_CONF)
    finally:
        step_module.build = original
    args = build_parser().parse_args([
        "fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--gpu-memory-gib", "95.5", "--micro-batch", "1",
        "--seq-len", "32768", "--activation-checkpointing", "full", "--framework", "torchtitan", "--unchunked-loss",
        "--torchtitan-release", release])
    request = request_from_args(args, StrategyKind.fsdp_full_shard)
    planned = memory_breakdown(request.model_copy(update={"model": model}))[0].reserved_peak_bytes
    assert abs(planned / record.allocator.reserved_peak_bytes - 1) <= 0.04, (planned, record.allocator.reserved_peak_bytes)
