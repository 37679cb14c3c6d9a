"""Record a grid of real CPU runs (torchrun, gloo, 2 ranks) into benchmarks/records/, then print
predicted against measured for each and save the plot. The committed records are what
docs/validation.md and notebooks/compare_stages.ipynb reconcile against.

    python benchmarks/cpu_records.py [--out benchmarks/records] [--plot docs/validation.png]

With --deepspeed it records DeepSpeed's ZeRO stages instead (needs deepspeed installed), into
benchmarks/deepspeed-records/ by default; docs/harness.md discusses those figures:

    python benchmarks/cpu_records.py --deepspeed
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from zeroplan.harness.launch import launch
from zeroplan.validate.compare import compare_record
from zeroplan.validate.load import load_records
from zeroplan.validate.report import render_validation_table, save_validation_plot

GRID = [
    # (model, strategy, engine, precision)
    ("tiny-llama", "zero1", "zeroplan", "fp32"),
    ("tiny-llama", "zero2", "zeroplan", "fp32"),
    ("tiny-llama", "zero3", "zeroplan", "fp32"),
    ("tiny-llama", "zero3", "zeroplan", "bf16-mixed"),
    ("tiny-llama", "ddp", "torch", "fp32"),
    ("tiny-llama", "zero1", "torch", "fp32"),
    ("tiny-llama", "fsdp-full-shard", "torch", "fp32"),
    ("tiny-llama", "fsdp-shard-grad-op", "torch", "fp32"),
    ("tiny-gpt2", "zero2", "zeroplan", "fp32"),
    ("tiny-gpt2", "fsdp-full-shard", "torch", "fp32"),
]
# Gradient accumulation into unsharded gradients (FSDP2 without gradient sync; FSDP1's no_sync,
# which Lightning Fabric and litgpt run, the same way; the reference ZeRO-2/3 reducing once per
# step): 4 micro-batches per step. FSDP1's root unit stays gathered after the forward
# (StrategySpec.fsdp1_root_stays_gathered, which validate sets for the torch-fsdp1 engine).
ACCUMULATING = ["--grad-accum", "4", "--keep-unsharded-grads-on-accum"]
ACCUMULATING_GRID = [
    ("tiny-llama", "fsdp-full-shard", "torch", "fp32"),
    ("tiny-llama", "fsdp-full-shard", "torch", "bf16-mixed"),
    ("tiny-llama", "fsdp-full-shard", "torch-fsdp1", "fp32"),
    ("tiny-llama", "zero2", "zeroplan", "fp32"),
    ("tiny-llama", "zero3", "zeroplan", "fp32"),
]
DEEPSPEED_GRID = [
    ("tiny-llama", strategy, "deepspeed", precision)
    for precision in ("fp32", "bf16-mixed") for strategy in ("zero1", "zero2", "zero3")
] + [("tiny-llama", strategy, "deepspeed", "fp32") for strategy in ("zero2-offload", "zero3-offload")]
NPROC, STEPS, MICRO_BATCH, SEQ_LEN = 2, 3, 2, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="default benchmarks/records (benchmarks/deepspeed-records with --deepspeed)")
    parser.add_argument("--plot", type=Path, help="default docs/validation.png (none with --deepspeed)")
    parser.add_argument("--deepspeed", action="store_true", help="record DeepSpeed's ZeRO stages instead")
    args = parser.parse_args()
    if args.out is None:
        args.out = Path("benchmarks/deepspeed-records" if args.deepspeed else "benchmarks/records")
    if args.plot is None and not args.deepspeed:
        args.plot = Path("docs/validation.png")
    grid = [(run, []) for run in DEEPSPEED_GRID] if args.deepspeed else (
        [(run, []) for run in GRID] + [(run, ACCUMULATING) for run in ACCUMULATING_GRID])
    for (model, strategy, engine, precision), extra in grid:
        run_id = f"{model}-{strategy}-{engine}-{precision}-n{NPROC}" + ("-accum4-keep" if extra else "")
        start = time.perf_counter()
        result = launch(NPROC, [model, "--strategy", strategy, "--engine", engine, "--precision", precision,
                                "--steps", str(STEPS), "--micro-batch", str(MICRO_BATCH), "--seq-len", str(SEQ_LEN),
                                "--run-id", run_id, *extra], args.out / run_id, timeout_s=600)
        status = "ok" if result.returncode == 0 else f"FAILED {result.errors}"
        print(f"{run_id:48s} {time.perf_counter() - start:6.1f} s  {status}")
    records = [r for r in load_records([str(args.out)]) if r.rank == 0]
    rows = [row for record in records for row in compare_record(record)]
    print(render_validation_table(rows))
    if args.plot is not None:
        save_validation_plot(rows, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
