"""`zeroplan measure` called off (SIGTERM, Ctrl-C) stops torchrun and its ranks before it exits,
with 128 + the signal's number; a second measure into a directory in use is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.harness.launch import out_dir_lock
from zeroplan.harness.record import read_record

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
LONG_RUN = ["micro-llama", "--strategy", "ddp", "--engine", "torch", "--nproc", "2", "--steps", "100000",
            "--seq-len", "16", "--precision", "fp32", "--timeout-s", "300"]


def test_a_second_measure_into_a_directory_in_use_is_refused(tmp_path: Path) -> None:
    with out_dir_lock(tmp_path, 0):
        with pytest.raises(ZeroplanError, match="being written by another zeroplan measure on this node"):
            with out_dir_lock(tmp_path, 0):
                pass
        with out_dir_lock(tmp_path, 1):  # another node of the same launch has its own lock
            pass
    with out_dir_lock(tmp_path, 0):  # released
        pass


def _start(out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zeroplan", "measure", *LONG_RUN, "--out", str(out)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_records(out: Path, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(list(out.glob("rank*.json"))) < 2:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no records"
        time.sleep(0.5)


@pytest.mark.slow  # launches torchrun twice
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_called_off_run_stops_its_ranks_and_exits_128_plus_the_signal(tmp_path: Path, signum: int) -> None:
    process = _start(tmp_path)
    _wait_for_records(tmp_path, process)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum
    assert out == "" and len(err.strip().splitlines()) == 1
    assert f"stopped by {signal.Signals(signum).name}: torchrun and its ranks were stopped" in err
    # Nothing runs on: no record changes after the launcher has returned, and none says complete.
    records = sorted(tmp_path.glob("rank*.json"))
    before = [(p.stat().st_mtime_ns, p.stat().st_size) for p in records]
    time.sleep(1)
    assert [(p.stat().st_mtime_ns, p.stat().st_size) for p in records] == before
    assert not any(read_record(p).complete for p in records)
    # The lock went with the launcher: a new run may use the directory.
    with out_dir_lock(tmp_path, 0):
        pass


def test_the_lock_leaves_nothing_behind(tmp_path: Path) -> None:
    with out_dir_lock(tmp_path, 0):
        assert [p.name for p in tmp_path.iterdir()] == [".measure-node0.lock"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["link to a file", "fifo"])
def test_the_lock_never_writes_through_what_sits_at_its_name(tmp_path: Path, kind: str) -> None:
    """A link or a FIFO left at the lock's name (by another user of the folder, say) is refused in
    one line and left as it was: the lock was opened with open(path, 'w'), which truncated a
    link's target and wrote the pid into it (as root, a device node's first bytes), and blocked
    for ever on a FIFO no one reads."""
    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".measure-node0.lock"
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.symlink_to(target)
    with pytest.raises(ZeroplanError, match="--out") as refusal:
        with out_dir_lock(out, 0):
            pass
    assert "\n" not in str(refusal.value)
    assert target.read_text() == "keep me\n"
    assert lock.is_symlink() if kind != "fifo" else lock.is_fifo()
