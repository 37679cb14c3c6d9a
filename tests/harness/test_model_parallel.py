"""Tensor (sequence) parallelism with FSDP2 and a two-stage pipeline with DDP or FSDP2, run for
real on 4 gloo ranks: every rank's record, the tensor-parallel collectives and the pipeline's
sends and receives in it, the parameter bytes each rank holds against the planner's, and
``zeroplan validate`` on the records. Plus the one-line refusals of bad --tp / --pp values."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness_runs import (
    MICRO_BATCH,
    PARALLEL_MICRO_BATCHES,
    PARALLEL_MODEL,
    PARALLEL_RUNS,
    PARALLEL_STEPS,
    SEQ_LEN,
)

from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.harness.record import SCHEMA_VERSION, read_record
from zeroplan.validate.compare import compare_record

MODEL, NPROC, STEPS, MICRO_BATCHES = PARALLEL_MODEL, 4, PARALLEL_STEPS, PARALLEL_MICRO_BATCHES
RUNS = {run.name: run for run in PARALLEL_RUNS}


@pytest.fixture(scope="module")
def runs(measured) -> dict[str, Path]:
    """Every run of RUNS, launched with the other runs of 4 ranks (tests/harness/conftest.py)."""
    return {name: measured(run) for name, run in RUNS.items()}


def _records(out: Path):
    return [read_record(path) for path in sorted(out.glob("rank*.json"))]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_one_complete_record_per_rank_carrying_the_parallel_spec(runs, name: str) -> None:
    records = _records(runs[name])
    assert [r.rank for r in records] == list(range(NPROC))
    for record in records:
        assert record.complete and record.schema_version == SCHEMA_VERSION and len(record.steps) == STEPS
        parallel = record.description.parallel
        if name.startswith("tp"):
            assert (parallel.tp, parallel.pp, parallel.sequence_parallel) == (2, 1, name == "tp-sp")
            # tp innermost: ranks 2k and 2k + 1 are one tensor-parallel group.
            assert record.mesh_coordinates == {"dp": record.rank // 2, "tp": record.rank % 2}
        else:
            assert (parallel.tp, parallel.pp, parallel.pp_schedule.value) == (1, 2, name.split("-")[1])
            # pp outermost: ranks 0, 1 run the first stage, 2, 3 the second.
            assert record.mesh_coordinates == {"pp": record.rank // 2, "dp": record.rank % 2}
            assert parallel.pipeline_rank == record.rank // 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp", "tp-sp"])
def test_tensor_parallel_collectives_run_over_the_tp_group(runs, name: str) -> None:
    spec = HARNESS_PRESETS[MODEL]
    activation = MICRO_BATCH * SEQ_LEN * spec.hidden_size * 4  # one fp32 s b h tensor, the full buffer
    for record in _records(runs[name]):
        pair = [record.rank - record.rank % 2, record.rank - record.rank % 2 + 1]
        calls = record.steps[-1].collectives
        tp = [c for c in calls if c.group == "tp"]
        assert tp and all(c.group_size == 2 and c.group_ranks == pair for c in tp)
        ops = {c.op for c in tp if c.num_bytes == activation}
        assert ops == ({"all_gather", "reduce_scatter"} if name == "tp-sp" else {"all_reduce"})
        # FSDP2's gathers and reduce-scatters run over the data-parallel pair, tp ranks apart.
        dp = [c for c in calls if c.group == "dp"]
        assert {c.op for c in dp} == {"all_gather", "reduce_scatter"}
        assert all(c.group_ranks == [record.rank % 2, record.rank % 2 + 2] for c in dp)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp-1f1b-fsdp", "pp-gpipe-ddp"])
def test_the_stages_send_activations_and_gradients_to_each_other(runs, name: str) -> None:
    spec = HARNESS_PRESETS[MODEL]
    activation = MICRO_BATCH * SEQ_LEN * spec.hidden_size * 4
    for record in _records(runs[name]):
        stage = record.rank // 2
        peer = record.rank + 2 if stage == 0 else record.rank - 2
        calls = record.steps[-1].collectives
        for op in ("send", "recv"):
            p2p = [c for c in calls if c.op == op]
            # One activation forward (stage 0 sends, 1 receives) and one gradient back per micro-batch.
            assert len(p2p) == MICRO_BATCHES, (record.rank, op, p2p)
            assert all(c.peer == peer and c.group == "pp" and c.group_size == 2 and c.num_bytes == activation for c in p2p)
        data = {c.op for c in calls if c.group == "dp"}
        if name.endswith("ddp"):
            # DDP's one-off broadcast of its rebuilt bucket order follows the first step.
            assert "all_reduce" in data and data <= {"all_reduce", "broadcast"}
        else:
            assert data == {"all_gather", "reduce_scatter"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_each_rank_holds_the_parameter_bytes_the_planner_says(runs, name: str) -> None:
    for record in _records(runs[name]):
        rows = {row.quantity: row for row in compare_record(record)}
        for quantity in ("parameters", "optimizer states"):
            row = rows[quantity]
            assert row.measured_bytes == row.predicted_bytes, (name, record.rank, quantity, row)
        assert all(row.pipeline_rank == (record.rank // 2 if name.startswith("pp") else None) for row in rows.values())


@pytest.mark.slow
def test_tensor_and_sequence_parallel_runs_train_the_same_model(runs) -> None:
    """Sequence parallelism moves the same numbers differently: the losses agree."""
    plain, sequence = _records(runs["tp"]), _records(runs["tp-sp"])
    for a, b in zip(plain, sequence):
        assert [s.loss for s in a.steps] == pytest.approx([s.loss for s in b.steps], rel=1e-5)


@pytest.mark.slow
def test_validate_puts_the_planner_beside_every_rank(runs, capsys) -> None:
    from zeroplan.cli.main import main

    assert main(["validate", *(str(runs[name]) for name in RUNS), "--all-ranks"]) == 0
    table = capsys.readouterr().out
    assert "3 (pp 1)" in table and "send bytes/step (pp)" in table and "all_reduce bytes/step (tp)" in table
    # Without --all-ranks: rank 0, and the first rank of each further pipeline stage.
    assert main(["validate", str(runs["pp-gpipe-ddp"])]) == 0
    table = capsys.readouterr().out
    assert "0 (pp 0)" in table and "2 (pp 1)" in table and "3 (pp 1)" not in table


BAD = [
    (["--tp", "3"], "--tp", "allowed: 2"),
    (["--pp", "4"], "--pp", "allowed: 2"),
    (["--tp", "2", "--pp", "2"], "--tp", "not both"),
    (["--sequence-parallel"], "--sequence-parallel", "--tp 2 or more"),
    (["--tp", "2", "--engine", "zeroplan"], "--engine", "allowed: torch"),
    (["--pp", "2", "--strategy", "zero2"], "--strategy", "allowed: ddp, fsdp-full-shard, fsdp-shard-grad-op"),
    (["--tp", "2", "--strategy", "ddp"], "--strategy", "allowed: fsdp-full-shard, fsdp-shard-grad-op"),
    (["--tp", "2", "--sequence-parallel", "--seq-len", "15"], "--sequence-parallel", "allowed: a multiple of 2"),
    (["--pp", "2", "--model", "micro-gpt2"], "--pp", "untied"),
    (["--tp", "2", "--model", "micro-llama"], "--tp", "allowed: a divisor"),
]


@pytest.mark.parametrize("extra,flag,allowed", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_model_parallel_flags_are_one_line_errors(capsys, tmp_path, extra, flag, allowed) -> None:
    from zeroplan.cli.main import main

    model = MODEL
    if "--model" in extra:
        model = extra[extra.index("--model") + 1]
        extra = [e for e in extra if e not in ("--model", model)]
    argv = ["measure", model, "--strategy", "fsdp-full-shard", "--nproc", "4", *extra, "--out", str(tmp_path / "out")]
    if "--strategy" in extra:
        argv = ["measure", model, "--nproc", "4", *extra, "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and allowed in lines[0], captured.err
    assert "Traceback" not in captured.err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag,value", [("--tp", "0"), ("--pp", "-1"), ("--pp-schedule", "zbv")])
def test_values_no_degree_can_take_are_refused_by_the_parser(capsys, tmp_path, flag, value) -> None:
    from zeroplan.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["measure", MODEL, "--strategy", "fsdp-full-shard", "--nproc", "4", flag, value, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()
    assert len(line) == 1 and flag in line[0]
