"""DeepSpeed's ZeRO stages as a measured engine (torchrun, gloo, CPU): parameters after K steps
against single-process AdamW, and the recorded bytes against the layout docs/harness.md
explains (one flat group padded to 2N, fp32 master and gradient partitions, one bucket)."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from harness_runs import (
    DEEPSPEED_ACCUMULATING,
    DEEPSPEED_ACCUMULATION,
    DEEPSPEED_KEYS,
    DEEPSPEED_STRATEGIES,
    HPZ,
    MICRO_BATCH,
    OFFLOAD_COPIES,
    SEQ_LEN,
    STEPS,
)

from zeroplan.cli.main import main as zeroplan_main
from zeroplan.errors import ZeroplanError
from zeroplan.harness.model import build_model
from zeroplan.harness.oracle import oracle_parameters
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.harness.record import read_record
from zeroplan.specs import StateConvention
from zeroplan.validate.compare import compare_record

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation 'deepspeed==0.19.8')",
)

MODEL = "micro-llama"
RUNS, ACCUMULATION, ACCUMULATION_RUNS = DEEPSPEED_STRATEGIES, DEEPSPEED_ACCUMULATION, DEEPSPEED_ACCUMULATING


@pytest.fixture(scope="module")
def runs(measured) -> dict[tuple, Path]:
    """Every run below by its key, launched with the other runs of its world size
    (tests/harness/conftest.py, harness_runs.py DEEPSPEED_KEYS: DeepSpeed's import and gloo's
    start cost far more than a micro model's run)."""
    return {key: measured(run) for key, run in DEEPSPEED_KEYS.items()}


@functools.cache
def _oracle(nproc: int, grad_accum_steps: int = 1) -> dict[str, torch.Tensor]:
    """Single-process AdamW's parameters, computed once per setting (only read below)."""
    return oracle_parameters(HARNESS_PRESETS[MODEL], STEPS, nproc, MICRO_BATCH, SEQ_LEN, grad_accum_steps=grad_accum_steps)


def _numels() -> list[int]:
    return [p.numel() for p in build_model(HARNESS_PRESETS[MODEL]).parameters()]


def _last_step(path: Path):
    record = read_record(path)
    assert record.complete and len(record.steps) == STEPS
    return record, record.steps[-1]


def _collective_bytes(step, op: str, phase: str) -> int:
    return sum(c.num_bytes for c in step.collectives if c.op == op and c.phase == phase)


@needs_deepspeed
@pytest.mark.parametrize("strategy,nproc", RUNS)
def test_parameters_match_single_process_adamw(runs, strategy, nproc) -> None:
    measured = torch.load(runs[(strategy, nproc)] / "parameters.pt")
    expected = _oracle(nproc)
    assert measured.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(measured[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@needs_deepspeed
@pytest.mark.parametrize("strategy,nproc", ACCUMULATION_RUNS)
def test_accumulating_runs_match_single_process_adamw_over_the_whole_batch(runs, strategy, nproc) -> None:
    """DeepSpeed driven as its training loop drives it (backward and step every micro-batch, the
    optimizer stepping at the boundary) computes the step of the whole accumulated batch."""
    measured = torch.load(runs[(strategy, nproc, ACCUMULATION)] / "parameters.pt")
    expected = _oracle(nproc, ACCUMULATION)
    assert measured.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(measured[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    record = read_record(runs[(strategy, nproc, ACCUMULATION)] / "rank00000.json")
    assert record.description.batch.grad_accum_steps == ACCUMULATION


@needs_deepspeed
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_stage_1_and_2_bytes_are_one_flat_group(runs, strategy) -> None:
    """deepspeed/runtime/zero/stage_1_and_2.py: one fp32 flat buffer of psi elements padded to a
    multiple of 2N; the rank's fp32 gradient partition is what AdamW reads (at both stages); the
    bucket of gradients is all-reduced (unpadded), then the flat parameters all-gathered."""
    nproc, psi = 2, sum(_numels())
    padded = math.ceil(psi / (2 * nproc)) * 2 * nproc
    partition = padded // nproc
    for path in sorted(runs[(strategy, nproc)].glob("rank*.json")):
        record, step = _last_step(path)
        assert record.description.training.state_convention is StateConvention.deepspeed
        states = step.model_state
        assert states.parameters_bytes == 4 * padded
        assert states.gradients_bytes == 4 * partition
        # fp32 master + exp_avg + exp_avg_sq of the partition, one 4-byte step counter.
        assert states.optimizer_states_bytes == 3 * 4 * partition + 4
        assert _collective_bytes(step, "all_reduce", "forward_backward") == 4 * psi
        assert _collective_bytes(step, "reduce_scatter", "forward_backward") == 0
        assert _collective_bytes(step, "all_gather", "step") == 4 * padded


@needs_deepspeed
@pytest.mark.parametrize("nproc", [2, 4])
def test_stage_3_bytes_are_per_parameter_partitions(runs, nproc) -> None:
    """deepspeed/runtime/zero/partition_parameters.py pads each parameter to a multiple of N;
    stage3.py keeps a gradient partition buffer and a reduce bucket (psi elements here) and
    hands AdamW an fp32 copy of the partition."""
    numels = _numels()
    psi, partition = sum(numels), sum(math.ceil(n / nproc) for n in numels)
    for path in sorted(runs[("zero3", nproc)].glob("rank*.json")):
        _, step = _last_step(path)
        states = step.model_state
        assert states.parameters_bytes == 4 * partition
        # The fp32 partition AdamW reads; the reduce bucket (psi) and the gradient partition
        # buffer are buffers, as the planner counts them (total unchanged).
        assert states.gradients_bytes == 4 * partition
        assert states.buffers_bytes == 4 * (psi + partition)
        assert states.total_bytes == states.parameters_bytes + 4 * (psi + 2 * partition) + states.optimizer_states_bytes
        assert states.optimizer_states_bytes == 3 * 4 * partition + 4
        # Each parameter gathered before its forward and again before its backward.
        assert _collective_bytes(step, "all_gather", "forward_backward") == 2 * 4 * nproc * partition
        assert _collective_bytes(step, "all_reduce", "forward_backward") == 0


@needs_deepspeed
@pytest.mark.parametrize("strategy", ["zero2-offload", "zero3-offload"])
def test_offload_keeps_master_gradient_and_adam_states_on_the_host(runs, strategy) -> None:
    """offload_optimizer cpu: fp32 master, gradient partition and AdamW states on the host
    (16 bytes/element, as the planner), plus DeepSpeed's host staging buffers: stage 2 a copy of
    the working partition and a largest-parameter gradient buffer, stage 3 its gradient
    partition buffer (stage_1_and_2.py, stage3.py)."""
    numels = _numels()
    psi = sum(numels)
    stage_2 = strategy == "zero2-offload"
    partition = math.ceil(psi / 4) * 4 // 2 if stage_2 else sum(math.ceil(n / 2) for n in numels)
    record, step = _last_step(runs[(strategy, 2)] / "rank00000.json")
    states = step.model_state
    staging = 4 * partition + 4 * max(numels) if stage_2 else 4 * partition
    assert states.host_bytes == 16 * partition + 4 + staging
    assert states.optimizer_states_bytes == 0
    # On the device, buffers: the largest-parameter staging buffer (stage 2), the reduce bucket
    # (stage 3); no gradient stays on the device.
    assert states.gradients_bytes == 0
    assert states.buffers_bytes == (4 * max(numels) if stage_2 else 4 * psi)
    rows = {row.quantity: row for row in compare_record(record)}
    # The planner: the same 16 bytes/element, one step counter per unit (DeepSpeed: one) and the
    # same staging buffers on each side (zeroplan.core.deepspeed_offload).
    units = 2 + HARNESS_PRESETS[MODEL].num_layers
    assert rows["host (offloaded)"].predicted_bytes == 16 * partition + 4 * units + staging
    assert rows["buffers (kept)"].predicted_bytes == states.buffers_bytes


@needs_deepspeed
def test_planner_matches_parameters_and_optimizer_states_at_two_ranks(runs) -> None:
    """At N = 2 micro-llama needs no padding, so the planner's deepspeed convention (fp32 master
    included) equals DeepSpeed up to the step counters (one flat tensor, not one per unit)."""
    for strategy in ("zero1", "zero2", "zero3"):
        record, _ = _last_step(runs[(strategy, 2)] / "rank00000.json")
        rows = {row.quantity: row for row in compare_record(record)}
        assert rows["parameters"].measured_bytes == rows["parameters"].predicted_bytes
        # stage 1 as stage 2: one micro-batch per step keeps only the fp32 partition; stage 3's
        # bucket and partition buffer are buffers on both sides
        assert rows["gradients"].measured_bytes == rows["gradients"].predicted_bytes
        if strategy == "zero3":
            assert rows["buffers (kept)"].measured_bytes == rows["buffers (kept)"].predicted_bytes
        units = 2 + HARNESS_PRESETS[MODEL].num_layers
        assert rows["optimizer states"].predicted_bytes - rows["optimizer states"].measured_bytes == 4 * (units - 1)


@pytest.mark.slow  # launches torchrun
@needs_deepspeed
def test_measure_command_runs_deepspeed_zero2_bf16(tmp_path, capsys) -> None:
    code = zeroplan_main(["measure", MODEL, "--strategy", "zero2", "--engine", "deepspeed", "--nproc", "2",
                          "--steps", "2", "--seq-len", "16", "--precision", "bf16-mixed", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    step = read_record(tmp_path / "rank00000.json").steps[-1]
    psi = sum(_numels())
    partition = math.ceil(psi / 4) * 4 // 2
    # bf16 working parameters, fp32 gradient partition, fp32 master + Adam states.
    assert step.model_state.parameters_bytes == 2 * 2 * partition
    assert step.model_state.gradients_bytes == 4 * partition
    assert _collective_bytes(step, "all_reduce", "forward_backward") == 2 * psi
    assert {c.dtype for c in step.collectives if c.phase == "forward_backward"} == {"bfloat16"}


def test_measure_without_deepspeed_fails_before_launching(tmp_path, monkeypatch, capsys) -> None:
    import zeroplan.harness.engines_table as table

    monkeypatch.setattr(table, "_module_installed", lambda name: False)
    assert zeroplan_main(["measure", MODEL, "--strategy", "zero2", "--engine", "deepspeed", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "engine:" in err and "DS_BUILD_OPS=0" in err
    assert not list(tmp_path.iterdir())


def test_missing_deepspeed_is_a_one_line_engine_error(monkeypatch) -> None:
    from zeroplan.harness.deepspeed_engine import import_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` raise ImportError
    with pytest.raises(ZeroplanError) as error:
        import_deepspeed()
    message = str(error.value)
    assert "\n" not in message and "engine" in message and "DS_BUILD_OPS=0" in message


@needs_deepspeed
def test_hpz_secondary_partition_equals_the_planner_to_the_byte(runs) -> None:
    """DeepSpeed 0.19.8's own hpZ (zero_hpz_partition_size 2 over 4 ranks, CPU, gloo): the
    secondary partition each rank holds from the forward through the backward, gone after the
    step, equals zeroplan.core.zero3_groups.hpz_secondary_partition_bytes; the primary partition
    and the optimizer states are stage 3's over all four ranks."""
    from zeroplan.core.model_states import model_state_bytes
    from zeroplan.core.zero3_groups import hpz_secondary_partition_bytes
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.specs import (
        BatchSpec,
        PlanRequest,
        Precision,
        StrategyKind,
        StrategySpec,
        TrainingSpec,
        cluster_from_gpus,
    )

    request = PlanRequest(
        model=HARNESS_PRESETS[MODEL], batch=BatchSpec(micro_batch_size=MICRO_BATCH, seq_len=SEQ_LEN),
        training=TrainingSpec(precision=Precision.fp32, state_convention=StateConvention.deepspeed),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), 4, gpus_per_node=4),
        strategy=StrategySpec(kind=StrategyKind.zero3_hpz, hpz_partition_size=HPZ),
    )
    predicted = hpz_secondary_partition_bytes(request)
    states = model_state_bytes(request)
    numels = _numels()
    assert predicted == sum(math.ceil(n / 4) * 4 // 2 * 4 for n in numels)
    for rank in range(4):
        record = json.loads((runs[("hpz", 4)] / f"rank{rank}.json").read_text())
        for step in record["steps"]:
            assert step["after_forward"] == step["after_backward"] == predicted
            assert step["after_step"] == 0
        assert 4 * record["primary_elements"] == states.parameter_bytes
        # fp32 master + exp_avg + exp_avg_sq; DeepSpeed's one step counter against one per unit.
        units = 2 + HARNESS_PRESETS[MODEL].num_layers
        assert states.optimizer_state_bytes - record["optimizer_state_bytes"] == 4 * (units - 1)


def _offload_request(kind, accum: int):
    from zeroplan.harness.presets import HARNESS_PRESETS
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.specs import (
        BatchSpec,
        PlanRequest,
        Precision,
        StateConvention,
        StrategySpec,
        TrainingSpec,
        cluster_from_gpus,
    )

    return PlanRequest(
        model=HARNESS_PRESETS["micro-llama"], batch=BatchSpec(micro_batch_size=2, seq_len=16, grad_accum_steps=accum),
        training=TrainingSpec(precision=Precision.bf16_mixed, state_convention=StateConvention.deepspeed),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), 2, gpus_per_node=2), strategy=StrategySpec(kind=kind),
    )


@needs_deepspeed
def test_offload_copies_match_deepspeed_to_the_parameter(runs) -> None:
    """The host-link bytes zeroplan.core.deepspeed_offload_time prices against the copies DeepSpeed
    0.19.8's own optimizer offload makes (CPU, gloo, two ranks; tests/harness/offload_copies_worker.py
    counts every aten.copy_ into or out of the optimizer's host buffers)."""
    from zeroplan.core.communication import Phase
    from zeroplan.core.deepspeed_offload_time import deepspeed_offload_transfer_bytes
    from zeroplan.core.timing import offloaded_optimizer_elements
    from zeroplan.specs import StrategyKind

    kinds = {2: StrategyKind.zero2_offload, 3: StrategyKind.zero3_offload}
    out = runs[("offload-copies", 2)]
    records = {(stage, accum): [json.loads((out / f"rank{rank}-stage{stage}-accum{accum}.json").read_text())
                                for rank in range(2)] for stage, accum in OFFLOAD_COPIES}
    for (stage, accum), ranks in records.items():
        request = _offload_request(kinds[stage], accum)
        elements = offloaded_optimizer_elements(request)
        moved = deepspeed_offload_transfer_bytes(request, elements)
        for record in ranks:
            measured = record["bytes"]
            assert record["partition_elements"] == elements
            # The bf16 partition goes up once after the CPU step; stage 2 casts it on the host first
            # (bit16_partition_buffer.copy_, 2 B written per element).
            assert measured["step up"] == 2 * elements
            assert measured.get("step host", 0) == (2 * elements if stage == 2 else 0)
            if stage == 2:
                # No overlap_comm: the gradient copies are charged to the step phase; the model
                # prices the partition's elements, DeepSpeed's accumulation copies move whole
                # parameters that touch it (16 elements of one more here, each micro-batch).
                gradient = moved[Phase.step] - measured["step up"]
                extra = 2 * 16 * (2 * accum - 1) if accum > 1 else 0
                assert measured["backward down"] + measured.get("backward up", 0) == gradient + extra
                assert measured["backward down"] == 4 * elements + (accum * (2 * elements + 32) if accum > 1 else 0)
            else:
                assert moved[Phase.step] == measured["step up"]
                # Seen on the CPU accelerator: the first micro-batch's bf16 copy down and the fp32
                # copy at the boundary. The later micro-batches' round trips take stage3.py's
                # on_accelerator branch here (the host is the device) and add in place; on a GPU
                # they come up and go down again: 2 x 2 B per element each, in the model.
                assert measured["backward down"] == 2 * elements + 4 * elements
                assert moved[Phase.backward] == measured["backward down"] + 2 * elements + (accum - 1) * 2 * 2 * elements


@needs_deepspeed
def test_the_saved_group_records_are_this_releases_engine(runs) -> None:
    """tests/harness/groups_worker.py on the installed DeepSpeed (2 ranks) calls the same
    collectives on the same groups as benchmarks/deepspeed-groups-records (tests/test_deepspeed_groups.py
    checks the planner's communicators against those)."""
    import importlib.metadata

    saved = Path(__file__).resolve().parents[2] / "benchmarks" / "deepspeed-groups-records"
    release = importlib.metadata.version("deepspeed")
    for rank in range(2):
        live = json.loads((runs[("groups", 2)] / f"rank{rank}.json").read_text())
        recorded = json.loads((saved / release / f"rank{rank}.json").read_text())
        assert live["calls"] == recorded["calls"] and live["group_sizes"] == recorded["group_sizes"]
