"""Real multi-process runs (torchrun, gloo, CPU): every engine, optimizer and accumulation
mode against the single-process oracle, and zeroplan's reference ZeRO stages byte-for-byte
against the planner. The runs themselves are listed in harness_runs.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from harness_runs import MICRO_BATCH, RUNS, SEQ_LEN, STEPS, Run, find_run
from zeroplan.harness.launch import launch
from zeroplan.harness.model import build_model
from zeroplan.harness.oracle import oracle_parameters
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.harness.record import read_record
from zeroplan.specs import Optimizer
from zeroplan.validate.compare import compare_record

MODEL = "micro-llama"


@pytest.fixture(scope="module")
def oracle() -> Callable[[Run], dict[str, torch.Tensor]]:
    """The single-process parameters each run must end with (cached: runs share them)."""
    cache: dict[tuple, dict[str, torch.Tensor]] = {}

    def parameters(run: Run) -> dict[str, torch.Tensor]:
        key = (run.model, run.nproc, run.grad_accum, run.optimizer)
        if key not in cache:
            cache[key] = oracle_parameters(HARNESS_PRESETS[run.model], STEPS, run.nproc, MICRO_BATCH, SEQ_LEN,
                                           grad_accum_steps=run.grad_accum, optimizer=Optimizer(run.optimizer))
        return cache[key]

    return parameters


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_parameters_match_the_single_process_oracle(measured, oracle, run: Run) -> None:
    measured_parameters = torch.load(measured(run) / "parameters.pt")
    expected = oracle(run)
    assert measured_parameters.keys() == expected.keys()
    moved = 0.0
    initial = {name: p.detach() for name, p in build_model(HARNESS_PRESETS[run.model]).named_parameters()}
    for name, tensor in expected.items():
        torch.testing.assert_close(measured_parameters[name], tensor, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
        moved = max(moved, (tensor - initial[name]).abs().max().item())
    assert moved > 1e-4  # the optimizer really changed the parameters


def test_the_oracle_tells_the_micro_batches_of_a_step_apart() -> None:
    """A run that trained on K=2 micro-batches cannot pass as one that trained on one, nor an
    optimizer as another: the parity tests above could fail."""
    spec = HARNESS_PRESETS[MODEL]
    one = oracle_parameters(spec, 2, 2, MICRO_BATCH, SEQ_LEN)
    two = oracle_parameters(spec, 2, 2, MICRO_BATCH, SEQ_LEN, grad_accum_steps=2)
    sgd = oracle_parameters(spec, 2, 2, MICRO_BATCH, SEQ_LEN, grad_accum_steps=2, optimizer=Optimizer.sgd_momentum)
    for other in (two, sgd):
        assert max((one[n] - other[n]).abs().max().item() for n in one) > 1e-4
    assert max((two[n] - sgd[n]).abs().max().item() for n in one) > 1e-4


@pytest.mark.parametrize("run", [r for r in RUNS if r.engine == "zeroplan"], ids=lambda run: run.name)
def test_reference_zero_bytes_equal_the_planner(measured, run: Run) -> None:
    for path in sorted(measured(run).glob("rank*.json")):
        record = read_record(path)
        assert record.complete and len(record.steps) == STEPS
        assert record.description.batch.grad_accum_steps == run.grad_accum
        assert record.description.training.optimizer.value == run.optimizer
        assert record.description.keep_unsharded_grads_on_accum == run.keep_unsharded
        exact = {row.quantity: row for row in compare_record(record) if row.quantity in (
            "parameters", "gradients", "optimizer states", "all_gather bytes/step", "reduce_scatter bytes/step")}
        assert len(exact) == 5
        for row in exact.values():
            assert row.measured_bytes == row.predicted_bytes, (path.name, row.quantity, row.measured_bytes, row.predicted_bytes)


def test_each_rank_writes_its_own_record(measured) -> None:
    out = measured(find_run(strategy="zero3", engine="zeroplan", nproc=4))
    records = [read_record(p) for p in sorted(out.glob("rank*.json"))]
    assert [r.rank for r in records] == [0, 1, 2, 3]
    assert {r.description.world_size for r in records} == {4}


@pytest.mark.slow  # launches torchrun
def test_time_limit_stops_the_run(tmp_path) -> None:
    result = launch(2, ["tiny-llama", "--strategy", "zero2", "--steps", "50"], tmp_path, timeout_s=3)
    assert result.returncode == 124


@pytest.mark.parametrize("run", [find_run(strategy="zero3", engine="zeroplan"), find_run(strategy="ddp", engine="torch"),
                                 find_run(strategy="fsdp-full-shard", engine="torch")], ids=lambda run: run.name)
def test_the_allocator_peak_holds_what_must_be_alive_together(measured, run: Run) -> None:
    """At the loss backward of a step after the first, the parameters, the optimizer states and
    every saved activation are alive at once: the allocator's peak cannot be below their sum,
    nor (nothing counted twice) far above it; the record names who allocated what was live."""
    for rank in range(run.nproc):
        record = read_record(measured(run) / f"rank{rank:05d}.json")
        assert record.complete
        for step in record.steps[1:]:
            states, memory = step.model_state, step.memory
            assert memory.allocator_peak_bytes is not None
            together = states.parameters_bytes + states.optimizer_states_bytes + memory.saved_activation_bytes
            assert memory.allocator_peak_bytes >= together
            assert memory.allocator_peak_bytes < 4 * together  # nothing counted twice over
            assert memory.allocator_live_bytes_by_operator


def test_memory_snapshot_is_refused_on_nccl_in_one_line(tmp_path, capsys) -> None:
    """--memory-snapshot writes the CPU allocator's events (zeroplan.harness.snapshot); a CUDA run
    records its own history, so the flag is refused there before anything launches."""
    from zeroplan.cli.main import main as zeroplan_main

    argv = ["measure", "micro-llama", "--strategy", "ddp", "--engine", "torch", "--nproc", "2", "--backend", "nccl",
            "--memory-snapshot", "--out", str(tmp_path / "out")]
    assert zeroplan_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--memory-snapshot: writes the CPU allocator's events" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # launches torchrun
def test_memory_snapshot_is_written_and_read_back_at_the_records_peak(tmp_path, capsys) -> None:
    """measure --memory-snapshot: the rank's pickle, read by validate --from-log's reader, peaks
    at the CPU-allocator peak of the rank's record (the same events, replayed)."""
    from zeroplan.cli.main import main as zeroplan_main
    from zeroplan.validate.logs import read_log

    out = tmp_path / "out"
    argv = ["measure", "micro-llama", "--strategy", "ddp", "--engine", "torch", "--nproc", "1", "--backend", "gloo",
            "--steps", "2", "--micro-batch", "2", "--seq-len", "16", "--memory-snapshot", "--out", str(out)]
    assert zeroplan_main(argv) == 0, capsys.readouterr().err
    record = read_record(out / "rank00000.json")
    (reading,) = read_log(out / "rank00000.snapshot.pickle").readings
    assert reading.figure == "allocated"
    assert reading.bytes == max(step.memory.allocator_peak_bytes for step in record.steps) > 0
