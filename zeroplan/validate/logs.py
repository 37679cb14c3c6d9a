"""The peak-memory lines training stacks print, read from a user's own log (``zeroplan validate
--from-log``). Each format is the stack's own, read from its source:

- torchtitan 0.3.0 components/metrics.py MetricsProcessor.log: ``step: N  loss: ...  memory:
  {max_reserved_gib:5.2f}GiB({pct:.2f}%)  tps: ...`` -- the peak of reserved_bytes.all.peak
  since the last log line, in GiB (DeviceMemoryMonitor._to_gib divides by 1024^3);
- torchtune 0.6.1 training/memory.py get_memory_stats, logged each step with
  log_peak_memory_stats by training/metric_logging.py (Disk/StdoutLogger: ``Step N | name:value
  ...``): peak_memory_active / peak_memory_alloc / peak_memory_reserved in GiB (/ 1024**3),
  no unit printed; and log_memory_stats' ``<device> peak memory allocation: X GiB`` lines;
- transformers 4.56.2 trainer_utils.py TrainerMemoryTracker, printed by trainer_pt_utils.py
  log_metrics (``  {key} = {value}``, metrics_format writes ``{v >> 20}MB``: MiB, labelled MB):
  before_init_mem_gpu + init_mem_gpu_alloc_delta is the allocated memory when training began,
  and train_mem_gpu_alloc_delta + train_mem_gpu_peaked_delta the peak above it;
  Before transformers 4.12 (pull request 13915) there is no before_init_mem_gpu: what was
  allocated before the Trainer was built is then not in the block, and is read as 0 with a note;
- DeepSpeed 0.19.8 runtime/utils.py see_memory_usage: ``MA x GB  Max_MA x GB  CA x GB  Max_CA n GB``,
  each divided by 1024**3 (GiB, labelled GB), and the peaks reset after each call; Max_CA is
  rounded to a whole GiB (``round(max_memory_reserved / 1024**3)``), so the reserved peak read is
  the larger of the largest Max_CA and the largest CA (CA, to 0.01 GiB, bounds it from below:
  a Max_CA of 0 beside CA 0.31 is a peak of 0.31 to 0.5 GiB, not 0).

A line that mentions GPU memory in none of these shapes is refused, named; so is a log whose
lines come from two stacks. A pickle is read as a torch.cuda.memory._snapshot() (zeroplan.validate.snapshot)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from zeroplan.errors import ZeroplanError
from zeroplan.units import GiB, MiB

_NUM = r"(-?\d+(?:\.\d+)?)"
TORCHTITAN_STEP = re.compile(rf"step:\s*\d+\s+loss:.*?\smemory:\s*{_NUM}GiB\(\s*{_NUM}%\)")
TORCHTITAN_CAPACITY = re.compile(r"(CUDA|GPU|XPU|NPU) capacity: .* with [\d.]+GiB memory")
TORCHTITAN_RETRIES = re.compile(r"\d+ \w+ (memory allocation retries|OOM errors thrown)\.")
TORCHTUNE_STEP = re.compile(r"Step \d+ \| .*peak_memory_")
TORCHTUNE_OTHER_STEP = re.compile(r"^Step \d+ \| .*\b\w*(mem|gpu)\w*:\s*\d")
"""A torchtune Step line whose memory key is not get_memory_stats' (an older torchtune's
gpu_resources, a user's own metric): which counter it holds is not in the line."""
TORCHTUNE_INIT = re.compile(rf"\b\w+ peak memory (allocation|reserved|active): {_NUM} GiB")
TORCHTUNE_INIT_HEADER = re.compile(r"Memory stats after model init:")
HF_METRIC = re.compile(r"^\s*(\w*_mem_(?:gpu|cpu)\w*)\s*=\s*(-?\d+)MB\s*$")
DEEPSPEED = re.compile(rf"\bMA {_NUM} GB\s+Max_MA {_NUM} GB\s+CA {_NUM} GB\s+Max_CA {_NUM} GB")
DEEPSPEED_CPU = re.compile(r"CPU Virtual Memory:\s+used = ")
MEMORY_WORDS = re.compile(r"(?i)\b(gpu|cuda|device)?\s*mem(ory)?\b|max_memory|GiB|\bMA\b")


@dataclass(frozen=True)
class Reading:
    """One figure read from a log: its peak over the lines that print it."""

    stack: str
    figure: str
    """allocated, reserved or active (torch.cuda.memory_stats' counters)."""
    bytes: int
    unit: str
    """The unit as the log prints it, and what it is ('GiB', 'MB (MiB: >> 20)', 'GB (GiB: / 1024**3)')."""
    lines: int
    """How many lines it was read from."""
    note: str = ""


@dataclass
class LogRead:
    readings: list[Reading] = field(default_factory=list)
    stack: str = ""


def _refuse(path: Path, number: int, line: str, why: str) -> ZeroplanError:
    shown = line.strip()
    shown = shown if len(shown) <= 160 else shown[:157] + "..."
    return ZeroplanError("--from-log", f"{str(path)!r} line {number}: {why}: {shown!r}")


def _stack_of(path: Path, stacks: dict[str, int], stack: str, number: int, line: str) -> None:
    other = next((s for s in stacks if s != stack), None)
    if other is not None:
        raise _refuse(path, number, line, f"a {stack} line in a log whose line {stacks[other]} is {other}'s; "
                                          "give one stack's log (allowed: torchtitan, torchtune, hf, deepspeed)")
    stacks.setdefault(stack, number)


