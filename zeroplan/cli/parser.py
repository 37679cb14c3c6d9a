"""An argparse parser whose errors are one line and exit with status 2."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

from pydantic import ValidationError

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import first_error


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage before its error; a user wants the one line that says what is wrong."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


# Generic upper bounds on counts a user types (docs/input-bounds.md explains each). They are far
# above any real job and far below where int/float arithmetic or a table stops making sense, so
# a typo such as 10^12 GPUs is refused instead of answered.
MAX_COUNT = 2**20
"""Default bound of a count flag (GPUs, micro-batch, accumulation steps, ranks): 1,048,576."""
MAX_SEQ_LEN = 2**24
"""Tokens per sequence: 16,777,216, above the longest context any published model trains with."""
MAX_FLOAT = 2.0**40
"""Bound of a positive number flag (memory in GiB/GB, seconds, MFU before its own check)."""


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
seq_len_int = bounded_int(MAX_SEQ_LEN, "2^24 tokens")


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


def run_reporting_user_errors(prog: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command; a user's mistake becomes one line on stderr and exit status 2."""
    try:
        return run(args)
    except ZeroplanError as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        return 2
    except ValidationError as error:
        sys.stderr.write(f"{prog}: error: {first_error(error)}\n")
        return 2
