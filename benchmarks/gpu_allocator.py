"""The CUDA caching allocator's own verdict on a ~1B model's training steps, on ONE GPU.

Rank 0 of an N-way shard runs alone on a fake process group (backend "fake": collectives return
at once, tensors have the sizes rank 0 holds; gpu_measure.py says more). Three phases, each in
fresh processes so allocator state starts clean:

1. profile: per case, step time (CUDA events around forward+backward, optimizer step and
   zero_grad) and one profiled step's operators (torch.profiler key averages by input shape).
2. history: per case and allocator configuration, torch.cuda.memory._record_memory_history over
   the whole run (model build included), trimmed to (action, address, size, stream, time) and
   written with torch.cuda.memory_stats(); the planner's allocator model replays these
   (zeroplan/allocator/snapshot.py). Also gpu_measure.py's harness records (kernels: cuda).
3. capacity: the smallest cap (torch.cuda.set_per_process_memory_fraction, 2 MiB resolution) at
   which the same run completes: a k-section search between the measured allocated and reserved
   peaks, probes run side by side within a memory budget, each its own process.

    python benchmarks/gpu_allocator.py --out "$OUT"     # on a GPU machine; 4.5 minutes on an H200 (run 1 of the records)

Results: <out>/profile.tar.gz, <out>/history.tar.gz, <out>/capacity.json (rewritten after each
round, so a run stopped early keeps what it found). The runs are lean (no memory tracker, no
records) so that every probe repeats the history run's allocations exactly.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from zeroplan.allocator.measured import TRACE_FORMAT  # noqa: E402
from zeroplan.atomic import write_atomic, write_text_atomic  # noqa: E402

MAIN_CASES = ("ddp:torch", "zero3:zeroplan", "fsdp-full-shard:torch")
RECORD_CASES = "ddp:torch,zero1:zeroplan,zero2:zeroplan,zero3:zeroplan,fsdp-full-shard:torch,fsdp-shard-grad-op:torch"
CONFS = {"default": "", "expandable": "expandable_segments:True"}
STEP = 2 * 2**20
"""The capacity search's resolution: segments and pages are multiples of 2 MiB."""
OOM_EXIT = 3
STARTED = time.perf_counter()


def write_gzip_json(path: Path, document: object) -> None:
    """``document`` as compact JSON in a gzip file (the trace format's container), its folder made.
    Shared with gpu_step_profile.py."""
    def dump(tmp: Path) -> None:
        with gzip.open(tmp, "wt") as handle:
            json.dump(document, handle, separators=(",", ":"))

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, dump)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-allocator")))
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--model", default="llama-1b-like", help="llama-1b-like or a harness preset (smoke runs)")
    parser.add_argument("--steps", type=int, default=2, help="history and probe runs: step 0 creates the optimizer states")
    parser.add_argument("--phases", default="history,records,profile,capacity")
    parser.add_argument("--budget-gib", type=float, default=112.0, help="GPU memory the side-by-side probes may cap in all")
    parser.add_argument("--jobs", type=int, default=12, help="processes side by side")
    parser.add_argument("--points", type=int, default=8, help="probes per search per round")
    parser.add_argument("--only", default=None, help="comma-separated strategy:engine cases to keep (default: all)")
    parser.add_argument("--deadline-s", type=float, default=450, help="no capacity round starts after this")
    parser.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: one run
    return parser


# --- one run (a child process) ---------------------------------------------------------------

def _model_spec():  # type: ignore[no-untyped-def]
    from gpu_measure import llama_1b

    return llama_1b()


def _preset(name: str):  # type: ignore[no-untyped-def]
    from zeroplan.harness.presets import HARNESS_PRESETS

    return HARNESS_PRESETS[name]


