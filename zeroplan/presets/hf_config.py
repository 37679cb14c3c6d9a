"""Read a Hugging Face ``config.json`` offline into a ModelSpec (GPT-2, Llama, Gemma and Phi-3 families,
and the mixture-of-experts families Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3;
OPT, Falcon, GPT-J, MPT and the StarCoder families through zeroplan.presets.hf_families).

Every key that changes the parameter count is either read, refused in one line (a count-changing
feature the planner does not model), or, when the reader does not know the key at all, the spec
is marked ``parameter_count_exact=False`` with the keys named, so that no count is silently wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zeroplan.errors import ZeroplanError, nested_too_deeply_error
from zeroplan.presets.hf_encoder_decoder import ENCODER_DECODER_NEUTRAL_KEYS, ENCODER_DECODER_READERS
from zeroplan.presets.hf_families import FAMILY_NEUTRAL_KEYS, FAMILY_READERS
from zeroplan.presets.hf_fields import require_key, strict_model_spec
from zeroplan.specs.base import first_error
from zeroplan.specs.model import EagerSoftmax, GeluForm, MlpKind, ModelSpec, NormKind, PositionKind

# Llama's block layout, parameter for parameter. phi3 fuses q/k/v into qkv_proj and gate/up into
# gate_up_proj (transformers 4.40 models/phi3/modeling_phi3.py), which holds the same elements.
_LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3")
# Gemma: GeGLU MLP, head_dim given separately, tied embeddings (transformers 4.38
# models/gemma/modeling_gemma.py); Gemma 2 adds two post-norms per block (4.42 models/gemma2).
_GEMMA_LIKE = ("gemma", "gemma2")
_GPT2_LIKE = ("gpt2",)
# Mixtures of experts with their own block layouts (transformers 4.56 models/qwen2_moe,
# qwen3_moe, deepseek_v2, deepseek_v3): expert widths apart from the dense MLP's, shared
# experts, dense blocks, and DeepSeek's multi-head latent attention.
_QWEN_MOE = ("qwen2_moe", "qwen3_moe")
_DEEPSEEK = ("deepseek_v2", "deepseek_v3")
_GPT_NEOX = ("gpt_neox",)
_PHI = ("phi",)
_BLOOM = ("bloom",)
_BERT = ("bert",)
# transformers 4.56.2 models/longt5, switch_transformers, mbart, pegasus, marian: encoder-decoder
# model types not read (their own attention, experts or norms), named in their refusal; t5, mt5,
# umt5 and bart are read by zeroplan.presets.hf_encoder_decoder.
ENCODER_DECODER_TYPES = ("longt5", "switch_transformers", "mbart", "pegasus", "marian")
# OPT, Falcon, GPT-J, MPT, GPTBigCode and StarCoder2: zeroplan.presets.hf_families.
_FAMILIES = tuple(FAMILY_READERS)
SUPPORTED_MODEL_TYPES = (_GPT2_LIKE + _GPT_NEOX + _PHI + _BLOOM + _BERT + _LLAMA_LIKE + _GEMMA_LIKE + _QWEN_MOE + _DEEPSEEK
                         + _FAMILIES + tuple(ENCODER_DECODER_READERS))


# transformers 4.56.2 modeling_rope_utils.py ROPE_INIT_FUNCTIONS: the RoPE variants a config's
# rope_scaling (rope_type, or the older key type) may name.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


CONFIG_KEY_OF_FIELD = {
    "tied_embeddings": "tie_word_embeddings", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "ffn_hidden_size": "intermediate_size",
    "max_positions": "max_position_embeddings", "hidden_dropout": "hidden_dropout",
}
"""ModelSpec fields whose config.json key (transformers' name) differs, for error messages."""


def config_key_error(error: ZeroplanError) -> ZeroplanError:
    """A ModelSpec validation error named by the config.json key the user wrote."""
    field = error.field
    return ZeroplanError(f"config.{CONFIG_KEY_OF_FIELD.get(field, field)}", error.detail)


def check_rope_scaling(config: dict) -> None:
    """Refuse, in one line, a rope_scaling that transformers would not build."""
    scaling = config.get("rope_scaling")
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in ROPE_TYPES:
        raise ZeroplanError(
            "config.rope_scaling", f"{scaling!r} is not a RoPE scaling transformers builds "
            f"(allowed: null or an object whose rope_type is one of {', '.join(ROPE_TYPES)})",
        )

# Keys every PretrainedConfig may write that never change the parameter count
# (transformers configuration_utils.py: generation, tokenizer, label and serialisation settings).
_NEUTRAL_COMMON = frozenset({
    "_name_or_path", "name_or_path", "architectures", "auto_map", "model_type", "torch_dtype", "dtype",
    # Read by config_quantization: it changes the storage of the weights, not their count.
    "quantization_config",
    "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "use_cache", "initializer_range", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_bfloat16", "tie_word_embeddings", "is_decoder",
    "is_encoder_decoder", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
    "finetuning_task", "task_specific_params", "prefix", "tokenizer_class", "tf_legacy_loss",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "gradient_checkpointing",
    # Read (or checked below) by this module.
    "add_cross_attention", "pruned_heads",
})
# Family keys: read here, or without effect on the count (norm epsilon, RoPE frequencies and
# scaling, attention windows, soft-capping, router loss settings); from each family's
# configuration_*.py in transformers.
_NEUTRAL_LLAMA = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "pretraining_tp", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "attention_dropout",
    "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
})
_NEUTRAL_BY_TYPE: dict[str, frozenset[str]] = {
    "llama": _NEUTRAL_LLAMA,
    "mistral": _NEUTRAL_LLAMA,
    "qwen2": _NEUTRAL_LLAMA,
    "qwen3": _NEUTRAL_LLAMA,
    "mixtral": _NEUTRAL_LLAMA | {
        "num_local_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef",
        "router_jitter_noise",
    },
    "qwen2_moe": _NEUTRAL_LLAMA | {
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "norm_topk_prob", "output_router_logits",
        "router_aux_loss_coef",
    },
    "qwen3_moe": _NEUTRAL_LLAMA | {
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
        "norm_topk_prob", "output_router_logits", "router_aux_loss_coef",
    },
    # Routing settings (groups, scoring, scaling, auxiliary losses) choose experts and add no
    # parameters; ep_size is the checkpoint's inference layout.
    "deepseek_v2": _NEUTRAL_LLAMA | {
        "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
        "first_k_dense_replace", "moe_layer_freq", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "aux_loss_alpha", "n_group", "topk_group", "topk_method",
        "routed_scaling_factor", "scoring_func", "seq_aux", "norm_topk_prob", "ep_size", "rope_interleave",
    },
    "phi3": _NEUTRAL_LLAMA | {"embd_pdrop", "resid_pdrop", "original_max_position_embeddings", "partial_rotary_factor"},
    "gemma": _NEUTRAL_LLAMA | {"hidden_activation"},
    "gemma2": _NEUTRAL_LLAMA | {
        "hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
        "cache_implementation",
    },
    "gpt2": frozenset({
        "vocab_size", "n_embd", "hidden_size", "n_layer", "num_hidden_layers", "n_head", "num_attention_heads",
        "n_inner", "n_positions", "max_position_embeddings", "n_ctx", "activation_function", "resid_pdrop",
        "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "summary_type", "summary_use_proj",
        "summary_activation", "summary_proj_to_labels", "summary_first_dropout", "scale_attn_weights",
        "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
    }),
}
# transformers 4.56.2 models/gpt_neox/configuration_gpt_neox.py: rotary settings, dropouts, the
# parallel-residual switch and the norm epsilon add no parameters; attention_bias is read.
_NEUTRAL_BY_TYPE["gpt_neox"] = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "rotary_pct", "partial_rotary_factor", "rotary_emb_base", "rope_theta", "rope_scaling", "attention_dropout",
    "hidden_dropout", "classifier_dropout", "max_position_embeddings", "layer_norm_eps", "use_parallel_residual",
    "attention_bias", "tie_encoder_decoder", "cross_attention_hidden_size",
})
# transformers 4.56.2 models/phi/configuration_phi.py: dropouts, rotary settings and the norm
# epsilon add no parameters; qk_layernorm (per-head q/k LayerNorms) is read and refused when set.
_NEUTRAL_BY_TYPE["phi"] = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "resid_pdrop", "embd_pdrop", "attention_dropout", "hidden_act", "max_position_embeddings", "layer_norm_eps",
    "rope_theta", "rope_scaling", "partial_rotary_factor", "qk_layernorm",
})
# transformers 4.56.2 models/bloom/configuration_bloom.py takes n_layer/n_head (num_hidden_layers
# and num_attention_heads by attribute_map) and n_embed for hidden_size; the Megatron-DeepSpeed
# switches bigscience's configs carry (fusions, tensor-parallel slicing, alibi offset) and
# n_inner (BloomMLP is always 4h wide) change no parameter.
_NEUTRAL_BY_TYPE["bloom"] = frozenset({
    "vocab_size", "hidden_size", "n_embed", "n_layer", "num_hidden_layers", "n_head", "num_attention_heads",
    "layer_norm_epsilon", "apply_residual_connection_post_layernorm", "hidden_dropout", "attention_dropout",
    "pretraining_tp", "slow_but_exact", "attention_softmax_in_fp32", "bias_dropout_fusion", "masked_softmax_fusion",
    "offset_alibi", "skip_bias_add", "skip_bias_add_qkv", "n_inner", "seq_length", "unk_token_id",
})
# transformers 4.56.2 models/bert/configuration_bert.py: dropouts, the norm epsilon and the
# classifier's dropout add no parameters; position_embedding_type is read (absolute only).
_NEUTRAL_BY_TYPE["bert"] = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "position_embedding_type", "classifier_dropout", "gradient_checkpointing",
})
_NEUTRAL_BY_TYPE.update(FAMILY_NEUTRAL_KEYS)
_NEUTRAL_BY_TYPE.update(ENCODER_DECODER_NEUTRAL_KEYS)
# DeepSeek-V3's num_nextn_predict_layers is read (a caveat: transformers builds no MTP module).
_NEUTRAL_BY_TYPE["deepseek_v3"] = _NEUTRAL_BY_TYPE["deepseek_v2"] | {"num_nextn_predict_layers"}

