"""The NCCL COLL-log parser and its check against the dispatch-mode count (no torch, no GPU).

Every log line here is FORMAT-DERIVED, not captured from a GPU run: it is built by printf-style
formatting of the format strings copied from NVIDIA/nccl (the INFO(NCCL_COLL, ...) call in
src/enqueue.cc, the "<host>:<pid>:<tid> [<dev>] NCCL INFO " prefix of src/debug.cc), with
glibc's rendering of %p ("0x..." and "(nil)"). The NCCL path of the harness has not been run on a
GPU yet; these tests pin the parser to the format as the source prints it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zeroplan.harness.nccl_log import (
    attach_nccl_log, check_span, enable_coll_log, expand_debug_file, nccl_hostname, parse_line, parse_lines, read_span,
)
from zeroplan.harness.record import CollectiveRecord, read_record

# Copied from NVIDIA/nccl src/enqueue.cc (ncclEnqueueCheck); 2.17 and earlier use %zi for count.
COLL_FORMAT = ("%s: opCount %lx sendbuff %p recvbuff %p count %zu datatype %d op %d root %d comm %p "
               "[nranks=%d] stream %p")
COLL_FORMAT_2_17 = COLL_FORMAT.replace("%zu", "%zi")
# RCCL's variant (src/enqueue.cc of ROCm/rccl) appends two fields.
COLL_FORMAT_RCCL = ("%s: opCount %lx sendbuff %p recvbuff %p count %zi datatype %d op %d root %d comm %p "
                    "[nranks=%d] stream %p task %d globalrank %d")
# src/debug.cc: hostname:pid:tid, then "[%d] NCCL INFO %s\n" with the CUDA device.
PREFIX_FORMAT = "%s:%d:%d [%d] NCCL INFO "
# NCCL's TUNING line (src/enqueue.cc), printed with NCCL_DEBUG_SUBSYS=TUNING or ALL: not a call.
TUNING_FORMAT = "%s: %ld Bytes -> Algo %s proto %s channel{Lo..Hi}={%d..%d}"

FLOAT32, BFLOAT16, INT64 = 7, 9, 4
DDP_COMM, SUB_COMM = 0x55D0C0FFEE00, 0x55D0C0FFEF80


def printf(fmt: str, *args: object) -> str:
    """C printf for the conversions these formats use, as glibc renders them."""
    values = iter(args)

    def one(match: re.Match[str]) -> str:
        spec = match.group(0)
        if spec == "%%":
            return "%"
        value = next(values)
        if spec == "%p":
            return "(nil)" if value in (None, 0) else f"0x{value:x}"
        if spec == "%lx":
            return f"{value:x}"
        if spec == "%s":
            return str(value)
        return str(int(value))  # %d %zu %zi %ld

    text = re.sub(r"%(?:%|p|lx|ld|zu|zi|d|s)", one, fmt)
    assert next(values, None) is None, "more arguments than conversions"
    return text


def coll_line(name: str, count: int, datatype: int, nranks: int, *, op_count: int = 0, red_op: int = 0,
              root: int = 0, comm: int = DDP_COMM, sendbuff: int | None = 0x7F0000200000,
              recvbuff: int = 0x7F0000400000, stream: int = 0x55D0BEEF0000, device: int = 0,
              fmt: str = COLL_FORMAT, extra: tuple[int, ...] = ()) -> str:
    prefix = printf(PREFIX_FORMAT, "gpu-node-3", 4242, 4250, device)
    body = printf(fmt, name, op_count, sendbuff, recvbuff, count, datatype, red_op, root, comm, nranks, stream, *extra)
    return prefix + body + "\n"


def test_allreduce_line_fields() -> None:
    call = parse_line(coll_line("AllReduce", 1024, FLOAT32, 4, op_count=0x1F, red_op=0, device=3), 7)
    assert call is not None
    assert (call.name, call.op, call.op_count, call.count, call.dtype, call.nranks) == ("AllReduce", "all_reduce", 31, 1024, "float32", 4)
    assert (call.numel, call.num_bytes, call.cuda_device, call.line, call.comm) == (1024, 4096, 3, 7, "0x55d0c0ffee00")


def test_per_rank_counts_become_full_buffers() -> None:
    # ncclAllGather logs sendcount and ncclReduceScatter recvcount (src/collectives.cc): one
    # rank's part. comm.py records the full buffer: N times that.
    gather = parse_line(coll_line("AllGather", 1000, BFLOAT16, 8))
    scatter = parse_line(coll_line("ReduceScatter", 1000, FLOAT32, 8))
    broadcast = parse_line(coll_line("Broadcast", 1000, FLOAT32, 8, root=2))
    assert (gather.numel, gather.num_bytes) == (8000, 16000)
    assert (scatter.numel, scatter.num_bytes) == (8000, 32000)
    assert (broadcast.numel, broadcast.num_bytes, broadcast.root) == (1000, 4000, 2)


def test_send_with_null_sendbuff_and_format_variants() -> None:
    # ncclSend passes NULL as sendbuff (src/collectives.cc): glibc prints "(nil)".
    send = parse_line(coll_line("Send", 16, INT64, 2, sendbuff=None, root=1))
    assert (send.op, send.root, send.num_bytes) == ("send", 1, 128)
    old = parse_line(coll_line("AllReduce", 5, FLOAT32, 2, fmt=COLL_FORMAT_2_17))
    rccl = parse_line(coll_line("AllReduce", 5, FLOAT32, 2, fmt=COLL_FORMAT_RCCL, extra=(3, 1)))
    assert old == rccl == parse_line(coll_line("AllReduce", 5, FLOAT32, 2))


def test_timestamp_prefix_and_unknown_datatype() -> None:
    # NCCL_DEBUG_TIMESTAMP_LEVELS=INFO puts "[%F %T] " in front (src/debug.cc).
    line = "[2025-03-01 12:00:00] " + coll_line("AllReduce", 3, FLOAT32, 2)
    assert parse_line(line).num_bytes == 12
    odd = parse_line(coll_line("AllReduce", 3, 42, 2))
    assert odd.dtype == "unknown(42)" and odd.num_bytes is None


def test_irrelevant_and_malformed_lines() -> None:
    lines = [
        "gpu-node-3:4242:4250 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.3<0>\n",
        "gpu-node-3:4242:4250 [0] NCCL INFO comm 0x55d0c0ffee00 rank 0 nranks 2 cudaDev 0 busId 1000 - Init COMPLETE\n",
        printf(PREFIX_FORMAT, "gpu-node-3", 4242, 4250, 0) + printf(TUNING_FORMAT, "AllReduce", 4096, "RING", "LL", 0, 1) + "\n",
        "NCCL version 2.21.5+cuda12.4\n",
        "\n",
        coll_line("AllReduce", 10, FLOAT32, 2),
        coll_line("AllGather", 10, FLOAT32, 2)[:70] + "\n",  # cut off, as by a crash mid-write
        "gpu-node-3:4242:4250 [0] NCCL INFO AllReduce: opCount zz sendbuff 0x1 recvbuff 0x1 count 1\n",
        coll_line("ReduceScatter", 10, FLOAT32, 2),
    ]
    calls, malformed = parse_lines(lines)
    assert [c.name for c in calls] == ["AllReduce", "ReduceScatter"]
    assert [c.line for c in calls] == [6, 9]
    assert len(malformed) == 2 and malformed[0].startswith("line 7:") and malformed[1].startswith("line 8:")
    with pytest.raises(ValueError, match="line 7"):
        parse_line(lines[6], 7)


def test_two_communicators_are_told_apart(tmp_path: Path) -> None:
    """DDP's world communicator and a 2-rank subgroup's: both counted, both listed."""
    log = tmp_path / "nccl.log"
    log.write_text(coll_line("AllReduce", 100, FLOAT32, 4, comm=DDP_COMM) + coll_line("AllReduce", 50, FLOAT32, 2, comm=SUB_COMM))
    span = read_span(log.read_bytes(), 0, log.stat().st_size)
    assert [(c.comm, c.nranks) for c in span.collectives] == [("0x55d0c0ffee00", 4), ("0x55d0c0ffef80", 2)]
    dispatch = [_dispatch("all_reduce", 400, 4), _dispatch("all_reduce", 200, 2)]
    assert check_span("step 0", dispatch, span).agrees


def _dispatch(op: str, num_bytes: int, group: int, dtype: str = "float32") -> CollectiveRecord:
    size = {"float32": 4, "bfloat16": 2}[dtype]
    return CollectiveRecord(op=op, raw_op=f"c10d.{op}", dtype=dtype, numel=num_bytes // size, num_bytes=num_bytes,
                            group_size=group, phase="forward_backward")


def test_check_reports_each_disagreement() -> None:
    span = read_span((coll_line("AllGather", 10, FLOAT32, 2) + coll_line("AllGather", 10, FLOAT32, 2)
                      + coll_line("AllReduce", 1, FLOAT32, 2)).encode(), 0, 10**9)
    dispatch = [_dispatch("all_gather", 80, 2), _dispatch("reduce_scatter", 80, 2)]
    check = check_span("step 1", dispatch, span)
    assert not check.agrees
    assert check.nccl["all_gather"].calls == 2 and check.dispatch["all_gather"].calls == 1
    text = "\n".join(check.disagreements)
    assert "step 1: all_gather: 1 call(s), 80 B by the dispatch mode; 2 call(s), 160 B in the NCCL log" in text
    assert "step 1: all_reduce: 0 call(s), 0 B by the dispatch mode; 1 call(s), 4 B" in text
    assert "step 1: reduce_scatter: 1 call(s), 80 B by the dispatch mode; 0 call(s), 0 B" in text
    assert "step 1: 160 B in all by the dispatch mode, 164 B in the NCCL log" in text


def test_debug_file_naming() -> None:
    # src/debug.cc: %h host name (cut at '.'), %p pid, %% a percent sign, anything else kept.
    assert expand_debug_file("/logs/nccl.%h.%p.log", "gpu-node-3", 4242) == "/logs/nccl.gpu-node-3.4242.log"
    assert expand_debug_file("/l/100%%-%q-%", "h", 1) == "/l/100%-%q-%"
    assert nccl_hostname("gpu-node-3.cluster.example.org") == "gpu-node-3"
    assert nccl_hostname("odd/name%x.example") == "odd-name-x"


def test_enable_coll_log_per_rank_files(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    stale = (tmp_path / "run%1").resolve() / "nccl-rank00003.log"
    stale.parent.mkdir()
    stale.write_text(coll_line("AllReduce", 1, FLOAT32, 2))  # a previous run's
    path = enable_coll_log(env, tmp_path / "run%1", 3, hostname="gpu-node-3", pid=99)
    assert not stale.exists()
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "COLL"
    assert path == (tmp_path / "run%1").resolve() / "nccl-rank00003.log"
    assert expand_debug_file(env["NCCL_DEBUG_FILE"], "x", 1) == str(path)  # the % in the directory is escaped
    # A user's own settings: TRACE stays, COLL is added, a pattern is honoured per process.
    env = {"NCCL_DEBUG": "TRACE", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": "/logs/n.%h.%p"}
    assert enable_coll_log(env, tmp_path, 0, hostname="a.b", pid=7) == Path("/logs/n.a.7")
    assert (env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]) == ("TRACE", "INIT,NET,COLL")
    env = {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "^COLL,NET"}
    enable_coll_log(env, tmp_path, 0, hostname="a", pid=1)
    assert (env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]) == ("INFO", "^NET")


RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "records"


def _nccl_lines_for(calls: list[CollectiveRecord]) -> str:
    """What NCCL would print for these dispatch-mode calls: per-rank counts for AllGather and
    ReduceScatter, the datatype's enum value. (Format-derived, see the module docstring.)"""
    names = {"all_reduce": "AllReduce", "all_gather": "AllGather", "reduce_scatter": "ReduceScatter", "broadcast": "Broadcast"}
    enums = {"float32": FLOAT32, "bfloat16": BFLOAT16, "int64": INT64, "int32": 2}
    text = ""
    for index, call in enumerate(calls):
        name = names[call.op]
        count = call.numel // call.group_size if name in ("AllGather", "ReduceScatter") else call.numel
        text += coll_line(name, count, enums[call.dtype], call.group_size, op_count=index)
    return text


