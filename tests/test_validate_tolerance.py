"""The harness's tolerance (zeroplan.validate.tolerance, `zeroplan validate --check`) over the
committed CPU records, and the one definition of gradients the harness and the planner share
(DeepSpeed's reduce bucket and stage 3's gradient partition buffer are buffers in both). Reads
JSON records only; no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.main import main
from zeroplan.core.deepspeed_accumulation import stage3_resident_bytes
from zeroplan.harness.record import read_record
from zeroplan.validate.compare import compare_record, request_for
from zeroplan.validate.rows import ComparisonRow
from zeroplan.validate.tolerance import TOLERANCE, outside, tolerance_of, within

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
OWN = sorted(p for p in (BENCH / "records").iterdir() if p.is_dir())
DEEPSPEED = sorted(p for p in (BENCH / "deepspeed-records").iterdir() if p.is_dir())
EMITTED = sorted(p for p in (BENCH / "emitted-records").iterdir() if p.is_dir())


def _rows(run: Path) -> list[ComparisonRow]:
    return compare_record(read_record(run / "rank00000.json"))


@pytest.mark.parametrize("run", OWN + DEEPSPEED + EMITTED, ids=lambda p: p.name)
def test_every_row_has_a_bound(run: Path) -> None:
    for row in _rows(run):
        tolerance_of(row.quantity)  # raises for a quantity without a bound


@pytest.mark.parametrize("run", OWN, ids=lambda p: p.name)
def test_the_harness_own_records_are_within_tolerance_on_every_rank(run: Path) -> None:
    """The reference ZeRO, DDP, ZeroRedundancyOptimizer and FSDP2 engines (benchmarks/records),
    every rank: rank 0 alone passed the FSDP2 full-shard runs while rank 1's allocator peak was
    10 % over the planner's."""
    ranks = sorted(run.glob("rank*.json"))
    assert len(ranks) == 2
    for path in ranks:
        failed = outside(compare_record(read_record(path)))
        assert not failed, [(path.name, row.quantity, row.measured_bytes, row.predicted_bytes) for row in failed]


def test_validate_check_passes_every_rank_of_the_committed_records(capsys) -> None:
    """What docs/validation.md's first table comes from: `zeroplan validate benchmarks/records
    --check --all-ranks`, in process."""
    assert main(["validate", str(BENCH / "records"), "--check", "--all-ranks"]) == 0
    assert "within the harness's tolerance" in capsys.readouterr().err


@pytest.mark.parametrize("run", DEEPSPEED, ids=lambda p: p.name)
def test_deepspeed_records_are_within_tolerance_on_every_rank(run: Path) -> None:
    """DeepSpeed's ZeRO stages, offload included (benchmarks/deepspeed-records): on a CPU run the
    offloaded states share the one allocator, and validate adds them to the predicted peak."""
    for path in sorted(run.glob("rank*.json")):
        rows = compare_record(read_record(path))
        assert not outside(rows), [r.quantity for r in outside(rows)]


@pytest.mark.parametrize("run", EMITTED, ids=lambda p: p.name)
def test_emitted_runs_are_within_tolerance_on_every_rank(run: Path) -> None:
    """The runs of `zeroplan fit --emit`'s files: every row, the allocator's peak included
    (docs/harness.md, "Running an emitted config"), on both ranks."""
    for path in sorted(run.glob("rank*.json")):
        rows = compare_record(read_record(path))
        assert any(row.quantity == "peak (CPU allocator)" for row in rows)
        assert not outside(rows), [r.quantity for r in outside(rows)]


def test_within_reads_its_bounds() -> None:
    base = dict(run_id="r", strategy="zero3", engine="deepspeed", world_size=2, rank=0, category="memory")
    assert within(ComparisonRow(**base, quantity="gradients", predicted_bytes=1000, measured_bytes=1001))
    assert not within(ComparisonRow(**base, quantity="gradients", predicted_bytes=1000, measured_bytes=1002))
    assert within(ComparisonRow(**base, quantity="peak (CPU allocator)", predicted_bytes=100, measured_bytes=105))
    assert not within(ComparisonRow(**base, quantity="peak (CPU allocator)", predicted_bytes=100, measured_bytes=106))
    assert not within(ComparisonRow(**base, quantity="all_reduce bytes/step", predicted_bytes=0, measured_bytes=8))
    assert within(ComparisonRow(**base, quantity="peak (tracked tensors)", predicted_bytes=100, measured_bytes=50))
    assert TOLERANCE["activations (saved)"] == 0.02


def test_check_sets_the_exit_status(capsys, tmp_path: Path) -> None:
    offload = BENCH / "deepspeed-records" / "tiny-llama-zero3-offload-deepspeed-fp32-n2"
    # The run passes (test_deepspeed_records_are_within_tolerance_on_every_rank); with its last
    # step's allocator peak 6 % higher it is outside the 5 % bound.
    for path in sorted(offload.glob("rank*.json")):
        record = json.loads(path.read_text())
        memory = record["steps"][-1]["memory"]
        memory["allocator_peak_bytes"] = memory["allocator_peak_bytes"] * 106 // 100
        (tmp_path / path.name).write_text(json.dumps(record))
    assert main(["validate", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "outside tolerance: tiny-llama-zero3-offload-deepspeed-fp32-n2 rank 0: peak (CPU allocator)" in err


@pytest.mark.parametrize("run", [p for p in DEEPSPEED + EMITTED if "zero3-deepspeed" in p.name], ids=lambda p: p.name)
def test_deepspeed_stage3_gradients_and_buffers_are_counted_alike(run: Path) -> None:
    """gradients: the fp32 partition AdamW steps from; buffers: the ipg bucket and
    grad_partitions_flat_buffer. Both sides count them so; the record's total is unchanged
    (parameters + gradients + optimizer states + buffers)."""
    for path in sorted(run.glob("rank*.json")):
        record = read_record(path)
        states = record.steps[-1].model_state
        rows = {row.quantity: row for row in compare_record(record)}
        assert rows["gradients"].measured_bytes == rows["gradients"].predicted_bytes
        assert states.buffers_bytes == rows["buffers (kept)"].predicted_bytes == stage3_resident_bytes(request_for(record.description))
        assert states.total_bytes == (states.parameters_bytes + states.gradients_bytes + states.optimizer_states_bytes
                                      + states.buffers_bytes)
