"""benchmarks/step_time_twin_rows.py: rows of one source that ran the same computation per GPU
(docs/validation.md, "Twin rows"). Its premise is checked on the planner's own counts: twins
execute the same FLOPs per GPU per step and siblings the same per token, so a gap between their
published ratio and the planner's is not a FLOP the planner miscounts; its two-unknown reading
of the V100 table reproduces the two rows it is solved on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script

SCRIPT = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "step_time_twin_rows.py")


@pytest.fixture(scope="module")
def rows():  # type: ignore[no-untyped-def]
    return SCRIPT.load_published_throughput().rows


def _executed(row) -> float:  # type: ignore[no-untyped-def]
    return SCRIPT.planned_step(row.request(0.5, attention_rate=SCRIPT.DEFAULT_ATTENTION_RATE)).executed_flops


def test_twins_execute_the_same_flops(rows) -> None:  # type: ignore[no-untyped-def]
    pairs = SCRIPT.twin_pairs(rows)
    assert pairs, "the published set has twin rows"
    for a, b, _, _ in pairs:
        assert _executed(a) == pytest.approx(_executed(b), rel=1e-9), (a.name, b.name)


def test_siblings_execute_the_same_flops_per_token(rows) -> None:  # type: ignore[no-untyped-def]
    pairs = SCRIPT.sibling_pairs(rows)
    assert pairs
    for a, b, _, _ in pairs[:20]:
        assert a.num_gpus < b.num_gpus
        assert _executed(a) / a.tokens_per_step_per_gpu == pytest.approx(_executed(b) / b.tokens_per_step_per_gpu,
                                                                         rel=1e-9), (a.name, b.name)


def test_v100_reading_reproduces_its_two_rows(rows) -> None:  # type: ignore[no-untyped-def]
    lines = SCRIPT.v100_reading(rows)
    table = [line for line in lines if line.startswith("| megatron 2020")]
    assert len(table) == 4
    residuals = {line.split(" | ")[1]: line.rstrip(" |").rsplit("| ", 1)[1] for line in table}
    assert residuals["2"] in ("+0.0%", "-0.0%") and residuals["8"] in ("+0.0%", "-0.0%")


def test_one_dimension_pairs_differ_in_that_dimension_alone(rows) -> None:  # type: ignore[no-untyped-def]
    found = SCRIPT.one_dimension_pairs(rows)
    assert found
    for (_, dimension), pairs in found.items():
        for a, b, gap in pairs:
            da, db = SCRIPT._dimensions(a), SCRIPT._dimensions(b)
            differ = {d for d in SCRIPT.DIMENSIONS if da[d] != db[d]}
            expected = {"sequence", "micro-batch"} if dimension == "sequence, same tokens" else {dimension}
            assert differ == expected, (a.name, b.name, dimension)
            assert SCRIPT._fixed(a) == SCRIPT._fixed(b) and gap >= 0
