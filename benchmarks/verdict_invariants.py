"""A metamorphic sweep of the planner's answers for physical consistency: random but valid
requests (models from 0.5 B to 70 B, every framework, strategy, tp/pp/cp layout, LoRA/QLoRA,
activation checkpointing, GPU), each asked again with one thing changed where physics says which
way the answer must move. A verdict that disagrees with the GPU is the worst answer a planner
can give; none of this is a GPU measurement, only the planner against itself.

Invariants (each checked only where it must hold):
  1 bigger-gpu     the same request on a GPU of the same family with more memory never turns fits into OOM
                   (under the allocator model, never into an OOM that is not borderline: a refused
                   cudaMalloc frees the cache, so completion is not monotone in the memory)
  2 batch-growth   the allocated peak never decreases when the micro-batch or the sequence grows;
                   the reserved peak is never below the allocated peak
  3 state-order    model-state bytes per GPU: ddp >= zero1 >= zero2 >= zero3, fsdp-shard-grad-op >=
                   fsdp-full-shard, and an offload variant holds no more than its strategy on the GPU
  4 checkpointing  full activation checkpointing saves no more activation bytes than any other mode,
                   and moving saved activations to host memory (torchtune's activation offloading)
                   never raises the allocated peak
  5 max-mb         the largest micro-batch (max-mb) fits, so do smaller ones, and max-mb + 1 does not,
                   by plan()'s verdict
  6 plan-vs-fit    plan()'s verdict and peak for a strategy equal fit()'s row for it
  7 determinism    the same request answers the same numbers again (after every other request of the
                   run, in reverse order: a cache keyed on too few fields shows here), and every
                   refused request is a one-line ZeroplanError (or pydantic's one-line error), never
                   another exception
  8 scale-out      twice the GPUs (the same per-GPU batch and layout) never raise zero3's or
                   fsdp-full-shard's model-state bytes per GPU: each rank's shard of every tensor
                   is no larger over more ranks
  9 precision      fp32 model states per GPU are no fewer than bf16-pure's (4 bytes an element
                   against 2, the same optimizer; mixed precision is not compared: it keeps fp32
                   master weights beside the 16-bit ones, more bytes than fp32 alone)
 10 step-time      a longer sequence, a larger micro-batch or more micro-batches a step never lowers
                   the step's time: more tokens through the same model on the same GPUs
 11 adapter-rank   twice the LoRA rank never lowers the model-state bytes per GPU (every adapter
                   matrix, its gradient and its optimizer states grow) or, outside DeepSpeed's
                   ZeRO-3 gathers, the allocated peak (so does the rank-wide input each adapter
                   saves for backward; DeepSpeed prefetches up to a count of elements, which
                   larger adapters fill with fewer base weights); not asked of a paged optimizer,
                   which moves a tensor's states off the GPU once it reaches 1e5 elements
 12 ds-checkpoint  DeepSpeed's activation checkpointing (Megatron-DeepSpeed, zeroplan's model): keeping
                   each checkpointed block input on the host (--checkpoint-in-cpu) or split over the
                   tensor-parallel ranks (--partition-activations) never raises the allocated peak nor
                   lowers the step time (host copies and all-gathers only add), each against the same
                   request without it (pipeline rank by pipeline rank); the host bytes per rank never
                   fall when the checkpoints go to the host. The step time of both options is not
                   compared with the host's alone: the partition changes which copies cross the
                   host link (partitions_host_copies)
 13 offload-ratio  ZeRO-Offload++'s ratio (zero3-offload, zero3-param-offload) moves whole optimizer
                   sub-groups: a smaller ratio (more sub-groups on the GPU) never lowers the GPU's
                   model-state bytes nor raises the host bytes per rank, at DeepSpeed's default
                   sub_group_size and at sizes that split the rank's partition into 3 and 8; ratio
                   1.0 answers exactly as no ratio
 14 hf-fsdp1       hf under accelerate's FSDP1 (--fsdp-version 1) against the same request under FSDP2:
                   the FSDP1 module changes when units are gathered (the root kept gathered, the cat
                   that ends backward, no unit prefetched), not what is stored, so the parameter,
                   gradient and optimizer-state bytes, the activation bytes and the host bytes per
                   rank are identical, and no more bytes are sent (the kept root is not gathered
                   again in backward)
 15 ulysses        DeepSpeed-Ulysses (--cp P under megatron-deepspeed) against cp 1 and 2P on the same
                   GPUs: a larger degree never raises the rank's activation bytes (its blocks run
                   s/P tokens) nor lowers the all-to-all bytes its sequence group sends (P ranks
                   each sending (P - 1)/P of s/P tokens' q, k, v and context), and leaves the
                   model-state bytes unchanged (ZeRO shards over the dp x P ranks, the world)
 16 mha-views      --torch-multihead-attention (DeepSpeed ZeRO-3's pinned in_proj views) never lowers
                   the allocated peak, and where no in-projection is pinned (a full block checkpoint,
                   or gathers that are not DeepSpeed's plain ZeRO-3) answers every memory figure
                   as without it
 17 device-map     hf's --device-map (accelerate's split of the layers over one process's GPUs):
                   the plan's peak and verdict are the worst GPU's, 'auto' answers as 'balanced',
                   and twice the GPUs (half, where twice leaves the node) never raise the worst
                   GPU's parameter bytes, sequential, or balanced where accelerate's per-GPU
                   budget holds the largest unsplit module (else its walk may skip to the last GPU)
 18 muon           --optimizer muon keeps no more optimizer-state (nor model-state) bytes per GPU
                   than AdamW on the same request: one momentum for each block matrix's element
                   where AdamW keeps two states, AdamW's own on the rest; under DeepSpeed's ZeRO-1/2
                   beyond that only its momentum and staged copy, in the model's dtype, of the
                   matrix elements past the Muon group's partition (a rank keeps every matrix its
                   partition meets whole) and the two groups' separate alignment padding
 19 torch-linear   --deepspeed-torch-linear (torch's F.linear under DeepSpeed's ZeRO-3) never
                   lowers the allocated peak or the flat reserve's peak, and where no linear weight
                   is pinned (gathers that are not DeepSpeed's plain ZeRO-3) answers every memory
                   figure as without it
 20 model-load     hf's --model-load: 'sharded' answers as no flag (the profile's default); a
                   full-per-rank load never turns an OOM into a fit, never lowers the allocated
                   peak, the host bytes per rank or raises max-mb, against the sharded load
 21 margin         the allocated peak's error band (margin.ALLOCATED_PEAK_ERROR_BAND) marks fits
                   only: a predicted OOM is borderline by the reserve's band or the allocator's
                   turn within it alone, and a fit whose allocated peak alone may reach the usable
                   memory is borderline (every plan of a request, and those near its tightest fit)
 22 dpo            --objective dpo (torchtune's LoRA DPO recipes) against the same rows as a causal-LM
                   step: the same model-state bytes (the reference is the policy with its adapters
                   disabled, no second copy of the weights) and no lower allocated peak (the same
                   forward and backward, with the whole fp32 log-softmax that SFT's chunked loss
                   saves chunk by chunk, plus the reference's head beside it); max-mb counts rows of
                   pairs, so it is even and max-mb + 2 does not fit (2, 4 and 10 step by two rows)
 23 padded         --padded-batches yes against no: the same model-state bytes and no lower allocated
                   peak (a padding mask and, under hf's SDPA, repeated K/V only add); without
                   --varying-lengths, 'no' answers every figure as no flag (nothing pads then)
 24 loss-options   --uncast-loss never raises the allocated peak (the loss's three logits-sized
                   tensors in the logits' dtype, never wider than the fp32 of the upcast) and
                   --keep-outputs never lowers it (the output object held through backward only
                   adds); neither changes the model-state bytes
 25 exact-allocator --exact-allocator (every verdict's whole trace replayed afresh, the oracle)
                   answers the same verdict, reserved peak, borderline mark and max-mb as the
                   replays reused where they decide it exactly (allocator.planner._outcome), on a
                   share of the requests the allocator model judges
 26 checkpoint-peak full activation checkpointing never raises the allocated peak above no
                   checkpointing's, strategy by strategy and pipeline rank by pipeline rank (each
                   block keeps its input and recomputes the rest one block at a time in backward,
                   against every block's activations kept: 4 compares saved activation bytes only).
                   Not a property of hf's LoRA (frozen weights) under DeepSpeed's plain ZeRO-3
                   gathers: from DeepSpeed 0.19.3 a frozen weight fetched in a reentrant
                   checkpoint's recompute stays gathered to the backward's end
                   (core.deepspeed_coordinator.holds_recomputed_frozen, measured on DeepSpeed's own
                   engine), so recomputation gathers the whole frozen model (Mistral-7B LoRA on 8
                   GPUs: 16.4 GiB allocated against 11.5 without); those are left out
 27 accum-states   under DDP the gradient accumulation steps never change the model-state bytes per
                   GPU (DDP's no_sync accumulates into the same .grad the all-reduce reads: torch
                   nn/parallel/distributed.py no_sync; nothing is kept per micro-batch)
 28 verdict        every plan's verdict agrees with its own figures: headroom = usable - peak; a fit
                   has peak <= usable (and its load within it); an OOM has peak > usable or a load
                   that runs out; under a pipeline the plan is the rank with the least headroom, each
                   rank on its own usable memory (not always the highest peak: a middle stage's
                   communicators leave it less)
 29 round-trip     the report's JSON validates back into a FitReport that dumps the same, and its
                   data frame has one row per plan with the plan's peak and verdict; `zeroplan plan
                   --format json` validates back into a PlanSearchResult that dumps the same
 30 cli-agrees     `zeroplan fit ... --format json` answers fit()'s plans field for field, and the
                   text view's first line and table say fit()'s verdict, fits cell and peak (GiB to
                   0.1) for every strategy (on a share of the requests)

    python benchmarks/verdict_invariants.py --requests 500 --seed 1
"""

from __future__ import annotations

import argparse
import functools
import random
import shlex
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from zeroplan.cli.fit import (
    add_fit_arguments, check_offload_ratio, check_options_apply, parse_strategies, request_from_args, strategies_asked,
)
from zeroplan.cli.parser import OneLineParser
from zeroplan.core.plan import fit, pipeline_rank_breakdowns, plan
from zeroplan.errors import ZeroplanError
from zeroplan.specs.strategy import StrategyKind

SMALL_MODELS = ("qwen2.5-0.5b", "qwen3-0.6b", "tinyllama-1.1b", "gpt2", "gpt2-medium", "qwen2.5-1.5b", "qwen2.5-3b",
                "t5-large", "bart-large")
MID_MODELS = ("llama-2-7b", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b", "llama-2-13b", "qwen3-8b")
LARGE_MODELS = ("qwen2.5-32b", "llama-2-70b", "llama-3.1-70b")
FRAMEWORKS = ("zeroplan", "hf", "torchtune", "torchtitan", "litgpt", "megatron", "zeroplan", "hf", "megatron-deepspeed",
              "fairseq")
GPUS = ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "a10g", "l40s", "v100-16gb", "v100-32gb", "rtx-4090",
        "b200", "mi300x")
LARGER_SIBLING = {"a100-40gb": "a100-80gb", "v100-16gb": "v100-32gb", "h100-80gb": "h200-141gb", "mi300x": "mi325x"}
"""A GPU of the same family with more memory (H200: an H100 with 141 GB of HBM3e; MI325X: an
MI300X, CDNA 3, with 256 GB of HBM3E)."""
CHECKPOINTING = ("none", "selective", "full", "selective-op", "selective-layer")
MODEL_PARALLEL_FRAMEWORKS = ("zeroplan", "torchtitan", "megatron")

STATE_ORDER = (("ddp", "zero1"), ("zero1", "zero2"), ("zero2", "zero3"), ("ddp", "fsdp-shard-grad-op"),
               ("fsdp-shard-grad-op", "fsdp-full-shard"), ("zero2", "zero2-offload"), ("zero3", "zero3-offload"),
               ("zero3-offload", "zero3-param-offload"), ("zero3", "zero3-nvme"), ("zero3-offload", "zero3-nvme"),
               ("zero3-param-offload", "zero3-param-nvme"))
"""(more, no more) pairs of model-state bytes per GPU on the same layout."""

INVARIANTS = ("1 bigger-gpu", "2 batch-growth", "3 state-order", "4 checkpointing", "5 max-mb", "6 plan-vs-fit",
              "7 determinism", "8 scale-out", "9 precision", "10 step-time", "11 adapter-rank", "12 ds-checkpoint",
              "13 offload-ratio", "14 hf-fsdp1", "15 ulysses", "16 mha-views", "17 device-map", "18 muon",
              "19 torch-linear", "20 model-load", "21 margin", "22 dpo", "23 padded", "24 loss-options",
              "25 exact-allocator", "26 checkpoint-peak", "27 accum-states", "28 verdict", "29 round-trip",
              "30 cli-agrees")
SCALE_OUT_STRATEGIES = ("zero3", "fsdp-full-shard")
"""Strategies whose every model state is sharded over the data-parallel ranks (8 scale-out)."""


