"""Configurations per second of the vectorised plan search (zeroplan.core.search).

Sweeps every model-parallel layout (tp x cp x pp x schedule, zeroplan.core.search_space) x
strategy x activation checkpointing x HSDP group of a model against every (micro-batch,
accumulation) split of many global batch sizes over each layout's data-parallel ranks, and
prints how many configurations and groups were evaluated and how fast: building the groups
(the scalar planner, a few calls per class of pipeline ranks), the vectorised sweep, and both
end to end. Then the one question `zeroplan plan MODEL --gpus G --global-batch G x 8` end to end,
and the search with and without its pruning (branch and bound) side by side (CPU seconds, the same
answer or not: ranking, Pareto front, explanation; how many configurations were bounded out): the
model at --global-batch, and --also-model at each --also GPUS:GLOBAL_BATCH (by default
llama-3.1-405b at 2^20 GPUs and sequences, the documented maximum).

    python benchmarks/plan_search.py [--model llama-3.1-70b] [--gpus 64] [--batches 600] [--no-model-parallel]
        [--global-batch 512] [--also-model llama-3.1-405b] [--also 1048576:1048576]
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
    parser.add_argument("--global-batch", type=int, default=512, help="the pruned-vs-unpruned search's global batch")
    parser.add_argument("--also-model", default="llama-3.1-405b", help="model of the --also searches")
    parser.add_argument("--also", type=lambda v: tuple(int(x) for x in v.split(":")), nargs="*",
                        default=[(2**20, 2**20)], help="more pruned-vs-unpruned searches, GPUS:GLOBAL_BATCH each "
                        "(default: the documented maximum, 2^20 GPUs and sequences)")
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
    pruned_vs_unpruned(args, args.model, args.gpus, args.global_batch, space)
    for gpus, batch in args.also:
        pruned_vs_unpruned(args, args.also_model, gpus, batch, space)


def pruned_vs_unpruned(args: argparse.Namespace, model: str, gpus: int, global_batch: int, space: LayoutSpace) -> None:
    """The search with and without pruning (search's ``prune``), side by side in one run, each
    on fresh caches (a new request: the layout and family caches are the search's own), CPU
    seconds; and that they answer the same."""
    base = PlanRequest(
        model=get_model(model), cluster=cluster_from_gpus(get_gpu(args.gpu), gpus),
        strategy=StrategySpec(kind=StrategyKind.ddp), batch=BatchSpec(seq_len=args.seq_len),
    )
    seconds, results = {}, {}
    # Pruned first: what the planner's own caches keep from it favours the unpruned run.
    for prune in (True, False):
        start = time.process_time()
        results[prune] = search(base, global_batch, space=space, prune=prune)
        seconds[prune] = time.process_time() - start
    # The answer: the ranking, the Pareto front and the explanation (the pruned search counts the
    # fitting configurations of the groups it evaluated only: configurations_bounded_out).
    same = all(getattr(results[True], name) == getattr(results[False], name)
               for name in ("ranked", "pareto", "best", "explanation", "configurations_evaluated"))
    print(f"{model} on {gpus} GPUs, global batch {global_batch}: unpruned {seconds[False]:.2f} s CPU, "
          f"pruned {seconds[True]:.2f} s CPU ({seconds[False] / seconds[True]:.1f}x; "
          f"{results[True].configurations_bounded_out:,} of {results[True].configurations_evaluated:,} "
          f"configurations bounded out); same answer: {same}")


if __name__ == "__main__":
    main()
