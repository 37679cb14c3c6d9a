"""Parameter shapes and counts of a decoder-only transformer, grouped into sharding units.

A *unit* is what ZeRO-3 and FSDP gather at once: the embedding, each transformer block, and
the head (final norm + untied output projection). The tensor order inside a unit is the
registration order of the harness's PyTorch model, so padded flat layouts agree exactly.
"""

from __future__ import annotations

from functools import lru_cache

from zeroplan.core.encoder_decoder_params import parameter_units as encoder_decoder_units
from zeroplan.core.param_tensors import ParamTensor, ParamUnit, linear_tensors, mlp_tensors, norm_tensors
from zeroplan.specs.model import ModelSpec, PositionKind

FINAL_NORM_PREFIX = "final_norm."
"""How the final norm's tensors are named in the head unit (FSDP wrappings that leave it to the
root unit take them out: zeroplan.allocator.fsdp_schedule)."""


def expert_tensors(model: ModelSpec, expert: int) -> list[ParamTensor]:
    """One routed expert's tensors, named 'mlp.experts.<i>.<leaf>.weight'."""
    return mlp_tensors(f"mlp.experts.{expert}", model, model.expert_ffn_hidden_size)


def expert_parameters(model: ModelSpec) -> int:
    """Elements of one routed expert."""
    return sum(t.numel for t in expert_tensors(model, 0))


# DeepSeek-V2 (arXiv 2405.04434) sec. 2.1.2-2.1.3, as transformers 4.56 DeepseekV2Attention /
# DeepseekV3Attention build it: the query projected directly (q_proj, h -> a(d_nope + d_rope)) or
# through a low-rank latent (q_a_proj h -> q_lora, q_a_layernorm, q_b_proj q_lora -> a(d_nope +
# d_rope)); the keys and values from one latent (kv_a_proj_with_mqa h -> kv_lora + d_rope, the
# d_rope part the RoPE key shared by all heads; kv_a_layernorm; kv_b_proj kv_lora -> a(d_nope +
# d_v)); o_proj a d_v -> h. No biases (attention_bias false in every published config).
def _mla_tensors(model: ModelSpec) -> list[ParamTensor]:
    h, a, d_qk, d_rope = model.hidden_size, model.num_heads, model.head_size, model.qk_rope_head_dim
    assert d_rope is not None and model.kv_lora_rank is not None
    d_nope = d_qk - d_rope
    if model.q_lora_rank is None:
        tensors = linear_tensors("attention.q", h, a * d_qk, False)
    else:
        tensors = (linear_tensors("attention.q_a", h, model.q_lora_rank, False)
                   + [ParamTensor(name="attention.q_a_norm.weight", shape=(model.q_lora_rank,))]
                   + linear_tensors("attention.q_b", model.q_lora_rank, a * d_qk, False))
    tensors += linear_tensors("attention.kv_a", h, model.kv_lora_rank + d_rope, False)
    tensors.append(ParamTensor(name="attention.kv_a_norm.weight", shape=(model.kv_lora_rank,)))
    tensors += linear_tensors("attention.kv_b", model.kv_lora_rank, a * (d_nope + model.v_head_size), False)
    tensors += linear_tensors("attention.o", model.attention_output_size, h, False)
    return tensors


def _attention_tensors(model: ModelSpec) -> list[ParamTensor]:
    if model.is_mla:
        return _mla_tensors(model)
    h, bias = model.hidden_size, model.bias
    # Qwen2 biases q/k/v only: transformers 4.44 models/qwen2/modeling_qwen2.py (Qwen2Attention, bias=True)
    qkv_bias = bias or model.qkv_bias
    tensors = linear_tensors("attention.q", h, model.q_size, qkv_bias)
    tensors += linear_tensors("attention.k", h, model.kv_size, qkv_bias)
    tensors += linear_tensors("attention.v", h, model.kv_size, qkv_bias)
    if model.qk_norm:
        # Qwen3 per-head RMSNorm on q and k: transformers 4.51 models/qwen3/modeling_qwen3.py (q_norm, k_norm)
        tensors += [
            ParamTensor(name="attention.q_norm.weight", shape=(model.head_size,)),
            ParamTensor(name="attention.k_norm.weight", shape=(model.head_size,)),
        ]
    tensors += linear_tensors("attention.o", model.q_size, h, bias)
    return tensors


# The MoE block (transformers 4.56 MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
# Qwen3MoeSparseMoeBlock, DeepseekV2MoE, DeepseekV3MoE): a bias-free router h -> E, E routed
# experts, then the shared expert and Qwen2-MoE's shared-expert gate h -> 1. DeepSeek-V3's
# e_score_correction_bias is a buffer (register_buffer), not a parameter, and is not counted.
def _moe_tensors(model: ModelSpec) -> list[ParamTensor]:
    tensors = linear_tensors("mlp.router", model.hidden_size, model.num_experts, bias=False)
    for expert in range(model.num_experts):
        tensors += expert_tensors(model, expert)
    if model.shared_expert_ffn_hidden_size:
        tensors += mlp_tensors("mlp.shared", model, model.shared_expert_ffn_hidden_size)
    if model.shared_expert_gate:
        tensors += linear_tensors("mlp.shared_gate", model.hidden_size, 1, bias=False)
    return tensors


