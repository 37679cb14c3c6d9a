"""Run torchtitan's own expert parallelism (its DeepSeek-V3 model and parallelize_deepseekv3, EP
with FSDP2 on top) on a fake process group and write the records the planner's expert
parallelism is checked against.

    python benchmarks/expert_records.py [OUT_DIR]
        (default benchmarks/parallel-records/expert)

Each record is rank 0 of a fake group: torchtitan 0.3.0's DeepSeek "16B" flavour (DeepSeek-V2-Lite's
shapes) and its Qwen3 "30B-A3B" from its registries at full width, DeepSeek's dense first block
and one (states) or one and two (activations) MoE blocks (Qwen3: one, and one and two), without and with torchtitan's FullAC, parallelized by torchtitan's own calls
(zeroplan.frameworks.expert_parallel). Needs torch and torchtitan; about a minute and a half on 2 cores.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.expert_parallel import measure_activations, measure_states

DEFAULT_OUT = Path(__file__).resolve().parent / "parallel-records" / "expert"

# (ep, dp_shard): ep borrows its ranks from dp_shard (torchtitan 0.3.0 parallel_dims.py), so
# efsdp = dp_shard / ep: 1, 2 and 4 here.
LAYOUTS = [(2, 2), (4, 4), (4, 8), (8, 8), (8, 16), (2, 8)]
SEQ_LENS = (2048, 4096)
POLICIES = ("none", "full")


# torchtitan's Qwen3 "30B-A3B" (Qwen3-30B-A3B's shapes: 48 MoE blocks, 128 experts, top 8, no
# shared or dense blocks), one and two blocks: (ep, dp_shard, seq_len, policy).
QWEN3_ACTIVATIONS = [(8, 8, 2048, "none"), (8, 8, 4096, "none"), (4, 8, 4096, "none"), (8, 16, 4096, "none"),
                     (8, 8, 4096, "full")]


def main(out: Path = DEFAULT_OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for ep, dp in LAYOUTS:
        _write(out, measure_states("16B", ep, dp))
    for policy in POLICIES:
        for ep, dp in LAYOUTS:
            for seq in SEQ_LENS:
                _write(out, measure_activations("16B", ep, dp, seq, policy=policy))
    for ep, dp in LAYOUTS:
        _write(out, measure_states("30B-A3B", ep, dp, layers=1, family="qwen3"))
    for ep, dp, seq, policy in QWEN3_ACTIVATIONS:
        _write(out, measure_activations("30B-A3B", ep, dp, seq, layers=1, policy=policy, family="qwen3"))


def _write(out: Path, record) -> None:
    write_text_atomic(out / record.file_name, record.model_dump_json(indent=1) + "\n")
    a = record.activations
    figure = f"MoE block {a.block_kept_bytes:>13,} B kept" if a else f"params {record.full_depth_param_bytes():>15,} B"
    print(f"{record.name:64s} {figure}  ({record.wall_time_s:.1f} s)", flush=True)


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__)
    start = time.perf_counter()
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
    print(f"{time.perf_counter() - start:.0f} s")
