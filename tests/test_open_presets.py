"""Presets of open decoder families read from their published config.json
(zeroplan.presets.models._OPEN_CONFIGS): LLaMA-1, Llama-3.2, Code Llama, Mistral-7B-v0.3,
Mixtral-8x22B, Gemma and Gemma 2, Phi-1.5/2/3-mini, OPT, BLOOM, Falcon-40B, GPT-J, GPT-NeoX-20B,
Pythia, MPT-7B, StarCoder and StarCoder2, DeepSeek-V2-Lite, Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B; and
the Hugging Face hub ids every preset answers to.

META_COUNTS are sum(p.numel()) of AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
under torch.device("meta") with transformers 4.56.2, config = _OPEN_CONFIGS[name];
test_counts_are_what_transformers_builds measures them again. Where the repository holds a copy of
the published config.json (tests/fixtures/hf, benchmarks/published_memory/configs), the preset is
what the config reader makes of that file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.transformers_meta import meta_parameter_count
from zeroplan.core.params import total_parameters
from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_config import load_hf_config
from zeroplan.presets.models import _HUB_IDS, _OPEN_CONFIGS, get_model, model_names

ROOT = Path(__file__).resolve().parents[1]

META_COUNTS = {
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-33b": 32_528_943_616,
    "llama-65b": 65_285_660_672,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "codellama-7b": 6_738_546_688,
    "codellama-13b": 13_016_028_160,
    "codellama-34b": 33_743_970_304,
    "mistral-7b-v0.3": 7_248_023_552,
    "mixtral-8x22b": 140_620_634_112,
    "gemma-2b": 2_506_172_416,
    "gemma-7b": 8_537_680_896,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-2-27b": 27_227_128_320,
    "phi-1.5": 1_418_270_720,
    "phi-2": 2_779_683_840,
    "phi-3-mini-4k": 3_821_079_552,
    "opt-125m": 125_239_296,
    "opt-350m": 331_196_416,
    "opt-1.3b": 1_315_758_080,
    "opt-2.7b": 2_651_596_800,
    "opt-6.7b": 6_658_473_984,
    "opt-13b": 12_853_473_280,
    "opt-30b": 29_974_540_288,
    "opt-66b": 65_719_701_504,
    "bloom-560m": 559_214_592,
    "bloom-1b1": 1_065_314_304,
    "bloom-1b7": 1_722_408_960,
    "bloom-3b": 3_002_557_440,
    "bloom-7b1": 7_069_016_064,
    "bloom-176b": 176_247_271_424,
    "falcon-40b": 41_303_293_952,
    "gpt-j-6b": 6_050_882_784,
    "gpt-neox-20b": 20_554_567_680,
    "pythia-70m": 70_426_624,
    "pythia-160m": 162_322_944,
    "pythia-410m": 405_334_016,
    "pythia-1b": 1_011_781_632,
    "pythia-1.4b": 1_414_647_808,
    "pythia-2.8b": 2_775_208_960,
    "pythia-6.9b": 6_857_302_016,
    "pythia-12b": 11_846_072_320,
    "mpt-7b": 6_649_286_656,
    "starcoder": 15_517_456_384,
    "starcoder2-3b": 3_030_371_328,
    "starcoder2-7b": 7_173_923_840,
    "starcoder2-15b": 15_957_889_024,
    "deepseek-v2-lite": 15_706_484_224,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    "qwen3-30b-a3b": 30_532_122_624,
}

HF = ROOT / "tests" / "fixtures" / "hf"
PUBLISHED = ROOT / "benchmarks" / "published_memory" / "configs"
COPIES = {
    "gemma-2b": PUBLISHED / "gemma-2b.json", "llama-3.2-1b": PUBLISHED / "llama-3.2-1b.json",
    "llama-3.2-3b": PUBLISHED / "llama-3.2-3b.json", "phi-1.5": HF / "phi-1_5.json",
    **{name: HF / f"{name}.json" for name in (
        "gemma-7b", "gemma-2-2b", "gemma-2-9b", "phi-2", "phi-3-mini-4k", "opt-350m", "opt-1.3b", "bloom-560m",
        "bloom-7b1", "falcon-40b", "gpt-j-6b", "gpt-neox-20b", "pythia-1.4b", "mpt-7b", "starcoder", "starcoder2-3b",
        "deepseek-v2-lite", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b")},
}
# tests/fixtures/hf/starcoder2-3b.json holds only bigcode/starcoder2-3b's shape keys; the preset
# also carries the published attention_dropout and residual_dropout (0.1).
NOT_IN_THE_COPY = {"starcoder2-3b": {"attention_dropout": 0.1, "hidden_dropout": 0.1}}


def test_every_added_preset_has_its_count_and_is_listed() -> None:
    assert set(META_COUNTS) == set(_OPEN_CONFIGS)
    assert set(_OPEN_CONFIGS) <= set(model_names())


@pytest.mark.parametrize("name,count", sorted(META_COUNTS.items()))
def test_preset_counts_equal_the_meta_device_counts(name: str, count: int) -> None:
    spec = get_model(name)
    assert spec.parameter_count_exact, spec.parameter_count_caveat
    assert total_parameters(spec) == count


@pytest.mark.parametrize("name", sorted(COPIES))
def test_preset_is_what_the_config_reader_makes_of_the_published_config(name: str) -> None:
    read = load_hf_config(COPIES[name])
    assert read.model_copy(update={"name": name, **NOT_IN_THE_COPY.get(name, {})}) == get_model(name)


def test_family_mechanisms_come_from_the_reader() -> None:
    gemma, gemma2 = get_model("gemma-7b"), get_model("gemma-2-27b")
    assert gemma.norm_scales_fp32 and gemma.tied_embeddings and not gemma.post_norms
    assert gemma2.post_norms and gemma2.attention_softcapping and gemma2.head_size == 128
    assert get_model("phi-2").parallel_block and get_model("phi-2").hidden_dropout == 0.1
    assert get_model("falcon-40b").parallel_residual and get_model("falcon-40b").kv_heads == 8
    assert get_model("bloom-176b").fused_qkv and get_model("bloom-176b").embedding_norm
    assert get_model("opt-350m").embedding_projection == 512 and not get_model("opt-350m").final_norm
    assert get_model("pythia-70m").parallel_residual and get_model("pythia-12b").vocab_size == 50688
    assert get_model("starcoder2-15b").tied_embeddings is False and get_model("starcoder2-7b").tied_embeddings
    assert get_model("codellama-34b").kv_heads == 8 and get_model("codellama-7b").vocab_size == 32016


@pytest.mark.parametrize("hub_id,name", [(hub_id, name) for name, hub_ids in sorted(_HUB_IDS.items()) for hub_id in hub_ids])
def test_hub_ids_name_their_preset_in_any_case(hub_id: str, name: str) -> None:
    assert get_model(hub_id) is get_model(name)
    assert get_model(hub_id.upper()) is get_model(name)


def test_every_preset_has_a_hub_id_but_the_paper_shapes() -> None:
    # gpt3-175b is Brown et al.'s table; no config.json on the hub holds it.
    assert set(model_names()) - set(_HUB_IDS) == {"gpt3-175b"}


@pytest.mark.parametrize("typed,preset", [
    ("meta-llama/Llama-2-7b-hf", "llama-2-7b"), ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"),
    ("mistralai/Mistral-7B-v0.1", "mistral-7b"), ("Qwen/Qwen2.5-7B", "qwen2.5-7b"), ("huggyllama/llama-65b", "llama-65b"),
    ("google/gemma-7b", "gemma-7b"), ("microsoft/phi-2", "phi-2"), ("facebook/opt-13b", "opt-13b"),
    ("bigscience/bloom-7b1", "bloom-7b1"), ("tiiuae/falcon-7b", "falcon-7b"), ("EleutherAI/gpt-neox-20b", "gpt-neox-20b"),
    ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "tinyllama-1.1b"), ("llama-30b", "llama-33b"),
    ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"), ("google/gemma-2-9b-it", "gemma-2-9b"),
])
def test_names_users_type(typed: str, preset: str) -> None:
    assert get_model(typed).name == preset


@pytest.mark.parametrize("typed,suggested", [
    ("llama-65", "llama-65b"), ("gemma7b", "gemma-7b"), ("phi2", "phi-2"), ("opt13b", "opt-13b"),
    ("bloom-7b", "bloom-7b1"), ("codellama-34", "codellama-34b"),
    ("meta-llama/llama-2-7b-hff", "meta-llama/Llama-2-7b-hf"),
])
def test_unknown_model_is_one_short_line_with_close_matches(typed: str, suggested: str) -> None:
    with pytest.raises(ZeroplanError) as caught:
        get_model(typed)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 300
    assert f"did you mean {suggested!r}" in message or f", {suggested!r}" in message
    assert "`zeroplan models`" in message and "config.json" in message


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(META_COUNTS))
def test_counts_are_what_transformers_builds(name: str) -> None:
    assert meta_parameter_count(dict(_OPEN_CONFIGS[name])) == META_COUNTS[name]
