"""A sequence-parallel block's forward collectives under torch's tensor-parallel styles
(zeroplan.core.parallel.sequence_parallel) as the planner's schedules allocate them."""

from __future__ import annotations

import functools

import pytest

from zeroplan.allocator.builder import TraceBuilder
from zeroplan.allocator import fsdp_schedule
from zeroplan.allocator.fsdp_schedule import run_sequence_parallel_forward
from zeroplan.allocator.schedule import step_trace
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.parallel.sequence_parallel import SublayerCollectives, sequence_parallel_forward_collectives
from zeroplan.core.plan import peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.specs import StrategyKind

TP = ("llama-3.1-8b --framework torchtitan --gpus 16 --gpu h100-80gb --tp 4 --micro-batch 2 --seq-len 4096 "
      "--activation-checkpointing full")


@functools.lru_cache(maxsize=None)
def _request(flags: str):
    return request_from_args(build_parser().parse_args(["fit", *flags.split()]), StrategyKind.fsdp_full_shard)



def test_a_block_gathers_and_scatters_whole_sequence_tensors() -> None:
    collectives = sequence_parallel_forward_collectives(_request(TP + " --compile"))
    whole = 2 * 4096 * 4096 * 2  # b s h in bf16
    assert (collectives.gathered, collectives.partial, collectives.shard) == (whole, whole, whole // 4)
    assert not collectives.held and not collectives.fused and collectives.recomputed
    float8 = sequence_parallel_forward_collectives(_request(TP + " --compile --float8 tensorwise"))
    assert float8.gathered == whole // 2 and float8.partial == whole  # torchao gathers in float8
    eager = sequence_parallel_forward_collectives(_request(TP))
    assert eager.held
    assert sequence_parallel_forward_collectives(_request(TP.replace("--tp 4", "--tp 1"))) is None
    # torch 2.13's funcol gathers dim 1 as a view at one sequence per micro-batch (0.3.0); the
    # December 2024 funcol of 9dec370's runs always concatenates.
    one = TP.replace("--micro-batch 2", "--micro-batch 1") + " --compile"
    assert collectives.gather_copy and not sequence_parallel_forward_collectives(_request(one)).gather_copy
    assert sequence_parallel_forward_collectives(_request(one + " --unchunked-loss --torchtitan-release 9dec370")).gather_copy


@pytest.mark.parametrize("held, fused, copy, allocations, peak", [
    (False, False, True, 5, 2), (True, False, True, 5, 3), (False, True, True, 3, 1), (True, True, True, 3, 2),
    (False, False, False, 4, 2), (True, False, False, 4, 3)])
def test_each_sublayer_allocates_and_frees_its_tensors(held: bool, fused: bool, copy: bool, allocations: int,
                                                       peak: int) -> None:
    # funcol's gather on dim 1: output, concatenated copy; its scatter: partial, copy, shard. Fused
    # (asynchronous TP): the gathered input, the stacked partials, the shard.
    whole = 1 << 30
    collectives = SublayerCollectives(whole, whole, whole // 8, recomputed=True, held=held, fused=fused, gather_copy=copy)
    b = TraceBuilder()
    run_sequence_parallel_forward(b, collectives)
    trace = b.trace("forward collectives")
    assert len(trace.events) == 2 * 2 * allocations  # two sublayers, every tensor freed
    assert trace.requested_peak_bytes() == max(collectives.peak(), peak * whole)


def test_the_collectives_fit_inside_the_steps_requested_peak(monkeypatch) -> None:
    # Scheduled only where the block's backward workspace holds them (forward_collectives): the
    # step's requested peak is the one without them.
    request = _request(TP + " --compile")
    trace = step_trace(request, *peak_terms(request))
    whole = 2 * 4096 * 4096 * 2
    assert sum(getattr(e, "size_bytes", 0) == whole for e in trace.events) >= 2 * 32 * 2 * 2
    monkeypatch.setattr(fsdp_schedule, "forward_collectives", lambda request, terms: None)
    assert step_trace(request, *peak_terms(request)).requested_peak_bytes() == trace.requested_peak_bytes()


def test_async_tp_needs_a_compiled_torchtitan_block() -> None:
    with pytest.raises(ZeroplanError, match="async_tp"):
        _request(TP + " --async-tp")
    assert sequence_parallel_forward_collectives(_request(TP + " --compile --async-tp")).fused
