"""litgpt's GPT compiled whole (torch.compile(model)) in the planner, against what inductor's
partitioner saved for litgpt's own model (benchmarks/compiled-litgpt-records,
benchmarks/litgpt_compiled_records.py), and the loop loss of lightning-thunder's benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core.compiled import COMPILED_POLICIES, check_compiled, litgpt_compiled_layer_bytes, litgpt_compiled_outside_bytes
from zeroplan.core.framework_loss import framework_logits_tensors
from zeroplan.core.frameworks import framework_activation_bytes
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import ActivationCheckpointing, BatchSpec, Framework, PlanRequest, Precision, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.finetune import FineTuneSpec

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "compiled-litgpt-records"
STABLECODE = ROOT / "benchmarks" / "published_memory" / "configs" / "stablecode-completion-alpha-3b.json"


def _records() -> list[Path]:
    return sorted(RECORDS.glob("*.json"))


def _cuda_statistics(request: PlanRequest, norms: int) -> int:
    """What CUDA's fp32 LayerNorm statistics add to the records' CPU graph, which holds them in
    the input's dtype (torch 2.13 _refs/__init__.py native_layer_norm): two a token a norm."""
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    return norms * 2 * (4 - request.training.precision.compute_bytes) * tokens


def _request(seq_len: int, micro_batch: int = 1, model=None, **training) -> PlanRequest:
    fields = dict(framework=Framework.litgpt, precision=Precision.bf16_pure, compile=True, uncast_loss=True)
    fields.update(training)
    return PlanRequest(model=model or get_model(str(STABLECODE)), training=TrainingSpec(**fields),
                       batch=BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch),
                       cluster=cluster_from_gpus(get_gpu("h100-80gb"), 1), strategy=StrategySpec(kind="ddp"))


def test_there_are_records_at_two_lengths() -> None:
    assert {json.loads(p.read_text(encoding="utf-8"))["records"][0]["seq_len"] for p in _records()} == {2048, 4096}


@pytest.mark.parametrize("path", _records(), ids=lambda p: p.stem)
def test_each_layer_and_the_rest_are_what_the_partitioner_saved(path: Path) -> None:
    summary = json.loads(path.read_text(encoding="utf-8"))
    records = summary["records"]
    # By storage (a saved view keeps its base), as the compiled autograd node held them at run time.
    storage = [r["intermediate_storage_bytes"] for r in records]
    assert storage == [r["runtime_saved_bytes"] for r in records]
    per_layer = {b - a for a, b in zip(storage, storage[1:])}
    assert len(per_layer) == 1, "each layer adds the same bytes"
    first = records[0]
    request = _request(first["seq_len"], first["micro_batch_size"])
    assert (request.model.hidden_size, request.model.num_heads, request.model.ffn_hidden_size) == (
        first["n_embd"], first["n_head"], first["intermediate_size"])
    layer = per_layer.pop()
    assert litgpt_compiled_layer_bytes(request) == layer + _cuda_statistics(request, 1)
    assert litgpt_compiled_outside_bytes(request) == storage[0] - layer + _cuda_statistics(request, 1)
    # Every tensor autograd saw saved, and the graph broken at each block as FSDP's units break
    # it: the same bytes at every depth.
    assert [r["autograd_saved_bytes"] for r in records] == storage
    assert summary["unit_breaks_autograd_saved_bytes"] == storage
    assert all(r["dynamo_graphs"] == 1 and r["partitions"] == 1 for r in summary["unit_breaks_records"])


def test_the_planner_keeps_every_layer_and_the_head_input() -> None:
    request = _request(16384)
    layers = request.model.num_layers * litgpt_compiled_layer_bytes(request)
    assert framework_activation_bytes(request) == layers + litgpt_compiled_outside_bytes(request)


def test_the_loop_loss_holds_the_logits_and_three_tensors_in_their_dtype() -> None:
    request = _request(4096)
    sbv = 4096 * request.model.vocab_size
    forward, backward = framework_logits_tensors(request)
    assert forward == (2 * sbv, 2 * sbv)
    assert backward == (2 * sbv,) * 4


def test_without_the_loop_loss_litgpt_keeps_its_fit_loss() -> None:
    eager = _request(4096, uncast_loss=False, compile=False)
    compiled = _request(4096, uncast_loss=False)
    assert framework_logits_tensors(compiled) == framework_logits_tensors(eager)


def test_litgpt_compile_is_measured_without_checkpointing_only() -> None:
    assert COMPILED_POLICIES[Framework.litgpt] == (ActivationCheckpointing.none,)
    with pytest.raises(ZeroplanError, match="compile"):
        request = _request(4096, activation_checkpointing="full")
        check_compiled(request.training, request.model)


def test_litgpt_compile_of_another_block_is_refused_in_one_line() -> None:
    request = _request(4096, model=get_model("llama-3.1-8b"))
    with pytest.raises(ZeroplanError, match="GPT-NeoX") as error:
        check_compiled(request.training, request.model)
    assert "\n" not in str(error.value)


def test_litgpt_compiled_lora_is_refused() -> None:
    request = _request(4096, finetune=FineTuneSpec(lora_rank=8))
    with pytest.raises(ZeroplanError, match="finetune"):
        check_compiled(request.training, request.model)


def test_the_model_at_its_own_depth_saves_every_layer_and_the_rest() -> None:
    full = [json.loads(p.read_text(encoding="utf-8")) for p in _records()]
    full = [s for s in full if s["full_depth"]]
    assert full, "one record measures the model at its own depth"
    for summary in full:
        first = summary["records"][0]
        request = _request(first["seq_len"], first["micro_batch_size"])
        assert summary["full_depth"]["n_layer"] == request.model.num_layers
        assert summary["full_depth"]["intermediate_storage_bytes"] == summary["full_depth"]["runtime_saved_bytes"]
        norms = request.model.num_layers + 1
        assert framework_activation_bytes(request) == (summary["full_depth"]["intermediate_storage_bytes"]
                                                       + _cuda_statistics(request, norms))


def test_shard_grad_op_is_planned_for_litgpt_only_when_named() -> None:
    from zeroplan.core.profiles import check_framework_strategies, framework_strategies
    from zeroplan.specs import StrategyKind

    assert StrategyKind.fsdp_shard_grad_op not in framework_strategies(Framework.litgpt, 8)
    check_framework_strategies(Framework.litgpt, (StrategyKind.fsdp_shard_grad_op,), 8)
    with pytest.raises(ZeroplanError, match="strategies"):
        check_framework_strategies(Framework.litgpt, (StrategyKind.zero2,), 8)


def test_litgpt_compile_under_autocast_is_refused() -> None:
    request = _request(4096, precision=Precision.bf16_mixed)
    with pytest.raises(ZeroplanError, match="bf16-pure"):
        check_compiled(request.training, request.model)
