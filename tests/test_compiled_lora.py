"""torch.compile with LoRA and QLoRA in the planner, against what inductor's partitioner saved
for torchtune's own LoRA/QLoRA blocks (benchmarks/compiled-finetune-records,
zeroplan/frameworks/compiled.py with a FineTuneSpec)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.core.compiled import check_compiled
from zeroplan.core.frameworks import framework_block_kept_bytes
from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.compiled_record import CompiledBlockRecord, load_compiled_records
from zeroplan.frameworks.record import load_framework_records
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import FineTuneSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
RECORDS = BENCHMARKS / "compiled-finetune-records"
BLOCK_TARGET = 0.02


def request_of(record: CompiledBlockRecord) -> PlanRequest:
    # hf's block was measured under the bf16 autocast the Trainer runs on its DDP path.
    training = TrainingSpec(framework=record.framework, precision="bf16-mixed" if record.autocast else "bf16-pure",
                            compile=True, finetune=record.finetune, activation_checkpointing=record.activation_checkpointing)
    strategy = "ddp" if record.framework.value == "hf" else "fsdp-full-shard"
    return PlanRequest(model=record.model, training=training, batch=record.batch,
                       cluster=cluster_from_gpus(get_gpu("h100-80gb"), 8), strategy=StrategySpec(kind=strategy))


def test_the_records_cover_lora_and_qlora_with_and_without_recomputation() -> None:
    records = load_compiled_records(RECORDS)
    kinds = {(r.framework.value, r.finetune.quantize.value, r.activation_checkpointing.value, r.autocast) for r in records}
    assert kinds == {("torchtune", "none", "none", False), ("torchtune", "none", "full", False),
                     ("torchtune", "nf4", "none", False), ("torchtune", "nf4", "full", False), ("hf", "none", "none", True)}


@pytest.mark.parametrize("path", sorted(RECORDS.glob("*.json")), ids=lambda p: p.stem)
def test_a_compiled_lora_block_keeps_what_the_partitioner_saved(path: Path) -> None:
    record = CompiledBlockRecord.model_validate_json(path.read_text(encoding="utf-8"))
    # The storages the compiled node held at run time, parameters left out: the partitioned
    # graph's list also names five transposed adapter weights of the NF4 block (views of
    # parameters, no storage of their own: 1,015,808 bytes) as intermediates.
    measured = record.compiled_runtime_saved_bytes
    assert 0 <= record.compiled_saved_bytes - measured <= 2 ** 20
    predicted = framework_block_kept_bytes(request_of(record))
    if record.activation_checkpointing.value == "none":
        assert predicted == measured
    # Under full recomputation: the block input (and a few KB of saved RNG state).
    assert abs(predicted - measured) <= BLOCK_TARGET * measured, (predicted, measured)


def test_the_eager_figures_are_the_lora_block_records() -> None:
    # The same block measured eagerly here and by benchmarks/framework_records.py --finetune
    # (hf's: ddp bf16-mixed, the Trainer's autocast, as the hf records here ran).
    def in_force(finetune: FineTuneSpec, framework) -> FineTuneSpec:
        # A record made with the framework's default targets names none.
        return finetune.model_copy(update={"lora_targets": finetune.targets(framework)})

    eager = {(r.training.framework, in_force(r.training.finetune, r.training.framework), r.training.activation_checkpointing):
             r.block_kept_bytes
             for r in load_framework_records(BENCHMARKS / "framework-finetune-records")
             if (r.training.framework.value == "torchtune" or (r.strategy.value == "ddp" and r.training.precision.value == "bf16-mixed"))
             and r.batch.seq_len == 4096}
    compared = {"torchtune": 0, "hf": 0}
    for record in load_compiled_records(RECORDS):
        key = (record.framework, in_force(record.finetune, record.framework), record.activation_checkpointing)
        if key in eager:
            assert record.eager_live_bytes == eager[key], record.name
            compared[record.framework.value] += 1
    assert compared["torchtune"] >= 2 and compared["hf"] >= 2, compared


def test_a_qlora_block_compiled_keeps_its_dequantized_weights() -> None:
    records = {r.name: r for r in load_compiled_records(RECORDS)}
    lora = next(r for r in records.values() if r.finetune.quantize.value == "none" and r.activation_checkpointing.value == "none"
                and r.framework.value == "torchtune" and len(r.finetune.targets(r.framework)) == 7 - 1)  # its 8B_lora targets
    qlora = next(r for r in records.values() if r.finetune.quantize.value == "nf4" and r.activation_checkpointing.value == "none")
    # All seven linears (QLoRA) against q, v, o and the MLP (LoRA): one more r-wide lora_a output
    # (k's), and the block's seven weights in bf16 (Llama-3.1-8B: 218,103,808 elements).
    assert qlora.compiled_runtime_saved_bytes - lora.compiled_runtime_saved_bytes == 2 * 4096 * 8 + 2 * 218_103_808


def _hf_saved_views(record: CompiledBlockRecord, shape: list[int]) -> list[int]:
    """The saved [tokens, width] matmul inputs (views of the linears' 3-d inputs)."""
    return [v.bytes for v in record.compiled_saved_values if v.op == "aten::view" and v.shape == shape]


def test_an_hf_compiled_lora_block_keeps_its_adapters_bf16_weights_and_a_copy_of_os_input() -> None:
    # What hf_compiled_lora_extra_bytes counts beyond torchtune's rule, read from the records'
    # saved values: autocast's bf16 copy of each fp32 adapter weight (lora_A's r x in and
    # lora_B's out x r, transposed), and with an adapter on o its [tokens, h] input.
    hf = [r for r in load_compiled_records(RECORDS) if r.framework.value == "hf"]
    assert len(hf) == 5
    for record in hf:
        model, rank = record.model, record.finetune.lora_rank
        targets = record.finetune.targets(record.framework)
        copies = [v for v in record.compiled_saved_values if v.op == "aten::permute" and v.dtype == "torch.bfloat16"
                  and rank in v.shape and len(v.shape) == 2]
        assert len(copies) == 2 * len(targets), record.name
        tokens = record.batch.seq_len * record.batch.micro_batch_size
        inputs = _hf_saved_views(record, [tokens, model.attention_output_size])
        # The attention norm's and the MLP norm's outputs have the same shape in Llama ([tokens, h]).
        named = {t.value for t in targets}
        norms = sum(bool(named & set(group)) for group in (("q", "k", "v"), ("gate", "up")))
        assert len(inputs) == norms + ("o" in named), record.name


@pytest.mark.parametrize("fields, framework, precision", [
    ({"lora_rank": 8, "lora_dropout": 0.1}, "torchtune", "bf16-pure"),
    ({"lora_rank": 8, "dora": True}, "torchtune", "bf16-pure"),
    ({"lora_rank": 8, "lora_dropout": 0.1}, "hf", "bf16-mixed"),
    ({"lora_rank": 8, "dora": True}, "hf", "bf16-mixed"),
    ({"lora_rank": 8, "base_dtype": "fp32"}, "hf", "bf16-mixed"),
    ({"lora_rank": 8, "quantize": "nf4"}, "hf", "bf16-mixed"),
    ({"lora_rank": 8}, "hf", "bf16-pure"),
])
def test_compiled_fine_tunes_not_measured_are_refused_naming_the_field(fields, framework, precision) -> None:
    with pytest.raises(ZeroplanError) as error:
        check_compiled(TrainingSpec(framework=framework, precision=precision, compile=True, finetune=FineTuneSpec(**fields)),
                       get_model("llama-3.1-8b"))
    assert error.value.field == "finetune"


def test_hf_compiled_lora_is_planned_under_ddp_only() -> None:
    training = TrainingSpec(framework="hf", precision="bf16-mixed", compile=True, finetune=FineTuneSpec(lora_rank=8))
    check_compiled(training, get_model("llama-3.1-8b"))

    def request(kind: str) -> PlanRequest:
        return PlanRequest(model=get_model("llama-3.1-8b"), training=training,
                           cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8), strategy=StrategySpec(kind=kind))

    assert request("ddp").training.compile
    with pytest.raises(ZeroplanError) as error:
        request("fsdp-full-shard")
    assert error.value.field == "strategy"


