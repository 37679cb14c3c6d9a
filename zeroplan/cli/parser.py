"""An argparse parser whose errors are one line and exit with status 2."""

from __future__ import annotations

import argparse
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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
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
