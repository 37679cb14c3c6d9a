"""Configurations per second through the Python API, one request at a time: `plan()` (one
strategy, its memory breakdown, largest micro-batch, collectives and step time) and `fit()`
(every strategy, each with its largest micro-batch, the verdict and, when nothing fits, the
smallest change that would). 60 requests: Llama-2-7B on 8 x A100, ZeRO-3, sequence 1024-4096,
micro-batch 1-20; each measured after a warm-up pass, in one run, at the defaults (the
caching-allocator model, answering from the replays of a trace already made where they decide
it), with every verdict's trace replayed afresh (MemoryAssumptions.exact_allocator, the
oracle), with the capacity bisected (MemoryAssumptions.exact_capacity) and on the flat reserve
(no replay). With --breakdown, where a default plan()'s and fit()'s time goes instead: the
allocator's replays (how many a request, how many events each is handed, the time an event handed;
a replay may stop early or apply a repeated period at once, so it runs fewer), the trace
builds, the trace keys and the rest of the planner, each timed by wrapping
zeroplan.allocator.planner's own calls, and the requests that replay a trace against the others
(how many of each, the time each takes); for fit(), the smallest change's share (where nothing
fits: each candidate's every strategy) of the pass and of its replays.

    python benchmarks/api_throughput.py [--cpu-time] [--breakdown]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

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


def breakdown(batch: list[PlanRequest], clock=time.perf_counter) -> None:
    """Print where plan()'s and then fit()'s time goes at the defaults, each measured as main()
    measures it: plan() first, over requests none of whose answers is kept yet (after a
    warm-up), then fit() after that plan() pass and a warm-up."""
    from zeroplan.allocator import planner

    for name, function in (("plan()", plan), ("fit()", fit)):
        for request in batch[:3]:
            function(request)
        _timed_pass(name, function, batch, planner, clock)


def _timed_pass(name: str, function, batch: list[PlanRequest], planner, clock) -> None:
    """Time one pass of ``function`` over ``batch``, zeroplan.allocator.planner's own calls
    wrapped, and print the split."""
    spent: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    replayed: Counter[str] = Counter()

    def timed(call_name: str, call):
        def wrapper(*args):
            if call_name == "replay_ops":
                replayed["events"] += len(args[0])
            start = clock()
            try:
                return call(*args)
            finally:
                spent[call_name] += clock() - start
                calls[call_name] += 1
        return wrapper

    names = ("replay_ops", "record_step", "step_inputs")
    originals = {call_name: getattr(planner, call_name) for call_name in names}
    for call_name in names:
        setattr(planner, call_name, timed(call_name, originals[call_name]))
    # fit()'s smallest change (where nothing fits): each candidate's every strategy, which fit
    # reaches through zeroplan.core.plan.suggestion_fit; the replays made inside it counted apart.
    from zeroplan.core import plan as core_plan

    suggestion_fit = core_plan.suggestion_fit
    inside: Counter[str] = Counter()

    def suggesting(*args):
        replays_before, start = calls["replay_ops"], clock()
        try:
            return suggestion_fit(*args)
        finally:
            inside["seconds"] += clock() - start
            inside["calls"] += 1
            inside["replays"] += calls["replay_ops"] - replays_before

    core_plan.suggestion_fit = suggesting
    # Each request's time, by whether it replayed a trace (the replays' share of the pass is
    # those requests', whose other work is the same as the rest's).
    by_kind: Counter[bool] = Counter()
    requests_of: Counter[bool] = Counter()
    try:
        start = clock()
        for request in batch:
            replays_before = calls["replay_ops"]
            began = clock()
            function(request)
            replaying = calls["replay_ops"] > replays_before
            by_kind[replaying] += clock() - began
            requests_of[replaying] += 1
        total = clock() - start
    finally:
        for call_name, call in originals.items():
            setattr(planner, call_name, call)
        core_plan.suggestion_fit = suggestion_fit
    n = len(batch)
    replays, events = calls["replay_ops"], replayed["events"]
    allocator = spent["replay_ops"] + spent["record_step"] + spent["step_inputs"]
    rest = total - allocator
    print(f"{name} at the defaults: {1e3 * total / n:.3f} ms a request ({n / total:,.1f} configs/s)")
    print(f"  allocator replays   {1e3 * spent['replay_ops'] / n:6.3f} ms ({replays / n:.2f} a request, {events / max(replays, 1):,.0f} "
          f"events handed to each, {1e6 * spent['replay_ops'] / max(events, 1):.2f} us an event handed)")
    print(f"  trace builds        {1e3 * spent['record_step'] / n:6.3f} ms ({calls['record_step'] / n:.2f} a request)")
    print(f"  trace keys          {1e3 * spent['step_inputs'] / n:6.3f} ms ({calls['step_inputs'] / n:.2f} a request)")
    print(f"  the rest            {1e3 * rest / n:6.3f} ms (the planner's terms, step times, collectives, specs)")
    print(f"  {requests_of[True]} requests replay a trace, {1e3 * by_kind[True] / max(requests_of[True], 1):.3f} ms each "
          f"({100 * by_kind[True] / total:.0f} % of the pass); the other {requests_of[False]}, "
          f"{1e3 * by_kind[False] / max(requests_of[False], 1):.3f} ms each")
    if inside["calls"]:
        print(f"  the smallest change (nothing fits: each candidate's every strategy) {1e3 * inside['seconds'] / n:6.3f} ms "
              f"({100 * inside['seconds'] / total:.0f} % of the pass; {inside['calls']} candidate changes planned, "
              f"{inside['replays'] / n:.2f} of the replays a request are its)")
    print(f"  at most {n / max(allocator, 1e-9):,.0f} configs/s with nothing but the replays, builds and keys; "
          f"{n / rest:,.0f}/s with nothing but the rest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU time (steadier than the wall clock on a shared machine)")
    parser.add_argument("--breakdown", action="store_true",
                        help="where a default plan()'s and fit()'s time goes (replays, trace builds, keys, the rest) instead")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    batch = requests()
    if args.breakdown:
        breakdown(batch, clock)
        return
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
