"""``--emit DIR`` of ``zeroplan plan`` and ``zeroplan fit``: the configuration shown, written as
run files (zeroplan.emit). Kept apart from the commands' own modules: zeroplan.cli.main adds the
flag and wraps the command (emitting), which runs as before and then writes the files."""

from __future__ import annotations

import argparse
import enum
import sys

from zeroplan.errors import ZeroplanError
from zeroplan.specs.lengths import VaryingLengths
from zeroplan.specs.strategy import StrategyKind

SKIPPED_DESTS = {"help", "format", "unit", "detail", "explain", "emit", "top", "run", "search_result"}
"""Flags that change how an answer is shown, not what is planned."""


def add_emit_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--emit", metavar="DIR",
                        help=f"write run files for {what} into DIR: DeepSpeed JSON, accelerate YAML, torchtitan or "
                             "torchtune overrides (those that apply), launch.sh, job.sbatch and a README")


class _RebuiltParser(argparse.ArgumentParser):
    """Parses the command line emit rebuilt; a flag that does not come back is emit's fault, said
    in one line rather than as argparse's usage text."""

    def error(self, message: str):
        raise ZeroplanError("--emit", f"the rebuilt fit flags do not parse back ({message}); please report it")


def _parser(add_arguments) -> argparse.ArgumentParser:
    parser = _RebuiltParser(add_help=False)
    add_arguments(parser)
    return parser


