"""A fixed GPU idle per optimizer step, per micro-batch or per block, fitted per stack and
measured on the project's H200, against the published rows (issue 30: llm-foundry's small models
solve lower HFUs than the large ones in the same table; docs/validation.md, "Fixed costs per
step, micro-batch and block").

The planner's step is compute (matrix products at the HFU, attention at its rate, memory-bound
kernels at the copy bandwidth), the optimizer step at the copy bandwidth and exposed
communication: nothing in it lasts a fixed time whatever the model's width and tokens. A training
loop's host work does, where the GPU waits on it: the host's launches between a block's eager
kernels, a per-tensor optimizer loop, the syncs of a loop that logs the loss every batch. On
llm-foundry's tables the small models' steps are the short ones (MPT-1B on 8 H100s: 0.63 s;
MPT-7B with recomputation: 13-40 s), so such a constant weighs most on them.

Three shapes, each adding c seconds to every row of a mechanism (nothing in zeroplan changes):

- per step: step + c (the loop's syncs and per-tensor optimizer step);
- per micro-batch: step + c x micro-batches;
- per block: step + c x micro-batches x blocks (a pipeline stage's share): the GPU idle between a
  block's eager kernels.

c is fitted per mechanism (--by: the stack, the default, as a host-side cost is the loop's;
GPU generation x stack; or eager rows against fused and compiled ones) leave-one-source-out: for
each source, the c on the grid that makes the HFUs calibrate step solves on the other sources of
its mechanism most alike (the mean |log| deviation of each row's HFU from its source's median,
eager_memory_fit.dispersion), its rows never in it; 0 where no other source has the mechanism.
Each source is then scored (calibrated on one row, and the fitted default held out) at the c
fitted without it. With --per block the GPU idle per block the H200's FSDP steps measured
(measured_block_idle_s, each record; no constant from the rows) is scored beside it on every
eager row (eager_memory_fit.row_mechanism).

    python benchmarks/step_overhead_fit.py                       # per step, ~3 min on 2 cores
    python benchmarks/step_overhead_fit.py --only llm-foundry    # that stack's rows alone
    python benchmarks/step_overhead_fit.py --per micro-batch
    python benchmarks/step_overhead_fit.py --per block
    python benchmarks/step_overhead_fit.py --measured            # the measured constants alone

One process per planner variant (the study's caches keep the planner they first ran).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RECORDS = Path(__file__).resolve().parent / "gpu-step-profile-records" / "steps"
IDLE_RECORDS = ("fsdp-full-shard-torch-1-8192-none", "fsdp-full-shard-torch-2-4096-none")
"""The H200 profile's FSDP steps without recomputation (the harness's eager Llama, one block a unit)."""
OPTIMIZER_RECORD = "ddp-torch-2-4096-none"
"""The H200 profile's DDP step: torch's single-tensor AdamW (foreach=False) over plain tensors."""


def _record(case: str) -> dict:  # type: ignore[type-arg]
    import gzip

    with gzip.open(RECORDS / f"{case}.json.gz", "rt") as handle:
        return json.load(handle)


def _kernels_before_optimizer(record: dict) -> list[tuple[float, float]]:  # type: ignore[type-arg]
    """(start, end) us of the profiled step's device kernels before its optimizer step
    (torch.profiler's annotations, zeroplan.validate.step_profile.ANNOTATION_PREFIXES, and the
    host-to-device copies left out)."""
    from zeroplan.validate.step_profile import ANNOTATION_PREFIXES

    events = record["device_events"]
    starts = [e["start_us"] for e in events if e["name"].startswith("Optimizer.")]
    optimizer_start = min(starts) if starts else float("inf")
    return sorted((e["start_us"], e["start_us"] + e["duration_us"]) for e in events
                  if e["start_us"] < optimizer_start and not e["name"].startswith((*ANNOTATION_PREFIXES, "Memcpy HtoD")))


def _busy_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds at least one kernel runs (the union of the intervals)."""
    busy, current = 0.0, None
    for start, end in intervals:
        if current is None or start > current[1]:
            if current is not None:
                busy += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    if current is not None:
        busy += current[1] - current[0]
    return busy / 1e6


# The GPU idles between a block's eager kernels while the host launches them (and FSDP's hooks
# run): the forward+backward's device span (CUDA events, the median of five steps) less the time
# the profiled step's kernels run, per block. The profiled step's kernels are timed on the device
# and do not grow under the profiler; its gaps do, so they are not read.
def measured_block_idle_s() -> tuple[float, ...]:
    """Seconds per block and micro-batch the H200's FSDP steps leave the GPU idle, per record."""
    import statistics

    idle = []
    for case in IDLE_RECORDS:
        record = _record(case)
        span_s = statistics.median(record["phase_device_s"]["forward_backward"])
        idle.append((span_s - _busy_s(_kernels_before_optimizer(record))) / record["model"]["num_layers"])
    return tuple(idle)


