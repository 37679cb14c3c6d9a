"""Inputs that were a traceback or a silent (wrong or ignored) answer: each is now one line on
stderr naming the flag or field and what is allowed, exit status 2, nothing on stdout. No case
launches torchrun: measure's refusals happen before it starts a rank."""

from __future__ import annotations

import pytest


def _one_line(capsys, argv: list[str], *words: str) -> str:
    from zeroplan.cli.main import main

    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2, (argv, code, captured.err)
    assert captured.out == "", (argv, captured.out)
    assert captured.err.count("\n") == 1 and captured.err.endswith("\n"), (argv, captured.err)
    assert "Traceback" not in captured.err
    for word in words:
        assert word in captured.err, (argv, word, captured.err)
    return captured.err


@pytest.mark.parametrize("argv,flag", [
    # cp 3 gives no layout (2 x cp does not divide 4096), and asking which cp would recursed
    # between the layout enumeration and its own error path.
    (["plan", "llama-3.1-8b", "--global-batch", "8", "--cp", "3", "--gpus", "6", "--gpus-per-node", "6"], "--cp: 3"),
    (["plan", "llama-3.1-8b", "--global-batch", "8", "--cp", "2", "--seq-len", "4097", "--gpus", "8"], "--cp: 2"),
])
def test_a_fixed_degree_without_layout_is_one_line(capsys, argv, flag) -> None:
    _one_line(capsys, argv, flag, "allowed: 1")


@pytest.mark.parametrize("argv,field", [
    (["fit", "{deep}"], "model: "),
    (["fit", "gpt2", "--gpu", "{deep}"], "gpu: "),
    (["validate", "{deep}"], "records: "),
])
def test_a_file_nested_200000_deep_is_one_line(capsys, tmp_path, argv, field) -> None:
    """The JSON decoder recurses once per level: a RecursionError, not a refusal naming the file."""
    deep = tmp_path / "config.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    _one_line(capsys, [a.format(deep=deep) for a in argv], field, str(deep), "nests")
