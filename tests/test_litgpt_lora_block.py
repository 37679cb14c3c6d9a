"""litgpt's LoRA block (lora.py: one dropout and one lora_A over the fused q/k/v, a scattered
lora_B output where only some of q, k and v are enabled, the one-norm block's shared input) as
litgpt's own code keeps it for backward, against the planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core.finetune.activations import (group_input_readers, mlp_reads_attention_input,
                                                litgpt_qkv_zero_pad_bytes)
from zeroplan.core.frameworks import framework_layer_bytes
from zeroplan.specs.finetune import LoraTarget
from zeroplan.specs.training import Kernels

from test_neox_block import _request

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "lora-litgpt-records"
CONFIGS = {"phi-2": str(ROOT / "tests" / "fixtures" / "hf" / "phi-2.json"),
           "llama-3.2-1b": str(ROOT / "benchmarks" / "published_memory" / "configs" / "llama-3.2-1b.json"),
           "gemma-2b": str(ROOT / "benchmarks" / "published_memory" / "configs" / "gemma-2b.json"),
           "gemma-2-2b": str(ROOT / "tests" / "fixtures" / "hf" / "gemma-2-2b.json")}
SWITCHES = (("lora_query", "q"), ("lora_key", "k"), ("lora_value", "v"), ("lora_projection", "o"))
QKV = (LoraTarget.q, LoraTarget.k, LoraTarget.v)


def _requests(record: dict, kernels: Kernels = Kernels.cpu):
    """The planner's full fine-tune and LoRA requests for a record of benchmarks/litgpt_lora_records.py."""
    lora = record["lora"]
    targets = [t for switch, t in SWITCHES if lora.get(switch)]
    if lora.get("lora_mlp"):
        mlp = ["up", "down"] if record["model"].startswith("phi-2") else ["gate", "up", "down"]
        targets += mlp
    config = CONFIGS[record["model"].split("-qv")[0]]
    s, b = record["seq_len"], record["micro_batch_size"]
    flags = ["--lora-rank", str(lora["lora_r"]), "--lora-targets", ",".join(targets),
             "--lora-dropout", str(lora["lora_dropout"])]
    return (_request(config, "litgpt", s, b, kernels=kernels),
            _request(config, "litgpt", s, b, *flags, kernels=kernels))


@pytest.mark.parametrize("path", sorted(RECORDS.glob("litgpt_*_lora_*.json")), ids=lambda p: p.stem)
def test_litgpt_lora_terms_are_the_records_to_the_byte(path: Path) -> None:
    # benchmarks/litgpt_lora_records.py: litgpt 9a1b82b's lora.py GPT on fake tensors (CPU kernels).
    record = json.loads(path.read_text())
    full, lora = _requests(record)
    model = lora.model
    assert (model.hidden_size, model.num_heads, model.kv_heads, model.ffn_hidden_size) == (
        record["n_embd"], record["n_head"], record["n_query_groups"], record["intermediate_size"])
    # What LoRA changes in the block, against the same model's full fine-tune.
    assert (framework_layer_bytes(lora) - framework_layer_bytes(full)
            == record["per_layer_bytes"] - record["full_per_layer_bytes"])
    if model.kv_heads > 1:
        # The whole block (gemma-2b's one K/V head: litgpt's expand-and-reshape is a view there,
        # a full fine-tune term outside these).
        assert framework_layer_bytes(lora) == record["per_layer_bytes"]


def test_the_fused_qkv_adapter_drops_its_input_once() -> None:
    record = json.loads((RECORDS / "litgpt_phi-2_lora_s512_b4.json").read_text())
    tokens, h = record["seq_len"] * record["micro_batch_size"], record["n_embd"]
    # Three h-wide dropout products (q/k/v's, the projection's, fc's) and one f-wide (proj's).
    noise = [row for row in record["second_block_saved"] if row["node"] == "MulBackward0" and row["saved"] == "other"]
    assert sorted(row["shape"][-1] for row in noise) == [h, h, h, record["intermediate_size"]]
    # lora_A's r x 3 output is kept once, by lora_B's grouped conv1d.
    conv = [row for row in record["second_block_saved"] if row["node"] == "ConvolutionBackward0"]
    assert [row["storage_bytes"] for row in conv] == [2 * tokens * 3 * record["lora"]["lora_r"]]
    _, lora = _requests(record)
    assert group_input_readers(lora, QKV) == 1
    assert group_input_readers(lora.model_copy(update={"training": lora.training.model_copy(
        update={"framework": "hf"})}), QKV) == 3
    assert mlp_reads_attention_input(lora) and litgpt_qkv_zero_pad_bytes(lora) == 0


