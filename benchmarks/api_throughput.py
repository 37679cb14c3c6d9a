"""Configurations per second through the Python API, one request at a time: `plan()` (one
strategy, its memory breakdown, largest micro-batch, collectives and step time) and `fit()`
(every strategy, each with its largest micro-batch, the verdict and, when nothing fits, the
smallest change that would). 60 requests: Llama-2-7B on 8 x A100, ZeRO-3, sequence 1024-4096,
micro-batch 1-20; each measured after a warm-up pass, in one run, at the defaults (the
caching-allocator model, answering from the replays of a trace already made where they decide
it), with every verdict's trace replayed afresh (MemoryAssumptions.exact_allocator, the
oracle), with the capacity bisected (MemoryAssumptions.exact_capacity) and on the flat reserve
(no replay).

    python benchmarks/api_throughput.py [--cpu-time]
"""

from __future__ import annotations

import argparse
import time

from zeroplan.core.plan import fit, plan
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, MemoryAssumptions, PlanRequest, StrategySpec, cluster_from_gpus


def requests() -> list[PlanRequest]:
    cluster = cluster_from_gpus(get_gpu("a100-80gb"), 8)
    return [PlanRequest(model=get_model("llama-2-7b"), cluster=cluster, strategy=StrategySpec(kind="zero3"),
                        batch=BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch))
            for seq_len in (1024, 2048, 4096) for micro_batch in range(1, 21)]


def per_second(function, batch: list[PlanRequest], clock=time.perf_counter) -> float:
    for request in batch[:3]:
        function(request)
    start = clock()
    for request in batch:
        function(request)
    return len(batch) / (clock() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU time (steadier than the wall clock on a shared machine)")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    batch = requests()
    settings = {
        "defaults": batch,
        "every verdict replayed (--exact-allocator)": [r.model_copy(update={"assumptions": MemoryAssumptions(exact_allocator=True)})
                                                        for r in batch],
        "capacity bisected (--exact-capacity)": [r.model_copy(update={"assumptions": MemoryAssumptions(exact_capacity=True)})
                                                  for r in batch],
        "flat reserve (--flat-reserve)": [r.with_allocator_conf(None) for r in batch],
    }
    for name, requests_ in settings.items():
        print(f"{name:44s} plan(): {per_second(plan, requests_, clock):8,.0f} configs/s   fit(): "
              f"{per_second(fit, requests_, clock):6,.1f} configs/s ({len(requests_)} requests each)")


if __name__ == "__main__":
    main()
