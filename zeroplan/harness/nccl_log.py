"""A second count of a rank's collectives, from NCCL's own log (pure Python, no torch).

With ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL`` NCCL writes one line per collective or
point-to-point call as it is enqueued, from ``ncclEnqueueCheck`` in NVIDIA/nccl
``src/enqueue.cc``::

    INFO(NCCL_COLL,"%s: opCount %lx sendbuff %p recvbuff %p count %zu datatype %d op %d root %d comm %p [nranks=%d] stream %p",
         info->opName, info->comm->opCount, info->sendbuff, info->recvbuff, info->count,
         info->datatype, info->op, info->root, info->comm, info->comm->nRanks, info->stream);

Variants: NCCL 2.17 (and earlier) print the count with ``%zi`` instead of ``%zu`` (the same
decimal text); a recent master (with ncclAlltoAll, ncclGather, ncclScatter and copy-engine
collectives) prints the line as above; RCCL appends `` task %d globalrank %d``, which is
accepted and ignored. ``src/debug.cc`` puts ``<host>:<pid>:<tid> [<cudaDev>] NCCL INFO `` in
front (and, where NCCL_DEBUG_TIMESTAMP_LEVELS asks for it, a timestamp before that); glibc's
``%p`` prints a null pointer (Send's sendbuff) as ``(nil)``. The ``count`` is NCCL's argument,
per ``src/collectives.cc``: ncclAllGather's ``sendcount`` (one rank's part), ncclReduceScatter's
``recvcount`` (one rank's part), the buffer length otherwise; the log prints the datatype the
caller passed (NCCL turns AllGather and Broadcast into bytes only later, in taskAppend).

:func:`attach_nccl_log` reads the byte ranges of the log that the runner marked around setup and
around each step, and puts the parsed calls and their check against the dispatch-mode records
(``CollectiveRecord``) into the rank's record.
"""

from __future__ import annotations

import os
import re
import socket
from collections import defaultdict
from collections.abc import Iterable, MutableMapping
from pathlib import Path

from zeroplan.harness.record import (
    CollectiveRecord, NcclCheck, NcclCollective, NcclLogRecord, NcclSpan, OpTotals, RankRecord,
)

# ncclDataType_t (NVIDIA/nccl src/nccl.h.in) -> (torch-style name, bytes per element). Values 10
# and 11 (ncclFloat8e4m3, ncclFloat8e5m2) exist only in newer headers; older ones stop at
# ncclBfloat16 = 9.
DATATYPES: dict[int, tuple[str, int]] = {
    0: ("int8", 1), 1: ("uint8", 1), 2: ("int32", 4), 3: ("uint32", 4), 4: ("int64", 8), 5: ("uint64", 8),
    6: ("float16", 2), 7: ("float32", 4), 8: ("float64", 8), 9: ("bfloat16", 2),
    10: ("float8_e4m3fn", 1), 11: ("float8_e5m2", 1),
}

# NCCL's opName -> CollectiveRecord.op (zeroplan/harness/comm.py's vocabulary).
OPS = {
    "AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast", "Reduce": "reduce", "Send": "send", "Recv": "recv",
    "AlltoAll": "all_to_all", "Gather": "gather", "Scatter": "scatter",
}

# Calls whose count is one rank's part: the full buffer (comm.py's numel) is count * nranks.
PER_RANK_COUNT = {"AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter"}

_CALL = re.compile(
    r"NCCL INFO (?P<name>[A-Za-z]+): opCount (?P<op_count>[0-9a-fA-F]+) sendbuff (?P<sendbuff>\S+) "
    r"recvbuff (?P<recvbuff>\S+) count (?P<count>\d+) datatype (?P<datatype>-?\d+) op (?P<red_op>-?\d+) "
    r"root (?P<root>-?\d+) comm (?P<comm>\S+) \[nranks=(?P<nranks>\d+)\] stream (?P<stream>\S+)(?: .*)?$"
)
_DEVICE = re.compile(r"\S+:\d+:\d+ \[(?P<device>\d+)\] NCCL INFO ")


def _looks_like_call(line: str) -> bool:
    return "NCCL INFO " in line and ": opCount " in line


