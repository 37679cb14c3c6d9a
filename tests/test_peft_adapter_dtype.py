"""peft's adapter dtype by release (FineTuneSpec.peft_version, zeroplan.core.finetune.adapter_dtype)
against peft's own LoRA on the CPU: a tiny bf16 Llama under get_peft_model, no autocast (the
MetaMathQA loop's bf16-pure), its adapters' dtype, what the q and v adapters of a block save for
backward and the bytes of parameters, gradients and AdamW states after one step. The installed
peft is measured here; the records of other releases (benchmarks/peft_adapter_dtype_records.py
run on a release's source tree) are read as they were written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core.finetune.activations import INPUT_GROUPS, _group_input_bytes, adapter_matmul_bytes
from zeroplan.core.finetune.adapter_dtype import peft_adapter_element_bytes
from zeroplan.core.model_states import model_state_bytes
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.hf_config import parse_hf_config
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, FineTuneSpec, Framework, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.finetune import LoraTarget, lora_adapters
from zeroplan.specs.training import Kernels, OptimizerLoop
from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peft_adapter_dtype_records.py"
RECORDS = SCRIPT.parent / "peft-adapter-dtype-records"
TARGETS = (LoraTarget.q, LoraTarget.v)


def _request(record: dict, precision: str = "bf16-pure", **finetune) -> PlanRequest:
    transformers = pytest.importorskip("transformers")
    spec = parse_hf_config(transformers.LlamaConfig(**record["config"]).to_dict(), "llama")
    version = record["peft_version"].split(".dev")[0]
    return PlanRequest(model=spec, cluster=cluster_from_gpus(get_gpu("h100-80gb"), 1), strategy=StrategySpec(kind="ddp"),
                       batch=BatchSpec(seq_len=record["seq_len"], micro_batch_size=record["micro_batch"]),
                       training=TrainingSpec(framework="hf", precision=precision, kernels=Kernels.cpu,
                                             optimizer_loop=OptimizerLoop.foreach,
                                             finetune=FineTuneSpec(lora_rank=record["rank"], lora_alpha=2 * record["rank"],
                                                                   lora_targets=TARGETS, peft_version=version, **finetune)))


def _planned_saved_bytes(request: PlanRequest) -> int:
    """What the planner keeps for the q and v adapters of one block: the inputs they read and
    each B's r-wide input (zeroplan.core.finetune.activations)."""
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    adapters = lora_adapters(request.training.finetune, request.model, Framework.hf)
    inputs = sum(_group_input_bytes(request, group, kind, kept_anyway) for group, kind, kept_anyway in INPUT_GROUPS
                 if any(t in group for t in TARGETS))
    return inputs + len(adapters) * adapter_matmul_bytes(request) * tokens * request.training.finetune.lora_rank


def _check(record: dict) -> None:
    request = _request(record)
    assert peft_adapter_element_bytes(request) == record["adapter_element_bytes"]
    assert all(_planned_saved_bytes(request) == saved for saved in record["adapter_saved_bytes_per_block"])
    states = model_state_bytes(request)
    assert (states.parameter_bytes, states.gradient_bytes, states.optimizer_state_bytes) == (
        record["parameter_bytes"], record["gradient_bytes"], record["optimizer_state_bytes"])


def _records() -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(RECORDS.glob("peft-*.json"))]


def test_records_span_the_three_behaviours() -> None:
    # 0.6.2: nn.Linear's fp32 left as made; 0.11.1: cast to the base's bf16; 0.17.1: upcast to fp32.
    by_version = {r["peft_version"]: r["adapter_dtypes"] for r in _records()}
    assert by_version == {"0.6.2": ["float32"], "0.11.1": ["bfloat16"], "0.17.1": ["float32"]}


@pytest.mark.parametrize("record", _records(), ids=lambda r: r["peft_version"])
def test_planner_equals_each_releases_record(record: dict) -> None:
    _check(record)


def test_installed_peft_equals_the_planner() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    record = load_script(SCRIPT).measure()
    _check(record)
    # No autocast, fp32 adapters over bf16: each adapter its own fp32 copy of the shared input and
    # an fp32 r-wide product, 4 bytes an element of every adapter state.
    request = _request(record)
    assert adapter_matmul_bytes(request) == 4 and record["adapter_element_bytes"] == 4


def test_release_moves_only_where_the_source_differs() -> None:
    record = {"config": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=128, max_position_embeddings=64),
              "seq_len": 16, "micro_batch": 2, "rank": 8}
    newest = _request(dict(record, peft_version="0.20.0"))
    follows = _request(dict(record, peft_version="0.11.1"))
    oldest = _request(dict(record, peft_version="0.6.2"))
    assert [peft_adapter_element_bytes(r) for r in (oldest, follows, newest)] == [4, 2, 4]
    # Under the Trainer's autocast (bf16-mixed) lora_A multiplies autocast's bf16 copy in every release.
    mixed = _request(dict(record, peft_version="0.20.0"), precision="bf16-mixed")
    assert adapter_matmul_bytes(mixed) == 2
    # An fp32 base gives fp32 adapters in every release.
    assert peft_adapter_element_bytes(_request(dict(record, peft_version="0.11.1"), base_dtype="fp32")) == 4


@pytest.mark.parametrize("change, field", [
    (dict(peft_version="0.3.0"), "finetune.peft_version"),
    (dict(peft_version="0.21.0"), "finetune.peft_version"),
    (dict(peft_version="latest"), "finetune.peft_version"),
])
def test_refused_in_one_line(change: dict, field: str) -> None:
    with pytest.raises(ZeroplanError) as error:
        FineTuneSpec(lora_rank=8, **change)
    assert error.value.field == field and "\n" not in str(error.value)


def test_only_hf_runs_peft() -> None:
    with pytest.raises(ZeroplanError) as error:
        PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 1),
                    strategy=StrategySpec(kind="ddp"), batch=BatchSpec(seq_len=512, micro_batch_size=1),
                    training=TrainingSpec(framework="torchtune", precision="bf16-pure",
                                          finetune=FineTuneSpec(lora_rank=8, peft_version="0.11.1")))
    assert error.value.field == "finetune.peft_version" and "\n" not in str(error.value)


def test_deepspeed_zero3_keeps_fp32_only_what_peft_made_fp32() -> None:
    # DeepSpeed from 0.19.2 casts no zero.Init model (activations.adapters_stay_fp32): the adapters
    # keep get_peft_model's dtype, fp32 from peft 0.12.0, bf16 in 0.7.0-0.11.1 (the 0.11.1 record).
    from zeroplan.core.finetune.activations import adapters_stay_fp32

    def request(version: str) -> PlanRequest:
        return PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 8),
                           strategy=StrategySpec(kind="zero3"), batch=BatchSpec(seq_len=512, micro_batch_size=1),
                           training=TrainingSpec(framework="hf", precision="bf16-mixed",
                                                 finetune=FineTuneSpec(lora_rank=8, peft_version=version)))

    assert adapters_stay_fp32(request("0.20.0")) and adapter_matmul_bytes(request("0.20.0")) == 4
    assert not adapters_stay_fp32(request("0.11.1")) and adapter_matmul_bytes(request("0.11.1")) == 2
