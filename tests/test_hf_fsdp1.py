"""hf under accelerate's FSDP1 (fsdp_version 1: `fit --framework hf --fsdp-version 1`,
StrategySpec.fsdp1_root_stays_gathered) against whole steps of transformers' Llama wrapped by
accelerate's own FSDP1 arguments at full size (benchmarks/framework-fsdp1-step-records, written by
`benchmarks/framework_step_records.py --hf-fsdp1`): torch-free, except the live reproduction."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zeroplan.core.model_states import model_state_bytes
from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.step_record import FrameworkStepRecord, load_step_records

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
RECORDS = BENCHMARKS / "framework-fsdp1-step-records"


def _accuracy():
    sys.path.insert(0, str(BENCHMARKS))
    import framework_accuracy

    return framework_accuracy


def _record(path: Path) -> FrameworkStepRecord:
    return FrameworkStepRecord.model_validate_json(path.read_text(encoding="utf-8"))


def test_records_cover_the_fsdp2_records_sizes_under_both_sharding_strategies() -> None:
    records = load_step_records(RECORDS)
    assert all(r.fsdp_version == 1 and r.training.framework.value == "hf" for r in records)
    fsdp2 = {(r.model.name, r.world_size, r.batch.seq_len, r.training.activation_checkpointing)
             for r in load_step_records(BENCHMARKS / "framework-step-records") if r.training.framework.value == "hf"}
    full_shard = {(r.model.name, r.world_size, r.batch.seq_len, r.training.activation_checkpointing)
                  for r in records if r.strategy.value == "fsdp-full-shard"}
    assert fsdp2 <= full_shard
    assert {r.training.activation_checkpointing.value for r in records if r.strategy.value == "fsdp-shard-grad-op"} == {"none", "full"}


@pytest.mark.parametrize("path", sorted(RECORDS.glob("*.json")), ids=lambda p: p.stem)
def test_the_planner_allocated_peak_is_within_target_of_accelerates_fsdp1_step(path: Path) -> None:
    accuracy = _accuracy()
    record = _record(path)
    request = accuracy.step_request(record)
    assert request.strategy.fsdp1_root_stays_gathered
    breakdown = accuracy.memory_breakdown(request)[0]
    assert abs(breakdown.allocated_peak_bytes - record.peak_bytes) <= accuracy.STEP_TARGET * record.peak_bytes


def test_the_fsdp1_plan_is_nearer_each_fsdp1_step_than_the_fsdp2_plan() -> None:
    """What --fsdp-version 1 changes is what the FSDP1 step does: planned as FSDP2, each record
    is missed by at least as much (the root kept gathered, the cat that ends the backward, no
    unit prefetched)."""
    from zeroplan.specs import StrategySpec

    accuracy = _accuracy()
    for record in load_step_records(RECORDS):
        fsdp1 = accuracy.step_request(record)
        fsdp2 = fsdp1.with_strategy(StrategySpec(kind=record.strategy))
        assert (fsdp1.strategy.prefetch_units, fsdp2.strategy.prefetch_units) == (0, 1)
        errors = [abs(accuracy.memory_breakdown(r)[0].allocated_peak_bytes - record.peak_bytes) for r in (fsdp1, fsdp2)]
        assert errors[0] <= errors[1], record.name


@pytest.mark.parametrize("path", sorted(RECORDS.glob("*.json")), ids=lambda p: p.stem)
def test_model_states_equal_the_planners(path: Path) -> None:
    record = _record(path)
    states = model_state_bytes(_accuracy().step_request(record))
    # One flat parameter per unit, padded to a multiple of the ranks: the planner's padding.
    assert record.parameter_bytes == states.parameter_bytes
    assert record.gradient_bytes == states.gradient_bytes
    # use_orig_params hands AdamW every trainable original parameter; one with no element on
    # this rank has no gradient, so AdamW makes it no state, not even its 4-byte step counter.
    finetune = record.training.finetune
    tensors = (2 + 9 * record.model.num_layers + 1 if finetune.trains_everything
               else 2 * len(finetune.targets(record.training.framework)) * record.model.num_layers)
    assert 0 <= states.optimizer_state_bytes - record.optimizer_state_bytes <= 4 * tensors


def test_each_record_peaks_in_backward_with_the_states_alive() -> None:
    for record in load_step_records(RECORDS):
        assert record.running_peak_bytes[record.peak_phase] == record.peak_bytes
        assert record.peak_bytes > record.model_state_bytes


def _fit(zeroplan_cli, *flags: str):
    return zeroplan_cli("fit", "llama-3.1-8b", "--framework", "hf", "--gpus", "8", "--seq-len", "4096", *flags)


def test_fsdp_version_1_is_accepted_under_hf_and_named_in_the_header(zeroplan_cli) -> None:
    code, out, _ = _fit(zeroplan_cli, "--strategies", "fsdp-full-shard", "--fsdp-version", "1")
    assert code == 0 and "fsdp_version 1 (FullyShardedDataParallel" in out
    code, out, _ = _fit(zeroplan_cli, "--strategies", "fsdp-full-shard")
    assert code == 0 and "fsdp_version 2 (fully_shard)" in out
    # The default list leaves out what FSDP1 was not measured under, with the reason.
    code, out, _ = _fit(zeroplan_cli, "--fsdp-version", "1")
    assert code == 0 and "Left out: hsdp: hf under FSDP1" in " ".join(out.split())
    code, out, _ = zeroplan_cli("compare", "llama-3.1-8b", "--framework", "hf", "--gpus", "8", "--fsdp-version", "1")
    assert code == 0 and "fsdp_version 1 (FullyShardedDataParallel" in " ".join(out.split())


def _full_fine_tune_one_micro_batch(record: FrameworkStepRecord) -> bool:
    return record.training.finetune.trains_everything and record.batch.grad_accum_steps == 1


def _error(record: FrameworkStepRecord) -> float:
    accuracy = _accuracy()
    return accuracy.memory_breakdown(accuracy.step_request(record))[0].allocated_peak_bytes / record.peak_bytes - 1


def test_lora_and_accumulation_records_are_met_as_closely_as_the_full_fine_tunes() -> None:
    """PEFT LoRA and no_sync accumulation under accelerate's FSDP1: each record within the range
    of errors the one-micro-batch full fine-tunes' records meet."""
    records = load_step_records(RECORDS)
    base = [_error(r) for r in records if _full_fine_tune_one_micro_batch(r)]
    new = {r.name: _error(r) for r in records if not _full_fine_tune_one_micro_batch(r)}
    assert {"lora", "accumulation"} <= {"lora" if "+lora" in name else "accumulation" for name in new}
    assert all(min(base) <= error <= max(base) for error in new.values()), (min(base), max(base), new)