def parse_line(line: str, number: int = 1) -> NcclCollective | None:
    """One COLL call line -> its collective; None for any other line (INIT, TUNING, ...).
    Raises ValueError for a line that starts like a call line but does not parse."""
    line = line.rstrip("\r\n")
    if not _looks_like_call(line):
        return None
    match = _CALL.search(line)
    if match is None:
        raise ValueError(f"line {number}: not a complete COLL line: {line[:200]!r}")
    name, count, datatype, nranks = match["name"], int(match["count"]), int(match["datatype"]), int(match["nranks"])
    if nranks < 1:
        raise ValueError(f"line {number}: nranks={nranks}")
    numel = count * nranks if name in PER_RANK_COUNT else count
    dtype, size = DATATYPES.get(datatype, (f"unknown({datatype})", None))
    device = _DEVICE.search(line)
    return NcclCollective(
        name=name, op=OPS.get(name, name), op_count=int(match["op_count"], 16), count=count, datatype=datatype,
        dtype=dtype, red_op=int(match["red_op"]), root=int(match["root"]), comm=match["comm"], nranks=nranks,
        numel=numel, num_bytes=None if size is None else numel * size,
        cuda_device=int(device["device"]) if device else None, line=number,
    )


def parse_lines(lines: Iterable[str], first_number: int = 1) -> tuple[list[NcclCollective], list[str]]:
    """All call lines -> (collectives in log order, the lines that looked like calls but did not parse)."""
    calls: list[NcclCollective] = []
    malformed: list[str] = []
    for number, line in enumerate(lines, start=first_number):
        try:
            call = parse_line(line, number)
        except ValueError as error:
            malformed.append(str(error))
            continue
        if call is not None:
            calls.append(call)
    return calls, malformed


def read_span(data: bytes, start: int, end: int) -> NcclSpan:
    """The calls logged between two byte offsets of the log (``data`` is the whole file)."""
    if end < start:
        return NcclSpan(start_byte=start, end_byte=end, collectives=[], malformed_lines=[
            f"the log shrank from {start} to {end} bytes during this phase (rewritten from the start?)"])
    first_number = data.count(b"\n", 0, start) + 1
    text = data[start:end].decode("utf-8", errors="replace")
    calls, malformed = parse_lines(text.splitlines(), first_number)
    return NcclSpan(start_byte=start, end_byte=end, collectives=calls, malformed_lines=malformed)


# ---- where the log goes -------------------------------------------------------------------------

def nccl_hostname(raw: str | None = None) -> str:
    """The host name as NCCL writes it into %h (src/debug.cc, getHostNameForLog): gethostname()
    cut at the first '.', with '%' and '/' replaced by '-'."""
    name = (raw if raw is not None else socket.gethostname()).split(".", 1)[0]
    return name.replace("%", "-").replace("/", "-")


def expand_debug_file(pattern: str, hostname: str, pid: int) -> str:
    """NCCL_DEBUG_FILE as NCCL expands it (src/debug.cc, ncclDebugInit): %h -> host name, %p ->
    pid, %% -> %, any other %x kept as it is."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        i += 1
        if char != "%":
            out.append(char)
            continue
        code = pattern[i] if i < len(pattern) else ""
        i += 1 if code else 0
        out.append({"%": "%", "h": hostname, "p": str(pid)}.get(code, "%" + code))
    return "".join(out)


def default_log_file(out_dir: Path, rank: int) -> Path:
    """Where a rank's NCCL log goes unless NCCL_DEBUG_FILE is already set: next to its record."""
    return out_dir.resolve() / f"nccl-rank{rank:05d}.log"


def enable_coll_log(env: MutableMapping[str, str], out_dir: Path, rank: int,
                    hostname: str | None = None, pid: int | None = None) -> Path:
    """Ask NCCL for its COLL lines (before NCCL starts in this process) and return the file this
    process will write: NCCL_DEBUG at least INFO, COLL among NCCL_DEBUG_SUBSYS, and
    NCCL_DEBUG_FILE, unless set, a per-rank file in ``out_dir`` (a set one is honoured and
    expanded with this process's host name and pid, as NCCL does, and left alone: it should
    hold %p when ranks share a directory)."""
    if env.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        env["NCCL_DEBUG"] = "INFO"
    env["NCCL_DEBUG_SUBSYS"] = _with_coll(env.get("NCCL_DEBUG_SUBSYS", ""))
    pattern = env.get("NCCL_DEBUG_FILE")
    if not pattern:
        own = default_log_file(out_dir, rank)
        # NCCL truncates the file when it first logs, which may be after the runner's first
        # offset: a previous run's file must not be there to be measured.
        own.unlink(missing_ok=True)
        pattern = str(own).replace("%", "%%")
        env["NCCL_DEBUG_FILE"] = pattern
    return Path(expand_debug_file(pattern, nccl_hostname(hostname), os.getpid() if pid is None else pid))


