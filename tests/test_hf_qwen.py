"""Qwen2 q/k/v biases and Qwen3 q/k norms are counted (published totals from the model cards)."""

from __future__ import annotations

from pathlib import Path

from zeroplan.core.params import total_parameters
from zeroplan.presets.hf_config import load_hf_config

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def test_qwen25_7b_matches_published_total() -> None:
    # Qwen/Qwen2.5-7B model card / safetensors index: 7,615,616,512 parameters.
    spec = load_hf_config(FIXTURES / "qwen2.5-7b.json")
    assert spec.qkv_bias and not spec.bias and not spec.qk_norm
    assert total_parameters(spec) == 7_615_616_512


def test_qwen25_7b_bias_is_q_k_v_widths() -> None:
    spec = load_hf_config(FIXTURES / "qwen2.5-7b.json")
    unbiased = spec.model_copy(update={"qkv_bias": False})
    assert total_parameters(spec) - total_parameters(unbiased) == spec.num_layers * (spec.q_size + 2 * spec.kv_size)


def test_qwen3_8b_matches_published_total() -> None:
    # Qwen/Qwen3-8B safetensors index: 8,190,735,360 parameters.
    spec = load_hf_config(FIXTURES / "qwen3-8b.json")
    assert spec.qk_norm and not spec.qkv_bias
    assert total_parameters(spec) == 8_190_735_360
    plain = spec.model_copy(update={"qk_norm": False})
    assert total_parameters(spec) - total_parameters(plain) == spec.num_layers * 2 * spec.head_size
