"""Gemma, Gemma 2 and Phi-3 configs, and count-changing keys the reader does not model.

Published totals: keras-hub keras_nlp/src/models/gemma/gemma_presets.py ("params") for Gemma and
Gemma 2; keras-hub phi3_presets.py and the Hugging Face API's safetensors count (NumWeights) for
microsoft/Phi-3-mini-4k-instruct. Fixtures are the published config.json values, by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core.activations import layer_bytes, norm_bytes
from zeroplan.core.params import parameter_units, total_parameters
from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_config import load_hf_config, parse_hf_config
from zeroplan.specs import MlpKind, TrainingSpec

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize(
    "fixture,total",
    [
        ("gemma-7b.json", 8_537_680_896),
        ("gemma-2-2b.json", 2_614_341_888),
        ("gemma-2-9b.json", 9_241_705_984),
        ("phi-3-mini-4k.json", 3_821_079_552),
        ("pythia-1.4b.json", 1_414_647_808),
        ("gpt-neox-20b.json", 20_554_567_680),
        ("phi-2.json", 2_779_683_840),
        ("phi-1_5.json", 1_418_270_720),
        ("bloom-560m.json", 559_214_592),
        ("bloom-7b1.json", 7_069_016_064),
        ("bert-base-uncased.json", 109_514_298),
        ("bert-large-uncased.json", 335_174_458),
    ],
)
def test_matches_published_total(fixture: str, total: int) -> None:
    spec = load_hf_config(FIXTURES / fixture)
    assert spec.parameter_count_exact and spec.parameter_count_caveat == ""
    assert total_parameters(spec) == total


def test_gemma_is_tied_geglu_with_its_own_head_dim() -> None:
    spec = load_hf_config(FIXTURES / "gemma-7b.json")
    assert spec.mlp is MlpKind.geglu and spec.tied_embeddings and not spec.post_norms and not spec.attention_softcapping
    assert spec.head_size == 256 != spec.hidden_size // spec.num_heads
    assert [u.name for u in parameter_units(spec)][-1] == "head"
    assert parameter_units(spec)[-1].numel == spec.hidden_size  # final norm only: the head is tied


def test_gemma_head_dim_defaults_to_256_like_gemma_config() -> None:
    config = json.loads((FIXTURES / "gemma-7b.json").read_text())
    del config["head_dim"]
    assert parse_hf_config(config, "g").head_size == 256


def test_gemma2_has_four_norms_per_block() -> None:
    spec = load_hf_config(FIXTURES / "gemma-2-9b.json")
    assert spec.post_norms and spec.norms_per_block == 4
    # Gemma2Config's attn_logit_softcapping (50.0 in the checkpoint; null turns it off).
    assert spec.attention_softcapping
    config = json.loads((FIXTURES / "gemma-2-9b.json").read_text())
    assert not parse_hf_config({**config, "attn_logit_softcapping": None}, "g").attention_softcapping
    plain = spec.model_copy(update={"post_norms": False})
    assert total_parameters(spec) - total_parameters(plain) == spec.num_layers * 2 * spec.hidden_size
    training = TrainingSpec()
    extra = layer_bytes(spec, training, 512, 2) - layer_bytes(plain, training, 512, 2)
    assert extra == 2 * norm_bytes(spec, training, 512, 2)


def test_phi3_counts_as_llama_layout() -> None:
    spec = load_hf_config(FIXTURES / "phi-3-mini-4k.json")
    config = json.loads((FIXTURES / "phi-3-mini-4k.json").read_text())
    as_llama = parse_hf_config({**config, "model_type": "llama", "original_max_position_embeddings": None}, "l")
    assert total_parameters(spec) == total_parameters(as_llama)


def _llama(**extra: object) -> dict[str, object]:
    return {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 2,
            "num_attention_heads": 32, "intermediate_size": 11008, **extra}


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"num_local_experts": 8}, "config.num_local_experts"),
        ({"num_experts": 64}, "config.num_experts"),
        ({"moe_intermediate_size": 1408}, "config.moe_intermediate_size"),
        ({"qk_layernorm": True}, "config.qk_layernorm"),
        ({"attention_bias": True}, "config.attention_bias"),
        ({"mlp_bias": True}, "config.mlp_bias"),
        ({"pruned_heads": {"0": [1]}}, "config.pruned_heads"),
    ],
)
def test_unmodelled_count_keys_are_refused(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ZeroplanError, match=field):
        parse_hf_config(_llama(**extra), "x")


def test_gemma_attention_bias_is_refused() -> None:
    config = json.loads((FIXTURES / "gemma-7b.json").read_text())
    with pytest.raises(ZeroplanError, match="config.attention_bias"):
        parse_hf_config({**config, "attention_bias": True}, "g")


def test_unknown_key_marks_the_count_inexact_and_names_it() -> None:
    spec = parse_hf_config(_llama(extra_adapter_rank=16), "x")
    assert not spec.parameter_count_exact
    assert "extra_adapter_rank" in spec.parameter_count_caveat
    assert parse_hf_config(_llama(rope_theta=5e5, torch_dtype="bfloat16"), "x").parameter_count_exact


def test_mixtral_reads_its_experts_with_mixtral_config_defaults() -> None:
    base = _llama(model_type="mixtral", num_key_value_heads=8, intermediate_size=14336)
    spec = parse_hf_config(base, "m")
    assert (spec.num_experts, spec.experts_per_token) == (8, 2)
    assert parse_hf_config({**base, "num_local_experts": 4}, "m").num_experts == 4


def test_inexact_spec_needs_a_reason() -> None:
    spec = parse_hf_config(_llama(), "x")
    with pytest.raises(ZeroplanError, match="parameter_count_caveat"):
        type(spec)(**{**spec.model_dump(), "parameter_count_exact": False})


def test_fit_output_cautions_an_inexact_count_in_one_line(tmp_path: Path, capsys) -> None:
    from zeroplan.cli.main import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_llama(extra_adapter_rank=16)))
    assert main(["fit", "--detail", str(path), "--gpus", "8", "--strategies", "zero3"]) == 0
    cautions = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Caution:")]
    assert len(cautions) == 1 and "extra_adapter_rank" in cautions[0]
    assert main(["fit", "--detail", str(path), "--strategies", "zero3", "--format", "json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["parameter_count_exact"] is False and "extra_adapter_rank" in model["parameter_count_caveat"]
    assert main(["compare", "--detail", str(path), "--strategies", "zero3"]) == 0
    assert "Caution:" in capsys.readouterr().out


def test_fit_output_has_no_caution_for_an_exact_count(capsys) -> None:
    from zeroplan.cli.main import main

    assert main(["fit", "--detail", str(FIXTURES / "gemma-2-9b.json"), "--strategies", "zero3", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "9,241,705,984 parameters" in out and "Caution:" not in out


@pytest.mark.parametrize("key,value,field", [
    ("tie_word_embeddings", "yes", "config.tie_word_embeddings"),
    ("rope_scaling", {"type": "banana", "factor": 8}, "config.rope_scaling"),
    ("rope_scaling", "linear", "config.rope_scaling"),
])
def test_config_values_are_not_coerced(tmp_path, capsys, key, value, field) -> None:
    # A string is no boolean, and a RoPE scaling transformers does not build is refused.
    import json as json_module

    from zeroplan.cli.main import main

    config = json_module.loads((Path(__file__).parent / "fixtures" / "hf" / "qwen2.5-7b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json_module.dumps({**config, key: value}))
    assert main(["fit", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {field}: " in err, err


def test_a_known_rope_scaling_is_read(tmp_path) -> None:
    import json as json_module

    from zeroplan.presets.hf_config import parse_hf_config

    config = json_module.loads((Path(__file__).parent / "fixtures" / "hf" / "qwen2.5-7b.json").read_text())
    parse_hf_config({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "x")


def test_a_config_too_deep_to_plan_in_seconds_is_refused(tmp_path, capsys) -> None:
    import json as json_module

    from zeroplan.cli.main import main

    config = json_module.loads((Path(__file__).parent / "fixtures" / "hf" / "qwen2.5-7b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json_module.dumps({**config, "num_hidden_layers": 2**24}))
    assert main(["fit", str(path)]) == 2
    assert "config.num_hidden_layers: must be at most 1,024" in capsys.readouterr().err


def test_gpt_neox_without_attention_biases_is_refused() -> None:
    config = json.loads((FIXTURES / "pythia-1.4b.json").read_text())
    with pytest.raises(ZeroplanError, match="config.attention_bias: gpt_neox without attention biases"):
        parse_hf_config({**config, "attention_bias": False}, "x")


def test_phis_parallel_block_keeps_one_norm_input_and_one_normed_copy() -> None:
    # PhiDecoderLayer: one LayerNorm, whose output both the QKV projections and fc1 read.
    from zeroplan.core.activations import layer_terms
    from zeroplan.specs import TrainingSpec

    phi = load_hf_config(FIXTURES / "phi-2.json")
    sequential = phi.model_copy(update={"parallel_block": False, "head_bias": False})
    training = TrainingSpec()
    s, b, e = 2048, 1, training.precision.compute_bytes
    parallel, plain = layer_terms(phi, training, s, b), layer_terms(sequential, training, s, b)
    assert plain["norm_inputs"] - parallel["norm_inputs"] == e * s * b * phi.hidden_size
    assert parallel["mlp_input"] == 0 and parallel["qkv_input"] == plain["mlp_input"]
    assert phi.norms_per_block == 1


def test_phi_with_query_key_norms_is_refused() -> None:
    config = json.loads((FIXTURES / "phi-2.json").read_text())
    with pytest.raises(ZeroplanError, match="config.qk_layernorm"):
        parse_hf_config({**config, "qk_layernorm": True}, "x")


def test_measure_refuses_a_phi_before_launching_any_rank(tmp_path, capsys) -> None:
    pytest.importorskip("torch")
    from zeroplan.cli.main import main

    out = tmp_path / "runs"
    assert main(["measure", str(FIXTURES / "phi-2.json"), "--strategy", "zero3", "--nproc", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.parallel_block" in err and not out.exists()


def test_bloom_plans_eager_attention_with_its_fp32_softmax(capsys) -> None:
    # BloomAttention: baddbmm scores, F.softmax(dtype=float32) (its fp32 output kept), then a
    # bf16 copy for the bmm with the values (kept too): 6 bytes a score, not the 2 of a bf16 softmax.
    from zeroplan.cli.main import main
    from zeroplan.core.activations import attention_core_terms
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.specs import AttentionKernel, BatchSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus

    bloom = load_hf_config(FIXTURES / "bloom-560m.json")
    request = PlanRequest(model=bloom, cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8), batch=BatchSpec(seq_len=2048),
                          strategy=StrategySpec(kind="zero3"))
    assert request.training.attention_kernel is AttentionKernel.eager  # the API defaults as the CLI does
    terms = attention_core_terms(bloom, request.training, 2048, 1)
    assert terms["softmax_output"] == (4 + 2) * bloom.num_heads * 2048 * 2048
    with pytest.raises(ZeroplanError, match="training.attention_kernel"):
        PlanRequest(model=bloom, cluster=request.cluster, batch=BatchSpec(seq_len=2048), strategy=request.strategy,
                    training=TrainingSpec(attention_kernel=AttentionKernel.flash))
    assert main(["fit", "--detail", str(FIXTURES / "bloom-560m.json"), "--gpus", "8"]) == 0
    assert "eager attention" in capsys.readouterr().out
    assert main(["fit", "--detail", str(FIXTURES / "bloom-560m.json"), "--attention", "flash"]) == 2
    assert "--attention eager" in capsys.readouterr().err


def test_bloom_keeps_its_embedding_norms_input() -> None:
    from zeroplan.core.activations import outside_layers_bytes
    from zeroplan.specs import TrainingSpec

    bloom = load_hf_config(FIXTURES / "bloom-560m.json")
    training = TrainingSpec(attention_kernel="eager")
    without = bloom.model_copy(update={"embedding_norm": False})
    assert outside_layers_bytes(bloom, training, 2048, 1) - outside_layers_bytes(without, training, 2048, 1) == 2 * 2048 * 1024


@pytest.mark.parametrize("model", ["gpt2-xl", "bloom-560m.json", "phi-2.json"])
def test_torchtune_refuses_a_model_it_has_no_builder_for(capsys, model) -> None:
    from zeroplan.cli.main import main

    target = str(FIXTURES / model) if model.endswith(".json") else model
    assert main(["fit", target, "--framework", "torchtune", "--gpus", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "torchtune 0.6.1 builds" in err


def test_bert_is_an_encoder_whose_attention_computes_every_score(capsys) -> None:
    from zeroplan.cli.main import main
    from zeroplan.core.flops import executed_causal_fraction
    from zeroplan.specs import AttentionKernel

    bert = load_hf_config(FIXTURES / "bert-base-uncased.json")
    assert not bert.causal and bert.token_types == 2 and bert.head_transform and bert.head_bias and bert.tied_embeddings
    assert executed_causal_fraction(AttentionKernel.flash, causal=False) == 2 * executed_causal_fraction(AttentionKernel.flash) == 1.0
    assert main(["fit", "--detail", str(FIXTURES / "bert-base-uncased.json"), "--gpus", "8"]) == 0
    assert "an encoder with a masked-LM head" in capsys.readouterr().out


def test_bert_with_other_heads_is_counted_as_masked_lm_with_a_caution() -> None:
    config = json.loads((FIXTURES / "bert-base-uncased.json").read_text())
    spec = parse_hf_config({**config, "architectures": ["BertForSequenceClassification"]}, "x")
    assert not spec.parameter_count_exact and "counted as BertForMaskedLM" in spec.parameter_count_caveat
    with pytest.raises(ZeroplanError, match="config.position_embedding_type"):
        parse_hf_config({**config, "position_embedding_type": "relative_key"}, "x")


@pytest.mark.parametrize("fixture, model_class, config_class", [
    ("pythia-1.4b.json", "GPTNeoXForCausalLM", "GPTNeoXConfig"), ("gpt-neox-20b.json", "GPTNeoXForCausalLM", "GPTNeoXConfig"),
    ("phi-2.json", "PhiForCausalLM", "PhiConfig"), ("phi-1_5.json", "PhiForCausalLM", "PhiConfig"),
    ("bloom-560m.json", "BloomForCausalLM", "BloomConfig"), ("bloom-7b1.json", "BloomForCausalLM", "BloomConfig"),
    ("bert-base-uncased.json", "BertForMaskedLM", "BertConfig"), ("bert-large-uncased.json", "BertForMaskedLM", "BertConfig"),
])
def test_counts_equal_what_transformers_builds(fixture: str, model_class: str, config_class: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = json.loads((FIXTURES / fixture).read_text())
    with torch.device("meta"):
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    assert total_parameters(load_hf_config(FIXTURES / fixture)) == sum(p.numel() for p in model.parameters())


def test_hf_cautions_when_its_llama_measured_terms_plan_another_layout(capsys) -> None:
    from zeroplan.cli.main import main

    assert main(["fit", str(FIXTURES / "phi-2.json"), "--framework", "hf", "--gpus", "8"]) == 0
    assert "measured on transformers' Llama" in capsys.readouterr().out
    assert main(["fit", "llama-3.1-8b", "--framework", "hf", "--gpus", "8"]) == 0
    assert "measured on transformers' Llama" not in capsys.readouterr().out
