"""The committed pipeline records (benchmarks/pipeline-records): readable without torch, each
consistent with itself, and one small case of each kind still what torch and torchtitan produce."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zeroplan.frameworks.pipeline_record import (
    PipelineScheduleRecord,
    PipelineSplitRecord,
    compute_actions,
    load_schedule_records,
    load_split_records,
    parse_order,
    peak_in_flight,
)

from tests.scripts import load_script

RECORDS = Path(__file__).resolve().parent.parent / "benchmarks" / "pipeline-records"
SPLITS = load_split_records(RECORDS)
SCHEDULES = load_schedule_records(RECORDS)
MEASURED_SPLITS = [r for r in SPLITS if r.error is None]
MEASURED_SCHEDULES = [r for r in SCHEDULES if r.error is None]


def test_records_load_with_torch_blocked() -> None:
    program = (
        "import sys; sys.modules['torch'] = None\n"
        "from pathlib import Path\n"
        "from zeroplan.frameworks.pipeline_record import load_schedule_records, load_split_records\n"
        f"d = Path({str(RECORDS)!r})\n"
        "print(len(load_split_records(d)), len(load_schedule_records(d)))\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m] is not None)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    splits, schedules = map(int, result.stdout.split())
    assert splits == len(SPLITS) and schedules == len(SCHEDULES)


def test_split_refusals_are_torchtitans_layers_per_stage_checks() -> None:
    # With its defaults torchtitan splits every flavour at every degree; only a
    # pipeline_parallel_layers_per_stage whose stage count pp does not divide is refused.
    refused = [r for r in SPLITS if r.error]
    assert all(r.layers_per_stage is not None and "must be divisible by pipeline parallel size" in r.error for r in refused)
    assert all(r.error is None for r in SPLITS if r.layers_per_stage is None)
    assert any(r.stages_per_rank == 4 for r in MEASURED_SPLITS)


def test_split_layers_are_the_registry_depths() -> None:
    script = load_script(RECORDS.parent / "pipeline_records.py")
    assert {r.flavour: r.num_layers for r in SPLITS} == script.NUM_LAYERS


def test_the_records_cover_what_the_docs_table() -> None:
    # docs/pipeline-measured.md tabulates these; every one must be measured, not refused.
    for flavour in ("8B", "70B", "405B"):
        for pp in (4, 8, 16):
            assert any(r.flavour == flavour and r.pp == pp and r.schedule == "1F1B" for r in MEASURED_SPLITS)
    for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        for pp, m in ((4, 8), (8, 16)):
            assert any(r.schedule == schedule and r.pp == pp and r.microbatches == m for r in MEASURED_SCHEDULES), (schedule, pp, m)


@pytest.mark.parametrize("record", MEASURED_SPLITS, ids=lambda r: r.name)
def test_split_adds_up(record: PipelineSplitRecord) -> None:
    stages = record.stages
    assert [s.stage_index for s in stages] == list(range(record.pp * record.stages_per_rank))
    for stage in stages:
        parts = stage.embedding_elements + stage.block_elements + stage.norm_elements + stage.output_elements
        assert parts == stage.total_elements, stage.stage_index
    # The stages split the whole model: nothing lost, nothing counted twice.
    assert sum(s.total_elements for s in stages) == record.model_param_elements
    assert sum(r.param_elements for r in record.ranks) == record.model_param_elements
    # Every decoder block on exactly one stage, in order; embedding first, norm and output last.
    layers = [name for s in stages for name in s.modules if name.startswith("layers.")]
    assert layers == [f"layers.{i}" for i in range(record.num_layers)]
    assert [s.layers for s in stages] == [sum(n.startswith("layers.") for n in s.modules) for s in stages]
    assert stages[0].modules[0] == "tok_embeddings" and stages[-1].modules[-2:] == ["norm", "lm_head"]
    assert all(s.embedding_elements == 0 for s in stages[1:]) and all(s.output_elements == 0 for s in stages[:-1])
    by_index = {s.stage_index: s for s in stages}
    for rank in record.ranks:
        assert rank.param_elements == sum(by_index[i].total_elements for i in rank.stage_indices)
        if record.style == "loop":
            assert rank.stage_indices == [rank.rank + k * record.pp for k in range(record.stages_per_rank)]
        else:
            assert rank.stage_indices == [rank.rank, 2 * record.pp - 1 - rank.rank]


def _check_order(order: str, stages: list[int], microbatches: int) -> None:
    """Each (stage, micro-batch) runs F once, then either B once or I then W, once each."""
    seen: dict[tuple[int, int], list[str]] = {}
    for stage, kind, micro in compute_actions(order):
        assert stage in stages and 0 <= micro < microbatches, (stage, kind, micro)
        seen.setdefault((stage, micro), []).append(kind)
    assert set(seen) == {(s, m) for s in stages for m in range(microbatches)}
    for key, kinds in seen.items():
        assert kinds in (["F", "B"], ["F", "I", "W"]), (key, kinds)


@pytest.mark.parametrize("record", MEASURED_SCHEDULES, ids=lambda r: r.name)
def test_schedule_orders_are_consistent(record: PipelineScheduleRecord) -> None:
    assert [r.rank for r in record.ranks] == list(range(record.pp))
    for rank in record.ranks:
        assert len(rank.stage_indices) == record.stages_per_rank
        _check_order(rank.executed_order, rank.stage_indices, record.microbatches)
        # The peaks are what the stored orders say.
        assert rank.peak_in_flight_until_input_grad == peak_in_flight(rank.executed_order, "BI")
        assert rank.peak_in_flight_until_weight_grad == peak_in_flight(rank.executed_order, "BW")
        assert rank.peak_in_flight_ir == peak_in_flight(rank.ir_order, "BW")
        matches = compute_actions(rank.ir_order) == compute_actions(rank.executed_order)
        assert rank.ir_matches_executed == matches
        if matches:
            assert rank.peak_in_flight_ir == rank.peak_in_flight_until_weight_grad
        # The saved activations alive at once, counted while step() ran, are the chunks the
        # order says were between F and their last backward action.
        assert rank.peak_saved_chunks_measured == rank.peak_in_flight_until_weight_grad
        # The same step on fake tensors made the same calls and kept as many chunks' bytes.
        assert rank.fake_run_order_matches
        assert rank.peak_saved_bytes_fake == rank.peak_in_flight_until_weight_grad * record.fake_chunk_bytes
        assert rank.peak_in_flight_until_input_grad <= rank.peak_in_flight_until_weight_grad
        if rank.ir_slots is not None:
            assert rank.ir_slots == len(rank.ir_order.split())
            assert rank.ir_idle_slots == sum(a is None for a in parse_order(rank.ir_order))


def test_only_the_known_ir_mismatch() -> None:
    # torch 2.13 Schedule1F1B._get_pipeline_order numbers the last rank's forwards 1..m (its
    # steady-state loop increments forward_mb before the first use when there is no warm-up);
    # _step_microbatches runs 0..m-1. No other schedule's IR differs from its execution.
    mismatched = {(r.schedule, r.pp, rank.rank) for r in MEASURED_SCHEDULES for rank in r.ranks if not rank.ir_matches_executed}
    assert mismatched == {("1F1B", r.pp, r.pp - 1) for r in MEASURED_SCHEDULES if r.schedule == "1F1B"}


def test_order_parsing() -> None:
    assert parse_order("_ 1F0 (1F6;6B2)OVERLAP_F_B 10W12") == [None, (1, "F", 0), (1, "F", 6), (6, "B", 2), (10, "W", 12)]
    assert peak_in_flight("0F0 0F1 0I0 0F2 0W0 0B1 0B2", "BI") == 2
    assert peak_in_flight("0F0 0F1 0I0 0F2 0W0 0B1 0B2", "BW") == 3


def _committed(records: list, name: str):
    return next(r for r in records if r.name == name)


def test_small_schedule_regenerates_as_committed() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/install-frameworks installs it)")
    from zeroplan.frameworks.pipeline import schedule_record

    for schedule, per_rank in (("1F1B", 1), ("InterleavedZeroBubble", 2), ("DualPipeV", 2)):
        live = schedule_record(schedule, 2, per_rank, 4)
        assert live == _committed(SCHEDULES, live.name)


@pytest.mark.slow
def test_small_split_regenerates_as_committed() -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/install-frameworks installs it)")
    from zeroplan.frameworks.pipeline import split_record

    live = split_record("8B", 2, "ZBVZeroBubble")
    assert live == _committed(SPLITS, live.name)


def _interleaved_1f1b(pp: int, v: int, m: int, r: int) -> int:
    # torch 2.13 schedules.py _get_warmup_ops (multiply_factor 2) with ScheduleInterleaved1F1B's
    # rounds (max(1, m // pp)) and micro-batches per round; one more forward before the first
    # backward, capped at every chunk of the rank.
    per_round = m // max(1, m // pp)
    return min((v - 1) * per_round + 2 * (pp - 1 - r) + 1, v * m)


# schedule -> (peak until B/W, peak until B/I) for rank r of pp, v stages per rank, m micro-batches:
# the rules docs/pipeline-measured.md states, fitted to the records and checked against all.
RULES = {
    "GPipe": (lambda pp, v, m, r: m, None),
    "1F1B": (lambda pp, v, m, r: min(pp - r, m), None),
    "Interleaved1F1B": (_interleaved_1f1b, None),
    "LoopedBFS": (lambda pp, v, m, r: v * m, None),
    "InterleavedZeroBubble": (lambda pp, v, m, r: v * min(pp, m), lambda pp, v, m, r: min(v * pp - r, v * m)),
    "ZBVZeroBubble": (lambda pp, v, m, r: min(2 * pp, m + 1 + r), None),
    "DualPipeV": (lambda pp, v, m, r: 2 * pp + 1, None),
}


@pytest.mark.parametrize("record", MEASURED_SCHEDULES, ids=lambda r: r.name)
def test_schedules_follow_the_documented_rules(record: PipelineScheduleRecord) -> None:
    until_weight, until_input = RULES[record.schedule]
    until_input = until_input or until_weight
    args = (record.pp, record.stages_per_rank, record.microbatches)
    assert [r.peak_in_flight_until_weight_grad for r in record.ranks] == [until_weight(*args, r) for r in range(record.pp)]
    assert [r.peak_in_flight_until_input_grad for r in record.ranks] == [until_input(*args, r) for r in range(record.pp)]


def test_dualpipev_refuses_fewer_microbatches_than_stages() -> None:
    refused = {(r.pp, r.microbatches) for r in SCHEDULES if r.error}
    assert refused == {(r.pp, r.microbatches) for r in SCHEDULES if r.schedule == "DualPipeV" and r.microbatches < 2 * r.pp}
    assert all(r.schedule == "DualPipeV" for r in SCHEDULES if r.error)


def test_docs_tables_are_the_records() -> None:
    root = RECORDS.parents[1]
    script = load_script(root / "benchmarks" / "pipeline_records.py")
    doc = (root / "docs" / "pipeline-measured.md").read_text(encoding="utf-8")
    for table in script.tables(RECORDS).split("\n\n"):
        assert table.strip() in doc


def test_private_pipeline_pieces_are_where_we_expect() -> None:
    """Fails, naming the piece, when a torch release moves what _torch_private's pipeline
    helpers patch or read."""
    pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode

    from zeroplan.simulate import _torch_private as private

    assert hasattr(schedules._PipelineSchedule, "_warmup_p2p"), "schedules._PipelineSchedule._warmup_p2p moved"
    assert InferenceMode.STATIC, "pipelining._utils.InferenceMode.STATIC moved"
    assert private.pipeline_action_class()._fields[:3] == ("stage_index", "computation_type", "microbatch_index")
    original = schedules._PipelineSchedule._warmup_p2p
    with private.pipeline_stages_static():
        assert schedules._PipelineSchedule._warmup_p2p is not original
    assert schedules._PipelineSchedule._warmup_p2p is original