@lru_cache(maxsize=128)
def block_tensors(model: ModelSpec, moe: bool) -> tuple[ParamTensor, ...]:
    """One block's tensors in registration order: with the experts (``moe``) or a dense MLP."""
    tensors = norm_tensors("attention_norm", model)
    tensors += _attention_tensors(model)
    if model.post_norms:
        # Gemma 2 normalises each sub-block's output: transformers 4.42 models/gemma2/modeling_gemma2.py
        # (Gemma2DecoderLayer: post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm)
        tensors += norm_tensors("attention_post_norm", model)
    if not model.parallel_block:
        tensors += norm_tensors("mlp_norm", model)
    tensors += _moe_tensors(model) if moe else mlp_tensors("mlp", model)
    if model.post_norms:
        tensors += norm_tensors("mlp_post_norm", model)
    return tuple(tensors)


def _block_tensors(model: ModelSpec) -> tuple[ParamTensor, ...]:
    """The block the model repeats most: with experts for a mixture of experts."""
    return block_tensors(model, model.is_moe)


def block_linear_weight_elements(model: ModelSpec) -> int:
    """Elements of the weight matrices of one block's linear layers (norms and biases excluded)."""
    return linear_weight_elements(_block_tensors(model))


def linear_weight_elements(tensors) -> int:
    """Elements of the weight matrices among ``tensors`` (norms and biases excluded)."""
    return sum(t.numel for t in tensors if t.name.endswith(".weight") and len(t.shape) == 2)


# A function of the model alone, asked for each micro-batch shape the plan search prices
# (a walk over every block's tensors each time).
@lru_cache(maxsize=64)
def blocks_linear_weight_elements(model: ModelSpec) -> int:
    """Elements of the weight matrices of all the blocks' linear layers (embedding and head excluded)."""
    return sum(linear_weight_elements(unit.tensors) for unit in parameter_units(model)[1:-1])


@lru_cache(maxsize=64)
def parameter_units(model: ModelSpec) -> tuple[ParamUnit, ...]:
    """Units in forward order: embedding, blocks 0..L-1, head."""
    if model.encoder_decoder is not None:
        # Two stacks of blocks (zeroplan.core.encoder_decoder).

        return encoder_decoder_units(model)
    h = model.hidden_size
    # OPT's project_in / project_out between a narrower embedding and the blocks (ModelSpec.embedding_projection).
    width = model.embedding_projection or h
    embedding = [ParamTensor(name="token.weight", shape=(model.vocab_size, width))]
    if model.embedding_projection:
        embedding += linear_tensors("project_in", width, h, False)
    if model.position is PositionKind.learned:
        embedding.append(ParamTensor(name="position.weight", shape=(model.max_positions + model.position_offset, h)))
    if model.token_types:
        embedding.append(ParamTensor(name="token_type.weight", shape=(model.token_types, h)))
    if model.embedding_norm:
        embedding += norm_tensors("embedding_norm", model)
    head = linear_tensors("head_transform", h, h, True) if model.head_transform else []
    if model.final_norm:
        head += norm_tensors(FINAL_NORM_PREFIX.rstrip("."), model)
    if model.embedding_projection:
        head += linear_tensors("project_out", h, width, False)
    if not model.tied_embeddings:
        head.append(ParamTensor(name="lm_head.weight", shape=(model.vocab_size, width)))
    if model.head_bias:
        head.append(ParamTensor(name="lm_head.bias", shape=(model.vocab_size,)))
    units = [ParamUnit(name="embedding", tensors=tuple(embedding))]
    units += [ParamUnit(name=f"block.{i}", tensors=block_tensors(model, model.is_moe_layer(i)))
              for i in range(model.num_layers)]
    units.append(ParamUnit(name="head", tensors=tuple(head)))
    return tuple(units)


# A function of the model alone, asked for by every step's FLOPs (active_parameters) and FSDP's
# copies: a walk over every unit's tensors each time.
@lru_cache(maxsize=64)
def total_parameters(model: ModelSpec) -> int:
    """Psi in the ZeRO paper: every trainable parameter, counted once (tied weights once)."""
    return sum(unit.numel for unit in parameter_units(model))


# Kaplan et al. 2020 (sec. 2.1) count FLOPs per token with the parameters a token touches;
# for a mixture of experts that is the routed experts only (Fedus et al. 2022, sec. 2).
def active_parameters(model: ModelSpec) -> int:
    """Parameters one token passes through (all of them for a dense model)."""
    if not model.is_moe:
        return total_parameters(model)
    # Shared experts, the router and the dense first blocks serve every token; of the routed
    # experts of each MoE block, k.
    unused_experts = model.num_experts - model.experts_per_token
    return total_parameters(model) - model.moe_layer_count * unused_experts * expert_parameters(model)


def largest_unit_parameters(model: ModelSpec) -> int:
    """Elements of the biggest unit: what a ZeRO-3/FSDP rank must gather at once."""
    return max(unit.numel for unit in parameter_units(model))
