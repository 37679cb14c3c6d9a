"""Run whole training steps of the frameworks' own models under their own FSDP2 wrapping and
write the records the planner's allocated peak is checked against.

    python benchmarks/framework_step_records.py [OUT_DIR [FRAMEWORK ...]]
        (default benchmarks/framework-step-records, every framework)
    python benchmarks/framework_step_records.py --optimizer-in-backward [OUT_DIR]
        (only torchtune's optimizer_in_bwd runs)
    python benchmarks/framework_step_records.py --finetune [OUT_DIR]
        (the LoRA/QLoRA runs, FINETUNE, default benchmarks/framework-finetune-step-records;
        about 8 minutes, most of it the single-device and 70B runs)
    python benchmarks/framework_step_records.py --torchtune-unchunked [OUT_DIR]
        (torchtune with a plain CrossEntropyLoss, TORCHTUNE_UNCHUNKED; about a minute)
    python benchmarks/framework_step_records.py --dpo [OUT_DIR]
        (torchtune's lora_dpo_single_device step, DPO, into the fine-tune directory)
    python benchmarks/framework_step_records.py --batch-slope [OUT_DIR]
        (hf LoRA at micro-batch 1 and 2, BATCH_SLOPE, into the fine-tune directory; about 2 minutes)
    python benchmarks/framework_step_records.py --dora [OUT_DIR]
        (the DoRA runs, DORA, into the same directory; about 2 minutes)
    python benchmarks/framework_step_records.py --long-context [OUT_DIR]
        (torchtitan at long sequences, LONG_CONTEXT; about 2 minutes)
    python benchmarks/framework_step_records.py --hf-fsdp1 [OUT_DIR]
        (hf under accelerate's FSDP1, HF_FSDP1, default benchmarks/framework-fsdp1-step-records;
        about 5 minutes; zeroplan.frameworks.hf_fsdp1_step counts its storages instead of
        FSDPMemTracker)
    python benchmarks/framework_step_records.py --hf-fsdp1-lora [OUT_DIR]
        (PEFT LoRA and gradient accumulation under accelerate's FSDP1, HF_FSDP1_LORA, into the
        same directory)
    python benchmarks/framework_step_records.py --hf-fsdp1-qlora-offload [OUT_DIR]
        (PEFT QLoRA, bitsandbytes nf4 stored in bf16, and a bf16 LoRA under accelerate's FSDP1
        with and without CPUOffload(offload_params=True), HF_FSDP1_QLORA, default
        benchmarks/framework-fsdp1-qlora-offload-step-records; about 7 minutes)
    python benchmarks/framework_step_records.py --hf-fsdp1-orig-params [OUT_DIR]
        (the first of those QLoRA runs under use_orig_params=True, HF_FSDP1_ORIG_PARAMS, default
        benchmarks/framework-fsdp1-orig-params-step-records; about 2 minutes)
    python benchmarks/framework_step_records.py --shallow [OUT_DIR]
        (SHALLOW: two of the matrix's runs at SHALLOW_BLOCKS blocks, what the live test reruns,
        default benchmarks/framework-step-records-shallow; a few seconds each)

Each run (zeroplan.frameworks.step.run_step) builds the framework's model at full depth on fake
tensors, shards it over a fake process group of N ranks as the framework's recipe does, and
runs two steps (forward, the framework's loss, backward, fused AdamW), tracking the second with
FSDP2's FSDPMemTracker. Needs torch and the frameworks (scripts/install-frameworks); 6-80 s a
run on 2 cores (about 7 minutes for the 20), the wall time is printed and kept in each record.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.step import run_step, step_training
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, ModelSpec, StrategyKind
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import Objective

DEFAULT_OUT = Path(__file__).resolve().parent / "framework-step-records"
FINETUNE_OUT = Path(__file__).resolve().parent / "framework-finetune-step-records"
SHALLOW_OUT = Path(__file__).resolve().parent / "framework-step-records-shallow"
HF_FSDP1_OUT = Path(__file__).resolve().parent / "framework-fsdp1-step-records"

# issue 8's sizes: 8B at 8 and 128 ranks, 70B at 64, seq 4096 and 8192, micro-batch 1-2.
SHAPES = [
    ("llama-3.1-8b", 8, 4096, 1), ("llama-3.1-8b", 8, 8192, 2),
    ("llama-3.1-8b", 128, 4096, 1), ("llama-3.1-8b", 128, 8192, 2),
    ("llama-3.1-70b", 64, 4096, 1),
]
FRAMEWORKS = (Framework.torchtune, Framework.hf, Framework.torchtitan)
POLICIES = ("none", "full")
MORE_POLICIES = {Framework.torchtitan: ("selective-op",)}
"""Policies a framework offers beyond none and full (torchtitan's SelectiveAC)."""
LONG_CONTEXT = [("llama-3.1-8b", 8, 16384, 4, "full"), ("llama-3.1-8b", 8, 32768, 1, "selective-op"),
                ("llama-3.1-70b", 64, 65536, 1, "full")]
"""torchtitan at b x s / 8 rows a loss chunk above the hidden size, where the first chunk's
cross-entropy backward, not the last chunk's head reduce-scatter, is the loss's largest moment
(zeroplan.core.framework_loss.torchtitan_chunk_cross_entropy_bytes): (model, ranks, seq, micro-batch, policy)."""
TORCHTUNE_UNCHUNKED = [("llama-3.1-8b", 8, 4096, 1, policy) for policy in POLICIES]
"""torchtune with a plain torch.nn.CrossEntropyLoss as its recipe's `loss:` (--unchunked-loss)."""
OPTIMIZER_IN_BACKWARD = [("llama-3.1-8b", 8, 4096, 1, "none"), ("llama-3.1-8b", 8, 4096, 1, "full"),
                         ("llama-3.1-70b", 64, 4096, 1, "full")]
"""torchtune's optimizer_in_bwd: (model, ranks, seq, micro-batch, policy) of each extra run."""
FINETUNE = [
    # torchtune 0.6.1 recipes/lora_finetune_distributed.py with configs/llama3_1/8B_lora.yaml
    # (r 8, q v o + MLP; AdamW fused over model.parameters(): states only for the adapters,
    # the only parameters with gradients) and with its QLoRA model (quantize_base, NF4).
    *[(Framework.torchtune, "llama-3.1-8b", 8, policy, finetune)
      for policy in POLICIES for finetune in ({"lora_rank": 8}, {"lora_rank": 8, "quantize": "nf4"})],
    # PEFT r 16 over every block linear under the HF Trainer's accelerate FSDP2 path.
    *[(Framework.hf, "llama-3.1-8b", 8, policy, {"lora_rank": 16, "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]})
      for policy in POLICIES],
    # recipes/lora_finetune_single_device.py with 8B_lora_single_device.yaml
    # (enable_activation_checkpointing True): `zeroplan fit ... --lora-rank 8 --gpus 1`.
    (Framework.torchtune, "llama-3.1-8b", 1, "full", {"lora_rank": 8}),
    # configs/llama3_1/70B_lora.yaml: r 16, enable_activation_checkpointing True.
    (Framework.torchtune, "llama-3.1-70b", 8, "full", {"lora_rank": 16}),
]
"""(framework, model, ranks, policy, TrainingSpec.finetune) of each LoRA/QLoRA run at s4096 b1;
1 rank is the single-device recipe (StrategyKind.ddp), more its FSDP2 recipe (fsdp-full-shard)."""
DORA = [
    # torchtune 0.6.1 configs/llama3_1/8B_lora.yaml with use_dora: True (lora_llama3_1(use_dora=True)).
    *[(Framework.torchtune, "llama-3.1-8b", 8, policy, {"lora_rank": 8, "dora": True}) for policy in POLICIES],
    # configs/llama3/8B_qdora_single_device.yaml: DoRA over NF4 on one GPU (lora_finetune_single_device).
    (Framework.torchtune, "llama-3.1-8b", 1, "full", {"lora_rank": 8, "dora": True, "quantize": "nf4"}),
    # PEFT LoraConfig(use_dora=True) over every block linear, accelerate's FSDP2.
    (Framework.hf, "llama-3.1-8b", 8, "full", {"lora_rank": 16, "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"],
                                               "dora": True}),
]
"""The DoRA runs, as FINETUNE's."""
DPO = [
    # torchtune 0.6.1 recipes/lora_dpo_single_device.py with configs/llama3_1/8B_lora_dpo_single_device.yaml:
    # r 8 on q v o + MLP, max_seq_len 1024, batch_size 4 pairs (8 rows), activation checkpointing
    # on, bf16; and one pair (2 rows).
    ("llama-3.1-8b", 1024, 8, {"lora_rank": 8}), ("llama-3.1-8b", 1024, 2, {"lora_rank": 8}),
]
"""(model, seq, rows, TrainingSpec.finetune) of each single-device LoRA DPO run (objective dpo)."""
BATCH_SLOPE = [
    # The memory each extra sample adds in a LoRA step (published fsdp_qlora tables vary only the
    # batch: Llama-2-7B, r 64 on all seven linears, dropout 0.1, 2 GPUs, 2048 tokens, gradient
    # checkpointing), here under the hf profile's own code: PEFT over accelerate's FSDP2.
    (Framework.hf, "llama-2-7b", 2, 2048, micro_batch, "full",
     {"lora_rank": 64, "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"], "lora_dropout": 0.1})
    for micro_batch in (1, 2)
]
"""(framework, model, ranks, seq, micro-batch, policy, TrainingSpec.finetune) of each run."""
SHALLOW_BLOCKS = 4
SHALLOW = [("llama-3.1-8b", 128, 4096, 1, Framework.torchtune, "full"),
           ("llama-3.1-8b", 128, 4096, 1, Framework.torchtitan, "selective-op")]
"""(model, ranks, seq, micro-batch, framework, policy) of the runs tests/test_framework_step.py
reruns live against their committed records, each at SHALLOW_BLOCKS blocks (shallow_model): the
same framework code on the same architecture, every block alike, in 2-4 s a run where the full
depth takes about 15 (the cost of a fake step grows with its operations, not their sizes)."""


HF_FSDP1 = [
    # The default matrix's hf runs under FULL_SHARD, then SHARD_GRAD_OP at the first shape, and
    # the 8B at SHALLOW_BLOCKS blocks that tests/test_framework_step.py reruns live.
    *[(model_name, world_size, seq_len, micro_batch, policy, StrategyKind.fsdp_full_shard, None)
      for model_name, world_size, seq_len, micro_batch in SHAPES for policy in POLICIES],
    *[("llama-3.1-8b", 8, 4096, 1, policy, StrategyKind.fsdp_shard_grad_op, None) for policy in POLICIES],
    ("llama-3.1-8b", 8, 4096, 1, "full", StrategyKind.fsdp_full_shard, SHALLOW_BLOCKS),
]
"""hf under accelerate's fsdp_version 1: (model, ranks, seq, micro-batch, policy, strategy, blocks
or None for the full depth)."""

ALL_LINEAR = ["q", "k", "v", "o", "gate", "up", "down"]
"""PEFT's target_modules="all-linear" on Llama (every nn.Linear of the blocks; lm_head is left out)."""
HF_FSDP1_LORA = [
    # PEFT LoRA r 16 under the Trainer's accelerate FSDP1 (PEFT's fsdp_auto_wrap_policy), q,v
    # (LoraConfig's Llama default) and all-linear, none and full recomputation, FULL_SHARD.
    *[("llama-3.1-8b", 8, 4096, 1, 1, policy, {"lora_rank": 16, "lora_targets": targets}, None)
      for targets in (["q", "v"], ALL_LINEAR) for policy in POLICIES],
    ("llama-3.1-8b", 8, 4096, 2, 1, "full", {"lora_rank": 16, "lora_targets": ALL_LINEAR}, None),
    # Gradient accumulation: 2 micro-batches a step, the first under FSDP1's no_sync.
    *[("llama-3.1-8b", 8, 4096, 1, 2, policy, {}, None) for policy in POLICIES],
    ("llama-3.1-8b", 8, 4096, 1, 2, "full", {"lora_rank": 16, "lora_targets": ALL_LINEAR}, None),
    # What tests/test_hf_fsdp1.py reruns live: both at SHALLOW_BLOCKS blocks.
    ("llama-3.1-8b", 8, 4096, 1, 2, "full", {"lora_rank": 16, "lora_targets": ["q", "v"]}, SHALLOW_BLOCKS),
]
"""LoRA and gradient accumulation under accelerate's fsdp_version 1, FULL_SHARD: (model, ranks,
seq, micro-batch, accumulation steps, policy, TrainingSpec.finetune ({}: full fine-tuning),
blocks or None for the full depth)."""

HF_FSDP1_QLORA_OUT = Path(__file__).resolve().parent / "framework-fsdp1-qlora-offload-step-records"

PEFT_FSDP_QLORA = {"lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.1, "lora_targets": ALL_LINEAR,
                   "quantize": "nf4", "kbit_fp32_cast": False}
NOTEBOOK_FSDP_QLORA = {"lora_rank": 16, "lora_alpha": 8, "lora_dropout": 0.05, "lora_targets": ALL_LINEAR,
                       "quantize": "nf4", "kbit_fp32_cast": False}

HF_FSDP1_QLORA = [
    # PEFT's FSDP QLoRA guide (docs/source/accelerate/fsdp.md at 6008f27, fsdp_config_qlora.yaml:
    # use_orig_params false): Llama-2-70B, nf4 with double quantization stored in bf16, r 8 alpha
    # 16 dropout 0.1 on all linears, 2 ranks, micro-batch 2 of 2048 tokens, 2 micro-batches a
    # step, reentrant recomputation, without and with fsdp_offload_params.
    ("llama-2-70b", 2, 2048, 2, 2, "full", PEFT_FSDP_QLORA, False, False),
    ("llama-2-70b", 2, 2048, 2, 2, "full", PEFT_FSDP_QLORA, True, False),
    # The same without LoRA dropout (nn.Identity: each lora_A keeps the input it shares).
    ("llama-2-70b", 2, 2048, 2, 2, "full", {**PEFT_FSDP_QLORA, "lora_dropout": 0.0}, False, False),
    # The Llama-3-70B FSDP QLoRA notebook's yaml (fsdp "full_shard auto_wrap offload",
    # use_orig_params false): r 16 alpha 8 dropout 0.05, 4 ranks, micro-batch 1 of 3072.
    ("llama-3-70b", 4, 3072, 1, 2, "full", NOTEBOOK_FSDP_QLORA, True, False),
    # A bf16 LoRA offloaded under the Trainer's own FSDP1 settings (use_orig_params true), the
    # LoRA records' run (framework-fsdp1-step-records) with fsdp_offload_params.
    *[("llama-3.1-8b", 8, 4096, 1, 1, policy, {"lora_rank": 16, "lora_targets": ALL_LINEAR}, True, True)
      for policy in POLICIES],
    # A full fine-tune offloaded (accelerate's fsdp_offload_params true under the Trainer's own
    # settings), the FSDP1 records' 8B shape, with and without recomputation, then 2 micro-batches
    # a step: torch 2.13's FSDP1 no_sync keeps the unsharded gradients on the device until the
    # syncing micro-batch (fully_sharded_data_parallel.py no_sync's note; _runtime_utils.py
    # _post_backward_hook returns before the reduce-scatter and _offload_grad).
    *[("llama-3.1-8b", 8, 4096, 1, accumulation, policy, {}, True, True)
      for accumulation, policy in ((1, "none"), (1, "full"), (2, "full"))],
]
"""PEFT QLoRA and CPU offload under accelerate's fsdp_version 1, FULL_SHARD, full depth: (model,
ranks, seq, micro-batch, accumulation steps, policy, TrainingSpec.finetune, CPU offload,
use_orig_params)."""


HF_FSDP1_ORIG_PARAMS_OUT = Path(__file__).resolve().parent / "framework-fsdp1-orig-params-step-records"
HF_FSDP1_ORIG_PARAMS = [
    # PEFT's FSDP QLoRA guide's first run under the Trainer's own use_orig_params=True (its record
    # name is the use_orig_params=False run's, hence a directory of its own).
    ("llama-2-70b", 2, 2048, 2, 2, "full", PEFT_FSDP_QLORA, False, True),
]
"""HF_FSDP1_QLORA's fields, use_orig_params true."""


def shallow_model(model_name: str, blocks: int = SHALLOW_BLOCKS) -> ModelSpec:
    """``model_name``'s architecture with ``blocks`` blocks, named apart from the full depth (the
    model itself where that is its depth)."""
    model = get_model(model_name)
    if blocks == model.num_layers:
        return model
    return model.model_copy(update={"name": f"{model.name}-{blocks}-blocks", "num_layers": blocks})


def main(out: Path = DEFAULT_OUT, frameworks: set[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, world_size, seq_len, micro_batch in SHAPES:
        for framework in FRAMEWORKS:
            if frameworks and framework.value not in frameworks:
                continue
            for policy in POLICIES + MORE_POLICIES.get(framework, ()):
                _run(out, model_name, world_size, seq_len, micro_batch, step_training(framework, policy))
    if not frameworks or Framework.torchtune.value in frameworks:
        main_optimizer_in_backward(out)
        main_torchtune_unchunked(out)
    if not frameworks or Framework.torchtitan.value in frameworks:
        main_long_context(out)
    if not frameworks:
        main_finetune(FINETUNE_OUT if out == DEFAULT_OUT else out)
        main_finetune(FINETUNE_OUT if out == DEFAULT_OUT else out, DORA)
        main_shallow(SHALLOW_OUT if out == DEFAULT_OUT else out)


def main_finetune(out: Path = FINETUNE_OUT, runs: list = FINETUNE) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for framework, model_name, world_size, policy, finetune in runs:
        training = step_training(framework, policy).model_copy(update={"finetune": FineTuneSpec(**finetune)})
        strategy = StrategyKind.ddp if world_size == 1 else StrategyKind.fsdp_full_shard
        _run(out, model_name, world_size, 4096, 1, training, strategy)


def main_dpo(out: Path = FINETUNE_OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, seq_len, rows, finetune in DPO:
        training = step_training(Framework.torchtune, "full").model_copy(
            update={"finetune": FineTuneSpec(**finetune), "objective": Objective.dpo})
        _run(out, model_name, 1, seq_len, rows, training, StrategyKind.ddp)


def main_batch_slope(out: Path = FINETUNE_OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for framework, model_name, world_size, seq_len, micro_batch, policy, finetune in BATCH_SLOPE:
        training = step_training(framework, policy).model_copy(update={"finetune": FineTuneSpec(**finetune)})
        _run(out, model_name, world_size, seq_len, micro_batch, training)


def main_shallow(out: Path = SHALLOW_OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, world_size, seq_len, micro_batch, framework, policy in SHALLOW:
        _run(out, model_name, world_size, seq_len, micro_batch, step_training(framework, policy),
             model=shallow_model(model_name))


def _run(out: Path, model_name: str, world_size: int, seq_len: int, micro_batch: int, training,
         strategy: StrategyKind = StrategyKind.fsdp_full_shard, model: ModelSpec | None = None) -> None:
    """One step of ``model`` (default: the preset ``model_name``) written into ``out``."""
    record = run_step(model or get_model(model_name), strategy, training,
                      BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch), world_size)
    _write(out, record)


def _write(out: Path, record) -> None:  # type: ignore[no-untyped-def]
    write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
    print(f"{record.name:72s} peak {record.peak_bytes / 2**30:8.2f} GiB at {record.peak_phase.value:9s} "
          f"({record.wall_time_s:.1f} s)", flush=True)


def main_hf_fsdp1(out: Path = HF_FSDP1_OUT) -> None:
    from zeroplan.frameworks.hf_fsdp1_step import run_hf_fsdp1_step

    out.mkdir(parents=True, exist_ok=True)
    for model_name, world_size, seq_len, micro_batch, policy, strategy, blocks in HF_FSDP1:
        model = get_model(model_name) if blocks is None else shallow_model(model_name, blocks)
        record = run_hf_fsdp1_step(model, strategy, step_training(Framework.hf, policy),
                                   BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch), world_size)
        _write(out, record)


def main_hf_fsdp1_lora(out: Path = HF_FSDP1_OUT) -> None:
    from zeroplan.frameworks.hf_fsdp1_step import run_hf_fsdp1_step

    out.mkdir(parents=True, exist_ok=True)
    for model_name, world_size, seq_len, micro_batch, accumulation, policy, finetune, blocks in HF_FSDP1_LORA:
        model = get_model(model_name) if blocks is None else shallow_model(model_name, blocks)
        training = step_training(Framework.hf, policy).model_copy(update={"finetune": FineTuneSpec(**finetune)})
        batch = BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch, grad_accum_steps=accumulation)
        _write(out, run_hf_fsdp1_step(model, StrategyKind.fsdp_full_shard, training, batch, world_size))


def main_hf_fsdp1_qlora_offload(out: Path = HF_FSDP1_QLORA_OUT, runs: list | None = None) -> None:
    from zeroplan.frameworks.hf_fsdp1_step import run_hf_fsdp1_step

    out.mkdir(parents=True, exist_ok=True)
    for model_name, world_size, seq_len, micro_batch, accumulation, policy, lora, offload, orig in runs or HF_FSDP1_QLORA:
        training = step_training(Framework.hf, policy).model_copy(
            update={"finetune": FineTuneSpec(**lora), "fsdp_cpu_offload": offload})
        batch = BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch, grad_accum_steps=accumulation)
        _write(out, run_hf_fsdp1_step(get_model(model_name), StrategyKind.fsdp_full_shard, training, batch, world_size,
                                      use_orig_params=orig))


def main_long_context(out: Path = DEFAULT_OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, world_size, seq_len, micro_batch, policy in LONG_CONTEXT:
        _run(out, model_name, world_size, seq_len, micro_batch, step_training(Framework.torchtitan, policy))


def main_torchtune_unchunked(out: Path = DEFAULT_OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, world_size, seq_len, micro_batch, policy in TORCHTUNE_UNCHUNKED:
        training = step_training(Framework.torchtune, policy).model_copy(update={"unchunked_loss": True})
        _run(out, model_name, world_size, seq_len, micro_batch, training)


def main_optimizer_in_backward(out: Path = DEFAULT_OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, world_size, seq_len, micro_batch, policy in OPTIMIZER_IN_BACKWARD:
        training = step_training(Framework.torchtune, policy).model_copy(update={"optimizer_in_backward": True})
        _run(out, model_name, world_size, seq_len, micro_batch, training)


def _parse(argv: list[str]):  # type: ignore[no-untyped-def]
    """The command line the docstring shows: at most one mode flag, then OUT_DIR, then (for the
    default matrix alone) frameworks; anything else is refused before a step runs."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_mutually_exclusive_group()
    for flag in MODES:
        modes.add_argument(flag, action="store_true")
    parser.add_argument("out", nargs="?", type=Path, help="where the records go")
    parser.add_argument("frameworks", nargs="*", help="the default matrix's frameworks (every one when none)")
    options = parser.parse_args(argv)
    mode = next((flag for flag in MODES if getattr(options, flag[2:].replace("-", "_"))), None)
    if mode is not None and options.frameworks:
        parser.error(f"{mode} takes only OUT_DIR")
    return mode, options.out, options.frameworks


MODES = {
    "--finetune": (main_finetune, FINETUNE_OUT),
    "--batch-slope": (main_batch_slope, FINETUNE_OUT),
    "--dora": (lambda out: main_finetune(out, DORA), FINETUNE_OUT),
    "--dpo": (main_dpo, FINETUNE_OUT),
    "--torchtune-unchunked": (main_torchtune_unchunked, DEFAULT_OUT),
    "--long-context": (main_long_context, DEFAULT_OUT),
    "--shallow": (main_shallow, SHALLOW_OUT),
    "--hf-fsdp1": (main_hf_fsdp1, HF_FSDP1_OUT),
    "--hf-fsdp1-lora": (main_hf_fsdp1_lora, HF_FSDP1_OUT),
    "--hf-fsdp1-qlora-offload": (main_hf_fsdp1_qlora_offload, HF_FSDP1_QLORA_OUT),
    "--hf-fsdp1-orig-params": (lambda out: main_hf_fsdp1_qlora_offload(out, HF_FSDP1_ORIG_PARAMS), HF_FSDP1_ORIG_PARAMS_OUT),
    "--optimizer-in-backward": (main_optimizer_in_backward, DEFAULT_OUT),
}
"""Each mode flag: the function that runs it and its default OUT_DIR."""


if __name__ == "__main__":
    mode, out, frameworks = _parse(sys.argv[1:])
    if mode is None:
        main(out or DEFAULT_OUT, set(frameworks) or None)
    else:
        run, default_out = MODES[mode]
        run(out or default_out)
