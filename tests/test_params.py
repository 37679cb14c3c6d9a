"""Exact parameter counts of the presets, against published figures."""

from __future__ import annotations

import json

import pytest

from zeroplan.core.params import active_parameters, largest_unit_parameters, parameter_units, total_parameters
from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_config import load_hf_config, parse_hf_config
from zeroplan.presets.models import get_model, model_names

# Counts printed by transformers' model.num_parameters() for the published checkpoints
# (model cards and the Llama-2 / Llama-3 papers' configs); GPT-2's 124,439,808 is the
# well-known count of openai-community/gpt2 with its tied head counted once.
EXACT_COUNTS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("name,count", sorted(EXACT_COUNTS.items()))
def test_exact_parameter_counts(name: str, count: int) -> None:
    assert total_parameters(get_model(name)) == count


def test_gpt3_is_175b() -> None:
    # Brown et al. 2020 Table 2.1 rounds to 175.0B.
    assert round(total_parameters(get_model("gpt3-175b")) / 1e9, 1) == 174.6


def test_mixtral_active_parameters() -> None:
    # Mistral AI's announcement: 12.9B active parameters per token of 46.7B.
    assert active_parameters(get_model("mixtral-8x7b")) == 12_879_925_248
    assert active_parameters(get_model("llama-2-7b")) == total_parameters(get_model("llama-2-7b"))


def test_units_are_embedding_blocks_head() -> None:
    model = get_model("llama-2-7b")
    units = parameter_units(model)
    assert [u.name for u in units[:2]] == ["embedding", "block.0"]
    assert units[-1].name == "head" and len(units) == model.num_layers + 2
    assert largest_unit_parameters(model) == units[1].numel == 202_383_360


def test_tied_head_has_no_output_matrix() -> None:
    head = parameter_units(get_model("gpt2"))[-1]
    assert [t.name for t in head.tensors] == ["final_norm.weight", "final_norm.bias"]


def test_every_preset_resolves_case_insensitively() -> None:
    for name in model_names():
        assert get_model(name.upper()).name == name


def test_a_preset_is_built_once_when_first_asked_for() -> None:
    assert get_model("llama-2-70b") is get_model("LLAMA-2-70B")


def test_unknown_model_suggests_close_match() -> None:
    with pytest.raises(ZeroplanError) as caught:
        get_model("llama-2-7")
    message = str(caught.value)
    assert message.startswith("model: unknown 'llama-2-7'") and "llama-2-7b" in message
    assert "\n" not in message


LLAMA_2_7B_CONFIG = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}
GPT2_CONFIG = {
    "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
    "n_positions": 1024, "n_inner": None, "attn_pdrop": 0.1, "resid_pdrop": 0.1,
}


def test_hf_config_file_matches_preset(tmp_path) -> None:
    path = tmp_path / "Llama-2-7b-hf" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA_2_7B_CONFIG))
    spec = get_model(str(path))
    assert spec.name == "Llama-2-7b-hf"
    assert total_parameters(spec) == EXACT_COUNTS["llama-2-7b"]
    assert total_parameters(parse_hf_config(GPT2_CONFIG, "gpt2")) == EXACT_COUNTS["gpt2"]


def test_hf_config_mixtral_reads_experts() -> None:
    config = dict(LLAMA_2_7B_CONFIG, model_type="mixtral", num_key_value_heads=8, intermediate_size=14336,
                  num_local_experts=8, num_experts_per_tok=2)
    assert total_parameters(parse_hf_config(config, "mixtral")) == EXACT_COUNTS["mixtral-8x7b"]


@pytest.mark.parametrize(
    "text,field",
    [
        ("{not json", "model"),
        ("[1, 2]", "config"),
        (json.dumps({"vocab_size": 10}), "config.model_type"),
        (json.dumps(dict(LLAMA_2_7B_CONFIG, model_type="longt5")), "config.model_type"),
        (json.dumps({k: v for k, v in LLAMA_2_7B_CONFIG.items() if k != "hidden_size"}), "config.hidden_size"),
        (json.dumps(dict(LLAMA_2_7B_CONFIG, num_attention_heads=31)), "model.num_heads"),
        (json.dumps(dict(LLAMA_2_7B_CONFIG, vocab_size=-1)), "config.vocab_size"),
    ],
)
def test_malformed_config_is_one_line_error(tmp_path, text: str, field: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ZeroplanError) as caught:
        load_hf_config(path)
    assert caught.value.field == field
    assert "\n" not in str(caught.value)


def test_missing_config_file() -> None:
    with pytest.raises(ZeroplanError) as caught:
        get_model("/nonexistent/config.json")
    assert caught.value.field == "model"
