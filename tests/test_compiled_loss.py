"""The compiled loss in the planner, against what inductor's partitioner saved for one chunk of
torchtune's and torchtitan's own cross-entropy, compiled as each framework compiles its loss
(benchmarks/compiled-loss-records, zeroplan/frameworks/compiled_loss.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.allocator.fsdp_schedule import fsdp_step_inputs
from zeroplan.core.compiled import (COMPILED_CROSS_ENTROPY_ROW_BYTES, compiled_chunked_logits_pieces, compiles_loss,
                                    compiles_unchunked_loss)
from zeroplan.core.framework_loss import chunked_logits_pieces, fsdp_head_gathered_bytes, framework_logits_pieces
from zeroplan.core.plan import peak_terms
from zeroplan.core.plan import plan
from zeroplan.frameworks.compiled_record import CompiledLossRecord, load_compiled_loss_records
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.units import FP32_BYTES

RECORDS = Path(__file__).resolve().parent.parent / "benchmarks" / "compiled-loss-records"


def _records() -> list[CompiledLossRecord]:
    return load_compiled_loss_records(RECORDS)


def test_the_records_cover_both_frameworks_at_every_block_shape() -> None:
    records = _records()
    assert {r.framework.value for r in records} == {"torchtune", "torchtitan"}
    assert len([r for r in records if r.chunks == 8]) == 6
    # torchtitan's unchunked loss, compiled whole (chunks 1), at the published MI300X rows' shape too.
    assert {(r.model.name, r.batch.seq_len, r.batch.micro_batch_size) for r in records if r.chunks == 1} == {
        ("llama-3-8b", 8192, 1), ("llama-3.1-8b", 4096, 1), ("llama-3.1-8b", 8192, 2)}


@pytest.mark.parametrize("record", _records(), ids=lambda r: r.name)
def test_a_compiled_chunk_saves_its_bf16_logits_and_two_fp32_values_a_row(record: CompiledLossRecord) -> None:
    logits_bytes = 2 * record.rows * record.model.vocab_size
    assert record.saved_bytes(True, ("hidden",)) == logits_bytes
    assert record.saved_bytes(True) == COMPILED_CROSS_ENTROPY_ROW_BYTES * record.rows
    assert record.compiled_gradient_dtype == "torch.bfloat16"
    # What the compiled autograd node held at run time: the list, distinct storages.
    assert record.compiled_runtime_saved_bytes == record.saved_bytes(True, ("hidden", "shared", "intermediate"))
    # Eager keeps the fp32 log-softmax (and a scalar), as chunked_logits_pieces charges it.
    assert record.saved_bytes(False) == FP32_BYTES * record.rows * record.model.vocab_size + FP32_BYTES


def _torchtune(compile_: bool, model: str = "llama-3.1-8b", seq_len: int = 4096, micro_batch: int = 1) -> PlanRequest:
    training = TrainingSpec(framework="torchtune", precision="bf16-pure", compile=compile_, activation_checkpointing="full")
    return PlanRequest(model=get_model(model), training=training, batch=BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch),
                       cluster=cluster_from_gpus(get_gpu("h100-80gb"), 8), strategy=StrategySpec(kind="fsdp-full-shard"))


@pytest.mark.parametrize("record", [r for r in _records() if r.framework.value == "torchtune"], ids=lambda r: r.name)
def test_torchtunes_compiled_loss_holds_what_its_chunks_save(record: CompiledLossRecord) -> None:
    request = _torchtune(True, record.model.name, record.batch.seq_len, record.batch.micro_batch_size)
    assert compiles_loss(request.training)
    forward, backward, head = framework_logits_pieces(request)
    # Forward: every chunk's saved values (its logits and row statistics), all chunks alive.
    per_chunk = record.saved_bytes(True, ("hidden", "intermediate"))
    assert forward == record.chunks * per_chunk
    # Backward: the same, plus the first chunk's bf16 gradient (the backward graph's output).
    assert backward == record.chunks * per_chunk + 2 * record.rows * record.model.vocab_size
    eager = framework_logits_pieces(_torchtune(False, record.model.name, record.batch.seq_len, record.batch.micro_batch_size))
    assert head == eager[2] and forward < eager[0] and backward < eager[1]


def test_the_compiled_loss_lowers_torchtunes_loss_and_only_torchtunes() -> None:
    eager, compiled = plan(_torchtune(False, micro_batch=2)), plan(_torchtune(True, micro_batch=2))
    assert compiled.memory.allocated_peak_bytes <= eager.memory.allocated_peak_bytes
    assert compiled.max_micro_batch_size > eager.max_micro_batch_size
    titan = TrainingSpec(framework="torchtitan", precision="bf16-mixed", compile=True)
    assert not compiles_loss(titan)


def test_the_compiled_pieces_are_the_eager_ones_without_the_fp32_log_softmax() -> None:
    training = TrainingSpec(framework="torchtune", precision="bf16-pure", compile=True)
    model = get_model("llama-3.1-8b")
    sbv = 4096 * model.vocab_size
    eager = chunked_logits_pieces(model, training, 4096, 1, 8)
    compiled = compiled_chunked_logits_pieces(model, training, 4096, 1, 8)
    assert eager[0] - compiled[0] == FP32_BYTES * sbv + FP32_BYTES * sbv // 8 - COMPILED_CROSS_ENTROPY_ROW_BYTES * 4096


def test_measuring_a_compiled_loss_runs_the_frameworks_own_compile_call() -> None:
    pytest.importorskip("torchtune")
    pytest.importorskip("torchtitan")
    from zeroplan.frameworks.compiled_loss import measure_compiled_loss
    from zeroplan.specs.framework import Framework

    tiny = get_model("llama-3.1-8b").model_copy(update={"vocab_size": 512})
    for framework in (Framework.torchtune, Framework.torchtitan):
        record = measure_compiled_loss(framework, tiny, BatchSpec(seq_len=64, micro_batch_size=2))
        assert record.rows == 16 and record.saved_bytes(True) == COMPILED_CROSS_ENTROPY_ROW_BYTES * 16
        assert record.saved_bytes(False) == FP32_BYTES * 16 * 512 + FP32_BYTES


def _torchtitan_unchunked(compile_: bool, model: str = "llama-3-8b", seq_len: int = 8192, micro_batch: int = 1,
                          release: str | None = None, tp: int = 1) -> PlanRequest:
    training = TrainingSpec(framework="torchtitan", precision="bf16-mixed", compile=compile_, unchunked_loss=True,
                            activation_checkpointing="selective-op", torchtitan_release=release)
    return PlanRequest(model=get_model(model), training=training, batch=BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch),
                       cluster=cluster_from_gpus(get_gpu("h100-80gb"), 8), strategy=StrategySpec(kind="fsdp-full-shard"),
                       parallel={"tp": tp})


@pytest.mark.parametrize("record", [r for r in _records() if r.chunks == 1], ids=lambda r: r.name)
def test_torchtitans_compiled_unchunked_loss_holds_what_it_saves_and_its_bf16_gradient(record: CompiledLossRecord) -> None:
    request = _torchtitan_unchunked(True, record.model.name, record.batch.seq_len, record.batch.micro_batch_size)
    assert compiles_unchunked_loss(request)
    (moment,) = framework_logits_pieces(request)
    # What the partition saved (the bf16 logits and the row statistics; the labels are the
    # batch's) and the backward's bf16 gradient, beside the head's unit FSDP2 holds gathered.
    gradient = 2 * record.rows * record.model.vocab_size
    assert record.compiled_gradient_dtype == "torch.bfloat16"
    assert moment == record.saved_bytes(True, ("hidden", "intermediate")) + gradient + fsdp_head_gathered_bytes(request)
    # Eager: the fp32 log-softmax the record's eager run saved, and two fp32 gradients.
    (eager,) = framework_logits_pieces(_torchtitan_unchunked(False, record.model.name, record.batch.seq_len,
                                                             record.batch.micro_batch_size))
    assert eager == 3 * (record.saved_bytes(False) - FP32_BYTES) + fsdp_head_gathered_bytes(request)


def test_only_the_releases_that_compile_their_loss_compile_it_and_the_schedule_runs_it() -> None:
    # torchtitan 9dec370 (train.py:136-138) and 0da8901 (components/loss.py:17-18) leave the loss
    # eager under compile; 2c8b594 (components/loss.py:25-30) and 0.3.0 (BaseLoss._maybe_compile) compile it.
    assert compiles_unchunked_loss(_torchtitan_unchunked(True))
    assert not compiles_unchunked_loss(_torchtitan_unchunked(True, release="9dec370"))
    assert not compiles_unchunked_loss(_torchtitan_unchunked(False))
    # Under tensor parallelism 0.3.0 runs its own loss-parallel Function, not measured compiled.
    assert not compiles_unchunked_loss(_torchtitan_unchunked(True, tp=2))
    request = _torchtitan_unchunked(True)
    inputs = fsdp_step_inputs(request, peak_terms(request)[1])
    logits = 2 * 8192 * request.model.vocab_size
    assert inputs.compiled_loss and inputs.loss_tensors == (logits, COMPILED_CROSS_ENTROPY_ROW_BYTES * 8192)
    eager = _torchtitan_unchunked(False)
    assert not fsdp_step_inputs(eager, peak_terms(eager)[1]).compiled_loss
    # Two fp32 logit-sized tensors fewer at the loss's backward (4 + 4 against 2 bytes a logit).
    compiled_plan, eager_plan = plan(request), plan(_torchtitan_unchunked(True, release="9dec370"))
    assert compiled_plan.memory.allocated_peak_bytes < eager_plan.memory.allocated_peak_bytes
