"""Mixture-of-experts models: parameter counts against transformers' own modules, active
parameters, and the config.json reader's MoE and MLA keys.

The records (tests/fixtures/moe_parameter_counts.json) are made by
benchmarks/moe_parameter_records.py: each fixture config.json instantiated by transformers 4.56.2
on the meta device and its named_parameters() counted by module type.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zeroplan.core.params import active_parameters, parameter_units, total_parameters
from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_config import load_hf_config, parse_hf_config
from zeroplan.specs import ModelSpec

FIXTURES = Path(__file__).parent / "fixtures"
RECORDS = json.loads((FIXTURES / "moe_parameter_counts.json").read_text())
MODELS = sorted(name for name in RECORDS if not name.startswith("torchtitan-"))

# The planner's tensor names (zeroplan.core.params) sorted into the records' categories.
_CATEGORIES = (
    (r"^token\.", "embedding"),
    (r"^lm_head\.", "lm_head"),
    (r"^final_norm\.", "final_norm"),
    (r"^attention\.", "attention"),
    (r"_norm\.", "norms"),
    (r"^mlp\.experts\.", "routed_experts"),
    (r"^mlp\.shared\.", "shared_experts"),
    (r"^mlp\.shared_gate\.", "shared_expert_gate"),
    (r"^mlp\.router\.", "router"),
    (r"^mlp\.(gate|up|down)\.", "dense_mlp"),
)


def _category(name: str) -> str:
    return next(label for pattern, label in _CATEGORIES if re.search(pattern, name))


def _spec(name: str) -> ModelSpec:
    return load_hf_config(FIXTURES / "hf" / f"{name}.json")


@pytest.mark.parametrize("name", MODELS)
def test_total_matches_transformers_to_the_element(name: str) -> None:
    assert total_parameters(_spec(name)) == RECORDS[name]["total_parameters"]


@pytest.mark.parametrize("name", MODELS)
def test_every_category_and_block_matches_transformers(name: str) -> None:
    spec = _spec(name)
    totals: dict[str, int] = {}
    for unit in parameter_units(spec):
        for tensor in unit.tensors:
            label = _category(tensor.name)
            totals[label] = totals.get(label, 0) + tensor.numel
    assert totals == RECORDS[name]["by_category"]
    blocks = [unit.numel for unit in parameter_units(spec) if unit.name.startswith("block.")]
    assert blocks == RECORDS[name]["per_layer"]


def test_mla_projection_shapes_match_deepseek_v3() -> None:
    spec = _spec("deepseek-v3")
    last = {t.name: list(t.shape) for t in parameter_units(spec)[-2].tensors}
    shapes = RECORDS["deepseek-v3"]["last_layer_shapes"]
    pairs = {"attention.q_a.weight": "self_attn.q_a_proj.weight", "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
             "attention.q_b.weight": "self_attn.q_b_proj.weight", "attention.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
             "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attention.kv_b.weight": "self_attn.kv_b_proj.weight",
             "attention.o.weight": "self_attn.o_proj.weight", "mlp.router.weight": "mlp.gate.weight",
             "mlp.shared.gate.weight": "mlp.shared_experts.gate_proj.weight"}
    for ours, theirs in pairs.items():
        assert last[ours] == shapes[theirs], ours


def test_deepseek_v3_router_bias_is_a_buffer_not_counted() -> None:
    # e_score_correction_bias: one per routed expert in each of the 58 MoE blocks, a buffer.
    assert RECORDS["deepseek-v3"]["non_rotary_buffer_elements"] == 58 * 256
    assert not _spec("deepseek-v3").parameter_count_exact  # the MTP block is named in the caveat


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "deepseek-v2-lite"])
def test_published_configs_are_exact(name: str) -> None:
    spec = _spec(name)
    assert spec.parameter_count_exact, spec.parameter_count_caveat


# Active parameters: everything but the (E - k) unused routed experts of each MoE block. The
# published figures: Mixtral 12.9B active (Mistral AI, "Mixtral of experts", 2024); Qwen1.5-MoE
# A2.7B; Qwen3-30B-A3B 3.3B; DeepSeek-V2-Lite 2.4B without embeddings (2.66B with the 0.21B
# embedding table); DeepSeek-V3 37B.
@pytest.mark.parametrize("name,active", [
    ("mixtral-8x7b", 12_879_925_248), ("qwen1.5-moe-a2.7b", 2_689_173_504), ("qwen3-30b-a3b", 3_353_032_704),
    ("deepseek-v2-lite", 2_661_150_208), ("deepseek-v3", 37_552_282_624),
])
def test_active_parameters(name: str, active: int) -> None:
    spec = _spec(name)
    record = RECORDS[name]
    routed = record["by_category"]["routed_experts"]
    unused = routed - routed * spec.experts_per_token // spec.num_experts
    assert active_parameters(spec) == record["total_parameters"] - unused == active


def test_deepseek_dense_first_blocks() -> None:
    spec = _spec("deepseek-v3")
    assert spec.first_dense_layers == 3 and spec.moe_layer_count == 58
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, False, False, True]


def _qwen_moe(**extra: object) -> dict[str, object]:
    return {"model_type": "qwen2_moe", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, **extra}


def test_qwen_sparse_step_and_mlp_only_layers() -> None:
    spec = parse_hf_config(_qwen_moe(decoder_sparse_step=2, mlp_only_layers=[3]), "q")
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


@pytest.mark.parametrize("config,field", [
    ({"model_type": "deepseek_v2", "moe_layer_freq": 2}, "config.moe_layer_freq"),
    ({"num_experts_per_tok": 9}, "model.experts_per_token"),
    ({"mlp_only_layers": [7]}, "model.dense_layers"),
    ({"moe_intermediate_size": "32"}, "config.moe_intermediate_size"),
])
def test_bad_moe_configs_are_refused_in_one_line(config: dict[str, object], field: str) -> None:
    base = _qwen_moe()
    if config.get("model_type") == "deepseek_v2":
        base = {**base, "model_type": "deepseek_v2", "n_routed_experts": 8, "kv_lora_rank": 16, "q_lora_rank": None}
        base.pop("num_experts")
        base.pop("shared_expert_intermediate_size")
    with pytest.raises(ZeroplanError, match=field):
        parse_hf_config({**base, **config}, "bad")


@pytest.mark.parametrize("update,field", [
    ({"moe_ffn_hidden_size": 64}, "model.moe_ffn_hidden_size"),
    ({"kv_lora_rank": 64}, "model.qk_rope_head_dim"),
    ({"qk_rope_head_dim": 32}, "model.qk_rope_head_dim"),
])
def test_spec_refuses_moe_and_mla_fields_out_of_place(update: dict[str, object], field: str) -> None:
    dense = dict(name="d", vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=128)
    with pytest.raises(ZeroplanError, match=field):
        ModelSpec(**dense, **update)


def test_capacity_factor_pads_each_expert_to_its_capacity() -> None:
    from zeroplan.core.activations import mlp_terms, routed_token_copies
    from zeroplan.specs import TrainingSpec

    spec = _spec("mixtral-8x7b")
    capped = spec.model_copy(update={"moe_capacity_factor": 1.25})
    # DeepSpeed-MoE: capacity = ceil(k x T x cf / E) = ceil(2 x 4096 x 1.25 / 8) = 1280 per expert.
    assert routed_token_copies(spec, 4096) == 2 * 4096
    assert routed_token_copies(capped, 4096) == 8 * 1280
    training = TrainingSpec()
    assert mlp_terms(capped, training, 4096, 1)["mlp_input"] * 4 == mlp_terms(spec, training, 4096, 1)["mlp_input"] * 5
