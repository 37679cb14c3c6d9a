"""No writer of the project replaces a special file: an atomic write renames a temporary file over
its target, which as root turned ``--out /dev/full`` into a plain file. Each writer is aimed at a
character device (a private twin of /dev/null, made with mknod, so no real device is at risk), a
FIFO, a socket, a directory and a symlink to a device; each must refuse in one line and leave the
target what it was."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from zeroplan.atomic import writable_directory, write_atomic, write_text_atomic
from zeroplan.errors import ZeroplanError

AS_ROOT = os.geteuid() == 0
NCCL_LOG = Path(__file__).parent / "fixtures" / "nccl_tests" / "all_reduce_8gpu_1node.txt"


def _device(path: Path) -> Path:
    # Major 1, minor 3 is the null device: writes to it are discarded, whatever a bug would do.
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _directory(path: Path) -> Path:
    path.mkdir()
    return path


def _link_to_device(path: Path) -> Path:
    target = _device(path.with_name(path.name + ".target"))
    path.symlink_to(target)
    return path


@pytest.fixture
def bound_socket(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    sockets: list[socket.socket] = []

    def make(path: Path) -> Path:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        sockets.append(server)
        return path

    yield make
    for server in sockets:
        server.close()


SPECIAL_KINDS = ["device", "fifo", "directory", "link-to-device", "socket"]


@pytest.fixture(params=SPECIAL_KINDS)
def special(request, tmp_path: Path, bound_socket) -> tuple[Path, int]:
    """(a special file named like an output, its mode and device number before any write)."""
    kind = request.param
    if kind in ("device", "link-to-device") and not AS_ROOT:
        pytest.skip("mknod of a character device needs root (CI runs as root)")
    makers = {"device": _device, "fifo": _fifo, "directory": _directory, "link-to-device": _link_to_device,
              "socket": bound_socket}
    path = makers[kind](tmp_path / "out.png")
    return path, _identity(path)


def _identity(path: Path) -> tuple[int, int, int]:
    status = os.lstat(path)
    return status.st_mode, status.st_ino, status.st_rdev


def _assert_untouched(path: Path, before: tuple[int, int, int]) -> None:
    assert _identity(path) == before
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_write_text_atomic_refuses_a_special_file(special) -> None:
    path, before = special
    with pytest.raises(ZeroplanError, match=r"^out: .*(is a|is not).*") as error:
        write_text_atomic(path, "{}")
    assert "\n" not in str(error.value)
    _assert_untouched(path, before)


def test_write_atomic_refuses_before_it_writes_anything(special) -> None:
    path, before = special
    calls: list[Path] = []
    with pytest.raises(ZeroplanError):
        write_atomic(path, calls.append, "plot")
    assert calls == []
    _assert_untouched(path, before)


def test_a_link_to_a_regular_file_stays_a_link_and_its_file_is_rewritten(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_regular_file_is_replaced_and_no_temporary_file_stays(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text("old")
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_replaced_file_keeps_its_permissions(tmp_path: Path) -> None:
    """The rename put a new file with the process's default mode in place: a private (0600)
    calibration file became readable by everyone (0644)."""
    path = tmp_path / "gpu.json"
    path.write_text("old")
    path.chmod(0o600)
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("where", ["below-a-file", "in-proc"])
def test_a_folder_that_cannot_hold_the_file_is_one_line(tmp_path: Path, where: str) -> None:
    if where == "below-a-file":
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "out.json"
    else:
        path = Path("/proc/zeroplan-test/out.json")
    with pytest.raises(ZeroplanError, match="^out: cannot (write|make)"):
        write_text_atomic(path, "{}")
    with pytest.raises(ZeroplanError, match="^out: "):
        writable_directory(path.parent, "out")


def test_calibrate_refuses_a_special_out(zeroplan_cli, special) -> None:
    path, before = special
    code, out, err = zeroplan_cli("calibrate", str(NCCL_LOG), "--gpu", "h100", "--out", str(path))
    assert code == 2 and err.startswith("zeroplan: error: out: ") and err.count("\n") == 1, err
    assert out == ""
    _assert_untouched(path, before)


def test_validate_refuses_a_special_plot(zeroplan_cli, special, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path, before = special
    code, _, err = zeroplan_cli("validate", str(tmp_path), "--plot", str(path))
    assert code == 2 and err.startswith("zeroplan: error: plot: ") and err.count("\n") == 1, err
    _assert_untouched(path, before)


def test_the_validation_plot_writer_itself_refuses_a_special_file(special) -> None:
    pytest.importorskip("matplotlib")
    from zeroplan.validate.report import save_validation_plot
    from zeroplan.validate.rows import ComparisonRow

    path, before = special
    row = ComparisonRow(run_id="r", strategy="zero3", engine="zeroplan", world_size=2, rank=0, category="memory",
                        quantity="parameters", predicted_bytes=2**20, measured_bytes=2**20)
    with pytest.raises(ZeroplanError, match="^plot: "):
        save_validation_plot([row], path)
    _assert_untouched(path, before)


@pytest.mark.parametrize("command", [
    ["simulate", "tiny-llama", "--strategy", "fsdp-full-shard", "--world-size", "2"],
    ["measure", "tiny-llama", "--strategy", "zero2", "--nproc", "2", "--backend", "gloo"],
])
def test_simulate_and_measure_refuse_an_out_that_is_not_a_directory(zeroplan_cli, special, command) -> None:
    pytest.importorskip("torch")
    path, before = special
    if stat.S_ISDIR(os.stat(path).st_mode):
        pytest.skip("a directory is what --out takes here")
    code, _, err = zeroplan_cli(*command, "--out", str(path))
    assert code == 2 and err.count("\n") == 1, err
    assert "error: --out: " in err or "error: out: " in err, err
    _assert_untouched(path, before)
