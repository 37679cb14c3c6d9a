"""``zeroplan validate --from-log FILE <fit's flags>``: the peak memory a training stack printed
in its own log (zeroplan.validate.logs), against the planner's prediction for the same setup."""

from __future__ import annotations

import argparse
import sys

from zeroplan.cli.parser import OneLineParser, run_reporting_user_errors
from zeroplan.errors import ZeroplanError
from zeroplan.units import GiB, MiB


def wants_log(argv: list[str]) -> bool:
    """Whether a `zeroplan validate` line reads a log (its other arguments are then fit's)."""
    return any(arg == "--from-log" or arg.startswith("--from-log=") for arg in argv)


def build_parser() -> OneLineParser:
    from zeroplan.cli.fit import add_fit_arguments

    parser = OneLineParser(prog="zeroplan validate --from-log",
                           description="a run's own peak-memory log lines against the prediction for its setup")
    parser.add_argument("--from-log", required=True, metavar="FILE",
                        help="rank 0's log of torchtitan, torchtune (log_peak_memory_stats=True), the HF Trainer "
                             "(skip_memory_metrics=False) or DeepSpeed (see_memory_usage), or a pickled "
                             "torch.cuda.memory._snapshot() (or zeroplan measure --memory-snapshot's)")
    add_fit_arguments(parser)
    return parser


def _gib(n: float) -> str:
    """GiB, or MiB below 1 GiB (a harness model's snapshot is a few hundred KiB)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.2f} MiB"


def run(args: argparse.Namespace) -> int:
    from zeroplan.cli.fit import request_from_args, strategies_asked
    from zeroplan.core.plan import fit
    from zeroplan.validate.logs import read_log

    kinds = strategies_asked(args)
    if kinds is None or len(kinds) != 1:
        raise ZeroplanError("--strategies", "names the one strategy the run used (allowed: exactly one, or a "
                                            "--deepspeed-config file)")
    log = read_log(args.from_log)  # refused before planning when it holds no peak
    report = fit(request_from_args(args, kinds[0]), kinds)
    plan = report.plan_for(kinds[0])
    memory = plan.memory
    conf = report.allocator_conf
    if memory.reserved_peak_bytes is not None:
        reserved, how = memory.reserved_peak_bytes, f"the caching-allocator model under PYTORCH_CUDA_ALLOC_CONF={conf or '(defaults)'}"
    else:
        reserved, how = memory.peak_bytes, "allocated plus the flat 5% reserve"
    predicted = {"allocated": (memory.allocated_peak_bytes, "allocated peak"), "active": (memory.allocated_peak_bytes,
                 "allocated peak (active also counts blocks awaiting their stream)"), "reserved": (reserved, f"reserved peak, {how}")}
    from zeroplan.validate.snapshot import STACK

    out = [f"{args.from_log}: {'a ' + STACK + ' pickle' if log.stack == STACK else log.stack + chr(39) + 's log'}"]
    for reading in log.readings:
        value, what = predicted[reading.figure]
        diff = value - reading.bytes
        pct = f" ({100 * diff / reading.bytes:+.1f}%)" if reading.bytes else ""
        counted = "event" if log.stack == STACK else "line"
        out.append(f"  {reading.figure}: read {_gib(reading.bytes)} (peak of {reading.lines} {counted}{'s' * (reading.lines != 1)}, "
                   f"{reading.unit}{'; ' + reading.note if reading.note else ''}); predicted {_gib(value)} ({what}); "
                   f"predicted - read = {'+' if diff >= 0 else '-'}{_gib(abs(diff))}{pct}")
    out.append(f"Prediction: {plan.strategy.value}, micro-batch {plan.micro_batch_size}, "
               f"{'fits' if plan.fits else 'does not fit'} in {_gib(plan.usable_memory_bytes)} usable")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def main(argv: list[str]) -> int:
    return run_reporting_user_errors("zeroplan", run, build_parser().parse_args(argv))
