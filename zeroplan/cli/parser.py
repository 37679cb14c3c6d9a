"""An argparse parser whose errors are one line and exit with status 2."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from pydantic import ValidationError

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import first_error
from zeroplan.specs.training import BatchSpec


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage before its error; a user wants the one line that says what is wrong."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)

    # argparse.py (3.11) ArgumentParser._get_values removes a '--' from every option's strings
    # ("strip out first '--'"), so '--host=--' leaves no string and stores [] with neither the
    # option's type nor its choices applied: a list where a string is read (a traceback), or a
    # falsy value read as the default (--precision=--, --emit=--, answered as if absent). An
    # option given '--' as its value is refused here, naming the option.
    def _get_values(self, action: argparse.Action, arg_strings: list[str]):  # type: ignore[no-untyped-def]
        if action.option_strings and action.nargs in (None, argparse.OPTIONAL) and arg_strings == ["--"]:
            self.error(f"argument {'/'.join(action.option_strings)}: expected one argument, got '--' "
                       "(allowed: a value; '--' ends the options)")
        return super()._get_values(action, arg_strings)

    # argparse.py (3.11) ArgumentParser._get_formatter: ``self.formatter_class(prog=self.prog)``,
    # whose HelpFormatter.__init__ with width None imports shutil for shutil.get_terminal_size;
    # argparse makes one at every add_argument on a parser (its metavar check) and in
    # add_subparsers, so every command paid the import (about 2 ms of CPU, 7 M instructions)
    # for a width no answer prints. The same width, columns - 2, from terminal_columns.
    def _get_formatter(self) -> argparse.HelpFormatter:
        return self.formatter_class(prog=self.prog, width=terminal_columns() - 2)


def terminal_columns(fallback: int = 80) -> int:
    """shutil.get_terminal_size((fallback, ...)).columns without importing shutil (shutil.py
    get_terminal_size, 3.10 to 3.13): COLUMNS where it is a positive integer, else the width of
    the terminal on sys.__stdout__, else ``fallback`` (no terminal, or one that reports 0)."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns > 0:
        return columns
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or fallback
    except (AttributeError, ValueError, OSError):
        return fallback


# Generic upper bounds on counts a user types (docs/input-bounds.md explains each). They are far
# above any real job and far below where int/float arithmetic or a table stops making sense, so
# a typo such as 10^12 GPUs is refused instead of answered.
MAX_COUNT = 2**20
MAX_SIMULATED_WORLD_SIZE = 4096
"""The most ranks a fake process group plays (simulate): FSDP2 chunks every parameter into N
pieces, so the work grows with N (Llama-3.1-8B: 10 s at 1,024 ranks, 27 s at 8,192 on 2 cores;
2^20 did not finish). The planner answers larger worlds without building anything."""
"""Default bound of a count flag (GPUs, micro-batch, accumulation steps, ranks): 1,048,576."""
MAX_SEQ_LEN = 2**24
"""Tokens per sequence: 16,777,216, above the longest context any published model trains with."""
MAX_FLOAT = 2.0**40
"""Bound of a positive number flag (memory in GiB/GB, seconds, MFU before its own check)."""
MAX_BUCKET_ELEMENTS = 2**36
"""--reduce-bucket-size: 2^36 elements (128 GiB of 16-bit gradients), a bucket no GPU holds."""


def _as_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None


