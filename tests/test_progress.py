"""Progress on stderr: shown under a terminal (a pseudo-terminal here), nothing when piped, and
tqdm not imported by the planner's start-up nor by a command that shows no bar."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import termios
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLAN = "['plan', 'gpt2', '--gpus', '8', '--global-batch', '64']"


def _python(program: str, stderr_on_terminal: bool) -> tuple[str, str]:
    """Run ``program`` with stdout piped and stderr on a pseudo-terminal (or piped)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not stderr_on_terminal:
        result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 0, result.stderr
        return result.stdout, result.stderr
    primary, secondary = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, and a bar fitted to no columns draws nothing.
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=secondary, env=env)
    os.close(secondary)
    seen = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the terminal's other end closed: the child is done
            break
        if not chunk:
            break
        seen += chunk
    stdout = process.communicate(timeout=120)[0].decode()
    os.close(primary)
    assert process.returncode == 0, seen.decode(errors="replace")
    return stdout, seen.decode(errors="replace")


def _program(body: str) -> str:
    # A bar waits PROGRESS_DELAY_S before it shows; set to 0 so the test does not hang on timing.
    return f"import zeroplan.progress as p\np.PROGRESS_DELAY_S = 0\n{body}\n"


def test_a_bar_shows_on_a_terminal_and_nothing_when_piped() -> None:
    body = "import time\nfor _ in p.progress(range(3), 3, 'counting'):\n    time.sleep(0.05)"
    _, on_terminal = _python(_program(body), stderr_on_terminal=True)
    assert "counting" in on_terminal and "/3" in on_terminal
    _, piped = _python(_program(body), stderr_on_terminal=False)
    assert piped == ""


def test_the_plan_search_shows_groups_done_on_a_terminal_only() -> None:
    run_plan = f"from zeroplan.cli.main import main\nraise SystemExit(main({PLAN}))"
    stdout_tty, stderr_tty = _python(_program(run_plan), stderr_on_terminal=True)
    assert "plan: groups" in stderr_tty
    stdout_piped, stderr_piped = _python(_program(run_plan), stderr_on_terminal=False)
    assert stderr_piped == ""
    # The answer on stdout is the same whether or not a bar was drawn beside it.
    assert stdout_tty == stdout_piped


def test_a_disabled_bar_shows_nothing_even_on_a_terminal() -> None:
    body = "for _ in p.progress(range(3), 3, 'quiet', enabled=False):\n    pass"
    _, on_terminal = _python(_program(body), stderr_on_terminal=True)
    assert "quiet" not in on_terminal


@pytest.mark.parametrize("program", [
    "import zeroplan.cli.main",
    "from zeroplan.cli.main import main\nmain(['fit', 'gpt2', '--gpus', '2'])",
    f"from zeroplan.cli.main import main\nmain({PLAN})",
])
def test_tqdm_is_imported_only_to_draw_a_bar(program: str) -> None:
    # stderr is piped: no bar, so tqdm is never imported (it costs tens of ms at start-up).
    stdout, _ = _python(f"{program}\nimport sys\nprint('tqdm' in sys.modules)", stderr_on_terminal=False)
    assert stdout.strip().splitlines()[-1] == "False"
