"""Run torchtitan's own tensor, sequence, context and FSDP parallelism on a fake process group
and write the records the planner's parallelism is checked against.

    python benchmarks/parallel_records.py [OUT_DIR [quick]]
        (default benchmarks/parallel-records; `quick` runs only the 8B records)

Each record is rank 0 of a fake group: torchtitan 0.3.0's Llama-3 config from its registry,
two and three blocks deep at full width, parallelized by torchtitan's own calls
(zeroplan.frameworks.tensor_parallel). Needs torch and torchtitan; about four minutes on 2 cores.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.tensor_parallel import measure_activations, measure_states

DEFAULT_OUT = Path(__file__).resolve().parent / "parallel-records"

# (flavor, tp, dp_shard, spmd_backend): the default backend's TP alone (its FSDP step refuses, see
# the records' notes), and the partial_dtensor backend's whole parallelize_llama, FSDP2 on top.
STATES = [(flavor, tp, 1, "spmd_types") for flavor in ("8B", "70B") for tp in (1, 2, 4, 8)] + [
    (flavor, tp, dp, "partial_dtensor") for flavor in ("8B", "70B") for tp in (1, 2, 4, 8) for dp in (1, 2)]
# (flavor, tp, sequence parallel, seq_len, checkpointing, cp, norm formula): tp 1 has no
# sequence parallelism to switch, so it runs once. "cpu" is what F.rms_norm saves on the CPU,
# "cuda" what the fused CUDA kernel saves (zeroplan.simulate.fused_rms_norm).
TP_GRID = [(1, False)] + [(tp, sp) for tp in (2, 4, 8) for sp in (True, False)]
ACTIVATIONS = (
    [("8B", tp, sp, seq, policy, 1, norm) for seq in (2048, 4096) for policy in ("none", "full")
     for norm in ("cpu", "cuda") for tp, sp in TP_GRID if norm == "cpu" or policy == "none"]
    + [("8B", tp, sp, 4096, "selective-op", 1, "cpu") for tp, sp in TP_GRID]
    + [("8B", 1, False, 4096, "none", 2, "cpu"), ("8B", 2, True, 4096, "none", 2, "cpu"),
       ("8B", 1, False, 4096, "none", 2, "cuda"), ("8B", 2, True, 4096, "none", 2, "cuda")]
    + [("70B", tp, sp, 4096, "none", 1, norm) for tp, sp in TP_GRID for norm in ("cpu", "cuda")]
)
# The partial_dtensor backend (DTensor TP; CP by apply_cp_to_forward), for comparison, and the
# whole parallelize_llama with FSDP2 over dp_shard 2 on top of TP: (flavor, tp, SP, seq, cp, dp_shard).
DTENSOR_ACTIVATIONS = [("8B", 2, True, 2048, 1, 1), ("8B", 2, False, 2048, 1, 1), ("8B", 1, False, 4096, 2, 1),
                       ("8B", 2, True, 4096, 2, 1), ("8B", 1, False, 2048, 1, 2), ("8B", 2, False, 2048, 1, 2)] + [
    ("8B", tp, True, 2048, 1, 2) for tp in (2, 4, 8)]


def main(out: Path = DEFAULT_OUT, quick: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for flavor, tp, dp, backend in STATES:
        if quick and flavor != "8B":
            continue
        _write(out, measure_states(flavor, tp, dp, spmd_backend=backend))
    for flavor, tp, sp, seq, policy, cp, norm in ACTIVATIONS:
        if quick and flavor != "8B":
            continue
        _write(out, measure_activations(flavor, tp, sp, seq, policy=policy, cp=cp, norm_formula=norm))
    for flavor, tp, sp, seq, cp, dp in DTENSOR_ACTIVATIONS:
        _write(out, measure_activations(flavor, tp, sp, seq, cp=cp, spmd_backend="partial_dtensor", dp_shard=dp))


def _write(out: Path, record) -> None:
    write_text_atomic(out / record.file_name, record.model_dump_json(indent=1) + "\n")
    a = record.activations
    figure = f"block {a.block_kept_bytes:>13,} B kept" if a else f"params {record.local_param_bytes:>15,} B"
    print(f"{record.name:64s} {figure}  ({record.wall_time_s:.1f} s)", flush=True)


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__)
    start = time.perf_counter()
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT, "quick" in sys.argv[2:])
    print(f"{time.perf_counter() - start:.0f} s")
