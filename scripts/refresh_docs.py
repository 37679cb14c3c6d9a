"""The docs' commands, run or parsed: README.md and docs/*.md.

Every ```console block is a command (`$ zeroplan ...`, continued with a trailing backslash)
followed by its real output; `python scripts/refresh_docs.py` reruns every one in process and
pastes the current output in place, and tests/test_docs_console.py fails until it has been run
after a change to the model. Output is compared exactly, except in a block preceded by the
marker line

    <!-- console: numbers vary (why) -->

where every number is masked before comparing (for timings; say why in the marker).

Every other `zeroplan ...` command in a code block (```bash, a bare ``` block, or a block
indented by four spaces) needs torch, torchrun or a GPU, or files that are not in the
repository, so it is not run: the test hands it to the sub-command's real argument parser
(`commands_to_parse`), which refuses a missing required flag or an unknown value. A synopsis
line is parsed twice: without its optional `[...]` parts and with all of them (first choice of
each `a|b`)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroplan.atomic import write_text_atomic  # noqa: E402

REFRESH_COMMAND = "python scripts/refresh_docs.py"
NUMBERS_VARY = "<!-- console: numbers vary"

_CONSOLE = re.compile(
    r"(?P<marker>^<!-- console: numbers vary[^\n]*-->\n)?"
    r"^```console\n(?P<command>\$ zeroplan (?:[^\n]*\\\n)*[^\n]*)\n(?P<output>.*?)^```$",
    flags=re.S | re.M,
)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def doc_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class ConsoleBlock:
    path: Path
    line: int
    command: str  # as written, continuations included, without the "$ "
    output: str
    numbers_vary: bool

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.command.replace("\\\n", " "))

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def console_blocks(path: Path) -> list[ConsoleBlock]:
    text = path.read_text()
    return [
        ConsoleBlock(path, text.count("\n", 0, match.start("command")) + 1, match["command"][2:],
                     match["output"].rstrip("\n"), match["marker"] is not None)
        for match in _CONSOLE.finditer(text)
    ]


def run_console(argv: list[str]) -> str:
    """The command's standard output, run in process; it must exit 0."""
    from zeroplan.cli.main import main

    assert argv[0] == "zeroplan", argv
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        status = main(argv[1:])
    if status != 0:
        raise AssertionError(f"{shlex.join(argv)} exited {status}")
    return output.getvalue().rstrip()


def mask_numbers(text: str) -> str:
    return _NUMBER.sub("N", text)


def same_output(block: ConsoleBlock, actual: str) -> bool:
    if block.numbers_vary:
        return mask_numbers(actual) == mask_numbers(block.output)
    return actual == block.output


def refresh(path: Path) -> bool:
    """Rerun the file's console blocks and write the current outputs; True when it changed."""
    text = path.read_text()

    def rerun(match: re.Match[str]) -> str:
        command = match["command"]
        output = run_console(shlex.split(command[2:].replace("\\\n", " ")))
        return f"{match['marker'] or ''}```console\n{command}\n{output}\n```"

    new = _CONSOLE.sub(rerun, text)
    if new != text:
        write_text_atomic(path, new)
    return new != text


# Commands that are only parsed ---------------------------------------------------------------

@dataclass(frozen=True)
class ParsedCommand:
    path: Path
    line: int
    argv: tuple[str, ...]  # from "zeroplan" (or "python -m zeroplan.simulate") on

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {shlex.join(self.argv)}"


_START = re.compile(
    r"(?:^|\s)((?:python -m zeroplan\.simulate|zeroplan (?:fit|compare|plan|validate|calibrate|models|gpus|simulate|measure))"
    r"(?:\s|$))"
)
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(?:\.\.\.)?$")  # MODEL, LOG... : a synopsis of every model


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every line in a fenced block that is not console, python or json
    output, and of every block indented by four spaces after a blank line."""
    lines = text.split("\n")
    found: list[tuple[int, str]] = []
    fence: str | None = None
    indented = False
    for number, line in enumerate(lines, 1):
        if fence is not None:
            if line.startswith("```"):
                fence = None
            elif fence in ("", "bash", "sh", "shell"):
                found.append((number, line))
            continue
        if line.startswith("```"):
            fence = line[3:].strip()
            continue
        if line.startswith("    ") and (indented or (number > 1 and not lines[number - 2].strip())):
            indented = True
            found.append((number, line[4:]))
        else:
            indented = False
    return found


def _joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in lines:
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        else:
            pending = (number, line)
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
        else:
            joined.append(pending)
            pending = None
    return joined


def _synopsis_forms(command: str) -> list[str]:
    """The command without its optional [...] parts and with all of them, each a|b as a."""
    if "[" not in command and "|" not in command:
        return [command]
    minimal = command
    while True:
        shorter = re.sub(r"\s*\[[^\[\]]*\]", "", minimal)
        if shorter == minimal:
            break
        minimal = shorter
    maximal = re.sub(r"[\[\]]", " ", command)
    first = re.compile(r"(?<![\w'\"])([\w.-]+)(?:\|[\w.-]+)+")
    return list(dict.fromkeys(" ".join(first.sub(r"\1", form).split()) for form in (minimal, maximal)))


def commands_to_parse(path: Path) -> list[ParsedCommand]:
    commands: list[ParsedCommand] = []
    for number, line in _joined(_code_lines(path.read_text())):
        start = _START.search(line)
        if start is None or line.lstrip().startswith("#"):
            continue
        command = line[start.start(1):]
        command = re.sub(r"\s+#.*$", "", command)  # a shell comment
        for form in _synopsis_forms(command):
            argv = shlex.split(form)
            if argv[:3] == ["python", "-m", "zeroplan.simulate"]:
                argv = ["zeroplan", "simulate", *argv[3:]]
            if any(_PLACEHOLDER.match(token) for token in argv[2:3]):
                continue
            commands.append(ParsedCommand(path, number, tuple(argv)))
    return commands


def parse(argv: tuple[str, ...] | list[str]):
    """The sub-command's own parser's Namespace (argparse exits 2 on a bad line)."""
    import importlib

    from zeroplan.cli.main import _DELEGATED, build_parser

    assert argv[0] == "zeroplan", argv
    if argv[1] in _DELEGATED:
        return importlib.import_module(_DELEGATED[argv[1]][0]).build_parser().parse_args(list(argv[2:]))
    from zeroplan.cli import validate_log

    if argv[1] == "validate" and validate_log.wants_log(list(argv[2:])):
        return validate_log.build_parser().parse_args(list(argv[2:]))  # as zeroplan.cli.main routes it
    return build_parser().parse_args(list(argv[1:]))


def main() -> int:
    for path in doc_paths():
        if refresh(path):
            print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