def random_argv(rng: random.Random) -> list[str]:
    """One random request as `zeroplan fit` flags; valid most of the time (the planner refuses the rest)."""
    framework = rng.choice(FRAMEWORKS)
    if rng.random() < 0.08:
        return moe_argv(rng)
    models, modes = framework_accepts(framework)
    while not models or not modes:
        framework = rng.choice(FRAMEWORKS)
        models, modes = framework_accepts(framework)
    size = rng.random()
    sized = [m for m in (SMALL_MODELS if size < 0.35 else MID_MODELS if size < 0.8 else LARGE_MODELS) if m in models]
    model = rng.choice(sized or models)
    gpus = rng.choice((1, 2, 4, 8, 8, 16, 32))
    argv = [model, "--framework", framework, "--gpu", rng.choice(GPUS), "--gpus", str(gpus),
            "--micro-batch", str(rng.choice((1, 1, 2, 3, 4, 8))), "--seq-len", str(rng.choice((512, 1024, 2048, 4096))),
            "--grad-accum", str(rng.choice((1, 1, 2, 4))),
            "--activation-checkpointing", rng.choice(modes)]
    if framework in MODEL_PARALLEL_FRAMEWORKS and gpus >= 2 and rng.random() < 0.4:
        tp = rng.choice((1, 2, 4))
        pp = rng.choice((1, 1, 2, 4))
        cp = rng.choice((1, 1, 2)) if framework != "megatron" else 1
        if tp * pp * cp <= gpus:
            argv += ["--tp", str(tp), "--pp", str(pp), "--cp", str(cp)]
            if pp > 1:
                argv = with_flag(argv, "--grad-accum", str(rng.choice((pp, 2 * pp))))
                if rng.random() < 0.4:
                    argv += rng.choice(PIPELINE_OPTIONS)
            if tp > 1 and rng.random() < 0.2:
                argv += [rng.choice(("--no-sequence-parallel", "--async-tp"))]
    finetune = rng.random()
    if finetune < 0.15:
        argv += ["--lora-rank", str(rng.choice((8, 16, 64)))]
    elif finetune < 0.25:
        argv += ["--lora-rank", str(rng.choice((8, 16))), "--quantize", "nf4"]
    if rng.random() < 0.1:
        argv += ["--optimizer", rng.choice(("adam", "sgd", "adam-8bit", "lion", "adafactor"))]
    if rng.random() < 0.1:
        argv += ["--precision", rng.choice(("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"))]
    if framework in ("torchtune", "torchtitan") and rng.random() < 0.15:
        argv += ["--fsdp-cpu-offload"]
    if framework in ("torchtune", "torchtitan") and rng.random() < 0.1:
        argv += ["--compile"]
    argv += rare_options(rng, framework, model)
    argv += deepspeed_options(argv, framework)
    argv = new_input_options(argv, framework)
    argv = newest_input_options(argv, framework)
    argv = objective_and_loss_options(argv, framework)
    if rng.random() < 0.3:
        argv += ["--flat-reserve"]
    elif rng.random() < 0.15:
        argv += ["--allocator-conf", "expandable_segments:True"]
    return argv


OPTIONS = (
    # (probability, frameworks (None: any), flags)
    (0.06, ("zeroplan", "hf"), ["--strategies", "zero3,zero3-hpz,zero3-zeropp,zero3-mics,zero3-nvme,zero3-param-nvme,"
                                "zero3-offload,zero3-param-offload"]),
    (0.05, ("zeroplan", "hf", "torchtitan", "torchtune", "litgpt"), ["--hsdp-group", "2"]),
    (0.05, ("zeroplan", "hf"), ["--strategies", "zero1,zero2,zero2-offload,zero3,zero3-offload"]),
    (0.05, ("zeroplan",), ["--fsdp-version", "1"]),
    (0.05, None, ["--keep-unsharded-grads-on-accum"]),
    (0.05, ("torchtune",), ["--optimizer-in-backward", "--grad-accum", "1"]),
    (0.04, None, ["--paged-optimizer"]),
    (0.06, ("torchtune",), ["--activation-offloading"]),
    (0.05, None, ["--fused-linear-cross-entropy"]),
    (0.05, ("zeroplan",), ["--fused-cross-entropy"]),
    (0.05, ("hf",), ["--use-cache"]),
    (0.05, ("hf",), ["--keep-outputs"]),
    (0.05, ("hf", "zeroplan"), ["--checkpoint-reentrant"]),
    (0.05, ("torchtitan",), ["--unchunked-loss"]),
    (0.05, ("torchtitan",), ["--compile", "--float8", "--gpu", "h100-80gb"]),
    (0.03, ("torchtitan",), ["--compile", "--float8", "--gpu", "b200"]),
    (0.04, ("hf",), ["--compile"]),
    (0.05, None, ["--freeze-embeddings"]),
    (0.05, None, ["--frozen-blocks", "4"]),
    (0.04, None, ["--lora-rank", "16", "--dora"]),
    (0.03, ("hf",), ["--lora-rank", "8", "--quantize", "int8", "--strategies", "ddp"]),
    (0.05, None, ["--varying-lengths", "900,400,64,20000"]),
    (0.05, None, ["--cuda-context-mib", "1024"]),
    (0.04, None, ["--seq-len", "8192"]),
    (0.03, None, ["--seq-len", "16384", "--allow-longer-seq"]),
    (0.05, ("torchtune", "hf"), ["--activation-checkpointing", "full", "--checkpoint-reentrant"]),
)
"""Less common options the sweep adds now and then (the planner refuses those that do not apply)."""

PIPELINE_OPTIONS = (["--pp-schedule", "gpipe"], ["--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2"],
                    ["--pp-schedule", "zero-bubble"], ["--pp-schedule", "looped-bfs", "--virtual-stages", "2"])


DEEPSPEED_CHECKPOINTING = ("--partition-activations", "--checkpoint-in-cpu")
"""DeepSpeed's activation-checkpointing options (TrainingSpec.partition_activations, cpu_checkpointing)."""
DEEPSPEED_CHECKPOINTING_FRAMEWORKS = ("megatron-deepspeed", "zeroplan")
"""The profiles whose model calls deepspeed.checkpointing (the planner refuses the options elsewhere)."""
OFFLOAD_RATIOS = (0.1, 0.25, 0.5, 0.75, 0.9)
"""ZeRO-Offload++ ratios the sweep draws (and steps through in 13 offload-ratio, with 1.0)."""


def rare_options(rng: random.Random, framework: str, model: str) -> list[str]:
    out = []
    for probability, frameworks, flags in OPTIONS:
        if (frameworks is None or framework in frameworks) and rng.random() < probability:
            out += flags
    return out


def deepspeed_options(argv: list[str], framework: str) -> list[str]:
    """DeepSpeed's checkpointing options, ZeRO-Offload++'s ratio and hf's compiled LoRA, now and
    then, drawn from a generator seeded by the request's own flags, which takes no draw from the
    seed's generator."""
    rng = random.Random(shlex.join(argv))
    out = []
    if framework in DEEPSPEED_CHECKPOINTING_FRAMEWORKS and rng.random() < 0.1:
        out += ["--activation-checkpointing", "full",
                *rng.choice(([DEEPSPEED_CHECKPOINTING[0]], [DEEPSPEED_CHECKPOINTING[1]], list(DEEPSPEED_CHECKPOINTING)))]
    if framework in ("zeroplan", "hf") and rng.random() < 0.06:
        out += ["--strategies", rng.choice(("zero3-offload", "zero3-param-offload", "zero3-offload,zero3-param-offload")),
                "--offload-ratio", str(rng.choice(OFFLOAD_RATIOS))]
    if framework == "hf" and rng.random() < 0.05:
        # compiled_finetune_measured: hf's LoRA under torch.compile (ddp, bf16-mixed, no dropout),
        # measured without checkpointing only.
        out += ["--compile", "--lora-rank", str(rng.choice((8, 16, 64))), "--strategies", "ddp",
                "--precision", "bf16-mixed", "--activation-checkpointing", "none"]
    return out


HF_FSDP1_REFUSED = ("--lora-rank", "--quantize", "--dora", "--frozen-blocks", "--freeze-embeddings", "--compile",
                    "--float8", "--fused-linear-cross-entropy", "--fsdp-cpu-offload", "--hsdp-group", "--paged-optimizer")
"""Flags the sweep does not draw hf's FSDP1 with: what specs.request.check_hf_fsdp1 refuses, and
PEFT LoRA, which it plans (under FULL_SHARD) with the frozen base in its load dtype where FSDP2's
upcast makes it fp32: invariant 14 compares stored bytes with FSDP2's, which LoRA changes by design."""
HF_FSDP1_MODELS = ("tinyllama-1.1b", "llama-2-7b", "llama-3.1-8b", "mistral-7b", "llama-2-13b", "llama-2-70b",
                   "llama-3.1-70b")
"""The sweep's dense Llama-layout models (ModelSpec.is_dense_llama_layout), which hf's FSDP1 plans."""
MULTI_HEAD_MODELS = {"gpt2": (12, 1024), "gpt2-medium": (16, 1024), "llama-2-7b": (32, 4096), "llama-2-13b": (40, 4096)}
"""The sweep's decoders with as many key/value heads as query heads, each hidden / heads wide (the
shape of nn.MultiheadAttention and of Megatron-DeepSpeed's Ulysses attention): (heads, positions)."""
FULL_TRAINING_REFUSED = ("--lora-rank", "--quantize", "--dora", "--frozen-blocks", "--freeze-embeddings")
MODEL_PARALLEL_FLAGS = ("--tp", "--pp", "--cp")


def multi_head_argv(argv: list[str], rng: random.Random) -> list[str] | None:
    """argv on a multi-head model whose positions hold its sequence: its own model where it is
    one, else one drawn (None where none holds the sequence)."""
    seq = int(flag_value(argv, "--seq-len"))
    if argv[0] in MULTI_HEAD_MODELS:
        return argv if seq <= MULTI_HEAD_MODELS[argv[0]][1] else None
    fitting = [m for m, (_, positions) in MULTI_HEAD_MODELS.items() if seq <= positions]
    return [rng.choice(fitting), *argv[1:]] if fitting else None


def new_input_options(argv: list[str], framework: str) -> list[str]:
    """hf under accelerate's FSDP1, DeepSpeed-Ulysses and torch's nn.MultiheadAttention under
    ZeRO-3, each where it can apply (what each was measured for; otherwise refused), drawn from a
    generator seeded by the request's own flags (no draw from the seed's generator). Ulysses and
    the MHA flag take a multi-head model in place of the drawn one where it is not one."""
    rng = random.Random("new inputs " + shlex.join(argv))
    if (framework == "hf" and argv[0] in HF_FSDP1_MODELS and not any(f in argv for f in HF_FSDP1_REFUSED)
            and not flag_value(argv, "--gpu").startswith("v100") and rng.random() < 0.5):
        # check_hf_fsdp1: bf16-mixed (a V100 has no bf16) full fine-tuning, FULL_SHARD or
        # SHARD_GRAD_OP; one micro-batch a step (accumulating, FSDP1 keeps the unsharded gradients
        # to the last micro-batch under the Trainer's no_sync, which invariant 14's comparison of
        # stored bytes with FSDP2 would count against it).
        argv = with_flag(with_flag(argv, "--grad-accum", "1"), "--precision", None)
        argv = with_flag(argv, "--strategies", rng.choice(("fsdp-full-shard,fsdp-shard-grad-op", "fsdp-full-shard",
                                                           "fsdp-shard-grad-op")))
        return [*argv, "--fsdp-version", "1"]
    full_training = not any(f in argv for f in FULL_TRAINING_REFUSED)
    if framework == "megatron-deepspeed" and full_training and rng.random() < 0.6:
        # check_ulysses: tp = pp = 1, P dividing the heads, the sequence and the GPUs; none or full
        # recomputation (check_ulysses_training).
        mha = multi_head_argv(argv, rng)
        gpus = int(flag_value(argv, "--gpus"))
        degrees = [p for p in (2, 4, 8) if mha and MULTI_HEAD_MODELS[mha[0]][0] % p == 0 and gpus % p == 0]
        if degrees:
            if flag_value(mha, "--activation-checkpointing") == "selective":
                mha = with_flag(mha, "--activation-checkpointing", rng.choice(("none", "full")))
            return [*mha, "--cp", str(rng.choice(degrees))]
    if (framework == "zeroplan" and full_training and not any(f in argv for f in MODEL_PARALLEL_FLAGS)
            and (argv[0] in MULTI_HEAD_MODELS or rng.random() < 0.3) and rng.random() < 0.6):
        # check_torch_multihead_attention: full training without tp, cp or pp; pinned only under
        # DeepSpeed's plain ZeRO-3 gathers (the deepspeed state convention), asked mostly there.
        mha = multi_head_argv(argv, rng)
        if mha:
            mha = with_flag(mha, "--strategies", rng.choice(("zero3", "zero3,zero3-offload,zero3-param-offload",
                                                             "zero3,zero3-hpz,zero3-mics", "zero2,zero3")))
            if rng.random() < 0.75:
                mha = with_flag(mha, "--state-convention", "deepspeed")
            return [*mha, "--torch-multihead-attention"]
    return argv


DEVICE_MAPS = ("auto", "balanced", "sequential")
DEVICE_MAP_REFUSED_SWITCHES = ("--compile", "--fsdp-cpu-offload", "--keep-unsharded-grads-on-accum")
"""What check_device_map refuses beside a device map (the sweep draws none of it there, mostly)."""
MUON_STRATEGIES = {"zeroplan": (("ddp",), ("zero1,zero2", "deepspeed")), "hf": (("ddp",), ("zero1,zero2",), ("ddp,zero1,zero2",))}
"""Where check_muon plans Muon: torch's beside AdamW under DDP, DeepSpeed's MuonWithAuxAdam under
ZeRO-1/2 (the deepspeed state convention): (strategies, state convention) by framework."""
MODEL_PARALLEL_SWITCHES = ("--no-sequence-parallel", "--async-tp", "--sequence-parallel")
ZERO3_STRATEGIES = ("zero3", "zero3,zero3-offload,zero3-param-offload", "zero3,zero3-hpz,zero3-mics", "zero2,zero3")


