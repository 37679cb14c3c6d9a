"""Configurations per second of the vectorised plan search (zeroplan.core.search).

Sweeps every strategy x activation checkpointing x HSDP group of a model against every
(micro-batch, accumulation) split of many global batch sizes, and prints how many configurations
were evaluated and how fast: once for building the groups (scalar planner, a few calls each) and
once for the vectorised sweep itself.

    python benchmarks/plan_search.py [--model llama-2-70b] [--gpus 64] [--batches 600]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from zeroplan.core.search import batch_splits, evaluate, groups, search
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import PlanRequest, StrategyKind, StrategySpec, cluster_from_gpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-70b")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--batches", type=int, default=600, help="global batches gpus x 1 .. gpus x N")
    args = parser.parse_args()
    base = PlanRequest(
        model=get_model(args.model), cluster=cluster_from_gpus(get_gpu(args.gpu), args.gpus),
        strategy=StrategySpec(kind=StrategyKind.ddp),
    )
    splits = [batch_splits(args.gpus * k, args.gpus) for k in range(1, args.batches + 1)]
    micro = np.concatenate([m for m, _ in splits])
    accum = np.concatenate([a for _, a in splits])

    start = time.perf_counter()
    all_groups = groups(base)
    built = time.perf_counter()
    fitting = 0
    for group in all_groups:
        _, fits, _ = evaluate(group, micro, accum)
        fitting += int(fits.sum())
    swept = time.perf_counter()

    configs = len(all_groups) * len(micro)
    total_s = swept - start
    print(f"{args.model} on {args.gpus} x {args.gpu}: {len(all_groups)} groups x {len(micro):,} (micro, accum) splits "
          f"of {args.batches} global batches = {configs:,} configurations, {fitting:,} fit")
    print(f"build groups (scalar planner): {built - start:.3f} s; vectorised sweep: {swept - built:.3f} s")
    print(f"total {total_s:.3f} s: {configs / total_s:,.0f} configs/s "
          f"(sweep alone {configs / (swept - built):,.0f} configs/s)")
    scalar_only = sum(g.scalar_only for g in all_groups)
    print(f"groups on the scalar fallback: {scalar_only}")

    start = time.perf_counter()
    result = search(base, args.gpus * 8)
    print(f"search at global batch {args.gpus * 8}: {time.perf_counter() - start:.3f} s, "
          f"{result.configurations_evaluated} configurations; {result.explanation}")


if __name__ == "__main__":
    main()
