"""DeepSpeed's unpartitioned optimizer (zero_optimization.stage 0: the ddp strategy under the
deepspeed state convention) against DeepSpeed's own engine, to the byte: the committed records
of benchmarks/deepspeed_accumulation_records.py --stages 0 (fp32, bf16-mixed, fp16-mixed,
accumulation 1 and 2, both ranks). Reads JSON only: DeepSpeed is not run here."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from zeroplan.core.communication import collectives
from zeroplan.core.deepspeed_stage0 import allreduce_bucket_bytes, allreduce_bucket_elements, runs_deepspeed_stage0
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.peak import peak_moments
from zeroplan.core.plan import peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.specs import BatchSpec, Precision, StateConvention, StrategyKind, TrainingSpec
from zeroplan.results import PeakMoment
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.validate.rows import planner_request

RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed-accumulation-records"


@cache
def _runs() -> list[tuple[int, dict]]:
    runs = []
    for path in sorted(RECORDS.glob("records-zero0-*.json")):
        for rank, rank_runs in enumerate(json.loads(path.read_text())["ranks"]):
            runs += [(rank, run) for run in rank_runs]
    return runs


def _request(run: dict, precision: str | None = None):
    training = TrainingSpec(precision=Precision(precision or run["precision"]), state_convention=StateConvention.deepspeed)
    batch = BatchSpec(micro_batch_size=run["micro_batch"], seq_len=run["seq_len"], grad_accum_steps=run["grad_accum"])
    return planner_request(HARNESS_PRESETS[run["model"]], training, batch, StrategyKind.ddp, run["world_size"])


def _name(item: tuple[int, dict]) -> str:
    rank, run = item
    return f"zero0-{run['precision']}-k{run['grad_accum']}-r{rank}"


def test_the_records_cover_the_grid() -> None:
    runs = [run for _, run in _runs()]
    assert {(run["precision"], run["grad_accum"]) for run in runs} == {
        (p, k) for p in ("fp32", "bf16-mixed", "fp16-mixed") for k in (1, 2)}
    # The wrapper DeepSpeed chose: FP16_UnfusedOptimizer under 16 bits, the torch AdamW in fp32.
    assert {run["precision"]: run["optimizer_class"] for run in runs} == {
        "fp32": "AdamW", "bf16-mixed": "FP16_UnfusedOptimizer", "fp16-mixed": "FP16_UnfusedOptimizer"}


@pytest.mark.parametrize("item", _runs(), ids=_name)
def test_planner_equals_deepspeed_stage0_at_every_moment(item) -> None:
    """Parameters, master and AdamW's states; the gradients between micro-steps, at the step and
    after it (the last recorded step, as the stage 1-3 records are read)."""
    _, run = item
    request = _request(run)
    assert runs_deepspeed_stage0(request)
    states, terms = peak_terms(request)
    moments = run["steps"][-1]
    for name, moment in moments.items():
        if name == "allreduce_buckets":
            continue
        assert moment["parameter_bytes"] == states.parameter_bytes, name
        assert moment["master_bytes"] + moment["optimizer_state_bytes"] == states.optimizer_state_bytes, name
    micro = [name for name in moments if name.startswith("micro")]
    assert len(micro) == run["grad_accum"] - 1
    for name in micro:
        assert moments[name]["buffer_bytes"] == terms.accumulated_gradients + terms.resident_buffers, moments[name]
    assert moments["at_step"]["buffer_bytes"] == terms.step_gradients + terms.resident_buffers
    assert moments["after_step"]["buffer_bytes"] == terms.resident_buffers == 0
    # The step's AdamW reads an fp32 gradient of every element: zeroplan's gradient here.
    fp32_gradients = moments["at_step"]["buffers"].get("master.grad", moments["at_step"]["buffers"]["param.grad"])
    assert fp32_gradients == states.gradient_bytes
    # Nothing else held: the script's own int64 token batch alone.
    batch = run["grad_accum"] * run["world_size"] * run["micro_batch"] * (run["seq_len"] + 1) * 8
    assert {moment["unnamed_tensor_bytes"] for name, moment in moments.items() if name != "allreduce_buckets"} == {batch}


@pytest.mark.parametrize("item", _runs(), ids=_name)
def test_the_allreduce_buckets_are_deepspeeds(item) -> None:
    """One flat bucket per all-reduce, in the model dtype: what the backward's end holds beside
    the gradients and what the communication sends (once per step, at the boundary)."""
    _, run = item
    request = _request(run)
    recorded = [bucket["bytes"] for bucket in run["steps"][-1]["allreduce_buckets"]]
    assert allreduce_bucket_bytes(request) == recorded
    _, terms = peak_terms(request)
    assert terms.backward_end_buffers == max(recorded)
    (reduce,) = collectives(request)
    assert (reduce.op.value, reduce.what, reduce.buffer_bytes, reduce.calls) == ("all_reduce", "gradients",
                                                                               sum(recorded), len(recorded))
    assert reduce.occurrences_per_step == 1


@pytest.mark.parametrize("numels, per_bucket, buckets", [
    ([3, 3, 3], 5, [6, 3]), ([3, 3, 3], 6, [9]), ([7], 5, [7]), ([2, 2], 4, [4]), ([], 5, []),
])
def test_a_bucket_is_flushed_once_it_passes_its_size(numels, per_bucket, buckets) -> None:
    """engine.py allreduce_no_retain: ``numel > numel_per_bucket`` after the tensor joins."""
    assert allreduce_bucket_elements(numels, per_bucket) == buckets


def test_stage0_is_not_torch_ddp() -> None:
    """The same request under torch DDP's convention keeps its reducer's bucket copies and an fp32
    parameter under autocast: stage 0 is planned apart, and below it under bf16."""
    run = _runs()[0][1]
    deepspeed = _request(run, "bf16-mixed")
    torch_ddp = deepspeed.model_copy(update={"training": deepspeed.training.model_copy(update={"state_convention": None})})
    assert not runs_deepspeed_stage0(torch_ddp)
    assert model_state_bytes(torch_ddp) != model_state_bytes(deepspeed)
    _, terms = peak_terms(deepspeed)
    assert terms.resident_buffers == 0 < peak_terms(torch_ddp)[1].resident_buffers


def test_the_step_is_stage0s_peak_moment_with_16_bit_gradients_alive() -> None:
    """Under bf16 the optimizer step holds both gradients (the peak's step moment has them)."""
    run = next(run for _, run in _runs() if run["precision"] == "bf16-mixed" and run["grad_accum"] == 2)
    states, terms = peak_terms(_request(run))
    step = peak_moments(states, terms, 2)[PeakMoment.optimizer_step]
    assert step.gradients == run["steps"][-1]["at_step"]["buffer_bytes"]


@pytest.mark.parametrize("update, field", [
    ({"training": {"precision": Precision.bf16_pure}}, "training.precision"),
    ({"parallel": ParallelSpec(tp=2)}, "parallel"),
])
def test_what_stage0_is_not_measured_with_is_refused(update, field) -> None:
    request = _request(_runs()[0][1])
    changes = {k: (request.training.model_copy(update=v) if k == "training" else v) for k, v in update.items()}
    with pytest.raises(ZeroplanError) as error:
        peak_terms(request.model_copy(update=changes))
    assert error.value.field == field


@pytest.mark.parametrize("item", [i for i in _runs() if i[0] == 0], ids=_name)
def test_the_allocator_step_holds_what_the_peak_moments_hold(item) -> None:
    """The caching-allocator replay's step (zeroplan.allocator.schedule) keeps the 16-bit
    gradients through the step beside the fp32 copies, as the planner's step moment does: its
    requested peak is the planner's allocated peak."""
    from zeroplan.allocator.schedule import record_step, step_inputs
    from zeroplan.core.peak import peak_allocated_bytes

    _, run = item
    request = _request(run)
    states, terms = peak_terms(request)
    peak, _ = peak_allocated_bytes(states, terms, run["grad_accum"])
    assert record_step(step_inputs(request, states, terms)).requested_peak_bytes == peak
