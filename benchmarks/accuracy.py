"""How far to trust zeroplan: prediction error per category on a grid of fake-scale runs
(real FSDP2/DDP code, fake tensors, `zeroplan simulate`) and of real CPU harness runs (gloo),
printed beside DeepSpeed's estimator formulas and, when it is installed, llm-analysis's
per-GPU estimates on the same cases.

    python benchmarks/accuracy.py [--quick] [--harness-records DIR]

Targets (issue "Validation and comparison"): model-state error under 1% against fake-scale
FSDP2 at 7B and 70B (N = 8, 64); peak-memory error under 5% against CPU harness runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from framework_accuracy import print_framework_table, print_step_table  # noqa: E402
from peers import LLM_ANALYSIS_INSTALL, deepspeed_zero3_gpu_bytes, llm_analysis_available, llm_analysis_memory  # noqa: E402

from zeroplan.core.params import largest_unit_parameters, total_parameters  # noqa: E402
from zeroplan.presets.models import get_model  # noqa: E402
from zeroplan.units import GiB, MiB  # noqa: E402
from zeroplan.validate.rows import ComparisonRow  # noqa: E402

FAKE_SCALE_GRID = [
    ("llama-2-7b", "fsdp-full-shard", 8),
    ("llama-2-7b", "fsdp-full-shard", 64),
    ("llama-2-70b", "fsdp-full-shard", 8),
    ("llama-2-70b", "fsdp-full-shard", 64),
    ("llama-2-70b", "fsdp-shard-grad-op", 64),
    ("llama-2-7b", "ddp", 8),
]


def error_percent(row: ComparisonRow) -> float:
    return 100.0 * (row.predicted_bytes - row.measured_bytes) / row.measured_bytes if row.measured_bytes else float("nan")


def print_rows(rows: list[ComparisonRow]) -> None:
    print(f"{'run':46s} {'quantity':24s} {'predicted GiB':>14s} {'measured GiB':>13s} {'error %':>9s}")
    for row in rows:
        print(f"{row.run_id:46s} {row.quantity:24s} {row.predicted_bytes / GiB:14.4f} "
              f"{row.measured_bytes / GiB:13.4f} {error_percent(row):9.4f}")


def fake_scale(grid) -> list[ComparisonRow]:
    from zeroplan.simulate import simulate
    from zeroplan.validate.simulation import compare_simulation

    rows = []
    for model_name, strategy, world_size in grid:
        start = time.perf_counter()
        record = simulate(get_model(model_name), strategy, world_size, mem_tracker=False)
        rows += compare_simulation(record)
        print(f"  simulated {model_name} {strategy} N={world_size} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return rows


def harness_peaks(records_dir: Path) -> None:
    """Peak memory predicted against the CPU allocator's peak of real gloo runs (every rank)."""
    from zeroplan.validate.compare import compare_record
    from zeroplan.validate.load import load_records

    rows = [
        row for record in load_records([str(records_dir)]) for row in compare_record(record)
        if row.quantity == "peak (CPU allocator)"
    ]
    print(f"\nCPU harness runs ({records_dir}): peak predicted against the CPU allocator's peak, last step, every rank")
    print(f"{'run':46s} {'rank':>4s} {'predicted MiB':>14s} {'measured MiB':>13s} {'error %':>9s}")
    for row in rows:
        print(f"{row.run_id:46s} {row.rank:4d} {row.predicted_bytes / MiB:14.3f} {row.measured_bytes / MiB:13.3f} "
              f"{error_percent(row):9.3f}")
    if rows:
        worst = max(abs(error_percent(r)) for r in rows)
        print(f"largest peak error: {worst:.3f} % over {len(rows)} rank records (target < 5 %)")
    else:
        print("no record with an allocator peak (records of schema 2 made on CPU have one)")


def deepspeed_side_by_side(grid) -> None:
    print("\nDeepSpeed's ZeRO-3 estimator (stage3.py, 18 bytes/param + 4 x largest layer) vs zeroplan")
    print(f"{'model':12s} {'N':>4s} {'DeepSpeed GiB':>14s} {'zeroplan zero3 (deepspeed convention) GiB':>42s}")
    from zeroplan.core.model_states import model_state_bytes
    from zeroplan.specs import BatchSpec, StateConvention, StrategyKind, TrainingSpec
    from zeroplan.validate.rows import planner_request

    seen = set()
    for model_name, _, world_size in grid:
        if (model_name, world_size) in seen:
            continue
        seen.add((model_name, world_size))
        model = get_model(model_name)
        theirs = deepspeed_zero3_gpu_bytes(total_parameters(model), largest_unit_parameters(model), world_size, False, False)

        request = planner_request(model, TrainingSpec(state_convention=StateConvention.deepspeed), BatchSpec(), StrategyKind.zero3, world_size)
        ours = model_state_bytes(request).gpu_bytes
        print(f"{model_name:12s} {world_size:4d} {theirs / GiB:14.2f} {ours / GiB:42.2f}")
    print("(DeepSpeed adds 4 bytes x the largest layer for the gathered working set; zeroplan counts "
          "gathered units as buffers, not model states.)")


