"""Presets added for the published-memory rows (falcon-7b, stablelm-base-alpha-3b, yi-34b):
their counts against what transformers builds from each model's config.json.

META_COUNTS are sum(p.numel() for p in model.parameters()) of
AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)) built under
torch.device("meta") with transformers 4.56.2, config = tests/fixtures/hf/<name>.json (each
model's published config.json); test_meta_counts_are_what_transformers_builds measures them again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core.params import parameter_units, total_parameters
from zeroplan.presets.hf_config import load_hf_config
from zeroplan.presets.models import get_model
from tests.transformers_meta import meta_parameter_count

FIXTURES = Path(__file__).parent / "fixtures" / "hf"

META_COUNTS = {
    "falcon-7b": 6_921_720_704,
    "stablelm-base-alpha-3b": 3_637_321_728,
    "yi-34b": 34_388_917_248,
}


@pytest.mark.parametrize("name,count", sorted(META_COUNTS.items()))
def test_preset_counts_equal_the_meta_device_counts(name: str, count: int) -> None:
    spec = get_model(name)
    assert spec.parameter_count_exact
    assert total_parameters(spec) == count


@pytest.mark.parametrize("name", ["stablelm-base-alpha-3b", "yi-34b"])
def test_preset_is_what_the_config_reader_makes_of_its_config(name: str) -> None:
    # gpt_neox and llama configs are read by zeroplan.presets.hf_config: the preset and the
    # fixture read as a file are the same architecture (the name aside).
    spec = get_model(name)
    read = load_hf_config(FIXTURES / f"{name}.json")
    assert read.model_copy(update={"name": spec.name}) == spec


def test_falcon_is_a_multi_query_parallel_block_with_one_biased_layernorm() -> None:
    spec = get_model("falcon-7b")
    assert spec.kv_heads == 1 and spec.parallel_block and spec.norms_per_block == 1
    assert not spec.bias and spec.tied_embeddings
    block = next(u for u in parameter_units(spec) if u.name.startswith("block"))
    h, kv = spec.hidden_size, spec.kv_size
    # query_key_value (h -> h + 2 kv), dense (h -> h), dense_h_to_4h and dense_4h_to_h, no
    # biases; input_layernorm weight and bias.
    assert block.numel == h * (h + 2 * kv) + h * h + 2 * h * 4 * h + 2 * h


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(META_COUNTS))
def test_meta_counts_are_what_transformers_builds(name: str) -> None:
    assert meta_parameter_count(json.loads((FIXTURES / f"{name}.json").read_text())) == META_COUNTS[name]