def test_lora_states_are_peft_adapters_over_a_frozen_bf16_base() -> None:
    """accelerate upcasts only the flat parameters that require grad: the frozen base's shards
    stay bf16 (2 bytes an element), the adapters' fp32 with fp32 gradients and AdamW states."""
    records = load_step_records(RECORDS)
    full = {(r.model.name, r.world_size): r.parameter_bytes for r in records
            if r.training.finetune.trains_everything and r.strategy.value == "fsdp-full-shard"}
    lora = [r for r in records if r.training.finetune.is_lora]
    assert lora
    for record in lora:
        assert "frozen torch.bfloat16" in record.sharding and "peft fsdp_auto_wrap_policy" in record.sharding
        adapters = record.gradient_bytes // 4
        # exp_avg and exp_avg_sq of every adapter element, and a 4-byte step counter for each
        # adapter weight with elements on this rank.
        tensors = 2 * len(record.training.finetune.targets(record.training.framework)) * record.model.num_layers
        assert 0 < record.optimizer_state_bytes - 2 * 4 * adapters <= 4 * tensors
        # Half the full fine-tune's fp32 shards, but for each unit's padding to the ranks.
        frozen = record.parameter_bytes - 4 * adapters
        assert abs(2 * frozen - full[record.model.name, record.world_size]) <= 4 * record.world_size * (record.model.num_layers + 1)


