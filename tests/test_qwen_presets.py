"""Qwen presets (Qwen-1, Qwen2/2.5, Qwen3) and yi-6b, added for the ms-swift rows of
benchmarks/published_memory/rows.csv and the Qwen fine-tunes people plan: their counts against
transformers' own build of each config on the meta device (transformers 4.56.2).

COUNTS are sum(p.numel()) of AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
under torch.device("meta"), config = zeroplan.presets.models._QWEN_CONFIGS[name];
test_counts_are_what_transformers_builds measures them again. They agree with the published
cards (Qwen2.5: 0.49, 1.54, 3.09, 7.62, 14.7, 32.8, 72.7 B; Qwen3 0.6B to 32B, 1.7B tied: 1.72 B,
1.4 B without embeddings), and Qwen-7B's 7,721,324,544 is what ms-swift's benchmark page prints
for its full fine-tune (docs/source/LLM/Benchmark.md @4312aeb, "7721.3245(100.0000%)")."""

from __future__ import annotations

import pytest

from tests.transformers_meta import meta_parameter_count
from zeroplan.core.params import total_parameters
from zeroplan.presets.models import _QWEN_CONFIGS, get_model

COUNTS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "qwen-1.8b": 1_836_828_672,
    "qwen-7b": 7_721_324_544,
    "qwen-14b": 14_167_290_880,
    "qwen-72b": 72_287_920_128,
    "yi-6b": 6_061_035_520,
}


def test_every_added_preset_has_its_count() -> None:
    assert set(COUNTS) == set(_QWEN_CONFIGS)


@pytest.mark.parametrize("name,count", sorted(COUNTS.items()))
def test_preset_counts_equal_the_meta_device_counts(name: str, count: int) -> None:
    spec = get_model(name)
    assert spec.parameter_count_exact
    assert total_parameters(spec) == count


def test_qwen1_is_an_untied_multi_head_qwen2_and_the_aliases_name_their_shapes() -> None:
    spec = get_model("qwen-7b")
    assert spec.qkv_bias and not spec.bias and not spec.tied_embeddings
    assert spec.kv_heads == spec.num_heads == 32
    assert get_model("qwen2.5-0.5b").tied_embeddings and not get_model("qwen2.5-7b").tied_embeddings
    assert get_model("qwen2-7b") == get_model("qwen2.5-7b")
    assert get_model("Qwen-1_8B") == get_model("qwen-1.8b")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COUNTS))
def test_counts_are_what_transformers_builds(name: str) -> None:
    assert meta_parameter_count(dict(_QWEN_CONFIGS[name])) == COUNTS[name]