def bounded_int(maximum: int, what: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in [1, maximum]; ``what`` explains the bound in the error."""

    def parse(text: str) -> int:
        value = _as_int(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(
                f"must be at most {maximum:,}{' (' + what + ')' if what else ''}, got {value:,}"
            )
        return value

    parse.__name__ = "positive integer"
    return parse


positive_int = bounded_int(MAX_COUNT, "2^20")
bucket_elements_int = bounded_int(MAX_BUCKET_ELEMENTS, "2^36 elements")
seq_len_int = bounded_int(MAX_SEQ_LEN, "2^24 tokens")

DEFAULT_SEQ_LEN = BatchSpec().seq_len
"""--seq-len of the planning commands when none is given (4096, capped at the model's max_positions)."""


def add_seq_len_arguments(parser: argparse.ArgumentParser, default: int | None = None, *, target: bool = False) -> None:
    """--seq-len and --allow-longer-seq; ``default`` None means DEFAULT_SEQ_LEN capped at the model's limit;
    ``target``: --target-len too (the planning command that plans encoder-decoders)."""
    shown = f"{default}" if default is not None else f"{DEFAULT_SEQ_LEN}, or the model's maximum positions if fewer"
    parser.add_argument("--seq-len", type=seq_len_int, default=default, help=f"tokens per sequence (default {shown})")
    parser.add_argument(
        "--allow-longer-seq", action="store_true",
        help="accept --seq-len above the model's maximum positions (RoPE models only; learned positions cannot)",
    )
    if not target:
        return
    parser.add_argument("--target-len", type=seq_len_int, default=None,
                        help="an encoder-decoder's (T5's, BART's) decoder tokens per sequence, --seq-len being its encoder's "
                             "(default: --seq-len)")


def seq_len_of(args: argparse.Namespace, max_positions: int) -> int:
    """The --seq-len given, else DEFAULT_SEQ_LEN capped at ``max_positions`` (GPT-2 has 1,024)."""
    return args.seq_len if args.seq_len is not None else min(DEFAULT_SEQ_LEN, max_positions)


OPTION_GROUPS = (
    ("cluster", "the GPUs, nodes and host of the job, and how compute and collectives on them are timed"),
    ("batch", "what one optimizer step processes: sequences, their length, accumulation"),
    ("precision and optimizer", "numeric formats, the optimizer and how its states are kept"),
    ("parallelism", "which sharding strategies are planned, and tensor, context, pipeline and expert parallelism"),
    ("fine-tuning", "LoRA, QLoRA and frozen weights (docs/finetuning.md)"),
    ("framework", "the training stack whose model code, checkpointing, attention and loss are predicted"),
    ("allocator", "how PyTorch's caching allocator is modelled when fit is judged"),
    ("output", "what is printed: the first screen, the full tables, one strategy's terms, JSON or CSV"),
)
"""The --help sections of the planning commands, each with the one line that says what it is for."""


def option_groups(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = ()) -> dict[str, argparse._ArgumentGroup]:
    """The parser's OPTION_GROUPS, by title, in their --help order (less those a command has no
    flags for: an empty group would still print its line)."""
    return {title: parser.add_argument_group(title, description)
            for title, description in OPTION_GROUPS if title not in leave_out}


def screen_width() -> int:
    """Columns of the first screen: the terminal's when standard output is one, else 100 (a file
    or a pipe has no width, and its reader's screen is unknown)."""
    from zeroplan.report.summary import DEFAULT_WIDTH

    if not sys.stdout.isatty():
        return DEFAULT_WIDTH
    return terminal_columns(DEFAULT_WIDTH)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    if value > MAX_FLOAT:
        raise argparse.ArgumentTypeError(f"must be at most 2^40, got {text}")
    return value


def choices_of(enum_type) -> list[str]:
    return [member.value for member in enum_type]


FLAG_OF_FIELD = {
    "batch.seq_len": "--seq-len",
    "batch.target_len": "--target-len",
    "batch.micro_batch_size": "--micro-batch",
    "batch.grad_accum_steps": "--grad-accum",
    "parallel": "--tp/--cp/--pp",
    "parallel.tp": "--tp",
    "parallel.cp": "--cp",
    "parallel.pp": "--pp",
    "parallel.sequence_parallel": "--sequence-parallel",
    "parallel.async_tp": "--async-tp",
    "parallel.virtual_stages": "--virtual-stages",
    "parallel.pp_schedule": "--pp-schedule",
    "parallel.ep": "--ep",
    "parallel.device_map": "--device-map",
    "model.moe_capacity_factor": "--moe-capacity-factor",
    "strategy": "--strategies",
    "precision": "--precision",
    "state_convention": "--state-convention",
    "strategy.shard_group_size": "--hsdp-group",
    "strategy.hpz_partition_size": "--hpz-partition-size",
    "strategy.zero_bucket_elements": "--reduce-bucket-size",
    "strategy.mics_shard_size": "--mics-shard-size",
    "finetune": "--lora-rank/--frozen-blocks",
    "finetune.lora_rank": "--lora-rank",
    "lora_rank": "--lora-rank",
    "finetune.lora_alpha": "--lora-alpha",
    "finetune.lora_targets": "--lora-targets",
    "finetune.lora_dropout": "--lora-dropout",
    "finetune.dora": "--dora",
    "finetune.vera": "--vera",
    "finetune.lora_fa": "--lora-fa",
    "finetune.quantize": "--quantize",
    "finetune.base_dtype": "--base-dtype",
    "finetune.quant_block_size": "--quant-block-size",
    "finetune.double_quant": "--double-quant",
    "finetune.bitsandbytes_version": "--bitsandbytes-version",
    "finetune.peft_version": "--peft-version",
    "finetune.gptq_group_size": "--gptq-group-size",
    "finetune.kbit_fp32_cast": "--kbit-fp32-cast",
    "finetune.freeze_embeddings": "--freeze-embeddings",
    "finetune.frozen_blocks": "--frozen-blocks",
    "compile": "--compile",
    "optimizer_in_backward": "--optimizer-in-backward",
    "optimizer": "--optimizer",
    "optimizer_loop": "--optimizer-loop",
    "fsdp_cpu_offload": "--fsdp-cpu-offload",
    "paged_optimizer": "--paged-optimizer",
    "torchtitan_release": "--torchtitan-release",
    "deepspeed_release": "--deepspeed-release",
    "use_cache": "--use-cache",
    "keep_outputs": "--keep-outputs",
    "uncast_loss": "--uncast-loss",
    "torch_multihead_attention": "--torch-multihead-attention",
    "deepspeed_torch_linear": "--deepspeed-torch-linear",
    "deepspeed_fused_adam": "--deepspeed-fused-adam",
    "checkpoint_reentrant": "--checkpoint-reentrant",
    "transformers_version": "--transformers-version",
    "accelerate_version": "--accelerate-version",
    "fsdp_state_dict": "--fsdp-state-dict",
    "torch_release": "--torch-release",
    "model_load": "--model-load",
    "litgpt_fork": "--litgpt-fork",
    "training.paged_optimizer": "--paged-optimizer",
    "float8": "--float8",
    "float8_all_gather": "--float8-all-gather",
    "float8_skips_output": "--float8-skip-output",
    "cluster.cuda_context_bytes": "--cuda-context-mib",
    "activation_checkpointing": "--activation-checkpointing",
    "activation_offloading": "--activation-offloading",
}
"""The request's fields (the Python API's names, which its errors carry) and the flags that set
them, so the command line names what its user typed. Words inside a message keep the field's
name ("allow_longer_seq" for --allow-longer-seq)."""


def user_error_line(error: ZeroplanError) -> str:
    """One line for the command line: the flag for a request field, else the error as is."""
    flag = FLAG_OF_FIELD.get(error.field)
    return f"{flag}: {error.detail}" if flag else str(error)


def run_reporting_user_errors(prog: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command; a user's mistake becomes one line on stderr and exit status 2."""
    try:
        return run(args)
    except ZeroplanError as error:
        sys.stderr.write(f"{prog}: error: {user_error_line(error)}\n")
        return 2
    except ValidationError as error:
        sys.stderr.write(f"{prog}: error: {first_error(error)}\n")
        return 2