# Keys that add parameters the planner does not model, unless the model type reads them
# (_READ_COUNT_KEYS): mixture-of-experts widths and shared experts, query/key norms under other
# names (stablelm, olmo), low-rank attention.
_UNMODELLED_COUNT_KEYS = (
    "num_local_experts", "num_experts_per_tok", "num_experts", "moe_intermediate_size",
    "shared_expert_intermediate_size", "n_routed_experts", "n_shared_experts", "qk_layernorm", "use_qk_norm",
    "q_lora_rank", "kv_lora_rank",
)


_READ_COUNT_KEYS: dict[str, frozenset[str]] = {
    "mixtral": frozenset({"num_local_experts", "num_experts_per_tok"}),
    "qwen2_moe": frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"}),
    "qwen3_moe": frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size"}),
    "deepseek_v2": frozenset({"n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                              "q_lora_rank", "kv_lora_rank"}),
}
_READ_COUNT_KEYS["deepseek_v3"] = _READ_COUNT_KEYS["deepseek_v2"]


def _refuse_unmodelled(config: dict[str, Any], model_type: str) -> None:
    """One-line refusal of a key that would change the count in a way the planner does not model."""
    read = _READ_COUNT_KEYS.get(model_type, frozenset())
    for key in _UNMODELLED_COUNT_KEYS:
        value = config.get(key)
        # Absent, false, or a count of 0/1 (no experts, one expert) adds nothing; True == 1, so test it apart.
        if key not in read and value is not None and value is not False and (value is True or value not in (0, 1)):
            raise ZeroplanError(
                f"config.{key}", f"{config[key]!r} adds parameters zeroplan does not model for model_type {model_type!r}"
            )
    if config.get("add_cross_attention"):
        raise ZeroplanError("config.add_cross_attention", "cross-attention layers are not modelled (allowed: false)")
    if config.get("pruned_heads"):
        raise ZeroplanError("config.pruned_heads", "pruned attention heads are not modelled (allowed: none)")
    if model_type not in _GPT2_LIKE + _GPT_NEOX + _PHI + _BLOOM + _BERT + _FAMILIES and (config.get("attention_bias") or config.get("mlp_bias")):
        key = "attention_bias" if config.get("attention_bias") else "mlp_bias"
        raise ZeroplanError(f"config.{key}", f"biased projections are not modelled for model_type {model_type!r} (allowed: false)")


def _count_caveat(config: dict[str, Any], model_type: str) -> str:
    """Empty when every key is known; else a sentence naming the keys the count does not account for."""
    unknown = sorted(set(config) - _NEUTRAL_COMMON - _NEUTRAL_BY_TYPE[model_type])
    caveats = []
    if unknown:
        caveats.append(f"config.json keys not modelled: {', '.join(unknown)}; the count assumes they add no parameters")
    mtp = config.get("num_nextn_predict_layers")
    if model_type == "deepseek_v3" and mtp:
        # transformers 4.56 DeepseekV3Model builds num_hidden_layers blocks only; the published
        # checkpoint also holds the multi-token-prediction block (DeepSeek-V3 report sec. 2.2).
        caveats.append(f"num_nextn_predict_layers {mtp}: the multi-token-prediction module is not counted "
                       "(transformers builds none; the checkpoint holds it)")
    return "; ".join(caveats)


def _megatron_shape_fields(name: str, config: dict[str, Any], *hidden_keys: str) -> dict[str, Any]:
    """The shape as GPT-2's and Bloom's configs name it (n_layer, n_head; transformers maps the
    num_* names onto them), the hidden size under ``hidden_keys``."""
    return dict(name=name, vocab_size=require_key(config, "vocab_size"), hidden_size=require_key(config, *hidden_keys),
                num_layers=require_key(config, "n_layer", "num_hidden_layers"),
                num_heads=require_key(config, "n_head", "num_attention_heads"))


# transformers 4.56.2 models/gpt2/modeling_gpt2.py:193 (GPT2Attention.__init__): c_attn =
# Conv1D(3 * embed_dim, embed_dim), q, k and v in one module (fused_qkv).
def _gpt2_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    shape = _megatron_shape_fields(name, config, "n_embd", "hidden_size")
    return strict_model_spec(
        **shape,
        fused_qkv=True,
        # transformers 4.56.2 models/gpt2/modeling_gpt2.py:141 eager_attention_forward:
        # ``nn.functional.softmax(attn_weights, dim=-1)`` in the scores' dtype;
        # reorder_and_upcast_attn runs _upcast_and_reordered_attn instead (:211-255, fp32 baddbmm
        # scores, fp32 softmax, ``.type(value.dtype)``).
        eager_softmax=EagerSoftmax.fp32 if config.get("reorder_and_upcast_attn", False) else EagerSoftmax.scores,
        ffn_hidden_size=config.get("n_inner") or 4 * shape["hidden_size"],
        mlp=MlpKind.gelu,
        gelu_form=_gelu_form(config, "activation_function", "gelu_new", "gpt2"),
        norm=NormKind.layernorm,
        position=PositionKind.learned,
        max_positions=require_key(config, "n_positions", "max_position_embeddings"),
        bias=True,
        tied_embeddings=config.get("tie_word_embeddings", True),
        attention_dropout=config.get("attn_pdrop", 0.0),
        hidden_dropout=config.get("resid_pdrop", 0.0),
    )


# transformers 4.56.2 models/gpt_neox/modeling_gpt_neox.py: embed_in and embed_out (untied unless
# tie_word_embeddings), per layer input_layernorm and post_attention_layernorm (LayerNorm, weight
# and bias), query_key_value (h -> 3h) and dense (h -> h) with bias when attention_bias (default
# true), dense_h_to_4h and dense_4h_to_h with bias, final_layer_norm; rotary positions (no
# parameters). With use_parallel_residual (the default) attention and MLP both read the block
# input through their own norms (GPTNeoXLayer.forward: input_layernorm(hidden_states) and
# post_attention_layernorm(hidden_states)), whose one input is saved once (parallel_residual).
# modeling_gpt_neox.py:140 (GPTNeoXAttention.__init__): query_key_value = nn.Linear(hidden_size,
# 3 * hidden_size), one module (fused_qkv); GPTNeoXAttention.forward chunks its output into q, k
# and v views and apply_rotary_pos_emb concatenates the rotated and pass-through parts of q and k
# (rotary_cat).
def _shape_fields(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """The fields every config but GPT-2's names alike (vocab_size, hidden_size, ...)."""
    return dict(name=name, vocab_size=require_key(config, "vocab_size"), hidden_size=require_key(config, "hidden_size"),
                num_layers=require_key(config, "num_hidden_layers"), num_heads=require_key(config, "num_attention_heads"),
                ffn_hidden_size=require_key(config, "intermediate_size"))


# transformers 4.56.2 activations.py ACT2CLS: the config's activation name picks the module that
# runs the MLP's GELU (GPT2Config's activation_function and PhiConfig's hidden_act default to
# gelu_new); what each keeps for backward is zeroplan.core.hf_activation's.
def _gelu_form(config: dict[str, Any], key: str, default: str, model_type: str) -> GeluForm:
    value = config.get(key, default)
    allowed = [form.value for form in GeluForm]
    if value not in allowed:
        raise ZeroplanError(f"config.{key}", f"{value!r} is not modelled for {model_type} (allowed: {', '.join(allowed)})")
    return GeluForm(value)


def _biased_layernorm_gelu(config: dict[str, Any]) -> dict[str, Any]:
    """The GPT-style layout GPT-NeoX, Phi and BERT share: LayerNorm, biased linears, a GELU MLP,
    max_position_embeddings positions."""
    return dict(mlp=MlpKind.gelu, norm=NormKind.layernorm, bias=True,
                max_positions=require_key(config, "max_position_embeddings"))


def _gpt_neox_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    if config.get("attention_bias", True) is not True:
        raise ZeroplanError("config.attention_bias", "gpt_neox without attention biases is not modelled (allowed: true)")
    return strict_model_spec(
        **_shape_fields(name, config),
        **_biased_layernorm_gelu(config),
        position=PositionKind.rope,
        fused_qkv=True,
        rotary_cat=True,
        parallel_residual=config.get("use_parallel_residual", True),
        tied_embeddings=config.get("tie_word_embeddings", False),
        attention_dropout=config.get("attention_dropout", 0.0),
        hidden_dropout=config.get("hidden_dropout", 0.0),
    )


# transformers 4.56.2 models/phi/modeling_phi.py (Phi-1, 1.5, 2): embed_tokens; per layer one
# input_layernorm (LayerNorm, weight and bias) that attention and MLP both read (PhiDecoderLayer:
# hidden = attn + mlp + residual), q_proj, k_proj, v_proj and dense with biases, fc1 and fc2 with
# biases (gelu_new); final_layernorm; lm_head with a bias, untied unless tie_word_embeddings;
# partial rotary positions (no parameters), the rotated and pass-through parts of q and k joined
# by torch.cat (PhiAttention.forward, lines 155-168: rotary_cat); resid_pdrop drops the attention
# and MLP outputs.
def _phi_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    tied = config.get("tie_word_embeddings", False)
    shape = _shape_fields(name, config)
    return strict_model_spec(
        **shape,
        num_kv_heads=config.get("num_key_value_heads") or shape["num_heads"],
        **_biased_layernorm_gelu(config),
        gelu_form=_gelu_form(config, "hidden_act", "gelu_new", "phi"),
        position=PositionKind.rope,
        rotary_cat=True,
        parallel_block=True,
        head_bias=not tied,
        tied_embeddings=tied,
        attention_dropout=config.get("attention_dropout", 0.0),
        hidden_dropout=config.get("resid_pdrop", 0.0),
    )


BERT_MASKED_LM = "BertForMaskedLM"
"""The head a BERT config.json is counted with: transformers' masked-LM model (no pooler)."""


# transformers 4.56.2 models/bert/modeling_bert.py BertForMaskedLM: BertModel without its pooler
# (add_pooling_layer=False): word, position (learned) and token-type embeddings and a LayerNorm;
# per layer q, k, v and the attention output dense with biases, a LayerNorm after each residual
# add (post-norm: the same two norms a block), intermediate and output dense with biases (GELU);
# then cls.predictions: transform.dense (h -> h, bias), GELU, transform.LayerNorm, and a decoder
# tied to the word embeddings with a bias of its own. Attention is bidirectional.
def _bert_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ZeroplanError("config.position_embedding_type", f"{config['position_embedding_type']!r} is not modelled "
                            "(allowed: absolute)")
    if config.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_python"):
        raise ZeroplanError("config.hidden_act", f"{config['hidden_act']!r} is not modelled for bert (allowed: gelu)")
    architectures = config.get("architectures") or [BERT_MASKED_LM]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        # A number there was a TypeError (`in` on an int; join of a non-string item).
        raise ZeroplanError("config.architectures", f"{architectures!r} is not a list of class names (allowed: a JSON "
                                                    f"array of strings such as [\"{BERT_MASKED_LM}\"], or null)")
    caveat = "" if BERT_MASKED_LM in architectures else (
        f"counted as {BERT_MASKED_LM} (masked-LM head, no pooler); {', '.join(architectures)} has other heads")
    return strict_model_spec(
        **_shape_fields(name, config),
        **_biased_layernorm_gelu(config),
        position=PositionKind.learned,
        causal=False,
        token_types=config.get("type_vocab_size", 2),
        embedding_norm=True,
        head_transform=True,
        head_bias=True,
        tied_embeddings=config.get("tie_word_embeddings", True),
        attention_dropout=config.get("attention_probs_dropout_prob", 0.0),
        hidden_dropout=config.get("hidden_dropout_prob", 0.0),
        parameter_count_exact=not caveat,
        parameter_count_caveat=caveat,
    )


BLOOM_TRAINED_POSITIONS = 2048
"""BLOOM's training sequence length (Le Scao et al. 2022, "BLOOM", sec. 3.5: 2048 tokens); ALiBi
has no position table, so longer sequences run with --allow-longer-seq."""


# transformers 4.56.2 models/bloom/modeling_bloom.py: word_embeddings and
# word_embeddings_layernorm (LayerNorm), per block input_layernorm, self_attention.
# query_key_value (h -> 3h) and dense (h -> h) with biases, post_attention_layernorm, mlp.
# dense_h_to_4h and dense_4h_to_h with biases (BloomGelu); ln_f; lm_head tied to the embedding;
# ALiBi positions (no parameters) through an eager attention with an fp32 softmax.
# modeling_bloom.py:211 (BloomAttention.__init__): query_key_value = nn.Linear(hidden_size,
# 3 * hidden_size, bias=True), one module (fused_qkv).
def _bloom_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    if config.get("apply_residual_connection_post_layernorm"):
        raise ZeroplanError("config.apply_residual_connection_post_layernorm",
                            "a residual taken after the norm is not modelled (allowed: false)")
    shape = _megatron_shape_fields(name, config, "hidden_size", "n_embed")
    return strict_model_spec(
        **shape,
        ffn_hidden_size=4 * shape["hidden_size"],
        mlp=MlpKind.gelu,
        norm=NormKind.layernorm,
        position=PositionKind.alibi,
        max_positions=config.get("seq_length") or BLOOM_TRAINED_POSITIONS,
        bias=True,
        fused_qkv=True,
        embedding_norm=True,
        tied_embeddings=config.get("tie_word_embeddings", True),
        attention_dropout=config.get("attention_dropout", 0.0),
        hidden_dropout=config.get("hidden_dropout", 0.0),
    )


# transformers 4.56.2 models/phi3/modeling_phi3.py:161 (Phi3Attention.__init__): qkv_proj =
# nn.Linear(hidden_size, op_size), q, k and v in one module; :55 (Phi3MLP.__init__): gate_up_proj =
# nn.Linear(hidden_size, 2 * intermediate_size), gate and up in one (fused_qkv, fused_gate_up).
def _llama_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    model_type = config["model_type"]
    gemma = model_type in _GEMMA_LIKE
    moe_defaults = (8, 2) if model_type == "mixtral" else (1, 1)  # MixtralConfig: 8 experts, top-2
    return strict_model_spec(
        name=name,
        vocab_size=require_key(config, "vocab_size"),
        hidden_size=require_key(config, "hidden_size"),
        num_layers=require_key(config, "num_hidden_layers"),
        num_heads=require_key(config, "num_attention_heads"),
        num_kv_heads=config.get("num_key_value_heads"),
        # GemmaConfig / Gemma2Config default head_dim to 256, not hidden_size / heads.
        head_dim=config.get("head_dim", 256 if gemma else None),
        ffn_hidden_size=require_key(config, "intermediate_size"),
        mlp=MlpKind.geglu if gemma else MlpKind.swiglu,
        norm=NormKind.rmsnorm,
        position=PositionKind.rope,
        max_positions=config.get("max_position_embeddings", 4096),
        # transformers 4.38.x models/llama/modeling_llama.py:931-934 and models/gemma/modeling_gemma.py:822-825
        # register the P x P causal-mask buffer; mistral, mixtral and qwen2 of 4.38 build none.
        positions_causal_mask=model_type in ("llama", "gemma"),
        bias=False,
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        post_norms=model_type == "gemma2",
        # GemmaRMSNorm / Gemma2RMSNorm: (1 + weight) in fp32, cast after (ModelSpec.norm_scales_fp32).
        norm_scales_fp32=gemma,
        # Gemma2Config's attn_logit_softcapping defaults to 50.0; null turns the cap off.
        attention_softcapping=model_type == "gemma2" and config.get("attn_logit_softcapping", 50.0) is not None,
        fused_qkv=model_type == "phi3",
        fused_gate_up=model_type == "phi3",
        tied_embeddings=config.get("tie_word_embeddings", gemma),
        num_experts=config.get("num_local_experts", moe_defaults[0]) if model_type == "mixtral" else 1,
        experts_per_token=config.get("num_experts_per_tok", moe_defaults[1]) if model_type == "mixtral" else 1,
        attention_dropout=config.get("attention_dropout", 0.0),
        # Phi-3 drops out each sub-block's output (resid_attn_dropout, resid_mlp_dropout).
        hidden_dropout=config.get("resid_pdrop", 0.0) if model_type == "phi3" else 0.0,
    )


def _moe_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    """Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3; defaults are their transformers 4.56
    configuration_*.py defaults."""
    model_type = config["model_type"]
    deepseek = model_type in _DEEPSEEK
    common: dict[str, Any] = dict(
        **_shape_fields(name, config),
        mlp=MlpKind.swiglu,
        norm=NormKind.rmsnorm,
        position=PositionKind.rope,
        max_positions=config.get("max_position_embeddings", 4096),
        tied_embeddings=config.get("tie_word_embeddings", False),
        attention_dropout=config.get("attention_dropout", 0.0),
    )
    if not deepseek:
        qwen2 = model_type == "qwen2_moe"
        num_experts = config.get("num_experts", 60 if qwen2 else 128)
        return strict_model_spec(
            **common,
            num_kv_heads=config.get("num_key_value_heads"),
            head_dim=config.get("head_dim"),
            # Qwen2MoeAttention: q/k/v biased when qkv_bias (default true); Qwen3MoeAttention: q_norm, k_norm.
            qkv_bias=qwen2 and config.get("qkv_bias", True),
            qk_norm=not qwen2,
            num_experts=num_experts,
            experts_per_token=config.get("num_experts_per_tok", 4 if qwen2 else 8),
            moe_ffn_hidden_size=config.get("moe_intermediate_size", 1408 if qwen2 else 768),
            shared_expert_ffn_hidden_size=config.get("shared_expert_intermediate_size", 5632) if qwen2 else 0,
            shared_expert_gate=qwen2,
            moe_layer_interval=config.get("decoder_sparse_step", 1),
            dense_layers=_block_indices(config, "mlp_only_layers"),
        )
    if config.get("moe_layer_freq", 1) != 1:
        # transformers 4.56 DeepseekV2DecoderLayer makes every block from first_k_dense_replace on
        # a MoE block and never reads moe_layer_freq; a checkpoint with another value would not load.
        raise ZeroplanError("config.moe_layer_freq", f"{config['moe_layer_freq']!r} is not modelled (allowed: 1)")
    v2 = model_type == "deepseek_v2"
    moe_width = config.get("moe_intermediate_size", 1407 if v2 else 2048)
    shared = config.get("n_shared_experts", 2 if v2 else 1)
    qk_nope = config.get("qk_nope_head_dim", 128)
    qk_rope = config.get("qk_rope_head_dim", 64)
    return strict_model_spec(
        **common,
        # MLA: every query head gets its own key and value from the latent (kv_b_proj).
        head_dim=qk_nope + qk_rope,
        num_experts=config.get("n_routed_experts", 64 if v2 else 256),
        # DeepseekV2Config leaves num_experts_per_tok None: the model cannot route without it.
        experts_per_token=require_key(config, "num_experts_per_tok") if v2 else config.get("num_experts_per_tok", 8),
        moe_ffn_hidden_size=moe_width,
        shared_expert_ffn_hidden_size=(shared or 0) * moe_width,
        first_dense_layers=config.get("first_k_dense_replace", 0 if v2 else 3),
        q_lora_rank=config.get("q_lora_rank", 1536),
        kv_lora_rank=config.get("kv_lora_rank", 512),
        qk_rope_head_dim=qk_rope,
        v_head_dim=config.get("v_head_dim", 128),
    )


# Keys whose value must be a JSON integer: pydantic's lax mode would turn "4096" into 4096 and
# true into 1, silently accepting a config that Hugging Face itself would reject.
_INTEGER_KEYS = (
    "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
    "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "max_position_embeddings", "n_positions",
    "num_local_experts", "num_experts_per_tok", "num_experts", "n_routed_experts", "n_shared_experts",
    "moe_intermediate_size", "shared_expert_intermediate_size", "first_k_dense_replace", "decoder_sparse_step",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "ffn_dim", "word_embed_proj_dim", "n_embed", "num_kv_heads", "ffn_hidden_size", "rotary_dim",
    "d_model", "n_heads", "n_layers", "max_seq_len",
)


MAX_CONFIG_SIZE = 1 << 24
"""Largest width, count or vocabulary a config.json may give (16,777,216): far above any
published model (vocabularies ~256k, widths ~32k), low enough that a typo such as 10^30 is
refused instead of making the planner's integer arithmetic run for minutes."""
MAX_CONFIG_POSITIONS = 1 << 30
"""Largest max_position_embeddings / n_positions accepted."""
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len")
MAX_CONFIG_LAYERS = 1 << 10
"""Largest num_hidden_layers / n_layer (1,024): the deepest published models have under 200
blocks; the planner builds every block's units, so 2^24 grew past 10 GB and never answered,
while 1,024 answers in about a second (docs/input-bounds.md)."""
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers")


def _check_integer_keys(config: dict[str, Any]) -> None:
    for key in _INTEGER_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ZeroplanError(f"config.{key}", f"must be a JSON integer, got {value!r}")
        limit = MAX_CONFIG_POSITIONS if key in _POSITION_KEYS else MAX_CONFIG_LAYERS if key in _LAYER_KEYS else MAX_CONFIG_SIZE
        if value > limit:
            raise ZeroplanError(f"config.{key}", f"must be at most {limit:,}, got {value:,}")


def parse_hf_config(config: dict[str, Any], name: str) -> ModelSpec:
    """A ModelSpec from an already-parsed config.json dictionary."""
    if not isinstance(config, dict):
        raise ZeroplanError("config", "config.json must hold a JSON object")
    model_type = config.get("model_type")
    if model_type is None:
        raise ZeroplanError("config.model_type", f"missing (allowed: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if model_type in ENCODER_DECODER_TYPES or (config.get("is_encoder_decoder") and model_type not in SUPPORTED_MODEL_TYPES):
        # A ModelSpec is one stack of blocks over one sequence; an encoder-decoder has two stacks,
        # cross-attention and a decoder length of its own.
        raise ZeroplanError("config.model_type", f"{model_type!r} is an encoder-decoder zeroplan does not read "
                                                 f"(allowed: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ZeroplanError(
            "config.model_type", f"unsupported {model_type!r} (allowed: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    _check_integer_keys(config)
    check_rope_scaling(config)
    _refuse_unmodelled(config, model_type)
    config_quantization(config)
    try:
        if model_type in ENCODER_DECODER_READERS:
            spec = ENCODER_DECODER_READERS[model_type](name, config)
        elif model_type in _GPT2_LIKE:
            spec = _gpt2_spec(name, config)
        elif model_type in _GPT_NEOX:
            spec = _gpt_neox_spec(name, config)
        elif model_type in _PHI:
            spec = _phi_spec(name, config)
        elif model_type in _BLOOM:
            spec = _bloom_spec(name, config)
        elif model_type in _BERT:
            spec = _bert_spec(name, config)
        elif model_type in FAMILY_READERS:
            spec = FAMILY_READERS[model_type](name, config)
        elif model_type in _QWEN_MOE + _DEEPSEEK:
            spec = _moe_spec(name, config)
        else:
            spec = _llama_spec(name, config)
    except ValidationError as error:
        raise config_key_error(first_error(error)) from None
    caveat = "; ".join(part for part in (spec.parameter_count_caveat, _count_caveat(config, model_type)) if part)
    if caveat:
        spec = spec.model_copy(update={"parameter_count_exact": False, "parameter_count_caveat": caveat})
    return spec


# transformers 4.56.2 utils/quantization_config.py BitsAndBytesConfig.to_dict: quant_method
# "bitsandbytes", load_in_4bit / load_in_8bit, bnb_4bit_quant_type ("nf4" or "fp4"),
# bnb_4bit_use_double_quant, llm_int8_has_fp16_weight; a checkpoint saved from a quantized model
# carries it in config.json.
def config_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """The fine-tune fields a config.json's ``quantization_config`` sets (quantize, double_quant),
    None without one; a scheme the planner does not model is a one-line error."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ZeroplanError("config.quantization_config", f"must be an object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method == "bitsandbytes" and quant.get("load_in_4bit") and quant.get("load_in_8bit"):
        # transformers' BitsAndBytesConfig refuses both ("load_in_4bit and
        # load_in_8bit are both True, but only one can be used at the same time").
        raise ZeroplanError("config.quantization_config", "sets both load_in_4bit and load_in_8bit "
                                                          "(allowed: one of them)")
    if method == "bitsandbytes" and quant.get("load_in_4bit"):
        kind = quant.get("bnb_4bit_quant_type", "fp4")
        if kind != "nf4":
            raise ZeroplanError("config.quantization_config", f"bnb_4bit_quant_type {kind!r} is not modelled (allowed: nf4)")
        return {"quantize": "nf4", "double_quant": bool(quant.get("bnb_4bit_use_double_quant", False))}
    if method == "bitsandbytes" and quant.get("load_in_8bit"):
        # llm_int8_has_fp16_weight keeps the 16-bit weight beside its int8 copy (Int8Params
        # has_fp16_weights), a layout not measured; llm_int8_threshold only picks the input's
        # outlier columns.
        if quant.get("llm_int8_has_fp16_weight"):
            raise ZeroplanError("config.quantization_config", "llm_int8_has_fp16_weight true is not modelled (allowed: false)")
        return {"quantize": "int8"}
    if method == "gptq":
        return _gptq_fields(quant)
    raise ZeroplanError("config.quantization_config", f"quant_method {method!r} is not modelled "
                                                      "(allowed: bitsandbytes load_in_4bit nf4, bitsandbytes load_in_8bit, "
                                                      "gptq bits 4)")


# A GPTQ checkpoint's quantization_config (optimum's GPTQQuantizer fields: bits, group_size,
# desc_act). auto-gptq 0.4.2 utils/import_utils.py:41-45 runs qlinear_cuda_old only where desc_act
# is false or group_size is -1; with act-order groups it picks qlinear_cuda, not modelled.
def _gptq_fields(quant: dict[str, Any]) -> dict[str, Any]:
    bits = quant.get("bits")
    if bits != 4:
        raise ZeroplanError("config.quantization_config", f"gptq bits {bits!r} is not modelled (allowed: 4)")
    group = quant.get("group_size", 128)
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        raise ZeroplanError("config.quantization_config", f"gptq group_size {group!r} is not modelled "
                                                          "(allowed: a positive integer)")
    if quant.get("desc_act"):
        raise ZeroplanError("config.quantization_config", "gptq desc_act true is not modelled (allowed: false)")
    return {"quantize": "gptq-int4", "gptq_group_size": group}


def _block_indices(config: dict[str, Any], key: str) -> tuple:
    """A config list of block indices (Qwen's mlp_only_layers), as a tuple whose items the strict
    model spec checks; anything but a JSON array (or null) is refused naming the key (an integer
    there was a TypeError from tuple())."""
    value = config.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ZeroplanError(f"config.{key}", f"{value!r} is not a list of block indices (allowed: a JSON array such "
                                             "as [] or [0, 1], or null)")
    return tuple(value)


def read_config_quantization(path: Path) -> dict[str, Any] | None:
    """config_quantization of the config.json at ``path`` (already read once by load_hf_config)."""
    import json  # only for a config path: a preset name never loads it

    return config_quantization(json.loads(path.read_text(encoding="utf-8")))


def load_hf_config(path: Path) -> ModelSpec:
    """Parse ``path`` (a config.json); errors name the file problem or the bad key."""
    import json  # only for a config path: a preset name never loads it

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ZeroplanError("model", f"cannot read {str(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ZeroplanError("model", f"{str(path)!r} is not UTF-8 text (byte {error.start}); config.json must be UTF-8 JSON") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ZeroplanError("model", f"{str(path)!r} is not valid JSON (line {error.lineno}: {error.msg})") from None
    except RecursionError:
        raise nested_too_deeply_error("model", path, "a config.json nests a few") from None
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return parse_hf_config(config, name=name or "custom")
