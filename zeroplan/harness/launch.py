"""Start a measured run on this machine with torchrun, under a time limit, and say which ranks
left records. Torch is imported only by the child processes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from zeroplan.errors import ZeroplanError
from zeroplan.harness.placement import MultiNode
from zeroplan.harness.record import record_path

STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class LaunchResult:
    returncode: int
    """torchrun's exit status (124 when the time limit ended the run)."""
    records: list[Path]
    """Record files of this node's ranks that exist after the run, one per rank that wrote one."""
    missing_ranks: list[int]
    """This node's (global) ranks without a record."""
    incomplete_ranks: list[int]
    """Ranks whose record stops before the last step (crashed or stopped)."""
    errors: list[str]
    """The one-line errors the ranks printed."""
    stale_ranks: list[int] = field(default_factory=list)
    """Ranks whose record file is the one an earlier launch left in the directory (this launch
    never replaced it); also in ``missing_ranks``."""


def torchrun_command(nproc: int, harness_argv: list[str], nodes: MultiNode | None = None) -> list[str]:
    """Alone on this machine (``--standalone``), or this node's share of a multi-node launch.
    Multi-node uses the static rendezvous: node ranks are the ones given, so node r's ranks are
    r*nproc ... r*nproc + nproc - 1 whatever order the nodes start in (the c10d rendezvous would
    number nodes by arrival), and node 0's agent hosts the store at the endpoint."""
    if nodes is None:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={nodes.nnodes}", f"--node-rank={nodes.node_rank}", "--rdzv-backend=static",
                 f"--rdzv-endpoint={nodes.endpoint}", f"--rdzv-id={nodes.rdzv_id}"]
    return [
        sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}",
        "-m", "zeroplan.harness", *harness_argv,
    ]


