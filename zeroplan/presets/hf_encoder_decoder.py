"""Read the config.json of an encoder-decoder (T5, mT5, umT5, BART) into a ModelSpec with
``encoder_decoder`` set (zeroplan.specs.encoder_decoder): each family's layout as transformers
4.56.2 builds it, the modeling file cited above each reader, with a one-line refusal of any
option whose layout is not modelled. zeroplan.presets.hf_config dispatches here by model_type.
"""

from __future__ import annotations

from typing import Any

from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_fields import require_key, strict_model_spec
from zeroplan.specs.encoder_decoder import EncoderDecoderSpec
from zeroplan.specs.model import MlpKind, ModelSpec, NormKind, PositionKind

MAX_SIZE = 1 << 24
"""The largest width or vocabulary read (as zeroplan.presets.hf_config's MAX_CONFIG_SIZE)."""
MAX_STACK_LAYERS = 512
"""The deepest stack read (the ModelSpec's 1,024 blocks, two stacks)."""

T5_TRAINED_POSITIONS = 512
"""T5's pre-training input length (Raffel et al. 2020 sec. 3.1.2: 512 tokens), what the
relative bias was trained over; longer inputs run (the buckets are log-spaced past 128) with
--allow-longer-seq."""


def _int(config: dict[str, Any], key: str, default: int | None = None, *, limit: int = MAX_SIZE) -> int:
    """A JSON integer key (``default`` when absent and given), refused in one line otherwise."""
    value = config.get(key, default) if default is not None else require_key(config, key)
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ZeroplanError(f"config.{key}", f"must be a positive JSON integer, got {value!r}")
    if value > limit:
        raise ZeroplanError(f"config.{key}", f"must be at most {limit:,}, got {value:,}")
    return value