def without(argv: list[str], switches: tuple[str, ...] = (), flags: tuple[str, ...] = ()) -> list[str]:
    """argv without the ``switches`` and the value ``flags`` (each with its value)."""
    argv = [t for t in argv if t not in switches]
    for flag in flags:
        argv = with_flag(argv, flag, None)
    return argv


def newest_input_options(argv: list[str], framework: str) -> list[str]:
    """hf's --device-map and --model-load, --optimizer muon (zeroplan, hf) and
    --deepspeed-torch-linear (zeroplan), drawn from a generator seeded by the request's own flags
    (no draw from the seed's generator), at most one a request and none beside hf's FSDP1 or the
    MHA flag. Four in five are fitted to where the planner models them (its refusals are drawn too,
    and must be one line naming the field)."""
    if "--fsdp-version" in argv or "--torch-multihead-attention" in argv:
        return argv
    rng = random.Random("newest inputs " + shlex.join(argv))
    draw, fitted = rng.random(), rng.random() < 0.8
    if framework == "hf" and draw < 0.2:
        # check_device_map: LoRA/QLoRA (none, nf4 or int8), one replica ('ddp') of one process
        # driving the GPUs of one node; no compile, offload or optimizer in backward.
        if fitted:
            argv = without(argv, DEVICE_MAP_REFUSED_SWITCHES, ("--hsdp-group", "--offload-ratio", "--strategies"))
            if "--lora-rank" not in argv:
                argv += ["--lora-rank", str(rng.choice((8, 16)))]
            if int(flag_value(argv, "--gpus")) > 8:
                argv = with_flag(argv, "--gpus", str(rng.choice((2, 4, 8))))
            argv += ["--strategies", "ddp"]
        return [*argv, "--device-map", rng.choice(DEVICE_MAPS)]
    if framework == "hf" and draw < 0.4:
        # check_model_load: no quantized base; --strategies naming a DeepSpeed ZeRO-3 strategy.
        if fitted:
            argv = without(argv, flags=("--quantize",))
            if rng.random() < 0.5:
                argv = with_flag(argv, "--strategies", rng.choice(ZERO3_STRATEGIES[:2] + ZERO3_STRATEGIES[3:]))
            if rng.random() < 0.3:
                # fp32 keeps peft's adapters fp32 under either load: the loads' steps then compare.
                argv = with_flag(argv, "--precision", "fp32")
        return [*argv, "--model-load", rng.choice(("sharded", "full-per-rank", "full-per-rank"))]
    if framework in MUON_STRATEGIES and (draw < 0.5 if framework == "hf" else draw < 0.1):
        # check_muon: DDP, or ZeRO-1/2 under DeepSpeed's convention; whole matrices (no tp, pp
        # or ep); the optimizer on the GPU after the backward.
        if fitted:
            argv = without(argv, ("--paged-optimizer", "--fsdp-cpu-offload", *MODEL_PARALLEL_SWITCHES),
                           ("--tp", "--pp", "--cp", "--ep", "--pp-schedule", "--virtual-stages", "--offload-ratio",
                            "--hsdp-group"))
            strategies, *convention = rng.choice(MUON_STRATEGIES[framework])
            argv = with_flag(argv, "--strategies", strategies)
            if convention:
                argv = with_flag(argv, "--state-convention", convention[0])
        return with_flag(argv, "--optimizer", "muon")
    if framework == "zeroplan" and draw < 0.3:
        # Pinned only under DeepSpeed's plain ZeRO-3 gathers (the deepspeed state convention),
        # asked mostly there.
        if fitted:
            argv = with_flag(argv, "--strategies", rng.choice(ZERO3_STRATEGIES))
            if rng.random() < 0.75:
                argv = with_flag(argv, "--state-convention", "deepspeed")
        return [*argv, "--deepspeed-torch-linear"]
    return argv


DPO_REFUSED_SWITCHES = ("--keep-outputs", "--compile", "--activation-offloading", "--optimizer-in-backward",
                        "--fused-linear-cross-entropy", "--unchunked-loss", "--float8", "--checkpoint-reentrant",
                        *MODEL_PARALLEL_SWITCHES)
"""What check_dpo_request refuses beside --objective dpo (with tp, cp, pp and ep above 1), and the
reentrant checkpoint, which torchtune's recipes do not take."""


def objective_and_loss_options(argv: list[str], framework: str) -> list[str]:
    """torchtune's LoRA DPO (--objective dpo), --padded-batches and zeroplan's --uncast-loss, drawn
    from a generator seeded by the request's own flags (no draw from the seed's generator). Four
    in five DPO requests are fitted to what check_dpo_request plans (LoRA, no model parallelism,
    none of its refused switches, an even micro-batch: rows of chosen and rejected pairs); the
    rest are drawn as they come, so its refusals are asked too."""
    rng = random.Random("objective and loss " + shlex.join(argv))
    if framework == "torchtune" and rng.random() < 0.5:
        if rng.random() < 0.8:
            argv = without(argv, DPO_REFUSED_SWITCHES, ("--tp", "--pp", "--cp", "--ep", "--pp-schedule", "--virtual-stages"))
            if "--lora-rank" not in argv:
                argv += ["--lora-rank", str(rng.choice((8, 16)))]
            micro = int(flag_value(argv, "--micro-batch"))
            argv = with_flag(argv, "--micro-batch", str(micro + micro % 2))
        argv += ["--objective", "dpo"]
    if rng.random() < (0.25 if framework == "hf" else 0.08):
        argv += ["--padded-batches", rng.choice(("yes", "no"))]
    if framework == "zeroplan" and rng.random() < 0.15:
        argv = [t for t in argv if t != "--fused-cross-entropy"] + ["--uncast-loss"]
    return argv


ROOT = Path(__file__).resolve().parents[1]
MOE_CONFIGS = ("tests/fixtures/hf/qwen3-30b-a3b.json", "tests/fixtures/hf/deepseek-v2-lite.json",
               "tests/fixtures/hf/qwen1.5-moe-a2.7b.json")
"""Mixture-of-experts models beside the Mixtral preset, from their Hugging Face configs (torchtitan
builds Qwen3-MoE and DeepSeek's, not Mixtral's)."""


def moe_argv(rng: random.Random) -> list[str]:
    """A mixture-of-experts model under expert parallelism (zeroplan or torchtitan) or Hugging
    Face's data parallelism."""
    framework = rng.choice(("zeroplan", "torchtitan", "torchtitan", "hf"))
    models = ("mixtral-8x7b", *MOE_CONFIGS) if framework != "torchtitan" else MOE_CONFIGS[:2]
    model = rng.choice(models)
    gpus = rng.choice((8, 16, 32))
    argv = [str(ROOT / model) if model.endswith(".json") else model, "--framework", framework,
            "--gpu", rng.choice(("a100-80gb", "h100-80gb", "h200-141gb", "b200", "mi300x")), "--gpus", str(gpus),
            "--micro-batch", str(rng.choice((1, 2, 4))), "--seq-len", str(rng.choice((1024, 2048, 4096))),
            "--grad-accum", str(rng.choice((1, 2))),
            "--activation-checkpointing", rng.choice(("none", "full", "selective"))]
    if framework != "hf":
        argv += ["--ep", str(rng.choice((1, 2, 4, 8)))]
        if rng.random() < 0.2:
            argv = with_flag(argv + ["--pp", "2"], "--grad-accum", str(rng.choice((2, 4))))
    if framework == "torchtitan" and rng.random() < 0.2:
        argv += ["--fsdp-cpu-offload"]
    return argv


