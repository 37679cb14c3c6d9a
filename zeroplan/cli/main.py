"""Entry point of the ``zeroplan`` command. Sub-commands import their heavy parts lazily so
that the planner answers fast and never imports torch."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, NoReturn

from zeroplan.cli import no_pydantic_plugins
from zeroplan.core.collector import cyclic_gc_paused

if TYPE_CHECKING:
    from zeroplan.cli.parser import OneLineParser


def _list_models(_args) -> int:
    from zeroplan.core.params import total_parameters
    from zeroplan.presets.models import get_model, model_names

    from zeroplan.harness.presets import HARNESS_PRESETS  # torch-free: specs only

    width = max(map(len, [*model_names(), *HARNESS_PRESETS]))
    for name in model_names():
        print(f"{name:{width}s} {total_parameters(get_model(name)):>18,} parameters")
    print("\nScaled-down models for measurement runs (zeroplan measure and simulate take these names):")
    for name, model in HARNESS_PRESETS.items():
        print(f"{name:{width}s} {total_parameters(model):>18,} parameters")
    print("\nA preset's Hugging Face hub id names it too (meta-llama/Llama-2-7b-hf, google/gemma-7b; any case).")
    return 0


def _list_gpus(_args) -> int:
    from zeroplan.presets.gpus import get_gpu, gpu_names
    from zeroplan.units import GiB

    for name in gpu_names():
        gpu = get_gpu(name)
        print(f"{name:14s} {gpu.memory_bytes / GiB:7.1f} GiB  {gpu.peak_bf16_flops_per_s / 1e12:7.0f} TFLOP/s  {gpu.display_name}")
    return 0


_COMMANDS = (
    ("fit", "per-GPU memory of every strategy, and a verdict", "zeroplan.cli.fit", "add_fit_arguments", "run_fit"),
    ("compare", "communication volume and step time of every strategy", "zeroplan.cli.fit", "add_fit_arguments", "run_compare"),
    ("validate", "predicted vs measured for harness records", "zeroplan.cli.validate", "add_validate_arguments", "run_validate"),
    ("calibrate", "fit link latency and bandwidth to nccl-tests output; calibrate step: the compute efficiency "
     "of one measured step", "zeroplan.cli.calibrate", "add_calibrate_arguments", "run_calibrate"),
    ("plan", "the fastest configuration that fits a global batch", "zeroplan.cli.plan", "add_plan_arguments", "run_plan"),
)
"""(name, help, module, the function adding its arguments, the function running it)."""


def build_parser(command_line: str | None = None) -> OneLineParser:
    """The command's parser. ``command_line``: the sub-command the line names, whose parser
    alone is built (argparse hands a sub-command's arguments to its own parser only, and the
    main parser's one-line errors name no sub-command: the others' parsers, ten argparse parsers
    built for nothing, would change no output); None: every one, in full."""
    import importlib

    from zeroplan.cli.parser import OneLineParser

    parser = OneLineParser(prog="zeroplan", description="Will it fit, with which sharding, and what will it cost?")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, help_text, module_name, add_name, run_name in _COMMANDS:
        if command_line is not None and name != command_line:
            continue
        command = commands.add_parser(name, help=help_text)
        module = importlib.import_module(module_name)
        run = getattr(module, run_name)
        getattr(module, add_name)(command)
        command.set_defaults(run=run)
        if name == "calibrate":
            from zeroplan.cli.calibrate_step import add_step_mode

            add_step_mode(command)
        if name in EMITTING:
            from zeroplan.cli.emit import add_emit_argument, emitting

            add_emit_argument(command, EMITTING[name])
            command.set_defaults(run=emitting(name, run))
    if command_line is not None:
        return parser
    for name, (_, help_text) in _DELEGATED.items():
        commands.add_parser(name, help=f"{help_text} (zeroplan {name} --help)", add_help=False)
    commands.add_parser("models", help="list model presets").set_defaults(run=_list_models)
    commands.add_parser("gpus", help="list the GPU catalog").set_defaults(run=_list_gpus)
    return parser


EMITTING = {"fit": "the one strategy --strategies names", "plan": "the fastest configuration"}
"""Commands that take --emit DIR (zeroplan.cli.emit) and what they write the run files of."""


# Sub-commands that run torch live in their own packages, with their own parsers; the main
# command hands them the rest of the line so that planning never imports torch.
_DELEGATED = {
    "simulate": ("zeroplan.simulate.cli", "run real FSDP2/DDP code of a full-size model on fake tensors"),
    "measure": ("zeroplan.harness.cli", "launch a real multi-process run (torchrun) and record it"),
}


# pydantic looks for plugins (its "pydantic" entry-point group) at the first model it builds:
# pydantic/plugin/_loader.py get_plugins reads the entry points of every installed distribution,
# 28 M instructions of fit llama-2-70b's 1,063 M (callgrind) in an environment of 125
# distributions (torch, deepspeed, transformers...). A plugin observes validations; this command's
# are its own specs and results. Where PYDANTIC_DISABLE_PLUGINS is set already, pydantic reads that
# value (an empty one: every plugin loads, as without the variable). Where every plugin is
# disabled, the loader's own imports (importlib.metadata, email, zipfile: 51 M instructions of the
# 971 M) are skipped too: zeroplan.cli.no_pydantic_plugins stands in for it.
def skip_pydantic_plugin_discovery(environ: MutableMapping[str, str]) -> None:
    environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")


# numpy's wheels load OpenBLAS, which starts a thread per core it may use when numpy is imported
# (the plan search, --format csv's pandas); each waits for work spinning before it sleeps, CPU
# time the command pays for matrix products it never asks for: the search's arrays are
# element-wise (core/search.py), no BLAS call. One thread, where OPENBLAS_NUM_THREADS is not set:
# `plan llama-3.1-70b --gpus 64 --global-batch 512` 985 -> 905 ms of CPU, `import numpy` alone
# 134 -> 94 ms (medians of 15 alternating runs, 2 cores). The torch commands (measure, simulate)
# keep their own threads: they return before this is set.
def single_blas_thread(environ: MutableMapping[str, str]) -> None:
    environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# When the command's process has answered, the interpreter tears down what its imports built
# (Py_FinalizeEx: every module's namespace cleared, each object freed one by one), 14 M
# instructions of fit llama-2-70b's 898 M (callgrind), for memory the operating system takes back
# whole at exit. The command (python -m zeroplan, the console script) flushes its two streams and
# ends there instead, with main's status; the interpreter exits as usual where anything is left
# to run at exit: a handler registered with atexit, a thread that is not a daemon, or a stream
# whose flush fails (a closed pipe: the interpreter reports it as it always has). Every file the
# commands write is closed before main returns (zeroplan.atomic).
def exit_without_teardown(status: int) -> NoReturn:
    """End the process with ``status`` after flushing stdout and stderr, skipping the
    interpreter's teardown where nothing is registered to run at exit."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        raise SystemExit(status) from None
    if _left_to_run_at_exit():
        raise SystemExit(status)
    os._exit(status)


