"""The command line of a measurement script that reads its arguments by position (an output
directory, names to run): -h/--help prints the script's docstring, and an argument that looks
like an option but is not one of the script's is refused in one line, before anything runs and
before anything is written (taken by position, "--help" became an output directory)."""

from __future__ import annotations

import sys
from pathlib import Path


def checked_argv(argv: list[str], doc: str | None, flags: tuple[str, ...] = ()) -> list[str]:
    """``argv`` unchanged once every argument beginning with '-' is one of ``flags``; exits 0
    after printing ``doc`` for -h/--help, 2 with a one-line error for any other option."""
    script = Path(sys.argv[0]).name
    if "-h" in argv or "--help" in argv:
        print(doc or f"usage: python benchmarks/{script}")
        raise SystemExit(0)
    for arg in argv:
        if arg.startswith("-") and arg not in flags and not _is_number(arg):
            allowed = ", ".join(flags) if flags else "none"
            print(f"{script}: error: unknown option {arg} (allowed: {allowed}; -h for the usage)", file=sys.stderr)
            raise SystemExit(2)
    return argv


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True
