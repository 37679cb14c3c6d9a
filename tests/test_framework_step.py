"""Whole training steps of the frameworks' own models under their own FSDP2 wrapping
(benchmarks/framework-step-records, written by benchmarks/framework_step_records.py) against
the planner's allocated peak: torch-free, except the live reproduction and the command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zeroplan.core.model_states import model_state_bytes
from zeroplan.frameworks.step_record import FrameworkStepRecord, load_step_records

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
RECORDS = BENCHMARKS / "framework-step-records"
SHALLOW_RECORDS = BENCHMARKS / "framework-step-records-shallow"
"""Two of RECORDS' runs at a few blocks (framework_step_records.py --shallow): what the live test reruns."""

# issue 8: 8B at 8 and 128 ranks, 70B at 64 ranks, seq 4096 and 8192, micro-batch 1-2.
ISSUE_SIZES = {("llama-3.1-8b", 8), ("llama-3.1-8b", 128), ("llama-3.1-70b", 64)}


def _record_files() -> list[Path]:
    return sorted(RECORDS.glob("*.json")) + sorted(SHALLOW_RECORDS.glob("*.json"))


def _accuracy():
    sys.path.insert(0, str(BENCHMARKS))
    import framework_accuracy

    return framework_accuracy


def test_records_cover_the_issue_sizes_for_every_framework() -> None:
    records = load_step_records(RECORDS)
    for framework in ("hf", "torchtune", "torchtitan"):
        sizes = {(r.model.name, r.world_size) for r in records if r.training.framework.value == framework}
        assert ISSUE_SIZES <= sizes, framework
    shapes = {(r.batch.seq_len, r.batch.micro_batch_size) for r in records}
    assert {(4096, 1), (8192, 2)} <= shapes


@pytest.mark.parametrize("path", _record_files(), ids=lambda p: p.stem)
def test_the_planner_allocated_peak_is_within_target_of_the_frameworks_step(path: Path) -> None:
    accuracy = _accuracy()
    record = FrameworkStepRecord.model_validate_json(path.read_text(encoding="utf-8"))
    breakdown = accuracy.memory_breakdown(accuracy.step_request(record))[0]
    assert abs(breakdown.allocated_peak_bytes - record.peak_bytes) <= accuracy.STEP_TARGET * record.peak_bytes


@pytest.mark.parametrize("path", _record_files(), ids=lambda p: p.stem)
def test_model_states_equal_the_planners_to_the_byte(path: Path) -> None:
    record = FrameworkStepRecord.model_validate_json(path.read_text(encoding="utf-8"))
    states = model_state_bytes(_accuracy().step_request(record))
    assert record.parameter_bytes == states.parameter_bytes
    assert record.gradient_bytes == states.gradient_bytes
    assert record.optimizer_state_bytes == states.optimizer_state_bytes


def test_each_record_peaks_before_the_optimizer_step_with_the_states_alive() -> None:
    # The tracked step is the second: AdamW's states exist from its start.
    for record in load_step_records(RECORDS) + load_step_records(SHALLOW_RECORDS):
        assert record.peak_by_category["opt"] == record.optimizer_state_bytes, record.name
        assert record.running_peak_bytes[record.peak_phase] == record.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("framework, policy", [("torchtune", "full"), ("torchtitan", "selective-op")])
def test_a_live_step_reproduces_its_committed_record(framework, policy) -> None:
    pytest.importorskip("torch")
    pytest.importorskip(framework, reason=f"{framework} is not installed (scripts/install-frameworks installs it)")
    from zeroplan.frameworks.step import run_step, step_training
    from zeroplan.specs import BatchSpec, StrategyKind

    sys.path.insert(0, str(BENCHMARKS))
    from framework_step_records import shallow_model

    # The 8B at a few blocks (SHALLOW_RECORDS): the frameworks' same code, seconds instead of a minute.
    record = run_step(shallow_model("llama-3.1-8b"), StrategyKind.fsdp_full_shard, step_training(framework, policy),
                      BatchSpec(seq_len=4096, micro_batch_size=1), 128)
    committed = FrameworkStepRecord.model_validate_json((SHALLOW_RECORDS / record.file_name).read_text(encoding="utf-8"))
    # Another release is other code: say so before comparing bytes (scripts/install-frameworks pins it).
    assert record.framework_version == committed.framework_version
    assert record.peak_bytes == committed.peak_bytes
    assert record.peak_by_category == committed.peak_by_category
    assert record.model_state_bytes == committed.model_state_bytes