def _left_to_run_at_exit() -> bool:
    import atexit

    count = getattr(atexit, "_ncallbacks", None)
    if count is None or count() > 0:
        return True
    threading = sys.modules.get("threading")
    if threading is None:
        return False
    return any(thread is not threading.main_thread() and not thread.daemon and thread.is_alive()
               for thread in threading.enumerate())


def command() -> NoReturn:
    """The ``zeroplan`` command: main() on sys.argv, then the process ends (exit_without_teardown)."""
    exit_without_teardown(main())


def main(argv: list[str] | None = None) -> int:
    try:
        if argv is None and sys.argv[1:2] != [] and sys.argv[1] in _DELEGATED:
            return _main(argv)  # torch's commands keep the collector as it is
        if argv is None:
            # This process is the command (the console script, python -m zeroplan): Python's
            # cyclic collector is paused from the first import of the specs to the end (what the
            # imports build lives as long as the process, and the planner frees what it
            # allocates by reference counting; its collections would walk every live object
            # again and again and find nothing), then what is left is moved out of its reach
            # (gc.freeze) so that the interpreter's collection at exit does not walk it either.
            # A caller running commands in its own process (main(argv), the tests) keeps its
            # collector as it was.
            skip_pydantic_plugin_discovery(os.environ)
            no_pydantic_plugins.install(os.environ)
            single_blas_thread(os.environ)
            with cyclic_gc_paused():
                try:
                    return _main(argv)
                finally:
                    gc.freeze()
        return _main(argv)
    except BrokenPipeError:
        # The reader closed the pipe (`zeroplan plan ... | head`): what it wanted was printed.
        # As Python's signal documentation advises (note on SIGPIPE), stdout is pointed at
        # devnull so that the interpreter's final flush does not fail a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "validate":
        from zeroplan.cli import validate_log

        if validate_log.wants_log(argv[1:]):
            return validate_log.main(argv[1:])
    if argv and argv[0] in _DELEGATED:
        import importlib

        try:
            module = importlib.import_module(_DELEGATED[argv[0]][0])
        except ImportError as error:
            sys.stderr.write(f"zeroplan: error: {argv[0]}: needs torch (pip install 'zeroplan[harness]'): {error}\n")
            return 2
        return module.main(argv[1:])
    named = argv[0] if argv and argv[0] in {command[0] for command in _COMMANDS} else None
    args = build_parser(named).parse_args(argv)
    from zeroplan.cli.parser import run_reporting_user_errors

    return run_reporting_user_errors("zeroplan", args.run, args)


if __name__ == "__main__":
    raise SystemExit(main())
