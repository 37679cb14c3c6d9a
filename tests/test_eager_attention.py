"""transformers' eager attention (zeroplan.core.frameworks.eager_attention_extra_bytes): the fp32
probabilities and the repeated K and V it keeps beyond zeroplan.core.activations' eager terms,
against the tensors transformers' own LlamaAttention saves."""

from __future__ import annotations

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.activations import attention_core_terms, layer_terms
from zeroplan.core.frameworks import eager_attention_extra_bytes, framework_layer_bytes
from zeroplan.presets.models import get_model

LLAMA = "--gpus 1 --micro-batch 2 --seq-len 512 --precision bf16-pure --activation-checkpointing full"


def _request(model: str, flags: str):
    return request_from_args(build_parser().parse_args(["fit", model, *LLAMA.split(), *flags.split()]))


def test_hf_eager_keeps_fp32_probabilities_and_repeated_kv() -> None:
    scores = 32 * 512 * 512 * 2
    gqa = _request("llama-3-8b", "--framework hf --attention eager")
    model = get_model("llama-3-8b")
    repeated = 2 * 2 * 512 * 2 * (model.q_size - model.kv_size)
    assert eager_attention_extra_bytes(gqa) == 4 * scores + repeated
    flash = _request("llama-3-8b", "--framework hf")
    assert framework_layer_bytes(gqa) - framework_layer_bytes(flash) == (
        sum(attention_core_terms(gqa.model, gqa.training, 512, 2).values()) - sum(attention_core_terms(flash.model, flash.training, 512, 2).values())
        + 4 * scores + repeated)


def test_no_extra_where_the_stack_or_kernel_does_not_upcast() -> None:
    mha = _request("llama-2-7b", "--framework hf --attention eager")
    assert eager_attention_extra_bytes(mha) == 4 * 32 * 512 * 512 * 2  # Llama-2-7B: K and V are not grouped
    assert eager_attention_extra_bytes(_request("llama-2-7b", "--framework hf")) == 0
    assert eager_attention_extra_bytes(_request("llama-2-7b", "--framework zeroplan --attention eager")) == 0
    # fp32 compute: softmax's fp32 output is the probabilities themselves (.to returns it).
    fp32 = _request("llama-2-7b", "--framework hf --attention eager --precision fp32")
    assert eager_attention_extra_bytes(fp32) == 0


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_planned_terms_are_what_transformers_eager_attention_saves(kv_heads: int) -> None:
    """Saved-tensor hooks on transformers' own LlamaAttention (eager, bf16, CPU): every tensor
    it keeps for backward but the weights and RoPE's cos and sin (constants the planner leaves
    out, zeroplan.core.activations.layer_terms) is the planner's attention terms plus
    eager_attention_extra_bytes, to the byte. On the CPU as on CUDA a bf16 softmax with
    dtype=float32 converts its input and keeps the fp32 output (aten SoftMax.cpp softmax)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    h, heads, s, b = 192, 4, 80, 2
    config = LlamaConfig(hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=256, num_hidden_layers=1, vocab_size=64, attention_dropout=0.0)
    config._attn_implementation = "eager"
    attention = LlamaAttention(config, layer_idx=0).to(torch.bfloat16).train()
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(s)[None].expand(b, s))
    skipped = {tensor.untyped_storage().data_ptr() for tensor in (*attention.parameters(), cos, sin)}
    storages: dict[int, int] = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in skipped:
            storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        attention(x, (cos, sin), attention_mask=None)

    model = get_model("llama-2-7b").model_copy(update={
        "hidden_size": h, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": None, "num_layers": 1})
    request = _request("llama-2-7b", f"--framework hf --attention eager --seq-len {s}")
    request = request.model_copy(update={"model": model})
    terms = layer_terms(model, request.training, s, b)
    planned = sum(terms[name] for name in ("qkv_input", "q_k_v", "softmax_output", "output_projection_input"))
    assert sum(storages.values()) == planned + eager_attention_extra_bytes(request)
