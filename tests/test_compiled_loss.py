"""The compiled loss in the planner, against what inductor's partitioner saved for one chunk of
torchtune's and torchtitan's own cross-entropy, compiled as each framework compiles its loss
(benchmarks/compiled-loss-records, zeroplan/frameworks/compiled_loss.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.core.compiled import COMPILED_CROSS_ENTROPY_ROW_BYTES, compiled_chunked_logits_pieces, compiles_loss
from zeroplan.core.framework_loss import chunked_logits_pieces, framework_logits_pieces
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
    assert len(records) == 6


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