@pytest.mark.parametrize("run", ["tiny-llama-zero3-zeroplan-bf16-mixed-n2", "tiny-llama-ddp-torch-fp32-n2",
                                 "tiny-llama-fsdp-full-shard-torch-fp32-n2"])
def test_merge_into_a_real_record(tmp_path: Path, run: str) -> None:
    """A committed CPU record and a log of the lines NCCL would print for its calls, with
    irrelevant lines between phases: everything agrees; then one call is dropped from step 1
    and only step 1 disagrees, naming the op."""
    record = read_record(RECORDS / run / "rank00000.json")
    noise = "gpu-node-3:4242:4250 [0] NCCL INFO Channel 00/02 : 0 1\n"
    parts = [_nccl_lines_for(record.setup_collectives)] + [_nccl_lines_for(s.collectives) for s in record.steps]

    def write(parts: list[str]) -> tuple[tuple[int, int], list[tuple[int, int]]]:
        spans, offset, text = [], len(noise), noise
        for part in parts:
            spans.append((offset, offset + len(part)))
            text += part + noise
            offset = len(text)
        (tmp_path / "nccl.log").write_text(text)
        return spans[0], spans[1:]

    setup, steps = write(parts)
    merged = attach_nccl_log(record, tmp_path / "nccl.log", setup, steps)
    assert merged.nccl_log.agrees, [d for c in merged.nccl_log.checks for d in c.disagreements]
    assert [c.phase for c in merged.nccl_log.checks] == ["setup"] + [f"step {s.step}" for s in record.steps]
    assert sum(len(s.collectives) for s in merged.nccl_log.steps) == sum(len(s.collectives) for s in record.steps)
    assert merged.model_dump(exclude={"nccl_log"}) == record.model_dump(exclude={"nccl_log"})

    dropped = parts[2].splitlines(keepends=True)
    victim = parse_line(dropped[0])
    parts[2] = "".join(dropped[1:])
    setup, steps = write(parts)
    merged = attach_nccl_log(record, tmp_path / "nccl.log", setup, steps)
    assert not merged.nccl_log.agrees
    assert [c.phase for c in merged.nccl_log.checks if not c.agrees] == ["step 1"]
    assert any(d.startswith(f"step 1: {victim.op}:") for d in merged.nccl_log.checks[2].disagreements)


