"""Measure the frameworks' own model code and write the records the planner is checked against.

    python benchmarks/framework_records.py [OUT_DIR [FRAMEWORK ...]]
        (default benchmarks/framework-records, every framework)
    python benchmarks/framework_records.py --finetune [OUT_DIR [GROUP ...]]
        (the LoRA/QLoRA runs, default benchmarks/framework-finetune-records: kept apart from the
        full fine-tunes the planner is already checked against; GROUP lora (FINETUNE_RUNS, about a
        minute), dora (DORA_RUNS, a few minutes), bnb (BNB_RUNS: hf QLoRA with bitsandbytes on
        real CPU tensors, about 20 minutes on 2 cores), int8 (INT8_RUNS: hf LoRA over
        bitsandbytes' LLM.int8 base, real CPU tensors, about 15 minutes), qdora (QDORA_RUNS: PEFT's
        DoRA over the bitsandbytes nf4 base, real CPU tensors, a few minutes), bnb-legacy (BNB_LEGACY_RUNS: hf QLoRA on bitsandbytes
        before 0.43.2, a few minutes); default all six)

Each run builds a framework's decoder (zeroplan.frameworks.build) at full width, four blocks
deep, on fake tensors, and records what each block keeps for backward (zeroplan.frameworks.
measure). Needs torch and the frameworks (scripts/install-frameworks); about a minute on 2 cores.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.measure import measure
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, StrategyKind, TrainingSpec

DEFAULT_OUT = Path(__file__).resolve().parent / "framework-records"
FINETUNE_OUT = Path(__file__).resolve().parent / "framework-finetune-records"

# (framework, strategy, precision, checkpointing): HF under DeepSpeed trains a bf16 module, HF
# under FSDP/DDP an fp32 module with autocast; torchtune trains in pure bf16; torchtitan keeps
# fp32 parameters and FSDP2 gathers them in bf16 (its default), so its module computes in bf16.
RUNS = [
    ("hf", "zero3", "bf16-mixed", "none"), ("hf", "zero3", "bf16-mixed", "full"),
    ("hf", "ddp", "bf16-mixed", "none"), ("hf", "ddp", "bf16-mixed", "full"),
    ("torchtune", "fsdp-full-shard", "bf16-pure", "none"), ("torchtune", "fsdp-full-shard", "bf16-pure", "full"),
    ("torchtitan", "fsdp-full-shard", "bf16-mixed", "none"), ("torchtitan", "fsdp-full-shard", "bf16-mixed", "full"),
    ("torchtitan", "fsdp-full-shard", "bf16-mixed", "selective-op"),
]
# torchtune 0.6.1's other options, as TrainingSpec fields: ac_mode selective with ac_option 2
# (recipes/configs/dev/8B_full_experimental.yaml) and 3 (a period of three blocks), and
# enable_activation_offloading, which its recipe allows only with full checkpointing.
OPTION_RUNS = [
    ("torchtune", "fsdp-full-shard", "bf16-pure", {"activation_checkpointing": "selective-layer", "selective_layer_interval": 2}),
    ("torchtune", "fsdp-full-shard", "bf16-pure", {"activation_checkpointing": "selective-layer", "selective_layer_interval": 3}),
    ("torchtune", "fsdp-full-shard", "bf16-pure", {"activation_checkpointing": "full", "activation_offloading": True}),
]
SHAPES = [("llama-3.1-8b", 8192, 2), ("llama-3.1-8b", 4096, 1), ("llama-3.1-70b", 4096, 1)]
# LoRA/QLoRA (TrainingSpec.finetune; zeroplan.frameworks.lora): torchtune's 8B_lora.yaml (r 8, its
# default targets q, v, o and the MLP) and 8B_qlora_single_device.yaml (the same over an NF4
# base) in pure bf16; PEFT r 16 over every block linear and over its default (q, v), on the HF
# Trainer's DDP path (bf16 autocast) over an fp32 base (from_pretrained's default) and a bf16 one
# (torch_dtype=torch.bfloat16), and once each with lora_dropout 0.1.
FINETUNE_SHAPES = [("llama-3.1-8b", 4096, 1)]
FINETUNE_RUNS = [
    ("torchtune", "fsdp-full-shard", "bf16-pure", policy, finetune)
    for policy in ("none", "full") for finetune in ({"lora_rank": 8}, {"lora_rank": 8, "quantize": "nf4"})
] + [
    ("hf", "ddp", "bf16-mixed", policy, {**finetune, "base_dtype": base})
    for policy in ("none", "full") for base in ("fp32", "bf16")
    for finetune in ({"lora_rank": 16, "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]}, {"lora_rank": 16})
] + [("hf", "ddp", "bf16-mixed", "none", {"lora_rank": 16, "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"],
                                          "lora_dropout": 0.1, "base_dtype": base}) for base in ("fp32", "bf16")]

# DoRA (use_dora): torchtune's 8B_lora targets at r 8 (lora_llama3_1(use_dora=True): DoRALinear)
# in its bf16; PEFT r 16 over every block linear, on the Trainer's DDP path over a bf16 and an
# fp32 base. Fake tensors, as the LoRA runs.
DORA_RUNS = [
    ("torchtune", "fsdp-full-shard", "bf16-pure", policy, {"lora_rank": 8, "dora": True, **nf4})
    for policy in ("none", "full") for nf4 in ({}, {"quantize": "nf4"})  # QDoRA: configs/llama3/8B_qdora_single_device.yaml
] + [
    ("hf", "ddp", "bf16-mixed", policy, {"lora_rank": 16, "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"],
                                         "dora": True, "base_dtype": base})
    for policy in ("none", "full") for base in ("bf16", "fp32")
]
# hf QLoRA (bitsandbytes 0.50.2 Linear4bit, PEFT r 16 over every block linear and over its default
# q, v), built as from_pretrained(quantization_config=BitsAndBytesConfig(nf4, double quant, bf16
# compute, bf16 quant storage)) builds it and prepared by prepare_model_for_kbit_training, on
# real CPU tensors (bitsandbytes quantizes only on a real device): shorter sequences, since the
# forward really computes (about a minute a record at s 1024 on 2 cores).
BNB_SHAPES = [("llama-3.1-8b", 1024, 1), ("llama-3.1-8b", 2048, 1)]
BNB_RUNS = [
    ("hf", "ddp", "bf16-mixed", policy, {"lora_rank": 16, "quantize": "nf4", **targets})
    for policy in ("none", "full") for targets in ({"lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]}, {})
]
# hf LoRA over an LLM.int8 base (BitsAndBytesConfig(load_in_8bit=True): bitsandbytes 0.50.2
# Linear8bitLt), PEFT r 16 as BNB_RUNS, on real CPU tensors as they are.
INT8_RUNS = [
    ("hf", "ddp", "bf16-mixed", policy, {"lora_rank": 16, "quantize": "int8", **targets})
    for policy in ("none", "full") for targets in ({"lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]}, {})
]
# PEFT's DoRA over the bitsandbytes nf4 base (LoraConfig(use_dora=True) on hf QLoRA: peft 0.17.1
# tuners/lora/bnb.py Linear4bit with the DoRA variant, which dequantizes the weight for its norm
# in every forward), r 16 over every block linear, as BNB_RUNS.
QDORA_RUNS = [
    ("hf", "ddp", "bf16-mixed", policy, {"lora_rank": 16, "quantize": "nf4", "dora": True,
                                         "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]})
    for policy in ("none", "full")
]
# hf QLoRA as BNB_RUNS (checkpointing none) on bitsandbytes before 0.43.2, whose MatMul4Bit kept
# its input (FineTuneSpec.bitsandbytes_version; zeroplan/frameworks/lora.py
# matmul_4bit_keeps_input): 0.43.1, the last such release; fsdp_qlora's train.py asked for 0.43.0
# and litgpt pinned 0.42.0.
BNB_LEGACY_RUNS = [
    ("hf", "ddp", "bf16-mixed", "none", {"lora_rank": 16, "quantize": "nf4", "bitsandbytes_version": "0.43.1", **targets})
    for targets in ({"lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]}, {})
]
FINETUNE_GROUPS = {"lora": (FINETUNE_SHAPES, FINETUNE_RUNS), "dora": (FINETUNE_SHAPES, DORA_RUNS), "bnb": (BNB_SHAPES, BNB_RUNS),
                   "int8": (BNB_SHAPES, INT8_RUNS), "qdora": (BNB_SHAPES[:1], QDORA_RUNS),
                   "bnb-legacy": (BNB_SHAPES[:1], BNB_LEGACY_RUNS)}


def main(out: Path = DEFAULT_OUT, frameworks: set[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    runs = [(f, s, p, {"activation_checkpointing": policy}) for f, s, p, policy in RUNS] + OPTION_RUNS
    for model_name, seq_len, micro_batch in SHAPES:
        for framework, strategy, precision, options in runs:
            if frameworks and framework not in frameworks:
                continue
            training = TrainingSpec(framework=framework, precision=precision, **options)
            record = measure(get_model(model_name), StrategyKind(strategy), training,
                             BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch))
            _write(out, record)
    main_finetune(FINETUNE_OUT if out == DEFAULT_OUT else out, frameworks)


REAL_TENSOR_GROUPS = ("bnb", "int8", "qdora", "bnb-legacy")
"""Groups built on real CPU tensors (several GB a record): each record runs in a process of its
own, since two int8 records in one process exceeded 24 GB of memory."""


def main_finetune(out: Path = FINETUNE_OUT, frameworks: set[str] | None = None, groups: list[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for group in groups or list(FINETUNE_GROUPS):
        shapes, runs = FINETUNE_GROUPS[group]
        for shape in range(len(shapes)):
            for run in range(len(runs)):
                if frameworks and runs[run][0] not in frameworks:
                    continue
                if group in REAL_TENSOR_GROUPS:
                    subprocess.run([sys.executable, __file__, "--one", str(out), group, str(shape), str(run)], check=True)
                else:
                    measure_one(out, group, shape, run)


def measure_one(out: Path, group: str, shape: int, run: int) -> None:
    """Measure FINETUNE_GROUPS[group]'s run ``run`` at its shape ``shape`` and write its record."""
    shapes, runs = FINETUNE_GROUPS[group]
    model_name, seq_len, micro_batch = shapes[shape]
    framework, strategy, precision, policy, finetune = runs[run]
    training = TrainingSpec(framework=framework, precision=precision, activation_checkpointing=policy, finetune=finetune)
    _write(out, measure(get_model(model_name), StrategyKind(strategy), training,
                        BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch)))


def _write(out: Path, record) -> None:
    write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
    print(f"{record.name:70s} block {record.block_kept_bytes:>14,} bytes  ({record.wall_time_s:.1f} s)", flush=True)


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__, ("--finetune", "--one"))
    if sys.argv[1:2] == ["--one"]:
        measure_one(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1:2] == ["--finetune"]:
        main_finetune(Path(sys.argv[2]) if len(sys.argv) > 2 else FINETUNE_OUT, groups=sys.argv[3:] or None)
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT, set(sys.argv[2:]) or None)
