"""torchtitan's whole step on fake tensors under its 0.3.0 FSDP2 wrapping and under 9dec370's,
beside the planner (`--torchtitan-release`), for the published H100 runs' shapes.

torchtitan 9dec370 (the commit of benchmarks/llama3_h100_202412_torchtitan.md) wraps with
parallelisms/parallelize_llama.py apply_fsdp: fully_shard on each block (reshard_after_forward
False for the last), then fully_shard(model): the embedding, final norm and output projection
are the root unit, which the torch of those runs (1963fc8) never resharded after forward
(FSDPState._lazy_init). torch 2.13 keeps that rule for reshard_after_forward=None, so the root is
sharded with None here. The model, loss (unchunked: 9dec370's train.py loss_fn) and AdamW are
torchtitan 0.3.0's as zeroplan.frameworks.step runs them; only the wrapping differs. Each step's
every storage is replayed through the caching-allocator model under expandable segments
(torchtitan's launch setting), as `zeroplan simulate --whole-step --allocator-conf` does; beside
it, the planner's allocated and reserved peaks of the same step (its own schedule replayed so).

    python benchmarks/torchtitan_release_step.py [--world-size 8] [--policy selective-op] [--seq-len 8192] [--micro-batch 2]

About 40-80 s per wrapping on two cores. Llama-3.1-8B, 8 ranks, selective-op, 2 x 8192
(GiB; requested peak, unlimited reserved peak; the planner's allocated and reserved, its FSDP2
schedule replayed the same way):

| wrapping | step: peak | unsharded params | reserved | planner: allocated | reserved | published |
| --- | ---: | ---: | ---: | ---: | ---: | ---: |
| 0.3.0 | 68.56 | 0.98 | 78.27 | 68.0 | 77.5 | 82.4 |
| 9dec370 | 69.94 | 2.36 | 80.51 | 69.4 | 79.6 | 82.4 |

The same at --world-size 128 (published 67.0): 0.3.0 58.04 / 64.20 reserved (planner 57.5 / 63.1),
9dec370 59.42 / 66.33 (planner 58.9 / 65.0); and at --policy full --seq-len 32768 --micro-batch 1
(the CP 1 row's shape, published 83.9 compiled with float8): 0.3.0 68.92 / 83.11 (planner 67.7 /
81.1), 9dec370 70.30 / 84.85 (planner 69.1 / 83.2). docs/validation.md, "Published peaks", says
which allocations set the reserved peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import zeroplan.frameworks.step as step_module  # noqa: E402
from zeroplan.frameworks.build import build  # noqa: E402
from zeroplan.presets.models import get_model  # noqa: E402
from zeroplan.specs import BatchSpec, StrategyKind  # noqa: E402
from zeroplan.specs.framework import Framework  # noqa: E402

GIB = 2**30
ALLOC_CONF = "expandable_segments:True"


def build_9dec370(*args, **kwargs):
    """torchtitan 0.3.0's model, to be sharded as 9dec370's apply_fsdp shards it."""
    built = build(*args, **kwargs)
    module = built.module

    def shard(mesh: object, reshard_after_forward: bool) -> str:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # 9dec370 train_configs: mixed_precision_param bfloat16, mixed_precision_reduce float32.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        last = len(module.layers) - 1
        for name, block in module.layers.items():
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=int(name) < last)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=None)
        return "torchtitan 9dec370 apply_fsdp (blocks, the last not resharded; the root: embedding, norm, output)"

    return dataclasses.replace(built, shard=shard)


def planner_figures(options: argparse.Namespace, release: str):
    """The planner's breakdown of the same step as `zeroplan fit` plans the published rows
    (benchmarks/published_memory/rows.csv: H100 with 95.5 GiB, torchtitan's expandable segments)."""
    from zeroplan.cli.fit import check_options_apply, request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.plan import memory_breakdown

    args = build_parser().parse_args([
        "fit", "llama-3.1-8b", "--gpus", str(options.world_size), "--gpu", "h100-80gb", "--gpu-memory-gib", "95.5",
        "--micro-batch", str(options.micro_batch), "--seq-len", str(options.seq_len), "--activation-checkpointing",
        options.policy, "--framework", "torchtitan", "--unchunked-loss", "--torchtitan-release", release])
    check_options_apply(args)
    return memory_breakdown(request_from_args(args, StrategyKind.fsdp_full_shard))[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--policy", default="selective-op")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=2)
    options = parser.parse_args(argv)
    model = get_model("llama-3.1-8b")
    training = step_module.step_training(Framework.torchtitan, options.policy).model_copy(update={"unchunked_loss": True})
    batch = BatchSpec(micro_batch_size=options.micro_batch, seq_len=options.seq_len)
    print("wrapping  step peak  unsharded params  requested  reserved | planner: allocated  reserved  (GiB)")
    for name, builder in (("0.3.0", build), ("9dec370", build_9dec370)):
        step_module.build = builder
        record = step_module.run_step(model, StrategyKind.fsdp_full_shard, training, batch, options.world_size,
                                      allocator_conf=ALLOC_CONF)
        figures = record.allocator
        planned = planner_figures(options, name)
        print(f"{name:8s}  {record.peak_bytes / GIB:9.2f}  {record.peak_by_category['unsharded_param'] / GIB:16.2f}  "
              f"{figures.requested_peak_bytes / GIB:9.2f}  {figures.reserved_peak_bytes / GIB:8.2f} | "
              f"{planned.allocated_peak_bytes / GIB:18.2f}  {planned.reserved_peak_bytes / GIB:8.2f}")
    step_module.build = build
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