PEER_QUANTITIES = ("parameters", "gradients", "optimizer states", "activations")


def _predicted_activations(model, training, batch) -> int:
    from zeroplan.core.activations import activation_bytes, saved_logits_bytes

    s, b = batch.seq_len, batch.micro_batch_size
    return activation_bytes(model, training, s, b) + saved_logits_bytes(model, s, b)


def llm_analysis_side_by_side(grid, fake_rows: list[ComparisonRow], records_dir: Path | None) -> None:
    """llm-analysis's weights / gradients / optimizer states / activations per GPU beside
    zeroplan's prediction and the measurement, for the fake-scale grid (model states measured;
    activations are not measured there) and the committed CPU harness records (all four)."""
    if not llm_analysis_available():
        print(f"\nllm-analysis: not installed, skipped (optional peer: {LLM_ANALYSIS_INSTALL})")
        return
    from zeroplan.specs import ActivationCheckpointing, AttentionKernel, BatchSpec, TrainingSpec

    cases = []  # (label, unit, model, strategy, N, training, batch, {quantity: (zeroplan, measured)})
    for model_name, strategy, world_size in grid:
        label = f"simulate:{model_name}:{strategy}:N{world_size}"
        rows = {r.quantity: r for r in fake_rows if r.run_id == label}
        training, batch, model = TrainingSpec(), BatchSpec(), get_model(model_name)
        pairs = {q: (rows[q].predicted_bytes, rows[q].measured_bytes) for q in PEER_QUANTITIES[:3]}
        pairs["activations"] = (_predicted_activations(model, training, batch), None)
        cases.append((label, GiB, model, strategy, world_size, training, batch, pairs))
    if records_dir is not None:
        from zeroplan.validate.compare import compare_record
        from zeroplan.validate.load import load_records

        for record in (r for r in load_records([str(records_dir)]) if r.rank == 0):
            d = record.description
            rows = {r.quantity: r for r in compare_record(record)}
            pairs = {q: (rows[q].predicted_bytes, rows[q].measured_bytes) for q in PEER_QUANTITIES[:3]}
            saved = rows["activations (saved)"]
            pairs["activations"] = (saved.predicted_bytes, saved.measured_bytes)
            cases.append((d.run_id, MiB, d.model, d.strategy.value, d.world_size, d.training, d.batch, pairs))

    print("\nllm-analysis 0.2.2 (LLMAnalysis.training, per GPU) beside zeroplan and the measurement")
    print("(fake-scale: measured = real FSDP2/DDP on fake tensors, rank 0, model states only; "
          "CPU records: measured = gloo runs, rank 0, activations = autograd's saved tensors)")
    print(f"{'case':46s} {'quantity':17s} {'unit':>4s} {'llm-analysis':>13s} {'zeroplan':>10s} {'measured':>10s} "
          f"{'llm-a/meas':>10s} {'zp/meas':>8s}")
    for label, unit, model, strategy, world_size, training, batch, pairs in cases:
        theirs = llm_analysis_memory(
            model, strategy, world_size, training.precision.value, batch.micro_batch_size, batch.seq_len,
            full_checkpointing=training.activation_checkpointing is ActivationCheckpointing.full,
            flash_attention=training.attention_kernel is AttentionKernel.flash,
        )
        for quantity in PEER_QUANTITIES:
            ours, measured = pairs[quantity]
            name = "GiB" if unit == GiB else "MiB"
            ratio = "-" if not measured else f"{theirs[quantity] / measured:.3f}"
            ours_ratio = "-" if not measured else f"{ours / measured:.3f}"
            measured_text = "-" if measured is None else f"{measured / unit:.3f}"
            print(f"{label:46s} {quantity:17s} {name:>4s} {theirs[quantity] / unit:13.3f} {ours / unit:10.3f} "
                  f"{measured_text:>10s} {ratio:>10s} {ours_ratio:>8s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 7B cases")
    parser.add_argument("--harness-records", type=Path, default=Path(__file__).resolve().parent / "records",
                        help="CPU harness records for the peak and llm-analysis tables (default: the committed ones,"
                             " made by benchmarks/cpu_records.py)")
    args = parser.parse_args()
    grid = [case for case in FAKE_SCALE_GRID if not args.quick or case[0] == "llama-2-7b"]
    print("Fake-scale: real PyTorch FSDP2/DDP on fake tensors (rank 0), planner prediction for the same request")
    rows = fake_scale(grid)
    print_rows(rows)
    model_state_rows = [r for r in rows if r.category == "memory"]
    worst = max(abs(error_percent(r)) for r in model_state_rows)
    print(f"\nlargest model-state error: {worst:.4f} % (target < 1 %)")
    if args.harness_records.exists():
        harness_peaks(args.harness_records)
    deepspeed_side_by_side(grid)
    llm_analysis_side_by_side(grid, rows, args.harness_records if args.harness_records.exists() else None)
    print_framework_table()
    print_step_table()


if __name__ == "__main__":
    main()
