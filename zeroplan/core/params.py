"""Parameter shapes and counts of a decoder-only transformer, grouped into sharding units.

A *unit* is what ZeRO-3 and FSDP gather at once: the embedding, each transformer block, and
the head (final norm + untied output projection). The tensor order inside a unit is the
registration order of the harness's PyTorch model, so padded flat layouts agree exactly.
"""

from __future__ import annotations

from functools import lru_cache
from math import prod

from pydantic import Field

from zeroplan.specs.base import Frozen
from zeroplan.specs.model import ModelSpec, NormKind, PositionKind


class ParamTensor(Frozen):
    """One parameter tensor."""

    name: str
    """Dotted name inside its unit, e.g. 'attention.q.weight'."""
    shape: tuple[int, ...] = Field(min_length=1)
    """Tensor shape; dim 0 is the one FSDP2 shards."""

    @property
    def numel(self) -> int:
        return prod(self.shape)


class ParamUnit(Frozen):
    """A group of parameters gathered and reduced together."""

    name: str
    """'embedding', 'block.<i>' or 'head'."""
    tensors: tuple[ParamTensor, ...]
    """Tensors in registration order."""

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


def _norm_tensors(prefix: str, model: ModelSpec) -> list[ParamTensor]:
    h = model.hidden_size
    tensors = [ParamTensor(name=f"{prefix}.weight", shape=(h,))]
    if model.norm is NormKind.layernorm:
        tensors.append(ParamTensor(name=f"{prefix}.bias", shape=(h,)))
    return tensors


def _linear_tensors(prefix: str, in_features: int, out_features: int, bias: bool) -> list[ParamTensor]:
    tensors = [ParamTensor(name=f"{prefix}.weight", shape=(out_features, in_features))]
    if bias:
        tensors.append(ParamTensor(name=f"{prefix}.bias", shape=(out_features,)))
    return tensors


def _mlp_tensors(prefix: str, model: ModelSpec) -> list[ParamTensor]:
    h, f, bias = model.hidden_size, model.ffn_hidden_size, model.bias
    if not model.mlp.gated:
        return _linear_tensors(f"{prefix}.fc1", h, f, bias) + _linear_tensors(f"{prefix}.fc2", f, h, bias)
    return (
        _linear_tensors(f"{prefix}.gate", h, f, bias)
        + _linear_tensors(f"{prefix}.up", h, f, bias)
        + _linear_tensors(f"{prefix}.down", f, h, bias)
    )


def _block_tensors(model: ModelSpec) -> tuple[ParamTensor, ...]:
    h, bias = model.hidden_size, model.bias
    tensors = _norm_tensors("attention_norm", model)
    # Qwen2 biases q/k/v only: transformers 4.44 models/qwen2/modeling_qwen2.py (Qwen2Attention, bias=True)
    qkv_bias = bias or model.qkv_bias
    tensors += _linear_tensors("attention.q", h, model.q_size, qkv_bias)
    tensors += _linear_tensors("attention.k", h, model.kv_size, qkv_bias)
    tensors += _linear_tensors("attention.v", h, model.kv_size, qkv_bias)
    if model.qk_norm:
        # Qwen3 per-head RMSNorm on q and k: transformers 4.51 models/qwen3/modeling_qwen3.py (q_norm, k_norm)
        tensors += [
            ParamTensor(name="attention.q_norm.weight", shape=(model.head_size,)),
            ParamTensor(name="attention.k_norm.weight", shape=(model.head_size,)),
        ]
    tensors += _linear_tensors("attention.o", model.q_size, h, bias)
    if model.post_norms:
        # Gemma 2 normalises each sub-block's output: transformers 4.42 models/gemma2/modeling_gemma2.py
        # (Gemma2DecoderLayer: post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm)
        tensors += _norm_tensors("attention_post_norm", model)
    tensors += _norm_tensors("mlp_norm", model)
    if model.is_moe:
        tensors += _linear_tensors("mlp.router", h, model.num_experts, bias=False)
        for expert in range(model.num_experts):
            tensors += _mlp_tensors(f"mlp.experts.{expert}", model)
    else:
        tensors += _mlp_tensors("mlp", model)
    if model.post_norms:
        tensors += _norm_tensors("mlp_post_norm", model)
    return tuple(tensors)


def block_linear_weight_elements(model: ModelSpec) -> int:
    """Elements of the weight matrices of one block's linear layers (norms and biases excluded)."""
    return sum(t.numel for t in _block_tensors(model) if t.name.endswith(".weight") and len(t.shape) == 2)


@lru_cache(maxsize=64)
def parameter_units(model: ModelSpec) -> tuple[ParamUnit, ...]:
    """Units in forward order: embedding, blocks 0..L-1, head."""
    h = model.hidden_size
    embedding = [ParamTensor(name="token.weight", shape=(model.vocab_size, h))]
    if model.position is PositionKind.learned:
        embedding.append(ParamTensor(name="position.weight", shape=(model.max_positions, h)))
    block = _block_tensors(model)
    head = _norm_tensors("final_norm", model)
    if not model.tied_embeddings:
        head.append(ParamTensor(name="lm_head.weight", shape=(model.vocab_size, h)))
    units = [ParamUnit(name="embedding", tensors=tuple(embedding))]
    units += [ParamUnit(name=f"block.{i}", tensors=block) for i in range(model.num_layers)]
    units.append(ParamUnit(name="head", tensors=tuple(head)))
    return tuple(units)


def total_parameters(model: ModelSpec) -> int:
    """Psi in the ZeRO paper: every trainable parameter, counted once (tied weights once)."""
    return sum(unit.numel for unit in parameter_units(model))


# Kaplan et al. 2020 (sec. 2.1) count FLOPs per token with the parameters a token touches;
# for a mixture of experts that is the routed experts only (Fedus et al. 2022, sec. 2).
def active_parameters(model: ModelSpec) -> int:
    """Parameters one token passes through (all of them for a dense model)."""
    if not model.is_moe:
        return total_parameters(model)
    unused_experts = model.num_experts - model.experts_per_token
    expert_numel = sum(t.numel for t in _mlp_tensors("expert", model))
    return total_parameters(model) - model.num_layers * unused_experts * expert_numel


def largest_unit_parameters(model: ModelSpec) -> int:
    """Elements of the biggest unit: what a ZeRO-3/FSDP rank must gather at once."""
    return max(unit.numel for unit in parameter_units(model))
