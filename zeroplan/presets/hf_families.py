"""Read the config.json of OPT, Falcon, GPT-J, MPT, GPTBigCode (StarCoder) and StarCoder2 into a
ModelSpec: each family's layout as transformers 4.56.2 builds it (the modeling file is cited above
each reader), with a one-line refusal of any option whose layout the planner does not model.

zeroplan.presets.hf_config dispatches here by model_type and adds the checks every family shares
(integer keys, unknown keys, quantization).
"""

from __future__ import annotations

from typing import Any

from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_fields import require_key, strict_model_spec
from zeroplan.specs.model import EagerSoftmax, GeluForm, MlpKind, ModelSpec, NormKind, PositionKind

# The GELU variants transformers' ACT2FN maps to a GELU (erf or tanh approximations): the same
# saved tensors (the activation's input) and the same shapes.
GELU_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python", "gelu_accurate")


def _allowed(config: dict[str, Any], key: str, default: Any, allowed: tuple[Any, ...], why: str) -> Any:
    """config[key] (default when absent), refused in one line unless it is one of ``allowed``."""
    value = config.get(key, default)
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        raise ZeroplanError(f"config.{key}", f"{value!r} {why} (allowed: {', '.join(repr(a) for a in allowed)})")
    return value


def _zero_dropout(config: dict[str, Any], key: str, why: str) -> None:
    value = config.get(key) or 0.0
    if value != 0.0:
        raise ZeroplanError(f"config.{key}", f"{value!r}: {why} (allowed: 0.0)")


# transformers 4.56.2 models/opt/modeling_opt.py: OPTDecoder's embed_tokens (V x
# word_embed_proj_dim) and embed_positions (OPTLearnedPositionalEmbedding: max_position_embeddings
# + 2 rows, the ids offset by 2), dropout after their sum; per OPTDecoderLayer a pre-norm
# self_attn_layer_norm, q/k/v/out_proj (h -> h, bias when enable_bias), dropout on the attention
# output, final_layer_norm, fc1 (h -> ffn_dim) and fc2 with the same biases, ReLU between them,
# dropout on fc2's output; the decoder's final_layer_norm; OPTForCausalLM's lm_head (no bias)
# tied to embed_tokens. The attention (eager_attention_forward) drops out its probabilities
# with attention_dropout. OPT-350m (do_layer_norm_before False, word_embed_proj_dim 512): each
# OPTDecoderLayer norms after its residual adds instead of before (the same tensors saved for
# backward, byte for byte: benchmarks/opt_release_attention.py --opt-350m), OPTDecoder builds no
# final_layer_norm (only where do_layer_norm_before and not _remove_final_layer_norm), and where
# word_embed_proj_dim differs from hidden_size, bias-free project_in / project_out linears join
# the narrower embedding and tied lm_head to the blocks (ModelSpec.embedding_projection).
def opt_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    hidden = require_key(config, "hidden_size")
    projection = config.get("word_embed_proj_dim", hidden)
    final_norm = config.get("do_layer_norm_before", True) and not config.get("_remove_final_layer_norm", False)
    _allowed(config, "activation_function", "relu", ("relu",), "is not modelled for opt")
    _allowed(config, "layer_norm_elementwise_affine", True, (True,), "(norms without weights) is not modelled")
    _zero_dropout(config, "activation_dropout", "OPT's dropout between ReLU and fc2 is not modelled")
    _zero_dropout(config, "layerdrop", "skipping whole blocks at random is not modelled")
    return strict_model_spec(
        name=name, vocab_size=require_key(config, "vocab_size"), hidden_size=hidden,
        num_layers=require_key(config, "num_hidden_layers"), num_heads=require_key(config, "num_attention_heads"),
        ffn_hidden_size=require_key(config, "ffn_dim"),
        mlp=MlpKind.relu, norm=NormKind.layernorm, position=PositionKind.learned,
        max_positions=require_key(config, "max_position_embeddings"), position_offset=2,
        bias=config.get("enable_bias", True),
        tied_embeddings=config.get("tie_word_embeddings", True),
        attention_dropout=config.get("attention_dropout", 0.0),
        hidden_dropout=config.get("dropout", 0.1),
        embedding_projection=0 if projection == hidden else projection, final_norm=final_norm,
    )


