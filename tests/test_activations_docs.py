"""docs/memory-model.md's activation table is what zeroplan.core.activations.layer_terms computes.

Each table row names a term, its bytes per token as a formula, and the condition under which it
counts; this test evaluates every row and compares it with the code, term by term, so that the
docs and the code cannot drift apart silently.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zeroplan.core.activations import LAYER_TERMS, layer_terms
from zeroplan.presets.hf_config import load_hf_config
from zeroplan.presets.models import get_model
from zeroplan.specs import AttentionKernel, Kernels, ModelSpec, NormKind, Precision, TrainingSpec

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "memory-model.md"

# The "when" column: a comma-separated conjunction of these conditions.
CONDITIONS = {
    "always": lambda m, t: True,
    "LayerNorm": lambda m, t: m.norm is NormKind.layernorm,
    "RMSNorm": lambda m, t: m.norm is NormKind.rmsnorm,
    "cuda kernels": lambda m, t: t.kernels is Kernels.cuda,
    "cpu kernels": lambda m, t: t.kernels is Kernels.cpu,
    "eager attention": lambda m, t: t.attention_kernel is AttentionKernel.eager,
    "flash attention": lambda m, t: t.attention_kernel is AttentionKernel.flash,
    "sdpa-masked attention": lambda m, t: t.attention_kernel is AttentionKernel.sdpa_masked,
    "attention dropout > 0": lambda m, t: m.attention_dropout > 0,
    "hidden dropout > 0": lambda m, t: m.hidden_dropout > 0,
    "GeLU MLP": lambda m, t: not m.mlp.gated,
    "gated MLP": lambda m, t: m.mlp.gated,
    "mixture of experts": lambda m, t: m.is_moe,
    "shared expert": lambda m, t: m.shared_expert_ffn_hidden_size > 0,
    "shared expert gate": lambda m, t: m.shared_expert_gate,
    "MLA": lambda m, t: m.is_mla,
    "MLA query latent": lambda m, t: m.q_lora_rank is not None,
    "per-head q/k RMSNorm (Qwen3)": lambda m, t: m.qk_norm,
}


def _rows() -> list[tuple[str, str, str]]:
    text = DOC.read_text(encoding="utf-8")
    table = text.split("<!-- activation-terms:start -->")[1].split("<!-- activation-terms:end -->")[0]
    rows = []
    for line in table.strip().splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows.append((cells[0].strip("`"), cells[1], cells[2]))
    return rows


def _applies(when: str, model: ModelSpec, training: TrainingSpec) -> bool:
    return all(CONDITIONS[part.strip()](model, training) for part in when.split(","))


def _per_token(formula: str, model: ModelSpec, training: TrainingSpec, s: int) -> int:
    symbols = {
        "n": model.norms_per_block, "e": training.precision.compute_bytes, "h": model.hidden_size,
        "a": model.num_heads, "d": model.head_size, "kv": model.kv_heads, "s": s,
        "k": model.experts_per_token, "E": model.num_experts,
        "f": model.expert_ffn_hidden_size if model.is_moe else model.ffn_hidden_size,
        "dv": model.v_head_size, "fs": model.shared_expert_ffn_hidden_size,
        "cq": model.q_lora_rank or 0, "ckv": model.kv_lora_rank or 0,
    }
    expression = formula.replace("·", "*")
    assert re.fullmatch(r"[\w\s*+()\-]+", expression), formula
    return eval(expression, {"__builtins__": {}}, symbols)  # noqa: S307 - the docs' own arithmetic


def _models() -> list[ModelSpec]:
    dropout_moe = get_model("mixtral-8x7b").model_copy(update={"attention_dropout": 0.1, "hidden_dropout": 0.1})
    return [
        get_model("gpt2"), get_model("llama-2-7b"), get_model("mixtral-8x7b"), dropout_moe,
        load_hf_config(ROOT / "tests" / "fixtures" / "hf" / "gemma-2-9b.json"),
        load_hf_config(ROOT / "tests" / "fixtures" / "hf" / "qwen1.5-moe-a2.7b.json"),
        load_hf_config(ROOT / "tests" / "fixtures" / "hf" / "deepseek-v3.json"),
        load_hf_config(ROOT / "tests" / "fixtures" / "hf" / "qwen3-30b-a3b.json"),
        get_model("gpt2").model_copy(update={"attention_dropout": 0.0, "hidden_dropout": 0.0}),
    ]


TRAININGS = [
    TrainingSpec(attention_kernel=kernel, precision=precision, kernels=kernels)
    for kernel in AttentionKernel for precision in (Precision.bf16_mixed, Precision.fp32) for kernels in Kernels
]


def test_table_names_exactly_the_code_terms() -> None:
    names = [name for name, _, _ in _rows()]
    assert set(names) == set(LAYER_TERMS)
    for _, _, when in _rows():
        assert all(part.strip() in CONDITIONS for part in when.split(",")), when


@pytest.mark.parametrize("training", TRAININGS, ids=lambda t: f"{t.attention_kernel.value}-{t.precision.value}-{t.kernels.value}")
@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_every_row_is_what_the_code_computes(model: ModelSpec, training: TrainingSpec) -> None:
    s, b = 384, 3
    terms = layer_terms(model, training, s, b)
    for name in LAYER_TERMS:
        rows = [(formula, when) for row_name, formula, when in _rows() if row_name == name]
        applicable = [formula for formula, when in rows if _applies(when, model, training)]
        documented = sum(_per_token(formula, model, training, s) * s * b for formula in applicable)
        assert len(applicable) <= 1, (name, applicable)
        assert documented == terms[name], (name, documented, terms[name])


def test_every_row_is_exercised() -> None:
    seen = {
        (name, when)
        for model in _models() for training in TRAININGS for name, _, when in _rows()
        if _applies(when, model, training) and layer_terms(model, training, 384, 3)[name] > 0
    }
    assert seen == {(name, when) for name, _, when in _rows()}
