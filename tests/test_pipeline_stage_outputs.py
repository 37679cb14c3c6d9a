"""The stage outputs torch's pipeline schedules hold (zeroplan.core.parallel.activations
pipeline_stage_output_bytes): in flight under torchtitan 0.3.0 (torch 2.13, return_outputs=False),
every micro-batch's on every stage under 9dec370 (torch 2.6.0's output_chunks); and the stages
whose FSDP gradients accumulate at once (zeroplan.core.parallel.units
accumulating_trainable_elements); the receive buffers every stage keeps per micro-batch and the
input gradients held at the in-flight peak (pipeline_receive_buffer_bytes,
pipeline_input_gradient_bytes); against torch's own schedules on a fake process group
(benchmarks/torchtitan_pipeline_outputs.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from zeroplan.cli.fit import check_options_apply, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.parallel.activations import (
    pipeline_input_gradient_bytes,
    pipeline_receive_buffer_bytes,
    pipeline_received_input_bytes,
    pipeline_stage_output_bytes,
)
from zeroplan.core.parallel.pipeline import in_flight_chunks
from zeroplan.core.parallel.units import (
    accumulating_trainable_elements,
    rank_trainable_elements,
)
from zeroplan.specs.parallel import PipelineSchedule
from zeroplan.specs.strategy import StrategyKind

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
BF16 = 2
MICRO, SEQ, HIDDEN, VOCAB, TP, PP = 4, 8192, 16384, 128256, 8, 8
RESIDUAL = BF16 * MICRO * SEQ * HIDDEN // TP
"""A stage's output: the sequence-parallel residual stream of Llama-3.1-405B (128 MiB)."""
LOGITS = BF16 * MICRO * SEQ * (VOCAB // TP)
"""The last stage's: its bf16 logits, vocab-sharded under loss_parallel."""


@functools.cache
def _request(schedule: str, *release: str, microbatches: int = 8):
    args = build_parser().parse_args([
        "fit", "llama-3.1-405b", "--gpus", "512", "--gpu", "h100-80gb", "--micro-batch", str(MICRO),
        "--seq-len", str(SEQ), "--grad-accum", str(microbatches), "--activation-checkpointing", "full", "--framework", "torchtitan",
        "--tp", str(TP), "--pp", str(PP), "--pp-schedule", schedule, "--unchunked-loss", *release])
    check_options_apply(args)
    return request_from_args(args, StrategyKind.fsdp_full_shard)


def _outputs(request, rank: int) -> int:
    at = request.at_pipeline_rank(rank)
    return pipeline_stage_output_bytes(at, in_flight_chunks(at.parallel, rank, at.batch.grad_accum_steps))


def test_in_flight_micro_batches_hold_their_stage_outputs_under_0_3_0() -> None:
    request = _request("1f1b")
    # 1F1B: p - r in flight; the last stage's one is its loss's logits, which the loss counts.
    assert [_outputs(request, rank) for rank in range(PP)] == [(PP - rank) * RESIDUAL for rank in range(PP - 1)] + [0]


def test_9dec370_keeps_every_micro_batchs_output_on_every_stage() -> None:
    one = _request("1f1b", "--torchtitan-release", "9dec370")
    assert [_outputs(one, rank) for rank in range(PP - 1)] == [8 * RESIDUAL] * (PP - 1)
    # The last stage: every micro-batch's logits, the one its loss is on included (the stage
    # holds it in fwd_cache through the loss's backward; the loss's terms count none).
    assert _outputs(one, PP - 1) == 8 * LOGITS
    interleaved = _request("interleaved-1f1b", "--torchtitan-release", "9dec370")
    assert interleaved.parallel.pp_schedule is PipelineSchedule.interleaved_1f1b
    assert _outputs(interleaved, 0) == 16 * RESIDUAL
    assert _outputs(interleaved, PP - 1) == 8 * RESIDUAL + 8 * LOGITS


def test_one_round_of_interleaved_1f1b_accumulates_one_stages_gradients_at_a_time() -> None:
    # Rank 7 runs stage 7 (blocks 56-63) and stage 15 (blocks 119-125 and the head).
    last = _request("interleaved-1f1b").at_pipeline_rank(PP - 1)
    block = (2 * HIDDEN * HIDDEN + 2 * 1024 * HIDDEN + 3 * HIDDEN * 53248) // TP + 2 * HIDDEN
    assert accumulating_trainable_elements(last) == 8 * block
    assert rank_trainable_elements(last) == 15 * block + VOCAB // TP * HIDDEN + HIDDEN
    # Two rounds (m = 2p) alternate the stages: both accumulate.
    two_rounds = _request("interleaved-1f1b", microbatches=16).at_pipeline_rank(PP - 1)
    assert accumulating_trainable_elements(two_rounds) == rank_trainable_elements(two_rounds)
    assert accumulating_trainable_elements(_request("1f1b").at_pipeline_rank(0)) == rank_trainable_elements(
        _request("1f1b").at_pipeline_rank(0))


def _chunks(request, rank: int) -> int:
    return in_flight_chunks(request.at_pipeline_rank(rank).parallel, rank, request.batch.grad_accum_steps)


def test_every_stage_keeps_a_receive_buffer_per_micro_batch() -> None:
    one = _request("1f1b")
    # Rank 0 receives gradients only, the last rank activations only, the others both.
    assert [pipeline_receive_buffer_bytes(one.at_pipeline_rank(r)) for r in range(PP)] == (
        [8 * RESIDUAL] + [16 * RESIDUAL] * (PP - 2) + [8 * RESIDUAL])
    interleaved = _request("interleaved-1f1b")
    assert [pipeline_receive_buffer_bytes(interleaved.at_pipeline_rank(r)) for r in (0, 1, PP - 1)] == [
        24 * RESIDUAL, 32 * RESIDUAL, 24 * RESIDUAL]
    # They grow with the micro-batches, not with the chunks in flight.
    assert pipeline_receive_buffer_bytes(_request("1f1b", microbatches=16).at_pipeline_rank(1)) == 32 * RESIDUAL
    # A non-first stage's in-flight chunks saved their receive buffers as the first block's input.
    assert pipeline_received_input_bytes(one.at_pipeline_rank(0), _chunks(one, 0)) == 0
    assert pipeline_received_input_bytes(one.at_pipeline_rank(1), _chunks(one, 1)) == 7 * RESIDUAL
    assert pipeline_received_input_bytes(interleaved.at_pipeline_rank(0), _chunks(interleaved, 0)) == 8 * RESIDUAL


def test_input_gradients_held_at_the_in_flight_peak() -> None:
    # torch 2.6.0 (9dec370): every backward done so far left its input gradient on the buffer.
    one = _request("1f1b", "--torchtitan-release", "9dec370")
    assert [pipeline_input_gradient_bytes(one.at_pipeline_rank(r), _chunks(one, r)) // RESIDUAL
            for r in range(PP)] == [0, 1, 2, 3, 4, 5, 6, 7]
    interleaved = _request("interleaved-1f1b", "--torchtitan-release", "9dec370")
    assert [pipeline_input_gradient_bytes(interleaved.at_pipeline_rank(r), _chunks(interleaved, r)) // RESIDUAL
            for r in range(PP)] == [0, 0, 0, 0, 1, 3, 5, 7]
    # torch 2.13 (0.3.0): only Schedule1F1B's pending send of the previous backward's.
    assert [pipeline_input_gradient_bytes(_request("1f1b").at_pipeline_rank(r), 1) // RESIDUAL
            for r in (0, 1, PP - 1)] == [0, 1, 1]
    assert pipeline_input_gradient_bytes(_request("interleaved-1f1b").at_pipeline_rank(PP - 1), 9) == 0


def _measure():
    return load_script(ROOT / "benchmarks" / "torchtitan_pipeline_outputs.py").rank_outputs


@pytest.mark.slow
@pytest.mark.parametrize("schedule,planned", [("1F1B", PipelineSchedule.one_f_one_b),
                                              ("Interleaved1F1B", PipelineSchedule.interleaved_1f1b)])
def test_torchs_schedules_hold_one_output_per_chunk_in_flight(schedule: str, planned: PipelineSchedule) -> None:
    rank_outputs = _measure()
    request = _request(planned.value)
    for rank in (0, PP // 2, PP - 1):
        measured = rank_outputs(schedule, PP, 8, rank, return_outputs=False)
        at = request.at_pipeline_rank(rank)
        chunks = in_flight_chunks(at.parallel, rank, 8)
        # At every backward the live outputs are the chunks in flight; the largest is the planner's.
        assert all(outputs == in_flight for outputs, in_flight, _ in measured["at_backward"])
        assert max(in_flight for _, in_flight, _ in measured["at_backward"]) == chunks
        assert measured["after_step"] == 0
        # One receive buffer per micro-batch for each activation and gradient received, the
        # stage's input being the buffer itself; input gradients as the planner holds them.
        buffers = measured["activation_buffers"] + measured["gradient_buffers"]
        assert buffers * RESIDUAL == pipeline_receive_buffer_bytes(at)
        assert measured["inputs_in_buffers"][0] == measured["inputs_in_buffers"][1]
        at_peak = max(p for p in measured["at_backward"] if p[1] == chunks)
        assert at_peak[2] * RESIDUAL == pipeline_input_gradient_bytes(at, chunks)
        # One stage's gradients accumulate at a time on every rank (one round: m < 2p).
        assert measured["accumulating_stages"] == 1
    # Without return_outputs=False (9dec370's call) torch 2.13 keeps the last stage's m outputs too.
    assert rank_outputs(schedule, PP, 8, PP - 1)["after_step"] == 8
    if planned is PipelineSchedule.interleaved_1f1b:
        assert rank_outputs(schedule, PP, 16, 0, return_outputs=False)["accumulating_stages"] == 2


@pytest.mark.slow
def test_the_plan_search_follows_the_accumulators_across_rounds_and_plans_9dec370_pipelines_scalar() -> None:
    from zeroplan.core.search import (
        LayoutSpace,
        _at,
        _fit_group,
        evaluate,
        groups,
        scalar_evaluate,
    )
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.presets.models import get_model
    from zeroplan.specs import (
        BatchSpec,
        PlanRequest,
        StrategySpec,
        TrainingSpec,
        cluster_from_gpus,
    )

    base = PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 16),
                       strategy=StrategySpec(kind=StrategyKind.ddp), batch=BatchSpec(seq_len=2048), training=TrainingSpec())
    space = LayoutSpace(tp=1, pp=2, pp_schedules=(PipelineSchedule.interleaved_1f1b,))
    group = next(g for g in groups(base, space=space)
                 if g.request.parallel.virtual_stages == 2 and g.request.strategy.kind is StrategyKind.fsdp_full_shard)
    _fit_group(group)
    assert not group.scalar_only
    # One round below m = 2p = 4, two from it on: the accumulators change between.
    micro, accum = np.array([1, 3, 2, 1]), np.array([3, 4, 8, 17])
    peak, _, _ = evaluate(group, micro, accum)
    for k in range(len(micro)):
        assert abs(int(peak[k]) - scalar_evaluate(_at(group.request, int(micro[k]), int(accum[k])))[0]) <= 1
    from zeroplan.core.search import _build_group

    assert _build_group(_request("1f1b", "--torchtitan-release", "9dec370")).scalar_only
