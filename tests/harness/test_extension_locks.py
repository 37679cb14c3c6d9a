"""Stale torch JIT build locks (zeroplan/harness/extension_locks.py): found in a temporary
TORCH_EXTENSIONS_DIR or cache root, told apart from a lock a live process holds, and refused
before `zeroplan measure --engine deepspeed` starts a rank. No DeepSpeed build runs here, and
nothing under the real ~/.cache is touched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.harness import cli as measure_cli
from zeroplan.harness.extension_locks import (
    check_no_stale_extension_lock, describe_extension_locks, extension_locks, extensions_roots, lock_holders,
    stale_extension_locks,
)
from zeroplan.harness.launch import LaunchResult

needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")


def _lock(root: Path, op: str = "deepspeed_shm_comm") -> Path:
    """What a killed FileBaton owner leaves: <build dir>/lock, created O_CREAT|O_EXCL, now closed."""
    (root / op).mkdir(parents=True)
    lock = root / op / "lock"
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    return lock


def test_roots_follow_torch_extensions_dir_then_the_cache(tmp_path: Path) -> None:
    explicit = tmp_path / "ext"
    assert extensions_roots({"TORCH_EXTENSIONS_DIR": str(explicit)}) == [explicit]
    cache = tmp_path / "cache"
    (cache / "torch_extensions" / "py311_cpu").mkdir(parents=True)
    (cache / "torch_extensions" / "py311_cu128").mkdir()
    (cache / "torch_extensions" / "not-a-build-folder").mkdir()
    assert extensions_roots({"XDG_CACHE_HOME": str(cache)}) == [
        cache / "torch_extensions" / "py311_cpu", cache / "torch_extensions" / "py311_cu128"]
    home = tmp_path / "home"
    (home / ".cache" / "torch_extensions" / "py312_cpu").mkdir(parents=True)
    assert extensions_roots({"HOME": str(home)}) == [home / ".cache" / "torch_extensions" / "py312_cpu"]
    assert extensions_roots({"HOME": str(tmp_path / "nobody")}) == []


@needs_proc
def test_a_lock_no_process_holds_is_stale_and_refused_in_one_line(tmp_path: Path) -> None:
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    assert extension_locks(env) == [] and stale_extension_locks(env) == []
    check_no_stale_extension_lock(env)
    lock = _lock(tmp_path)
    assert extension_locks(env) == [lock] and lock_holders(lock) == []
    with pytest.raises(ZeroplanError) as error:
        check_no_stale_extension_lock(env)
    message = str(error.value)
    assert message.startswith("torch-extensions: stale JIT build lock ") and str(lock) in message
    assert "\n" not in message and "remove the file" in message
    assert lock.exists()  # found and named, never removed


@needs_proc
def test_a_lock_a_live_builder_holds_is_not_stale(tmp_path: Path) -> None:
    """A builder keeps the baton's descriptor open until it removes the file: while this process
    holds it, the lock belongs to a build in progress (others wait for it, and that is fine)."""
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    lock = _lock(tmp_path)
    fd = os.open(lock, os.O_RDONLY)
    try:
        assert lock_holders(lock) == [os.getpid()]
        assert stale_extension_locks(env) == []
        check_no_stale_extension_lock(env)
        assert f"held by pid {os.getpid()}" in describe_extension_locks(env)
    finally:
        os.close(fd)
    assert "held by no process on this machine" in describe_extension_locks(env)


def test_without_proc_nothing_is_called_stale(tmp_path: Path) -> None:
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    lock = _lock(tmp_path)
    no_proc = tmp_path / "no-proc"
    assert lock_holders(lock, no_proc) is None
    check_no_stale_extension_lock(env, no_proc)
    assert "holder unknown" in describe_extension_locks(env, no_proc)


@needs_proc
def test_measure_deepspeed_refuses_a_stale_lock_before_any_rank(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lock = _lock(tmp_path / "ext")
    launched = []
    monkeypatch.setattr("zeroplan.harness.launch.launch", lambda *args, **kwargs: launched.append(args))
    monkeypatch.setattr("zeroplan.harness.engines_table._module_installed", lambda name: True)
    code = measure_cli.main(["micro-llama", "--strategy", "zero2", "--engine", "deepspeed", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and not launched
    assert len(err.strip().splitlines()) == 1 and str(lock) in err and "torch-extensions" in err


@needs_proc
def test_measure_timeout_names_the_lock_left_behind(tmp_path: Path, monkeypatch, capsys) -> None:
    """A run stopped at its limit during a build leaves the lock: the timeout message names it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "ext").mkdir()

    def timed_out(nproc, argv, out_dir, timeout_s, nodes=None, steps=None):
        _lock(tmp_path / "ext")  # what the stopped rank 0 left
        return LaunchResult(124, [], list(range(nproc)), [], [])

    monkeypatch.setattr("zeroplan.harness.launch.launch", timed_out)
    monkeypatch.setattr("zeroplan.harness.engines_table._module_installed", lambda name: True)
    monkeypatch.setattr("zeroplan.cli.measure_check.check_machine", lambda *args: None)
    code = measure_cli.main(["micro-llama", "--strategy", "zero2", "--engine", "deepspeed", "--out", str(tmp_path / "out"),
                             "--timeout-s", "5"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "passed its 5 s limit" in err and str(tmp_path / "ext" / "deepspeed_shm_comm" / "lock") in err
    assert "held by no process on this machine" in err


@needs_proc
def test_a_lock_released_while_proc_is_scanned_is_not_stale(tmp_path: Path, monkeypatch) -> None:
    """FileBaton.release closes its descriptor, then removes the file: a build that finishes
    while /proc is scanned shows no holder for a lock that is about to vanish. That lock is not
    stale (the launch must go on), whether it is gone by the next look or replaced by a new
    build's baton (a different inode)."""
    from zeroplan.harness import extension_locks as locks
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    lock = _lock(tmp_path)
    real_holders = locks.lock_holders

    def released_during_scan(path, proc=Path("/proc")):
        holders = real_holders(path, proc)
        path.unlink()
        return holders

    monkeypatch.setattr(locks, "lock_holders", released_during_scan)
    assert stale_extension_locks(env, settle_s=0.0) == []
    check_no_stale_extension_lock(env, settle_s=0.0)

    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))

    batons = []

    def rebuilt_during_scan(path, proc=Path("/proc")):
        holders = real_holders(path, proc)
        if not batons:
            path.unlink()
            batons.append(os.open(path, os.O_CREAT | os.O_EXCL))  # the next waiter took the baton
        return holders

    monkeypatch.setattr(locks, "lock_holders", rebuilt_during_scan)
    try:
        assert stale_extension_locks(env, settle_s=0.0) == []
    finally:
        os.close(batons[0])
    monkeypatch.setattr(locks, "lock_holders", real_holders)
    assert stale_extension_locks(env, settle_s=0.0) == [lock]  # that builder killed since: stale
