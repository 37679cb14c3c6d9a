"""Per-rank entry point, started by torchrun (locally or on a cluster):

    torchrun --nproc-per-node 2 -m zeroplan.harness tiny-llama --strategy zero2 --out runs/z2

Each rank writes its own record (runs/z2/rank00000.json, ...). A failing rank prints one line
and exits 1; the records other ranks wrote stay as they are.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from zeroplan.cli.parser import OneLineParser
from zeroplan.errors import ZeroplanError
from zeroplan.harness.args import (
    accelerate_notes_from_args, add_run_arguments, batch_from_args, check_parallel_args, deepspeed_file_from_args, parallel_from_args,
    resolve_engine, resolve_model, torchtitan_notes_from_args, training_from_args,
)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m zeroplan.harness", description="one rank of a measured run")
    add_run_arguments(parser)
    parser.add_argument("--save-parameters", help="rank 0 saves the full parameters here (torch.save), for oracle checks")
    parser.add_argument("--fail-rank", type=int, help="testing: this rank raises after its first step")
    return parser


def config_from_args(args):  # -> zeroplan.harness.runner.RunConfig (imports torch)
    """The run the parsed flags describe; a one-line ZeroplanError if no engine can run it."""
    from zeroplan.harness.engines import EngineKind, check_supported
    from zeroplan.harness.runner import RunConfig
    from zeroplan.specs import StrategyKind, check_seq_len

    resolve_engine(args)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = RunConfig(
        model=resolve_model(args.model), strategy=StrategyKind(args.strategy), engine=EngineKind(args.engine),
        training=training_from_args(args), batch=batch_from_args(args), steps=args.steps, seed=args.seed,
        run_id=args.run_id, fail_rank=args.fail_rank,
        keep_unsharded_grads_on_accum=args.keep_unsharded_grads_on_accum, parallel=parallel_from_args(args),
        deepspeed_file=deepspeed_file_from_args(args, world_size),
        memory_snapshot=args.memory_snapshot,
        config_notes=tuple(accelerate_notes_from_args(args, world_size) + torchtitan_notes_from_args(args, world_size)),
    )
    check_parallel_args(args, config.model, world_size)
    check_supported(config.strategy, config.engine, config.training.optimizer, config.batch.grad_accum_steps)
    check_seq_len(config.model, config.batch)
    return config


def run_and_save(config, out: Path, save_parameters: str | None, nccl_log: Path | None = None) -> None:
    """Run this rank; rank 0 saves the full parameters if asked; all ranks then wait for each other."""
    import torch
    import torch.distributed as dist

    from zeroplan.harness.runner import run_rank

    _, parameters = run_rank(config, out, nccl_log=nccl_log)
    if save_parameters and dist.get_rank() == 0:
        torch.save(parameters, save_parameters)
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import torch.distributed as dist

        from zeroplan.harness.nccl_log import enable_coll_log
        from zeroplan.harness.runner import default_backend, init_distributed

        config = config_from_args(args)
        backend = args.backend or default_backend()
        # NCCL reads its NCCL_DEBUG* variables when it first logs, i.e. after this point.
        nccl_log = None
        if backend == "nccl":
            nccl_log = enable_coll_log(os.environ, Path(args.out), int(os.environ.get("RANK", "0")))
        init_distributed(backend)
        run_and_save(config, Path(args.out), args.save_parameters, nccl_log)
        dist.destroy_process_group()
    except ZeroplanError as error:
        from zeroplan.cli.parser import user_error_line

        sys.stderr.write(f"zeroplan measure: error: {user_error_line(error)}\n")
        return 2
    except Exception as error:  # a rank's failure: one line, its records stay
        rank = _rank()
        sys.stderr.write(f"zeroplan measure: rank {rank} failed: {type(error).__name__}: {error}\n")
        return 1
    return 0


def _rank() -> str:
    return os.environ.get("RANK", "?")


def exit_rank(code: int) -> None:
    """Leave the rank's process with ``code`` once its records are written, skipping the
    interpreter's teardown. On gloo with the profiler's memory trace, about one 4-rank launch in
    ten aborted there after every rank had returned from main ("terminate called without an
    active exception", SIGABRT, from a native thread still joinable at exit): torchrun then
    reports the whole launch as failed although every record is complete. Nothing is left to
    tear down that a record needs: records are written atomically before this point."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_rank(main())
