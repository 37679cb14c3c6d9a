"""The built model has exactly the parameters the spec describes, in the documented order."""

from __future__ import annotations

import pytest
import torch

from zeroplan.harness.model import build_model, next_token_loss
from zeroplan.harness.presets import HARNESS_PRESETS, harness_model
from zeroplan.errors import ZeroplanError
from zeroplan.specs import ModelSpec


def _hand_count(spec: ModelSpec) -> int:
    """Count parameters from the spec's shapes, written out independently of model.py."""
    h, f, V, L = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size, spec.num_layers
    b = 1 if spec.bias else 0
    norm = 2 * h if spec.norm.value == "layernorm" else h
    q, kv = spec.num_heads * spec.head_size, spec.kv_heads * spec.head_size
    attention = (h * q + b * q) + 2 * (h * kv + b * kv) + (q * h + b * h)
    if spec.mlp.value == "gelu":
        expert = (h * f + b * f) + (f * h + b * h)
    else:
        expert = 2 * (h * f + b * f) + (f * h + b * h)
    mlp = expert if spec.num_experts == 1 else spec.num_experts * expert + h * spec.num_experts
    embed = V * h + (spec.max_positions * h if spec.position.value == "learned" else 0)
    head = norm + (0 if spec.tied_embeddings else V * h)
    return embed + L * (2 * norm + attention + mlp) + head


GPT2_LIKE = ModelSpec(
    name="gpt2-like", vocab_size=50, hidden_size=24, num_layers=3, num_heads=3,
    ffn_hidden_size=96, mlp="gelu", norm="layernorm", position="learned", max_positions=40,
    bias=True, tied_embeddings=True,
)
LLAMA_GQA = ModelSpec(
    name="llama-gqa", vocab_size=61, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=2,
    ffn_hidden_size=88, mlp="swiglu", norm="rmsnorm", position="rope",
)
HEAD_DIM = LLAMA_GQA.model_copy(update={"name": "head-dim", "head_dim": 12, "bias": True})
MOE = LLAMA_GQA.model_copy(update={"name": "moe", "num_experts": 3, "experts_per_token": 2})


@pytest.mark.parametrize("spec", [GPT2_LIKE, LLAMA_GQA, HEAD_DIM, MOE, *HARNESS_PRESETS.values()],
                         ids=lambda s: s.name)
def test_parameter_count_matches_hand_count(spec: ModelSpec) -> None:
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == _hand_count(spec)


def test_gpt2_like_count_is_the_known_number() -> None:
    # 50*24 + 40*24 + 3*(2*48 + 4*(24*24+24) + 24*96+96 + 96*24+24) + 48 = 23880
    assert _hand_count(GPT2_LIKE) == 23880
    assert sum(p.numel() for p in build_model(GPT2_LIKE).parameters()) == 23880


def test_registration_order_is_the_layout_contract() -> None:
    names = [name for name, _ in build_model(LLAMA_GQA).named_parameters()]
    assert names[0] == "embed.tok.weight"
    assert names[1:10] == [
        "blocks.0.attn_norm.weight", "blocks.0.attn.q.weight", "blocks.0.attn.k.weight",
        "blocks.0.attn.v.weight", "blocks.0.attn.o.weight", "blocks.0.mlp_norm.weight",
        "blocks.0.mlp.gate.weight", "blocks.0.mlp.up.weight", "blocks.0.mlp.down.weight",
    ]
    assert names[-2:] == ["head.norm.weight", "head.proj.weight"]
    gpt = [name for name, _ in build_model(GPT2_LIKE).named_parameters()]
    assert gpt[:2] == ["embed.tok.weight", "embed.pos.weight"]
    assert gpt[-2:] == ["head.norm.weight", "head.norm.bias"]  # tied: no head.proj


def test_tied_head_uses_the_embedding_table() -> None:
    model = build_model(GPT2_LIKE)
    tokens = torch.randint(0, GPT2_LIKE.vocab_size, (2, 8))
    next_token_loss(model(tokens), tokens).backward()
    # The token table receives gradient from both its uses; rows of unseen tokens only from the head.
    unseen = torch.ones(GPT2_LIKE.vocab_size, dtype=torch.bool)
    unseen[tokens.flatten()] = False
    assert model.embed.tok.weight.grad[unseen].abs().sum() > 0


def test_gqa_attention_is_causal() -> None:
    model = build_model(LLAMA_GQA).eval()
    tokens = torch.randint(0, LLAMA_GQA.vocab_size, (1, 10))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % LLAMA_GQA.vocab_size
    torch.testing.assert_close(model(tokens)[0, :-1], model(changed)[0, :-1])


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    tokens = torch.randint(0, MOE.vocab_size, (2, 8))
    grads = []
    for enabled in (False, True):
        model = build_model(MOE)
        model.set_activation_checkpointing(enabled)
        next_token_loss(model(tokens), tokens).backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(plain, recomputed)


def test_unknown_preset_is_a_one_line_error() -> None:
    with pytest.raises(ZeroplanError, match="model: unknown 'tiny-lama'.*tiny-llama"):
        harness_model("tiny-lama")


@pytest.mark.parametrize("field,value", [("qkv_bias", True), ("qk_norm", True), ("post_norms", True),
                                         ("attention_softcapping", True), ("mlp", "geglu")])
def test_build_model_refuses_unbuilt_fields(field: str, value: object) -> None:
    spec = ModelSpec(name="t", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, ffn_hidden_size=64, **{field: value})
    with pytest.raises(ZeroplanError, match=f"model.{field}"):
        build_model(spec)
