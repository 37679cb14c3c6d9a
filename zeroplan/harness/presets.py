"""Scaled-down models for CPU measurement runs (seconds for 3 steps on 4 gloo ranks).

These live with the harness, not in ``zeroplan.presets`` (the real models), because they exist
only to exercise the measurement code: each covers one family of architecture choices.
"""

from __future__ import annotations

from zeroplan.errors import unknown_name_error
from zeroplan.specs import MlpKind, ModelSpec, NormKind, PositionKind

HARNESS_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # GPT-2 family: gelu MLP, LayerNorm, learned positions, biases, tied embeddings (~5M).
        ModelSpec(
            name="tiny-gpt2", vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4,
            ffn_hidden_size=1024, mlp=MlpKind.gelu, norm=NormKind.layernorm,
            position=PositionKind.learned, max_positions=512, bias=True, tied_embeddings=True,
        ),
        # Llama family: SwiGLU, RMSNorm, RoPE, grouped-query attention, untied (~13M); read as
        # transformers' Llama (model_type llama: ModelSpec.positions_causal_mask), as its config is.
        ModelSpec(
            name="tiny-llama", vocab_size=8192, hidden_size=384, num_layers=4, num_heads=6,
            num_kv_heads=2, ffn_hidden_size=1024, mlp=MlpKind.swiglu, norm=NormKind.rmsnorm,
            position=PositionKind.rope, max_positions=512, positions_causal_mask=True,
        ),
        # Mixtral family: as tiny-llama with 4 experts, top-2 routing (~8M).
        ModelSpec(
            name="tiny-mixtral", vocab_size=4096, hidden_size=256, num_layers=2, num_heads=4,
            num_kv_heads=2, ffn_hidden_size=512, mlp=MlpKind.swiglu, norm=NormKind.rmsnorm,
            position=PositionKind.rope, max_positions=512, num_experts=4, experts_per_token=2,
        ),
        # The smallest useful model, for fast multi-process tests (odd sizes exercise padding).
        ModelSpec(
            name="micro-llama", vocab_size=101, hidden_size=32, num_layers=2, num_heads=4,
            num_kv_heads=2, ffn_hidden_size=45, max_positions=64, positions_causal_mask=True,
        ),
        # As micro-llama with sizes tensor parallelism of 2 divides (heads, key-value heads, MLP
        # width, vocabulary) and untied embeddings: the fast model-parallel tests' model.
        ModelSpec(
            name="micro-llama-mp", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, ffn_hidden_size=128, max_positions=64, positions_causal_mask=True,
        ),
        ModelSpec(
            name="micro-gpt2", vocab_size=97, hidden_size=32, num_layers=2, num_heads=2,
            ffn_hidden_size=64, mlp=MlpKind.gelu, norm=NormKind.layernorm,
            position=PositionKind.learned, max_positions=64, bias=True, tied_embeddings=True,
        ),
        ModelSpec(
            name="micro-mixtral", vocab_size=67, hidden_size=32, num_layers=2, num_heads=4,
            num_kv_heads=2, ffn_hidden_size=48, max_positions=64, num_experts=4, experts_per_token=2,
        ),
    )
}


def harness_model(name: str) -> ModelSpec:
    """Look up a harness preset; an unknown name is a one-line error naming the choices."""
    try:
        return HARNESS_PRESETS[name]
    except KeyError:
        raise unknown_name_error("model", name, HARNESS_PRESETS) from None


def llama_config_json(spec: ModelSpec) -> dict:
    """A Llama-layout preset as the Hugging Face config.json `zeroplan fit` reads a model from
    (zeroplan.presets.hf_config): the harness presets are measure's names, fit takes a file."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.ffn_hidden_size, "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": spec.tied_embeddings, "hidden_act": "silu",
    }
