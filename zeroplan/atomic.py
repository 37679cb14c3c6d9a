"""Atomic file writes: a reader sees the old file or the new one, never half of one.

An atomic write renames a temporary file over its target, and a rename replaces whatever the
name pointed at. Run as root, ``--out /dev/full`` would turn the device node into a plain file.
So every write the project makes goes through ``writable_file`` first: a target that exists and
is not a regular file (a device, a FIFO, a socket, a directory), or a symlink to one, is refused
in one line; a symlink to a regular file is followed, so the link stays and its file is rewritten.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from zeroplan.errors import ZeroplanError

# The kinds of file os.stat can report, in the words the refusal uses.
_KIND_OF_MODE = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for is_kind, name in _KIND_OF_MODE if is_kind(mode)), "not a regular file")


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def writable_file(path: str | Path, field: str) -> Path:
    """The path a write to ``path`` lands on (symlinks followed), refused in one line naming
    ``field`` where that is an existing non-regular file or its folder cannot hold a file."""
    real = Path(os.path.realpath(path))
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        _check_folder(real.parent, path, field)
        return real
    except OSError as error:
        raise ZeroplanError(field, f"cannot write {str(path)!r}: {_reason(error)}") from None
    if not stat.S_ISREG(mode):
        shown = f"{str(path)!r}" + (f" (a link to {str(real)!r})" if str(real) != os.path.abspath(path) else "")
        raise ZeroplanError(field, f"{shown} is {_kind(mode)}; zeroplan replaces only regular files "
                                   "(allowed: a new file name or an existing regular file)")
    return real


def _check_folder(folder: Path, path: str | Path, field: str) -> None:
    """The folder of a new file: it must be a directory zeroplan may create or write into."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ZeroplanError(field, f"cannot write {str(path)!r}: {str(existing)!r} is a file, not a folder")


def writable_directory(path: str | Path, field: str, create: bool = True) -> Path:
    """``path`` as a directory that exists afterwards (made where missing; with ``create=False``
    only checked, for a refusal before long work), refused in one line naming ``field`` where it
    is something else or cannot be made."""
    real = Path(os.path.realpath(path))
    if real.exists() and not real.is_dir():
        kind = "a file" if real.is_file() else _kind(os.stat(real).st_mode)
        raise ZeroplanError(field, f"{str(path)!r} is {kind}; give a directory (new or existing)")
    _check_folder(real, path, field)
    if not create:
        return real
    try:
        real.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ZeroplanError(field, f"cannot make the directory {str(path)!r}: {_reason(error)}") from None
    if not os.access(real, os.W_OK | os.X_OK):
        raise ZeroplanError(field, f"cannot write into {str(path)!r}: permission denied")
    return real


def write_atomic(path: str | Path, write: Callable[[Path], None], field: str = "out") -> Path:
    """Call ``write`` on a temporary file beside the target, fsync it, then rename it over the
    target; the temporary file never outlives a failure. Returns ``path`` as given."""
    real = writable_file(path, field)
    tmp = real.with_name(f".{real.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        # The rename puts a new file in place: it takes the replaced file's permissions, not the
        # process's default (a private 0600 file would otherwise become 0644).
        if real.exists():
            os.chmod(tmp, stat.S_IMODE(os.stat(real).st_mode))
        # Checked again just before the rename: the target may have changed while we wrote.
        writable_file(real, field)
        os.replace(tmp, real)
    except OSError as error:
        raise ZeroplanError(field, f"cannot write {str(path)!r}: {_reason(error)}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return Path(path)


def write_text_atomic(path: str | Path, text: str, field: str = "out") -> Path:
    """``text`` (UTF-8) written to ``path`` atomically: see write_atomic."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), field)
