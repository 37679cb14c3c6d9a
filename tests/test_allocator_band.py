"""A step's completion is not monotone in the device memory (a refused cudaMalloc frees the cache
and retries, and when that comes decides how the rest packs): the path bounds of a replay, the
band scan that finds the least memory a step completes on, and the verdict that says so."""

from __future__ import annotations

import pytest

from zeroplan.allocator.capacity import scan_band
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.device import DeviceAllocator
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, replay, run_ops
from zeroplan.units import MiB

# X 50 MiB freed to the cache; Y 60 MiB; Z 20 MiB; Y freed; W 80 MiB. On 110 MiB or more Y gets
# a segment of its own and Z splits X's cached segment, which W then cannot free: W needs 130 MiB
# in all. Below 110 MiB Y's cudaMalloc is refused, X's segment is freed and Y retried, Z takes a
# segment of its own, and W (Y's segment freed) needs Z's 20 + 80 MiB: completes from 100 MiB.
OPS = [(ALLOC_OP, 1, 50 * MiB, 0), (FREE_OP, 1, 0, 0), (ALLOC_OP, 2, 60 * MiB, 0), (ALLOC_OP, 3, 20 * MiB, 0),
       (FREE_OP, 2, 0, 0), (ALLOC_OP, 4, 80 * MiB, 0)]
CONFIG = parse_alloc_conf("")


@pytest.mark.parametrize(("capacity_mib", "completes"), [
    (98, False), (100, True), (109, True), (110, False), (129, False), (130, True), (190, True),
])
def test_completion_is_not_monotone_in_the_memory(capacity_mib: int, completes: bool) -> None:
    assert replay(OPS, CONFIG, capacity_mib * MiB).completed is completes


@pytest.mark.parametrize(("capacity_mib", "floor_mib", "ceiling_mib"), [(105, 100, 110), (115, 110, 130)])
def test_a_replay_knows_the_memories_it_goes_the_same_way_on(capacity_mib: int, floor_mib: int, ceiling_mib: int) -> None:
    device = DeviceAllocator(CONFIG, capacity_mib * MiB)
    run_ops(device, OPS, 0, {})
    assert (device.path_floor, device.path_ceiling) == (floor_mib * MiB, ceiling_mib * MiB)
    # Every memory in the bounds goes the same way; just outside them another.
    same = [replay(OPS, CONFIG, c).model_dump() for c in (floor_mib * MiB, ceiling_mib * MiB - 1)]
    assert same[0]["completed"] == same[1]["completed"] == replay(OPS, CONFIG, capacity_mib * MiB).completed
    assert replay(OPS, CONFIG, ceiling_mib * MiB).completed != same[0]["completed"]


@pytest.mark.parametrize(("low_mib", "high_mib", "expected_mib"), [
    (90, 200, 100), (110, 200, 130), (110, 129, None), (101, 200, 101), (50, 99, None),
])
def test_band_scan_finds_the_least_memory_the_step_completes_on(low_mib: int, high_mib: int, expected_mib) -> None:
    scan = scan_band(OPS, CONFIG, low_mib * MiB, high_mib * MiB)
    assert scan.settled
    assert scan.found_bytes == (None if expected_mib is None else expected_mib * MiB)


@pytest.mark.parametrize(("low_mib", "high_mib", "expected_mib"), [
    (100, 120, 110), (100, 109, None), (130, 400, None), (90, 120, 90),
])
def test_band_scan_finds_the_least_memory_the_step_runs_out_on(low_mib: int, high_mib: int, expected_mib) -> None:
    scan = scan_band(OPS, CONFIG, low_mib * MiB, high_mib * MiB, completes=False)
    assert scan.settled
    assert scan.found_bytes == (None if expected_mib is None else expected_mib * MiB)


def test_band_scan_stops_unsettled_after_its_replays() -> None:
    scan = scan_band(OPS, CONFIG, 50 * MiB, 99 * MiB, max_replays=1)
    assert not scan.settled and scan.found_bytes is None and scan.replays == 1


LLAMA_70B_QLORA = ["llama-3.1-70b", "--framework", "zeroplan", "--gpu", "a100-80gb", "--gpus", "8", "--micro-batch", "2",
                   "--seq-len", "16384", "--allow-longer-seq", "--precision", "bf16-pure", "--activation-checkpointing",
                   "full", "--fused-cross-entropy", "--lora-rank", "8", "--quantize", "nf4"]


@pytest.mark.slow
def test_a_step_that_completes_on_less_memory_is_a_borderline_oom(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama-3.1-70B QLoRA under FSDP on A100-80GBs: the replay runs out on the GPU's 79.5 GiB
    (it needs 79.75 GiB on that path) but completes on 72.56-76.42 GiB, where a refused cudaMalloc
    frees the cache earlier; with the error band that is no confident OOM."""
    from zeroplan.cli.fit import add_fit_arguments, request_from_args
    from zeroplan.cli.parser import OneLineParser
    from zeroplan.core import margin
    from zeroplan.core.plan import plan
    from zeroplan.specs.strategy import StrategyKind
    from zeroplan.units import GiB

    parser = OneLineParser(prog="zeroplan fit")
    add_fit_arguments(parser)
    request = request_from_args(parser.parse_args([*LLAMA_70B_QLORA, "--strategies", "fsdp-full-shard"]))
    request = request.with_strategy(request.strategy.model_copy(update={"kind": StrategyKind.fsdp_full_shard}))
    # Today's band reaches this step's unlimited peak (80.86 GiB x its low edge < 79.5): borderline
    # by the peak alone, no scan needed.
    today = plan(request, False, False)
    assert not today.fits and today.borderline
    assert today.memory.peak_bytes * margin.PEAK_ERROR_BAND.low < today.usable_memory_bytes
    # Under the band the step was found with (its low edge 0.988) the peak lies past the band's
    # reach, and only the scan of the memories a run with that error stands on finds the
    # completion: the path this test holds.
    monkeypatch.setattr(margin, "PEAK_ERROR_BAND", margin.PeakErrorBand(low=0.988, high=1.056, rows=83))
    answer = plan(request, False, False)
    assert not answer.fits and answer.borderline
    assert answer.memory.peak_bytes > answer.usable_memory_bytes / 0.988  # not borderline by its peak alone
    assert 72.5 * GiB < answer.borderline_capacity_bytes < answer.usable_memory_bytes
    assert replay_completes(request, answer.borderline_capacity_bytes)


def replay_completes(request, capacity_bytes: int) -> bool:
    from zeroplan.allocator.planner import allocator_fits
    from zeroplan.core.plan import checked_peak_terms, memory_breakdown, replayed

    breakdown, _ = memory_breakdown(request)
    return allocator_fits(request, *replayed(*checked_peak_terms(request)), breakdown.allocated_peak_bytes, capacity_bytes)
