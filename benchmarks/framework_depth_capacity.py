"""The planner's OOM capacity against the replay of torchtune's own whole step (full
recompute, Llama-3.1-8B's architecture, FSDP2 full shard, 8 ranks, seq 1024, micro-batch 1)
at several depths: the check of tests/test_framework_step.py's allocator replay, block count
by block count, under the default allocator settings and expandable segments.

    python benchmarks/framework_depth_capacity.py [BLOCKS ...]   (default 2 4 8 32)
    python benchmarks/framework_depth_capacity.py --dump DIR BLOCKS ...
        (also pickles both traces' compiled ops per depth into DIR, for comparing them)

About 5 s a depth on 2 cores at 2-8 blocks, 30 s at 32.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from framework_accuracy import step_request  # noqa: E402
from framework_step_records import shallow_model  # noqa: E402

from zeroplan.allocator import planner  # noqa: E402
from zeroplan.allocator.capacity import oom_capacity  # noqa: E402
from zeroplan.allocator.config import parse_alloc_conf  # noqa: E402
from zeroplan.allocator.replay import compile_trace  # noqa: E402
from zeroplan.core.plan import memory_breakdown  # noqa: E402
from zeroplan.frameworks import step as step_module  # noqa: E402
from zeroplan.frameworks.step import run_step, step_training  # noqa: E402
from zeroplan.specs import BatchSpec, StrategyKind  # noqa: E402

GiB = 2**30
CONFS = ("", "expandable_segments:True")


def depth(blocks: int, dump: Path | None = None) -> None:
    model = shallow_model("llama-3.1-8b", blocks)
    traces = []

    def recorded(trace, config):  # noqa: ANN001, ANN202
        traces.append(trace)
        return oom_capacity(trace, config)

    original = step_module.oom_capacity
    step_module.oom_capacity = recorded
    try:
        record = run_step(model, StrategyKind.fsdp_full_shard, step_training("torchtune", "full"),
                          BatchSpec(seq_len=1024, micro_batch_size=1), 8, allocator_conf="")
    finally:
        step_module.oom_capacity = original
    planned_ops = []
    step_ops = planner.step_ops

    def recording_ops(*args):  # noqa: ANN002, ANN202
        planned_ops.append(step_ops(*args))
        return planned_ops[-1]

    planner.step_ops = recording_ops
    try:
        for conf in CONFS:
            framework = oom_capacity(traces[0], parse_alloc_conf(conf))
            request = step_request(record).with_allocator_conf(conf).with_exact_capacity()
            breakdown = memory_breakdown(request)[0]
            error = breakdown.oom_capacity_bytes / framework.oom_capacity_bytes - 1
            print(f"{blocks:>3d} blocks {'expandable' if conf else 'default':10s} | trace: req "
                  f"{framework.unlimited.requested_peak_bytes / GiB:6.3f} reserved {framework.unlimited.reserved_peak_bytes / GiB:6.3f} "
                  f"oom-at {framework.oom_capacity_bytes / GiB:6.3f} | planner: alloc {breakdown.allocated_peak_bytes / GiB:6.3f} "
                  f"reserved {breakdown.reserved_peak_bytes / GiB:6.3f} oom-at {breakdown.oom_capacity_bytes / GiB:6.3f} "
                  f"| {100 * error:+5.1f} %", flush=True)
    finally:
        planner.step_ops = step_ops
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        with open(dump / f"{blocks}.pkl", "wb") as out:
            pickle.dump({"framework": compile_trace(traces[0]), "planner": planned_ops[0] if planned_ops else None}, out)


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__, ("--dump",))
    args = sys.argv[1:]
    dump = None
    if args[:1] == ["--dump"]:
        dump, args = Path(args[1]), args[2:]
    for blocks in [int(a) for a in args] or [2, 4, 8, 32]:
        depth(blocks, dump)
