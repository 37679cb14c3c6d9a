"""benchmarks/step_time_anchor_pairs.py: the anchor of a source and each of its other rows, two
published steps, solve the HFU and one candidate mechanism's unknown (docs/validation.md, "The
anchor and each row, two unknowns"). Its algebra recovers a known HFU and unknown, it refuses a
pair the mechanism cannot tell apart, and its line through the planner's step is the planner's
(the anchor's HFU alone is the one calibrate step solves)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script

SCRIPT = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "step_time_anchor_pairs.py")


def synthetic(a: float, b: float, memory_s: float, micro_batches: int, blocks: int, model_parallel_s: float,
              hfu: float, mechanism: str, x: float):  # type: ignore[no-untyped-def]
    """Terms of a row whose published step is the planner's at ``hfu`` with ``mechanism`` at ``x``."""
    terms = object.__new__(SCRIPT.Terms)
    terms.a, terms.b, terms.linear = a, b, True
    terms.memory_s, terms.micro_batches, terms.blocks, terms.model_parallel_s = memory_s, micro_batches, blocks, model_parallel_s
    added = {
        "memory-bound x k": (x - 1) * memory_s,
        "per step (s)": x,
        "per micro-batch (s)": micro_batches * x,
        "per block (ms)": micro_batches * blocks * x / 1e3,
        "per block and step (ms)": blocks * x / 1e3,
        "model-parallel communication x k": (x - 1) * model_parallel_s,
    }[mechanism]
    terms.published_s = a / hfu + b + added
    return terms


@pytest.mark.parametrize("mechanism, x", [
    ("memory-bound x k", 3.5), ("per step (s)", 0.07), ("per micro-batch (s)", 0.02), ("per block (ms)", 4.0),
    ("per block and step (ms)", 4.4),
    ("model-parallel communication x k", 2.5),
])
def test_a_pair_solves_the_hfu_and_the_unknown_it_was_built_with(mechanism: str, x: float) -> None:
    assert mechanism in SCRIPT.MECHANISMS
    anchor = synthetic(1.0, 0.5, 0.15, 2, 24, 0.10, 0.45, mechanism, x)
    row = synthetic(40.0, 3.0, 1.2, 21, 48, 0.60, 0.45, mechanism, x)
    hfu, solved = SCRIPT.pair_solution(anchor, row, mechanism)
    assert hfu == pytest.approx(0.45)
    assert solved == pytest.approx(x)


def test_a_pair_whose_term_is_the_same_share_of_its_products_solves_nothing() -> None:
    anchor = synthetic(1.0, 0.5, 0.15, 2, 24, 0.0, 0.45, "memory-bound x k", 3.0)
    # twice the products and twice the memory-bound time: the same model at twice the tokens
    row = synthetic(2.0, 1.0, 0.30, 2, 24, 0.0, 0.45, "memory-bound x k", 3.0)
    assert SCRIPT.pair_solution(anchor, row, "memory-bound x k") is None
    # neither row has model-parallel communication
    assert SCRIPT.pair_solution(anchor, row, "model-parallel communication x k") is None


def test_the_line_is_the_planners_step_and_the_anchors_hfu_is_calibrate_steps() -> None:
    from zeroplan.calibrate.step import planned_step
    from zeroplan.validate.step_calibration import (
        DEFAULT_ATTENTION_RATE, calibration_row, implied_hfu, source_label, source_rows,
    )
    from zeroplan.validate.step_time import load_published_throughput

    rows = next(rows for rows in source_rows(load_published_throughput()).values()
                if "Large Scale" in source_label(rows[0]))
    anchor = calibration_row(rows)
    terms = SCRIPT.Terms(anchor)
    assert terms.linear
    assert terms.a / (terms.published_s - terms.b) == pytest.approx(implied_hfu(anchor), rel=1e-6)
    for row in rows[:6]:
        row_terms = SCRIPT.Terms(row)
        if row_terms.linear:
            at = planned_step(row.request(0.7, attention_rate=DEFAULT_ATTENTION_RATE)).step_with_overlap_s
            assert row_terms.a / 0.7 + row_terms.b == pytest.approx(at, rel=1e-6)


def test_the_figures_docs_quote_are_the_scripts() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "validation.md").read_text()
    docs = " ".join(text[text.index("#### The anchor and each row, two unknowns"):].split()[:1500])
    by_label = {source.label: source for source in SCRIPT.source_pairs()}

    def source(words: str):  # type: ignore[no-untyped-def]
        return next(pairs for label, pairs in by_label.items() if words in label)

    h100 = source("'H100 80GB BF16' table")
    unseparable, median_k, *_, outside, _ = h100.summary("memory-bound x k")
    separable = len(h100.pairs["memory-bound x k"]) - unseparable
    assert f"{median_k:.1f}x on the H100 table" in docs
    assert f"{outside} of the H100 table's {separable} separable rows" in docs
    large = source("Large Scale")
    _, median_c, low_c, high_c, *_ = large.summary("per step (s)")
    assert f"large-scale {median_c:.3f} s, quartiles {low_c:.3f}-{high_c:.3f}" in docs
    rebalancing = source("Rebalancing layers")
    _, median_mp, low_mp, high_mp, *_ = rebalancing.summary("model-parallel communication x k")
    assert f"k = {median_mp:.1f} ({low_mp:.1f}-{high_mp:.1f}" in docs
    # the anchor's own model, micro-batch and sequence on more GPUs: a fixed cost below 0
    siblings = [x for row, (_, x) in h100.solved("per step (s)")
                if (row.model, row.micro_batch_size, row.seq_len) == (h100.anchor.model, h100.anchor.micro_batch_size, h100.anchor.seq_len)]
    assert f"solves {min(siblings):.2f} and {max(siblings):.2f} s" in docs
