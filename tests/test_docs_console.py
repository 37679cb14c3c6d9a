"""The docs' commands are real: every ```console block in README.md and docs/*.md is rerun and
its output compared, and every other `zeroplan ...` line in a code block is handed to the
sub-command's own argument parser (scripts/refresh_docs.py says how)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
docs = load_script(ROOT / "scripts" / "refresh_docs.py")

BLOCKS = [block for path in docs.doc_paths() for block in docs.console_blocks(path)]
PARSED = [command for path in docs.doc_paths() for command in docs.commands_to_parse(path)]


def test_the_docs_have_console_examples_and_commands_to_parse() -> None:
    assert len(BLOCKS) >= 6 and len(PARSED) >= 20
    assert {block.path.name for block in BLOCKS} >= {"README.md", "parallelism.md"}


@pytest.mark.parametrize("path", docs.doc_paths(), ids=lambda path: path.name)
def test_every_console_block_is_a_command_with_its_output(path: Path) -> None:
    # A ```console block the pattern does not read (no "$ zeroplan ..." line) would go unchecked.
    text = path.read_text()
    assert text.count("```console\n") == len(docs.console_blocks(path))
    assert text.count(docs.NUMBERS_VARY) == sum(block.numbers_vary for block in docs.console_blocks(path))
    fences = [line for line in text.split("\n") if line.startswith("```")]
    assert len(fences) % 2 == 0, f"{path.name}: an unclosed ``` fence"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_console_output_is_current(block) -> None:
    actual = docs.run_console(block.argv)
    assert docs.same_output(block, actual), (
        f"{block.name}: the output of `{' '.join(block.argv)}` changed; run `{docs.REFRESH_COMMAND}` "
        "and commit the docs it rewrites"
    )


@pytest.mark.parametrize("command", PARSED, ids=lambda command: command.name)
def test_command_in_the_docs_parses(command, capsys) -> None:
    try:
        docs.parse(command.argv)
    except SystemExit as error:
        pytest.fail(f"{command.name}: refused by its parser (exit {error.code}): {capsys.readouterr().err.strip()}")


def test_the_parse_check_refuses_a_missing_required_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        docs.parse(("zeroplan", "simulate", "llama-3.1-8b", "--framework", "hf", "--world-size", "8"))
    assert "--strategy" in capsys.readouterr().err


def test_synopsis_lines_are_parsed_without_and_with_their_options(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n\n```\n# a comment naming zeroplan measure\n"
        "zeroplan simulate m --strategy ddp --world-size 8 \\\n"
        "    [--activation-checkpointing none|full --out DIR]   # note\n```\n\n"
        "    zeroplan validate runs/a runs/b\n\n"
        "```console\n$ zeroplan models\nnot parsed here\n```\n"
    )
    forms = [command.argv for command in docs.commands_to_parse(doc)]
    assert forms == [
        ("zeroplan", "simulate", "m", "--strategy", "ddp", "--world-size", "8"),
        ("zeroplan", "simulate", "m", "--strategy", "ddp", "--world-size", "8", "--activation-checkpointing", "none",
         "--out", "DIR"),
        ("zeroplan", "validate", "runs/a", "runs/b"),
    ]


def test_numbers_vary_masks_numbers_only(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- console: numbers vary (timings) -->\n```console\n$ zeroplan models\nstep 1.25 s, 3 ranks\n```\n")
    (block,) = docs.console_blocks(doc)
    assert block.numbers_vary
    assert docs.same_output(block, "step 1.31 s, 4 ranks")
    assert not docs.same_output(block, "step 1.31 ms, 4 ranks")


def test_refresh_rewrites_outputs_keeping_markers_and_continuations(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    head = "# A doc\n\n<!-- console: numbers vary (why) -->\n```console\n$ zeroplan \\\n    gpus\n"
    doc.write_text(head + "stale\n```\n\nprose\n")
    assert docs.refresh(doc)
    (block,) = docs.console_blocks(doc)
    assert block.argv == ["zeroplan", "gpus"] and block.numbers_vary
    assert block.output == docs.run_console(["zeroplan", "gpus"]) and "h100-80gb" in block.output
    assert doc.read_text().startswith(head) and doc.read_text().endswith("\n```\n\nprose\n")
    assert not docs.refresh(doc)
