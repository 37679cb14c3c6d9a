"""GPT-NeoX's block (parallel residual over two LayerNorms, one fused qkv, partial rotary, a GELU
MLP) as litgpt's and transformers' own code keep it for backward, against the planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.frameworks import framework_layer_bytes, layer_norm_statistics_bytes, rotary_cat_extra_bytes
from zeroplan.specs.training import Kernels

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "eager-litgpt-records"
# The zeroplan model each litgpt config of the records is (its hf config or preset).
GPT_NEOX = {
    "stablecode-completion-alpha-3b": str(ROOT / "benchmarks" / "published_memory" / "configs" / "stablecode-completion-alpha-3b.json"),
    "stablelm-base-alpha-3b": "stablelm-base-alpha-3b",
    "pythia-1.4b": str(ROOT / "tests" / "fixtures" / "hf" / "pythia-1.4b.json"),
}


def _request(model: str, framework: str, seq_len: int, micro_batch: int, *flags: str, kernels: Kernels = Kernels.cpu):
    request = request_from_args(build_parser().parse_args([
        "fit", model, "--framework", framework, "--precision", "bf16-pure", "--seq-len", str(seq_len),
        "--micro-batch", str(micro_batch), "--gpus", "1", "--activation-checkpointing", "none", *flags]))
    return request.model_copy(update={"training": request.training.model_copy(update={"kernels": kernels})})


# The other blocks of the records: Phi-2 (one shared LayerNorm, no dropout in litgpt's code though
# its config has resid_pdrop 0.1), Llama-2-7B (RMSNorm, MHA) and Llama-3-8B (grouped K/V heads;
# llama-3.1-8b has its shape).
OTHERS = {"phi-2": str(ROOT / "tests" / "fixtures" / "hf" / "phi-2.json"), "Llama-2-7b-hf": "llama-2-7b",
          "Llama-3-8B": "llama-3.1-8b"}


@pytest.mark.parametrize("path", sorted(RECORDS.glob("litgpt_*_eager_*.json")), ids=lambda p: p.stem)
def test_litgpt_block_is_planned_to_the_byte(path: Path) -> None:
    # benchmarks/litgpt_eager_records.py: litgpt 9a1b82b's own GPT on fake tensors (CPU kernels).
    record = json.loads(path.read_text())
    request = _request({**GPT_NEOX, **OTHERS}[record["model"]], "litgpt", record["seq_len"], record["micro_batch_size"])
    model = request.model
    assert (model.hidden_size, model.num_heads, model.kv_heads, model.ffn_hidden_size) == (
        record["n_embd"], record["n_head"], record["n_query_groups"], record["intermediate_size"])
    two_norms = record["parallel_residual"] and not record["shared_attention_norm"]
    assert model.parallel_residual == two_norms == (record["model"] in GPT_NEOX)
    assert model.hidden_dropout == model.attention_dropout == 0
    assert framework_layer_bytes(request) == record["per_layer_bytes"]


def test_the_records_keep_the_fused_qkv_output_whole_beside_the_rotated_q_and_k() -> None:
    record = json.loads((RECORDS / "litgpt_stablecode-completion-alpha-3b_eager_s2048_b1.json").read_text())
    tokens, h = record["seq_len"] * record["micro_batch_size"], record["n_embd"]
    sdpa = {row["saved"]: row for row in record["one_layer_saved"] if row["node"].startswith("ScaledDotProduct")}
    assert sdpa["value"]["storage_bytes"] == 2 * tokens * 3 * h  # a view of the fused output
    assert sdpa["query"]["storage_bytes"] == sdpa["key"]["storage_bytes"] == 2 * tokens * h  # the cat's
    # The projection's input is a copy of SDPA's output, not a view of it.
    projection_inputs = [row for row in record["one_layer_saved"] if row["node"] == "AddmmBackward0"
                         and row["shape"] == [tokens, h] and row["storage"] == sdpa["output"]["storage"]]
    assert not projection_inputs
    # One block input saved for both norms, each norm its own two statistics.
    norms = [row for row in record["one_layer_saved"] if row["node"] == "NativeLayerNormBackward0"]
    assert len({row["storage"] for row in norms if row["saved"] == "input"}) == 2  # the block's and the final norm's
    assert sum(row["saved"] != "input" for row in norms) == 6


def test_cuda_keeps_the_layer_norm_statistics_in_fp32() -> None:
    cpu = _request(GPT_NEOX["stablecode-completion-alpha-3b"], "litgpt", 2048, 1)
    cuda = _request(GPT_NEOX["stablecode-completion-alpha-3b"], "litgpt", 2048, 1, kernels=Kernels.cuda)
    assert layer_norm_statistics_bytes(cpu) == 2 * 2 * 2 * 2048
    assert framework_layer_bytes(cuda) - framework_layer_bytes(cpu) == 2 * 2 * (4 - 2) * 2048


def test_a_sequential_gpt_neox_reads_as_two_norm_inputs(tmp_path: Path) -> None:
    raw = json.loads((ROOT / "tests" / "fixtures" / "hf" / "pythia-1.4b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, "use_parallel_residual": False}))
    parallel = _request(GPT_NEOX["pythia-1.4b"], "hf", 512, 1)
    sequential = _request(str(path), "hf", 512, 1)
    assert not sequential.model.parallel_residual
    assert framework_layer_bytes(sequential) - framework_layer_bytes(parallel) == 2 * 512 * raw["hidden_size"]


S, HIDDEN, HEADS, FFN = 64, 256, 4, 1024


def _hf_neox_saved_bytes(torch, transformers, layers: int, use_cache: bool) -> int:
    """What transformers' GPTNeoXForCausalLM (bf16 module, sdpa, an all-ones attention mask as a
    tokenizer gives) saves for backward, by storage, beyond its parameters and buffers; real
    CPU tensors, so that the mask's all-ones test runs as on a GPU."""
    config = transformers.GPTNeoXConfig(vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=layers,
                                        num_attention_heads=HEADS, intermediate_size=FFN, rotary_pct=0.25,
                                        max_position_embeddings=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).to(torch.bfloat16).train()
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    storages: dict[int, int] = {}
    tokens = torch.randint(0, 128, (1, S))

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in own and tensor.dtype != torch.int64:
            storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(input_ids=tokens, attention_mask=torch.ones(1, S, dtype=torch.long), use_cache=use_cache)
    del output
    return sum(storages.values())