def _setup(args: argparse.Namespace, case: str, checkpointing: bool = False):  # type: ignore[no-untyped-def]
    """The fake group, the model and the engine on cuda:0, as the harness builds them; with
    ``checkpointing``, full activation checkpointing switched on in the model before the engine
    wraps it (as the harness runner does)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zeroplan.harness.engines import EngineKind, build_engine
    from zeroplan.harness.model import build_model
    from zeroplan.specs import StrategyKind

    strategy, engine_kind = case.split(":")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:  # a smoke run of the script's own logic (tests/test_gpu_allocator_script.py)
        device = torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    spec = _model_spec() if args.model == "llama-1b-like" else _preset(args.model)
    with torch.device(device):
        model = build_model(spec, 0)
        model.set_activation_checkpointing(checkpointing)
        engine = build_engine(model, StrategyKind(strategy), EngineKind(engine_kind), torch.bfloat16,
                              micro_batch_size=args.micro_batch)
    return spec, device, engine


def _batch(args: argparse.Namespace, spec, device, step: int):  # type: ignore[no-untyped-def]
    from zeroplan.harness.data import rank_batch

    tokens, targets = rank_batch(spec, step, args.world_size, 0, args.micro_batch, args.seq_len, 0)
    return tokens.to(device), targets.to(device)


def _train(args: argparse.Namespace, case: str):  # type: ignore[no-untyped-def]
    """``args.steps`` steps; the model and the wall-clock time (us since the epoch) each step starts."""
    import torch

    spec, device, engine = _setup(args, case)
    starts = []
    with torch.device(device):
        for step in range(args.steps):
            starts.append(time.time() * 1e6)
            tokens, targets = _batch(args, spec, device, step)
            engine.forward_backward(tokens, targets)
            engine.step()
            engine.zero_grad()
            _synchronize(device)
    return spec, starts


def _synchronize(device) -> None:  # type: ignore[no-untyped-def]
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _history(args: argparse.Namespace, case: str, conf: str, out: Path) -> None:
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10_000_000)
    spec, starts = _train(args, case)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [[e["action"], e["addr"], e["size"], e["stream"], e["time_us"]] for e in snapshot["device_traces"][0]]
    document = {
        "format": TRACE_FORMAT, "case": case, "alloc_conf": CONFS[conf], "world_size": args.world_size,
        "micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps, "precision": "bf16-mixed",
        "model": spec.model_dump(mode="json"), "torch_version": torch.__version__,
        "device_name": torch.cuda.get_device_name(0), "device_total_bytes": torch.cuda.get_device_properties(0).total_memory,
        "step_starts_us": starts, "memory_stats": dict(torch.cuda.memory_stats()),
        "columns": ["action", "addr", "size", "stream", "time_us"], "events": events,
    }
    write_gzip_json(out, document)
    stats = document["memory_stats"]
    print(f"{case} {conf}: {len(events)} events, allocated peak {stats['allocated_bytes.all.peak'] / 2**20:.1f} MiB, "
          f"reserved peak {stats['reserved_bytes.all.peak'] / 2**20:.1f} MiB, retries {stats['num_alloc_retries']}")


def _probe(args: argparse.Namespace, case: str, cap_bytes: int) -> int:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    # Half a MiB above the cap: the limit falls between the cap and the next 2 MiB multiple,
    # where every segment size behaves as the cap itself, whatever the fraction's rounding.
    torch.cuda.set_per_process_memory_fraction((cap_bytes + 2**19) / total, 0)
    try:
        _train(args, case)
    except Exception as error:  # an OOM raised inside an autograd or FSDP hook may arrive wrapped
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
            return OOM_EXIT
        raise
    return 0


def profile_steps(args: argparse.Namespace, spec, device, engine) -> dict:  # type: ignore[no-untyped-def]
    """Five steps timed with CUDA events per phase after three warm-ups, then one step under
    torch.profiler: the phase times, the operators by input shape and every device kernel.
    Shared with gpu_step_profile.py."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    phases = ("forward_backward", "optimizer_step", "zero_grad")
    timed: dict[str, list[float]] = {name: [] for name in phases}
    with torch.device(device):
        def one_step(step: int, events: list | None) -> None:
            tokens, targets = _batch(args, spec, device, step)
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if events is not None and cuda else None
            if marks:
                marks[0].record()
            engine.forward_backward(tokens, targets)
            if marks:
                marks[1].record()
            engine.step()
            if marks:
                marks[2].record()
            engine.zero_grad()
            if marks:
                marks[3].record()
                events.append(marks)

        for step in range(3):
            one_step(step, None)
        _synchronize(device)
        events: list = []
        wall = []
        for step in range(3, 8):
            start = time.perf_counter()
            one_step(step, events)
            _synchronize(device)
            wall.append(time.perf_counter() - start)
        for marks in events:
            for name, (a, b) in zip(phases, zip(marks, marks[1:])):
                timed[name].append(a.elapsed_time(b) / 1e3)
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities, record_shapes=True, with_flops=True) as prof:
            one_step(8, None)
            _synchronize(device)
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        device_us = getattr(e, "device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "cuda_time_total", 0)
        rows.append({"name": e.key, "input_shapes": str(e.input_shapes), "count": e.count,
                     "device_time_total_us": device_us, "self_device_time_total_us": getattr(e, "self_device_time_total", None),
                     "cpu_time_total_us": e.cpu_time_total, "flops": e.flops})
    kernels = [
        {"name": ev.name, "start_us": ev.time_range.start, "duration_us": ev.time_range.elapsed_us()}
        for ev in prof.events() if str(getattr(ev, "device_type", "")).endswith("CUDA")
    ]
    return {"torch_version": torch.__version__, "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
            "step_wall_s": wall, "phase_device_s": timed, "operators": rows, "device_events": kernels}


def phase_summary(document: dict) -> str:
    """'step X ms (min of 5) forward_backward Y ms, ...' for a profile_steps document."""
    wall, timed = document["step_wall_s"], document["phase_device_s"]
    phase_text = ", ".join(f"{name} {min(values) * 1e3:.1f} ms" for name, values in timed.items() if values)
    return f"step {min(wall) * 1e3:.1f} ms (min of {len(wall)}) {phase_text}"


def _profile(args: argparse.Namespace, case: str, out: Path) -> None:
    spec, device, engine = _setup(args, case)
    steps = profile_steps(args, spec, device, engine)
    document = {"case": case, "world_size": args.world_size, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                "precision": "bf16-mixed", "model": spec.model_dump(mode="json"), **steps}
    write_gzip_json(out, document)
    print(f"{case}: {phase_summary(steps)}")


def _run_single(args: argparse.Namespace) -> int:
    kind, _, rest = args.single.partition("/")
    if kind == "history":
        case, conf, out = rest.split("|")
        _history(args, case, conf, Path(out))
    elif kind == "probe":
        case, cap = rest.split("|")
        return _probe(args, case, int(cap))
    elif kind == "profile":
        case, out = rest.split("|")
        _profile(args, case, Path(out))
    return 0


# --- the search (pure: tested on the CPU) ------------------------------------------------------

def probe_points(low: int, high: int, points: int) -> list[int]:
    """Up to ``points`` capacities (in 2 MiB steps) strictly between ``low`` (fails) and
    ``high`` (completes), evenly spread."""
    inside = sorted({low + (high - low) * i // (points + 1) for i in range(1, points + 1)} - {low, high})
    return [p for p in inside if low < p < high]


def narrow(low: int, high: int, outcomes: dict[int, bool]) -> tuple[int, int, list[int]]:
    """The new bracket: the smallest completing capacity, the largest failing one below it,
    and any capacity that failed above a completing one (the allocator is not monotone there)."""
    completing = [p for p, ok in outcomes.items() if ok] + [high]
    new_high = min(completing)
    failing = [p for p, ok in outcomes.items() if not ok and p < new_high] + [low]
    inverted = sorted(p for p, ok in outcomes.items() if not ok and p > new_high)
    return max(failing), new_high, inverted


# --- orchestration -----------------------------------------------------------------------------

def child_env(**extra: str) -> dict[str, str]:
    """A child process's environment: the repository importable, warnings off."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                PYTHONWARNINGS="ignore", **extra)


def run_child(command: list[str], timeout_s: float, ok: tuple[int, ...] = (0,), **env: str) -> tuple[int, str]:
    """Run one child process: its exit status and, for a status in ``ok``, its stdout (whose last
    line is its summary), else stdout and stderr (which say why); -1 past ``timeout_s``. Shared
    with gpu_step_profile.py."""
    try:
        done = subprocess.run(command, env=child_env(**env), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    text = done.stdout.strip() if done.returncode in ok else (done.stdout + "\n" + done.stderr).strip()
    return done.returncode, text or "no output"


def _child(args: argparse.Namespace, single: str, env_extra: dict[str, str], timeout_s: float = 240) -> tuple[int, str]:
    command = [sys.executable, __file__, "--world-size", str(args.world_size), "--micro-batch", str(args.micro_batch),
               "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--model", args.model, "--single", single]
    return run_child(command, timeout_s, (0, OOM_EXIT), **env_extra)


def _tar(source: Path, target: Path) -> None:
    if not source.exists():
        print(f"nothing to pack: {source.name} (every run of the phase failed)", flush=True)
        return
    def pack(tmp: Path) -> None:
        with tarfile.open(tmp, "w:gz") as archive:
            archive.add(source, arcname=source.name)

    write_atomic(target, pack)


def _write_json(path: Path, document: object) -> None:
    write_text_atomic(path, json.dumps(document, indent=1))


def _kept(args: argparse.Namespace, cases) -> list[str]:  # type: ignore[no-untyped-def]
    return [case for case in cases if args.only is None or case in args.only.split(",")]


def _phase_profile(args: argparse.Namespace, work: Path) -> None:
    for case in _kept(args, MAIN_CASES):
        code, text = _child(args, f"profile/{case}|{work / 'profile' / (case.replace(':', '-') + '.json.gz')}", {})
        print(text.splitlines()[-1] if code == 0 else f"profile {case}: FAILED ({code}): {text[-2000:]}", flush=True)
    _tar(work / "profile", args.out / "profile.tar.gz")


def _history_jobs(args: argparse.Namespace) -> list[tuple[str, str]]:
    jobs = [(case, "default") for case in _kept(args, RECORD_CASES.split(","))]
    return jobs + [(case, "expandable") for case in _kept(args, MAIN_CASES)]


def _phase_history(args: argparse.Namespace, work: Path) -> None:
    def run(job: tuple[str, str]) -> str:
        case, conf = job
        out = work / "history" / f"{case.replace(':', '-')}-{conf}.json.gz"
        extra = {"PYTORCH_CUDA_ALLOC_CONF": CONFS[conf]} if CONFS[conf] else {}
        code, text = _child(args, f"history/{case}|{conf}|{out}", extra)
        return text.splitlines()[-1] if code == 0 else f"history {case} {conf}: FAILED ({code}): {text[-2000:]}"

    with ThreadPoolExecutor(4) as pool:
        for line in pool.map(run, _history_jobs(args)):
            print(line, flush=True)
    _tar(work / "history", args.out / "history.tar.gz")


def _phase_records(args: argparse.Namespace, work: Path) -> None:
    """gpu_measure.py's harness records (run_rank: the memory tracker and cuda peaks), one
    process per case, four side by side."""
    env = child_env()

    def run(case: str) -> str:
        command = [sys.executable, str(REPO / "benchmarks" / "gpu_measure.py"), "--world-size", str(args.world_size),
                   "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--cases", case,
                   "--out", str(work / "records")]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return f"records {case}: timed out"
        return (done.stdout.strip() or done.stderr.strip()[-2000:]).replace("\n", " | ")

    with ThreadPoolExecutor(4) as pool:
        for line in pool.map(run, _kept(args, RECORD_CASES.split(","))):
            print(line, flush=True)
    _tar(work / "records", args.out / "records.tar.gz")


def _peaks(work: Path, case: str, conf: str) -> tuple[int, int] | None:
    path = work / "history" / f"{case.replace(':', '-')}-{conf}.json.gz"
    if not path.exists():
        return None
    with gzip.open(path, "rt") as handle:
        stats = json.load(handle)["memory_stats"]
    return stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]


def _phase_capacity(args: argparse.Namespace, work: Path) -> None:
    searches: dict[tuple[str, str], dict] = {}
    for case in _kept(args, MAIN_CASES):
        for conf in CONFS:
            peaks = _peaks(work, case, conf)
            if peaks is None:
                continue
            allocated, reserved = peaks
            searches[(case, conf)] = {"case": case, "conf": CONFS[conf], "allocated_peak_bytes": allocated,
                                      "reserved_peak_bytes": reserved, "low": allocated // STEP - 1,
                                      "high": -(-reserved // STEP), "probes": {}, "inverted": [], "errors": []}
    budget = int(args.budget_gib * 2**30)
    document = {"resolution_bytes": STEP, "world_size": args.world_size, "seq_len": args.seq_len,
                "micro_batch": args.micro_batch, "steps": args.steps, "searches": list(searches.values())}
    round_index = 0
    while True:
        wanted = []
        for key, search in searches.items():
            points = probe_points(search["low"], search["high"], args.points)
            if round_index == 0:
                points.append(search["high"])  # the unlimited run's reserved peak must complete
            wanted += [(key, p) for p in points if str(p) not in search["probes"]]
        if not wanted:
            break
        # Largest first, packed under the budget: each probe may take its cap plus a context.
        wanted.sort(key=lambda item: -item[1])
        results: dict[tuple[tuple[str, str], int], int] = {}

        def run(item: tuple[tuple[str, str], int]) -> tuple[tuple[tuple[str, str], int], int, str]:
            (case, conf), cap = item
            extra = {"PYTORCH_CUDA_ALLOC_CONF": CONFS[conf]} if CONFS[conf] else {}
            code, text = _child(args, f"probe/{case}|{cap * STEP}", extra)
            return item, code, text

        pending = list(wanted)
        running: dict = {}
        with ThreadPoolExecutor(args.jobs) as pool:
            in_use = 0
            while pending or running:
                for item in list(pending):
                    need = item[1] * STEP + 2**30
                    if len(running) < args.jobs and (in_use + need <= budget or not running):
                        pending.remove(item)
                        running[pool.submit(run, item)] = need
                        in_use += need
                done = [f for f in running if f.done()]
                if not done:
                    time.sleep(0.2)
                for future in done:
                    in_use -= running.pop(future)
                    item, code, text = future.result()
                    results[item] = code
                    if code not in (0, OOM_EXIT):
                        searches[item[0]]["errors"].append(f"cap {item[1] * STEP}: {code}: {text[-500:]}")
        for key, search in searches.items():
            outcomes = {p: results[(k, p)] == 0 for (k, p) in results if k == key and results[(k, p)] in (0, OOM_EXIT)}
            search["probes"].update({str(p): ok for p, ok in outcomes.items()})
            if round_index == 0 and outcomes.get(search["high"]) is False:
                search["errors"].append("the unlimited run's reserved peak did not complete as a cap")
                search["high"] += max(1, search["high"] // 10)
                continue
            search["low"], search["high"], inverted = narrow(search["low"], search["high"], outcomes)
            search["inverted"] = sorted(set(search["inverted"]) | set(inverted))
            search["oom_capacity_bytes"] = search["high"] * STEP
        round_index += 1
        document["rounds"] = round_index
        _write_json(args.out / "capacity.json", document)
        print(f"capacity round {round_index}: " + "; ".join(
            f"{s['case']} {s['conf'] or 'default'} in ({s['low'] * STEP / 2**20:.0f}, {s['high'] * STEP / 2**20:.0f}] MiB"
            for s in searches.values()), flush=True)
        if round_index >= 6 or time.perf_counter() - STARTED > args.deadline_s:
            break


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.single:
        return _run_single(args)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-allocator-"))
    phases = {"profile": _phase_profile, "history": _phase_history, "records": _phase_records, "capacity": _phase_capacity}
    for name in args.phases.split(","):
        start = time.perf_counter()
        try:
            phases[name](args, work)
        except Exception as error:  # a phase that breaks must not lose the others' results
            print(f"phase {name} failed: {type(error).__name__}: {error}", flush=True)
        print(f"phase {name}: {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