@pytest.mark.slow
def test_compiled_nf4_linear_writes_its_bf16_weight_once_and_its_backward_dequantizes_nothing() -> None:
    # Inductor's generated CPU code for torchtune's FrozenNF4Linear (benchmarks/compiled_nf4_dequantize.py).
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import compiled_nf4_dequantize as bench
    from zeroplan.core.finetune.activations import COMPILED_NF4_DEQUANTIZE_COPIES

    forward, backward = bench.generated_buffers()
    weight = 2 * bench.IN_FEATURES * bench.OUT_FEATURES
    assert sum(size for _, size in forward if size >= weight) == COMPILED_NF4_DEQUANTIZE_COPIES * weight
    assert not [size for _, size in backward if size >= weight]


def test_a_compiled_torchtune_qlora_plans_no_dequantization_beside_the_blocks_backward() -> None:
    from zeroplan.core.finetune.activations import dequantized_weight_bytes
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.presets.models import get_model
    from zeroplan.specs import BatchSpec, FineTuneSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus

    def request(compile_: bool) -> PlanRequest:
        finetune = FineTuneSpec(lora_rank=8, quantize="nf4", lora_targets=("q", "k", "v", "o", "gate", "up", "down"))
        return PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 1),
                           strategy=StrategySpec(kind="ddp"), batch=BatchSpec(seq_len=2048, micro_batch_size=2),
                           training=TrainingSpec(framework="torchtune", precision="bf16-pure", finetune=finetune,
                                                 activation_checkpointing="full", compile=compile_))

    # Eager: torchao's get_original_weight, 7 bf16 copies of the MLP's 4096 x 14336 weight.
    assert dequantized_weight_bytes(request(False)) == 7 * 2 * 4096 * 14336
    assert dequantized_weight_bytes(request(True)) == 0


def test_the_docs_table_of_hf_compiled_lora_blocks_is_the_records_and_the_rule() -> None:
    # docs/finetuning.md "Compiled hf LoRA": each row from its record and the planner.
    from zeroplan.core.compiled import compiled_layer_bytes, hf_compiled_lora_extra_bytes

    docs = (Path(__file__).resolve().parent.parent / "docs" / "finetuning.md").read_text(encoding="utf-8")
    rows = 0
    for record in load_compiled_records(RECORDS):
        if record.framework.value != "hf":
            continue
        request = request_of(record)
        targets = [t.value for t in record.finetune.targets(record.framework)]
        label = "all seven" if len(targets) == 7 else ", ".join(targets)
        rule = compiled_layer_bytes(request)
        row = (f"| {label}, r {record.finetune.lora_rank} | {record.compiled_runtime_saved_bytes:,} | "
               f"{rule - hf_compiled_lora_extra_bytes(request):,} | {rule:,} | {record.eager_live_bytes:,} |")
        assert row in docs, row
        rows += 1
    assert rows == 5
