"""The DPO head's formulas (zeroplan.core.dpo) against torchtune's own DPO step on fake tensors
(benchmarks/dpo_head_records.py writes benchmarks/dpo-head-records.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core.dpo import dpo_head_peak_bytes, dpo_rows, policy_log_softmax_bytes

RECORDS = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "dpo-head-records.json").read_text())

HIDDEN_BYTES_PER_ELEMENT = 11
"""A bound, not a fit: besides the vocabulary-wide tensors, the head keeps hidden-width tensors of
the 2 x micro-batch rows (the final RMSNorm's fp32 input, its bf16 output, the output projection's
bf16 input, the embedding's bf16 output: 10 bytes an element), which the causal-LM head formulas
count at twice the micro-batch. Anything vocabulary-wide the formulas missed is V/D (31 or more)
times larger than this slack."""


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r['model']}-{r['pairs']}x{r['seq_len']}")
def test_vocabulary_terms_match_the_recipe_step(record):
    pairs, seq, vocab = record["pairs"], record["seq_len"], record["vocab_size"]
    slack = HIDDEN_BYTES_PER_ELEMENT * dpo_rows(pairs) * seq * record["hidden_size"]
    retained = record["retained_after_policy_bytes"] - policy_log_softmax_bytes(pairs, seq, vocab)
    peak = record["step_peak_bytes"] - dpo_head_peak_bytes(pairs, seq, vocab)
    assert 0 <= retained <= slack
    assert 0 <= peak <= slack