def launch(nproc: int, harness_argv: list[str], out_dir: Path, timeout_s: float,
           nodes: MultiNode | None = None, steps: int | None = None) -> LaunchResult:
    """Run ``nproc`` ranks on this machine (this node's share when ``nodes`` is given); never
    deletes or rewrites a record (each rank owns its own file, named by its global rank, so
    the nodes of one launch can share ``out_dir``). With ``steps`` (each rank's step count) and
    stderr on a terminal, a bar shows the steps the ranks have recorded, the ranks finished and
    the time elapsed (zeroplan.progress); off a terminal nothing is drawn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = torchrun_command(nproc, [*harness_argv, "--out", str(out_dir)], nodes)
    first = 0 if nodes is None else nodes.node_rank * nproc
    ranks = range(first, first + nproc)
    before = {rank: _file_identity(record_path(out_dir, rank)) for rank in ranks}
    from zeroplan import progress

    if steps is None or not progress.shown():
        returncode, output = run_torchrun(command, timeout_s)
    else:
        with RankProgress(out_dir, ranks, before, steps) as watch:
            returncode, output = run_torchrun(command, timeout_s, watch=watch.poll)
    return _collect(ranks, out_dir, returncode, output, before)


class RankProgress:
    """What the ranks have done so far, read from their records while torchrun runs: each rank
    rewrites its record after every step (zeroplan/harness/runner.py), so a record's step count
    is its progress and complete=true says the rank has finished. A file left by an earlier
    launch (same identity as before this one) counts for nothing."""

    def __init__(self, out_dir: Path, ranks: range, before: dict[int, tuple[int, int, int] | None],
                 steps: int) -> None:
        self.out_dir, self.ranks, self.before, self.steps = out_dir, ranks, before, steps
        self.seen: dict[int, tuple[tuple[int, int, int], int, bool]] = {}
        self.started = time.monotonic()
        self.bar = None

    def read(self) -> tuple[int, int]:
        """(steps recorded, ranks finished) over this launch's records."""
        import json

        for rank in self.ranks:
            identity = _file_identity(record_path(self.out_dir, rank))
            if identity is None or identity == self.before.get(rank):
                continue
            if rank in self.seen and self.seen[rank][0] == identity:
                continue
            try:
                data = json.loads(record_path(self.out_dir, rank).read_text(encoding="utf-8"))
                self.seen[rank] = (identity, len(data["steps"]), bool(data["complete"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # replaced while read, or not a record: the next poll reads it again
        return (sum(min(count, self.steps) for _, count, _ in self.seen.values()),
                sum(complete for *_, complete in self.seen.values()))

    def poll(self) -> None:
        from zeroplan import progress

        if self.bar is None:
            if time.monotonic() - self.started < progress.PROGRESS_DELAY_S:
                return
            self.bar = progress.steps(self.steps * len(self.ranks), "measure: steps recorded", delay_s=0,
                                      unit="step")
        recorded, finished = self.read()
        self.bar.update(recorded - self.bar.n)
        self.bar.set_postfix_str(f"ranks finished {finished}/{len(self.ranks)}", refresh=False)
        self.bar.refresh()  # redrawn every poll, so the elapsed time moves while no step lands

    def __enter__(self) -> "RankProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def out_dir_lock(out_dir: Path, node_rank: int) -> Iterator[None]:
    """Hold ``out_dir``'s lock for this node while its ranks run: a second launch into the same
    directory from the same node is refused at once, in one line, instead of interleaving its
    records with the first's (the nodes of one launch share a directory: each has its own lock)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f".measure-node{node_rank}.lock"
    with _open_lock(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ZeroplanError("--out", f"{out_dir} is being written by another zeroplan measure on this node "
                                         "(allowed: a directory no running measure uses)") from None
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            # Removed while still held, so the directory keeps only records. Left open: a measure
            # that opened the file in the instant before it went could lock the removed file
            # beside one that makes a new file; two launches started that close are not both refused.
            with contextlib.suppress(OSError):
                path.unlink()
            fcntl.flock(handle, fcntl.LOCK_UN)


def _open_lock(path: Path):  # type: ignore[no-untyped-def]
    """The lock file at ``path`` opened for writing, made if missing; never through a link, and
    only a regular file: open(path, "w") follows a link and truncates its target (then takes the
    pid), and blocks on a FIFO until someone reads it. O_NOFOLLOW refuses a link (ELOOP),
    O_NONBLOCK keeps a FIFO from blocking; whatever opens is checked to be a regular file before
    anything is written (zeroplan/atomic.py guards every other write the same way)."""
    import stat

    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(path, flags, 0o644)
    except OSError as error:
        mode = os.lstat(path).st_mode if os.path.lexists(path) else 0
        what = "a link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else error.strerror or str(error)
        raise ZeroplanError("--out", f"cannot take the lock {str(path)!r}: {what} (allowed: a regular file or none "
                                     "at that name; remove it)") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ZeroplanError("--out", f"cannot take the lock {str(path)!r}: not a regular file (allowed: a regular "
                                     "file or none at that name; remove it)")
    os.set_blocking(descriptor, True)
    os.ftruncate(descriptor, 0)
    return os.fdopen(descriptor, "w")


def _file_identity(path: Path) -> tuple[int, int, int] | None:
    """Every write of a record replaces the file (write_text_atomic: a new inode), so a file
    with the same inode, time and size as before the launch was not written by it. Matters when
    runs share a directory, as the nodes of one launch may, and a rank dies before its first record."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


class Interrupted(Exception):
    """The launcher was sent SIGINT or SIGTERM; torchrun and its ranks have been stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


POLL_S = 0.5
"""How often a watched launch calls its watcher while torchrun runs."""


def run_torchrun(command: list[str], timeout_s: float, watch: Callable[[], None] | None = None) -> tuple[int, str]:
    """Run a torchrun command under a time limit; its exit status (124 when stopped) and output.
    SIGINT or SIGTERM to this process stops torchrun (and so its ranks) before Interrupted is
    raised: a rank must not run on, and write records, after the run was called off. ``watch``,
    when given, is called every POLL_S while torchrun runs (the progress bar)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    # Output goes to a file, not a pipe: torchrun starts each worker in a session of its own,
    # so a worker that outlives the agent must not be able to block this process.
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)

        def called_off(signum: int, _frame) -> None:  # type: ignore[no-untyped-def]
            raise _CalledOff(signum)

        # Signal handlers can be set in the main thread only (a launch from another thread keeps
        # the default handling).
        in_main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, called_off) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
        try:
            try:
                returncode = _wait(process, timeout_s, watch)
            except subprocess.TimeoutExpired:
                stop_torchrun(process)
                returncode = 124
            except _CalledOff as called:
                # A second signal while stopping is ignored: the stop itself must finish.
                for sig in previous:
                    signal.signal(sig, signal.SIG_IGN)
                stop_torchrun(process)
                raise Interrupted(called.signum) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        log.seek(0)
        return returncode, log.read()


def _wait(process: subprocess.Popen, timeout_s: float, watch: Callable[[], None] | None) -> int:
    """process.wait under the time limit, calling ``watch`` between short waits; TimeoutExpired
    once the limit has passed, as process.wait raises it."""
    if watch is None:
        return process.wait(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return process.wait(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
        watch()


class _CalledOff(BaseException):
    """Raised by the signal handler out of process.wait (a BaseException, so nothing catches it on the way)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stop_torchrun(process: subprocess.Popen) -> None:
    """SIGTERM lets torchrun's agent stop its workers (torch/distributed/elastic/agent); SIGKILL
    follows if it does not finish in time."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _collect(ranks: range, out_dir: Path, returncode: int, output: str,
             before: dict[int, tuple[int, int, int] | None]) -> LaunchResult:
    from zeroplan.harness.record import read_record

    records, missing, incomplete, stale = [], [], [], []
    for rank in ranks:
        path = record_path(out_dir, rank)
        identity = _file_identity(path)
        if identity is None or identity == before.get(rank):
            missing.append(rank)
            if identity is not None:
                stale.append(rank)
            continue
        records.append(path)
        if not read_record(path).complete:
            incomplete.append(rank)
    errors = [line.strip() for line in output.splitlines() if line.startswith("zeroplan measure:")]
    return LaunchResult(returncode, records, missing, incomplete, errors, stale)