def test_a_log_that_shrank_is_a_disagreement() -> None:
    span = read_span(coll_line("AllReduce", 1, FLOAT32, 2).encode(), 500, 100)
    check = check_span("step 0", [], span)
    assert not check.agrees and "the log shrank from 500 to 100 bytes" in check.disagreements[0]


def test_missing_log_is_a_disagreement(tmp_path: Path) -> None:
    record = read_record(RECORDS / "tiny-llama-zero1-zeroplan-fp32-n2" / "rank00000.json")
    merged = attach_nccl_log(record, tmp_path / "absent.log", (0, 0), [(0, 0)] * len(record.steps))
    assert not merged.nccl_log.agrees
    assert "missing or empty" in merged.nccl_log.checks[0].disagreements[0]


def test_validate_prints_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zeroplan.cli.main import main
    from zeroplan.harness.record import write_record

    record = read_record(RECORDS / "tiny-llama-zero1-zeroplan-fp32-n2" / "rank00000.json")
    text = "".join(_nccl_lines_for(s.collectives) for s in record.steps[:1])
    (tmp_path / "nccl.log").write_text(text)
    spans = [(0, len(text))] + [(len(text), len(text))] * (len(record.steps) - 1)
    write_record(tmp_path, attach_nccl_log(record, tmp_path / "nccl.log", (0, 0), spans))
    # validate wants every rank of the run; rank 1 as it was recorded.
    write_record(tmp_path, read_record(RECORDS / "tiny-llama-zero1-zeroplan-fp32-n2" / "rank00001.json"))
    assert main(["validate", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NCCL log check, " in out and "DISAGREES" in out
    assert "  step 1: reduce_scatter: " in out and "step 0:" not in out
