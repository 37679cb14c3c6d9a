"""MODEL given as a file of Megatron-LM arguments (``zeroplan fit gpt2_755.args --framework
megatron``): the model is read from them (zeroplan.presets.megatron_args), and the run settings
that map exactly onto zeroplan's options (layout, batch, precision, distributed optimizer,
recomputation, overlaps) are planned where the flags leave them out. A flag that says the same
thing must agree with the arguments; a run setting a command does not take is refused."""

from __future__ import annotations

import argparse

from zeroplan.errors import ZeroplanError
from zeroplan.presets.megatron_args import (
    MegatronLaunch, megatron_arguments_path, model_only, read_megatron_arguments_file,
)
from zeroplan.specs.framework import Framework

READ_ATTRIBUTE = "_megatron_launch_read"
"""Where the namespace keeps the launch once read (a pipe such as <(echo $GPT_ARGS) gives its
content once) and applied."""

MEGATRON_FRAMEWORKS = (Framework.megatron,)
"""The frameworks whose model a Megatron-LM arguments file describes. The megatron-deepspeed
fork takes another argument set (bigscience-workshop/Megatron-DeepSpeed@8387ae1
megatron/arguments.py:398-405: --position-embedding-type absolute|rotary|alibi, --glu-activation
instead of --swiglu, an FFN of 4h whatever the activation)."""

# Megatron-LM argument -> (namespace attribute, flag, the flag's own default in fit's parser).
# tests/test_megatron_args.py checks the defaults against fit's parser, and the keys against
# zeroplan.presets.megatron_args.RUN_ARGUMENTS.
RUN_SETTINGS: dict[str, tuple[str, str, object]] = {
    "--tensor-model-parallel-size": ("tp", "--tp", 1),
    "--pipeline-model-parallel-size": ("pp", "--pp", 1),
    "--context-parallel-size": ("cp", "--cp", 1),
    "--expert-model-parallel-size": ("ep", "--ep", 1),
    "--num-virtual-stages-per-pipeline-rank": ("virtual_stages", "--virtual-stages", None),
    "--num-layers-per-virtual-pipeline-stage": ("virtual_stages", "--virtual-stages", None),
    "--sequence-parallel": ("sequence_parallel", "--sequence-parallel", None),
    "--micro-batch-size": ("micro_batch", "--micro-batch", None),
    "--global-batch-size": ("grad_accum", "--grad-accum", None),
    "--seq-length": ("seq_len", "--seq-len", None),
    "--fp16": ("precision", "--precision", None),
    "--bf16": ("precision", "--precision", None),
    "--use-distributed-optimizer": ("strategies", "--strategies", None),
    "--recompute-granularity": ("activation_checkpointing", "--activation-checkpointing", None),
    "--recompute-activations": ("activation_checkpointing", "--activation-checkpointing", None),
    "--recompute-method": ("activation_checkpointing", "--activation-checkpointing", None),
    "--recompute-num-layers": ("activation_checkpointing", "--activation-checkpointing", None),
    "--overlap-grad-reduce": ("overlap_grad_reduce", "--overlap-grad-reduce", None),
    "--overlap-param-gather": ("overlap_param_gather", "--overlap-param-gather", False),
    "--tp-comm-overlap": ("tp_comm_overlap", "--tp-comm-overlap", False),
}


def launch_of(args: argparse.Namespace) -> MegatronLaunch | None:
    """The Megatron-LM arguments file MODEL names, read and applied to ``args`` once; None where
    MODEL is a config.json (the caller has ruled out presets: megatron_launch)."""
    if hasattr(args, READ_ATTRIBUTE):
        return getattr(args, READ_ATTRIBUTE)
    path = megatron_arguments_path(getattr(args, "model", "") or "")
    launch = None if path is None else read_megatron_arguments_file(path)
    if launch is not None:
        _check_framework(args)
        if hasattr(args, "tp"):
            _apply(args, launch)
        else:
            model_only(path, "a command that searches the layout and batch (plan)")
    setattr(args, READ_ATTRIBUTE, launch)
    return launch


def _check_framework(args: argparse.Namespace) -> None:
    framework = getattr(args, "framework", None)
    if framework not in tuple(f.value for f in MEGATRON_FRAMEWORKS):
        allowed = ", ".join(f.value for f in MEGATRON_FRAMEWORKS)
        raise ZeroplanError("--framework", f"{framework}, but MODEL is a file of Megatron-LM arguments, which describe "
                                           f"Megatron-LM's GPTModel (allowed: {allowed})")