def measured_optimizer_s_per_tensor() -> float:
    """Host seconds of torch's single-tensor AdamW per parameter tensor on the H200's host: the DDP
    step's optimizer phase (CUDA events, the median of five) over the model's parameter tensors."""
    import statistics

    from gpu_measure import llama_1b
    from zeroplan.core.params import parameter_units

    record = _record(OPTIMIZER_RECORD)
    tensors = sum(len(unit.tensors) for unit in parameter_units(llama_1b()))
    return statistics.median(record["phase_device_s"]["optimizer_step"]) / tensors


KERNELS = Path(__file__).resolve().parent / "gpu-step-profile-records" / "kernels.json"


# A GEMM's time past its FLOPs at the square 8192^3 product's rate: its prologue, epilogue and
# last partial wave, a fixed cost per call where the main loop's share grows with the product.
def gemm_call_overhead_s() -> list[tuple[str, str, float, float]]:
    """(projection, pass, GFLOP, seconds past the 8192^3 rate) of each product the H200 timed
    at 8,192 tokens (kernels.json: the 2,048-wide model's q/k/v/o, MLP and head products)."""
    kernels = json.loads(KERNELS.read_text())
    rate = kernels["square_gemm"]["tflops"] * 1e12
    return [(g["projection"], g["pass"], 2 * g["m"] * g["k"] * g["n"] / 1e9,
             g["seconds"] - 2 * g["m"] * g["k"] * g["n"] / rate) for g in kernels["gemm"]]


def llm_foundry_shapes() -> list[str]:
    """Per llm-foundry table, the published step and the step per block and micro-batch of its
    narrow (h <= 2,048) and wide (h >= 4,096) models: what a fixed cost per step or per block
    weighs against."""
    import statistics

    from zeroplan.validate.step_calibration import published_step_s, source_label, source_rows, stack_of
    from zeroplan.validate.step_time import load_published_throughput

    lines = []
    for rows in source_rows(load_published_throughput()).values():
        if stack_of(rows[0]) != "llm-foundry":
            continue
        cells = []
        for name, members in (("h <= 2048", [r for r in rows if r.model_spec.hidden_size <= 2048]),
                              ("h >= 4096", [r for r in rows if r.model_spec.hidden_size >= 4096])):
            if not members:
                continue
            steps = [published_step_s(r) for r in members]
            per_block = [published_step_s(r) / (r.grad_accum_steps * r.model_spec.num_layers / r.pp) * 1e3 for r in members]
            cells.append(f"{name}: step {min(steps):.2f}-{max(steps):.1f} s (median {statistics.median(steps):.2f}), "
                         f"per block and micro-batch {min(per_block):.0f}-{max(per_block):.0f} ms "
                         f"(median {statistics.median(per_block):.0f})")
        lines.append(f"{source_label(rows[0])[:60]}: " + "; ".join(cells))
    return lines


def measured_report() -> list[str]:
    """The measured constants and the tables' shapes the docs quote."""
    idle = measured_block_idle_s()
    overheads = gemm_call_overhead_s()
    lines = ["GPU idle per block and micro-batch, the H200's FSDP steps without recomputation: "
             + ", ".join(f"{case} {s * 1e3:.2f} ms" for case, s in zip(IDLE_RECORDS, idle)),
             f"torch's single-tensor AdamW on the H200's host ({OPTIMIZER_RECORD}): "
             f"{measured_optimizer_s_per_tensor() * 1e3:.3f} ms per parameter tensor",
             "GEMM time past the 8192^3 rate at 8,192 tokens (the H200, kernels.json): "
             + ", ".join(f"{p} {kind} {gflop:.0f} GFLOP {s * 1e6:.0f} us" for p, kind, gflop, s in overheads), ""]
    return lines + llm_foundry_shapes() + ["", optimizer_loop_line()]


