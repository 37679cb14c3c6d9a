"""The allocator model and the planner against the CUDA caching allocator, from the GPU records
(benchmarks/gpu-allocator-records, made by benchmarks/gpu_allocator.py on one H200).

Table 1 replays each measured trace: the model's reserved peak with CUDA's segment addresses
and with its own order, and its OOM capacity under a fraction cap, beside the allocator's.
Table 2 asks the planner (its own schedule, nothing measured in it) for the same runs.
Table 3 replays the trace of the same program run on fake tensors on the CPU
(zeroplan.simulate.harness_trace; needs torch, about 20 s).

    python benchmarks/allocator_accuracy.py [--no-fake]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from zeroplan.allocator.capacity import oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.measured import load_measured_run
from zeroplan.allocator.replay import replay
from zeroplan.core.plan import memory_breakdown
from zeroplan.harness.record import read_record
from zeroplan.validate.compare import request_for

RECORDS = Path(__file__).resolve().parent / "gpu-allocator-records"
MiB = 2**20


def _error(predicted: int, measured: int) -> str:
    return f"{100 * (predicted / measured - 1):+6.2f} %"


def _fake_tensor_table(capacities: dict) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_measure import llama_1b

    from zeroplan.harness.engines import EngineKind
    from zeroplan.simulate.harness_trace import harness_allocation_trace
    from zeroplan.specs import StrategyKind

    print("\nThe same runs on fake tensors on the CPU (MiB; the fake trace replayed vs the GPU; DDP cannot run on fake tensors)\n")
    print(f"{'run':34s} {'requested':>9s} {'fake':>9s} {'reserved':>9s} {'fake':>9s} {'error':>8s} {'oom-at':>8s} {'fake':>9s} "
          f"{'error':>8s} {'trace s':>7s}")
    traces: dict[str, tuple] = {}
    for path in sorted((RECORDS / "history").glob("*.json.gz")):
        run = load_measured_run(path)
        if run.case.startswith("ddp"):
            continue
        if run.case not in traces:
            strategy, engine = run.case.split(":")
            start = time.perf_counter()
            traces[run.case] = (harness_allocation_trace(llama_1b(), StrategyKind(strategy), EngineKind(engine), 8, 1, 2048),
                                time.perf_counter() - start)
        trace, seconds = traces[run.case]
        verdict = oom_capacity(trace, parse_alloc_conf(run.alloc_conf), fraction_cap=True)
        measured_cap = capacities.get((run.case, run.alloc_conf))
        cap_text = (f"{measured_cap / MiB:>8,.0f} {verdict.oom_capacity_bytes / MiB:>9,.0f} "
                    f"{_error(verdict.oom_capacity_bytes, measured_cap)}") if measured_cap else f"{'-':>8s} {verdict.oom_capacity_bytes / MiB:>9,.0f} {'':>8s}"
        print(f"{path.name.removesuffix('.json.gz'):34s} {run.requested_peak_bytes / MiB:>9,.0f} "
              f"{verdict.unlimited.requested_peak_bytes / MiB:>9,.0f} {run.reserved_peak_bytes / MiB:>9,.0f} "
              f"{verdict.unlimited.reserved_peak_bytes / MiB:>9,.0f} {_error(verdict.unlimited.reserved_peak_bytes, run.reserved_peak_bytes)} "
              f"{cap_text} {seconds:>7.1f}")


def main() -> None:
    import sys

    capacities = {(s["case"], s["conf"]): s["oom_capacity_bytes"]
                  for s in json.loads((RECORDS / "capacity.json").read_text())["searches"]}
    print("Replay of the measured traces (MiB; model vs CUDA caching allocator, torch 2.11.0+cu130, H200)\n")
    print(f"{'run':34s} {'events':>7s} {'reserved':>9s} {'model (CUDA addr)':>18s} {'model (own order)':>18s} "
          f"{'oom-at GPU':>10s} {'oom-at model':>12s} {'replay ms':>9s}")
    for path in sorted((RECORDS / "history").glob("*.json.gz")):
        run = load_measured_run(path)
        config = parse_alloc_conf(run.alloc_conf)
        start = time.perf_counter()
        with_addresses = replay(run.trace, config, None, run.segment_addresses)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        own = replay(run.trace, config)
        measured_cap = capacities.get((run.case, run.alloc_conf))
        model_cap = (oom_capacity(run.trace, config, run.segment_addresses, fraction_cap=True).oom_capacity_bytes
                     if measured_cap else None)
        name = path.name.removesuffix(".json.gz")
        print(f"{name:34s} {len(run.trace.events):>7,} {run.reserved_peak_bytes / MiB:>9,.0f} "
              f"{with_addresses.reserved_peak_bytes / MiB:>9,.0f} {_error(with_addresses.reserved_peak_bytes, run.reserved_peak_bytes)} "
              f"{own.reserved_peak_bytes / MiB:>9,.0f} {_error(own.reserved_peak_bytes, run.reserved_peak_bytes)} "
              f"{measured_cap / MiB if measured_cap else float('nan'):>10,.0f} "
              f"{model_cap / MiB if model_cap else float('nan'):>12,.0f} {elapsed_ms:>9.1f}")
    print("\nThe planner for the same runs (MiB; its schedule's trace vs the GPU)\n")
    print(f"{'run':34s} {'allocated':>9s} {'planner':>9s} {'error':>8s} {'reserved':>9s} {'planner':>9s} {'error':>8s} "
          f"{'oom-at':>8s} {'planner':>9s} {'error':>8s}")
    for (case, conf), measured_cap in sorted(capacities.items()):
        name = case.replace(":", "-")
        run = load_measured_run(RECORDS / "history" / f"{name}-{'expandable' if conf else 'default'}.json.gz")
        request = request_for(read_record(RECORDS / "records" / name / "rank00000.json").description)
        request = request.with_allocator_conf(conf).with_exact_capacity()
        breakdown, _ = memory_breakdown(request)
        label = f"{name}-{'expandable' if conf else 'default'}"
        print(f"{label:34s} {run.allocated_peak_bytes / MiB:>9,.0f} {breakdown.allocated_peak_bytes / MiB:>9,.0f} "
              f"{_error(breakdown.allocated_peak_bytes, run.allocated_peak_bytes)} {run.reserved_peak_bytes / MiB:>9,.0f} "
              f"{breakdown.reserved_peak_bytes / MiB:>9,.0f} {_error(breakdown.reserved_peak_bytes, run.reserved_peak_bytes)} "
              f"{measured_cap / MiB:>8,.0f} {breakdown.oom_capacity_bytes / MiB:>9,.0f} "
              f"{_error(breakdown.oom_capacity_bytes, measured_cap)}")
    if "--no-fake" not in sys.argv[1:]:
        _fake_tensor_table(capacities)


if __name__ == "__main__":
    main()
