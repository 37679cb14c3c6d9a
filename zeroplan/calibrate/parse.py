"""Read the text that nccl-tests' all_reduce_perf, all_gather_perf and reduce_scatter_perf print.

Format (NVIDIA/nccl-tests, src/common.cu and doc/PERFORMANCE.md): '#' comment lines hold the
header (``# nThread N nGpus G minBytes ...``), one ``#  Rank R Group G Pid P on HOST device D
[bus] NAME`` line per rank, and the footer (``# Avg bus bandwidth : X``, and in newer versions
``# Collective test concluded: all_reduce_perf``). Each data row is ``size(B) count type redop
root`` (older versions have no root column) then out-of-place ``time(us) algbw(GB/s)
busbw(GB/s) #wrong`` and in-place ``time algbw busbw #wrong``; GB/s is 1e9 bytes/s. NCCL INFO
lines and an srun ``  0: `` prefix are tolerated.
"""

from __future__ import annotations

import re
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
_SRUN_PREFIX = re.compile(r"^\s*\d+:\s")
_RANK = re.compile(r"^#\s*Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+")
_CONCLUDED = re.compile(r"^#\s*Collective test concluded:\s*(\w+?)_perf")
# NCCL's own banner with NCCL_DEBUG=VERSION ("NCCL version 2.21.5+cuda12.4"), and newer nccl-tests'
# header ("# nccl-tests version 2.17.1 ... nccl-library=22105", NCCL_VERSION_CODE = X*10000+Y*100+Z).
_NCCL_BANNER = re.compile(r"NCCL version (\d+\.\d+\.\d+)")
_NCCL_LIBRARY = re.compile(r"nccl-library=(\d{5,})")


class NcclTestsRow(Frozen):
    """One message size of a sweep."""

    size_bytes: int = Field(ge=0)
    """Message size, the ``size`` column, in bytes."""
    count: int = Field(ge=0)
    """Elements, the ``count`` column."""
    type_bytes: int = Field(gt=0)
    """Bytes per element of the ``type`` column."""
    redop: str
    """Reduction operator (``none`` for all-gather)."""
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
    """The file it was read from."""
    collective: str
    """all_reduce, all_gather or reduce_scatter."""
    num_ranks: int = Field(gt=0)
    """Ranks (the number of ``Rank`` lines)."""
    num_nodes: int = Field(gt=0)
    """Distinct host names among the ranks."""
    rows: tuple[NcclTestsRow, ...]
    """The sweep, in file order."""
    nccl_version: str | None = None
    """The NCCL release the log names (NCCL's version banner or nccl-tests' nccl-library code)."""

    @property
    def link(self) -> str:
        """The link the run measured: intra-node on one host, inter-node across hosts."""
        return "intra_node" if self.num_nodes == 1 else "inter_node"


def _bad(path: str, line_no: int, message: str) -> ZeroplanError:
    return ZeroplanError("calibrate", f"{path}:{line_no}: {message}")


def _infer_collective(path: str, rows: list[NcclTestsRow], ranks: int) -> str:
    """all-reduce has count*typesize == size; all-gather and reduce-scatter count*typesize*ranks
    == size, told apart by redop (none = all-gather)."""
    kinds = set()
    for row in rows:
        if row.count * row.type_bytes == row.size_bytes and ranks > 1 and row.redop != "none":
            kinds.add("all_reduce")
        elif row.count * row.type_bytes * ranks == row.size_bytes:
            kinds.add("all_gather" if row.redop == "none" else "reduce_scatter")
        else:
            kinds.add("unknown")
    if len(kinds) != 1 or "unknown" in kinds:
        raise ZeroplanError(
            "calibrate", f"{path}: cannot tell the collective from the rows; pass --collective ({', '.join(COLLECTIVES)})"
        )
    return kinds.pop()


def parse_nccl_tests(path: str | Path, collective: str | None = None) -> NcclTestsLog:
    """Parse one nccl-tests output file; ``collective`` overrides the detection."""
    name = str(path)
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as error:
        raise ZeroplanError("calibrate", f"cannot read {name!r}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ZeroplanError("calibrate", f"{name!r} is not a UTF-8 text file") from None
    hosts: dict[int, str] = {}
    concluded: str | None = None
    rows: list[NcclTestsRow] = []
    version: str | None = None
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = _SRUN_PREFIX.sub("", raw, count=1).strip()
        if version is None and (match := _NCCL_BANNER.search(line)):
            version = match.group(1)
        elif version is None and (match := _NCCL_LIBRARY.search(line)):
            code = int(match.group(1))
            version = f"{code // 10000}.{code // 100 % 100}.{code % 100}"
        if not line or "NCCL INFO" in line or "NCCL WARN" in line or line.startswith("NCCL version"):
            continue
        if line.startswith("#"):
            if match := _RANK.match(line):
                hosts[int(match.group(1))] = match.group(2)
            elif match := _CONCLUDED.match(line):
                concluded = match.group(1)
            continue
        fields = line.split()
        if len(fields) == 13:
            del fields[4]  # the root column of newer versions
        if len(fields) != 12:
            raise _bad(name, line_no, f"expected a data row of 12 or 13 columns, got {len(fields)}: {line[:60]!r}")
        type_name = fields[2]
        if type_name not in _TYPE_BYTES:
            raise _bad(name, line_no, f"unknown type {type_name!r} (allowed: {', '.join(_TYPE_BYTES)})")
        try:
            row = NcclTestsRow(
                size_bytes=int(fields[0]),
                count=int(fields[1]),
                type_bytes=_TYPE_BYTES[type_name],
                redop=fields[3],
                out_of_place_time_s=float(fields[4]) * 1e-6,
                out_of_place_busbw_bytes_per_s=float(fields[6]) * 1e9,
                in_place_time_s=float(fields[8]) * 1e-6,
                in_place_busbw_bytes_per_s=float(fields[10]) * 1e9,
            )
        except ValueError:
            raise _bad(name, line_no, f"a number does not parse or is negative: {line[:60]!r}") from None
        rows.append(row)
    if not rows:
        raise ZeroplanError("calibrate", f"{name}: no data rows (is this nccl-tests output?)")
    if not hosts:
        raise ZeroplanError("calibrate", f"{name}: no '#  Rank N ... on HOST device' lines, so the ranks are unknown")
    ranks = len(hosts)
    if collective is None:
        collective = concluded if concluded in COLLECTIVES else _infer_collective(name, rows, ranks)
    if collective not in COLLECTIVES:
        raise ZeroplanError("calibrate", f"collective {collective!r} not supported (allowed: {', '.join(COLLECTIVES)})")
    return NcclTestsLog(
        source=name, collective=collective, num_ranks=ranks, num_nodes=len(set(hosts.values())), rows=tuple(rows),
        nccl_version=version,
    )
