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
from concurrent.futures import ThreadPoolExecutor
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


FAKE_TORCHRUN = '''
import json, os, sys, time
from pathlib import Path
source, out, nproc = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
for step in range(1, 4):
    for rank in range(nproc):
        record = json.loads((source / f"rank{rank:05d}.json").read_text())
        record.update(steps=record["steps"][:step], complete=step == 3)
        temporary = out / f".rank{rank}.tmp"
        temporary.write_text(json.dumps(record))
        os.replace(temporary, out / f"rank{rank:05d}.json")
        time.sleep(0.3)
time.sleep(1.0)
'''


def _measure_program(tmp_path: Path) -> str:
    """launch() as `zeroplan measure` calls it, with torchrun replaced by a script that writes two
    ranks' records step by step (from a committed run's records), as the harness's ranks do."""
    fake = tmp_path / "fake_torchrun.py"
    fake.write_text(FAKE_TORCHRUN)
    source = ROOT / "benchmarks" / "records" / "tiny-llama-ddp-torch-fp32-n2"
    out = tmp_path / "out"
    return _program(
        "import sys\nfrom pathlib import Path\nimport zeroplan.harness.launch as launch\n"
        f"launch.torchrun_command = lambda nproc, argv, nodes=None: [sys.executable, {str(fake)!r}, {str(source)!r}, "
        "argv[argv.index('--out') + 1], str(nproc)]\n"
        f"result = launch.launch(2, ['tiny-llama'], Path({str(out)!r}), 60, steps=3)\n"
        "print(result.returncode, len(result.records), result.incomplete_ranks)")


def test_measure_shows_steps_recorded_ranks_finished_and_time_on_a_terminal_only(tmp_path) -> None:
    # The two launches run side by side: each mostly waits on its fake torchrun's steps.
    (tmp_path / "piped").mkdir()
    with ThreadPoolExecutor(max_workers=1) as beside:
        piped_run = beside.submit(_python, _measure_program(tmp_path / "piped"), stderr_on_terminal=False)
        stdout, on_terminal = _python(_measure_program(tmp_path), stderr_on_terminal=True)
        piped_stdout, piped = piped_run.result()
    assert stdout.strip() == "0 2 []"
    assert "measure: steps recorded" in on_terminal and "/6" in on_terminal
    assert "ranks finished 0/2" in on_terminal and "ranks finished 2/2" in on_terminal
    assert "[00:0" in on_terminal  # the time elapsed
    assert piped_stdout.strip() == "0 2 []" and piped == ""
