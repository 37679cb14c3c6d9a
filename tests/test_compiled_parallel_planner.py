"""torch.compile under tensor, sequence and context parallelism and with torchtune's activation
offloading, in the planner, against what inductor's partitioner saved for torchtitan's own
sharded block on a fake process group and what torchtune's offloading moved with compiled
layers (benchmarks/compiled-parallel-records, zeroplan/frameworks/compiled_parallel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.core.compiled import check_compiled, compiled_layer_bytes, runs_checkpointing
from zeroplan.core.frameworks import framework_activation_bytes, framework_block_kept_bytes, framework_layer_bytes
from zeroplan.core.parallel.activations import micro_batch_bytes
from zeroplan.core.plan import framework_activations, plan
from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.compiled_parallel_record import (
    CompiledOffloadRecord, CompiledParallelBlockRecord, load_compiled_parallel_records,
)
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import ActivationCheckpointing, BatchSpec, PlanRequest, StrategySpec, TrainingSpec
from zeroplan.specs.hardware import cluster_from_gpus
from zeroplan.specs.parallel import ParallelSpec

RECORDS = Path(__file__).resolve().parent.parent / "benchmarks" / "compiled-parallel-records"
PARALLEL = load_compiled_parallel_records(RECORDS)
OFFLOAD = [CompiledOffloadRecord.model_validate_json(p.read_text(encoding="utf-8"))
           for p in sorted((RECORDS / "offload").glob("*.json"))]
BLOCK_TARGET = 0.02
"""Per block within 2 % (the issue's target for per-block figures); most are to the byte."""


def request_of(record: CompiledParallelBlockRecord, **training) -> PlanRequest:
    training = dict(framework="torchtitan", compile=True, float8=record.float8_recipe,
                    activation_checkpointing=record.activation_checkpointing) | training
    return PlanRequest(
        model=record.model, training=TrainingSpec(**training), batch=record.batch,
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), record.tp * record.cp),
        strategy=StrategySpec(kind="fsdp-full-shard"),
        parallel=ParallelSpec(tp=record.tp, cp=record.cp, sequence_parallel=record.sequence_parallel),
    )


def test_the_records_cover_tp_with_and_without_sp_cp_both_and_float8():
    layouts = {(r.tp > 1, r.sequence_parallel, r.cp > 1, r.float8_recipe) for r in PARALLEL}
    assert {(True, True, False, None), (True, False, False, None), (False, False, True, None), (True, True, True, None),
            (False, False, True, "tensorwise"), (True, True, False, "tensorwise"), (True, False, False, "tensorwise"),
            (True, True, False, "rowwise")} <= layouts
    # The partition's list, checked at run time (the compiled autograd node's saved tensors).
    assert all(r.compiled_runtime_saved_bytes == r.compiled_saved_bytes for r in PARALLEL)


@pytest.mark.parametrize("record", PARALLEL, ids=lambda r: r.name)
def test_a_compiled_parallel_block_keeps_what_the_partitioner_saved(record):
    predicted = micro_batch_bytes(request_of(record), framework_activations).per_block
    measured = record.compiled_saved_bytes
    assert abs(predicted - measured) <= BLOCK_TARGET * measured, (predicted, measured)


FULL = [r for r in PARALLEL if r.activation_checkpointing.value == "full"]


@pytest.mark.parametrize("record", FULL, ids=lambda r: r.name)
def test_the_recomputed_block_is_the_compiled_block_of_the_same_layout(record):
    # Full recomputation reruns the compiled block in backward: the planner's recomputed block is
    # what the same layout's uncheckpointed compiled record saved.
    none = next(r for r in PARALLEL if r.activation_checkpointing.value == "none" and
                (r.model, r.tp, r.sequence_parallel, r.cp, r.float8_recipe, r.batch) ==
                (record.model, record.tp, record.sequence_parallel, record.cp, record.float8_recipe, record.batch))
    recompute = micro_batch_bytes(request_of(record), framework_activations).recompute
    assert abs(recompute - none.compiled_saved_bytes) <= BLOCK_TARGET * none.compiled_saved_bytes


def offload_request(record: CompiledOffloadRecord, **training) -> PlanRequest:
    training = dict(framework="torchtune", precision="bf16-pure", compile=True, finetune=record.finetune,
                    activation_checkpointing="full", activation_offloading=True) | training
    return PlanRequest(model=record.model, batch=record.batch, cluster=cluster_from_gpus(get_gpu("a100-80gb"), 1),
                       strategy=StrategySpec(kind="ddp"), training=TrainingSpec(**training))


def test_compiled_offloading_moves_what_eager_moves_and_recomputes_the_compiled_layer():
    assert {(r.finetune.is_lora, r.finetune.quantize.value) for r in OFFLOAD} == {(False, "none"), (True, "none"), (True, "nf4")}
    for record in OFFLOAD:
        assert record.compiled_host_bytes == record.eager_host_bytes
        # Every layer ran compiled: from one graph, or with a frozen embedding (LoRA) from two,
        # the first layer's (its input needs no gradient) and the one the deeper layers share.
        assert record.dynamo_graphs == (2 if record.finetune.is_lora else 1)
        request = offload_request(record)
        # The recomputed layer: the compiled (LoRA/QLoRA) block's rule, to the byte.
        assert compiled_layer_bytes(request) == record.compiled_layer_saved_bytes, record.file_name
        eager = offload_request(record, compile=False)
        # Only the recomputed block differs between the two: the offloaded stash is the same.
        assert (framework_activation_bytes(request) - framework_activation_bytes(eager)
                == framework_layer_bytes(request) - framework_layer_bytes(eager))


