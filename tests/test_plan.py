"""The assembled answer: fits, headroom, largest micro-batch, offload, recommendation."""

from __future__ import annotations

import pytest

from zeroplan.errors import ZeroplanError

from zeroplan.core.activations import backward_workspace_bytes
from zeroplan.core.buffers import (
    backward_held_buffer_bytes, block_backward_transient_bytes, block_copy_buffer_bytes, resident_buffer_bytes,
    root_gather_buffer_bytes, transient_buffer_bytes,
)
from zeroplan.core.model_states import padded_unit_elements_of
from zeroplan.core.params import total_parameters
from zeroplan.core.plan import checked_peak_terms, fit, max_micro_batch_size, memory_breakdown, plan, recommend
from zeroplan.results import PeakMoment
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    ActivationCheckpointing, BatchSpec, PlanRequest, StateConvention, StrategyKind, StrategySpec, TrainingSpec,
    ZeroGradientReduce, cluster_from_gpus,
)
from zeroplan.units import GB, GiB


def _request(gpu, model="llama-2-70b", gpus=8, kind=StrategyKind.zero3, seq_len=None, **training) -> PlanRequest:
    spec = get_model(model)
    seq_len = seq_len if seq_len is not None else min(4096, spec.max_positions)
    return PlanRequest(
        model=spec, training=TrainingSpec(**training), batch=BatchSpec(seq_len=seq_len),
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


def _moments(request) -> dict[str, int]:
    """The four moments of docs/memory-model.md, "Peak", written out from the terms."""
    memory = memory_breakdown(request)[0]
    s, b = request.batch.seq_len, request.batch.micro_batch_size
    workspace = backward_workspace_bytes(request.model, request.training, s, b)
    resident = memory.parameter_bytes + memory.optimizer_state_bytes + resident_buffer_bytes(request)
    held = resident + backward_held_buffer_bytes(request)
    transient = transient_buffer_bytes(request)
    accumulated = memory.gradient_bytes if request.batch.grad_accum_steps > 1 else 0
    # A block's units (FSDP full sharding: the root, the block, the next one and the earlier
    # block's reduce-scatter input) beside its workspace, or beside the next block's flat
    # all-gather buffer or its unsharded gradients; or, before them, the root gathered again.
    units = block_backward_transient_bytes(request)
    block = max(units + workspace, units + block_copy_buffer_bytes(request), root_gather_buffer_bytes(request))
    return {
        "loss": held + accumulated + memory.activation_bytes + memory.logits_bytes,
        "block": held + accumulated + memory.activation_bytes + block,
        "end": held + memory.gradient_bytes + transient,
        "step": resident + memory.gradient_bytes + memory.step_temporary_bytes,
    }


@pytest.mark.parametrize("kind", list(StrategyKind))
def test_peak_is_the_largest_of_the_four_moments(gpu_80gib, kind) -> None:
    request = _request(gpu_80gib, model="llama-2-7b", kind=kind)
    memory = memory_breakdown(request)[0]
    assert memory.allocated_peak_bytes == max(_moments(request).values())
    assert memory.peak_bytes == memory.allocated_peak_bytes + memory.allocator_reserve_bytes


def test_ddp_bucket_copies_are_alive_at_every_moment(gpu_80gib) -> None:
    copies = _request(gpu_80gib, model="llama-2-7b", kind=StrategyKind.ddp)
    views = copies.with_strategy(StrategySpec(kind=StrategyKind.ddp, ddp_gradient_as_bucket_view=True))
    bucket = resident_buffer_bytes(copies)
    assert bucket == memory_breakdown(copies)[0].gradient_bytes and resident_buffer_bytes(views) == 0
    assert all(_moments(copies)[m] == _moments(views)[m] + bucket for m in ("loss", "block", "end", "step"))


def test_zero_gradient_buffers_follow_the_implementation(gpu_80gib) -> None:
    def spec(kind, mode):
        return StrategySpec(kind=kind, zero_gradient_reduce=mode)

    bucket = _request(gpu_80gib, model="llama-2-7b", kind=StrategyKind.zero2)
    per_unit = bucket.with_strategy(spec(StrategyKind.zero2, ZeroGradientReduce.per_unit))
    ddp = bucket.with_strategy(spec(StrategyKind.zero1, ZeroGradientReduce.ddp_buckets))
    # DeepSpeed's bucket (5e8 bf16 elements) lives through backward only; the reference's
    # buffer is two of its largest unit; ZeroRedundancyOptimizer keeps DDP's bucket copies (in
    # the convention's gradient dtype: bf16 under zero).
    assert resident_buffer_bytes(bucket) == 0 and transient_buffer_bytes(bucket) == 500_000_000 * 2
    largest = max(padded_unit_elements_of(per_unit, 64))
    assert resident_buffer_bytes(per_unit) == 0 and transient_buffer_bytes(per_unit) == 2 * largest * 2
    assert resident_buffer_bytes(ddp) == total_parameters(ddp.model) * 2 and transient_buffer_bytes(ddp) == 0


def test_a_reduce_mode_for_another_stage_is_a_one_line_error() -> None:
    with pytest.raises(ZeroplanError, match="strategy.zero_gradient_reduce"):
        StrategySpec(kind=StrategyKind.zero3, zero_gradient_reduce=ZeroGradientReduce.ddp_buckets)


def test_deepspeed_stage3_keeps_its_bucket_and_gradient_partition(gpu_80gib) -> None:
    request = _request(gpu_80gib, model="llama-2-7b", kind=StrategyKind.zero3)
    deepspeed = request.model_copy(update={"training": TrainingSpec(state_convention=StateConvention.deepspeed)})
    partition = memory_breakdown(deepspeed)[1].optimizer_elements  # this rank's shard
    assert resident_buffer_bytes(request) == 0
    # and its gradient norm (fp64) and inf_or_nan_tracker (bool) scalars
    assert resident_buffer_bytes(deepspeed) == 500_000_000 * 2 + partition * 2 + 8 + 1


@pytest.mark.parametrize("accumulation", [1, 2])
def test_deepspeed_stage1_steps_on_its_partition_and_carries_full_gradients_between_micro_steps(
    gpu_80gib, accumulation,
) -> None:
    """The step reads the fp32 partition at any accumulation; between micro-steps DeepSpeed keeps
    every bf16 .grad and the ipg bucket (benchmarks/deepspeed-accumulation-records)."""
    request = _request(gpu_80gib, model="llama-2-7b", kind=StrategyKind.zero1).model_copy(update={
        "training": TrainingSpec(state_convention=StateConvention.deepspeed),
        "batch": BatchSpec(seq_len=4096, grad_accum_steps=accumulation),
    })
    states, terms = checked_peak_terms(request)
    assert states.gradient_bytes == states.optimizer_elements * 4
    assert terms.accumulated_gradients == total_parameters(request.model) * 2 + 500_000_000 * 2


def test_accumulation_keeps_gradients_beside_activations(gpu_80gib) -> None:
    base = _request(gpu_80gib, model="llama-2-7b", kind=StrategyKind.ddp)
    accumulating = base.model_copy(update={"batch": BatchSpec(seq_len=4096, grad_accum_steps=2)})
    gradients = memory_breakdown(base)[0].gradient_bytes
    one, two = _moments(base), _moments(accumulating)
    assert two["loss"] == one["loss"] + gradients and two["block"] == one["block"] + gradients
    assert two["end"] == one["end"] and two["step"] == one["step"]


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
    report = fit(_request(gpu_80gib, model="gpt2", seq_len=1024))
    frame = report.to_dataframe()
    assert list(frame.index) == [k.value for k in StrategyKind if not k.is_opt_in]
    assert frame.loc["zero3", "peak_bytes"] == report.plan_for("zero3").memory.peak_bytes
    # The step's parts, the model-parallel ones included (zero without tp, cp or pp), add up to it.
    parts = ["compute_s", "optimizer_step_s", "model_parallel_communication_s", "pipeline_bubble_s",
             "exposed_communication_s", "cpu_optimizer_s"]
    assert (frame[parts].sum(axis=1) - frame["step_with_overlap_s"]).abs().max() < 1e-9
    assert (frame[["model_parallel_communication_s", "pipeline_bubble_s"]] == 0).all().all()


# The README's own advice: with host RAM given, a plan that fits the GPU but not the host is
# neither recommended nor called a GPU OOM; the verdict and the table name the host shortfall.
def test_host_ram_shortfall_is_named_in_verdict_and_table():
    from zeroplan.cli.main import main
    import contextlib, io

    out = io.StringIO()
    argv = ["fit", "--detail", "llama-2-70b", "--gpus", "8", "--gpu", "a100-80gb", "--activation-checkpointing", "full"]
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--host-memory-gb", "1024"]) == 0
    text = out.getvalue()
    verdict = next(line for line in text.splitlines() if line.startswith("Verdict: "))
    assert verdict.startswith("Verdict: Nothing fits in host RAM: zero3-offload fits on the GPU")
    assert "1027.8 GiB of host RAM per node, 953.7 GiB available" in verdict
    zero3_offload_row = next(line for line in text.splitlines() if line.startswith("zero3-offload "))
    assert " host " in zero3_offload_row
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--host-memory-gib", "1100", "--format", "json"]) == 0
    import json

    report = json.loads(out.getvalue())
    assert report["recommended"] == "zero3-offload"
    # 1100 GiB holds zero3-offload's 1027.8 GiB, not zero3-param-offload's 1156 GiB.
    assert {plan["strategy"] for plan in report["plans"] if not plan["host_fits"]} == {"zero3-param-offload"}


def test_the_request_refuses_a_sequence_past_the_models_positions(gpu_80gib) -> None:
    # The Python API gets the command line's check: PlanRequest validates seq_len (docs/input-bounds.md).
    with pytest.raises(ZeroplanError, match="learned position table"):
        _request(gpu_80gib, model="gpt2", seq_len=1025)
    gpt2 = get_model("gpt2")
    with pytest.raises(ZeroplanError, match="learned position table"):
        PlanRequest(model=gpt2, batch=BatchSpec(seq_len=1025, allow_longer_seq=True),
                    cluster=cluster_from_gpus(gpu_80gib, 8), strategy=StrategySpec(kind=StrategyKind.ddp))
    assert _request(gpu_80gib, model="gpt2", seq_len=gpt2.max_positions).batch.seq_len == 1024
    with pytest.raises(ZeroplanError, match="--allow-longer-seq"):
        _request(gpu_80gib, model="llama-2-7b", seq_len=4097)
    llama = get_model("llama-2-7b")
    longer = PlanRequest(model=llama, batch=BatchSpec(seq_len=8192, allow_longer_seq=True),
                         cluster=cluster_from_gpus(gpu_80gib, 8), strategy=StrategySpec(kind=StrategyKind.zero3))
    assert plan(longer).memory.activation_bytes > plan(_request(gpu_80gib, model="llama-2-7b")).memory.activation_bytes


_MOMENT_NAMES = {"loss": PeakMoment.loss_backward, "block": PeakMoment.block_backward,
                 "end": PeakMoment.backward_end, "step": PeakMoment.optimizer_step}


@pytest.mark.parametrize("model, accum", [("gpt2", 1), ("llama-2-7b", 1), ("llama-2-7b", 3)])
@pytest.mark.parametrize("kind", list(StrategyKind))
def test_the_named_peak_moment_and_its_columns_add_up_to_the_peak(gpu_80gib, model, accum, kind) -> None:
    request = _request(gpu_80gib, model=model, kind=kind)
    request = request.model_copy(update={"batch": request.batch.model_copy(update={"grad_accum_steps": accum})})
    memory = memory_breakdown(request)[0]
    moments = _moments(request)
    assert moments[next(k for k, v in _MOMENT_NAMES.items() if v is memory.peak_moment)] == max(moments.values())
    assert sum(memory.peak_terms().values()) == memory.peak_bytes
    assert memory.peak_buffer_bytes <= memory.temporary_bytes


def test_ddp_on_70b_peaks_at_the_optimizer_step_with_its_temporary_in_the_table(gpu_80gib) -> None:
    from zeroplan.report.table import render_table

    report = fit(_request(gpu_80gib, kind=StrategyKind.ddp), [StrategyKind.ddp])
    memory = report.plans[0].memory
    assert memory.peak_moment is PeakMoment.optimizer_step
    assert memory.step_temporary_bytes > 0 and "step_temporary_bytes" in memory.peak_terms()
    table = render_table(report)
    assert "step-tmp" in table and "optimizer-step" in table and "add up to peak" in table


def test_one_gpu_recommends_plain_training_without_ddp_buckets(gpu_80gib) -> None:
    report = fit(_request(gpu_80gib, model="gpt2", gpus=1, kind=StrategyKind.ddp))
    ddp = report.plan_for("ddp")
    assert resident_buffer_bytes(_request(gpu_80gib, model="gpt2", gpus=1, kind=StrategyKind.ddp)) == 0
    assert ddp.collectives == () and ddp.sent_bytes_per_step == 0
    assert report.recommended is StrategyKind.ddp and "plain training" in report.verdict


def test_ties_follow_the_documented_rule_not_list_order(gpu_80gib) -> None:
    report = fit(_request(gpu_80gib, model="llama-2-7b", activation_checkpointing=ActivationCheckpointing.full))
    zero1, zero2 = report.plan_for("zero1"), report.plan_for("zero2")
    assert zero1.fits and zero2.fits and zero1.sent_bytes_per_step == zero2.sent_bytes_per_step
    # The same peak: the simpler strategy, whichever comes first.
    tied = zero2.model_copy(update={"memory": zero1.memory, "headroom_bytes": zero1.headroom_bytes})
    assert recommend([tied, zero1]) is StrategyKind.zero1 and recommend([zero1, tied]) is StrategyKind.zero1
    # A lower peak beats simplicity, whichever comes first.
    lower = zero1.memory.model_copy(update={"peak_bytes": zero1.memory.peak_bytes - 1})
    leaner = zero2.model_copy(update={"memory": lower})
    assert recommend([zero1, leaner]) is StrategyKind.zero2 and recommend([leaner, zero1]) is StrategyKind.zero2
    # Fewer bytes sent beats a lower peak.
    quieter = zero1.model_copy(update={"sent_bytes_per_step": zero1.sent_bytes_per_step - 1})
    assert recommend([leaner, quieter]) is StrategyKind.zero1
