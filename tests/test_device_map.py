"""Hugging Face's device-map model parallelism (zeroplan.core.parallel.device_map): the split
against accelerate's own (benchmarks/device-map-records/splits.json, written by
benchmarks/device_map_records.py from transformers' _get_device_map on meta-device models), the
per-GPU breakdown, the refusals and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.main import main
from zeroplan.core.parallel.device_map import device_shares
from zeroplan.core.plan import pipeline_rank_breakdowns, plan
from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_config import load_hf_config
from zeroplan.presets.models import get_model
from zeroplan.specs.finetune import FineTuneSpec, Quantization
from zeroplan.specs.framework import Framework
from zeroplan.presets.gpus import get_gpu
from zeroplan.specs.hardware import ClusterSpec
from zeroplan.specs.parallel import DeviceMap, ParallelSpec
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind, StrategySpec
from zeroplan.specs.training import BatchSpec, TrainingSpec

ROOT = Path(__file__).resolve().parents[1]
RECORDS = json.loads((ROOT / "benchmarks" / "device-map-records" / "splits.json").read_text())
GIB = 1 << 30


def _model(name: str):
    # The records script imports torch; its MODELS table is read as text instead.
    text = (ROOT / "benchmarks" / "device_map_records.py").read_text()
    for line in text.splitlines():
        if line.strip().startswith(f'"{name}":'):
            path = line.split(":", 1)[1].strip().rstrip(",").strip('"')
            return get_model(name) if path == "None" else load_hf_config(ROOT / path)
    raise KeyError(name)


def _request(model, gpus: int, memory_gib: float, mode: DeviceMap = DeviceMap.balanced, quantize: str = "none",
             strategy: StrategyKind = StrategyKind.ddp, **parallel) -> PlanRequest:
    gpu = get_gpu("a100-80gb").model_copy(update={"memory_bytes": int(memory_gib * GIB)})
    finetune = FineTuneSpec(lora_rank=8, quantize=Quantization(quantize))
    return PlanRequest(
        model=model, cluster=ClusterSpec(gpu=gpu, gpus_per_node=gpus, num_nodes=1),
        training=TrainingSpec(framework=Framework.hf, finetune=finetune),
        batch=BatchSpec(micro_batch_size=1, seq_len=512, grad_accum_steps=4),
        strategy=StrategySpec(kind=strategy),
        parallel=ParallelSpec(pp=parallel.pop("pp", gpus), device_map=mode, **parallel),
    )


@pytest.mark.parametrize("record", RECORDS["records"], ids=lambda r: f"{r['model']}-{r['device_map']}-{r['gpus']}x{r['gpu_memory_gib']}-{r['quantize']}")
def test_split_is_accelerates(record: dict) -> None:
    request = _request(_model(record["model"]), record["gpus"], record["gpu_memory_gib"],
                       DeviceMap(record["device_map"]), record["quantize"])
    shares = device_shares(request)
    assert [s.num_blocks for s in shares] == record["blocks_per_gpu"]
    assert [s.has_embedding for s in shares].index(True) == record["embedding_gpu"]
    assert [s.has_head for s in shares].index(True) == record["head_gpu"]


def test_records_span_ties_quantization_and_empty_gpus() -> None:
    """The records exercise what the rule must get right, not only even splits."""
    records = RECORDS["records"]
    assert any(r["head_gpu"] == r["embedding_gpu"] != r["norm_gpu"] for r in records)  # a tied head on the embedding's GPU
    assert any(r["quantize"] == "nf4" for r in records)
    assert any(0 in r["blocks_per_gpu"] for r in records)
    assert {r["device_map"] for r in records} == {"balanced", "sequential"}


def test_each_gpu_holds_its_share_and_the_peak_is_the_worst() -> None:
    request = _request(get_model("qwen-72b"), 2, 80)
    ranks = pipeline_rank_breakdowns(request)
    shares = device_shares(request)
    # Every block's LoRA adapters are on exactly one GPU: the two ranks' trainable states sum to
    # the one-GPU request's (the model states scale with the blocks held, not replicated).
    one = _request(get_model("qwen-72b"), 1, 80, pp=1)
    whole = pipeline_rank_breakdowns(one)[0][1]
    assert sum(states.gradient_bytes for _, states in ranks) == whole.gradient_bytes
    assert sum(states.optimizer_state_bytes for _, states in ranks) == whole.optimizer_state_bytes
    assert sum(states.parameter_bytes for _, states in ranks) == whole.parameter_bytes
    # The GPU with more blocks and the head has more weights.
    assert shares[1].num_blocks > shares[0].num_blocks
    assert ranks[1][1].parameter_bytes > ranks[0][1].parameter_bytes
    answer = plan(request)
    assert answer.pipeline_rank_peak_bytes == tuple(b.peak_bytes for b, _ in ranks)
    assert answer.memory.peak_bytes == max(answer.pipeline_rank_peak_bytes)
    assert answer.peak_rank_reason.startswith("GPU 1 of 2 under device_map 'balanced' (blocks 39-79 + head)")


def test_one_micro_batch_in_flight_whatever_the_accumulation() -> None:
    request = _request(get_model("qwen2.5-7b"), 2, 24)
    more = request.model_copy(update={"batch": request.batch.model_copy(update={"grad_accum_steps": 32})})
    for rank in range(2):
        a, b = pipeline_rank_breakdowns(request)[rank][0], pipeline_rank_breakdowns(more)[rank][0]
        assert a.activation_bytes == b.activation_bytes and a.activation_bytes > 0


@pytest.mark.parametrize(("change", "field"), [
    ({"strategy": StrategyKind.zero3}, "strategy"),
    ({"strategy": StrategyKind.fsdp_full_shard}, "strategy"),
    ({"pp": 1}, "parallel.pp"),
    ({"tp": 2}, "parallel.device_map"),
    ({"cp": 2}, "parallel.device_map"),
])
def test_refusals_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ZeroplanError) as error:
        _request(get_model("qwen2.5-7b"), 2, 24, **change)
    assert error.value.field == field
    assert "allowed" in str(error.value) and "\n" not in str(error.value)


def test_refuses_other_frameworks_and_full_training() -> None:
    request = _request(get_model("qwen2.5-7b"), 2, 24)
    with pytest.raises(ZeroplanError, match="parallel.device_map: .*allowed: framework hf"):
        PlanRequest(**{**dict(request), "training": request.training.model_copy(update={"framework": Framework.torchtune})})
    with pytest.raises(ZeroplanError, match="parallel.device_map: .*allowed: with a LoRA rank"):
        PlanRequest(**{**dict(request), "training": TrainingSpec(framework=Framework.hf)})


def test_refuses_the_gpus_of_more_than_one_node() -> None:
    """One process sees its own node's GPUs: a device map over 16 GPUs of two nodes is refused
    (it was planned as one process driving all 16)."""
    request = _request(get_model("qwen2.5-7b"), 8, 24)
    two_nodes = ClusterSpec(gpu=request.cluster.gpu, gpus_per_node=8, num_nodes=2)
    with pytest.raises(ZeroplanError) as error:
        PlanRequest(**{**dict(request), "cluster": two_nodes, "parallel": request.parallel.model_copy(update={"pp": 16})})
    assert error.value.field == "parallel.device_map" and "allowed: nodes 1" in str(error.value)


def test_refuses_a_model_the_gpus_cannot_hold() -> None:
    with pytest.raises(ZeroplanError, match="parallel.device_map: .*offload"):
        device_shares(_request(get_model("qwen-72b"), 2, 40))


def test_command_line(capsys) -> None:
    code = main(["fit", "qwen2.5-7b", "--gpus", "2", "--gpu", "a100-80gb", "--framework", "hf", "--lora-rank", "8",
                 "--seq-len", "512", "--micro-batch", "1", "--device-map", "auto", "--strategies", "ddp", "--detail"])
    out = capsys.readouterr().out
    assert code == 0
    assert "peak on GPU" in out and "under device_map 'balanced'" in out


def test_a_tied_head_puts_the_loss_on_the_embeddings_gpu() -> None:
    """Llama-3.2-1B ties its output projection: accelerate keeps it with the embedding on GPU 0
    (the records' norm_gpu is 1), so GPU 0 holds the logits and GPU 1 none."""
    request = _request(_model("llama-3.2-1b"), 2, 24)
    shares = device_shares(request)
    assert shares[0].has_embedding and shares[0].has_head and not shares[1].has_head
    (first, _), (second, _) = pipeline_rank_breakdowns(request)
    assert first.logits_bytes > 0 and second.logits_bytes == 0


def test_sequential_fills_the_first_gpu_first() -> None:
    balanced = device_shares(_request(get_model("qwen-72b"), 2, 80))
    sequential = device_shares(_request(get_model("qwen-72b"), 2, 80, mode=DeviceMap.sequential))
    assert sequential[0].num_blocks > balanced[0].num_blocks
    assert sum(s.num_blocks for s in sequential) == sum(s.num_blocks for s in balanced) == 80


@pytest.mark.parametrize(("extra", "flag"), [
    (["--strategies", "zero3"], "--strategies"),
    (["--tp", "2"], "--device-map"),
    (["--pp", "3"], "--pp"),
    (["--framework", "torchtune"], "--device-map"),
])
def test_command_line_refusals_are_one_line(capsys, extra: list[str], flag: str) -> None:
    from refusals import run_refused

    argv = ["fit", "qwen2.5-7b", "--gpus", "2", "--gpu", "a100-80gb", "--framework", "hf", "--lora-rank", "8",
            "--device-map", "auto", *extra]
    err = run_refused(main, argv, capsys)
    assert f"error: {flag}:" in err and "allowed" in err


# Reruns accelerate itself (transformers' _get_device_map on meta-device models, about 3 s): the
# committed records are what today's accelerate answers.
@pytest.mark.slow
def test_records_are_what_accelerate_answers_today() -> None:
    pytest.importorskip("accelerate")
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_map_records", ROOT / "benchmarks" / "device_map_records.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for case, recorded in zip(module.CASES, RECORDS["records"]):
        if case[0] in ("llama-3.2-1b", "qwen2.5-7b"):
            assert module.record(*case) == recorded


def test_the_plan_search_refuses_a_device_map() -> None:
    from zeroplan.core.search import search

    with pytest.raises(ZeroplanError, match="parallel.device_map: .*allowed"):
        search(_request(get_model("qwen2.5-7b"), 2, 24), global_batch_size=8)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_a_gpu_the_split_leaves_empty_allocates_nothing(checkpointing: str) -> None:
    """A GPU accelerate's split gives no module runs no block, so its step allocates nothing: it
    was given a block's backward workspace (and, with every block recomputed, the rebuilt block),
    0.36 GiB at Qwen2.5-0.5B micro-batch 8 x 1024 over 8 H100s, more than without recomputation
    (found by benchmarks/verdict_invariants.py, 26 checkpoint-peak)."""
    from zeroplan.specs.training import ActivationCheckpointing

    request = _request(get_model("qwen2.5-0.5b"), 8, 80, mode=DeviceMap.sequential)
    request = request.model_copy(update={
        "batch": BatchSpec(micro_batch_size=8, seq_len=1024, grad_accum_steps=2),
        "training": request.training.model_copy(update={"activation_checkpointing": ActivationCheckpointing(checkpointing)})})
    shares = device_shares(request)
    ranks = pipeline_rank_breakdowns(request)
    empty = [rank for rank, share in enumerate(shares) if share.weight_bytes == 0]
    assert empty and shares[0].weight_bytes > 0
    for rank in empty:
        assert ranks[rank][0].allocated_peak_bytes == 0, (rank, ranks[rank][0])
    assert ranks[0][0].allocated_peak_bytes > 0