# transformers 4.56.2 models/falcon/modeling_falcon.py: word_embeddings; per FalconDecoderLayer
# query_key_value (h -> (a + 2 kv) d: kv = 1 under multi_query, num_kv_heads under
# new_decoder_architecture, a otherwise) and dense (h -> h), dense_h_to_4h and dense_4h_to_h
# (ffn_hidden_size), all with bias when config.bias; with parallel_attn one input_layernorm both
# read (or, under new_decoder_architecture with num_ln_in_parallel_attn 2, ln_attn and ln_mlp over
# the same block input), else input_layernorm and post_attention_layernorm in sequence; ln_f;
# lm_head (no bias) tied to word_embeddings by default. Rotary positions unless alibi; the rotary
# path applies no attention dropout ("neither dropout nor head_mask is applied here").
# modeling_falcon.py:224 (FalconAttention.__init__): query_key_value = FalconLinear(hidden_size,
# qkv_out_dim), one module (fused_qkv).
def falcon_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    _allowed(config, "alibi", False, (False,), "(Falcon-RW's ALiBi attention, its softmax in the input dtype) is not modelled")
    _allowed(config, "activation", "gelu", ("gelu",), "is not modelled for falcon")
    _zero_dropout(config, "hidden_dropout", "Falcon's one dropout on the summed block output is not modelled")
    heads = require_key(config, "num_attention_heads")
    new = config.get("new_decoder_architecture", False)
    parallel = config.get("parallel_attn", True)
    if new and not parallel:
        raise ZeroplanError("config.parallel_attn", "false with new_decoder_architecture builds no ln_attn that its "
                                                    "forward calls (allowed: true)")
    # FalconAttention: qkv_out_dim is (2 num_kv_heads + a) d under new_decoder_architecture,
    # h + 2 d under multi_query, 3h otherwise (num_kv_heads is not read then).
    kv_heads = (config.get("num_kv_heads") or heads) if new else 1 if config.get("multi_query", True) else heads
    norms = config.get("num_ln_in_parallel_attn") or (2 if new else 1)
    if config.get("apply_residual_connection_post_layernorm"):
        raise ZeroplanError("config.apply_residual_connection_post_layernorm",
                            "a residual taken after the norm is not modelled (allowed: false)")
    hidden = require_key(config, "hidden_size", "n_embed")
    return strict_model_spec(
        name=name, vocab_size=require_key(config, "vocab_size"), hidden_size=hidden,
        num_layers=require_key(config, "num_hidden_layers", "n_layer"), num_heads=heads, num_kv_heads=kv_heads,
        ffn_hidden_size=config.get("ffn_hidden_size") or 4 * hidden,
        mlp=MlpKind.gelu, norm=NormKind.layernorm, position=PositionKind.rope,
        max_positions=config.get("max_position_embeddings", 2048),
        bias=config.get("bias", False),
        fused_qkv=True,
        # modeling_falcon.py:353 (the rotary branch's eager path): F.softmax(..., dtype=hidden_states.dtype).
        eager_softmax=EagerSoftmax.hidden,
        # Two norms over one block input (Falcon-40B/180B: ln_attn and ln_mlp) are a parallel
        # residual, as GPT-NeoX's: the block input saved once, the MLP's normed copy its own.
        parallel_block=parallel and norms == 1,
        parallel_residual=parallel and norms == 2,
        tied_embeddings=config.get("tie_word_embeddings", True),
    )


# transformers 4.56.2 models/gptj/modeling_gptj.py: wte; per GPTJBlock one ln_1 that attention
# and MLP both read (hidden = attn + mlp + residual), q/k/v/out_proj without bias, fc_in (h ->
# n_inner, default 4h) and fc_out with bias, gelu_new; resid_pdrop drops the attention's and the
# MLP's outputs; ln_f; GPTJForCausalLM's lm_head with a bias, untied by default. Partial rotary
# positions (rotary_dim) have no parameters.
def gptj_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    gelu_form = GeluForm(_allowed(config, "activation_function", "gelu_new", GELU_ACTIVATIONS, "is not modelled for gptj"))
    hidden = require_key(config, "n_embd", "hidden_size")
    return strict_model_spec(
        name=name, vocab_size=require_key(config, "vocab_size"), hidden_size=hidden,
        num_layers=require_key(config, "n_layer", "num_hidden_layers"),
        num_heads=require_key(config, "n_head", "num_attention_heads"),
        ffn_hidden_size=config.get("n_inner") or 4 * hidden,
        mlp=MlpKind.gelu, gelu_form=gelu_form, norm=NormKind.layernorm, position=PositionKind.rope,
        max_positions=config.get("n_positions", 2048),
        bias=False, mlp_bias=True, parallel_block=True, head_bias=True,
        tied_embeddings=config.get("tie_word_embeddings", False),
        attention_dropout=config.get("attn_pdrop", 0.0),
        hidden_dropout=config.get("resid_pdrop", 0.0),
    )