@pytest.mark.parametrize("flags, field", [
    (("--strategies", "hsdp"), "--strategies"),
    (("--strategies", "fsdp-shard-grad-op", "--grad-accum", "2"), "--grad-accum"),
    (("--strategies", "fsdp-shard-grad-op", "--lora-rank", "16"), "--strategies"),
    (("--strategies", "fsdp-full-shard", "--lora-rank", "16", "--quantize", "nf4"), "--kbit-fp32-cast"),
    (("--strategies", "fsdp-full-shard", "--lora-rank", "16", "--dora"), "--dora"),
    (("--strategies", "fsdp-full-shard", "--lora-rank", "16", "--base-dtype", "fp32"), "--base-dtype"),
    (("--strategies", "fsdp-shard-grad-op", "--fsdp-cpu-offload"), "--fsdp-cpu-offload"),
    (("--strategies", "fsdp-full-shard", "--precision", "fp32"), "--precision"),
    (("--strategies", "fsdp-full-shard", "--compile"), "compile"),
])
def test_what_hf_fsdp1_was_not_measured_under_is_one_line(zeroplan_cli, flags, field) -> None:
    code, out, err = _fit(zeroplan_cli, "--fsdp-version", "1", *flags)
    assert code == 2 and len(err.strip().splitlines()) == 1 and field in err and "FSDP1" in err, err


def test_frameworks_that_run_their_own_fsdp_still_refuse_the_version(zeroplan_cli) -> None:
    code, _, err = zeroplan_cli("fit", "llama-3.1-8b", "--framework", "torchtune", "--gpus", "8", "--fsdp-version", "1")
    assert code == 2 and "fsdp-version" in err and len(err.strip().splitlines()) == 1


def test_the_api_refuses_an_unmeasured_hf_fsdp1_request() -> None:
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.presets.models import get_model
    from zeroplan.specs import BatchSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
    from zeroplan.specs.framework import Framework

    def request(kind: str, **strategy):
        return PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8),
                           strategy=StrategySpec(kind=kind, **strategy), batch=BatchSpec(seq_len=4096, micro_batch_size=1),
                           training=TrainingSpec(framework=Framework.hf))

    assert request("fsdp-full-shard", fsdp1_root_stays_gathered=True).strategy.fsdp1_root_stays_gathered
    with pytest.raises(ZeroplanError, match="strategy"):
        request("hsdp", fsdp1_root_stays_gathered=True)
    request("hsdp")  # FSDP2 as before


def test_lora_and_accumulation_are_planned_under_fsdp_version_1(zeroplan_cli) -> None:
    for flags in (("--lora-rank", "16", "--lora-targets", "q,v"), ("--grad-accum", "2"),
                  ("--lora-rank", "8", "--quantize", "nf4", "--no-kbit-fp32-cast", "--fsdp-cpu-offload"),
                  ("--fsdp-cpu-offload",), ("--fsdp-cpu-offload", "--grad-accum", "2")):
        code, out, err = _fit(zeroplan_cli, "--strategies", "fsdp-full-shard", "--fsdp-version", "1", *flags)
        assert code == 0 and "fsdp_version 1 (FullyShardedDataParallel" in out, err


def test_accumulation_under_hf_fsdp1_keeps_unsharded_gradients() -> None:
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.presets.models import get_model
    from zeroplan.specs import BatchSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
    from zeroplan.specs.framework import Framework

    def request(accumulation: int, fsdp1: bool = True, **named) -> PlanRequest:
        return PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8),
                           strategy=StrategySpec(kind="fsdp-full-shard", fsdp1_root_stays_gathered=fsdp1, **named),
                           batch=BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum_steps=accumulation),
                           training=TrainingSpec(framework=Framework.hf))

    def strategy(accumulation: int, fsdp1: bool = True, **named) -> StrategySpec:
        return request(accumulation, fsdp1, **named).strategy

    assert strategy(2).keep_unsharded_grads_on_accum and strategy(1).keep_unsharded_grads_on_accum
    # Set at one micro-batch too, so a copy at two made without validation (the plan search's
    # core.search._at) plans the kept gradients as the request built at two does.
    from zeroplan.core.plan import memory_breakdown

    one = request(1)
    copied = one.model_copy(update={"batch": one.batch.model_copy(update={"grad_accum_steps": 2})})
    assert memory_breakdown(copied) == memory_breakdown(request(2))
    assert memory_breakdown(request(2)) != memory_breakdown(request(2, fsdp1=False))
    # The Trainer enters no_sync itself (trainer.py lines 2665-2671): no setting turns it off.
    assert strategy(2, keep_unsharded_grads_on_accum=False).keep_unsharded_grads_on_accum
    # FSDP2's fully_shard has no no_sync: accelerate's no_sync leaves it reducing every micro-batch.
    assert not strategy(2, fsdp1=False).keep_unsharded_grads_on_accum