@pytest.mark.parametrize("argv, field", [
    (["--strategy", "fsdp-full-shard", "--whole-step"], "--whole-step"),
    (["--framework", "torchtune", "--strategy", "ddp", "--whole-step"], "--strategy"),
    (["--framework", "hf", "--strategy", "fsdp-full-shard", "--whole-step", "--precision", "bf16-pure"], "--precision"),
    (["--framework", "torchtune", "--strategy", "fsdp-full-shard", "--whole-step", "--layers", "4"], "--layers"),
    (["--framework", "torchtune", "--strategy", "fsdp-full-shard", "--whole-step", "--rank", "8"], "--rank"),
    (["--strategy", "fsdp-full-shard", "--layers", "4"], "--layers"),
    (["--framework", "torchtune", "--strategy", "fsdp-full-shard", "--allocator-conf", ""], "--allocator-conf"),
    (["--framework", "torchtune", "--strategy", "fsdp-full-shard", "--whole-step", "--allocator-conf", "max_split_size_mb:1"],
     "max_split_size_mb"),
])
def test_bad_whole_step_input_is_one_line_and_exit_2(capsys, argv, field) -> None:
    pytest.importorskip("torch")
    from zeroplan.cli.main import main

    code = main(["simulate", "llama-3.1-8b", "--world-size", "8", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and field in err, err


def test_the_local_shard_of_a_dtensor_is_where_the_adapter_reads_it() -> None:
    """Fails when a torch release moves DTensor._local_tensor (zeroplan/simulate/_torch_private.py)."""
    torch = pytest.importorskip("torch")
    from torch.distributed.tensor import DTensor, Shard

    from zeroplan.simulate import _torch_private as private
    from zeroplan.simulate.fake_world import device_mesh, fake_process_group

    with fake_process_group(4, 1):
        mesh = device_mesh(4)
        with private.fake_tensor_mode():
            local = torch.empty(3, 5)
            sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            assert sharded.shape == (12, 5)
            shard = private.dtensor_local_storage(sharded)
            assert shard.shape == (3, 5) and not isinstance(shard, DTensor)
            assert private.storage_key(shard) == private.storage_key(local)
            assert private.dtensor_local_storage(local) is local


@pytest.mark.slow
def test_a_whole_step_replays_its_allocations_through_the_allocator_model(monkeypatch) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("torchtune", reason="torchtune is not installed (scripts/install-frameworks installs it)")
    from zeroplan.frameworks.step import run_step, step_training
    from zeroplan.specs import BatchSpec, StrategyKind

    from zeroplan.allocator.capacity import oom_capacity
    from zeroplan.allocator.config import parse_alloc_conf
    from zeroplan.frameworks import step as step_module
    from zeroplan.frameworks.step_record import AllocatorFigures

    # At 8 blocks: with FSDP2's all-gather outputs living as wait_for_unshard keeps them, and
    # torchtune's head unit the output projection alone, the planner is 1.6-1.8 % below at 4, 8
    # and 32 blocks under either conf (benchmarks/framework_depth_capacity.py prints 2-32; the full
    # 32 blocks, about 45 s a run here, are left to it). At 2 blocks the default conf's bisection
    # lands above a window of capacities on which the planner's trace fails again (it completes
    # from about 4 % above the replay's), not checked here.
    blocks = 8
    sys.path.insert(0, str(BENCHMARKS))
    from framework_step_records import shallow_model

    args = (shallow_model("llama-3.1-8b", blocks), StrategyKind.fsdp_full_shard, step_training("torchtune", "full"),
            BatchSpec(seq_len=1024, micro_batch_size=1), 8)
    # One fake step: its recorded trace is replayed again under expandable segments (what a
    # second run_step with that conf would do, after recording the same trace again).
    traces = []

    def recorded(trace, config):  # noqa: ANN001, ANN202
        traces.append(trace)
        return oom_capacity(trace, config)

    monkeypatch.setattr(step_module, "oom_capacity", recorded)
    record = run_step(*args, allocator_conf="")
    figures = record.allocator
    verdict = oom_capacity(traces[0], parse_alloc_conf("expandable_segments:True"))
    expandable = record.model_copy(update={"allocator": AllocatorFigures(
        alloc_conf="expandable_segments:True", cublas_workspace_bytes=figures.cublas_workspace_bytes,
        events=figures.events, requested_peak_bytes=verdict.unlimited.requested_peak_bytes,
        reserved_peak_bytes=verdict.unlimited.reserved_peak_bytes, oom_capacity_bytes=verdict.oom_capacity_bytes)})
    # The recorder's peak counts every storage, the two 32 MiB cuBLAS workspaces included: at
    # least what FSDPMemTracker holds at its peak, which it counts from the same storages.
    assert figures.requested_peak_bytes >= record.peak_bytes
    assert figures.requested_peak_bytes <= figures.oom_capacity_bytes <= figures.reserved_peak_bytes + 2 * 2**20
    assert expandable.allocator.requested_peak_bytes == figures.requested_peak_bytes
    # fit --allocator-conf on the same request: the planner's FSDP2 schedule finds the OOM
    # capacity within 3 % of this step's (the coarse schedule before it was 10.9 % low at 32
    # blocks; the unit-by-unit one 3.4 % there and 14.1 % at 8 before the all-gather lifetimes).
    accuracy = _accuracy()
    for record in (figures, expandable.allocator):
        request = accuracy.step_request(expandable)
        request = request.with_allocator_conf(record.alloc_conf).with_exact_capacity()
        planned = accuracy.memory_breakdown(request)[0].oom_capacity_bytes
        assert abs(planned / record.oom_capacity_bytes - 1) <= 0.03, (record.alloc_conf, planned, record.oom_capacity_bytes)
