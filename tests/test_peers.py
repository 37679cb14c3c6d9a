"""benchmarks/peers.py's llm-analysis adapter (optional peer) and the benchmark's skip path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import accuracy  # noqa: E402
import peers  # noqa: E402

from zeroplan.harness.presets import HARNESS_PRESETS  # noqa: E402


def test_skipped_with_one_line_when_not_installed(monkeypatch, capsys) -> None:
    monkeypatch.setattr(accuracy, "llm_analysis_available", lambda: False)
    accuracy.llm_analysis_side_by_side([], [], None)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "skipped" in lines[0] and "llm-analysis==0.2.2" in lines[0]


def test_llm_analysis_figures_follow_its_formulas() -> None:
    pytest.importorskip("llm_analysis")
    model = HARNESS_PRESETS["tiny-gpt2"]  # GELU MLP, tied embeddings: its own parameter count
    h, f, v, layers = model.hidden_size, model.ffn_hidden_size, model.vocab_size, model.num_layers
    params = v * h + layers * (4 * h * h + 2 * h * f + 2 * h) + h  # analysis.py get_num_params_*
    figures = peers.llm_analysis_memory(model, "zero2", 2, "fp32", 2, 256)
    assert figures["parameters"] == 4 * params  # stage 2 keeps the weights whole
    assert figures["gradients"] == 4 * params / 2 and figures["optimizer states"] == 8 * params / 2
    # bf16-mixed goes through LLMAnalysis.training and is checked against the part sums inside.
    llama = HARNESS_PRESETS["tiny-llama"]
    for batch in (1, 2):
        mixed = peers.llm_analysis_memory(llama, "fsdp-full-shard", 2, "bf16-mixed", batch, 128)
        assert mixed["optimizer states"] == 6 * mixed["parameters"]  # 12 bytes against 2, both sharded
