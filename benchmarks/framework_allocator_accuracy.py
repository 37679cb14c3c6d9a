"""The planner's allocator verdict against the frameworks' own steps: for each configuration,
the OOM capacity the caching-allocator model finds on the fake-tensor trace of the framework's
whole step (zeroplan simulate --whole-step --allocator-conf; that trace predicted an H200's
within 0.7 % on the harness, docs/validation.md) beside the one it finds on the planner's own
schedule (fit --allocator-conf). Llama-3.1-8B, 8 ranks, FSDP2 full shard (the unit-by-unit
schedule, zeroplan/allocator/fsdp_schedule.py) and shard-grad-op (the coarse one,
zeroplan/allocator/schedule.py), CPU kernels on both sides. About 10 minutes on 2 cores.

    python benchmarks/framework_allocator_accuracy.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from framework_accuracy import step_request  # noqa: E402

from zeroplan.core.plan import memory_breakdown  # noqa: E402
from zeroplan.frameworks.step import run_step, step_training  # noqa: E402
from zeroplan.presets.models import get_model  # noqa: E402
from zeroplan.specs import BatchSpec, StrategyKind  # noqa: E402

GiB = 2**30
FULL, SGO = StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op
CONFIGURATIONS = ((FULL, "torchtune", "none", 4096, 1), (FULL, "torchtune", "full", 4096, 1), (FULL, "hf", "none", 4096, 1),
                  (FULL, "hf", "full", 4096, 1), (FULL, "torchtitan", "selective-op", 4096, 1),
                  (FULL, "torchtitan", "full", 8192, 2), (FULL, "torchtitan", "full", 16384, 4),
                  (SGO, "torchtune", "full", 4096, 1), (SGO, "hf", "full", 4096, 1),
                  (SGO, "torchtitan", "selective-op", 4096, 1))


def main() -> None:
    print(f"{'strategy':18s} {'framework':10s} {'AC':12s} {'s':>5s} {'b':>2s} {'allocator':10s} {'tracked':>8s} | {'trace: req':>10s} "
          f"{'reserved':>8s} {'oom-at':>7s} | {'planner: alloc':>14s} {'reserved':>8s} {'oom-at':>7s} {'error':>7s}   (GiB)")
    for strategy, framework, policy, seq_len, micro_batch in CONFIGURATIONS:
        for conf in ("", "expandable_segments:True"):
            record = run_step(get_model("llama-3.1-8b"), strategy, step_training(framework, policy),
                              BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch), 8, allocator_conf=conf)
            request = step_request(record)
            request = request.with_allocator_conf(conf)
            # The default answer replays once on the usable memory; the OOM capacity compared
            # here is the bisected one (MemoryAssumptions.exact_capacity), as the trace's is.
            request = request.model_copy(update={"assumptions": request.assumptions.model_copy(update={"exact_capacity": True})})
            breakdown, _ = memory_breakdown(request)
            trace = record.allocator
            error = breakdown.oom_capacity_bytes / trace.oom_capacity_bytes - 1
            print(f"{strategy.value:18s} {framework:10s} {policy:12s} {seq_len:>5d} {micro_batch:>2d} {'expandable' if conf else 'default':10s} "
                  f"{record.peak_bytes / GiB:>8.2f} | {trace.requested_peak_bytes / GiB:>10.2f} {trace.reserved_peak_bytes / GiB:>8.2f} "
                  f"{trace.oom_capacity_bytes / GiB:>7.2f} | {breakdown.allocated_peak_bytes / GiB:>14.2f} "
                  f"{breakdown.reserved_peak_bytes / GiB:>8.2f} {breakdown.oom_capacity_bytes / GiB:>7.2f} {100 * error:>+6.1f}%",
                  flush=True)


if __name__ == "__main__":
    main()