def test_a_partly_enabled_qkv_adapter_keeps_its_scattered_output() -> None:
    record = json.loads((RECORDS / "litgpt_llama-3.2-1b_lora_s512_b1.json").read_text())
    tokens = record["seq_len"] * record["micro_batch_size"]
    scattered = [row for row in record["second_block_saved"] if row["node"] == "IndexCopyBackward0"]
    q, v = record["n_head"] * record["head_size"], record["n_query_groups"] * record["head_size"]
    assert [row["storage_bytes"] for row in scattered] == [2 * tokens * (q + v)]
    _, lora = _requests(record)
    assert litgpt_qkv_zero_pad_bytes(lora) == 2 * tokens * (q + v)


def test_cuda_keeps_a_bool_dropout_mask_where_the_cpu_keeps_bf16_noise() -> None:
    # CUDA's fused native_dropout keeps a bool mask; the CPU's dropout its bf16 noise
    # (zeroplan.core.finetune.activations.dropout_mask_bytes): one byte an element less, once
    # per adapter input (q/k/v's once).
    record = json.loads((RECORDS / "litgpt_phi-2_lora_s512_b4.json").read_text())
    tokens, h, f = record["seq_len"] * record["micro_batch_size"], record["n_embd"], record["intermediate_size"]
    (_, cpu), (_, cuda) = _requests(record), _requests(record, Kernels.cuda)
    assert framework_layer_bytes(cpu) - framework_layer_bytes(cuda) - (
        _norm_stats(cpu) - _norm_stats(cuda)) == tokens * (3 * h + f)


def _norm_stats(request) -> int:
    from zeroplan.core.frameworks import layer_norm_statistics_bytes

    return layer_norm_statistics_bytes(request)


def test_gemma2_soft_capped_attention_keeps_its_eager_scores() -> None:
    # litgpt model.py scaled_dot_product_attention with attention_logit_softcapping: no SDPA node;
    # tanh's bf16 result, the fp32 softmax and its bf16 cast (read by scores @ v) are kept.
    record = json.loads((RECORDS / "litgpt_gemma-2-2b_lora_s512_b2.json").read_text())
    s, b, heads = record["seq_len"], record["micro_batch_size"], record["n_head"]
    rows = record["second_block_saved"]
    assert not [row for row in rows if "ScaledDotProduct" in row["node"]]
    scores = [row for row in rows if row["shape"] == [b, heads, s, s] or row["shape"] == [b * heads, s, s]]
    assert sorted((row["node"], row["dtype"]) for row in scores) == [
        ("BmmBackward0", "torch.bfloat16"), ("SoftmaxBackward0", "torch.float32"), ("TanhBackward0", "torch.bfloat16")]
    full, lora = _requests(record)
    assert full.model.attention_softcapping
    # What the eager path keeps beyond flash's terms: the three score tensors less SDPA's output
    # and log-sum-exp.
    from zeroplan.core.frameworks import litgpt_softcapped_attention_extra_bytes

    sdpa_only = 2 * s * b * heads * record["head_size"] + 4 * heads * s * b
    assert litgpt_softcapped_attention_extra_bytes(full) == sum(row["storage_bytes"] for row in scores) - sdpa_only
    uncapped = full.model_copy(update={"model": full.model.model_copy(update={"attention_softcapping": False})})
    assert framework_layer_bytes(full) - framework_layer_bytes(uncapped) == sum(
        row["storage_bytes"] for row in scores) - sdpa_only
