"""Measure what a compiled torchtitan block saves under tensor (with and without sequence) and
context parallelism, and what torchtune's activation offloading moves with compiled layers, and
write the records the planner's compiled model is checked against.

    python benchmarks/compiled_parallel_records.py [--offload] [OUT_DIR]
        (default benchmarks/compiled-parallel-records; the offloading records in OUT_DIR/offload;
        --offload: those only, about a minute)

Rank 0 of a fake process group, fake tensors, no GPU: about ten minutes on 2 CPU cores
(zeroplan.frameworks.compiled_parallel; docs/compile-float8.md, "Under model parallelism").
"""

from __future__ import annotations

import sys
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.compiled_parallel import measure_compiled_offload, measure_parallel_compiled_block
from zeroplan.specs.finetune import FineTuneSpec

DEFAULT_OUT = Path(__file__).resolve().parent / "compiled-parallel-records"

# (flavor, tp, sequence parallel, seq_len, checkpointing, cp, float8 recipe)
RUNS = (
    [("8B", 2, sp, 4096, policy, 1, None) for sp in (True, False) for policy in ("none", "full", "selective-op")]
    + [("8B", 4, True, 4096, "none", 1, None)]
    + [("8B", 1, False, 4096, policy, 2, None) for policy in ("none", "full", "selective-op")]
    + [("8B", 1, False, 8192, "none", 4, None)]
    + [("8B", 2, True, 4096, "none", 2, None)]
    + [("8B", 1, False, 4096, policy, 2, "tensorwise") for policy in ("none", "full")]
    + [("8B", 2, True, 4096, policy, 1, "tensorwise") for policy in ("none", "full")]
    + [("8B", 2, False, 4096, "none", 1, "tensorwise"), ("8B", 2, True, 4096, "none", 1, "rowwise")]
    + [("70B", 8, True, 4096, policy, 1, "tensorwise") for policy in ("none", "full")]
    + [("70B", 8, True, 4096, policy, 1, None) for policy in ("none", "full")]
)
LLAMA_32_3B = str(Path(__file__).resolve().parent / "published_memory" / "configs" / "llama-3.2-3b.json")
# torchtune's Llama 3.2 3B LoRA and QLoRA as its README's optimisation table ran them
# (recipes/configs/llama3_2/3B_lora_single_device.yaml and 3B_qlora_single_device.yaml: rank 64,
# alpha 128, q, v, o and the MLP; batch 2, packed to 4096; compile, checkpointing, offloading).
TORCHTUNE_3B_LORA = {"lora_rank": 64, "lora_alpha": 128, "lora_targets": ("q", "v", "o", "gate", "up", "down")}
OFFLOAD = [("llama-3.1-8b", 4096, 1, FineTuneSpec()),
           (LLAMA_32_3B, 4096, 2, FineTuneSpec(**TORCHTUNE_3B_LORA)),
           (LLAMA_32_3B, 4096, 2, FineTuneSpec(**TORCHTUNE_3B_LORA, quantize="nf4"))]


def main(out: Path = DEFAULT_OUT, offload_only: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for flavor, tp, sp, seq, policy, cp, recipe in [] if offload_only else RUNS:
        record = measure_parallel_compiled_block(flavor, tp, sp, seq, policy, cp, float8_recipe=recipe)
        write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
        print(f"{record.name:70s} compiled {record.compiled_saved_bytes:>14,}  eager {record.eager_live_bytes:>14,}"
              f"  ({record.wall_time_s:.1f} s)", flush=True)
    (out / "offload").mkdir(exist_ok=True)
    for model_name, seq, micro_batch, finetune in OFFLOAD:
        record = measure_compiled_offload(model_name, seq, micro_batch, finetune=finetune)
        write_text_atomic(out / "offload" / record.file_name, record.model_dump_json(indent=2) + "\n")
        print(f"{record.file_name:70s} host eager {record.eager_host_bytes} compiled {record.compiled_host_bytes} "
              f"layer {record.compiled_layer_saved_bytes:,} (first {record.compiled_first_layer_saved_bytes:,}, "
              f"{record.dynamo_graphs} graphs)  ({record.wall_time_s:.1f} s)", flush=True)


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__, ("--offload",))
    args = [a for a in sys.argv[1:] if a != "--offload"]
    main(Path(args[0]) if args else DEFAULT_OUT, offload_only="--offload" in sys.argv[1:])
