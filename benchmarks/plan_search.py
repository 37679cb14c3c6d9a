"""Configurations per second of the vectorised plan search (zeroplan.core.search).

Sweeps every model-parallel layout (tp x cp x pp x schedule, zeroplan.core.search_space) x
strategy x activation checkpointing x HSDP group of a model against every (micro-batch,
accumulation) split of many global batch sizes over each layout's data-parallel ranks, and
prints how many configurations and groups were evaluated and how fast: building the groups
(the scalar planner, a few calls per class of pipeline ranks), the vectorised sweep, and both
end to end. Then the one question `zeroplan plan MODEL --gpus G --global-batch G x 8` end to end.

    python benchmarks/plan_search.py [--model llama-3.1-70b] [--gpus 64] [--batches 600] [--no-model-parallel]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from zeroplan.core.search import LayoutSpace, batch_splits, evaluate, groups, search
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PlanRequest, StrategyKind, StrategySpec, cluster_from_gpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-70b")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=600, help="global batches gpus x 1 .. gpus x N")
    parser.add_argument("--no-model-parallel", action="store_true", help="data parallelism only, as before layouts")
    args = parser.parse_args()
    base = PlanRequest(
        model=get_model(args.model), cluster=cluster_from_gpus(get_gpu(args.gpu), args.gpus),
        strategy=StrategySpec(kind=StrategyKind.ddp), batch=BatchSpec(seq_len=args.seq_len),
    )
    space = LayoutSpace(model_parallel=not args.no_model_parallel)
    batches = [args.gpus * k for k in range(1, args.batches + 1)]
    splits: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def sweep(ranks: int) -> tuple[np.ndarray, np.ndarray]:
        """Every split of every global batch over ``ranks`` data-parallel ranks."""
        if ranks not in splits:
            parts = [batch_splits(n, ranks) for n in batches]
            splits[ranks] = np.concatenate([m for m, _ in parts]), np.concatenate([a for _, a in parts])
        return splits[ranks]

    start = time.perf_counter()
    all_groups = groups(base, space=space)
    built = time.perf_counter()
    configs = fitting = 0
    for group in all_groups:
        micro, accum = sweep(group.request.data_parallel_size)
        _, fits, _ = evaluate(group, micro, accum)
        configs += micro.size
        fitting += int(fits.sum())
    swept = time.perf_counter()

    layouts = len({(g.request.parallel.tp, g.request.parallel.cp, g.request.parallel.pp, g.request.parallel.pp_schedule)
                   for g in all_groups})
    total_s = swept - start
    print(f"{args.model} on {args.gpus} x {args.gpu}, seq {args.seq_len}: {layouts} layouts, {len(all_groups)} groups, "
          f"{args.batches} global batches: {configs:,} configurations, {fitting:,} fit")
    print(f"build groups (scalar planner): {built - start:.3f} s; vectorised sweep: {swept - built:.3f} s")
    print(f"total {total_s:.3f} s: {configs / total_s:,.0f} configs/s end to end "
          f"(sweep alone {configs / (swept - built):,.0f} configs/s)")
    print(f"groups on the scalar fallback: {sum(g.scalar_only for g in all_groups)}")

    question = args.gpus * 8
    start = time.perf_counter()
    result = search(base, question, space=space)
    elapsed = time.perf_counter() - start
    print(f"search at global batch {question}: {elapsed:.3f} s, {result.layouts_searched} layouts, "
          f"{result.groups_searched} groups, {result.configurations_evaluated:,} configurations "
          f"({result.configurations_evaluated / elapsed:,.0f} configs/s); {result.explanation}")


if __name__ == "__main__":
    main()