def test_the_first_lora_layer_keeps_less_than_the_recomputed_one():
    # Its input needs no gradient: no input and no first-norm rsqrt kept (and over NF4 no
    # dequantized q, k, v weights, which only the input's gradient reads), so the planner's
    # recomputed block is the deeper layers' graph.
    for record in OFFLOAD:
        if record.finetune.is_lora:
            model = record.model
            tokens, h = record.batch.seq_len * record.batch.micro_batch_size, model.hidden_size
            qkv_weights = 2 * h * (model.q_size + 2 * model.kv_size) if record.finetune.quantize.value == "nf4" else 0
            dropped = record.compiled_layer_saved_bytes - record.compiled_first_layer_saved_bytes
            assert dropped == 2 * tokens * h + 4 * tokens + qkv_weights


def test_compiled_lora_with_offloading_is_planned_and_what_was_not_measured_stays_refused():
    for record in OFFLOAD:
        check_compiled(offload_request(record).training, record.model)  # refused before
    lora = next(r for r in OFFLOAD if r.finetune.is_lora)
    for unmeasured in ({"dora": True}, {"lora_dropout": 0.05}):
        finetune = lora.finetune.model_copy(update=unmeasured)
        with pytest.raises(ZeroplanError) as error:
            check_compiled(offload_request(lora, finetune=finetune).training, lora.model)
        assert error.value.field == "finetune"


def _layout(**parallel) -> dict:
    return dict(model=get_model("llama-3.1-8b"), batch=BatchSpec(seq_len=8192, micro_batch_size=1, grad_accum_steps=2),
                cluster=cluster_from_gpus(get_gpu("h100-80gb"), 8), strategy=StrategySpec(kind="fsdp-full-shard"),
                parallel=ParallelSpec(**parallel))


def test_a_pipeline_stage_keeps_the_data_parallel_compiled_block():
    # torchtitan's pipeline_llm runs parallelize_llama (apply_compile included) on every stage:
    # a stage's block per micro-batch is the data-parallel compiled block, and the plan answers.
    for policy in ("none", "full", "selective-op"):
        training = TrainingSpec(framework="torchtitan", compile=True, activation_checkpointing=policy)
        staged = PlanRequest(training=training, **_layout(pp=2))
        flat = PlanRequest(training=training, **_layout())
        assert micro_batch_bytes(staged, framework_activations).per_block == framework_block_kept_bytes(flat)
        plan(staged)  # planned, not refused (peak_terms refused compile under pp before)


@pytest.mark.parametrize("training, parallel, field", [
    ({"framework": "torchtitan", "compile": True, "float8": "tensorwise", "activation_checkpointing": "selective-op"},
     {"tp": 2, "sequence_parallel": True}, "float8"),
])
def test_unmeasured_compiled_layouts_are_refused_naming_the_field(training, parallel, field):
    with pytest.raises(ZeroplanError) as error:
        PlanRequest(training=TrainingSpec(**training), **_layout(**parallel))
    assert error.value.field == field


def test_the_search_varies_only_policies_measured_under_the_layout():
    training = TrainingSpec(framework="torchtitan", compile=True, float8="tensorwise", activation_checkpointing="none")
    tp = ParallelSpec(tp=2, sequence_parallel=True)
    assert [p.value for p in ActivationCheckpointing if runs_checkpointing(training, p, tp)] == ["none", "full"]
    assert runs_checkpointing(training, ActivationCheckpointing.selective_op, ParallelSpec(cp=2))
    # A request varied by model_copy, as the search varies policies, is refused by the planner too.
    request = PlanRequest(training=training, **_layout(tp=2, sequence_parallel=True))
    varied = request.model_copy(update={"training": training.model_copy(update={"activation_checkpointing": ActivationCheckpointing.selective_op})})
    with pytest.raises(ZeroplanError, match="under tensor parallelism"):
        plan(varied)


@pytest.mark.slow
def test_compiled_lora_offloading_on_a_small_model_moves_what_eager_moves(tmp_path):
    # torchtune's LoRA model with OffloadActivations, eager and every layer compiled, at a small
    # width (what it moves and the layer's partition are per element): two layers, so the deeper
    # layer's graph is compiled too.
    import json

    from zeroplan.frameworks.compiled_parallel import measure_compiled_offload
    from zeroplan.specs import FineTuneSpec

    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}), encoding="utf-8")
    finetune = FineTuneSpec(lora_rank=8, lora_targets=("q", "v", "o", "gate", "up", "down"))
    record = measure_compiled_offload(str(config), 64, 1, depths=(1, 2), finetune=finetune)
    assert record.compiled_host_bytes == record.eager_host_bytes
    assert record.dynamo_graphs == 2
    assert compiled_layer_bytes(offload_request(record)) == record.compiled_layer_saved_bytes


@pytest.mark.slow
def test_a_fresh_measurement_equals_its_committed_record():
    # Re-runs torchtitan's sharding and inductor's partition for one record (seconds, fake tensors).
    from zeroplan.frameworks.compiled_parallel import measure_parallel_compiled_block

    fresh = measure_parallel_compiled_block("8B", 2, True, 4096, "none")
    committed = next(r for r in PARALLEL if r.name == fresh.name)
    assert fresh.compiled_saved_values == committed.compiled_saved_values
    assert fresh.eager_live_bytes == committed.eager_live_bytes