def test_fsdp1_offload_keeps_the_reduced_shards_on_the_device_until_backward_ends() -> None:
    from zeroplan.core.buffers import backward_end_gradient_bytes
    from zeroplan.core.model_states import model_state_bytes
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.presets.models import get_model
    from zeroplan.specs import BatchSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
    from zeroplan.specs.framework import Framework

    def request(offload: bool, fsdp1: bool) -> PlanRequest:
        return PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8),
                           strategy=StrategySpec(kind="fsdp-full-shard", fsdp1_root_stays_gathered=fsdp1),
                           batch=BatchSpec(seq_len=4096, micro_batch_size=1),
                           training=TrainingSpec(framework=Framework.hf, fsdp_cpu_offload=offload))

    shards = model_state_bytes(request(False, True)).gradient_bytes
    assert shards > 0 and model_state_bytes(request(True, True)).gradient_bytes == 0
    # FSDP1's _saved_grad_shard outlives the copy into _cpu_grad until backward ends ...
    assert backward_end_gradient_bytes(request(True, True)) == shards
    # ... where FSDP2's CPUOffloadPolicy moves each shard to the host as it is reduced.
    assert not backward_end_gradient_bytes(request(True, False))


@pytest.mark.slow
def test_a_live_lora_accumulation_step_reproduces_its_committed_record() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    pytest.importorskip("accelerate")
    from zeroplan.frameworks.hf_fsdp1_step import run_hf_fsdp1_step
    from zeroplan.frameworks.step import step_training
    from zeroplan.specs import BatchSpec, StrategyKind
    from zeroplan.specs.finetune import FineTuneSpec
    from zeroplan.specs.framework import Framework

    sys.path.insert(0, str(BENCHMARKS))
    from framework_step_records import shallow_model

    training = step_training(Framework.hf, "full").model_copy(
        update={"finetune": FineTuneSpec(lora_rank=16, lora_targets=["q", "v"])})
    record = run_hf_fsdp1_step(shallow_model("llama-3.1-8b"), StrategyKind.fsdp_full_shard, training,
                               BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum_steps=2), 8)
    committed = _record(RECORDS / record.file_name)
    assert record.framework_version == committed.framework_version
    assert record.peak_bytes == committed.peak_bytes
    assert record.running_peak_bytes == committed.running_peak_bytes
    assert record.model_state_bytes == committed.model_state_bytes


@pytest.mark.slow
def test_a_live_fsdp1_step_reproduces_its_committed_record() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from zeroplan.frameworks.hf_fsdp1_step import run_hf_fsdp1_step
    from zeroplan.frameworks.step import step_training
    from zeroplan.specs import BatchSpec, StrategyKind
    from zeroplan.specs.framework import Framework

    sys.path.insert(0, str(BENCHMARKS))
    from framework_step_records import shallow_model

    record = run_hf_fsdp1_step(shallow_model("llama-3.1-8b"), StrategyKind.fsdp_full_shard,
                               step_training(Framework.hf, "full"), BatchSpec(seq_len=4096, micro_batch_size=1), 8)
    committed = _record(RECORDS / record.file_name)
    assert record.framework_version == committed.framework_version
    assert record.peak_bytes == committed.peak_bytes
    assert record.running_peak_bytes == committed.running_peak_bytes
    assert record.model_state_bytes == committed.model_state_bytes


QLORA_RECORDS = BENCHMARKS / "framework-fsdp1-qlora-offload-step-records"


@pytest.mark.parametrize("path", sorted(QLORA_RECORDS.glob("*.json")), ids=lambda p: p.stem)
def test_the_fsdp1_plan_meets_each_qlora_and_offload_step(path: Path) -> None:
    """PEFT QLoRA (bf16-stored nf4) under accelerate's FSDP1, with and without CPUOffload, at
    the published runs' configurations (use_orig_params false), and a bf16 LoRA offloaded under
    the Trainer's own settings: the --fsdp-version 1 plan within the step target."""
    accuracy = _accuracy()
    record = _record(path)
    quantized = record.training.finetune.quantize.value == "nf4"
    assert quantized or record.training.fsdp_cpu_offload
    assert f"use_orig_params={not quantized}" in record.sharding
    breakdown = accuracy.memory_breakdown(accuracy.step_request(record))[0]
    assert abs(breakdown.allocated_peak_bytes - record.peak_bytes) <= accuracy.STEP_TARGET * record.peak_bytes


