"""One check shared by the tests of bad input: a refusal is one line on stderr, exit status 2,
nothing on stdout and no traceback."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def run_refused(run: Callable[[list[str]], int], argv: Sequence[str], capsys) -> str:
    """Run an entry point on ``argv``, check the refusal's form and return its stderr."""
    try:
        code = run(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2, (argv, code, captured.err)
    assert captured.out == "", (argv, captured.out)
    assert captured.err.count("\n") == 1 and captured.err.endswith("\n"), (argv, captured.err)
    assert "Traceback" not in captured.err
    return captured.err
