"""The planner's allocated peak (zeroplan.core.peak: the largest of its moments) against the
caching-allocator replay's requested peak (the most bytes its step trace, schedule.step_ops,
has allocated at once) over the dev set's rows (benchmarks/published_memory/rows.csv) and random
requests (benchmarks/allocator_fast_sweep.py's generator: models x frameworks x strategies x
layouts x micro-batch/sequence/checkpointing). The planner's moments should bound the trace: a
row where the replay requests more than the planner's allocated peak is one where --flat-reserve
and the reported allocated peak miss a moment. Prints each pipeline rank where the replay
exceeds the planner's allocated peak by more than --threshold (1 % by default).

    python benchmarks/allocated_peak_gap.py [--requests 2000] [--seed 0] [--threshold 0.01]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.allocator_fast_sweep import random_requests
from benchmarks.published_memory_accuracy import argv_of, load_rows
from zeroplan.allocator.planner import _requested_peak_bytes
from zeroplan.allocator.schedule import step_ops
from zeroplan.cli.fit import check_options_apply, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import (
    checked_peak_terms,
    peak_allocated_bytes,
    pipeline_rank_requests,
    replayed,
)
from zeroplan.errors import ZeroplanError
from zeroplan.specs import StrategyKind

GIB = 2**30


def gaps(request) -> list[tuple[int, int, str]]:
    """(planner's allocated peak, replay's requested peak, the planner's peak moment) per pipeline rank."""
    out = []
    for rank in pipeline_rank_requests(request):
        states, terms = replayed(*checked_peak_terms(rank))
        allocated, moment = peak_allocated_bytes(states, terms, rank.batch.grad_accum_steps)
        requested = _requested_peak_bytes(step_ops(rank, states, terms))
        out.append((allocated, requested, moment.value))
    return out


def dev_set_requests():
    for row in load_rows():
        if row["expressible"].startswith("no"):
            continue
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                args = build_parser().parse_args(argv_of(row))
            check_options_apply(args)
            yield row["id"], request_from_args(args, StrategyKind(row["strategy"]))
        except (ZeroplanError, SystemExit):
            continue


def label(request) -> str:
    return (f"{request.training.framework.value} {request.strategy.kind.value} gpus={request.cluster.world_size} "
            f"tp={request.parallel.tp} pp={request.parallel.pp} mb={request.batch.micro_batch_size} "
            f"seq={request.batch.seq_len} ga={request.batch.grad_accum_steps} ckpt={request.training.activation_checkpointing.value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=0.01)
    args = parser.parse_args()
    sources = [("dev", list(dev_set_requests())),
               ("random", [(f"random-{i}", r) for i, r in enumerate(random_requests(args.requests, args.seed))])]
    for name, requests in sources:
        over = collections.Counter()
        count = exceeding = 0
        for ident, request in requests:
            try:
                ranks = gaps(request)
            except ZeroplanError:
                continue
            for rank, (allocated, requested, moment) in enumerate(ranks):
                count += 1
                if requested > allocated * (1 + args.threshold):
                    exceeding += 1
                    over[(request.strategy.kind.value, request.training.framework.value)] += 1
                    print(f"  {name} {ident} rank {rank}: replay {requested / GIB:.2f} GiB > planner {allocated / GIB:.2f} GiB "
                          f"({moment}) +{100 * (requested / allocated - 1):.1f} %  [{label(request)}]")
        print(f"{name}: {exceeding} of {count} ranks with the replay's requested peak > the planner's allocated peak by "
              f"> {100 * args.threshold:.0f} %")
        for key, n in sorted(over.items()):
            print(f"    {key[0]} / {key[1]}: {n}")


if __name__ == "__main__":
    main()
