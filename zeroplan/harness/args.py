"""Flags that describe one measured run, shared by the per-rank entry point and the launcher.
No torch here: the main command line imports this to register ``zeroplan measure``."""

from __future__ import annotations

import argparse
from pathlib import Path

from zeroplan.cli.parser import add_seq_len_arguments, positive_int
from zeroplan.errors import ZeroplanError
from zeroplan.harness.engines_table import MEASURABLE_OPTIMIZERS, PP_SCHEDULES
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule
from zeroplan.specs import ActivationCheckpointing, BatchSpec, ModelSpec, Optimizer, Precision, StrategyKind, TrainingSpec

MEASURABLE_PRECISIONS = (Precision.fp32, Precision.bf16_mixed)
ENGINES = ("zeroplan", "torch", "torch-fsdp1", "deepspeed")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="harness preset (tiny-llama, tiny-gpt2, ...) or a zeroplan model preset")
    parser.add_argument("--strategy", required=True, choices=[k.value for k in StrategyKind])
    parser.add_argument("--engine", choices=ENGINES, help="whose implementation runs (default zeroplan; torch with --tp or --pp)")
    parser.add_argument("--steps", type=positive_int, default=3)
    parser.add_argument("--micro-batch", type=positive_int, default=2)
    add_seq_len_arguments(parser, default=64)
    parser.add_argument("--precision", choices=[p.value for p in MEASURABLE_PRECISIONS], default=Precision.fp32.value)
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="micro-batches accumulated before each optimizer step (default 1)")
    parser.add_argument("--keep-unsharded-grads-on-accum", action="store_true",
                        help="zero2/zero3/fsdp-*: accumulate full gradients locally and reduce once per step "
                             "(FSDP1 no_sync, FSDP2 set_requires_gradient_sync(False)); default: reduce-scatter "
                             "every micro-batch into the gradient shard. ddp and zero1 reduce once per step either way")
    parser.add_argument("--optimizer", choices=[o.value for o in MEASURABLE_OPTIMIZERS], default=Optimizer.adamw.value)
    parser.add_argument("--activation-checkpointing", choices=["none", "full"], default="none")
    parser.add_argument("--deepspeed-config", metavar="FILE",
                        help="with --engine deepspeed: take the ZeRO stage, buckets, offload, batch split and precision "
                             "from this DeepSpeed config JSON (e.g. the deepspeed.json of zeroplan fit/plan --emit); "
                             "a setting that contradicts these flags, or that the CPU run cannot take, is refused")
    parser.add_argument("--accelerate-config", metavar="FILE",
                        help="with --engine torch and an fsdp-* strategy: check an accelerate FSDP2 config YAML (e.g. "
                             "the accelerate.yaml of zeroplan fit/plan --emit) against this run and record the settings "
                             "it took; a setting that contradicts these flags, or that the CPU run cannot take, is refused")
    parser.add_argument("--torchtitan-config", metavar="FILE",
                        help="with --engine torch: check torchtitan's command-line overrides (e.g. the "
                             "torchtitan-overrides.txt of zeroplan fit/plan --emit) against this run and record the "
                             "settings it took; a setting that contradicts these flags, or that the CPU run cannot "
                             "take, is refused")
    parser.add_argument("--memory-snapshot", action="store_true",
                        help="CPU runs: also write each rank's allocations as a torch.cuda.memory._snapshot()-format "
                             "pickle beside its record (rankNNNNN.snapshot.pickle; zeroplan validate --from-log reads it)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl with CUDA, else gloo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-id", default="local", help="a name stored in every record of the run")
    parser.add_argument("--out", required=True, help="directory for the per-rank records")
    parallel = parser.add_argument_group("model parallelism (docs/harness.md, 'Model parallelism')")
    parallel.add_argument("--tp", type=positive_int, default=1,
                          help="tensor-parallel degree: torch's parallelize_module over the inner mesh dimension, "
                               "FSDP2 (--strategy fsdp-*) over the rest; must divide --nproc (default 1)")
    parallel.add_argument("--sequence-parallel", action="store_true",
                          help="with --tp: norms and residual stream on sequence shards (SequenceParallel)")
    parallel.add_argument("--pp", type=positive_int, default=1,
                          help="pipeline stages, one per rank of each pipeline (torch.distributed.pipelining), "
                               "DDP or FSDP2 over the rest; must divide --nproc (default 1); "
                               "--grad-accum sets the micro-batches per step")
    parallel.add_argument("--pp-schedule", choices=list(PP_SCHEDULES),
                          help="pipeline schedule with --pp 2 or more (default 1f1b)")


def resolve_model(name: str) -> ModelSpec:
    from zeroplan.harness.presets import HARNESS_PRESETS
    from zeroplan.presets.models import get_model

    if name in HARNESS_PRESETS:
        return HARNESS_PRESETS[name]
    try:
        return get_model(name)
    except ZeroplanError:
        if name.endswith(".json") or Path(name).exists():
            # A config file that cannot be read or is refused: its own reason, not "unknown".
            raise
        from zeroplan.errors import unknown_name_error
        from zeroplan.presets.models import UNLISTED_MODELS, known_model_names

        raise unknown_name_error("model", name, [*HARNESS_PRESETS, *known_model_names()],
                                 f"{', '.join(HARNESS_PRESETS)}, {UNLISTED_MODELS}") from None


def training_from_args(args: argparse.Namespace) -> TrainingSpec:
    return TrainingSpec(
        precision=Precision(args.precision),
        optimizer=Optimizer(args.optimizer),
        activation_checkpointing=ActivationCheckpointing(args.activation_checkpointing),
    )