def test_qlora_records_cover_offload_and_keep_host_states_off_the_device() -> None:
    records = load_step_records(QLORA_RECORDS)
    assert {(r.training.fsdp_cpu_offload, r.training.finetune.quantize.value) for r in records} == {
        (False, "nf4"), (True, "nf4"), (True, "none")}
    for record in records:
        assert ("frozen torch.bfloat16" in record.sharding) is record.training.finetune.is_lora
        if record.training.fsdp_cpu_offload:
            assert "CPUOffload(offload_params=True)" in record.sharding
            assert record.parameter_bytes == record.gradient_bytes == record.optimizer_state_bytes == 0
    by_offload = {r.training.fsdp_cpu_offload: r for r in records if r.model.name == "llama-2-70b"}
    # Offloading moves the sharded 4-bit base (16 GiB a rank for Llama-2-70B on 2) off the device.
    assert by_offload[False].peak_bytes - by_offload[True].peak_bytes > 15 * 2**30


def test_host_storages_are_left_out_of_the_running_peak() -> None:
    from zeroplan.allocator.trace import AllocEvent, FreeEvent
    from zeroplan.frameworks.hf_fsdp1_step import _running_peaks

    events = [AllocEvent(id=0, size_bytes=100, stream=0), AllocEvent(id=1, size_bytes=40, stream=0),
              AllocEvent(id=2, size_bytes=7, stream=0), FreeEvent(id=2), FreeEvent(id=1)]
    marks = {"start": 1, "forward0": 3, "backward0": 4, "optimizer": 5, "micro_batches": 1}
    assert max(_running_peaks(events, marks).values()) == 147
    assert max(_running_peaks(events, marks, frozenset({0})).values()) == 47


def test_a_quantized_fsdp1_step_refuses_peft_fp32_cast() -> None:
    from zeroplan.frameworks.hf_fsdp1_step import check_hf_fsdp1_step
    from zeroplan.specs import StrategyKind, TrainingSpec
    from zeroplan.specs.finetune import FineTuneSpec
    from zeroplan.specs.framework import Framework

    training = TrainingSpec(framework=Framework.hf, finetune=FineTuneSpec(lora_rank=8, quantize="nf4"))
    with pytest.raises(ZeroplanError, match="kbit_fp32_cast"):
        check_hf_fsdp1_step(StrategyKind.fsdp_full_shard, training, 2, 0)


ORIG_PARAMS_RECORDS = BENCHMARKS / "framework-fsdp1-orig-params-step-records"


def test_peft_bnb_autocast_question_is_answered_for_the_fake_device() -> None:
    """peft's Linear4bit.forward asks torch.is_autocast_enabled() with no device (CUDA's on a
    GPU); on the fake CPU device the step answers it for the CPU's autocast, and only there."""
    import torch

    from zeroplan.frameworks.autocast_query import autocast_query_on_device

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled() is False
        with autocast_query_on_device("cpu"):
            assert torch.is_autocast_enabled() is True
            assert torch.is_autocast_enabled("cuda") is False
    with autocast_query_on_device("cpu"):
        assert torch.is_autocast_enabled() is False
    assert torch.is_autocast_enabled() is False


def test_use_orig_params_changes_nothing_of_a_qlora_step() -> None:
    """Under autocast peft casts no QLoRA adapter input, so the fp32 sharded views
    use_orig_params leaves as lora_A.weight are never read for a cast: the step under the
    Trainer's use_orig_params=True keeps what PEFT's use_orig_params=False config keeps, to the
    byte, and the plan (which has no use_orig_params input) meets both."""
    accuracy = _accuracy()
    (orig,) = load_step_records(ORIG_PARAMS_RECORDS)
    flat = _record(QLORA_RECORDS / orig.file_name)
    assert "use_orig_params=True" in orig.sharding and "use_orig_params=False" in flat.sharding
    assert orig.peak_bytes == flat.peak_bytes
    assert orig.running_peak_bytes == flat.running_peak_bytes
    breakdown = accuracy.memory_breakdown(accuracy.step_request(orig))[0]
    assert abs(breakdown.allocated_peak_bytes - orig.peak_bytes) <= accuracy.STEP_TARGET * orig.peak_bytes
