"""Replay speed of the caching-allocator model (zeroplan.allocator): events per second on a
synthetic many-tensor trace, and the time to replay and bisect the OOM capacity of a 70B
model's step trace from the planner's schedule. Replays are timed with Python's cyclic garbage
collector paused, as fit runs them.

    python benchmarks/allocator_replay.py
"""

from __future__ import annotations

import gc
import random
import time

from zeroplan.allocator.capacity import oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.replay import compile_trace, replay
from zeroplan.allocator.schedule import step_trace
from zeroplan.allocator.trace import AllocationTrace, AllocEvent, FreeEvent, Stream
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import peak_terms
from zeroplan.units import GiB

SEVENTY_B = "llama-2-70b --framework torchtitan --gpus 64 --gpu h100-80gb --micro-batch 1 --seq-len 4096 --activation-checkpointing selective-op"


def synthetic_trace(events: int, seed: int = 0) -> AllocationTrace:
    """Many tensors of mixed sizes (512 B to 256 MiB) on three streams, each freed after a
    random lifetime: a harder mix for the pools than a training step."""
    rng = random.Random(seed)
    out, live, ident = [], [], 0
    while len(out) < events:
        if live and (len(live) > 400 or rng.random() < 0.5):
            out.append(FreeEvent(id=live.pop(rng.randrange(len(live)))))
            continue
        size = int(2 ** rng.uniform(9, 28))
        out.append(AllocEvent(id=ident, size_bytes=size, stream=rng.choice(list(Stream))))
        live.append(ident)
        ident += 1
    out.extend(FreeEvent(id=i) for i in live)
    return AllocationTrace(events=tuple(out), source="synthetic")


def _rate(trace: AllocationTrace, text: str) -> tuple[float, float]:
    ops = compile_trace(trace)
    # As fit replays (zeroplan.allocator.planner): the cyclic collector paused, so a collection
    # of the trace's objects does not land in the timed replay.
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        replay(ops, parse_alloc_conf(text))
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return len(ops) / elapsed, elapsed


def main() -> None:
    synthetic = synthetic_trace(200_000)
    for text in ("", "expandable_segments:True"):
        rate, elapsed = _rate(synthetic, text)
        print(f"synthetic  {len(synthetic.events):>7,} events  {text or 'default':26s} {rate:>12,.0f} events/s  ({elapsed:.3f} s)")
    request = request_from_args(build_parser().parse_args(["fit", *SEVENTY_B.split()]))
    for kind_name in ("fsdp-full-shard", "ddp"):
        from zeroplan.specs import StrategyKind

        req = request.model_copy(update={"strategy": request.strategy.model_copy(update={"kind": StrategyKind(kind_name)})})
        start = time.perf_counter()
        trace = step_trace(req, *peak_terms(req))
        built = time.perf_counter() - start
        for text in ("", "expandable_segments:True"):
            rate, elapsed = _rate(trace, text)
            start = time.perf_counter()
            verdict = oom_capacity(trace, parse_alloc_conf(text))
            bisect_s = time.perf_counter() - start
            print(f"70B {kind_name:16s} {len(trace.events):>6,} events  {text or 'default':26s} {rate:>10,.0f} events/s  "
                  f"replay {elapsed * 1e3:6.1f} ms  trace {built * 1e3:5.1f} ms  OOM bisection {bisect_s * 1e3:6.1f} ms  "
                  f"reserved {verdict.unlimited.reserved_peak_bytes / GiB:6.2f} GiB  oom-at {verdict.oom_capacity_bytes / GiB:6.2f} GiB")


if __name__ == "__main__":
    main()
