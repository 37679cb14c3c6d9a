"""``zeroplan measure``: launch a real multi-process run and record it. No torch in this
process: the ranks import it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from zeroplan.cli.parser import MAX_COUNT, OneLineParser, positive_float, positive_int, run_reporting_user_errors
from zeroplan.errors import ZeroplanError
from zeroplan.harness.args import (
    accelerate_notes_from_args, add_run_arguments, batch_from_args, check_parallel_args, deepspeed_file_from_args,
    resolve_engine, resolve_model, torchtitan_notes_from_args,
)
from zeroplan.harness.placement import MultiNode, parse_endpoint, slurm_multinode, srun_tasks


def node_rank_int(text: str) -> int:
    """An argparse type: 0, 1, 2, ... (the upper bound, --nnodes - 1, is checked once both are known)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer 0..NNODES-1, got {text!r}") from None
    if not 0 <= value < MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be an integer 0..NNODES-1, got {value}")
    return value


node_rank_int.__name__ = "node rank"


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="zeroplan measure", description="run and record a sharded training job (torchrun)")
    add_run_arguments(parser)
    parser.add_argument("--nproc", "--nproc-per-node", type=positive_int, default=2,
                        help="ranks on this machine (default 2); with several nodes, on each node")
    parser.add_argument("--timeout-s", type=positive_float, default=600.0, help="time limit of the whole run")
    nodes = parser.add_argument_group("across nodes (docs/harness.md, 'Across nodes')")
    nodes.add_argument("--nnodes", type=positive_int,
                       help="nodes of the launch (default 1); start zeroplan measure once on each, with the same flags "
                            "but --node-rank; the world size is nnodes x nproc-per-node")
    nodes.add_argument("--node-rank", type=node_rank_int, help="this node, 0..nnodes-1 (node 0 hosts the rendezvous)")
    nodes.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0, where its rendezvous store listens (same on every node)")
    nodes.add_argument("--rdzv-id", help="the launch's rendezvous id, the same on every node (default: --run-id; "
                                         "with --slurm, slurm-<job id>.<step id>)")
    nodes.add_argument("--slurm", action="store_true",
                       help="one srun task per node: take the node count, this node's rank and node 0's host from "
                            "SLURM's environment (port: MASTER_PORT or 29500)")
    # For tests of the failure path: this rank raises after its first step.
    parser.add_argument("--fail-rank", type=int, help=argparse.SUPPRESS)
    return parser


def _harness_argv(args: argparse.Namespace) -> list[str]:
    argv = [args.model, "--strategy", args.strategy, "--engine", args.engine, "--steps", str(args.steps),
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--precision", args.precision,
            "--grad-accum", str(args.grad_accum), "--optimizer", args.optimizer,
            "--activation-checkpointing", args.activation_checkpointing, "--seed", str(args.seed), "--run-id", args.run_id]
    if args.tp > 1:
        argv += ["--tp", str(args.tp)]
    if args.sequence_parallel:
        argv.append("--sequence-parallel")
    if args.pp > 1:
        argv += ["--pp", str(args.pp), "--pp-schedule", args.pp_schedule or "1f1b"]
    if args.keep_unsharded_grads_on_accum:
        argv.append("--keep-unsharded-grads-on-accum")
    if args.allow_longer_seq:
        argv.append("--allow-longer-seq")
    if args.deepspeed_config is not None:
        argv += ["--deepspeed-config", str(Path(args.deepspeed_config).resolve())]
    if args.accelerate_config is not None:
        argv += ["--accelerate-config", str(Path(args.accelerate_config).resolve())]
    if args.memory_snapshot:
        argv.append("--memory-snapshot")
    if args.torchtitan_config is not None:
        argv += ["--torchtitan-config", str(Path(args.torchtitan_config).resolve())]
    if args.backend:
        argv += ["--backend", args.backend]
    if args.fail_rank is not None:
        argv += ["--fail-rank", str(args.fail_rank)]
    return argv


def multinode_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> MultiNode | None:
    """This node's share of a multi-node launch, or None for a launch alone on this machine.
    Every inconsistency is refused here, before torchrun starts: a node that starts and then
    waits for a rendezvous that cannot happen only ends at --timeout-s."""
    if args.slurm:
        for flag, value in (("--nnodes", args.nnodes), ("--node-rank", args.node_rank)):
            if value is not None:
                raise ZeroplanError(flag, "comes from SLURM's environment with --slurm (allowed: leave it out, or "
                                          "drop --slurm and give --nnodes, --node-rank and --rdzv-endpoint)")
        if args.rdzv_endpoint is not None:
            parse_endpoint(args.rdzv_endpoint)
        return slurm_multinode(env, args.rdzv_endpoint, args.rdzv_id)
    nnodes = args.nnodes or 1
    node_rank = args.node_rank if args.node_rank is not None else 0
    if node_rank >= nnodes:
        raise ZeroplanError("--node-rank", f"{node_rank} is not below --nnodes {nnodes} (allowed: 0..{nnodes - 1})")
    if args.nnodes is None and args.node_rank is None and args.rdzv_endpoint is None:
        tasks = srun_tasks(env)
        if tasks > 1:
            # Each of the tasks would run its own launch into the same --out, overwriting the others' records.
            raise ZeroplanError("--slurm", f"this is one of {tasks} srun tasks (SLURM_STEP_NUM_TASKS) and no node flags "
                                           "were given (allowed: --slurm with one task per node, or --nnodes, "
                                           "--node-rank and --rdzv-endpoint)")
        if args.rdzv_id is not None:
            raise ZeroplanError("--rdzv-id", "only with several nodes (allowed: with --nnodes > 1 or --slurm)")
        return None
    if args.rdzv_endpoint is None:
        raise ZeroplanError("--rdzv-endpoint", f"needed with --nnodes {nnodes}: HOST:PORT of node 0, the same on "
                                               "every node (e.g. node01:29500)")
    parse_endpoint(args.rdzv_endpoint)
    rdzv_id = args.rdzv_id if args.rdzv_id is not None else args.run_id
    if not rdzv_id.strip():
        raise ZeroplanError("--rdzv-id", "must not be empty (allowed: any name, the same on every node)")
    return MultiNode(nnodes=nnodes, node_rank=node_rank, endpoint=args.rdzv_endpoint, rdzv_id=rdzv_id)


