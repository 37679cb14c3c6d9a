"""Lock files that torch's JIT extension builds leave behind, found before a DeepSpeed launch.

DeepSpeed builds its ops on first use with ``torch.utils.cpp_extension.load`` (on CPU the
TorchBackend builds ``deepspeed_shm_comm``). torch 2.13 (torch/utils/cpp_extension.py,
``_jit_compile``) guards each build with ``FileBaton(<build dir>/lock)``
(torch/utils/file_baton.py): the builder creates the file with O_CREAT|O_EXCL and keeps it open
until it removes it; every other process polls ``while os.path.exists(lock)`` with no time
limit. A build killed before it released the baton leaves the file, and every later launch
that needs that op waits forever. The build directory is ``$TORCH_EXTENSIONS_DIR/<op>`` when
that variable is set, else ``<cache>/torch_extensions/py<XY>_<accelerator>/<op>``, where
<cache> is ``$XDG_CACHE_HOME`` or ``~/.cache`` (torch/_appdirs.py, ``user_cache_dir``).

A lock is stale when no process holds it open: that is read from /proc (Linux), where a
builder's open descriptor shows as a link to the file. ``FileBaton.release`` closes the
descriptor and only then removes the file, and a scan of /proc takes long enough for a build to
finish during it: a lock counts as stale only when the same file (device, inode, change time) is still
there, still unheld, after the scan and again a moment later. This module only finds and describes
locks; it never removes one (a build on another machine that shares the directory, which /proc
cannot see, would then be broken). No torch here: the launcher does not import it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from zeroplan.errors import ZeroplanError

LOCK_NAME = "lock"
"""The baton's file name inside an op's build directory (cpp_extension.py, _jit_compile)."""


def extensions_roots(environ: Mapping[str, str] | None = None) -> list[Path]:
    """The directories whose sub-directories are op build directories. Without
    TORCH_EXTENSIONS_DIR torch adds a ``py<XY>_<accelerator>`` level, which this process cannot
    name without importing torch: every such sub-directory of the cache root is returned."""
    environ = os.environ if environ is None else environ
    if explicit := environ.get("TORCH_EXTENSIONS_DIR"):
        return [Path(explicit)]
    cache = Path(environ.get("XDG_CACHE_HOME") or Path(environ.get("HOME", "~")).expanduser() / ".cache")
    root = cache / "torch_extensions"
    return sorted(path for path in root.glob("py*_*") if path.is_dir()) if root.is_dir() else []


def extension_locks(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Every ``<root>/<op>/lock`` that exists now."""
    return sorted(lock for root in extensions_roots(environ) for lock in root.glob(f"*/{LOCK_NAME}") if lock.is_file())


def lock_holders(lock: Path, proc: Path = Path("/proc")) -> list[int] | None:
    """Process ids (that this user may inspect) with ``lock`` open; None where /proc cannot say."""
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(lock)
    holders = []
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                holders.append(int(fd_dir.parent.name))
        except OSError:  # another user's process, or one that just exited
            continue
    return holders


STALE_SETTLE_S = 0.2
"""How long a lock must stay, unheld and unchanged, before it is called stale: far longer than a
release's gap between closing the baton's descriptor and removing its file."""


def _identity(lock: Path) -> tuple[int, int, int] | None:
    """(device, inode, change time) of the lock file, None once it is gone; the time tells a
    new file apart from a removed one whose inode number it reuses."""
    try:
        status = lock.stat()
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_ctime_ns


def _is_stale(lock: Path, proc: Path, settle_s: float) -> bool:
    """No holder, seen twice around a pause, of one file that stayed in place throughout."""
    identity = _identity(lock)
    if identity is None or lock_holders(lock, proc) != [] or _identity(lock) != identity:
        return False
    time.sleep(settle_s)
    return _identity(lock) == identity and lock_holders(lock, proc) == [] and _identity(lock) == identity


def _age(lock: Path, now_s: float) -> str:
    try:
        return f"{max(0.0, now_s - lock.stat().st_mtime):.0f} s old"
    except OSError:
        return "age unknown"


def stale_extension_locks(environ: Mapping[str, str] | None = None, proc: Path = Path("/proc"),
                          settle_s: float = STALE_SETTLE_S) -> list[Path]:
    """Locks no process on this machine holds open (empty where /proc cannot tell); a lock that
    disappears or is replaced while it is checked belonged to a live build and is not stale."""
    return [lock for lock in extension_locks(environ) if _is_stale(lock, proc, settle_s)]


def check_no_stale_extension_lock(environ: Mapping[str, str] | None = None, proc: Path = Path("/proc"),
                                  settle_s: float = STALE_SETTLE_S) -> None:
    """Refuse, in one line naming the file, to launch into a build that would wait forever."""
    stale = stale_extension_locks(environ, proc, settle_s)
    if stale:
        now_s = time.time()
        named = "; ".join(f"{lock} ({_age(lock, now_s)})" for lock in stale)
        raise ZeroplanError(
            "torch-extensions",
            f"stale JIT build lock {named}: no process on this machine holds it (a build was stopped before "
            f"it removed it), and DeepSpeed's op build would wait on it forever (torch/utils/file_baton.py); "
            f"remove the file, unless another machine sharing this directory is building that op",
        )


def describe_extension_locks(environ: Mapping[str, str] | None = None, proc: Path = Path("/proc")) -> str:
    """One sentence on the locks that exist now, for a run that passed its time limit ('' if none)."""
    locks = extension_locks(environ)
    if not locks:
        return ""
    now_s = time.time()
    parts = []
    for lock in locks:
        holders = lock_holders(lock, proc)
        held = ("held by no process on this machine" if holders == [] else
                f"held by pid {', '.join(map(str, holders))}" if holders else "holder unknown")
        parts.append(f"{lock} ({_age(lock, now_s)}, {held})")
    return ("JIT build lock(s) left in the torch extensions directory: " + "; ".join(parts)
            + "; a DeepSpeed rank waiting on one never ends: remove a lock no process holds")
