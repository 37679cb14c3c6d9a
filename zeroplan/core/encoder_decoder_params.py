"""An encoder-decoder's parameter units (T5, mT5, umT5, T0/mT0 and BART in transformers 4.56.2):
the encoder's blocks, then the decoder's, between the shared embedding and the head, so its
model states, its ZeRO and FSDP gathers and its communication volumes follow from the counts
as they do for one stack (zeroplan.core.params asks here when ModelSpec.encoder_decoder is set).
"""

from __future__ import annotations

from functools import lru_cache

from zeroplan.core.param_tensors import ParamTensor, ParamUnit, linear_tensors, mlp_tensors, norm_tensors
from zeroplan.specs.model import ModelSpec, PositionKind


def _attention(prefix: str, model: ModelSpec) -> list[ParamTensor]:
    h, inner, bias = model.hidden_size, model.q_size, model.bias
    return (linear_tensors(f"{prefix}.q", h, inner, bias) + linear_tensors(f"{prefix}.k", h, inner, bias)
            + linear_tensors(f"{prefix}.v", h, inner, bias) + linear_tensors(f"{prefix}.o", inner, h, bias))


def _relative_bias(model: ModelSpec, index_in_stack: int) -> list[ParamTensor]:
    """T5's buckets x heads bias table: in the first self-attention of a stack (every one in umT5)."""
    stacks = model.encoder_decoder
    if not stacks.relative_attention_buckets or (index_in_stack > 0 and not stacks.relative_bias_every_layer):
        return []
    return [ParamTensor(name="attention.relative_bias.weight", shape=(stacks.relative_attention_buckets, model.num_heads))]


# transformers 4.56.2 models/t5/modeling_t5.py: T5Block.layer = [T5LayerSelfAttention (q, k, v,
# o without bias, the relative_attention_bias Embedding where has_relative_attention_bias, then
# its T5LayerNorm), T5LayerCrossAttention in the decoder (EncDecAttention q, k, v, o and its
# norm), T5LayerFF (DenseReluDense wi, wo or T5DenseGatedActDense wi_0, wi_1, wo, and its norm)].
# models/bart/modeling_bart.py BartEncoderLayer / BartDecoderLayer: self_attn (k, v, q,
# out_proj with bias), self_attn_layer_norm, encoder_attn and encoder_attn_layer_norm in the
# decoder, fc1, fc2, final_layer_norm (LayerNorm with bias). The order within a block here is
# attention, its norm, cross-attention, its norm, MLP, its norm.
@lru_cache(maxsize=64)
def block_tensors(model: ModelSpec, decoder: bool, index_in_stack: int) -> tuple[ParamTensor, ...]:
    """One encoder (``decoder`` False) or decoder block's tensors."""
    tensors = _attention("attention", model) + _relative_bias(model, index_in_stack) + norm_tensors("attention_norm", model)
    if decoder:
        tensors += _attention("cross_attention", model) + norm_tensors("cross_attention_norm", model)
    return tuple(tensors + mlp_tensors("mlp", model) + norm_tensors("mlp_norm", model))


# T5ForConditionalGeneration: `shared` (V x h), the input embedding of both stacks (T5Stack
# embed_tokens is the same module), each stack's final_layer_norm, lm_head (V x h, no bias) tied to
# shared when tie_word_embeddings (T5 1.0; T5 1.1, mT5 and T0 untie it). BartForConditionalGeneration:
# shared, each stack's BartLearnedPositionalEmbedding (max_position_embeddings + 2 rows) and
# layernorm_embedding, the final layer_norm only with add_final_layer_norm, lm_head tied to
# shared; final_logits_bias is a buffer (register_buffer), not a parameter.
@lru_cache(maxsize=64)
def parameter_units(model: ModelSpec) -> tuple[ParamUnit, ...]:
    """Units in forward order: embedding (the shared table, and BART's position tables and
    embedding norms), the encoder's blocks (the last with the encoder's final norm), the
    decoder's blocks, head (the decoder's final norm and an untied output projection)."""
    h, stacks = model.hidden_size, model.encoder_decoder
    embedding = [ParamTensor(name="token.weight", shape=(model.vocab_size, h))]
    for stack in ("encoder", "decoder"):
        if model.position is PositionKind.learned:
            embedding.append(ParamTensor(name=f"{stack}_position.weight", shape=(model.max_positions + model.position_offset, h)))
        if model.embedding_norm:
            embedding += norm_tensors(f"{stack}_embedding_norm", model)
    units = [ParamUnit(name="embedding", tensors=tuple(embedding))]
    encoder = stacks.encoder_layers
    for i in range(model.num_layers):
        decoder = i >= encoder
        tensors = block_tensors(model, decoder, i - encoder if decoder else i)
        if i == encoder - 1 and stacks.stack_final_norms:
            tensors += tuple(norm_tensors("encoder_final_norm", model))
        units.append(ParamUnit(name=f"block.{i}", tensors=tensors))
    head = norm_tensors("final_norm", model) if stacks.stack_final_norms else []
    if not model.tied_embeddings:
        head.append(ParamTensor(name="lm_head.weight", shape=(model.vocab_size, h)))
    units.append(ParamUnit(name="head", tensors=tuple(head)))
    return tuple(units)