def _grad_accum(launch: MegatronLaunch, args: argparse.Namespace) -> int | None:
    """Micro-batches a step: megatron/core/num_microbatches_calculator.py:381-388 (d98e8a6),
    global_batch_size // (micro_batch_size x data-parallel size), which it asserts divides;
    arguments.py:442-448: the data-parallel size is world / (tp x pp x cp)."""
    if launch.global_batch_size is None:
        return 1  # arguments.py:702-703: global_batch_size = micro_batch_size x data-parallel size
    model_parallel = launch.tp * launch.pp * launch.cp
    gpus = getattr(args, "gpus", None)
    if gpus is None or gpus % model_parallel:
        raise ZeroplanError("--gpus", f"{gpus} is not a multiple of tp x pp x cp = {model_parallel} (Megatron-LM's "
                                      "world size must be)")
    per_step = (launch.micro_batch_size or 1) * (gpus // model_parallel)
    if launch.global_batch_size % per_step:
        raise ZeroplanError("--global-batch-size", f"{launch.global_batch_size} is not a multiple of micro-batch x "
                                                   f"data-parallel ranks = {per_step} on {gpus} GPUs (Megatron-LM asserts it is)")
    return launch.global_batch_size // per_step


def _planned(launch: MegatronLaunch, args: argparse.Namespace) -> dict[str, object]:
    """Each namespace attribute the arguments set, with the value the flag would carry."""
    return {
        "tp": launch.tp, "pp": launch.pp, "cp": launch.cp, "ep": launch.ep,
        # megatron-core's interleaved 1F1B (schedules.py forward_backward_pipelining_with_interleaving).
        "virtual_stages": launch.virtual_stages,
        "pp_schedule": "interleaved-1f1b" if launch.virtual_stages else None,
        "sequence_parallel": launch.sequence_parallel,
        "micro_batch": launch.micro_batch_size,
        "grad_accum": _grad_accum(launch, args),
        "seq_len": launch.seq_len,
        "precision": launch.precision.value,
        # Megatron-LM's DistributedDataParallel, or with --use-distributed-optimizer its
        # DistributedOptimizer: the megatron profile's ddp and zero1.
        "strategies": "zero1" if launch.distributed_optimizer else "ddp",
        "activation_checkpointing": launch.checkpointing.value,
        "overlap_grad_reduce": launch.overlap_grad_reduce,
        "overlap_param_gather": launch.overlap_param_gather,
        "tp_comm_overlap": launch.tp_comm_overlap,
    }


_FLAG_DEFAULTS = {attribute: (flag, default) for attribute, flag, default in RUN_SETTINGS.values()}
_FLAG_DEFAULTS["pp_schedule"] = ("--pp-schedule", None)
_ARGUMENT_OF = {attribute: argument for argument, (attribute, _, _) in RUN_SETTINGS.items()}
_ARGUMENT_OF["pp_schedule"] = "--num-virtual-stages-per-pipeline-rank"


def _apply(args: argparse.Namespace, launch: MegatronLaunch) -> None:
    """Set each run setting where its flag was left at its default; refuse a flag that says
    otherwise than the arguments."""
    for attribute, value in _planned(launch, args).items():
        if value is None:
            continue
        flag, default = _FLAG_DEFAULTS[attribute]
        current = getattr(args, attribute, default)
        if current == default or current == value:
            setattr(args, attribute, value)
            continue
        shown = "(none)" if current is None else current
        raise ZeroplanError(flag, f"{shown} but the Megatron-LM arguments plan {value} ({_ARGUMENT_OF[attribute]} and "
                                  f"what it implies; give {flag} {value}, or leave {flag} out)")


def ignored_line(launch: MegatronLaunch) -> str:
    """The arguments read as changing no byte planned, grouped by the reason (printed under fit's
    and compare's table, so that none is dropped unseen)."""
    reasons: dict[str, list[str]] = {}
    for entry in launch.ignored:
        argument, _, reason = entry.partition(": ")
        reasons.setdefault(reason, []).append(argument)
    if not reasons:
        return f"Megatron-LM arguments: {len(launch.given)} read, none ignored."
    groups = "; ".join(f"{', '.join(arguments)} ({reason})" for reason, arguments in reasons.items())
    return (f"Megatron-LM arguments: {len(launch.given) - len(launch.ignored)} read; ignored, changing no byte planned: "
            f"{groups}.")