def optimizer_loop_line() -> str:
    """The tensors Composer's loop steps on the busiest rank of llm-foundry's MPT rows
    (step_time_mechanisms.rank_stepped_tensors) and their seconds at the measured time per tensor."""
    from step_time_mechanisms import rank_stepped_tensors
    from zeroplan.calibrate.step import timed_request
    from zeroplan.validate.step_time import load_published_throughput

    counts = {}
    for row in load_published_throughput().rows:
        if row.model_spec.name.startswith("mpt-"):
            request = timed_request(row.request())
            counts[row.name] = (rank_stepped_tensors(request), request.training.checkpoint_early_stop is False)
    orig = [n for n, flat in counts.values() if not flat]
    flat = [n for n, flat in counts.values() if flat]
    per_tensor_s = measured_optimizer_s_per_tensor()
    return (f"Composer's optimizer loop on llm-foundry's MPT rows (busiest rank): use_orig_params rows {min(orig)}-{max(orig)} "
            f"tensors, {min(orig) * per_tensor_s * 1e3:.0f}-{max(orig) * per_tensor_s * 1e3:.0f} ms a step; torch 1.13.1 rows "
            f"(one flat shard a unit) {min(flat)}-{max(flat)}, {min(flat) * per_tensor_s * 1e3:.0f}-{max(flat) * per_tensor_s * 1e3:.0f} ms")


GRIDS = {"step": (0.0, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3), "micro-batch": (0.0, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3),
         "block": (0.0, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008)}
"""Seconds per step, per micro-batch or per block and micro-batch tried by the fit (0: the planner
as it is)."""
EVERY = "every source"


def mechanism_of(row, by: str) -> str:  # type: ignore[no-untyped-def]
    """The row's stack, with ``by`` 'generation-stack' its GPU generation x stack, with 'eager'
    whether its blocks run torch's eager kernels (eager_memory_fit.row_mechanism: an eager stack,
    not compiled) or not."""
    from zeroplan.core.default_efficiency import generation_of
    from zeroplan.validate.step_calibration import stack_of

    if by == "eager":
        from eager_memory_fit import row_mechanism

        return "eager" if row_mechanism(row) is not None else "fused or compiled"
    return stack_of(row) if by == "stack" else f"{generation_of(row.gpu)} x {stack_of(row)}"


def patch(variant: dict) -> None:  # type: ignore[type-arg]
    """Add {"seconds": {mechanism: c}} to every step of the mechanism's rows (mechanism_of, with
    {"by": ...}), once per step, per micro-batch or per block and micro-batch ({"per": ...})."""
    import zeroplan.core.timing as timing
    from eager_memory_fit import request_key
    from step_time_mechanisms import slower_by
    from zeroplan.validate.step_calibration import default_request
    from zeroplan.validate.step_time import load_published_throughput

    seconds_of = variant.get("seconds", {})
    per = variant.get("per", "step")
    stacks: dict[tuple, str | None] = {}  # type: ignore[type-arg]
    for row in load_published_throughput().rows:
        key, stack = request_key(default_request(row)), mechanism_of(row, variant.get("by", "stack"))
        stacks[key] = stack if stacks.get(key, stack) == stack else None
    step_time = timing.step_time

    @functools.lru_cache(maxsize=8192)
    def added_s(key: tuple, accumulation: int, blocks: float) -> float:  # type: ignore[type-arg]
        stack = stacks.get(key)
        c = seconds_of.get(stack, 0.0) if stack is not None else 0.0
        return c * {"step": 1, "micro-batch": accumulation, "block": accumulation * blocks}[per]

    def patched(request, collectives):  # type: ignore[no-untyped-def]
        time = step_time(request, collectives)
        # a pipeline stage runs its share of the blocks
        added = added_s(request_key(request), request.batch.grad_accum_steps, request.model.num_layers / request.parallel.pp)
        return slower_by(time, added, "step_without_overlap_s") if added else time

    timing.step_time = patched


def run(variant: dict) -> dict:  # type: ignore[type-arg]
    """Every row's out-of-sample errors under ``variant`` (eager_memory_fit.scored)."""
    patch(variant)
    from eager_memory_fit import scored
    return scored()


