"""The allocator model against the CUDA caching allocator itself: every trace measured on a GPU
(benchmarks/gpu-allocator-records) replayed, and the OOM capacities the GPU found by capping its
memory; then the planner's own prediction for the same runs. Torch-free."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from zeroplan.allocator.capacity import oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.measured import load_measured_run, traced_reserved_peak_bytes
from zeroplan.allocator.replay import replay
from zeroplan.core.plan import memory_breakdown
from zeroplan.errors import ZeroplanError
from zeroplan.harness.record import read_record
from zeroplan.validate.compare import request_for

RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu-allocator-records"
HISTORIES = sorted((RECORDS / "history").glob("*.json.gz"))
SEARCHES = json.loads((RECORDS / "capacity.json").read_text())["searches"]


def _history(case: str, conf: str) -> Path:
    tag = "expandable" if conf else "default"
    return RECORDS / "history" / f"{case.replace(':', '-')}-{tag}.json.gz"


def test_the_records_cover_ddp_zero_and_fsdp_with_both_allocators() -> None:
    assert len(HISTORIES) == 9
    assert {(s["case"], s["conf"]) for s in SEARCHES} == {
        (case, conf) for case in ("ddp:torch", "zero3:zeroplan", "fsdp-full-shard:torch")
        for conf in ("", "expandable_segments:True")
    }


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_replaying_a_measured_trace_gives_the_allocators_own_peaks(path: Path) -> None:
    run = load_measured_run(path)
    events = json.load(gzip.open(path, "rt"))["events"]
    assert traced_reserved_peak_bytes(events) == run.reserved_peak_bytes  # the trace is whole
    result = replay(run.trace, parse_alloc_conf(run.alloc_conf), None, run.segment_addresses)
    assert result.completed and run.alloc_retries == 0
    assert result.requested_peak_bytes == run.requested_peak_bytes
    assert result.allocated_peak_bytes == run.allocated_peak_bytes
    # With CUDA's own segment addresses (which break ties between equal cached blocks) the
    # model reserves what the allocator reserved, segment for segment.
    assert result.reserved_peak_bytes == run.reserved_peak_bytes
    assert result.device_alloc_calls == run.device_alloc_calls


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_with_the_models_own_addresses_the_reserved_peak_is_within_a_segment(path: Path) -> None:
    # The planner's traces have no addresses: the model places segments in order. Measured:
    # exact on eight runs; DDP's default allocator reserves one 250 MiB segment more (+1.01 %),
    # a cached block taken from another segment than CUDA's addresses made it take.
    run = load_measured_run(path)
    result = replay(run.trace, parse_alloc_conf(run.alloc_conf))
    assert 0 <= result.reserved_peak_bytes - run.reserved_peak_bytes <= 250 * 2**20


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: f"{s['case']}-{s['conf'] or 'default'}")
def test_the_oom_capacity_is_the_one_the_gpu_found(search: dict) -> None:
    # The GPU's: the smallest set_per_process_memory_fraction cap (2 MiB steps) at which the
    # run completed; the model's: the same bisection over its replay under a fraction cap.
    measured = search["oom_capacity_bytes"]
    probes = {int(cap) * 2 * 2**20: ok for cap, ok in search["probes"].items()}
    assert probes[measured] is True and probes.get(measured - 2 * 2**20) is False and not search["inverted"]
    run = load_measured_run(_history(search["case"], search["conf"]))
    verdict = oom_capacity(run.trace, parse_alloc_conf(run.alloc_conf), run.segment_addresses, fraction_cap=True)
    assert verdict.oom_capacity_bytes == measured


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: f"{s['case']}-{s['conf'] or 'default'}")
def test_the_planners_own_prediction_is_within_five_percent_of_the_gpu(search: dict) -> None:
    # End to end: the planner's request for the run (its schedule's trace, no measurement in
    # it) against the allocator's peaks and the capacity the GPU found (--exact-capacity).
    # Measured: allocated -1.3 % to +3.2 %, OOM capacity -2.1 % (ZeRO-3, expandable segments) to +2.4 %.
    case = search["case"].replace(":", "-")
    record = read_record(RECORDS / "records" / case / "rank00000.json")
    request = request_for(record.description)
    request = request.model_copy(update={"assumptions": request.assumptions.model_copy(
        update={"allocator_conf": search["conf"], "exact_capacity": True})})
    breakdown, _ = memory_breakdown(request)
    run = load_measured_run(_history(search["case"], search["conf"]))
    assert breakdown.allocated_peak_bytes == pytest.approx(run.allocated_peak_bytes, rel=0.05)
    assert breakdown.oom_capacity_bytes == pytest.approx(search["oom_capacity_bytes"], rel=0.05)
    # The peak: what the step reserves on the GPU's usable memory, against the run's
    # max_memory_reserved without a cap. Measured: -2.4 % to -1.0 % under expandable segments;
    # -13.9 % to +13.5 % under PyTorch's defaults, where whole cached segments make the reserve
    # hang on where each of the schedule's coarser tensors lands (docs/validation.md).
    tolerance = 0.05 if "expandable_segments:True" in search["conf"] else 0.15
    assert breakdown.peak_bytes == breakdown.reserved_peak_bytes == pytest.approx(run.reserved_peak_bytes, rel=tolerance)


def test_a_file_of_another_layout_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"format": "something-else"}, handle)
    with pytest.raises(ZeroplanError, match="format.*allowed: zeroplan-allocator-trace/1"):
        load_measured_run(path)
    path.write_text("not gzip")
    with pytest.raises(ZeroplanError, match="not a gzip'd JSON allocator trace"):
        load_measured_run(path)


def test_a_free_of_an_unknown_address_is_refused(tmp_path: Path) -> None:
    from zeroplan.allocator.measured import trace_from_events

    with pytest.raises(ZeroplanError, match="never allocated"):
        trace_from_events([["alloc", 4096, 512, 7, 0], ["free_completed", 8192, 512, 7, 1]], "t")
    trace, segments = trace_from_events([["segment_alloc", 0, 2097152, 7, 0], ["alloc", 0, 512, 7, 1],
                                         ["free_requested", 0, 512, 7, 2], ["free_completed", 0, 512, 7, 3]], "t")
    assert len(trace.events) == 2 and segments == ((0, 2097152),)
