"""Read the text that nccl-tests' all_reduce_perf, all_gather_perf and reduce_scatter_perf print.

Format (NVIDIA/nccl-tests, src/common.cu and doc/PERFORMANCE.md): '#' comment lines hold the
header (``# nThread N nGpus G minBytes ...``, newer versions first print ``# nccl-tests version
V nccl-headers=C nccl-library=C`` and ``# Collective test starting: X_perf``), one ``#  Rank R
Group G Pid P on HOST device D [bus] NAME`` line per rank (versions before the Group column print
``#  Rank R Pid P on HOST ...``), the column header (``#  size count type redop root time algbw
busbw #wrong time algbw busbw #wrong``), and the footer (``# Avg bus bandwidth : X``, and in newer
versions ``# Collective test concluded: X_perf``). Each data row has the columns the header names:
``size(B) count type redop root`` (older versions have no root column) then out-of-place ``time(us)
algbw(GB/s) busbw(GB/s) #wrong`` and in-place ``time algbw busbw #wrong``; GB/s is 1e9 bytes/s, and
``#wrong`` is ``N/A`` when validation is off (``-c 0``).

Real logs carry more than that, and all of it is skipped: NCCL INFO/WARN lines, ``NCCL version``
banners, the shell prompt and the command line, loader warnings (``libnl-3.so.200: no version
information available``), markdown around a pasted block, an srun ``  0: `` label or an mpirun
``[1,0]<stdout>:`` tag in front of every line. A line is a data row when it starts like one (two
integers, then a word: ``size count type``); such a line that then does not parse is refused with
``file:line``. A file may hold several runs (a script that runs the three tests into one log):
each ``# nThread`` header starts one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")

# Element sizes of the nccl-tests type names (src/common.cu, test_typenames).
_TYPE_BYTES = {
    "int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "half": 2, "float": 4, "double": 8, "bfloat16": 2, "f8e4m3": 1, "f8e5m2": 1,
}
# srun --label ("  0: ") and mpirun --tag-output ("[1,0]<stdout>:") put a tag before each line.
_LINE_TAG = re.compile(r"^\s*(?:\d+:\s|\[\d+,\d+\]<std(?:out|err)>:)")
_RANK = re.compile(r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+(?:\s+\[[^\]]*\]\s+(.+))?")
_RUN_HEADER = re.compile(r"^#\s*nThread\s+\d+")
_STARTING = re.compile(r"^#\s*Collective test starting:\s*(\w+?)_perf")
_CONCLUDED = re.compile(r"^#\s*Collective test concluded:\s*(\w+?)_perf")
_COLUMNS = re.compile(r"^#\s*size\s+count\s+type\b")
_AVG_BUSBW = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.]+(?:[eE][-+]?\d+)?)")
# "# nccl-tests version 2.18.2 nccl-headers=22907 nccl-library=22907" (nccl-tests >= 2.14), and
# NCCL's own "NCCL version 2.20.5+cuda12.4" banner at NCCL_DEBUG=INFO (src/init.cc).
_LIBRARY_CODE = re.compile(r"^#\s*nccl-tests version\s+\S+.*\bnccl-library=(\d+)")
_NCCL_BANNER = re.compile(r"^NCCL version\s+(\d+\.\d+\.\d+)")
_ROW_START = re.compile(r"^\d+\s+\d+\s+[A-Za-z]\w*(?:\s|$)")


class NcclTestsRow(Frozen):
    """One message size of a sweep."""

    size_bytes: int = Field(ge=0)
    """Message size, the ``size`` column, in bytes."""
    count: int = Field(ge=0)
    """Elements, the ``count`` column."""
    type_bytes: int = Field(gt=0)
    """Bytes per element of the ``type`` column."""
    redop: str
    """Reduction operator (``none`` for all-gather; empty where the log has no redop column)."""
    out_of_place_time_s: float = Field(ge=0)
    """Out-of-place time, seconds (printed in microseconds)."""
    out_of_place_busbw_bytes_per_s: float = Field(ge=0)
    """Out-of-place bus bandwidth as printed, in bytes per second."""
    in_place_time_s: float = Field(ge=0)
    """In-place time, seconds."""
    in_place_busbw_bytes_per_s: float = Field(ge=0)
    """In-place bus bandwidth, in bytes per second."""


class NcclTestsLog(Frozen):
    """One nccl-tests run."""

    source: str
    """The file it was read from (with the run's number where the file holds several)."""
    collective: str
    """all_reduce, all_gather or reduce_scatter."""
    num_ranks: int = Field(gt=0)
    """Ranks (the number of ``Rank`` lines)."""
    num_nodes: int = Field(gt=0)
    """Distinct host names among the ranks."""
    rows: tuple[NcclTestsRow, ...]
    """The sweep, in file order."""
    reported_avg_busbw_bytes_per_s: float | None = None
    """The log's own ``# Avg bus bandwidth`` line (nccl-tests' mean of the busbw column over
    every row, in- and out-of-place), bytes per second; None where the log has no footer."""
    nccl_version: str | None = None
    """NCCL library version as the log states it (``nccl-library=`` code or the INFO banner)."""
    device_name: str | None = None
    """The GPU every rank ran on, as its ``Rank`` lines name it (None where they name none)."""

    @property
    def link(self) -> str:
        """The link the run measured: intra-node on one host, inter-node across hosts."""
        return "intra_node" if self.num_nodes == 1 else "inter_node"


@dataclass(frozen=True)
class _Layout:
    """Where a data row's fields sit (0-based), from the column header line."""

    num_columns: int
    redop: int | None
    out_of_place_time: int
    out_of_place_busbw: int
    out_of_place_wrong: int | None
    in_place_time: int
    in_place_busbw: int
    in_place_wrong: int | None


def _layout(names: list[str]) -> _Layout | None:
    """The layout a column header names, or None if it is not the two-block table."""
    times = [i for i, name in enumerate(names) if name == "time"]
    busbws = [i for i, name in enumerate(names) if name == "busbw"]
    wrongs = [i for i, name in enumerate(names) if name == "#wrong"]
    if names[:3] != ["size", "count", "type"] or len(times) != 2 or len(busbws) != 2:
        return None
    return _Layout(
        num_columns=len(names), redop=names.index("redop") if "redop" in names else None,
        out_of_place_time=times[0], out_of_place_busbw=busbws[0], out_of_place_wrong=wrongs[0] if wrongs else None,
        in_place_time=times[1], in_place_busbw=busbws[1], in_place_wrong=wrongs[1] if len(wrongs) > 1 else None,
    )


# The current header (nccl-tests 2.x since the root column) and the one before it.
_DEFAULT_LAYOUTS = {
    13: _layout("size count type redop root time algbw busbw #wrong time algbw busbw #wrong".split()),
    12: _layout("size count type redop time algbw busbw #wrong time algbw busbw #wrong".split()),
}


def nccl_version_from_code(code: int) -> str:
    """NCCL_VERSION_CODE to a version (nccl.h: major*10000 + minor*100 + patch since 2.9,
    major*1000 + minor*100 + patch before)."""
    if code >= 20900:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def _bad(path: str, line_no: int, message: str) -> ZeroplanError:
    return ZeroplanError("calibrate", f"{path}:{line_no}: {message}")


def _wrong_count(field: str) -> int:
    """The ``#wrong`` column: an integer, or N/A when nccl-tests did not check (-c 0)."""
    return 0 if field == "N/A" else int(field)


def _parse_row(path: str, line_no: int, line: str, layout: _Layout) -> NcclTestsRow:
    fields = line.split()
    if len(fields) != layout.num_columns:
        raise _bad(path, line_no, f"expected a data row of {layout.num_columns} columns, got {len(fields)}: {line[:60]!r}")
    type_name = fields[2]
    if type_name not in _TYPE_BYTES:
        raise _bad(path, line_no, f"unknown type {type_name!r} (allowed: {', '.join(_TYPE_BYTES)})")
    try:
        for index in (layout.out_of_place_wrong, layout.in_place_wrong):
            if index is not None and (wrong := _wrong_count(fields[index])) > 0:
                raise _bad(path, line_no, f"nccl-tests counted {wrong} wrong results at size {fields[0]}: the "
                                          "collective returned wrong data, so its times do not calibrate anything")
        return NcclTestsRow(
            size_bytes=int(fields[0]),
            count=int(fields[1]),
            type_bytes=_TYPE_BYTES[type_name],
            redop=fields[layout.redop] if layout.redop is not None else "",
            out_of_place_time_s=float(fields[layout.out_of_place_time]) * 1e-6,
            out_of_place_busbw_bytes_per_s=float(fields[layout.out_of_place_busbw]) * 1e9,
            in_place_time_s=float(fields[layout.in_place_time]) * 1e-6,
            in_place_busbw_bytes_per_s=float(fields[layout.in_place_busbw]) * 1e9,
        )
    except ValueError:
        raise _bad(path, line_no, f"a number does not parse or is negative: {line[:60]!r}") from None


def _row_collectives(rows: list[NcclTestsRow], ranks: int) -> set[str]:
    """What each row's sizes say it is: all-reduce has count*typesize == size; all-gather and
    reduce-scatter count*typesize*ranks == size, told apart by redop (none = all-gather)."""
    kinds = set()
    for row in rows:
        if row.count * row.type_bytes == row.size_bytes and ranks > 1 and row.redop not in ("none", ""):
            kinds.add("all_reduce")
        elif row.count * row.type_bytes * ranks == row.size_bytes and row.redop:
            kinds.add("all_gather" if row.redop == "none" else "reduce_scatter")
        else:
            kinds.add("unknown")
    return kinds


def _infer_collective(path: str, rows: list[NcclTestsRow], ranks: int) -> str:
    kinds = _row_collectives(rows, ranks)
    if len(kinds) != 1 or "unknown" in kinds:
        raise ZeroplanError(
            "calibrate", f"{path}: cannot tell the collective from the rows; pass --collective ({', '.join(COLLECTIVES)})"
        )
    return kinds.pop()


@dataclass
class _Run:
    """One run while it is read."""

    line_no: int
    named: str | None = None
    hosts: dict[int, str] = field(default_factory=dict)
    devices: dict[int, str] = field(default_factory=dict)
    rows: list[NcclTestsRow] = field(default_factory=list)
    avg_busbw_bytes_per_s: float | None = None


def _finish(name: str, run: _Run, collective: str | None, nccl_version: str | None) -> NcclTestsLog:
    where = f"{name} (run at line {run.line_no})" if run.line_no else name
    if not run.rows:
        raise ZeroplanError("calibrate", f"{where}: no data rows (is this nccl-tests output?)")
    if not run.hosts:
        raise ZeroplanError("calibrate", f"{where}: no '#  Rank N ... on HOST device' lines, so the ranks are unknown "
                                         "(paste the log with its 'Using devices' block)")
    ranks = len(run.hosts)
    if collective is None:
        collective = run.named if run.named in COLLECTIVES else _infer_collective(where, run.rows, ranks)
    if collective not in COLLECTIVES:
        raise ZeroplanError("calibrate", f"collective {collective!r} not supported (allowed: {', '.join(COLLECTIVES)})")
    # A collective given by name must be the one the rows (or the log's own header) show.
    shown = {run.named} if run.named in COLLECTIVES else _row_collectives(run.rows, ranks) - {"unknown"}
    if len(shown) == 1 and collective not in shown:
        raise ZeroplanError("calibrate", f"{where}: the log is an {shown.pop()} run, not {collective} "
                                         f"(allowed: --collective of the log's own collective, or none)")
    devices = set(run.devices.values())
    if len(devices) > 1:
        raise ZeroplanError("calibrate", f"{where}: its ranks ran on different GPUs ({', '.join(sorted(devices))}); "
                                         "the planner has one GPU per cluster (allowed: a run on one GPU model)")
    return NcclTestsLog(
        source=where, collective=collective, num_ranks=ranks, num_nodes=len(set(run.hosts.values())),
        rows=tuple(run.rows), reported_avg_busbw_bytes_per_s=run.avg_busbw_bytes_per_s, nccl_version=nccl_version,
        device_name=devices.pop() if devices else None,
    )


def parse_nccl_tests_runs(path: str | Path, collective: str | None = None) -> list[NcclTestsLog]:
    """Parse every run of one nccl-tests output file; ``collective`` overrides the detection."""
    name = str(path)
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as error:
        raise ZeroplanError("calibrate", f"cannot read {name!r}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ZeroplanError("calibrate", f"{name!r} is not a UTF-8 text file") from None
    runs: list[_Run] = []
    current: _Run | None = None
    starting: str | None = None
    nccl_version: str | None = None
    layout: _Layout | None = None
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = _LINE_TAG.sub("", raw, count=1).strip()
        if match := _NCCL_BANNER.match(line):
            nccl_version = nccl_version or match.group(1)
        if not line.startswith("#"):
            if _ROW_START.match(line):
                if current is None:  # rows without a run header: one implicit run
                    current = _Run(line_no=0)
                    runs.append(current)
                row_layout = layout or _DEFAULT_LAYOUTS.get(len(line.split()), _DEFAULT_LAYOUTS[13])
                current.rows.append(_parse_row(name, line_no, line, row_layout))
            continue
        if match := _RANK.match(line):
            if current is None:
                current = _Run(line_no=0)
                runs.append(current)
            current.hosts[int(match.group(1))] = match.group(2)
            if match.group(3):
                current.devices[int(match.group(1))] = match.group(3).strip()
        elif _RUN_HEADER.match(line):
            current = _Run(line_no=line_no, named=starting)
            runs.append(current)
            starting, layout = None, None
        elif match := _STARTING.match(line):
            starting = match.group(1)
        elif match := _CONCLUDED.match(line):
            if current is not None:
                current.named = match.group(1)
        elif match := _LIBRARY_CODE.match(line):
            nccl_version = nccl_version_from_code(int(match.group(1)))
        elif match := _AVG_BUSBW.match(line):
            if current is not None:
                current.avg_busbw_bytes_per_s = float(match.group(1)) * 1e9
        elif _COLUMNS.match(line):
            layout = _layout(line.lstrip("#").split())
            if layout is None:
                raise _bad(name, line_no, f"column header not understood (want size count type ... time algbw busbw "
                                          f"... time algbw busbw ...): {line[:60]!r}")
    if not runs:
        raise ZeroplanError("calibrate", f"{name}: no data rows (is this nccl-tests output?)")
    if len(runs) == 1:
        runs[0].line_no = 0  # one run: named by the file alone
    return [_finish(name, run, collective, nccl_version) for run in runs]


def parse_nccl_tests(path: str | Path, collective: str | None = None) -> NcclTestsLog:
    """Parse a file that holds one nccl-tests run; ``collective`` overrides the detection."""
    runs = parse_nccl_tests_runs(path, collective)
    if len(runs) != 1:
        lines = ", ".join(run.source.rsplit("line ", 1)[-1].rstrip(")") for run in runs)
        raise ZeroplanError("calibrate", f"{path}: holds {len(runs)} runs (at lines {lines}); expected one")
    return runs[0]