@functools.cache
def framework_accepts(framework: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The sweep's models and checkpointing modes the framework's profile plans (it refuses the others)."""
    def accepted(argv: list[str]) -> bool:
        try:
            request_from_args(PARSER.parse_args(argv))
        except ZeroplanError:
            return False
        return True

    models = tuple(m for m in SMALL_MODELS + MID_MODELS + LARGE_MODELS if accepted([m, "--framework", framework]))
    modes = tuple(c for c in CHECKPOINTING if models and accepted([models[0], "--framework", framework,
                                                                   "--activation-checkpointing", c]))
    return models, modes


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="zeroplan fit")
    add_fit_arguments(parser)
    return parser


PARSER = _parser()


def with_flag(argv: list[str], flag: str, value: str | None) -> list[str]:
    """argv with ``flag`` set to ``value`` ("" for a switch; None removes it)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == flag:
            skip = flag not in SWITCHES
        else:
            out.append(token)
    return out + ([flag] if value == "" else [flag, value] if value is not None else [])


SWITCHES = ("--flat-reserve", "--fsdp-cpu-offload", "--compile", "--torch-multihead-attention", "--deepspeed-torch-linear",
            "--paged-optimizer", "--keep-unsharded-grads-on-accum", "--uncast-loss", "--keep-outputs", "--exact-allocator",
            *MODEL_PARALLEL_SWITCHES, *DEEPSPEED_CHECKPOINTING)


def flag_value(argv: list[str], flag: str) -> str | None:
    value = None
    for i, token in enumerate(argv[:-1]):
        if token == flag:
            value = argv[i + 1]
    return value


def command_line(argv: list[str], strategies: str | None = None) -> str:
    """The command that reproduces ``argv`` from the repository's root."""
    argv = with_flag(argv, "--strategies", strategies) if strategies else argv
    return "zeroplan fit " + shlex.join(t.removeprefix(f"{ROOT}/") for t in argv)


class Refused(Exception):
    """The request was refused in one line (a user's error), as the command line would refuse it."""


@dataclass
class Sweep:
    checked: Counter = field(default_factory=Counter)
    violations: dict[str, list[str]] = field(default_factory=lambda: {name: [] for name in INVARIANTS})
    refused: Counter = field(default_factory=Counter)
    requests: int = 0
    answered: list[tuple[list[str], object]] = field(default_factory=list)

    def check(self, invariant: str, holds: bool, what: str) -> None:
        self.checked[invariant] += 1
        if not holds:
            self.violations[invariant].append(what)


def build(argv: list[str], sweep: Sweep):
    """The request the flags describe; Refused where the planner refuses it in one line, and a
    determinism (7) violation where anything else is raised or the line is not one line."""
    try:
        args = PARSER.parse_args(argv)
        check_options_apply(args)
        kinds = strategies_asked(args)
        check_offload_ratio(args, kinds)
        # As the command builds it: a ratio's base request is a strategy it applies to.
        return request_from_args(args, kinds[0]) if args.offload_ratio is not None else request_from_args(args)
    except SystemExit:
        raise Refused("argparse") from None
    except (ZeroplanError, ValidationError) as error:
        _one_line(error, argv, sweep)
        raise Refused(getattr(error, "field", "validation")) from None
    except Exception:
        sweep.check(INVARIANTS[6], False, f"traceback building the request: {_last_line()}\n    {command_line(argv)}")
        raise Refused("traceback") from None


def answer(call, argv: list[str], sweep: Sweep, strategies: str | None = None):
    """call() (a fit or plan of the request), with the same rule for refusals as build."""
    try:
        return call()
    except (ZeroplanError, ValidationError) as error:
        _one_line(error, argv, sweep, strategies)
        raise Refused(getattr(error, "field", "validation")) from None
    except Exception:
        sweep.check(INVARIANTS[6], False, f"traceback answering: {_last_line()}\n    {command_line(argv, strategies)}")
        raise Refused("traceback") from None


def _one_line(error: Exception, argv: list[str], sweep: Sweep, strategies: str | None = None) -> None:
    text = str(error) if isinstance(error, ZeroplanError) else _first_validation_line(error)
    sweep.check(INVARIANTS[6], "\n" not in text.strip(), f"refusal of more than one line: {text!r}\n    "
                f"{command_line(argv, strategies)}")


def _first_validation_line(error: ValidationError) -> str:
    from zeroplan.specs.base import first_error

    return first_error(error)


def _last_line() -> str:
    return traceback.format_exc().strip().splitlines()[-1]


def fit_plans(argv: list[str], sweep: Sweep, strategies: tuple[str, ...] | None = None) -> dict[str, object]:
    """{strategy: StrategyPlan} of fit on argv without the largest micro-batch or step time."""
    request = build(argv, sweep)
    kinds = tuple(StrategyKind(s) for s in strategies) if strategies else None
    report = answer(lambda: fit(request, kinds, suggest=False, largest_micro_batch=False, timed=False), argv, sweep)
    return {p.strategy.value: p for p in report.plans}


def allocated_peak(request) -> int:
    """The highest allocated peak over every pipeline rank."""
    return max(b.allocated_peak_bytes for b, _ in pipeline_rank_breakdowns(request))


def state_bytes(p) -> int:
    m = p.memory
    return m.parameter_bytes + m.gradient_bytes + m.optimizer_state_bytes


def gib(value: int) -> str:
    return f"{value / 2**30:.3f} GiB"


def check_request(argv: list[str], rng: random.Random, sweep: Sweep, search_share: float = 0.25) -> None:
    request = build(argv, sweep)
    named = answer(lambda: parse_strategies(flag_value(argv, "--strategies")), argv, sweep)
    report = answer(lambda: fit(request, named, suggest=False), argv, sweep)
    sweep.answered.append((argv, report))
    plans = {p.strategy.value: p for p in report.plans}
    names = ",".join(plans)
    _check_reserved(argv, plans, sweep)
    _check_plan_vs_fit(argv, request, plans, sweep)
    _check_max_micro_batch(argv, request, plans, sweep)
    _check_state_order(argv, plans, sweep, request)
    _check_margin(argv, plans, sweep)
    checks = [_check_bigger_gpu, _check_growth, _check_checkpointing, _check_activation_offloading,
              _check_offload_policy, _check_scale_out, _check_precision, _check_step_time, _check_adapter_rank,
              _check_deepspeed_checkpointing, _check_offload_ratio, _check_hf_fsdp1, _check_ulysses,
              _check_multihead_attention_views, _check_device_map, _check_muon, _check_torch_linear,
              _check_model_load, _check_dpo, _check_padded_batches, _check_loss_options, _check_exact_allocator,
              _check_checkpointing_peak, _check_accumulation_states, _check_verdict_figures, _check_round_trip,
              _check_command_line]
    if rng.random() < search_share:
        checks.append(_check_search)
    for check in checks:
        try:
            check(argv, names, plans, sweep)
        except Refused as refusal:
            sweep.refused[f"variant: {refusal}"] += 1


def _check_reserved(argv, plans, sweep) -> None:
    for name, p in plans.items():
        m = p.memory
        sweep.check(INVARIANTS[1], m.peak_bytes >= m.allocated_peak_bytes and
                    (m.reserved_peak_bytes is None or m.reserved_peak_bytes >= m.allocated_peak_bytes),
                    f"{name}: reserved {m.reserved_peak_bytes} / peak {m.peak_bytes} below allocated "
                    f"{m.allocated_peak_bytes}\n    {command_line(argv, name)}")


def _check_plan_vs_fit(argv, request, plans, sweep) -> None:
    for name, p in plans.items():
        alone = answer(lambda: plan(request.with_strategy(request.strategy.model_copy(update={"kind": StrategyKind(name)}))),
                       argv, sweep, name)
        same = (alone.fits, alone.memory.peak_bytes, alone.max_micro_batch_size) == (p.fits, p.memory.peak_bytes,
                                                                                      p.max_micro_batch_size)
        sweep.check(INVARIANTS[5], same, f"{name}: plan() fits {alone.fits} peak {alone.memory.peak_bytes} max-mb "
                    f"{alone.max_micro_batch_size}; fit() fits {p.fits} peak {p.memory.peak_bytes} max-mb "
                    f"{p.max_micro_batch_size}\n    {command_line(argv, name)}")


def _check_max_micro_batch(argv, request, plans, sweep) -> None:
    for name, p in plans.items():
        largest = p.max_micro_batch_size
        at = request.with_strategy(request.strategy.model_copy(update={"kind": StrategyKind(name)}))
        if largest >= 1:
            fits = answer(lambda: plan(at.with_micro_batch(largest), False, False).fits, argv, sweep, name)
            sweep.check(INVARIANTS[4], fits, f"{name}: max-mb {largest} does not fit\n    "
                        f"{command_line(with_flag(argv, '--micro-batch', str(largest)), name)}")
        # Below it, every micro-batch fits too: under the flat reserve the peak is the allocated
        # peak plus a share of it, which grows with the micro-batch; under the allocator model a
        # replay need not complete below one that completes (when its device allocations fail it
        # frees its cache and retries, and how tightly the step then packs moves with the
        # micro-batch), and max-mb is the largest below which none runs out (a random one below,
        # and the one just below, where a replay that retried is likeliest).
        # Under DPO only even row counts run (22 dpo): those below are the ones checked.
        step = micro_batch_step(argv)
        if largest >= 2 * step:
            below = {step * random.Random(largest * 7919 + len(argv)).randint(1, largest // step - 1)}
            if p.memory.allocator_modelled:
                below.add(largest - step)
            for smaller in sorted(below):
                fits = answer(lambda: plan(at.with_micro_batch(smaller), False, False).fits, argv, sweep, name)
                sweep.check(INVARIANTS[4], fits, f"{name}: max-mb {largest} but {smaller} does not fit\n    "
                            f"{command_line(with_flag(argv, '--micro-batch', str(smaller)), name)}")
        # Under DPO max-mb counts rows of whole pairs (plan.max_micro_batch_size rounds down to
        # even): the next is two rows on, and it is even itself (22 dpo).
        if step == 2:
            sweep.check(INVARIANTS[21], largest % 2 == 0, f"{name}: max-mb {largest} under --objective dpo is odd\n    "
                        f"{command_line(argv, name)}")
        if largest < 256:
            over = answer(lambda: plan(at.with_micro_batch(largest + step), False, False).fits, argv, sweep, name)
            sweep.check(INVARIANTS[4], not over, f"{name}: max-mb {largest} but {largest + step} fits\n    "
                        f"{command_line(with_flag(argv, '--micro-batch', str(largest + step)), name)}")


CROSS_ENGINE = {("ddp", "zero1"), ("ddp", "fsdp-shard-grad-op")}
"""Pairs whose two strategies run in different engines, each with its own layout of the
unsharded states: compared only where there are two data-parallel ranks or more to shard over.
On one rank nothing is sharded and the layouts differ by mechanism: DeepSpeed's bf16 ZeRO-1 keeps
bf16 parameters, an fp32 gradient partition and fp32 master and moments (18 bytes a parameter)
where torch AMP's DDP keeps fp32 parameters and gradients and moments (16); megatron-core's
distributed optimizer pads each parameter's start in its buffer (a few bytes more than its DDP);
accelerate's fsdp2_prepare_model casts a LoRA's frozen bf16 base to fp32 under FSDP (4 bytes a
base element against DDP's 2)."""


def _check_state_order(argv, plans, sweep, request=None) -> None:
    """Under a pipeline each strategy's plan is its peak rank, not always the same one: there
    every pipeline rank's states are compared with the same rank's (``request`` given)."""
    for more, less in STATE_ORDER:
        if (more, less) in CROSS_ENGINE and plans.get(less) is not None and plans[less].shard_group_size < 2:
            continue
        if more in plans and less in plans:
            if request is not None and request.parallel.pp > 1:
                pairs = zip(rank_state_bytes(request, more), rank_state_bytes(request, less))
            else:
                pairs = [(state_bytes(plans[more]), state_bytes(plans[less]))]
            for a, b in pairs:
                sweep.check(INVARIANTS[2], a >= b, f"{more} {gib(a)} < {less} {gib(b)} of model states per GPU\n    "
                            f"{command_line(argv, f'{more},{less}')}")


def rank_state_bytes(request, kind: str) -> list[int]:
    """Every pipeline rank's model-state bytes under ``kind`` (on the flat reserve: the states
    do not depend on the allocator)."""
    from zeroplan.core.search import on_flat_reserve

    at = on_flat_reserve(request.with_strategy(request.strategy.model_copy(update={"kind": StrategyKind(kind)})))
    return [b.parameter_bytes + b.gradient_bytes + b.optimizer_state_bytes for b, _ in pipeline_rank_breakdowns(at)]


def holds_with_more_memory(larger) -> bool:
    """What a plan on more memory must say where the same request fits on less: fits, or, under
    the allocator model only, a borderline OOM. PyTorch's caching allocator frees its cache when a
    cudaMalloc is refused and retries (c10/cuda/CUDACachingAllocator.cpp, malloc), and when that
    comes decides how the rest of the step packs, so a step may complete on less memory and run
    out on more; the planner must then not say OOM with confidence (StrategyPlan.borderline).
    Under the flat reserve the peak does not depend on the memory: fits, always."""
    return larger.fits or (larger.memory.allocator_modelled and larger.borderline)


def _check_bigger_gpu(argv, names, plans, sweep) -> None:
    gpu = flag_value(argv, "--gpu")
    bigger = with_flag(argv, "--gpu", LARGER_SIBLING[gpu]) if gpu in LARGER_SIBLING else None
    variants = [bigger] if bigger else []
    # The same GPU with 8 GiB more memory (--gpu-memory-gib): more memory alone.
    from zeroplan.presets.gpus import get_gpu

    variants.append(with_flag(argv, "--gpu-memory-gib", f"{get_gpu(gpu).memory_bytes / 2**30 + 8:g}"))
    # Near the boundary: the GPU shrunk until the strategy with the least headroom only just
    # fits, then a little more memory (where a replay of the caching allocator is least settled).
    fitting = [p for p in plans.values() if p.fits]
    if fitting:
        tight = min(fitting, key=lambda p: p.headroom_bytes)
        rng = random.Random(len(variants) + tight.memory.peak_bytes)
        memory_gib = (get_gpu(gpu).memory_bytes - tight.headroom_bytes) / 2**30 + rng.uniform(0.0, 0.25)
        near = with_flag(argv, "--gpu-memory-gib", f"{memory_gib:.4f}")
        try:
            small = fit_plans(near, sweep, tuple(plans))
        except Refused:
            small = {}
        _check_margin(near, small, sweep)
        for step_gib in (0.02, 0.1, 0.5):
            grown = with_flag(argv, "--gpu-memory-gib", f"{memory_gib + step_gib:.4f}")
            larger = fit_plans(grown, sweep, tuple(small))
            _check_margin(grown, larger, sweep)
            for name, p in small.items():
                sweep.check(INVARIANTS[0], not p.fits or holds_with_more_memory(larger[name]),
                            f"{name}: fits ({gib(p.memory.peak_bytes)} of {gib(p.usable_memory_bytes)}) but OOM with more "
                            f"memory ({gib(larger[name].memory.peak_bytes)} of {gib(larger[name].usable_memory_bytes)})\n"
                            f"    {command_line(near, name)}\n    {command_line(grown, name)}")
    for variant in variants:
        larger = fit_plans(variant, sweep, tuple(plans))
        for name, p in plans.items():
            if name in larger:
                sweep.check(INVARIANTS[0], not p.fits or holds_with_more_memory(larger[name]),
                            f"{name}: fits ({gib(p.memory.peak_bytes)} of {gib(p.usable_memory_bytes)}) but OOM with more "
                            f"memory ({gib(larger[name].memory.peak_bytes)} of {gib(larger[name].usable_memory_bytes)})\n"
                            f"    {command_line(argv, name)}\n    {command_line(variant, name)}")


def micro_batch_step(argv: list[str]) -> int:
    """The next micro-batch's step: one sample, or one pair of rows under DPO (the command
    refuses an odd row count there)."""
    return 2 if flag_value(argv, "--objective") == "dpo" else 1


def _check_growth(argv, names, plans, sweep) -> None:
    micro = int(flag_value(argv, "--micro-batch"))
    seq = int(flag_value(argv, "--seq-len"))
    accum = build(argv, sweep).batch.grad_accum_steps
    for flag, grown in (("--micro-batch", str(micro + micro_batch_step(argv))), ("--seq-len", str(seq * 2)), ("--grad-accum", str(accum * 2))):
        variant = with_flag(argv, flag, grown)
        try:
            request = build(variant, sweep)
        except Refused:
            continue  # e.g. a sequence past the model's positions
        base = build(argv, sweep)
        for name in plans:
            kind = StrategyKind(name)
            before = allocated_peak(base.with_strategy(base.strategy.model_copy(update={"kind": kind})))
            after = answer(lambda: allocated_peak(request.with_strategy(request.strategy.model_copy(update={"kind": kind}))),
                           variant, sweep, name)
            sweep.check(INVARIANTS[1], after >= before, f"{name}: allocated peak {gib(before)} -> {gib(after)} with "
                        f"{flag} {grown}\n    {command_line(argv, name)}\n    {command_line(variant, name)}")


def _check_checkpointing(argv, names, plans, sweep) -> None:
    full = fit_plans(with_flag(argv, "--activation-checkpointing", "full"), sweep, tuple(plans))
    for mode in CHECKPOINTING:
        if mode == "full":
            continue
        variant = with_flag(argv, "--activation-checkpointing", mode)
        try:
            other = fit_plans(variant, sweep, tuple(plans))
        except Refused:
            continue
        for name, p in full.items():
            if name in other:
                a, b = p.memory.activation_bytes, other[name].memory.activation_bytes
                sweep.check(INVARIANTS[3], a <= b, f"{name}: full {gib(a)} > {mode} {gib(b)} of activations\n    "
                            f"{command_line(with_flag(argv, '--activation-checkpointing', 'full'), name)}\n    "
                            f"{command_line(variant, name)}")


def _check_activation_offloading(argv, names, plans, sweep) -> None:
    """torchtune's activation offloading holds no more on the GPU at the allocated peak than the
    same request without it (pipeline rank by pipeline rank)."""
    if "--activation-offloading" not in argv:
        return
    plain_argv = [t for t in argv if t != "--activation-offloading"]

    def allocated_peaks(request, name: str) -> list[int]:  # type: ignore[no-untyped-def]
        return [b.allocated_peak_bytes for b, _ in pipeline_rank_breakdowns(_on_flat(request, StrategyKind(name)))]

    for name, _, offloaded, without in _beside_variant(argv, plain_argv, plans, sweep, allocated_peaks):
        for stage, (a, b) in enumerate(zip(offloaded, without)):
            sweep.check(INVARIANTS[3], a <= b, f"{name}: allocated peak {gib(a)} with --activation-offloading > "
                        f"{gib(b)} without (pipeline rank {stage})\n    {command_line(argv, name)}")


def _check_offload_policy(argv, names, plans, sweep) -> None:
    """FSDP's CPU offload holds no more model states on the GPU than the same FSDP strategy without it."""
    if "--fsdp-cpu-offload" not in argv:
        return
    plain_argv = [t for t in argv if t != "--fsdp-cpu-offload"]
    plain = fit_plans(plain_argv, sweep, tuple(name for name in plans))
    for name, p in plans.items():
        if name in plain:
            a, b = state_bytes(p), state_bytes(plain[name])
            sweep.check(INVARIANTS[2], a <= b, f"{name}: with --fsdp-cpu-offload {gib(a)} > {gib(b)} without\n    "
                        f"{command_line(argv, name)}")


def _check_scale_out(argv, names, plans, sweep) -> None:
    """Twice the GPUs: zero3's and fsdp-full-shard's model states per GPU do not grow (pipeline
    rank by pipeline rank)."""
    kinds = [name for name in SCALE_OUT_STRATEGIES if name in plans]
    if not kinds:
        return
    variant = with_flag(argv, "--gpus", str(2 * int(flag_value(argv, "--gpus"))))
    for name, _, before, after in _beside_variant(argv, variant, kinds, sweep, rank_state_bytes):
        for rank, (a, b) in enumerate(zip(before, after)):
            sweep.check(INVARIANTS[7], b <= a, f"{name}: model states {gib(a)} per GPU -> {gib(b)} on twice the GPUs "
                        f"(pipeline rank {rank})\n    {command_line(argv, name)}\n    {command_line(variant, name)}")


def _check_precision(argv, names, plans, sweep) -> None:
    """fp32 keeps no fewer model-state bytes per GPU than bf16-pure. Under a device map a plan's
    memory is its peak GPU's, which the precision can move to another GPU: there the GPUs' most
    parameter bytes are compared (_worst_gpu; the adapters' states are those of one process)."""
    full_argv, half_argv = with_flag(argv, "--precision", "fp32"), with_flag(argv, "--precision", "bf16-pure")
    try:
        full = fit_plans(full_argv, sweep, tuple(plans))
        half = fit_plans(half_argv, sweep, tuple(plans))
        mapped = (build(full_argv, sweep), build(half_argv, sweep)) if flag_value(argv, "--device-map") else None
    except Refused:
        return
    for name, p in half.items():
        if name in full:
            a, b = state_bytes(full[name]), state_bytes(p)
            if mapped is not None:
                a, b = (_worst_gpu(r, StrategyKind(name))[1] for r in mapped)
            sweep.check(INVARIANTS[8], a >= b, f"{name}: fp32 {gib(a)} < bf16-pure {gib(b)} of model states per GPU\n    "
                        f"{command_line(with_flag(argv, '--precision', 'fp32'), name)}\n    "
                        f"{command_line(with_flag(argv, '--precision', 'bf16-pure'), name)}")


def _check_step_time(argv, names, plans, sweep) -> None:
    """One more sample per micro-batch, twice the sequence or twice the micro-batches a step:
    the step takes no less time."""
    timed = {name: p.time.step_with_overlap_s for name, p in plans.items() if p.time is not None}
    if not timed:
        return
    micro = int(flag_value(argv, "--micro-batch"))
    seq = int(flag_value(argv, "--seq-len"))
    accum = build(argv, sweep).batch.grad_accum_steps
    for flag, grown in (("--micro-batch", str(micro + micro_batch_step(argv))), ("--seq-len", str(seq * 2)),
                        ("--grad-accum", str(2 * accum))):
        variant = with_flag(argv, flag, grown)
        try:
            request = build(variant, sweep)
            kinds = tuple(StrategyKind(name) for name in timed)
            report = answer(lambda: fit(request, kinds, suggest=False, largest_micro_batch=False), variant, sweep)
        except Refused:
            continue  # e.g. a sequence past the model's positions
        for p in report.plans:
            before, after = timed[p.strategy.value], p.time.step_with_overlap_s if p.time else None
            if after is not None:
                # Equal where the step is bound by communication alone: summed in another order.
                sweep.check(INVARIANTS[9], after >= before * (1 - 1e-12), f"{p.strategy.value}: step {before:.4f} s -> {after:.4f} s "
                            f"with {flag} {grown}\n    {command_line(argv, p.strategy.value)}\n    "
                            f"{command_line(variant, p.strategy.value)}")


def _check_adapter_rank(argv, names, plans, sweep) -> None:
    """Twice the LoRA rank: model-state bytes per GPU do not fall, nor the allocated peak where
    DeepSpeed's ZeRO-3 coordinator does not gather (pipeline rank by pipeline rank). Its
    prefetch takes whole parameters until stage3_prefetch_bucket_size elements are in flight
    (DeepSpeed 0.19.8 partitioned_param_coordinator.py fetch_sub_module; core.deepspeed_coordinator),
    so larger adapters, more elements for their bytes, leave base weights out of the window:
    Qwen2.5-3B LoRA under hf zero3-offload on 8 MI300X (micro-batch 1, s 512) gathers at most
    2.637, 2.617, 2.602 and 2.622 GB at ranks 32 to 256, and 1.021 to 1.027 GB, rising, with
    no prefetch."""
    rank = flag_value(argv, "--lora-rank")
    # bitsandbytes pages the states of a tensor of at least 1e5 elements (get_state_buffer):
    # doubling the rank takes an adapter past it and its states off the GPU (Llama-2-13B LoRA
    # under litgpt on one H200, --paged-optimizer: allocated peak 25.787 GiB at rank 16, 25.762
    # at 32, each 5,120 x 16 adapter matrix's states paged only at 32).
    if rank is None or "--paged-optimizer" in argv:
        return
    variant = with_flag(argv, "--lora-rank", str(2 * int(rank)))

    def states_and_peaks(request, name: str) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
        return [(b.parameter_bytes + b.gradient_bytes + b.optimizer_state_bytes, b.allocated_peak_bytes)
                for b, _ in pipeline_rank_breakdowns(_on_flat(request, StrategyKind(name)))]

    from zeroplan.core.deepspeed_coordinator import replays_gathers

    for name, request, before, after in _beside_variant(argv, variant, plans, sweep, states_and_peaks):
        kind = StrategyKind(name)
        prefetches = replays_gathers(request.with_strategy(request.strategy.model_copy(update={"kind": kind})))
        for stage, ((states_a, peak_a), (states_b, peak_b)) in enumerate(zip(before, after)):
            sweep.check(INVARIANTS[10], states_b >= states_a and (prefetches or peak_b >= peak_a),
                        f"{name}: model states {gib(states_a)} -> {gib(states_b)}, allocated peak {gib(peak_a)} -> "
                        f"{gib(peak_b)} at twice the LoRA rank (pipeline rank {stage})\n    {command_line(argv, name)}\n    "
                        f"{command_line(variant, name)}")


def _check_deepspeed_checkpointing(argv, names, plans, sweep) -> None:
    """Each of DeepSpeed's checkpointing options the request names against the same request
    without it (the other option as it is): the allocated peak no higher on any pipeline rank,
    the step no shorter, and, with the checkpoints on the host, no fewer host bytes per rank."""
    for flag in DEEPSPEED_CHECKPOINTING:
        if flag not in argv:
            continue
        without = [t for t in argv if t != flag]
        try:
            request = build(without, sweep)
            kinds = tuple(StrategyKind(name) for name in plans)
            report = answer(lambda: fit(request, kinds, suggest=False, largest_micro_batch=False), without, sweep)
        except Refused:
            continue
        plain = {p.strategy.value: p for p in report.plans}

        def allocated_peaks(request, name: str) -> list[int]:  # type: ignore[no-untyped-def]
            return [b.allocated_peak_bytes for b, _ in pipeline_rank_breakdowns(_on_flat(request, StrategyKind(name)))]

        for name, _, with_it, without_it in _beside_variant(argv, without, [n for n in plans if n in plain], sweep,
                                                              allocated_peaks):
            lines = f"    {command_line(argv, name)}\n    {command_line(without, name)}"
            for stage, (a, b) in enumerate(zip(with_it, without_it)):
                sweep.check(INVARIANTS[11], a <= b, f"{name}: allocated peak {gib(a)} with {flag} > {gib(b)} without "
                            f"(pipeline rank {stage})\n{lines}")
            p, q = plans[name], plain[name]
            if p.time is not None and q.time is not None and not partitions_host_copies(flag, argv):
                a_s, b_s = p.time.step_with_overlap_s, q.time.step_with_overlap_s
                sweep.check(INVARIANTS[11], a_s >= b_s * (1 - 1e-12), f"{name}: step {a_s:.4f} s with {flag} < "
                            f"{b_s:.4f} s without\n{lines}")
            if flag == "--checkpoint-in-cpu":
                a, b = p.host_bytes_per_rank, q.host_bytes_per_rank
                sweep.check(INVARIANTS[11], a >= b, f"{name}: host {gib(a)} per rank with {flag} < {gib(b)} without\n"
                            f"{lines}")


def partitions_host_copies(flag: str, argv: list[str]) -> bool:
    """Whether taking ``flag`` away changes how the checkpoints cross the host link: with
    --checkpoint-in-cpu, --partition-activations sends each block's 1/tp partition to the host
    and back, blocking (DeepSpeed 0.19.8 checkpointing.py lines 436 and 702), where without it the
    offload engine sends the whole input, hidden going out and exposed coming back for all but
    two blocks (offload_activations.py lines 183-210, 262-275;
    core.deepspeed_checkpointing.exposed_host_copy_bytes): 2/tp of a block's input against (blocks
    - 2)/blocks, fewer above tp 2, so the step may be shorter with both options than with the host
    alone: its time is not compared there (its allocated peak and host bytes still are)."""
    return flag == "--partition-activations" and "--checkpoint-in-cpu" in argv


def _check_offload_ratio(argv, names, plans, sweep) -> None:
    """ZeRO-Offload++'s ratio: 1.0 answers as no ratio (fit's every figure); and, strategy by
    strategy, at DeepSpeed's default sub_group_size and at sizes that cut the rank's partition
    into 3 and 8 sub-groups (a --deepspeed-config file's zero_optimization.sub_group_size), each
    smaller ratio of OFFLOAD_RATIOS keeps no fewer model-state bytes on the GPU and no more on the
    host (on the flat reserve: the states do not depend on the allocator)."""
    ratio = flag_value(argv, "--offload-ratio")
    if ratio is None:
        return
    one, none = with_flag(argv, "--offload-ratio", "1"), with_flag(argv, "--offload-ratio", None)
    kinds = tuple(StrategyKind(name) for name in plans)
    try:
        at_one = answer(lambda: fit(build(one, sweep), kinds, suggest=False), one, sweep)
        at_none = answer(lambda: fit(build(none, sweep), kinds, suggest=False), none, sweep)
    except Refused:
        at_one = at_none = None
    if at_one is not None:
        for p, q in zip(at_one.plans, at_none.plans):
            sweep.check(INVARIANTS[12], p.model_dump() == q.model_dump(), f"{p.strategy.value}: --offload-ratio 1 "
                        f"answers otherwise than no ratio\n    {command_line(one, p.strategy.value)}\n    "
                        f"{command_line(none, p.strategy.value)}")
    from zeroplan.core.nvme import sub_group_partition_elements

    request = build(argv, sweep)
    for name in plans:
        base = _on_flat(request, StrategyKind(name))
        total = sum(sub_group_partition_elements(base))
        sizes = sorted({base.strategy.deepspeed_sub_group_elements, max(1, -(-total // 3)), max(1, -(-total // 8))})
        for size in sizes:
            figures = []
            for r in sorted({float(ratio), *OFFLOAD_RATIOS, 1.0}):
                at = base.with_strategy(base.strategy.model_copy(
                    update={"offload_optimizer_ratio": r, "deepspeed_sub_group_elements": size}))
                p = answer(lambda: plan(at, False, False), argv, sweep, name)
                figures.append((r, state_bytes(p), p.host_bytes_per_rank))
            for (r_a, gpu_a, host_a), (r_b, gpu_b, host_b) in zip(figures, figures[1:]):
                sweep.check(INVARIANTS[12], gpu_a >= gpu_b and host_a <= host_b,
                            f"{name}: ratio {r_a:g}: {gib(gpu_a)} model states on the GPU, {gib(host_a)} host per rank; "
                            f"ratio {r_b:g}: {gib(gpu_b)}, {gib(host_b)} (sub_group_size {size})\n    "
                            f"{command_line(with_flag(argv, '--offload-ratio', f'{r_a:g}'), name)}")


def _check_hf_fsdp1(argv, names, plans, sweep) -> None:
    """hf under accelerate's FSDP1 against FSDP2 (the request without --fsdp-version): what the
    FSDP1 module adds (its root kept gathered, the cat of the root's gradients at backward's end,
    no unit prefetched: buffers._fsdp1_root_cats_gradients, PlanRequest._accelerate_fsdp1_settings)
    moves when bytes are gathered, never what is stored; the kept root is not gathered again in
    backward (communication: fsdp1_root_stays_gathered), so no more is sent."""
    if flag_value(argv, "--framework") != "hf" or flag_value(argv, "--fsdp-version") != "1":
        return
    fsdp2 = with_flag(argv, "--fsdp-version", None)
    other = fit_plans(fsdp2, sweep, tuple(plans))
    for name, p in plans.items():
        if name not in other:
            continue
        q = other[name]
        stored = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes")
        differ = [f"{f} {getattr(p.memory, f)} (FSDP1) vs {getattr(q.memory, f)} (FSDP2)" for f in stored
                  if getattr(p.memory, f) != getattr(q.memory, f)]
        if p.host_bytes_per_rank != q.host_bytes_per_rank:
            differ.append(f"host {p.host_bytes_per_rank} vs {q.host_bytes_per_rank}")
        if p.sent_bytes_per_step > q.sent_bytes_per_step:
            differ.append(f"sent {p.sent_bytes_per_step} > {q.sent_bytes_per_step} bytes a step")
        sweep.check(INVARIANTS[13], not differ, f"{name}: " + "; ".join(differ) + f"\n    {command_line(argv, name)}\n"
                    f"    {command_line(fsdp2, name)}")


def group_all_to_all_sent_bytes(p) -> int:
    """The bytes a step's all-to-alls send over the whole sequence-parallel group (each of its
    cp ranks sends the same)."""
    from zeroplan.core.collective import CollectiveOp

    sent = sum(c.sent_bytes_per_call_sum * c.occurrences_per_step for c in p.collectives if c.op is CollectiveOp.all_to_all)
    return sent * p.parallel.cp


def _check_ulysses(argv, names, plans, sweep) -> None:
    """DeepSpeed-Ulysses at cp 1, P and 2P (those answered), strategy by strategy: the rank's
    activation bytes never rise with the degree, the all-to-all bytes the sequence group sends
    never fall, and the model-state bytes stay as they are (DeepSpeed's optimizer shards over the
    dp x P sequence-data-parallel ranks: the same world at every P)."""
    cp = flag_value(argv, "--cp")
    if flag_value(argv, "--framework") != "megatron-deepspeed" or cp is None or int(cp) < 2:
        return
    answered = []
    for degree in (1, int(cp), 2 * int(cp)):
        variant = with_flag(argv, "--cp", str(degree))
        try:
            answered.append((variant, plans if degree == int(cp) else fit_plans(variant, sweep, tuple(plans))))
        except Refused:
            continue  # e.g. 2P not dividing the heads or the GPUs
    for (small_argv, small), (large_argv, large) in zip(answered, answered[1:]):
        for name, p in small.items():
            if name not in large:
                continue
            q = large[name]
            a, b = p.memory.activation_bytes, q.memory.activation_bytes
            sent_a, sent_b = group_all_to_all_sent_bytes(p), group_all_to_all_sent_bytes(q)
            sweep.check(INVARIANTS[14], b <= a and sent_b >= sent_a and state_bytes(p) == state_bytes(q),
                        f"{name}: cp {p.parallel.cp} -> {q.parallel.cp}: activations {gib(a)} -> {gib(b)}, all-to-all "
                        f"sent by the group {sent_a} -> {sent_b} bytes, model states {gib(state_bytes(p))} -> "
                        f"{gib(state_bytes(q))}\n    {command_line(small_argv, name)}\n    {command_line(large_argv, name)}")


def _check_multihead_attention_views(argv, names, plans, sweep) -> None:
    """--torch-multihead-attention against the same request without it: the allocated peak no
    lower (the pinned in-projections only add; on the flat reserve), and where nothing is pinned
    (deepspeed_mha_views.pins_in_projection) every memory figure the same."""
    if "--torch-multihead-attention" not in argv:
        return
    from zeroplan.core.deepspeed_mha_views import pins_in_projection

    without = with_flag(argv, "--torch-multihead-attention", None)
    other = fit_plans(without, sweep, tuple(plans))
    request = build(argv, sweep)
    base = build(without, sweep)
    for name, p in plans.items():
        if name not in other:
            continue
        kind = StrategyKind(name)
        a = answer(lambda: allocated_peak(_on_flat(request, kind)), argv, sweep, name)
        b = answer(lambda: allocated_peak(_on_flat(base, kind)), without, sweep, name)
        lines = f"\n    {command_line(argv, name)}\n    {command_line(without, name)}"
        sweep.check(INVARIANTS[15], a >= b, f"{name}: allocated peak {gib(a)} with --torch-multihead-attention < "
                    f"{gib(b)} without{lines}")
        if not pins_in_projection(request.with_strategy(request.strategy.model_copy(update={"kind": kind}))):
            same = p.memory.model_dump() == other[name].memory.model_dump()
            sweep.check(INVARIANTS[15], same, f"{name}: nothing pinned, yet the memory figures differ with "
                        f"--torch-multihead-attention (allocated peak {gib(p.memory.allocated_peak_bytes)} against "
                        f"{gib(other[name].memory.allocated_peak_bytes)}){lines}")


def _check_margin(argv, plans, sweep) -> None:
    """The allocated peak's band marks fits only: a predicted OOM is borderline by the reserve's
    band (or the caching allocator's turn within its reach) alone, never by the allocated peak's;
    and a fit whose allocated peak alone, at that band's high end, reaches the usable memory is
    borderline (margin.is_borderline)."""
    from zeroplan.core.margin import allocated_reaches_usable, error_band, is_borderline

    for name, p in plans.items():
        m, usable = p.memory, p.usable_memory_bytes
        band = error_band(flag_value(argv, "--varying-lengths") is not None)
        if not p.fits and p.borderline:
            by_reserve = p.borderline_capacity_bytes is not None or is_borderline(m.peak_bytes, usable, band)
            sweep.check(INVARIANTS[20], by_reserve and m.peak_bytes > usable,
                        f"{name}: OOM ({gib(m.peak_bytes)} of {gib(usable)}) marked borderline by the allocated peak's "
                        f"band ({gib(m.allocated_peak_bytes)} allocated)\n    {command_line(argv, name)}")
        if p.fits:
            reaches = allocated_reaches_usable(m.allocated_peak_bytes, usable)
            sweep.check(INVARIANTS[20], p.borderline or not reaches,
                        f"{name}: fits, allocated peak {gib(m.allocated_peak_bytes)} within its band of {gib(usable)} "
                        f"usable, but not borderline\n    {command_line(argv, name)}")


def _worst_gpu(request, kind: StrategyKind) -> tuple[int, int]:
    """(the highest peak, the most parameter bytes) over the GPUs of a device map, on the flat reserve."""
    ranks = [b for b, _ in pipeline_rank_breakdowns(_on_flat(request, kind))]
    return max(b.peak_bytes for b in ranks), max(b.parameter_bytes for b in ranks)


def balanced_budget_holds_largest_module(request) -> bool:
    """Whether accelerate's balanced budget for every GPU (get_balanced_memory: the model's bytes
    over the GPUs plus 1.25 x the larger of its first block and its mean leaf module, the last GPU
    uncapped) holds the largest module it cannot split. Where it does not, infer_auto_device_map
    skips every capped GPU the module does not fit and may put the whole model on the last one, so
    more GPUs can load one GPU with more: Qwen2.5-0.5B LoRA (a 272 MB tied embedding) balanced over
    4 A100-80GB holds 0, 1 (the embedding), 9 and 15 blocks a GPU and over 8 holds all 24 on GPU 7,
    as accelerate 1.10.1's own _get_device_map on the meta-device model does (0.418 GiB of
    parameters on the worst GPU against 0.922)."""
    from fractions import Fraction

    from zeroplan.core.parallel.device_map import _element_bytes, _max_layer, _module_tree, balanced_max_memory

    element, head_element = _element_bytes(request)
    tree = _module_tree(request.model, element, head_element)
    budgets = balanced_max_memory(tree, request.cluster.world_size, request.cluster.usable_memory_bytes)
    if request.training.finetune.quantize.is_quantized:
        budgets = [b * Fraction(9, 10) for b in budgets]
    return min(budgets) >= _max_layer(list(tree.children))[0]


def _check_device_map(argv, names, plans, sweep) -> None:
    """hf's --device-map: the plan's peak and verdict are its worst GPU's; 'auto' answers as
    'balanced' (transformers' _get_device_map treats every string but 'sequential' alike); twice
    the GPUs (half, where twice would leave the node) never raise the worst GPU's parameter
    bytes where the split is sequential (each GPU filled to its free memory in turn: GPU 0's fill does
    not depend on the count) or balanced with every GPU's budget holding the largest module
    (balanced_budget_holds_largest_module)."""
    mode = flag_value(argv, "--device-map")
    if mode is None:
        return
    for name, p in plans.items():
        peaks = p.pipeline_rank_peak_bytes or (p.memory.peak_bytes,)
        worst = max(peaks)
        sweep.check(INVARIANTS[16], p.memory.peak_bytes == worst and p.fits == (worst <= p.usable_memory_bytes),
                    f"{name}: peak {gib(p.memory.peak_bytes)} (fits {p.fits}) where the GPUs peak at "
                    f"{', '.join(gib(b) for b in peaks)} of {gib(p.usable_memory_bytes)}\n    {command_line(argv, name)}")
    if mode != "sequential":
        twin = with_flag(argv, "--device-map", "balanced" if mode == "auto" else "auto")
        other = fit_plans(twin, sweep, tuple(plans))
        for name, p in plans.items():
            same = name in other and p.memory.model_dump() == other[name].memory.model_dump() and p.fits == other[name].fits
            sweep.check(INVARIANTS[16], same, f"{name}: --device-map {mode} answers otherwise than its twin\n    "
                        f"{command_line(argv, name)}\n    {command_line(twin, name)}")
    gpus = int(flag_value(argv, "--gpus"))
    fewer, more = (gpus, 2 * gpus) if 2 * gpus <= 8 else (gpus // 2, gpus)
    if fewer < 1 or fewer == more:
        return
    small, large = with_flag(argv, "--gpus", str(fewer)), with_flag(argv, "--gpus", str(more))
    try:
        requests = build(small, sweep), build(large, sweep)
    except Refused:
        return
    if mode != "sequential" and not balanced_budget_holds_largest_module(requests[1]):
        return
    for name in plans:
        try:
            before, after = (answer(lambda: _worst_gpu(r, StrategyKind(name)), flags, sweep, name)
                             for r, flags in zip(requests, (small, large)))
        except Refused:
            continue  # e.g. the weights not fitting the fewer GPUs under accelerate's split
        sweep.check(INVARIANTS[16], after[1] <= before[1], f"{name}: the worst GPU holds {gib(before[1])} of parameters "
                    f"on {fewer} GPUs, {gib(after[1])} on {more}\n    {command_line(small, name)}\n    {command_line(large, name)}")


def _check_muon(argv, names, plans, sweep) -> None:
    """--optimizer muon against AdamW on the same request: no more optimizer-state bytes per GPU
    (torch.optim.Muon and DeepSpeed's MuonWithAuxAdam keep one momentum for a block matrix's
    element where AdamW keeps two, and AdamW's own states on the rest), nor model-state bytes,
    beyond what DeepSpeed's whole matrices add (muon_whole_matrix_bytes)."""
    if flag_value(argv, "--optimizer") != "muon":
        return
    adamw = with_flag(argv, "--optimizer", "adamw")
    other = fit_plans(adamw, sweep, tuple(plans))
    request = build(argv, sweep)
    for name, p in plans.items():
        if name not in other:
            continue
        q = other[name]
        extra = muon_whole_matrix_bytes(request.with_strategy(request.strategy.model_copy(update={"kind": StrategyKind(name)})))
        a, b = p.memory.optimizer_state_bytes, q.memory.optimizer_state_bytes
        sweep.check(INVARIANTS[17], a <= b + extra and state_bytes(p) <= state_bytes(q) + extra,
                    f"{name}: optimizer states {gib(a)} with muon > {gib(b)} with adamw + {gib(extra)} of whole "
                    f"matrices (model states {gib(state_bytes(p))} against {gib(state_bytes(q))})\n    "
                    f"{command_line(argv, name)}\n    {command_line(adamw, name)}")


def muon_whole_matrix_bytes(request) -> int:
    """What DeepSpeed's MuonWithAuxAdam under ZeRO-1/2 may keep beyond AdamW on a rank (0 under
    torch's Muon, whose states are unsharded). Its momentum and the staged copy of it
    (deepspeed 0.19.8 stage_1_and_2.py _muon_momentum_buffer, _muon_staging_momentum) span the
    whole matrices meeting the rank's partition of the Muon group (params_in_partition; Newton-
    Schulz needs whole matrices), each element in the gradients' dtype: two model-dtype bytes for
    every element past the partition. Under bf16-pure (bf16 master and Adam states) that is as
    many bytes an element as AdamW's two bf16 states, so Muon keeps more wherever a partition bound
    cuts a matrix (gpt2 under hf's zero1 on 8 GPUs: 11.8 M whole elements on the fullest rank of a
    10.6 M partition). And the Muon and auxiliary groups are flattened and aligned each on its own
    (_muon_param_groups; flat_group_elements), where AdamW's one group is aligned once: up to an
    alignment's elements more of master and states."""
    from zeroplan.core import muon
    from zeroplan.core.deepspeed_buckets import flat_group_elements
    from zeroplan.core.layout import element_bytes
    from zeroplan.specs.training import StateConvention

    if request.convention is not StateConvention.deepspeed:
        return 0
    eb = element_bytes(request.training.precision, request.convention)
    group = request.shard_group_size
    matrices, auxiliary = muon.split_tensors(request)
    muon_partition = flat_group_elements(sum(t.numel for t in matrices), group) // group
    one_group = flat_group_elements(sum(t.numel for t in matrices + auxiliary), group) // group
    past_partition = max(0, muon.deepspeed_whole_elements(request) - muon_partition)
    padding = max(0, muon_partition + muon.deepspeed_adamw_partition_elements(request) - one_group)
    return 2 * eb.compute_parameter * past_partition + (eb.master + 2 * eb.optimizer_dtype) * padding


def _check_torch_linear(argv, names, plans, sweep) -> None:
    """--deepspeed-torch-linear against the same request without it: the allocated peak and the
    flat reserve's peak no lower on any pipeline rank (the pinned weights only add), and where no
    weight is pinned (deepspeed_torch_linear.keeps_torch_linear) every memory figure the same."""
    if "--deepspeed-torch-linear" not in argv:
        return
    from zeroplan.core.deepspeed_torch_linear import keeps_torch_linear

    plain = with_flag(argv, "--deepspeed-torch-linear", None)
    other = fit_plans(plain, sweep, tuple(plans))

    def peaks(request, name: str) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
        return [(b.allocated_peak_bytes, b.peak_bytes) for b, _ in pipeline_rank_breakdowns(_on_flat(request, StrategyKind(name)))]

    for name, request, with_it, without_it in _beside_variant(argv, plain, [n for n in plans if n in other], sweep, peaks):
        lines = f"\n    {command_line(argv, name)}\n    {command_line(plain, name)}"
        for stage, ((a, peak_a), (b, peak_b)) in enumerate(zip(with_it, without_it)):
            sweep.check(INVARIANTS[18], a >= b and peak_a >= peak_b, f"{name}: allocated peak {gib(a)}, peak {gib(peak_a)} "
                        f"with --deepspeed-torch-linear < {gib(b)}, {gib(peak_b)} without (pipeline rank {stage}){lines}")
        kind = StrategyKind(name)
        if not keeps_torch_linear(request.with_strategy(request.strategy.model_copy(update={"kind": kind}))):
            same = plans[name].memory.model_dump() == other[name].memory.model_dump()
            sweep.check(INVARIANTS[18], same, f"{name}: nothing pinned, yet the memory figures differ with "
                        f"--deepspeed-torch-linear{lines}")


def _check_model_load(argv, names, plans, sweep) -> None:
    """hf's --model-load: 'sharded' answers every figure as no flag (the profile's default); a
    full-per-rank load against the sharded one, strategy by strategy, only adds (the whole model
    on the host and, under DeepSpeed's ZeRO-3, on the GPU before the step): never a fit where the
    sharded load runs out, no lower allocated peak, no fewer host bytes per rank, no larger
    max-mb. Compared where peft's adapters keep one dtype under both loads: DeepSpeed 0.19.8's
    engine casts a module that did not come from zero.Init (adapters_stay_fp32), which the
    full-per-rank load's LoRA adapters then are in 16 bits where the sharded load's stay fp32."""
    if flag_value(argv, "--model-load") is None:
        return
    from zeroplan.core.finetune.activations import adapters_stay_fp32

    kinds = tuple(StrategyKind(name) for name in plans)

    def report(flags):  # type: ignore[no-untyped-def]
        return {p.strategy.value: p for p in answer(lambda: fit(build(flags, sweep), kinds, suggest=False, timed=False),
                                                    flags, sweep).plans}

    none, sharded_argv, full_argv = (with_flag(argv, "--model-load", load) for load in (None, "sharded", "full-per-rank"))
    unset, sharded, full = report(none), report(sharded_argv), report(full_argv)
    for name, p in sharded.items():
        sweep.check(INVARIANTS[19], name in unset and p.model_dump() == unset[name].model_dump(),
                    f"{name}: --model-load sharded answers otherwise than no --model-load\n    "
                    f"{command_line(sharded_argv, name)}\n    {command_line(none, name)}")
    request = build(sharded_argv, sweep)
    for name, p in sharded.items():
        q = full.get(name)
        at = request.with_strategy(request.strategy.model_copy(update={"kind": StrategyKind(name)}))
        if q is None or adapters_stay_fp32(at):
            continue
        sweep.check(INVARIANTS[19], (p.fits or not q.fits) and q.memory.allocated_peak_bytes >= p.memory.allocated_peak_bytes
                    and q.host_bytes_per_rank >= p.host_bytes_per_rank and q.max_micro_batch_size <= p.max_micro_batch_size,
                    f"{name}: full-per-rank fits {q.fits}, allocated {gib(q.memory.allocated_peak_bytes)}, host "
                    f"{gib(q.host_bytes_per_rank)}, max-mb {q.max_micro_batch_size}; sharded fits {p.fits}, allocated "
                    f"{gib(p.memory.allocated_peak_bytes)}, host {gib(p.host_bytes_per_rank)}, max-mb {p.max_micro_batch_size}"
                    f"\n    {command_line(full_argv, name)}\n    {command_line(sharded_argv, name)}")


def _states_and_allocated_peaks(request, name: str) -> list[tuple[int, int]]:
    """(model-state bytes, allocated peak) on every pipeline rank of ``request`` under ``name``
    (on the flat reserve: neither depends on the allocator)."""
    return [(b.parameter_bytes + b.gradient_bytes + b.optimizer_state_bytes, b.allocated_peak_bytes)
            for b, _ in pipeline_rank_breakdowns(_on_flat(request, StrategyKind(name)))]


def _compare_states_and_peaks(invariant: str, argv, variant, plans, sweep, peak_holds, what: str) -> None:
    """Rank by rank: the same model-state bytes as ``variant``'s, and ``peak_holds(allocated
    peak, the variant's)``."""
    for name, _, mine, theirs in _beside_variant(argv, variant, plans, sweep, _states_and_allocated_peaks):
        for stage, ((states_a, peak_a), (states_b, peak_b)) in enumerate(zip(mine, theirs)):
            sweep.check(invariant, states_a == states_b and peak_holds(peak_a, peak_b),
                        f"{name}: model states {gib(states_a)}, allocated peak {gib(peak_a)} {what}; {gib(states_b)}, "
                        f"{gib(peak_b)} (pipeline rank {stage})\n    {command_line(argv, name)}\n    "
                        f"{command_line(variant, name)}")


def _check_dpo(argv, names, plans, sweep) -> None:
    """--objective dpo against the same rows as a causal-LM step of the recipe (22 dpo): the same
    model states, an allocated peak no lower."""
    if flag_value(argv, "--objective") != "dpo":
        return
    _compare_states_and_peaks(INVARIANTS[21], argv, with_flag(argv, "--objective", None), plans, sweep,
                              lambda dpo, sft: dpo >= sft, "under DPO against SFT's at the same rows")


def _check_padded_batches(argv, names, plans, sweep) -> None:
    """--padded-batches yes against no (23 padded), and 'no' against no flag where nothing varies."""
    padded = flag_value(argv, "--padded-batches")
    if padded is None:
        return
    yes, no = with_flag(argv, "--padded-batches", "yes"), with_flag(argv, "--padded-batches", "no")
    _compare_states_and_peaks(INVARIANTS[22], yes, no, plans, sweep, lambda a, b: a >= b,
                              "with padded batches against unpadded")
    if "--varying-lengths" in argv:
        return
    kinds = tuple(StrategyKind(name) for name in plans)
    try:
        said, unset = (answer(lambda: fit(build(flags, sweep), kinds, suggest=False, timed=False), flags, sweep)
                       for flags in (no, with_flag(argv, "--padded-batches", None)))
    except Refused:
        return
    for p, q in zip(said.plans, unset.plans):
        sweep.check(INVARIANTS[22], p.model_dump() == q.model_dump(), f"{p.strategy.value}: --padded-batches no "
                    f"answers otherwise than no flag without --varying-lengths\n    {command_line(no, p.strategy.value)}")


def _check_loss_options(argv, names, plans, sweep) -> None:
    """--uncast-loss and --keep-outputs against the same request without each (24 loss-options)."""
    if "--uncast-loss" in argv:
        _compare_states_and_peaks(INVARIANTS[23], argv, [t for t in argv if t != "--uncast-loss"], plans, sweep,
                                  lambda a, b: a <= b, "with --uncast-loss against without")
    if "--keep-outputs" in argv:
        _compare_states_and_peaks(INVARIANTS[23], argv, [t for t in argv if t != "--keep-outputs"], plans, sweep,
                                  lambda a, b: a >= b, "with --keep-outputs against without")


EXACT_ALLOCATOR_SHARE = 0.3
"""Share of the allocator-modelled requests asked again with --exact-allocator (a second fit
with its max-mb search, replays of whole traces: about as long as the rest of a request)."""


def _check_exact_allocator(argv, names, plans, sweep) -> None:
    """The oracle's answers against the reused replays' (25 exact-allocator), fit against fit:
    verdict, reserved peak, borderline mark and max-mb, strategy by strategy."""
    if "--flat-reserve" in argv or not any(p.memory.allocator_modelled for p in plans.values()):
        return
    # A request that names the oracle itself is asked again without it.
    asked = "--exact-allocator" in argv
    if not asked and random.Random("exact " + shlex.join(argv)).random() >= EXACT_ALLOCATOR_SHARE:
        return
    other = [t for t in argv if t != "--exact-allocator"] if asked else [*argv, "--exact-allocator"]
    exact = argv if asked else other
    kinds = tuple(StrategyKind(name) for name in plans)
    report = answer(lambda: fit(build(other, sweep), kinds, suggest=False, timed=False), other, sweep)
    for q in report.plans:
        name = q.strategy.value
        p = plans[name]
        if asked:
            p, q = q, p
        mine = (p.fits, p.memory.reserved_peak_bytes, p.borderline, p.max_micro_batch_size)
        oracle = (q.fits, q.memory.reserved_peak_bytes, q.borderline, q.max_micro_batch_size)
        sweep.check(INVARIANTS[24], mine == oracle, f"{name}: (fits, reserved, borderline, max-mb) {mine}; "
                    f"with --exact-allocator {oracle}\n    {command_line(exact, name)}")


def _check_checkpointing_peak(argv, names, plans, sweep) -> None:
    """Full activation checkpointing against none (26 checkpoint-peak): the allocated peak no
    higher on any pipeline rank (on the flat reserve: the allocated peak does not depend on the
    allocator). Asked of the request as drawn, with its own mode set to full and to none."""
    full, none = (with_flag(argv, "--activation-checkpointing", mode) for mode in ("full", "none"))

    def allocated_peaks(request, name: str) -> list[int]:  # type: ignore[no-untyped-def]
        return [b.allocated_peak_bytes for b, _ in pipeline_rank_breakdowns(_on_flat(request, StrategyKind(name)))]

    from zeroplan.core.deepspeed_coordinator import holds_recomputed_frozen, models_deepspeed_gathers

    for name, request, checkpointed, kept in _beside_variant(full, none, plans, sweep, allocated_peaks):
        at = request.with_strategy(request.strategy.model_copy(update={"kind": StrategyKind(name)}))
        if (holds_recomputed_frozen(at.training) and models_deepspeed_gathers(at)
                and not at.training.finetune.trains_everything):
            continue  # DeepSpeed >= 0.19.3 keeps each recomputed block's frozen weights gathered (below)
        for stage, (a, b) in enumerate(zip(checkpointed, kept)):
            sweep.check(INVARIANTS[25], a <= b, f"{name}: allocated peak {gib(a)} with full checkpointing > {gib(b)} "
                        f"without (pipeline rank {stage})\n    {command_line(full, name)}\n    {command_line(none, name)}")


def _check_accumulation_states(argv, names, plans, sweep) -> None:
    """DDP's model-state bytes at the request's accumulation against one step (27 accum-states);
    not under a pipeline, where --grad-accum is the schedule's micro-batch count."""
    if "ddp" not in plans or int(flag_value(argv, "--pp") or 1) > 1:
        return
    accum = int(flag_value(argv, "--grad-accum") or 1)
    other = with_flag(argv, "--grad-accum", "1" if accum > 1 else "4")

    def states(request, name: str) -> list[int]:  # type: ignore[no-untyped-def]
        return [b.parameter_bytes + b.gradient_bytes + b.optimizer_state_bytes
                for b, _ in pipeline_rank_breakdowns(_on_flat(request, StrategyKind(name)))]

    for name, _, mine, theirs in _beside_variant(argv, other, ("ddp",), sweep, states):
        sweep.check(INVARIANTS[26], mine == theirs, f"{name}: model states {[gib(b) for b in mine]} at --grad-accum "
                    f"{accum}, {[gib(b) for b in theirs]} at {flag_value(other, '--grad-accum')}\n    "
                    f"{command_line(argv, name)}\n    {command_line(other, name)}")


def _check_verdict_figures(argv, names, plans, sweep) -> None:
    """Each plan's verdict against its own figures (28 verdict). Under a pipeline (or a device
    map) every rank has its own usable memory (core.plan.rank_memories: the NCCL communicators it
    opens): the plan is the rank with the least headroom, and fits where every rank does."""
    from zeroplan.core.plan import rank_memories

    request = None
    for name, p in plans.items():
        m, usable = p.memory, p.usable_memory_bytes
        load_fits = p.load_gpu_bytes is None or p.load_gpu_bytes <= usable
        ranks_agree, usables = True, ()
        if p.pipeline_rank_peak_bytes:
            request = request or build(argv, sweep)
            at = request.with_strategy(request.strategy.model_copy(update={"kind": StrategyKind(name)}))
            usables = tuple(rank.usable_bytes for rank in rank_memories(at))
            ranks_agree = (len(usables) == len(p.pipeline_rank_peak_bytes) and m.peak_bytes in p.pipeline_rank_peak_bytes
                           and p.headroom_bytes == min(u - q for u, q in zip(usables, p.pipeline_rank_peak_bytes)))
        holds = (p.headroom_bytes == usable - m.peak_bytes and p.fits == (m.peak_bytes <= usable and load_fits)
                 and ranks_agree)
        sweep.check(INVARIANTS[27], holds, f"{name}: fits {p.fits}, peak {m.peak_bytes}, usable {usable}, headroom "
                    f"{p.headroom_bytes}, load {p.load_gpu_bytes}, pipeline ranks {p.pipeline_rank_peak_bytes} on "
                    f"{usables}\n    {command_line(argv, name)}")


def _check_round_trip(argv, names, plans, sweep) -> None:
    """The report's JSON back into a FitReport, and its data frame (29 round-trip)."""
    from zeroplan.answers import FitReport

    report = next(r for a, r in reversed(sweep.answered) if a is argv)
    try:
        back = FitReport.model_validate_json(report.model_dump_json())
        same = back.model_dump() == report.model_dump()
        what = "the report's JSON validates into a report that dumps otherwise"
    except ValidationError as error:
        same, what = False, f"the report's JSON does not validate: {_first_validation_line(error)}"
    sweep.check(INVARIANTS[28], same, f"{what}\n    {command_line(argv)}")
    frame = report.to_dataframe()
    rows = [(str(i), int(r["peak_bytes"]), bool(r["fits"])) for i, r in frame.iterrows()]
    expected = [(p.strategy.value, p.memory.peak_bytes, p.fits) for p in report.plans]
    sweep.check(INVARIANTS[28], rows == expected, f"data frame rows {rows} against the plans {expected}\n    "
                f"{command_line(argv)}")


CLI_SHARE = 0.3
"""Share of the answered requests asked again through the command line (30 cli-agrees)."""


def _check_command_line(argv, names, plans, sweep) -> None:
    """`zeroplan fit` on the request's flags against fit() (30 cli-agrees): its JSON's plans equal
    fit()'s field for field, and its text view's verdict line and table rows say the same."""
    import json

    from zeroplan.report.fits_cell import fits_cell

    if random.Random("cli " + shlex.join(argv)).random() >= CLI_SHARE:
        return
    from zeroplan.cli.fit import check_model_load_strategies

    try:
        # The one refusal the command adds to the API's: --model-load beside strategies that are
        # not all DeepSpeed's ZeRO-3 (the API plans the load under each; build() does not ask it).
        args = PARSER.parse_args(argv)
        check_model_load_strategies(args, strategies_asked(args))
    except ZeroplanError:
        return
    report = next(r for a, r in reversed(sweep.answered) if a is argv)
    line = ["fit", *argv]
    try:
        status, out, err = _run_command([*line, "--format", "json"])
        text_status, text, text_err = _run_command(line)
    except Exception:
        sweep.check(INVARIANTS[29], False, f"traceback: {_last_line()}\n    {command_line(argv)}")
        return
    if status != 0 or text_status != 0:
        sweep.check(INVARIANTS[29], False, f"fit() answers, the command exits {status} / {text_status}: "
                    f"{(err or text_err).strip()[:200]}\n    {command_line(argv)}")
        return
    dumped = json.loads(out)["plans"]
    mine = json.loads(report.model_dump_json())["plans"]
    for p, q in zip(mine, dumped):
        differ = sorted(k for k in set(p) | set(q) if p.get(k) != q.get(k))
        sweep.check(INVARIANTS[29], not differ and len(mine) == len(dumped),
                    f"{p['strategy']}: --format json differs from fit() in {differ}\n    {command_line(argv)}")
    first = text.splitlines()[0] if text else ""
    sweep.check(INVARIANTS[29], first.startswith("Fits.") == (report.recommended is not None),
                f"the first line {first!r} against fit()'s recommendation {report.recommended}\n    {command_line(argv)}")
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split() and line.split()[0] in plans}
    for name, p in plans.items():
        row = rows.get(name)
        expected = [fits_cell(p), f"{p.memory.peak_bytes / 2**30:.1f}"]
        sweep.check(INVARIANTS[29], row is not None and row[1:3] == expected,
                    f"{name}: the table's row {row} against fit()'s fits and peak {expected}\n    {command_line(argv)}")


def _beside_variant(argv, variant, names, sweep, figures):  # type: ignore[no-untyped-def]
    """For each strategy of ``names``: (name, the request, its figures, the variant's figures),
    ``figures(request, name)`` being a list by pipeline rank; the variant's asked through answer()
    (a refusal there passes the strategy over), nothing where either request is refused."""
    try:
        request, other = build(argv, sweep), build(variant, sweep)
    except Refused:
        return
    for name in names:
        try:
            after = answer(lambda: figures(other, name), variant, sweep, name)
        except Refused:
            continue
        yield name, request, figures(request, name), after


def _on_flat(request, kind: StrategyKind):
    """The request under ``kind`` on the flat reserve (the states and the allocated peak do not
    depend on the allocator)."""
    from zeroplan.core.search import on_flat_reserve

    return on_flat_reserve(request.with_strategy(request.strategy.model_copy(update={"kind": kind})))


PLAN_VALUE_FLAGS = ("--framework", "--gpu", "--gpus", "--seq-len", "--precision", "--optimizer", "--lora-rank",
                    "--quantize", "--cuda-context-mib", "--frozen-blocks", "--float8", "--tp", "--pp", "--cp")
PLAN_SWITCHES = ("--allow-longer-seq", "--compile", "--freeze-embeddings", "--dora", "--fused-linear-cross-entropy",
                 "--fused-cross-entropy")


def plan_argv(argv: list[str]) -> list[str]:
    """The `zeroplan plan` flags of a fit request: its model, cluster, sequence and stack (the
    search varies the strategy, micro-batch, accumulation and checkpointing); its own layout
    where it names one, else data parallelism alone."""
    out = [argv[0]]
    for i, token in enumerate(argv[1:], start=1):
        if token in PLAN_SWITCHES:
            out.append(token)
        elif token in PLAN_VALUE_FLAGS and i + 1 < len(argv):
            out += [token, argv[i + 1]]
    if not any(flag in argv for flag in ("--tp", "--pp", "--cp")):
        out.append("--no-model-parallel")
    return out


def candidate_argv(base: list[str], row: dict) -> list[str]:
    """The fit flags of one configuration the search shows."""
    argv = [t for t in base if t != "--no-model-parallel"]
    for flag in ("--tp", "--pp", "--cp"):
        argv = with_flag(argv, flag, None)
    argv += ["--strategies", row["strategy"], "--micro-batch", str(row["micro_batch_size"]),
             "--grad-accum", str(row["grad_accum_steps"]), "--activation-checkpointing", row["activation_checkpointing"],
             "--tp", str(row["tp"]), "--pp", str(row["pp"]), "--cp", str(row["cp"])]
    if row["tp"] > 1:
        argv.append("--sequence-parallel" if row["sequence_parallel"] else "--no-sequence-parallel")
    if row["pp"] > 1:
        argv += ["--pp-schedule", row["pp_schedule"], "--virtual-stages", str(row["virtual_stages"])]
    if row["strategy"] == "hsdp":
        argv += ["--hsdp-group", str(row["shard_group_size"])]
    return argv


def _run_command(argv: list[str]) -> tuple[object, str, str]:
    """The command's own entry point on ``argv`` in this process: (exit status, stdout, stderr);
    a traceback propagates."""
    import contextlib
    import io

    from zeroplan.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
    return status, out.getvalue(), err.getvalue()


def _check_search(argv, names, plans, sweep) -> None:
    """`zeroplan plan` at the request's global batch: every configuration it ranks fits under fit
    --flat-reserve with the same peak (the search ranks on the flat reserve), and fit's verdict
    under the allocator model is the one the search reports (allocator_fits)."""
    import json

    request = build(argv, sweep)
    global_batch = request.batch.micro_batch_size * request.batch.grad_accum_steps * request.data_parallel_size
    line = [*plan_argv(argv), "--global-batch", str(global_batch), "--top", "4", "--format", "json"]
    try:
        status, out, err = _run_command(["plan", *line])
    except Exception:
        sweep.check(INVARIANTS[6], False, f"traceback: {_last_line()}\n    zeroplan plan {shlex.join(line)}")
        return
    if status != 0:
        lines = err.strip().splitlines()
        sweep.check(INVARIANTS[6], len(lines) == 1, f"plan refused in {len(lines)} lines\n    zeroplan plan {shlex.join(line)}")
        sweep.refused["variant: plan search"] += 1
        return
    from zeroplan.answers import PlanSearchResult

    # 29 round-trip: the search's JSON validates back into its result type, which dumps the same.
    try:
        same = json.loads(PlanSearchResult.model_validate_json(out).model_dump_json()) == json.loads(out)
        what = "plan's JSON validates into a result that dumps otherwise"
    except ValidationError as error:
        same, what = False, f"plan's JSON does not validate: {_first_validation_line(error)}"
    sweep.check(INVARIANTS[28], same, f"{what}\n    zeroplan plan {shlex.join(line)}")
    for row in json.loads(out)["ranked"]:
        fit_line = candidate_argv(line[:-6], row)
        try:
            flat = fit_plans([*fit_line, "--flat-reserve"], sweep, (row["strategy"],))[row["strategy"]]
            modelled = fit_plans(fit_line, sweep, (row["strategy"],))[row["strategy"]]
        except Refused as refusal:
            sweep.check(INVARIANTS[5], False, f"plan shows a configuration fit refuses ({refusal})\n    "
                        f"zeroplan plan {shlex.join(line)}\n    {command_line(fit_line)}")
            continue
        sweep.check(INVARIANTS[5], flat.fits and flat.memory.peak_bytes == row["peak_bytes"],
                    f"plan ranks {row['strategy']} at peak {row['peak_bytes']} (fits); fit --flat-reserve: fits {flat.fits} "
                    f"peak {flat.memory.peak_bytes}\n    zeroplan plan {shlex.join(line)}\n    "
                    f"{command_line([*fit_line, '--flat-reserve'])}")
        sweep.check(INVARIANTS[5], modelled.fits == row["allocator_fits"],
                    f"plan says the allocator model {'completes' if row['allocator_fits'] else 'runs out'} "
                    f"(peak {row['allocator_peak_bytes']}); fit: fits {modelled.fits} peak {modelled.memory.peak_bytes}\n"
                    f"    zeroplan plan {shlex.join(line)}\n    {command_line(fit_line)}")


def check_determinism(sweep: Sweep, sample: int, rng: random.Random) -> None:
    """Each of ``sample`` answered requests asked again, in reverse order, after every other."""
    answered = sweep.answered[-sample:][::-1] if sample else []
    for argv, first in answered:
        again = fit(build(argv, sweep), parse_strategies(flag_value(argv, "--strategies")),
                    suggest=False)
        sweep.check(INVARIANTS[6], again.model_dump() == first.model_dump(), f"a second answer differs\n    {command_line(argv)}")


BAD_INPUTS = (
    ["llama-2-7b", "--tp", "3"], ["llama-2-7b", "--gpus", "8", "--pp", "16"], ["llama-2-7b", "--gpus", "6", "--tp", "4"],
    ["llama-2-7b", "--lora-rank", "8", "--tp", "2"], ["llama-2-7b", "--quantize", "nf4"], ["gpt2", "--seq-len", "4096"],
    ["llama-2-7b", "--framework", "hf", "--tp", "2"], ["llama-2-7b", "--framework", "torchtune", "--pp", "2"],
    ["llama-2-7b", "--quantize", "int8", "--lora-rank", "8", "--strategies", "zero3"], ["llama-2-7b", "--cp", "3"],
    ["llama-2-7b", "--gpus", "8", "--hsdp-group", "3"], ["llama-2-7b", "--gpu-memory-gib", "0.1"],
    ["llama-2-7b", "--cuda-context-mib", "1000000"], ["llama-2-7b", "--optimizer-in-backward", "--grad-accum", "4"],
    ["llama-2-7b", "--framework", "megatron", "--strategies", "zero3"], ["llama-2-7b", "--gpus", "16", "--nodes", "3"],
    ["llama-2-7b", "--paged-optimizer", "--strategies", "zero2-offload"], ["llama-2-7b", "--float8", "--framework", "hf"],
    ["llama-2-7b", "--gpus", "8", "--pp", "2", "--strategies", "zero3"], ["llama-2-7b", "--ep", "2"],
    ["llama-2-7b", "--frozen-blocks", "64", "--lora-rank", "8"], ["llama-2-7b", "--lora-rank", "8", "--dora", "--quantize", "int8"],
    ["llama-2-7b", "--compile", "--gpu", "v100-16gb", "--framework", "torchtitan"], ["llama-2-7b", "--gpus", "1", "--cp", "2"],
    ["llama-2-7b", "--selective-layer-interval", "2"], ["llama-2-7b", "--virtual-stages", "3", "--pp", "2", "--gpus", "8"],
)
"""Inputs the planner must refuse in one line: layouts that do not divide, options that do not
apply to the framework or strategy, memory that cannot hold the context."""


def check_bad_inputs(sweep: Sweep) -> None:
    """Every BAD_INPUTS line through the command's own entry point: status 2 and one line on stderr."""
    for argv in BAD_INPUTS:
        try:
            status, _, err = _run_command(["fit", *argv])
        except Exception:
            sweep.check(INVARIANTS[6], False, f"traceback: {_last_line()}\n    zeroplan fit {shlex.join(argv)}")
            continue
        lines = err.strip().splitlines()
        sweep.check(INVARIANTS[6], status in (0, 2) and (status == 0 or len(lines) == 1),
                    f"status {status}, stderr {lines!r}\n    zeroplan fit {shlex.join(argv)}")


def run(requests: int, seed: int, determinism_sample: int = 50, bad_inputs: bool = True,
        search_share: float = 0.25) -> Sweep:
    """The sweep of ``requests`` random requests; ``search_share`` of those answered are also
    searched by `zeroplan plan` at their global batch (each configuration it ranks asked of fit)."""
    rng = random.Random(seed)
    sweep = Sweep()
    for _ in range(requests):
        argv = random_argv(rng)
        sweep.requests += 1
        try:
            check_request(argv, rng, sweep, search_share)
        except Refused as refusal:
            sweep.refused[str(refusal)] += 1
    check_determinism(sweep, determinism_sample, rng)
    if bad_inputs:
        check_bad_inputs(sweep)
    return sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="random requests to sweep (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--search-share", type=float, default=0.25,
                        help="share of the answered requests also searched by zeroplan plan (default 0.25)")
    parser.add_argument("--determinism-sample", type=int, default=50,
                        help="answered requests asked again at the end, in reverse order (default 50)")
    args = parser.parse_args()
    start = time.perf_counter()
    sweep = run(args.requests, args.seed, args.determinism_sample, search_share=args.search_share)
    answered = len(sweep.answered)
    print(f"{sweep.requests} requests (seed {args.seed}): {answered} answered, {sweep.requests - answered} refused "
          f"in one line; {time.perf_counter() - start:.0f} s")
    print("refused by field: " + ", ".join(f"{k} {v}" for k, v in sweep.refused.most_common()))
    for name in INVARIANTS:
        print(f"invariant {name:16s} checked {sweep.checked[name]:7d}  violated {len(sweep.violations[name]):5d}")
    for name in INVARIANTS:
        for what in sweep.violations[name]:
            print(f"[{name}] {what}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