def _dropout(config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ZeroplanError(f"config.{key}", f"must be a number from 0 to below 1, got {value!r}")
    return float(value)


# transformers 4.56.2 models/t5/configuration_t5.py: feed_forward_proj "relu" (T5 1.0: wi, wo),
# "gated-gelu" (T5 1.1, mT5, T0, mT0, umT5: wi_0, wi_1, wo around gelu_new), or another
# "[gated-]act"; only these two are modelled (their saved tensors are measured).
FEED_FORWARD = {"relu": MlpKind.relu, "gated-gelu": MlpKind.geglu}

T5_TIED_BY_DEFAULT = {"t5": True, "mt5": False, "umt5": True}
"""tie_word_embeddings when config.json leaves it out: T5Config (PretrainedConfig's True),
MT5Config (False), UMT5Config (True), transformers 4.56.2."""


# transformers 4.56.2 models/t5/modeling_t5.py (mt5/modeling_mt5.py and umt5/modeling_umt5.py
# are copies, umT5 with a relative bias in every self-attention): `shared` V x d_model; per stack
# num_layers (encoder) or num_decoder_layers (decoder) T5Blocks of q, k, v (d_model -> num_heads x
# d_kv), o, no biases, T5LayerNorm (weight only, RMS without the mean), the feed-forward of
# feed_forward_proj (d_ff wide); relative_attention_bias (relative_attention_num_buckets x
# num_heads) in the first block of each stack; each stack's final_layer_norm; lm_head tied to
# shared when tie_word_embeddings. dropout_rate drops the embeddings, the attention
# probabilities, the activation and each sub-block's output.
def t5_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    model_type = config["model_type"]
    proj = config.get("feed_forward_proj", "gated-gelu" if model_type == "umt5" else "relu")
    if proj not in FEED_FORWARD:
        raise ZeroplanError("config.feed_forward_proj", f"{proj!r} is not modelled (allowed: {', '.join(FEED_FORWARD)})")
    encoder = _int(config, "num_layers", limit=MAX_STACK_LAYERS)
    decoder = _int(config, "num_decoder_layers", config.get("num_layers"), limit=MAX_STACK_LAYERS)
    tied = config.get("tie_word_embeddings", T5_TIED_BY_DEFAULT[model_type])
    dropout = _dropout(config, "dropout_rate", 0.1)
    return strict_model_spec(
        name=name, vocab_size=_int(config, "vocab_size"), hidden_size=_int(config, "d_model"),
        num_layers=encoder + decoder, num_heads=_int(config, "num_heads"), head_dim=_int(config, "d_kv"),
        ffn_hidden_size=_int(config, "d_ff"), mlp=FEED_FORWARD[proj], norm=NormKind.rmsnorm,
        position=PositionKind.relative, max_positions=_int(config, "n_positions", T5_TRAINED_POSITIONS),
        bias=False, tied_embeddings=tied, attention_dropout=dropout, hidden_dropout=dropout,
        encoder_decoder=EncoderDecoderSpec(
            encoder_layers=encoder, relative_attention_buckets=_int(config, "relative_attention_num_buckets", 32),
            relative_bias_every_layer=model_type == "umt5", scale_tied_head_input=bool(tied)),
    )


# transformers 4.56.2 models/bart/modeling_bart.py: `shared` V x d_model; per stack a
# BartLearnedPositionalEmbedding (max_position_embeddings + 2 rows, the ids offset by 2) and
# layernorm_embedding; encoder_layers BartEncoderLayers (self_attn q/k/v/out_proj with bias,
# self_attn_layer_norm after the residual, fc1 and fc2 of encoder_ffn_dim with bias,
# final_layer_norm after the residual) and decoder_layers BartDecoderLayers (the same with
# encoder_attn and encoder_attn_layer_norm); no stack-final norm; lm_head tied to shared
# (final_logits_bias is a buffer).
def bart_spec(name: str, config: dict[str, Any]) -> ModelSpec:
    for encoder_key, decoder_key in (("encoder_ffn_dim", "decoder_ffn_dim"), ("encoder_attention_heads", "decoder_attention_heads")):
        if config.get(encoder_key, 0) != config.get(decoder_key, 0):
            raise ZeroplanError(f"config.{decoder_key}", f"{config.get(decoder_key)!r} differs from {encoder_key} "
                                                         f"{config.get(encoder_key)!r}: stacks of two widths are not modelled (allowed: equal)")
    activation = config.get("activation_function", "gelu")
    if activation != "gelu":
        raise ZeroplanError("config.activation_function", f"{activation!r} is not modelled for bart (allowed: 'gelu')")
    for key in ("encoder_layerdrop", "decoder_layerdrop", "activation_dropout"):
        if _dropout(config, key, 0.0):
            raise ZeroplanError(f"config.{key}", f"{config[key]!r} is not modelled (allowed: 0.0)")
    encoder = _int(config, "encoder_layers", 12, limit=MAX_STACK_LAYERS)
    decoder = _int(config, "decoder_layers", 12, limit=MAX_STACK_LAYERS)
    return strict_model_spec(
        name=name, vocab_size=_int(config, "vocab_size"), hidden_size=_int(config, "d_model"),
        num_layers=encoder + decoder, num_heads=_int(config, "encoder_attention_heads", 16),
        ffn_hidden_size=_int(config, "encoder_ffn_dim", 4096), mlp=MlpKind.gelu, norm=NormKind.layernorm,
        position=PositionKind.learned, max_positions=_int(config, "max_position_embeddings", 1024), position_offset=2,
        bias=True, embedding_norm=True, tied_embeddings=config.get("tie_word_embeddings", True),
        attention_dropout=_dropout(config, "attention_dropout", 0.0), hidden_dropout=_dropout(config, "dropout", 0.1),
        encoder_decoder=EncoderDecoderSpec(encoder_layers=encoder, stack_final_norms=False, post_norm=True),
    )


ENCODER_DECODER_READERS = {"t5": t5_spec, "mt5": t5_spec, "umt5": t5_spec, "bart": bart_spec}
"""model_type -> reader, for the encoder-decoders read."""

_T5_KEYS = frozenset({
    "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
    "relative_attention_num_buckets", "relative_attention_max_distance", "dropout_rate", "layer_norm_epsilon",
    "initializer_factor", "feed_forward_proj", "classifier_dropout", "n_positions", "output_past",
    "dense_act_fn", "is_gated_act",
})
# Keys each family's configuration_*.py (transformers 4.56.2) defines that are read above or
# change no parameter (dropouts, epsilons, initialisation, generation and classifier settings).
ENCODER_DECODER_NEUTRAL_KEYS: dict[str, frozenset[str]] = {
    "t5": _T5_KEYS, "mt5": _T5_KEYS, "umt5": _T5_KEYS,
    "bart": frozenset({
        "vocab_size", "max_position_embeddings", "d_model", "encoder_ffn_dim", "encoder_layers",
        "encoder_attention_heads", "decoder_ffn_dim", "decoder_layers", "decoder_attention_heads", "encoder_layerdrop",
        "decoder_layerdrop", "activation_function", "dropout", "attention_dropout", "activation_dropout", "init_std",
        "classifier_dropout", "scale_embedding", "num_labels", "num_hidden_layers", "add_bias_logits",
        "add_final_layer_norm", "normalize_before", "normalize_embedding", "static_position_embeddings",
        "extra_pos_embeddings", "force_bos_token_to_be_generated", "activation_function", "classif_dropout",
    }),
}
