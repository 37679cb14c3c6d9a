"""When the data- and tensor-parallel collectives run (PerformanceAssumptions.overlap_grad_reduce,
overlap_param_gather, tp_comm_overlap; zeroplan.core.communication.scheduled): each moves a
collective between phases or off the critical path and changes the step by what that hides."""

from __future__ import annotations

import pytest

from zeroplan.core.communication import Phase, collectives
from zeroplan.core.parallel.collectives import model_parallel_collectives, overlapped_model_parallel_collectives
from zeroplan.core.timing import collective_time_s, step_time
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, GpuSpec, LinkSpec, PerformanceAssumptions, PlanRequest, StrategyKind, StrategySpec, ZeroGradientReduce,
    cluster_from_gpus,
)
from zeroplan.specs.framework import Framework
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.units import GiB

LINK = LinkSpec(name="l", bandwidth_bytes_per_s=400e9, latency_s=0.0)
GPU = GpuSpec(name="t", display_name="t", memory_bytes=80 * GiB, peak_bf16_flops_per_s=1e15,
              intra_node_link=LINK, inter_node_link=LINK, host_link=LINK, source="test")


def _request(kind: StrategyKind, tp: int = 1, **performance: bool) -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-2-7b"), batch=BatchSpec(micro_batch_size=1, seq_len=4096),
        cluster=cluster_from_gpus(GPU, 8), strategy=StrategySpec(kind=kind),
        parallel=ParallelSpec(tp=tp, sequence_parallel=tp > 1), performance=PerformanceAssumptions(**performance),
    )


def _step(request: PlanRequest):  # type: ignore[no-untyped-def]
    return step_time(request, tuple(collectives(request)))


def test_gradients_reduced_after_the_backward_are_exposed_in_full() -> None:
    overlapped = _request(StrategyKind.zero1, overlap_grad_reduce=True)
    after = _request(StrategyKind.zero1, overlap_grad_reduce=False)
    assert collectives(after) == collectives(_request(StrategyKind.zero1))  # DeepSpeed's default (below)
    gradients = next(c for c in collectives(overlapped) if c.what == "gradients")
    assert gradients.phase is Phase.backward
    moved = next(c for c in collectives(after) if c.what == "gradients")
    assert moved.phase is Phase.step
    seconds = collective_time_s(after, moved)
    assert seconds < _step(overlapped).backward_compute_s  # so the backward hid all of it
    # Hidden behind the backward before, every second of it is on the step now.
    assert _step(after).exposed_communication_s == pytest.approx(_step(overlapped).exposed_communication_s + seconds)


def test_the_parameter_gather_overlapping_the_next_forward_leaves_the_step() -> None:
    exposed, overlapped = _request(StrategyKind.zero1), _request(StrategyKind.zero1, overlap_param_gather=True)
    gather = next(c for c in collectives(exposed) if c.what == "parameters")
    assert gather.phase is Phase.step
    assert next(c for c in collectives(overlapped) if c.what == "parameters").phase is Phase.forward
    seconds = collective_time_s(exposed, gather)
    assert seconds < _step(exposed).forward_compute_s  # so the forward hides all of it
    assert _step(overlapped).step_with_overlap_s == pytest.approx(_step(exposed).step_with_overlap_s - seconds)


def test_tensor_parallel_collectives_overlapping_the_gemms_leave_the_critical_path() -> None:
    blocking, overlapped = _request(StrategyKind.ddp, tp=2), _request(StrategyKind.ddp, tp=2, tp_comm_overlap=True)
    activations = [c for c in collectives(blocking) if c.what == "tensor-parallel activations"]
    assert activations and all(c.blocking for c in activations)
    assert not any(c.blocking for c in collectives(overlapped) if c.what == "tensor-parallel activations")
    seconds = sum(collective_time_s(blocking, c) for c in activations)
    assert _step(overlapped).model_parallel_communication_s == pytest.approx(
        _step(blocking).model_parallel_communication_s - seconds)
    assert _step(overlapped).step_with_overlap_s < _step(blocking).step_with_overlap_s


@pytest.mark.parametrize("kind", [StrategyKind.ddp, StrategyKind.fsdp_full_shard])
@pytest.mark.parametrize("tp, overlap", [(1, False), (2, False), (2, True), (4, False)])
def test_the_overlapped_model_parallel_collectives_are_the_non_blocking_ones_in_order(kind, tp, overlap) -> None:
    # What the plan search's communication phases take (search._phase_seconds), built without
    # the blocking ones where it can: the same collectives, in the same order.
    request = _request(kind, tp=tp, tp_comm_overlap=overlap)
    expected = [c for c in model_parallel_collectives(request) if not c.blocking]
    assert overlapped_model_parallel_collectives(request) == expected
    assert expected or tp == 1


def test_left_unset_the_stack_decides_when_gradients_are_reduced() -> None:
    # hf and the reference transformer run ZeRO-1/2 through DeepSpeed, whose overlap_comm is on
    # for stage 3 only (zeroplan.core.communication.overlaps_grad_reduce); the reference's
    # per-unit ZeRO reduces from its backward hooks.
    def phase(kind: StrategyKind, framework: Framework, **strategy: object) -> Phase:
        request = _request(kind)
        request = request.model_copy(update={
            "training": request.training.model_copy(update={"framework": framework}),
            "strategy": request.strategy.model_copy(update=strategy)})
        # The gradients' reduction (DeepSpeed's state convention, hf's ZeRO, adds a "gradient norm" all-reduce).
        return next(c for c in collectives(request) if c.what == "gradients").phase

    assert phase(StrategyKind.zero2, Framework.hf) is Phase.step
    assert phase(StrategyKind.zero1, Framework.hf) is Phase.step
    assert phase(StrategyKind.zero3, Framework.hf) is Phase.backward
    assert phase(StrategyKind.zero2, Framework.zeroplan) is Phase.step
    assert phase(StrategyKind.zero2, Framework.zeroplan, deepspeed_overlap_comm=True) is Phase.backward
    assert phase(StrategyKind.zero2, Framework.zeroplan, zero_gradient_reduce=ZeroGradientReduce.per_unit) is Phase.backward
    assert phase(StrategyKind.fsdp_full_shard, Framework.zeroplan) is Phase.backward


def test_the_cli_flags_set_the_assumptions() -> None:
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser

    parser = build_parser()
    base = ["compare", "llama-2-7b", "--gpus", "8", "--gpu", "h100-80gb"]
    unset = request_from_args(parser.parse_args(base)).performance
    assert (unset.overlap_grad_reduce, unset.overlap_param_gather, unset.tp_comm_overlap) == (None, False, False)
    given = request_from_args(parser.parse_args(
        [*base, "--no-overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap"])).performance
    assert (given.overlap_grad_reduce, given.overlap_param_gather, given.tp_comm_overlap) == (False, True, True)
    assert request_from_args(parser.parse_args([*base, "--overlap-grad-reduce"])).performance.overlap_grad_reduce is True
