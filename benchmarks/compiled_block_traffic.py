"""Device-memory traffic of one decoder block's memory-bound kernels, eager and compiled
(zeroplan.frameworks.compiled_traffic), for the frameworks whose blocks the step time prices
compiled, each beside the roofline's single-pass count of the same block
(zeroplan.core.roofline.operations.block_memory_passes). zeroplan.core.compiled_time takes
its multiples from the record this writes (benchmarks/compiled-traffic-records/traffic.json).

    python benchmarks/compiled_block_traffic.py [--write]

Fake tensors, bf16, one sequence of 512 tokens (the kernels are elementwise per token: bytes
per token do not depend on the sequence), the RoPE cache sized to it; a few seconds per block
on a CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECORD = REPO / "benchmarks" / "compiled-traffic-records" / "traffic.json"
MODELS = ("llama-3.2-3b", "llama-2-7b", "llama-3-8b", "llama-2-70b")
"""The widths of the compiled published rows (torchtune's Llama 3.2 3B, fms-fsdp's Llama 2 7B and 70B) and Llama 3 8B: four (h, kv, F) that fix the per-width bytes (zeroplan.core.compiled_time)."""


@functools.cache
def model_spec(name: str):  # type: ignore[no-untyped-def]
    """A preset, or the published rows' own architecture (Llama 3.2 3B is no preset)."""
    from zeroplan.presets.models import get_model
    from zeroplan.validate.step_time import load_published_throughput

    for row in load_published_throughput().rows:
        if row.model == name and row.architecture is not None:
            return row.architecture
    return get_model(name)


def single_pass_bytes_per_token(framework, model) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    from zeroplan.core.profiles import profile
    from zeroplan.core.roofline.operations import OpPass, block_memory_passes

    fused_qkv = profile(framework).fuses_qkv
    return tuple(sum(op.moved_bytes for op in block_memory_passes(model, False, 1, 2, op_pass, 1, fused_qkv))
                 for op_pass in (OpPass.forward, OpPass.backward))  # type: ignore[return-value]


KINDS = ("eager_forward", "eager_backward", "compiled_forward", "compiled_backward")


def solve_widths(rows: list[dict], framework: str) -> dict[str, tuple[float, float, float, float]]:
    """Per kind (eager/compiled x forward/backward): (w_h, w_kv, w_F, w_0), bytes per element of
    each width, solved exactly from the framework's four measured models
    (bytes per token = w_h h + w_kv kv + w_F F + w_0; zeroplan.core.compiled_time)."""
    import numpy as np

    measured = [row for row in rows if row["framework"] == framework]
    widths = []
    for row in measured:
        model = model_spec(row["model"])
        widths.append([model.hidden_size, model.kv_size, model.ffn_hidden_size, 1.0])
    solved = {}
    for kind in KINDS:
        compiled, phase = kind.split("_")
        column = [row[f"{phase}_{compiled}_bytes_per_token"] for row in measured]
        solved[kind] = tuple(float(x) for x in np.linalg.solve(np.array(widths), np.array(column)))
    return solved


def load_record() -> list[dict]:
    return json.loads(RECORD.read_text())["rows"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"write {RECORD.relative_to(REPO)}")
    args = parser.parse_args(argv)

    from zeroplan.frameworks.compiled_traffic import (
        TRAFFIC_FRAMEWORKS,
        measure_block_traffic,
    )
    from zeroplan.specs import BatchSpec

    batch = BatchSpec(micro_batch_size=1, seq_len=512, grad_accum_steps=1)
    rows = []
    print("One block's memory-bound kernels, bytes per token (KB), and as multiples of the roofline's "
          "single-pass count\n")
    print("| framework | model | pass | roofline single pass | eager | kernels | compiled | kernels "
          "| eager / single | compiled / single | saved / single |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for framework in TRAFFIC_FRAMEWORKS:
        for name in MODELS:
            # Inductor charges a buffer it indexes indirectly in full (its worst case,
            # get_read_write_buffer_accesses), and torchtune gathers its RoPE cache by position:
            # the cache is sized to the measured sequence, as the positions a step reads are.
            model = model_spec(name).model_copy(update={"max_positions": batch.seq_len})
            traffic = measure_block_traffic(framework, model, batch)
            single = single_pass_bytes_per_token(framework, model)
            row = {"framework": framework.value, "model": name, "tokens": traffic.tokens,
                   "torch_version": traffic.torch_version}
            for i, phase in enumerate(("forward", "backward")):
                eager = getattr(traffic, f"eager_{phase}_bytes_per_token")
                compiled = getattr(traffic, f"compiled_{phase}_bytes_per_token")
                row |= {f"{phase}_single_pass_bytes_per_token": single[i], f"{phase}_eager_bytes_per_token": eager,
                        f"{phase}_compiled_bytes_per_token": compiled,
                        f"{phase}_eager_kernels": getattr(traffic, f"eager_{phase}_kernels"),
                        f"{phase}_compiled_kernels": getattr(traffic, f"compiled_{phase}_kernels")}
                print(f"| {framework.value} | {name} | {phase} | {single[i] / 1e3:,.1f} | {eager / 1e3:,.1f} "
                      f"| {row[f'{phase}_eager_kernels']} | {compiled / 1e3:,.1f} | {row[f'{phase}_compiled_kernels']} "
                      f"| {eager / single[i]:.3f} | {compiled / single[i]:.3f} | {(eager - compiled) / single[i]:.3f} |",
                      flush=True)
            rows.append(row)
    print("\nBytes per element of each width, solved from the four models (zeroplan.core.compiled_time):\n")
    for framework in TRAFFIC_FRAMEWORKS:
        solved = solve_widths(rows, framework.value)
        print(f"{framework.value}: " + "; ".join(f"{kind} h {w[0]:.3f}, kv {w[1]:.3f}, F {w[2]:.3f}, constant {w[3]:.1f}"
                                                for kind, w in solved.items()))
    if args.write:
        from zeroplan.atomic import write_text_atomic

        RECORD.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(RECORD, json.dumps({
            "description": ("Bytes per token of one decoder block's memory-bound kernels (matrix products and attention "
                            "excluded), eager (aten operators under a dispatch mode) and compiled (inductor's scheduler "
                            "kernels, its own byte count), on fake bf16 tensors at full width; written by "
                            "benchmarks/compiled_block_traffic.py --write (zeroplan.frameworks.compiled_traffic)."),
            "rows": rows}, indent=1) + "\n")
        print(f"\nwrote {RECORD.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
