"""FSDP2's second traced step copied from the first (allocator/builder.py TraceBuilder.repeat_step)
against the same step recorded call by call, over random requests (allocator_fast_sweep.py's, each
asked under fsdp-full-shard and hsdp where the planner accepts it): the ops, marks, ids, peaks and
sizes must be identical, and the copy must apply. Prints how many traces were compared, how many
are identical and how many were copied.

    python benchmarks/allocator_repeat_step.py [--requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from allocator_fast_sweep import random_requests  # noqa: E402

from zeroplan.allocator.builder import TraceBuilder  # noqa: E402
from zeroplan.allocator.fsdp_schedule import record_fsdp_step  # noqa: E402
from zeroplan.allocator.schedule import step_inputs  # noqa: E402
from zeroplan.core.plan import checked_peak_terms, replayed  # noqa: E402
from zeroplan.errors import ZeroplanError  # noqa: E402
from zeroplan.specs import StrategyKind  # noqa: E402


def recorded(x, copy_second_step: bool) -> tuple:
    b = TraceBuilder()
    record_fsdp_step(x, x.fsdp, b, copy_second_step)
    return (b.ops, b.marks, b.next_id, b.requested_peak_bytes, b.rounded_peak_bytes, b.largest_request_bytes(),
            b._alive, b._alive_rounded, b._sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    copied = {"yes": 0, "no": 0}
    repeat_step = TraceBuilder.repeat_step

    def counted(self, *a):  # type: ignore[no-untyped-def]
        done = repeat_step(self, *a)
        copied["yes" if done else "no"] += 1
        return done

    start = time.perf_counter()
    compared = identical = 0
    for request in random_requests(args.requests, args.seed):
        for kind in (StrategyKind.fsdp_full_shard, StrategyKind.hsdp):
            try:
                fsdp = request.with_strategy(request.strategy.model_copy(update={"kind": kind}))
                x = step_inputs(fsdp, *replayed(*checked_peak_terms(fsdp)))
            except ZeroplanError:
                continue
            if x.fsdp is None:
                continue
            TraceBuilder.repeat_step = counted
            try:
                fast = recorded(x, True)
            finally:
                TraceBuilder.repeat_step = repeat_step
            compared += 1
            identical += fast == recorded(x, False)
    print(f"{args.requests} random requests (seed {args.seed}), {compared} FSDP2 traces, "
          f"{time.perf_counter() - start:.0f} s")
    print(f"identical: {identical} of {compared}; second step copied in {copied['yes']}, recorded in {copied['no']}")


if __name__ == "__main__":
    main()