MPT_TRAINED_POSITIONS = 2048
"""MptConfig's max_seq_len default (transformers 4.56.2 configuration_mpt.py)."""


# transformers 4.56.2 models/mpt/modeling_mpt.py: wte and no position table (ALiBi, built for
# every config); per MptBlock norm_1 and norm_2 (LayerNorm with its bias set to None), Wqkv (h ->
# 3h) and out_proj without bias, up_proj (h -> 4h: MptMLP ignores expansion_ratio) and down_proj
# without bias, GELU; norm_f (no bias); lm_head tied to wte. The eager attention softmaxes the
# scores in fp32 and casts them back (softmax(scores.float()).to(value dtype)), Bloom's 6 bytes a
# score; attn_pdrop drops the probabilities and both sub-blocks' outputs. modeling_mpt.py:86
# (MptAttention.__init__): Wqkv = nn.Linear(hidden_size, 3 * hidden_size), one module (fused_qkv).
def mpt_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    hidden = require_key(config, "d_model")
    _allowed(config, "expansion_ratio", 4, (4,), "builds no other MLP width in transformers' MptMLP (4 x d_model)")
    _allowed(config, "no_bias", True, (True,), "builds no biases in transformers' MPT either way")
    attn = config.get("attn_config") or {}
    if not isinstance(attn, dict):
        raise ZeroplanError("config.attn_config", f"must be an object, got {type(attn).__name__}")
    for key, allowed in (("alibi", True), ("qk_ln", False), ("prefix_lm", False)):
        if attn.get(key, allowed) != allowed:
            raise ZeroplanError(f"config.attn_config.{key}", f"{attn[key]!r} is not modelled for mpt (allowed: {allowed!r})")
    dropout = attn.get("attn_pdrop", 0.0)
    return strict_model_spec(
        name=name, vocab_size=require_key(config, "vocab_size"), hidden_size=hidden,
        num_layers=require_key(config, "n_layers"), num_heads=require_key(config, "n_heads"),
        ffn_hidden_size=4 * hidden, mlp=MlpKind.gelu, norm=NormKind.layernorm, norm_bias=False,
        position=PositionKind.alibi, max_positions=config.get("max_seq_len", MPT_TRAINED_POSITIONS),
        bias=False, fused_qkv=True, tied_embeddings=config.get("tie_word_embeddings", True),
        attention_dropout=dropout, hidden_dropout=dropout,
    )


# transformers 4.56.2 models/gpt_bigcode/modeling_gpt_bigcode.py (SantaCoder, StarCoder): GPT-2's
# layout (wte, wpe, ln_1, c_attn, c_proj, ln_2, c_fc and c_proj with biases, ln_f, tied lm_head)
# whose c_attn projects h -> h + 2 d under multi_query (one key/value head, the default):
# modeling_gpt_bigcode.py:161-164 (GPTBigCodeAttention.__init__), one module (fused_qkv).
def gpt_bigcode_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    gelu_form = GeluForm(_allowed(config, "activation_function", "gelu_pytorch_tanh", GELU_ACTIVATIONS, "is not modelled for gpt_bigcode"))
    hidden = require_key(config, "n_embd", "hidden_size")
    heads = require_key(config, "n_head", "num_attention_heads")
    return strict_model_spec(
        name=name, vocab_size=require_key(config, "vocab_size"), hidden_size=hidden,
        num_layers=require_key(config, "n_layer", "num_hidden_layers"), num_heads=heads,
        num_kv_heads=1 if config.get("multi_query", True) else heads,
        ffn_hidden_size=config.get("n_inner") or 4 * hidden,
        mlp=MlpKind.gelu, gelu_form=gelu_form, norm=NormKind.layernorm, position=PositionKind.learned,
        max_positions=require_key(config, "n_positions", "max_position_embeddings"),
        bias=True, fused_qkv=True, tied_embeddings=config.get("tie_word_embeddings", True),
        # GPTBigCodeConfig drops out at 0.1 unless told otherwise.
        attention_dropout=config.get("attn_pdrop", 0.1), hidden_dropout=config.get("resid_pdrop", 0.1),
    )