def batch_from_args(args: argparse.Namespace) -> BatchSpec:
    return BatchSpec(
        micro_batch_size=args.micro_batch, seq_len=args.seq_len, grad_accum_steps=args.grad_accum,
        allow_longer_seq=args.allow_longer_seq,
    )


def parallel_from_args(args: argparse.Namespace) -> ParallelSpec:
    """The ParallelSpec of the run (pipeline_rank 0: each rank records its own)."""
    return ParallelSpec(tp=args.tp, sequence_parallel=args.sequence_parallel, pp=args.pp,
                        pp_schedule=PipelineSchedule(args.pp_schedule or PipelineSchedule.one_f_one_b.value))


def check_parallel_args(args: argparse.Namespace, model: ModelSpec, nproc: int) -> None:
    """Refuse, in one line naming the flag, model parallelism the harness cannot run."""
    from zeroplan.harness.engines_table import EngineKind, check_parallel_supported

    if args.pp_schedule is not None and args.pp == 1:
        raise ZeroplanError("--pp-schedule", "needs pipeline parallelism (allowed: with --pp 2 or more)")
    check_parallel_supported(StrategyKind(args.strategy), EngineKind(args.engine), model, nproc, args.tp,
                             args.sequence_parallel, args.pp, args.pp_schedule or PipelineSchedule.one_f_one_b.value,
                             args.seq_len)
    if args.pp > 1:
        # The schedule is built with --grad-accum micro-batches; torch refuses a count its
        # schedule cannot run only once every rank has started (the planner applies the same rule).
        refused = parallel_from_args(args).microbatch_rule(args.grad_accum)
        if refused:
            raise ZeroplanError("--grad-accum", refused)


def deepspeed_file_from_args(args: argparse.Namespace, world_size: int | None) -> dict | None:
    """The ``--deepspeed-config`` JSON checked against the run's flags (one-line refusals naming the
    key, zeroplan.harness.deepspeed_file), or None without the flag. After resolve_engine."""
    if args.deepspeed_config is None:
        return None
    from zeroplan.harness.deepspeed_file import check_deepspeed_file, read_deepspeed_file

    if args.engine != "deepspeed":
        raise ZeroplanError("--deepspeed-config", f"configures DeepSpeed, not --engine {args.engine} "
                                                  "(allowed: with --engine deepspeed)")
    strategy = StrategyKind(args.strategy)
    config = read_deepspeed_file(args.deepspeed_config)
    check_deepspeed_file(config, strategy.zero_stage, strategy.offloads_optimizer, args.micro_batch, args.grad_accum,
                         Precision(args.precision) is Precision.bf16_mixed, world_size)
    return config


def accelerate_notes_from_args(args: argparse.Namespace, world_size: int | None) -> list[str]:
    """The record's notes of an ``--accelerate-config`` file checked against the run's flags
    (one-line refusals naming the key, zeroplan.harness.accelerate_file); [] without the flag."""
    if args.accelerate_config is None:
        return []
    from zeroplan.harness.accelerate_file import check_accelerate_file, read_accelerate_file

    if args.engine != "torch" or args.strategy not in ("fsdp-full-shard", "fsdp-shard-grad-op"):
        raise ZeroplanError("--accelerate-config", f"configures accelerate's FSDP2, not --engine {args.engine} "
                                                   f"--strategy {args.strategy} (allowed: with --engine torch and "
                                                   "--strategy fsdp-full-shard or fsdp-shard-grad-op)")
    if args.tp > 1 or args.pp > 1:
        raise ZeroplanError("--accelerate-config", "accelerate's FSDP config carries no --tp or --pp "
                                                   "(allowed: data parallelism only)")
    if args.deepspeed_config is not None:
        raise ZeroplanError("--accelerate-config", "one engine config file per run (allowed: without --deepspeed-config)")
    return check_accelerate_file(read_accelerate_file(args.accelerate_config), args.strategy, args.precision,
                                 args.activation_checkpointing, world_size)


def torchtitan_notes_from_args(args: argparse.Namespace, world_size: int | None) -> list[str]:
    """The record's notes of a ``--torchtitan-config`` file checked against the run's flags
    (one-line refusals naming the option, zeroplan.harness.torchtitan_file); [] without the flag."""
    if getattr(args, "torchtitan_config", None) is None:
        return []
    from zeroplan.harness.torchtitan_file import check_torchtitan_file, read_torchtitan_file

    if args.engine != "torch":
        raise ZeroplanError("--torchtitan-config", f"runs torchtitan's FSDP2, DDP, TP and PP (the torch engine), not --engine {args.engine} "
                                                   "(allowed: with --engine torch)")
    if args.deepspeed_config is not None or args.accelerate_config is not None:
        raise ZeroplanError("--torchtitan-config", "one engine config file per run (allowed: without "
                                                   "--deepspeed-config and --accelerate-config)")
    return check_torchtitan_file(read_torchtitan_file(args.torchtitan_config), strategy=args.strategy,
                                 precision=args.precision, activation_checkpointing=args.activation_checkpointing,
                                 micro_batch=args.micro_batch, grad_accum=args.grad_accum, seq_len=args.seq_len,
                                 tp=args.tp, pp=args.pp, sequence_parallel=args.sequence_parallel, world_size=world_size)


def resolve_engine(args: argparse.Namespace) -> None:
    """--engine's default: zeroplan's reference ZeRO, or torch's engines under --tp / --pp (the
    only ones that compose with torch's tensor-parallel and pipelining APIs)."""
    if args.engine is None:
        args.engine = "torch" if args.tp > 1 or args.pp > 1 else "zeroplan"
