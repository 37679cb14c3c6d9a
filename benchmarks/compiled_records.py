"""Measure what one decoder block of each framework's own model saves for backward under
torch.compile (inductor's partitioner) and eagerly, and write the records.

    python benchmarks/compiled_records.py [OUT_DIR [FRAMEWORK ...]]
    python benchmarks/compiled_records.py --loss [OUT_DIR [FRAMEWORK ...]]   (the loss records only)
    python benchmarks/compiled_records.py --finetune [OUT_DIR [FRAMEWORK ...]]   (torchtune's LoRA/QLoRA blocks and
        hf's peft LoRA blocks, FINETUNE_RUNS, default benchmarks/compiled-finetune-records; a few minutes)
        (default benchmarks/compiled-records, every framework; the all-gather records go to
        benchmarks/float8-all-gather-records, the compiled-loss records to
        benchmarks/compiled-loss-records)

Each run builds one block at full width on fake tensors (zeroplan.frameworks.compiled) and
compiles it as torchtitan's apply_compile does, through inductor's compile_fx up to code
generation; torchtitan's block is also measured with torchao's Float8Linear (tensorwise, rowwise,
rowwise_with_gw_hp),
and one block's FSDP2 all-gather with torchao's float8 all-gather and in bf16 on a fake process
group (zeroplan.frameworks.float8); and one chunk of torchtune's and torchtitan's cross-entropy,
compiled as each framework compiles its loss, and torchtitan's unchunked loss whole
(zeroplan.frameworks.compiled_loss). Needs torch and the frameworks (scripts/install-frameworks); about a minute on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.compiled import measure_compiled_block
from zeroplan.frameworks.compiled_loss import measure_compiled_loss
from zeroplan.frameworks.float8 import measure_all_gather, measure_float8_block
from zeroplan.presets.models import get_model
from zeroplan.specs import ActivationCheckpointing, BatchSpec
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.framework import Framework

DEFAULT_OUT = Path(__file__).resolve().parent / "compiled-records"
GATHER_OUT = Path(__file__).resolve().parent / "float8-all-gather-records"
LOSS_OUT = Path(__file__).resolve().parent / "compiled-loss-records"

# (framework, checkpointing, memory budget): torchtitan's four policies (its MemoryBudgetAC at
# its default 0.5), torchtune's none and full, transformers' none (its checkpointing wraps the
# layer outside the compiled region; zeroplan.core.compiled.COMPILED_POLICIES).
RUNS = [
    ("torchtitan", "none", None), ("torchtitan", "full", None), ("torchtitan", "selective-op", None),
    ("torchtitan", "none", 0.5),
    ("torchtune", "none", None), ("torchtune", "full", None),
    ("hf", "none", None),
]
SHAPES = [("llama-3.1-8b", 4096, 1), ("llama-3.1-8b", 8192, 2), ("llama-3.1-70b", 4096, 1)]
# torchao Float8Linear on torchtitan's block (zeroplan.frameworks.float8): tensorwise (what the
# float8 all-gather needs), rowwise (torchtitan 0.3.0's default recipe) and rowwise_with_gw_hp
# (its other recipe_name: the weight's gradient in bf16 from the saved high-precision operands).
FLOAT8_RUNS = [("tensorwise", "none"), ("rowwise", "none"), ("tensorwise", "full"), ("rowwise", "full"),
               ("rowwise", "selective-op"), ("rowwise_with_gw_hp", "none"), ("rowwise_with_gw_hp", "full"),
               ("rowwise_with_gw_hp", "selective-op")]
ALL_GATHER_MODELS = [("llama-3.1-8b", 8), ("llama-3.1-70b", 8)]
# torchtune's LoRA and QLoRA blocks (zeroplan.frameworks.lora, FineTuneSpec fields), compiled as
# its recipes compile each layer with compile: True: r 8 on q, v (8B_lora_single_device.yaml) and
# on its 8B_lora targets (q, v, o and the MLP), and QLoRA r 8 on every block linear
# (8B_qlora_single_device.yaml), each without and with full recomputation. Then peft 0.17.1's LoRA
# over transformers' LlamaDecoderLayer (bf16 base, fp32 adapters as get_peft_model leaves them),
# r 8 on q, v (LoraConfig's default for Llama) and on all seven linears, r 16 on the attention's
# four (an adapter on o without the MLP's), and r 16 on q, v and on all seven (the eager blocks of
# benchmarks/framework-finetune-records, hf ddp bf16-mixed), compiled under the bf16
# autocast transformers' Trainer runs with bf16=True (hf compiles without recomputation only:
# zeroplan.core.compiled.COMPILED_POLICIES). Each run: (framework, checkpointing, FineTuneSpec
# fields, autocast).
FINETUNE_RUNS = [
    ("torchtune", policy, finetune, False)
    for finetune in ({"lora_rank": 8, "lora_targets": ["q", "v"]}, {"lora_rank": 8},
                     {"lora_rank": 8, "quantize": "nf4", "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]})
    for policy in ("none", "full")
] + [
    ("hf", "none", finetune, True)
    for finetune in ({"lora_rank": 8, "lora_targets": ["q", "v"]},
                     {"lora_rank": 8, "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]},
                     {"lora_rank": 16, "lora_targets": ["q", "k", "v", "o"]},
                     {"lora_rank": 16, "lora_targets": ["q", "v"]},
                     {"lora_rank": 16, "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]})
]
FINETUNE_SHAPES = SHAPES[:1]
FINETUNE_OUT = Path(__file__).resolve().parent / "compiled-finetune-records"
# The loss each framework compiles with its model (torchtune compile: True, torchtitan's default
# CompileConfig.components), one chunk at each block shape.
LOSS_FRAMEWORKS = ("torchtune", "torchtitan")
# torchtitan's unchunked loss compiled whole (0.3.0's CrossEntropyLoss over [b, s, V]; 2c8b594's
# build_cross_entropy_loss compiles the same cross-entropy): the published MI300X float8 rows'
# shape (Llama-3-8B, 1 x 8192) and two of the block shapes.
UNCHUNKED_LOSS_SHAPES = [("llama-3-8b", 8192, 1), ("llama-3.1-8b", 4096, 1), ("llama-3.1-8b", 8192, 2)]


def main(out: Path = DEFAULT_OUT, frameworks: set[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, seq_len, micro_batch in SHAPES:
        for framework, policy, budget in RUNS:
            if frameworks and framework not in frameworks:
                continue
            record = measure_compiled_block(Framework(framework), get_model(model_name), ActivationCheckpointing(policy),
                                            BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch), memory_budget=budget)
            write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
            _report(record)
        if frameworks and "torchtitan" not in frameworks:
            continue
        for recipe, policy in FLOAT8_RUNS:
            record = measure_float8_block(get_model(model_name), ActivationCheckpointing(policy),
                                          BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch), recipe)
            write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
            _report(record)
    main_loss(LOSS_OUT, frameworks)
    if frameworks and "torchtitan" not in frameworks:
        return
    GATHER_OUT.mkdir(parents=True, exist_ok=True)
    for model_name, world_size in ALL_GATHER_MODELS:
        for float8 in (False, True):
            gather = measure_all_gather(get_model(model_name), world_size, float8)
            write_text_atomic(GATHER_OUT / gather.file_name, gather.model_dump_json(indent=2) + "\n")
            print(f"{gather.name:60s} gathered {gather.gathered_bytes:>14,} bytes  ({gather.wall_time_s:.1f} s)")


def main_finetune(out: Path = FINETUNE_OUT, frameworks: set[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, seq_len, micro_batch in FINETUNE_SHAPES:
        for framework, policy, finetune, autocast in FINETUNE_RUNS:
            if frameworks and framework not in frameworks:
                continue
            record = measure_compiled_block(Framework(framework), get_model(model_name), ActivationCheckpointing(policy),
                                            BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch),
                                            finetune=FineTuneSpec(**finetune), autocast=autocast)
            write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
            _report(record)


def main_loss(out: Path = LOSS_OUT, frameworks: set[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, seq_len, micro_batch in SHAPES:
        for framework in LOSS_FRAMEWORKS:
            if frameworks and framework not in frameworks:
                continue
            record = measure_compiled_loss(Framework(framework), get_model(model_name),
                                           BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch))
            _write_loss(out, record)
    if frameworks and "torchtitan" not in frameworks:
        return
    for model_name, seq_len, micro_batch in UNCHUNKED_LOSS_SHAPES:
        _write_loss(out, measure_compiled_loss(Framework.torchtitan, get_model(model_name),
                                               BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch), chunks=1))


def _write_loss(out: Path, record) -> None:
    write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
    print(f"{record.name:60s} compiled {record.saved_bytes(True):>14,}  eager {record.saved_bytes(False):>14,}"
          f"  ({record.wall_time_s:.1f} s)")


def _report(record) -> None:
    print(f"{record.name:60s} compiled {record.compiled_saved_bytes:>14,}  eager {record.eager_live_bytes:>14,}"
          f"  ({record.wall_time_s:.1f} s)")


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__, ("--finetune", "--loss"))
    if sys.argv[1:2] == ["--loss"]:
        main_loss(Path(sys.argv[2]) if len(sys.argv) > 2 else LOSS_OUT, set(sys.argv[3:]) or None)
        sys.exit(0)
    if sys.argv[1:2] == ["--finetune"]:
        main_finetune(Path(sys.argv[2]) if len(sys.argv) > 2 else FINETUNE_OUT, set(sys.argv[3:]) or None)
        sys.exit(0)
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT, set(sys.argv[2:]) or None)
