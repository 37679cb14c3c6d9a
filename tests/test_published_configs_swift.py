"""The config.json files written for the ms-swift rows of benchmarks/published_memory/rows.csv:
Qwen-1 (1.8B, 7B, 14B, 72B) in the shapes of transformers' Qwen2 (c_attn = q, k, v with bias;
attention c_proj, w1, w2 and the MLP's c_proj unbiased; untied head), Yi-6B as llama. Their
counts against zeroplan's reader and, where transformers is installed, its meta-device build.

Qwen-7B's 7,721,324,544 is the count ms-swift's own benchmark page prints for a full fine-tune
(docs/source/LLM/Benchmark.md @4312aeb, "7721.3245(100.0000%)" trainable); the others are
sum(p.numel()) of AutoModelForCausalLM.from_config under torch.device("meta"), transformers
4.56.2, and the published model cards' counts (Qwen-1.8B 1.84 B, Qwen-14B 14.2 B, Qwen-72B 72.3 B,
Yi-6B 6.06 B)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.transformers_meta import meta_parameter_count
from zeroplan.core.params import total_parameters
from zeroplan.presets.hf_config import load_hf_config

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "published_memory" / "configs"

COUNTS = {
    "qwen-1_8b-chat": 1_836_828_672,
    "qwen-7b-chat": 7_721_324_544,
    "qwen-14b-chat": 14_167_290_880,
    "qwen-72b-chat": 72_287_920_128,
    "yi-6b-chat": 6_061_035_520,
}


@pytest.mark.parametrize("name,count", sorted(COUNTS.items()))
def test_config_reads_to_the_published_count(name: str, count: int) -> None:
    assert total_parameters(load_hf_config(CONFIGS / f"{name}.json")) == count


def test_qwen1_attention_is_biased_and_the_head_untied() -> None:
    spec = load_hf_config(CONFIGS / "qwen-7b-chat.json")
    assert spec.qkv_bias and not spec.bias and not spec.tied_embeddings
    assert spec.kv_heads == spec.num_heads == 32


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COUNTS))
def test_counts_are_what_transformers_builds(name: str) -> None:
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    assert meta_parameter_count(config) == COUNTS[name]
