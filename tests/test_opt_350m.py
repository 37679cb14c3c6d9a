"""OPT-350m's layout (ModelSpec.embedding_projection, final_norm; zeroplan.presets.hf_families
opt_spec): post-norm blocks without a final norm, a 512-wide embedding joined to the 1024-wide
blocks by project_in / project_out. The parameter count against transformers' own OPTForCausalLM
on the meta device is tests/test_hf_families.py META_COUNTS."""

from __future__ import annotations

import json
from pathlib import Path

from zeroplan.core.activations import outside_layers_bytes
from zeroplan.core.params import parameter_units
from zeroplan.presets.hf_config import load_hf_config, parse_hf_config
from zeroplan.specs.training import TrainingSpec

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"


def test_opt_350m_reads_its_projection_and_no_final_norm():
    model = load_hf_config(FIXTURES / "opt-350m.json")
    assert (model.embedding_projection, model.final_norm) == (512, False)
    embedding, *_, head = parameter_units(model)
    assert {t.name: t.shape for t in embedding.tensors}["project_in.weight"] == (1024, 512)
    assert {t.name: t.shape for t in head.tensors} == {"project_out.weight": (512, 1024)}  # lm_head tied, no norm


def test_pre_norm_opt_keeps_its_layout():
    model = load_hf_config(FIXTURES / "opt-1.3b.json")
    assert (model.embedding_projection, model.final_norm) == (0, True)
    assert "project_out.weight" not in {t.name for t in parameter_units(model)[-1].tensors}


def test_outside_the_blocks_the_projections_replace_the_final_norm():
    # benchmarks/opt_release_attention.py --opt-350m: the blocks save the same bytes either way;
    # outside them project_out keeps the last block's output where the final norm kept its input,
    # and project_in and the head each keep a p-wide tensor.
    config = json.loads((FIXTURES / "opt-350m.json").read_text())
    post = parse_hf_config(config, "post")
    pre = parse_hf_config({**config, "do_layer_norm_before": True, "word_embed_proj_dim": 1024}, "pre")
    training = TrainingSpec(precision="fp16-mixed", framework="hf")
    s, b, e = 512, 8, 2
    from zeroplan.core.activations import norm_bytes

    difference = outside_layers_bytes(post, training, s, b) - outside_layers_bytes(pre, training, s, b)
    assert difference == 2 * e * s * b * 512 - norm_bytes(pre, training, s, b)


def test_opt_350m_head_flops_are_its_narrow_projection_and_project_in_out():
    from zeroplan.core.flops import head_forward_flops_per_token

    model = load_hf_config(FIXTURES / "opt-350m.json")
    assert head_forward_flops_per_token(model) == 2 * (512 * model.vocab_size + 2 * 1024 * 512)