def read_log(path: str | Path) -> LogRead:
    """The peak-memory figures of a training log (see the module docstring)."""
    path = Path(path)
    from zeroplan.validate.snapshot import STACK, is_pickle, read_snapshot

    if is_pickle(path):  # torch.cuda.memory._snapshot() pickled, or zeroplan measure --memory-snapshot
        return LogRead([Reading(STACK, f.figure, f.bytes, "bytes", f.events, f.note) for f in read_snapshot(path)], STACK)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise ZeroplanError("--from-log", f"cannot read {str(path)!r}: {error.strerror or error}") from None
    peaks: dict[tuple[str, str], list[float]] = {}
    stacks: dict[str, int] = {}
    hf: dict[str, int] = {}
    init_only = None
    for number, line in enumerate(text.splitlines(), 1):
        if m := TORCHTITAN_STEP.search(line):
            _stack_of(path, stacks, "torchtitan", number, line)
            peaks.setdefault(("torchtitan", "reserved"), []).append(float(m.group(1)) * GiB)
        elif TORCHTUNE_STEP.search(line):
            _stack_of(path, stacks, "torchtune", number, line)
            fields = dict(re.findall(r"(\w+):(\S+)", line.split("|", 1)[1]))
            for name, figure in (("peak_memory_alloc", "allocated"), ("peak_memory_reserved", "reserved"),
                                 ("peak_memory_active", "active")):
                if name in fields:
                    try:
                        peaks.setdefault(("torchtune", figure), []).append(float(fields[name]) * GiB)
                    except ValueError:
                        raise _refuse(path, number, line, f"{name} is not a number") from None
        elif TORCHTUNE_OTHER_STEP.search(line):
            raise _refuse(path, number, line, "a torchtune Step line whose memory figure is not one of get_memory_stats' "
                                              "(allowed: peak_memory_active, peak_memory_alloc, peak_memory_reserved, "
                                              "logged with log_peak_memory_stats=True)")
        elif m := TORCHTUNE_INIT.search(line):
            _stack_of(path, stacks, "torchtune", number, line)
            init_only = init_only or (number, line)
        elif m := HF_METRIC.match(line):
            _stack_of(path, stacks, "hf", number, line)
            hf[m.group(1)] = int(m.group(2))
        elif m := DEEPSPEED.search(line):
            _stack_of(path, stacks, "deepspeed", number, line)
            peaks.setdefault(("deepspeed", "allocated"), []).append(float(m.group(2)) * GiB)
            # Max_CA is whole GiB; CA (0.01 GiB) is a lower bound of the same peak
            peaks.setdefault(("deepspeed", "reserved"), []).append(max(float(m.group(4)), float(m.group(3))) * GiB)
        elif (TORCHTITAN_CAPACITY.search(line) or TORCHTITAN_RETRIES.search(line) or TORCHTUNE_INIT_HEADER.search(line)
              or DEEPSPEED_CPU.search(line)):
            continue  # a known line that holds no peak
        elif MEMORY_WORDS.search(line) and re.search(r"\d", line) and re.search(r"(?i)(GiB|GB|MB|MiB|bytes|%)", line):
            raise _refuse(path, number, line, "a memory line in none of the formats zeroplan reads (torchtitan's step "
                                              "line, torchtune's peak_memory_*, the HF Trainer's *_mem_gpu_* metrics, "
                                              "DeepSpeed's see_memory_usage)")
    result = LogRead(stack=next(iter(stacks), ""))
    for (stack, figure), values in peaks.items():
        unit = {"torchtitan": "GiB", "torchtune": "GiB (printed without a unit: / 1024**3)",
                "deepspeed": "GB as printed, GiB in fact (/ 1024**3)"}[stack]
        note = ("Max_CA is printed rounded to a whole GiB (within 0.5 GiB), read as the larger of it and CA"
                if (stack, figure) == ("deepspeed", "reserved") else "")
        result.readings.append(Reading(stack, figure, int(max(values)), unit, len(values), note))
    if hf:
        gpu = {k: v for k, v in hf.items() if "_mem_gpu" in k}
        needed = ("before_init_mem_gpu", "init_mem_gpu_alloc_delta", "train_mem_gpu_alloc_delta", "train_mem_gpu_peaked_delta")
        note = "before_init_mem_gpu + init_mem_gpu_alloc_delta + train_mem_gpu_alloc_delta + train_mem_gpu_peaked_delta"
        if "before_init_mem_gpu" not in gpu and any(k in gpu for k in needed[1:]):
            # transformers before 4.12 prints no before_init_mem_gpu (pull request 13915 added it)
            gpu["before_init_mem_gpu"] = 0
            note = ("no before_init_mem_gpu (transformers before 4.12): memory allocated before the Trainer was built "
                    "is not counted; init_mem_gpu_alloc_delta + train_mem_gpu_alloc_delta + train_mem_gpu_peaked_delta")
        missing = [k for k in needed if k not in gpu]
        if missing:
            raise ZeroplanError("--from-log", f"{str(path)!r}: the HF Trainer's train metrics lack {', '.join(missing)}; "
                                              "its GPU peak is before_init + init alloc + train alloc + train peaked "
                                              "(allowed: the whole '***** train metrics *****' block)")
        total = sum(gpu[k] for k in needed)
        result.readings.append(Reading("hf", "allocated", total * MiB, "MB as printed, MiB in fact (>> 20)", len(needed),
                                       note))
    if not result.readings:
        if init_only is not None:
            raise _refuse(path, init_only[0], init_only[1], "torchtune's memory after model init, not a training peak "
                          "(allowed: a log of a run with log_peak_memory_stats=True, whose Step lines carry the peaks)")
        raise ZeroplanError("--from-log", f"{str(path)!r} has no peak-memory line of torchtitan, torchtune, the HF Trainer "
                                          "or DeepSpeed")
    order = {"allocated": 0, "reserved": 1, "active": 2}
    result.readings.sort(key=lambda r: order[r.figure])
    return result
