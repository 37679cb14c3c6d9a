"""``zeroplan measure``: launch a real multi-process run and record it. No torch in this
process: the ranks import it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zeroplan.cli.parser import OneLineParser, positive_float, positive_int, run_reporting_user_errors
from zeroplan.harness.args import add_run_arguments, batch_from_args, resolve_model


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="zeroplan measure", description="run and record a sharded training job (torchrun)")
    add_run_arguments(parser)
    parser.add_argument("--nproc", type=positive_int, default=2, help="ranks on this machine (default 2)")
    parser.add_argument("--timeout-s", type=positive_float, default=600.0, help="time limit of the whole run")
    # For tests of the failure path: this rank raises after its first step.
    parser.add_argument("--fail-rank", type=int, help=argparse.SUPPRESS)
    return parser


def _harness_argv(args: argparse.Namespace) -> list[str]:
    argv = [args.model, "--strategy", args.strategy, "--engine", args.engine, "--steps", str(args.steps),
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--precision", args.precision,
            "--grad-accum", str(args.grad_accum), "--optimizer", args.optimizer,
            "--activation-checkpointing", args.activation_checkpointing, "--seed", str(args.seed), "--run-id", args.run_id]
    if args.keep_unsharded_grads_on_accum:
        argv.append("--keep-unsharded-grads-on-accum")
    if args.allow_longer_seq:
        argv.append("--allow-longer-seq")
    if args.backend:
        argv += ["--backend", args.backend]
    if args.fail_rank is not None:
        argv += ["--fail-rank", str(args.fail_rank)]
    return argv


def run_measure(args: argparse.Namespace) -> int:
    from zeroplan.harness.engines_table import EngineKind, check_supported_names
    from zeroplan.harness.extension_locks import check_no_stale_extension_lock, describe_extension_locks
    from zeroplan.harness.launch import launch

    from zeroplan.cli.measure_check import check_machine, check_out_path
    from zeroplan.specs import StrategyKind, check_seq_len

    model = resolve_model(args.model)
    # A learned position table has max_positions rows: a longer sequence is an IndexError in every rank.
    check_seq_len(model, batch_from_args(args))
    check_supported_names(args.strategy, args.engine, args.optimizer, args.grad_accum)
    check_out_path(args.out)
    # DeepSpeed JIT-builds ops into the torch extensions directory; a stale build lock there makes
    # every rank wait forever (zeroplan/harness/extension_locks.py).
    deepspeed = EngineKind(args.engine) is EngineKind.deepspeed
    if deepspeed:
        check_no_stale_extension_lock()
    check_machine(model, StrategyKind(args.strategy), args.nproc, args.backend)
    result = launch(args.nproc, _harness_argv(args), Path(args.out), args.timeout_s)
    for error in result.errors:
        sys.stderr.write(error + "\n")
    if result.returncode == 124:
        locks = describe_extension_locks() if deepspeed else ""
        sys.stderr.write(
            f"zeroplan measure: error: timeout-s: the run passed its {args.timeout_s:g} s limit and was stopped; "
            f"{len(result.records)} record(s) in {args.out}, incomplete ranks marked complete=false "
            f"(allowed: a larger --timeout-s){'; ' + locks if locks else ''}\n"
        )
        return 2
    if result.missing_ranks or result.incomplete_ranks or result.returncode:
        sys.stderr.write(
            f"zeroplan measure: error: ranks without a complete record: "
            f"{sorted(result.missing_ranks + result.incomplete_ranks)}; {len(result.records)} record(s) kept in {args.out}\n"
        )
        return 1
    sys.stdout.write(f"{len(result.records)} records in {args.out}; compare with: zeroplan validate {args.out}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_user_errors("zeroplan measure", run_measure, args)