def _with_coll(subsys: str) -> str:
    names = [part.strip() for part in subsys.split(",") if part.strip()]
    if not names:
        return "COLL"
    if names[0].startswith("^"):  # an excluded list: everything but these
        excluded = [n for n in [names[0][1:], *names[1:]] if n.upper() != "COLL"]
        return "^" + ",".join(excluded) if excluded else "ALL"
    if any(n.upper() in ("COLL", "ALL") for n in names):
        return subsys
    return ",".join([*names, "COLL"])


def log_offset(path: Path) -> int:
    """The log's current size: NCCL writes each line, line-buffered, before the call returns."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


# ---- the check ----------------------------------------------------------------------------------

def _totals(pairs: Iterable[tuple[str, int]]) -> dict[str, OpTotals]:
    calls: dict[str, int] = defaultdict(int)
    num_bytes: dict[str, int] = defaultdict(int)
    for op, size in pairs:
        calls[op] += 1
        num_bytes[op] += size
    return {op: OpTotals(calls=calls[op], num_bytes=num_bytes[op]) for op in sorted(calls)}


def check_span(phase: str, dispatch: list[CollectiveRecord], span: NcclSpan) -> NcclCheck:
    """Same calls per op and same bytes per op (and in total) in both counts; every difference
    becomes a sentence in ``disagreements``."""
    by_dispatch = _totals((c.op, c.num_bytes) for c in dispatch)
    by_nccl = _totals((c.op, c.num_bytes or 0) for c in span.collectives)
    problems: list[str] = []
    for op in sorted(set(by_dispatch) | set(by_nccl)):
        d, n = by_dispatch.get(op, OpTotals(calls=0, num_bytes=0)), by_nccl.get(op, OpTotals(calls=0, num_bytes=0))
        if d != n:
            problems.append(f"{phase}: {op}: {d.calls} call(s), {d.num_bytes} B by the dispatch mode; "
                            f"{n.calls} call(s), {n.num_bytes} B in the NCCL log")
    total_d = sum(t.num_bytes for t in by_dispatch.values())
    total_n = sum(t.num_bytes for t in by_nccl.values())
    if total_d != total_n:
        problems.append(f"{phase}: {total_d} B in all by the dispatch mode, {total_n} B in the NCCL log")
    unknown = [c for c in span.collectives if c.num_bytes is None]
    if unknown:
        problems.append(f"{phase}: {len(unknown)} NCCL call(s) with an unknown datatype "
                        f"({unknown[0].datatype}, line {unknown[0].line}) counted as 0 B")
    if span.malformed_lines:
        problems.append(f"{phase}: {len(span.malformed_lines)} COLL line(s) did not parse; first: {span.malformed_lines[0]}")
    return NcclCheck(phase=phase, dispatch=by_dispatch, nccl=by_nccl, agrees=not problems, disagreements=problems)


def attach_nccl_log(record: RankRecord, log_file: Path, setup: tuple[int, int],
                    steps: list[tuple[int, int]]) -> RankRecord:
    """``record`` with ``nccl_log`` filled from ``log_file``: ``setup`` and ``steps[k]`` are the
    byte offsets the runner took before and after wrapping the model and each step."""
    if len(steps) != len(record.steps):
        raise ValueError(f"{len(steps)} step spans for {len(record.steps)} steps")
    try:
        data = log_file.read_bytes()
    except FileNotFoundError:
        data = b""
    setup_span = read_span(data, *setup)
    step_spans = [read_span(data, start, end) for start, end in steps]
    checks = [check_span("setup", record.setup_collectives, setup_span)]
    checks += [check_span(f"step {s.step}", s.collectives, span) for s, span in zip(record.steps, step_spans)]
    if not data:
        checks[0] = checks[0].model_copy(update=dict(
            agrees=False, disagreements=[f"setup: the NCCL log {str(log_file)!r} is missing or empty", *checks[0].disagreements]))
    communicators = {c.comm: c.nranks for span in (setup_span, *step_spans) for c in span.collectives}
    log = NcclLogRecord(file=str(log_file), setup=setup_span, steps=step_spans, checks=checks,
                        communicators=communicators, agrees=all(c.agrees for c in checks))
    return record.model_copy(update=dict(nccl_log=log))