# transformers 4.56.2 models/starcoder2/modeling_starcoder2.py: embed_tokens; per decoder layer
# input_layernorm and post_attention_layernorm (LayerNorm with bias), q/k/v/o_proj (grouped-query)
# and the MLP's c_fc and c_proj (intermediate_size, gelu_pytorch_tanh), all with bias when use_bias;
# residual_dropout on the attention's and the MLP's outputs; norm (LayerNorm); lm_head without
# bias, tied by default; rotary positions.
def starcoder2_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    gelu_form = GeluForm(_allowed(config, "hidden_act", "gelu_pytorch_tanh", GELU_ACTIVATIONS, "is not modelled for starcoder2"))
    return strict_model_spec(
        name=name, vocab_size=require_key(config, "vocab_size"), hidden_size=require_key(config, "hidden_size"),
        num_layers=require_key(config, "num_hidden_layers"), num_heads=require_key(config, "num_attention_heads"),
        num_kv_heads=config.get("num_key_value_heads"), ffn_hidden_size=require_key(config, "intermediate_size"),
        mlp=MlpKind.gelu, gelu_form=gelu_form, norm=NormKind.layernorm, position=PositionKind.rope,
        max_positions=config.get("max_position_embeddings", 4096),
        bias=config.get("use_bias", True), tied_embeddings=config.get("tie_word_embeddings", True),
        attention_dropout=config.get("attention_dropout", 0.0), hidden_dropout=config.get("residual_dropout", 0.0),
    )


FAMILY_READERS = {
    "opt": opt_spec, "falcon": falcon_spec, "gptj": gptj_spec, "mpt": mpt_spec,
    "gpt_bigcode": gpt_bigcode_spec, "starcoder2": starcoder2_spec,
}
"""model_type -> reader, for the families this module reads."""

# Keys each family's configuration_*.py (transformers 4.56.2) defines that are read above or
# change no parameter (dropouts, epsilons, rotary and attention-scaling settings, init).
FAMILY_NEUTRAL_KEYS: dict[str, frozenset[str]] = {
    "opt": frozenset({
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim", "max_position_embeddings",
        "do_layer_norm_before", "_remove_final_layer_norm", "word_embed_proj_dim", "dropout", "attention_dropout",
        "activation_dropout", "activation_function", "layerdrop", "init_std", "enable_bias",
        "layer_norm_elementwise_affine",
    }),
    "falcon": frozenset({
        "vocab_size", "hidden_size", "n_embed", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
        "num_ln_in_parallel_attn", "layer_norm_epsilon", "hidden_dropout", "attention_dropout", "num_kv_heads",
        "alibi", "new_decoder_architecture", "multi_query", "parallel_attn", "bias", "max_position_embeddings",
        "rope_theta", "rope_scaling", "ffn_hidden_size", "activation", "apply_residual_connection_post_layernorm",
    }),
    "gptj": frozenset({
        "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "rotary_dim", "n_inner", "activation_function",
        "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "n_ctx", "rotary", "scale_attn_weights",
        "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    }),
    "mpt": frozenset({
        "d_model", "n_heads", "n_layers", "expansion_ratio", "max_seq_len", "vocab_size", "resid_pdrop",
        "layer_norm_epsilon", "emb_pdrop", "learned_pos_emb", "attn_config", "init_device", "logit_scale", "no_bias",
        "verbose", "embedding_fraction", "norm_type", "init_config", "tokenizer_name",
    }),
    "gpt_bigcode": frozenset({
        "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function", "resid_pdrop",
        "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "scale_attn_weights", "attention_softmax_in_fp32",
        "scale_attention_softmax_in_fp32", "multi_query", "inference_runner", "max_batch_size", "max_sequence_length",
        "pad_key_length", "pre_allocate_kv_cache", "validate_runner_input", "n_ctx",
    }),
    "starcoder2": frozenset({
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "hidden_act", "max_position_embeddings", "norm_epsilon", "rope_theta", "rope_scaling",
        "sliding_window", "residual_dropout", "embedding_dropout", "attention_dropout", "use_bias",
    }),
}