def run_measure(args: argparse.Namespace) -> int:
    from zeroplan.harness.engines_table import EngineKind, check_supported_names
    from zeroplan.harness.extension_locks import check_no_stale_extension_lock, describe_extension_locks
    from zeroplan.harness.launch import Interrupted, launch, out_dir_lock

    from zeroplan.atomic import writable_directory
    from zeroplan.cli.measure_check import check_machine
    from zeroplan.specs import StrategyKind, check_seq_len

    nodes = multinode_from_args(args, os.environ)
    model = resolve_model(args.model)
    from zeroplan.harness.model import check_buildable

    # Refused here, in one line, rather than once by every rank after the launch.
    check_buildable(model)
    # A learned position table has max_positions rows: a longer sequence is an IndexError in every rank.
    check_seq_len(model, batch_from_args(args))
    resolve_engine(args)
    world = args.nproc * (nodes.nnodes if nodes is not None else 1)
    check_parallel_args(args, model, world)
    check_supported_names(args.strategy, args.engine, args.optimizer, args.grad_accum)
    deepspeed_file_from_args(args, world)  # refused here, in one line, not once by every rank
    accelerate_notes_from_args(args, world)
    torchtitan_notes_from_args(args, world)
    if args.memory_snapshot and args.backend == "nccl":
        # The trace is the CPU allocator's (zeroplan.harness.allocator_trace); a GPU run snapshots itself.
        raise ZeroplanError("--memory-snapshot", "writes the CPU allocator's events; a CUDA run records its own with "
                                                 "torch.cuda.memory._record_memory_history() (allowed: --backend gloo)")
    # DeepSpeed JIT-builds ops into the torch extensions directory; a stale build lock there makes
    # every rank wait forever (zeroplan/harness/extension_locks.py).
    deepspeed = EngineKind(args.engine) is EngineKind.deepspeed
    if deepspeed:
        check_no_stale_extension_lock()
    check_machine(model, StrategyKind(args.strategy), args.nproc, args.backend)
    # Made here (the last check): a file, a special file or a folder that cannot be made is refused in one line.
    writable_directory(args.out, "out")
    try:
        with out_dir_lock(Path(args.out), nodes.node_rank if nodes is not None else 0):
            result = launch(args.nproc, _harness_argv(args), Path(args.out), args.timeout_s, nodes=nodes,
                            steps=args.steps)
    except Interrupted as stop:
        kept = len(list(Path(args.out).glob("rank*.json")))
        sys.stderr.write(f"zeroplan measure: stopped by {stop}: torchrun and its ranks were stopped; records of "
                         f"ranks that had not finished are marked complete=false ({kept} record file(s) in {args.out})\n")
        return 128 + stop.signum
    for error in result.errors:
        sys.stderr.write(error + "\n")
    if result.returncode == 124:
        locks = describe_extension_locks() if deepspeed else ""
        # A node whose ranks never wrote a record most often waited for a node that did not come.
        waiting = (f"; no rank of node {nodes.node_rank} wrote a record: its ranks wait until all {nodes.nnodes} nodes "
                   f"have started with --rdzv-endpoint {nodes.endpoint}" if nodes is not None and not result.records else "")
        sys.stderr.write(
            f"zeroplan measure: error: timeout-s: the run passed its {args.timeout_s:g} s limit and was stopped; "
            f"{len(result.records)} record(s) in {args.out}, incomplete ranks marked complete=false "
            f"(allowed: a larger --timeout-s){waiting}{'; ' + locks if locks else ''}\n"
        )
        return 2
    if result.missing_ranks or result.incomplete_ranks or result.returncode:
        stale = (f" (the record of rank(s) {result.stale_ranks} there is an earlier launch's)"
                 if result.stale_ranks else "")
        sys.stderr.write(
            f"zeroplan measure: error: ranks without a complete record: "
            f"{sorted(result.missing_ranks + result.incomplete_ranks)}{stale}; {len(result.records)} record(s) kept in {args.out}\n"
        )
        return 1
    if nodes is None:
        sys.stdout.write(f"{len(result.records)} records in {args.out}; compare with: zeroplan validate {args.out}\n")
    else:
        first = nodes.node_rank * args.nproc
        sys.stdout.write(
            f"node {nodes.node_rank} of {nodes.nnodes}: {len(result.records)} records (ranks {first}..{first + args.nproc - 1} "
            f"of {nodes.nnodes * args.nproc}) in {args.out}; once every node is done, compare with: "
            f"zeroplan validate <the --out of every node>\n"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_user_errors("zeroplan measure", run_measure, args)