def flag_text(value) -> str:
    """The command-line text a parsed value came from: an enum by its value, a tuple or list
    (--lora-targets q,v) as its items joined by commas, a float by repr (every digit kept), the
    dataset's lengths as --varying-lengths reads them."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, VaryingLengths):
        # --varying-lengths MEAN,SD,MIN,SAMPLES,drop|truncate (zeroplan.cli.fit.varying_lengths_arg).
        return (f"{value.mean_tokens!r},{value.sd_tokens!r},{value.min_tokens},{value.samples},"
                f"{value.long_samples.value}")
    if isinstance(value, (tuple, list)):
        return ",".join(flag_text(item) for item in value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def flags_of(parser: argparse.ArgumentParser, values: dict) -> list[str]:
    """The command-line arguments that give ``values`` under ``parser`` (a value equal to the
    flag's default is left out), the positional model first. Every flag of fit survives the
    round trip parse -> flags_of -> parse (tests/test_emit_flags.py)."""
    positional, options = [], []
    for action in parser._actions:
        if action.dest in SKIPPED_DESTS or action.dest not in values:
            continue
        value = values[action.dest]
        if not action.option_strings:
            positional.append(flag_text(value))
            continue
        if value is None or value == action.default:
            continue
        flag = action.option_strings[-1] if action.dest == "algorithm" else action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            options.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:
            options.append(flag)
        else:
            options += [flag, flag_text(value)]
    return positional + options


def _fit_parser() -> argparse.ArgumentParser:
    from zeroplan.cli.fit import add_fit_arguments

    return _parser(add_fit_arguments)


def _one_strategy(args: argparse.Namespace) -> tuple[StrategyKind]:
    """The one strategy fit --emit writes the files of (cli.fit.strategies_asked)."""
    from zeroplan.cli.fit import strategies_asked

    kinds = strategies_asked(args)
    if kinds is None or len(kinds) != 1:
        raise ZeroplanError("--emit", "writes the files of one strategy (allowed: with --strategies naming exactly one, "
                                      "or a --deepspeed-config file)")
    return kinds


def planned_from_fit_flags(flags: list[str], command: str):
    """PlannedRun of the one strategy ``flags`` (fit's arguments) name, as fit predicts it."""
    from zeroplan.cli.fit import check_offload_ratio, request_from_args
    from zeroplan.core.plan import fit
    from zeroplan.emit import PlannedRun

    args = _fit_parser().parse_args(flags)
    kinds = _one_strategy(args)
    check_offload_ratio(args, kinds)
    report = fit(request_from_args(args, kinds[0]), kinds)
    plan = report.plan_for(kinds[0])
    request = request_from_args(args, kinds[0])
    if request.strategy.kind is not kinds[0]:
        request = request.with_strategy(request.strategy.model_copy(update={"kind": kinds[0]}))
    return PlannedRun(
        request=request, command=command, peak_bytes=plan.memory.peak_bytes,
        allocated_peak_bytes=plan.memory.allocated_peak_bytes, reserved_peak_bytes=plan.memory.reserved_peak_bytes,
        step_time_s=plan.time.step_with_overlap_s, fit_flags=tuple(flags),
    ), plan


def _write(planned, directory: str) -> int:
    from zeroplan.emit import emit

    result = emit(planned, directory)
    sys.stderr.write(result.summary() + "\n")
    return 0


def emit_fit(args: argparse.Namespace) -> int:
    """fit --emit: the one strategy asked for, written into args.emit."""
    import shlex  # here, not at the top: every fit builds --emit's flag, few use it

    flags = flags_of(_fit_parser(), vars(args))
    command = "zeroplan fit " + shlex.join(flags) + f" --emit {shlex.quote(args.emit)}"
    planned, plan = planned_from_fit_flags(flags, command)
    if not plan.fits:
        sys.stderr.write(f"zeroplan: note: {plan.strategy.value} does not fit as planned; its files are written anyway\n")
    return _write(planned, args.emit)


PLAN_ONLY = {"global_batch", "max_tp", "no_model_parallel", "top", "search_result", "search_held_off", "run"}


def emit_plan(args: argparse.Namespace, result) -> int:
    """plan --emit: the best configuration of the search, as fit flags, written into args.emit."""
    import shlex

    from zeroplan.cli.plan import SEARCH_HELD_OFF, add_plan_arguments

    best = result.best
    if best is None:
        raise ZeroplanError("--emit", "no configuration fits, so there is no plan to write (nothing was written)")
    values = {key: value for key, value in vars(args).items() if key not in PLAN_ONLY}
    values.update(
        strategies=best.strategy.value, micro_batch=best.micro_batch_size, grad_accum=best.grad_accum_steps,
        activation_checkpointing=best.activation_checkpointing.value, tp=best.tp, cp=best.cp, pp=best.pp,
        sequence_parallel=best.sequence_parallel if best.tp > 1 else None,
        pp_schedule=best.pp_schedule.value if best.pp > 1 else None,
        virtual_stages=best.virtual_stages if best.pp > 1 else None,
        hsdp_group=best.shard_group_size if best.strategy.value == "hsdp" else None,
        # What the search planned off where the framework's configuration sets it on
        # (zeroplan.cli.plan.SEARCH_HELD_OFF), named off so the run is the row planned.
        **{field: SEARCH_HELD_OFF[field] for field in getattr(args, "search_held_off", ())},
    )
    flags = flags_of(_fit_parser(), values)
    command = "zeroplan plan " + shlex.join(flags_of(_parser(add_plan_arguments), vars(args)))
    planned, _ = planned_from_fit_flags(flags, command + f" --emit {shlex.quote(args.emit)}")
    return _write(planned, args.emit)


def check_emit_directory(args: argparse.Namespace) -> None:
    """Refuse a --emit that is a file or a special file before any planning."""
    if getattr(args, "emit", None):
        from zeroplan.atomic import writable_directory

        writable_directory(args.emit, "--emit", create=False)


def emitting(command: str, run):
    """``run`` (the command), then, under --emit, the files of what it showed."""

    def run_then_emit(args: argparse.Namespace) -> int:
        check_emit_directory(args)
        if command == "fit" and getattr(args, "emit", None):
            _one_strategy(args)  # refused before planning
        status = run(args)
        if status or not getattr(args, "emit", None):
            return status
        return emit_plan(args, args.search_result) if command == "plan" else emit_fit(args)

    return run_then_emit