def in_process(variant: dict) -> dict:  # type: ignore[type-arg]
    done = subprocess.run([sys.executable, __file__, "--run", json.dumps(variant, sort_keys=True)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def fit(by_seconds: dict[float, dict], rows, stack_sources: dict[str, set[str]], held_out: str | None,  # type: ignore[no-untyped-def, type-arg]
        grid: tuple[float, ...]) -> dict[str, float]:
    """Each mechanism's c on ``grid`` fitted on its sources but ``held_out`` (None: all); a c at
    which calibrate step refuses more of those rows than at 0 is not taken."""
    from eager_memory_fit import fitted_on_grid

    return fitted_on_grid(by_seconds, rows, stack_sources, held_out, grid, neutral=0.0)


def _figures(errors: list[dict]) -> tuple[str, str]:  # type: ignore[type-arg]
    import statistics

    calibrated = [abs(e["calibrated"]) for e in errors if e["calibrated"] is not None]
    kernel = [abs(e["kernel"]) for e in errors]
    return (f"{statistics.median(calibrated):.1%} / {max(calibrated):.1%}" if calibrated else "-",
            f"{statistics.median(kernel):.1%} / {max(kernel):.1%}")


def held_out_errors(by_seconds: dict[float, dict], rows, mechanism_sources: dict[str, set[str]], variant: dict,  # type: ignore[no-untyped-def, type-arg]
                    grid: tuple[float, ...], labels: dict[str, str]) -> tuple[list[dict], dict[str, dict[str, float]]]:  # type: ignore[type-arg]
    """Each source's rows scored with every mechanism at the seconds fitted without it, and those seconds."""
    errors: list[dict] = []  # type: ignore[type-arg]
    runs: dict[str, dict] = {}  # type: ignore[type-arg]
    fitted_without: dict[str, dict[str, float]] = {}
    for source in labels:
        seconds = fit(by_seconds, rows, mechanism_sources, source, grid)
        fitted_without[source] = seconds
        key = json.dumps(seconds, sort_keys=True)
        if key not in runs:
            uniform = set(seconds.values())
            runs[key] = (by_seconds[uniform.pop()] if len(uniform) == 1
                         else in_process({**variant, "seconds": seconds}))
        errors += [e for e in runs[key]["errors"] if e["source"] == source]
    return errors, fitted_without


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="A fixed host overhead per step, per micro-batch or per block, fitted per stack.")
    parser.add_argument("--per", choices=tuple(GRIDS), default="step")
    parser.add_argument("--by", choices=("stack", "generation-stack", "eager"), default="stack",
                        help="what one fitted constant covers (default: the stack)")
    parser.add_argument("--only", help="fit the constant for this stack alone (the others keep the planner's step)")
    parser.add_argument("--measured", action="store_true",
                        help="only the measured constants (the H200's records) and llm-foundry's tables' step shapes")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        print(json.dumps(run(json.loads(args.run))))
        return 0
    if args.measured:
        print("\n".join(measured_report()))
        return 0
    from zeroplan.validate.step_calibration import source_label, source_of, stack_of
    from zeroplan.validate.step_time import load_published_throughput

    rows = load_published_throughput().rows
    mechanism_sources: dict[str, set[str]] = {}
    for row in rows:
        if args.only is None or stack_of(row) == args.only:
            mechanism_sources.setdefault(mechanism_of(row, args.by), set()).add(source_of(row))
    labels = {source_of(row): source_label(row) for row in rows}
    grid = GRIDS[args.per]
    variant = {"per": args.per, "by": args.by}
    by_seconds = {c: in_process({**variant, "seconds": {m: c for m in mechanism_sources}}) for c in grid}
    planner = by_seconds[0.0]
    fitted_errors, fitted_without = held_out_errors(by_seconds, rows, mechanism_sources, variant, grid, labels)
    columns = [("planner", planner["errors"]), ("fitted", fitted_errors)]
    if args.per == "block":
        # the GPU's idle per block measured on the H200 (each FSDP record), on the eager rows
        for idle_s in measured_block_idle_s():
            measured = in_process({"per": "block", "by": "eager", "seconds": {"eager": idle_s}})
            columns.append((f"measured {idle_s * 1e3:.2f} ms, eager rows", measured["errors"]))
    every = fit(by_seconds, rows, mechanism_sources, None, grid)
    print(f"Seconds per {args.per} fitted per {args.by} on every source (in sample, not a figure): "
          + ", ".join(f"{m} {c:g}" for m, c in sorted(every.items())))
    print()
    print(f"Each cell: calibrated on one row (median / max |error|), then the fitted default held out "
          f"(leave-one-source-out); 'fitted': the seconds per {args.per} of every mechanism fitted without the source"
          + ("; 'measured': the H200's idle per block (measured_block_idle_s) on every eager row" if args.per == "block" else "")
          + ":")
    print()
    print("| source | mechanism | seconds fitted without it |" + "".join(f" {name} | |" for name, _ in columns))
    print("|---|---|---:|" + "---:|---:|" * len(columns))
    mechanism_of_source = {source_of(row): mechanism_of(row, args.by) for row in rows}
    for source, label in labels.items():
        cells = [cell for _, errors in columns for cell in _figures([e for e in errors if e["source"] == source])]
        fitted = fitted_without[source].get(mechanism_of_source[source])
        print(f"| {label[:70]} | {mechanism_of_source[source]} | {'-' if fitted is None else f'{fitted:g}'} | "
              + " | ".join(cells) + " |")
    print("| every row | | | " + " | ".join(cell for _, errors in columns for cell in _figures(errors)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