@pytest.mark.slow
@pytest.mark.parametrize("use_cache", [False, True])
def test_transformers_gpt_neox_layer_is_planned_to_the_byte(use_cache: bool, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    per_layer = (_hf_neox_saved_bytes(torch, transformers, 2, use_cache)
                 - _hf_neox_saved_bytes(torch, transformers, 1, use_cache))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt_neox", "vocab_size": 128, "hidden_size": HIDDEN, "num_hidden_layers": 2,
                                "num_attention_heads": HEADS, "intermediate_size": FFN, "rotary_pct": 0.25,
                                "max_position_embeddings": 128}))
    request = _request(str(path), "hf", S, 1, *(["--use-cache"] if use_cache else []))
    assert framework_layer_bytes(request) == per_layer
    # The cache's own K and V copies replace the fused output's V view and the rotated K.
    assert rotary_cat_extra_bytes(request) == 2 * S * HIDDEN * (1 if use_cache else 3)


def test_under_lora_the_head_merge_copy_is_kept_only_by_an_adapter_without_dropout() -> None:
    # litgpt 9a1b82b's lora.py GPT (Phi-2, every linear adapted, lora_dropout 0.05), saved-tensor
    # hooks on fake tensors: SDPA's output is kept, the projection's input copy is not (the frozen
    # matmul keeps no input, the adapter its dropped copy and mask).
    config = GPT_NEOX["stablecode-completion-alpha-3b"]
    tokens_h = 2 * 2048 * 2560
    full = _request(config, "litgpt", 2048, 1)
    dropped = _request(config, "litgpt", 2048, 1, "--lora-rank", "8", "--lora-targets", "q,k,v,o", "--lora-dropout", "0.05")
    plain = _request(config, "litgpt", 2048, 1, "--lora-rank", "8", "--lora-targets", "q,k,v,o")
    untargeted = _request(config, "litgpt", 2048, 1, "--lora-rank", "8", "--lora-targets", "q,v")
    assert rotary_cat_extra_bytes(full) == rotary_cat_extra_bytes(plain) == 3 * tokens_h
    assert rotary_cat_extra_bytes(dropped) == rotary_cat_extra_bytes(untargeted) == 2 * tokens_h
