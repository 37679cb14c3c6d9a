"""``zeroplan fit``: will MODEL train on these GPUs, under which strategy?"""

from __future__ import annotations

import argparse
import math
import sys

from zeroplan.cli.finetune_args import add_finetune_arguments, finetune_from_args
from zeroplan.cli.parser import (
    add_seq_len_arguments, bucket_elements_int, choices_of, option_groups, positive_float, positive_int, screen_width, seq_len_of,
)
from zeroplan.errors import ZeroplanError
from zeroplan.specs import (
    ActivationCheckpointing,
    AttentionImplementation,
    AttentionKernel,
    BatchSpec,
    ClusterSpec,
    Float8Recipe,
    Framework,
    HostSpec,
    MemoryAssumptions,
    ModelSpec,
    Optimizer,
    OptimizerLoop,
    PerformanceAssumptions,
    PlanRequest,
    Precision,
    StateConvention,
    StrategyKind,
    StrategySpec,
    TrainingSpec,
    cluster_from_gpus,
)
from zeroplan.specs.framework import DEEPSPEED_RELEASES, HF_DEEPSPEED_RELEASES, LITGPT_FORKS, TORCHTITAN_RELEASES
from zeroplan.specs.lengths import LongSamples, VaryingLengths
from zeroplan.specs.finetune import Quantization
from zeroplan.specs.request import (
    ATTENTION_RATES, DEFAULT_ATTENTION_RATE, GPTQ_STRATEGIES, check_optimizer_in_backward, default_attention_kernel,
)
from zeroplan.specs.parallel import EXPERT_PARALLEL_STRATEGIES, DeviceMap, ParallelSpec, PipelineSchedule
from zeroplan.specs.strategy import PARTIAL_OFFLOAD_KINDS
from zeroplan.specs.training import FsdpStateDict, ModelLoad, Objective
from zeroplan.units import GB, GiB, MiB, ByteUnit


def add_cluster_arguments(group: argparse._ArgumentGroup) -> None:
    """The GPUs, nodes and host memory of a request (fit, compare, plan)."""
    group.add_argument("--gpus", type=positive_int, default=8, help="total GPUs (default 8)")
    group.add_argument("--gpu", default="a100-80gb", help="GPU name (see `zeroplan gpus`) or a JSON file (default a100-80gb)")
    group.add_argument("--gpu-memory-gib", type=positive_float, help="override the GPU's memory, in GiB")
    group.add_argument("--cuda-context-mib", type=positive_float,
                       help="the CUDA context and libraries' memory outside the allocator, in MiB, where a run "
                            "states it (default 512: CUDA 12 with lazy module loading)")
    group.add_argument("--nodes", type=positive_int, help="number of nodes (default: --gpus / --gpus-per-node)")
    group.add_argument("--gpus-per-node", type=positive_int, help="GPUs per node (default min(--gpus, 8))")
    host = group.add_mutually_exclusive_group()
    host.add_argument("--host-memory-gib", type=positive_float, help="host RAM per node in GiB (2^30 bytes), to check offload")
    host.add_argument("--host-memory-gb", type=positive_float, help="the same in GB (10^9 bytes)")
    group.add_argument("--host", default="dgx-h100",
                       help="the node's CPUs and memory that run offload's optimizer step: dgx-h100 (default), dgx-a100 or dgx-2")
    group.add_argument("--host-cores", type=positive_int, help="physical CPU cores per node (overrides --host's)")
    group.add_argument("--nvme-bandwidth",
                       help="zero3-nvme, zero3-param-nvme: the node's swap drive(s), a preset (pm9a3, the default; "
                            "pm1743; 4x-pm1743) or GB/s as one figure or READ,WRITE (docs/communication-time.md, 'NVMe offload')")
    group.add_argument("--nvme-capacity-gb", type=positive_float,
                       help="NVMe per node in GB (10^9 bytes), to check the NVMe strategies' swap files")
    group.add_argument("--host-memory-bandwidth-gbs", type=positive_float,
                       help="host memory bandwidth per node in GB/s (10^9 bytes/s; overrides --host's)")


def add_precision_arguments(group: argparse._ArgumentGroup) -> None:
    """--precision, --optimizer and --optimizer-loop (fit, compare, plan)."""
    group.add_argument("--precision", choices=choices_of(Precision),
                       help="numeric formats (default: the framework's, bf16-mixed; torchtune bf16-pure)")
    group.add_argument("--optimizer", choices=choices_of(Optimizer),
                       help="default: adamw, or the optimizer torchtune's own configuration builds (its 8B full "
                            "single-device ones: PagedAdamW8bit, adam-8bit with --paged-optimizer)")
    add_optimizer_loop_argument(group)


def add_request_arguments(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """Flags that describe a request (shared by fit and other planning commands), in --help's
    groups; returns the groups so that a command adds its own flags where they belong."""
    parser.add_argument("model", help="preset name (see `zeroplan models`) or a path to a Hugging Face config.json")
    groups = option_groups(parser)
    add_cluster_arguments(groups["cluster"])
    add_efficiency_arguments(groups["cluster"])
    add_collective_model_arguments(groups["cluster"])
    add_batch_arguments(groups["batch"])
    add_precision_arguments(groups["precision and optimizer"])
    add_state_arguments(groups["precision and optimizer"])
    add_sharding_arguments(groups["parallelism"])
    add_parallel_arguments(groups["parallelism"])
    add_finetune_arguments(groups["fine-tuning"])
    add_framework_arguments(groups["framework"])
    add_allocator_arguments(groups["allocator"])
    return groups


def add_batch_arguments(group: argparse._ArgumentGroup) -> None:
    # No default on the two counts themselves: a --deepspeed-config file's values apply where they
    # are not given (zeroplan.cli.deepspeed_config.batch_counts); 1 otherwise.
    group.add_argument("--micro-batch", type=positive_int, help="sequences per GPU per pass (default 1)")
    add_seq_len_arguments(group, target=True)
    group.add_argument("--grad-accum", type=positive_int, help="micro-batches per optimizer step (default 1)")
    group.add_argument(
        "--varying-lengths", type=varying_lengths_arg, default=None, metavar="MEAN,SD,MIN,SAMPLES[,drop|truncate]",
        help="each micro-batch is padded to its own longest sample, up to --seq-len: the dataset's token lengths "
             "(mean, standard deviation, shortest), its sample count, and whether longer samples are dropped "
             "(default, ms-swift's) or cut; adds what the epoch's record-long batches leave cached",
    )
    group.add_argument(
        "--padded-batches", choices=("yes", "no"), default=None,
        help="whether a micro-batch carries padding tokens (a padding mask with zeros), which under --framework hf "
             "keeps the mask for SDPA (default: yes with --varying-lengths and --micro-batch above 1, else no)",
    )


def _yes_no(answer: str | None) -> bool | None:
    return None if answer is None else answer == "yes"


def varying_lengths_arg(text: str) -> VaryingLengths:
    """--varying-lengths MEAN,SD,MIN,SAMPLES[,drop|truncate] as a spec; a bad value is one line."""
    allowed = "MEAN,SD,MIN,SAMPLES[,drop|truncate], e.g. 3234.4,2547.5,91,4959"
    fields = [part.strip() for part in text.split(",")]
    if len(fields) not in (4, 5):
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
    try:
        mean, sd = float(fields[0]), float(fields[1])
        shortest, samples = int(fields[2]), int(fields[3])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers in {allowed}, got {text!r}") from None
    if not (math.isfinite(mean) and math.isfinite(sd)) or mean <= 0 or sd <= 0 or shortest <= 0 or samples <= 0:
        raise argparse.ArgumentTypeError(f"MEAN, SD, MIN and SAMPLES must be positive, got {text!r}")
    if len(fields) == 5 and fields[4] not in choices_of(LongSamples):
        raise argparse.ArgumentTypeError(f"the fifth field must be drop or truncate, got {fields[4]!r}")
    try:
        return VaryingLengths(mean_tokens=mean, sd_tokens=sd, min_tokens=shortest, samples=samples,
                              long_samples=LongSamples(fields[4]) if len(fields) == 5 else LongSamples.drop)
    except ZeroplanError as error:
        raise argparse.ArgumentTypeError(error.detail) from None


def add_state_arguments(group: argparse._ArgumentGroup) -> None:
    """Where and in which layout the optimizer keeps its states (fit and compare)."""
    group.add_argument(
        "--optimizer-in-backward", action=argparse.BooleanOptionalAction, default=None,
        help="step each parameter's optimizer in backward and free its gradient (torchtune's optimizer_in_bwd; "
             "default: on where torchtune's own configuration sets it, its 8B full single-device ones, else off)",
    )
    group.add_argument(
        "--paged-optimizer", action=argparse.BooleanOptionalAction, default=None,
        help="bitsandbytes' paged optimizer (PagedAdamW, PagedAdamW8bit...): its states live in CUDA managed "
        "memory, outside PyTorch's allocator, and page to host RAM when the GPU is full (default: on where "
        "torchtune's own configuration builds one, its 8B full single-device ones, else off)",
    )
    group.add_argument(
        "--state-convention", choices=choices_of(StateConvention),
        help="byte layout of model states (default: fsdp2 for DDP/FSDP, zero for ZeRO)",
    )


def add_zero3_group_arguments(group: argparse._ArgumentGroup) -> None:
    """The knobs of the opt-in ZeRO-3 variants: group sizes, the NVMe swapper's pipelining (fit,
    compare and plan)."""
    group.add_argument("--hpz-partition-size", type=positive_int,
                       help="zero3-hpz: ranks of ZeRO++'s secondary parameter partition (DeepSpeed "
                            "zero_hpz_partition_size; default: GPUs per node)")
    group.add_argument("--mics-shard-size", type=positive_int,
                       help="zero3-mics: ranks sharing one shard of the model states (DeepSpeed mics_shard_size; "
                            "default: GPUs per node)")
    group.add_argument("--nvme-pipeline", choices=("read", "write", "both"),
                       help="zero3-nvme, zero3-param-nvme: pipeline the optimizer swapper's NVMe reads, writes "
                            "or both with the CPU step (DeepSpeed offload_optimizer pipeline_read / pipeline_write; "
                            "default neither)")


# torch 2.13 distributed/fsdp/_runtime_utils.py _post_forward_reshard: FSDP1 keeps its root gathered
# (StrategySpec.fsdp1_root_stays_gathered, what `validate` plans the harness's torch-fsdp1 engine with).
# accelerate 1.10.1 utils/dataclasses.py FullyShardedDataParallelPlugin.__post_init__: fsdp_version
# from FSDP_VERSION, default 1 (Accelerator.prepare_model's FullyShardedDataParallel); 2 is
# _prepare_fsdp2's fully_shard, which hf is planned with unless --fsdp-version 1 is given.
FSDP_VERSION_FRAMEWORKS = (Framework.zeroplan, Framework.hf)
"""Frameworks whose FSDP version is a choice of the run's, not of the framework's own code."""


def _fsdp1_from_args(args: argparse.Namespace, framework: Framework) -> bool:
    """Whether --fsdp-version 1 asks for FSDP1 (refused for a framework that runs its own FSDP)."""
    version = getattr(args, "fsdp_version", None)
    if version is not None and framework not in FSDP_VERSION_FRAMEWORKS:
        allowed = ", ".join(f.value for f in FSDP_VERSION_FRAMEWORKS)
        raise ZeroplanError("fsdp-version", f"applies to --framework {allowed} only ({framework.value} runs its own FSDP)")
    return version == 1


def _bucket_from_args(args: argparse.Namespace) -> dict[str, int]:
    """StrategySpec.zero_bucket_elements where --reduce-bucket-size gives it (else its default)."""
    size = getattr(args, "reduce_bucket_size", None)
    return {} if size is None else {"zero_bucket_elements": size}


def offload_ratio(text: str) -> float:
    """--offload-ratio: a number above 0, at most 1 (StrategySpec.offload_optimizer_ratio)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number above 0, at most 1, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0, at most 1, got {text}")
    return value


def check_offload_ratio(args: argparse.Namespace, kinds: tuple[StrategyKind, ...] | None) -> None:
    """--offload-ratio plans DeepSpeed's ZeRO-3 CPU offloads only, and a --deepspeed-config file
    sets its own (offload_optimizer.ratio)."""
    if getattr(args, "offload_ratio", None) is None:
        return
    if getattr(args, "deepspeed_config", None) is not None:
        raise ZeroplanError("--offload-ratio", "and --deepspeed-config both set the ratio; give one (the file's "
                                               "offload_optimizer.ratio)")
    allowed = ",".join(kind.value for kind in PARTIAL_OFFLOAD_KINDS)
    if kinds is None or any(kind not in PARTIAL_OFFLOAD_KINDS for kind in kinds):
        raise ZeroplanError("--offload-ratio", f"applies to {allowed} only (allowed: --strategies naming only those)")


def check_model_load_strategies(args: argparse.Namespace, kinds: tuple[StrategyKind, ...] | None) -> None:
    """--model-load is planned under DeepSpeed's ZeRO-3 strategies only (zeroplan.core.model_load):
    refused where --strategies names none of them."""
    if getattr(args, "model_load", None) is None or kinds is None:
        return
    if not any(kind.zero_stage == 3 and not kind.is_fsdp for kind in kinds):
        allowed = ",".join(kind.value for kind in StrategyKind if kind.zero_stage == 3 and not kind.is_fsdp)
        raise ZeroplanError("--model-load", f"is planned under DeepSpeed ZeRO-3 only (allowed: --strategies naming one of {allowed})")


def add_sharding_arguments(group: argparse._ArgumentGroup) -> None:
    """The data-parallel strategies' own knobs (fit and compare)."""
    group.add_argument(
        "--strategies", help=f"comma-separated subset of: {', '.join(choices_of(StrategyKind))} (default all)"
    )
    group.add_argument("--hsdp-group", type=positive_int, help="HSDP shard group size (default: GPUs per node)")
    group.add_argument("--reduce-bucket-size", type=bucket_elements_int,
                       help="DeepSpeed's zero_optimization reduce_bucket_size, in elements, where a run's config "
                            "sets one (default DeepSpeed's 5e8; the ipg bucket ZeRO-1/2/3 allocate)")
    group.add_argument("--deepspeed-config", metavar="FILE",
                       help="a DeepSpeed config JSON (the run's own, or --emit's): plan the ZeRO stage, offload and "
                            "bucket settings it sets, DeepSpeed's defaults for those it leaves out; its batch, "
                            "precision and optimizer must agree with the flags")
    add_zero3_group_arguments(group)
    group.add_argument("--offload-ratio", type=offload_ratio,
                       help="zero3-offload, zero3-param-offload: ZeRO-Offload++'s share of the optimizer sub-groups "
                            "stepped on the host (DeepSpeed offload_optimizer.ratio, above 0, at most 1; default 1: "
                            "all), the first of the others kept and stepped on the GPU")
    group.add_argument(
        "--keep-unsharded-grads-on-accum", action="store_true",
        help="accumulate unsharded gradients over --grad-accum micro-batches and reduce once (FSDP no_sync, "
             "FSDP2 set_requires_gradient_sync(False)): a full gradient buffer (default with --framework litgpt, "
             "whose loop runs it)",
    )
    group.add_argument(
        "--fsdp-version", type=int, choices=(1, 2),
        help="--framework zeroplan: the torch FSDP that runs fsdp-full-shard and hsdp, 1 "
             "(FullyShardedDataParallel: its root unit stays gathered from the forward through backward) or 2 "
             "(fully_shard; default); --framework hf: accelerate's fsdp_version, 1 (FullyShardedDataParallel, "
             "accelerate's own default; measured for fsdp-full-shard and fsdp-shard-grad-op) or 2 (fully_shard; "
             "the default planned); the other frameworks run their own (litgpt FSDP1, fairseq fairscale's, the others FSDP2)",
    )
    group.add_argument(
        "--fsdp-state-dict", choices=choices_of(FsdpStateDict),
        help="--framework hf with --fsdp-version 1: the state-dict type the Trainer's checkpoint saves use "
             "(accelerate's fsdp_state_dict_type), planned as a moment after the step: full (FULL_STATE_DICT, "
             "accelerate's default under FSDP1: one unit gathered at a time, copies on the host), sharded "
             "(SHARDED_STATE_DICT: every parameter's local chunk cloned, kept on the GPU before accelerate 0.31.0), "
             "none (no save); default full",
    )
    group.add_argument(
        "--fsdp-cpu-offload", action=argparse.BooleanOptionalAction, default=None,
        help="FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer states in host RAM "
             "(torchtune's fsdp_cpu_offload, torchtitan's enable_cpu_offload, accelerate's fsdp_offload_params; "
             "under --framework fairseq, fairscale FSDP's cpu_offload: fairseq's --cpu-offload; default: on where "
             "torchtune's own configuration sets it, its 70B full ones, else off)",
    )


def add_framework_arguments(group: argparse._ArgumentGroup) -> None:
    """The training stack and what its model code keeps: checkpointing, attention, loss, compile."""
    group.add_argument(
        "--framework", choices=choices_of(Framework), default=Framework.zeroplan.value,
        help="training stack whose model code, checkpointing and loss are predicted (default zeroplan)",
    )
    group.add_argument(
        "--torchtitan-release", choices=TORCHTITAN_RELEASES, metavar="R",
        help="with --framework torchtitan: the release planned, 0.3.0 (default) or 9dec370 (December 2024, its "
             "published H100 benchmarks: embedding, norm and head in the root unit, gathered through the step; "
             "the last block not resharded after forward; implies --unchunked-loss)",
    )
    group.add_argument(
        "--deepspeed-release", choices=tuple(dict.fromkeys(DEEPSPEED_RELEASES + HF_DEEPSPEED_RELEASES)), metavar="R",
        help="with --framework megatron-deepspeed: the DeepSpeed release planned, 0.19.8 (default) or 2022-bigscience "
             "(the February 2022 source BigScience's tr11 runs used: ZeRO-1 without a reduce bucket, a flat 16-bit "
             "gradient copy at the step); with --framework hf under ZeRO: 0.19.8 (default), 0.13.3 (any release "
             "before 0.19.2, whose engine casts peft's fp32 adapters to 16 bits under zero.Init, and before 0.18.0, whose "
             "ZeRO-2 allocates its reduce bucket before the loss's backward) or 0.14.2 (0.13.3, and the ZeRO-2 "
             "offload's step copies the fp32 partition onto the GPU, 0.14.1 to 0.16.x)",
    )
    group.add_argument(
        "--transformers-version", metavar="V",
        help="with --framework hf: the transformers release planned (4.31 to 4.56.2; default 4.56.2): before 4.46 the "
             "causal-LM forward returns fp32 logits, before 4.49 its loss copies the shifted fp32 logits (OPT: its "
             "attention keeps the clamped scores and its loss runs in the compute dtype)",
    )
    group.add_argument(
        "--accelerate-version", metavar="V",
        help="with --framework hf: the accelerate release that wraps the model (0.28 to 1.10.1; default 1.10.1): "
             "before 0.31.0 an FSDP1 SHARDED_STATE_DICT save keeps every parameter's chunk on the GPU",
    )
    group.add_argument(
        "--torch-release", metavar="V",
        help="with --framework hf or zeroplan: the torch release the loop runs (1.7 to 2.13; default 2.13): before 2.0 "
             "zero_grad() zeroes the gradients in place, so under ddp they stay allocated through the next forward, "
             "and torch's Adam/AdamW step tensor by tensor by default; before 2.7 its wheels load an NCCL that sets up "
             "NVLS's buffers on every communicator at initialisation, larger (2.2: NCCL 2.19.3, 1.5 GiB each on 8 H100s)",
    )
    group.add_argument(
        "--model-load", choices=choices_of(ModelLoad),
        help="with --framework hf under DeepSpeed ZeRO-3: how from_pretrained builds the model. sharded (default: "
             "TrainingArguments built first, so the load runs inside zero.Init) or full-per-rank (the model loaded "
             "before TrainingArguments: every rank holds the whole model in host RAM, fp32 unless loaded in bf16, "
             "and DeepSpeed's engine moves it whole onto each GPU before partitioning it)",
    )
    group.add_argument(
        "--litgpt-fork", choices=LITGPT_FORKS,
        help="with --framework litgpt: plan a fork of lit-gpt's model code as it trained (tinyllama: TinyLlama's "
             "pretraining on Lightning 2.1.2, its fused kernels and bf16-mixed with fp32 parameters)",
    )
    group.add_argument(
        "--activation-checkpointing", choices=choices_of(ActivationCheckpointing),
        help="what each block recomputes in the backward (default none; under --framework torchtitan or torchtune, "
             "for a model that framework ships a configuration of, that configuration's: torchtitan's llama3_8b "
             "selective-op, llama3_70b and llama3_405b full; torchtune's per method and GPU count)",
    )
    group.add_argument(
        "--selective-layer-interval", type=positive_int, metavar="K",
        help="with --activation-checkpointing selective-layer: checkpoint every K-th block (torchtune's ac_option; default 2)",
    )
    group.add_argument(
        "--activation-offloading", action=argparse.BooleanOptionalAction, default=None,
        help="move saved activations to host memory (torchtune's enable_activation_offloading; left out: off, or what "
             "the framework's own configuration sets)",
    )
    group.add_argument(
        "--partition-activations", action="store_true",
        help="DeepSpeed's activation checkpointing splits each checkpointed block input over the tensor-parallel "
             "ranks (Megatron-DeepSpeed's --partition-activations; a --deepspeed-config file's "
             "activation_checkpointing.partition_activations; with --activation-checkpointing full)",
    )
    group.add_argument(
        "--checkpoint-in-cpu", action="store_true",
        help="DeepSpeed's activation checkpointing keeps each checkpointed block input in host memory "
             "(Megatron-DeepSpeed's --checkpoint-in-cpu; a --deepspeed-config file's "
             "activation_checkpointing.cpu_checkpointing; with --activation-checkpointing full)",
    )
    add_fused_loss_argument(group)
    add_compile_arguments(group)
    add_attention_argument(group)


def add_attention_argument(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--attention", choices=choices_of(AttentionKernel),
                       help="how attention keeps its intermediates (default flash; eager for ALiBi models, whose "
                            "transformers attention has no fused path; sdpa-masked: torch 2.1's SDPA given an "
                            "additive mask, which it materialises per head, --framework hf --torch-release 2.1)")
    group.add_argument("--attention-impl", choices=choices_of(AttentionImplementation),
                       default=AttentionImplementation.flash_attn_2.value,
                       help="which flash kernel runs attention (default flash-attn-2, also PyTorch SDPA's flash "
                            "backend; flash-attn-triton: llm-foundry's attn_impl triton): read by --attention-rate")


def add_allocator_arguments(group: argparse._ArgumentGroup) -> None:
    """The caching-allocator model's setting, or the flat reserve instead of it."""
    allocator = group.add_mutually_exclusive_group()
    allocator.add_argument(
        "--allocator-conf", metavar="CONF",
        help="the PYTORCH_CUDA_ALLOC_CONF under which the caching-allocator model replays the step and judges "
        "fit (e.g. expandable_segments:True; default: what the framework's launcher sets, expandable_segments:True "
        "for torchtitan on one node (run_train.sh; its multi-node multinode_trainer.slurm sets none), PyTorch's "
        "defaults otherwise; \"\" for PyTorch's defaults)",
    )
    group.add_argument(
        "--exact-capacity", action="store_true",
        help="also bisect the allocator model's OOM capacity, the least memory the step completes on "
        "(a dozen replays more per strategy; shown as oom-at in --detail)",
    )
    group.add_argument(
        "--exact-allocator", action="store_true",
        help="replay every verdict's whole step trace afresh (the oracle; by default a replay of the same "
        "trace already made answers where it decides the verdict exactly)",
    )
    allocator.add_argument(
        "--flat-reserve", action="store_true",
        help="judge fit on the allocated peak plus a flat 5%% reserve instead of the allocator model "
        "(faster; the rule the plan search uses)",
    )


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    """torch.compile and float8 training (zeroplan.core.compiled, docs/compile-float8.md)."""
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile each block as the framework's recipe does (torchtitan, torchtune, hf; "
                             "litgpt: its whole GPT, torch.compile(model)): inductor's partitioner decides what each "
                             "block keeps (default: on where the framework's own configuration of the model compiles, "
                             "torchtitan's llama3_405b, else off)")
    parser.add_argument("--float8", nargs="?", const=Float8Recipe.rowwise.value, choices=[*choices_of(Float8Recipe), "none"],
                        help="torchtitan's float8 training (torchao Float8Linear) with this recipe (default rowwise, "
                             "torchtitan's; needs --compile), or te-delayed: TransformerEngine's te.Linear as llm-foundry's "
                             "amp_fp8 runs it (framework zeroplan, eager; timed only, memory as bf16); an SM89+ GPU; none: "
                             "no float8 (left out: rowwise where torchtitan's own configuration converts, its llama3_405b, "
                             "else none)")
    parser.add_argument("--float8-all-gather", action="store_true",
                        help="with --float8 tensorwise: FSDP2 gathers the Float8Linear weights already cast, one byte an "
                             "element (torchtitan's float8.enable_fsdp_float8_all_gather with its scale precompute)")
    parser.add_argument("--float8-skip-output", action=argparse.BooleanOptionalAction, default=None,
                        help="with --float8: the output projection stays bf16 (torchtitan's float8.filter_fqns "
                             "[\"output\"], as its Llama 3 configs set before 0.3.0, and llama3_405b's [\"lm_head\"], "
                             "the default where that configuration's float8 is planned)")


def add_parallel_arguments(group: argparse._ArgumentGroup) -> None:
    """Tensor, sequence, context and pipeline parallelism (zeroplan.specs.parallel; docs/parallelism.md)."""
    group.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree, inside a node (default 1)")
    group.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                       help="shard norms and the residual stream over the tp ranks (default: on for torchtitan, whose "
                            "enable_sequence_parallel defaults to true; off for the reference model, as Megatron-LM)")
    group.add_argument("--async-tp", action=argparse.BooleanOptionalAction, default=None,
                       help="torchtitan's asynchronous tensor parallelism (enable_async_tensor_parallel; needs --compile "
                            "and sequence parallelism): each all-gather and reduce-scatter fused with its matmuls "
                            "(default: on with --tp 2 or more where torchtitan's own configuration sets it, its "
                            "llama3_405b, else off)")
    group.add_argument("--cp", type=positive_int, default=1, help="context-parallel degree (ring attention; DeepSpeed-Ulysses, --ds-sequence-parallel-size, under --framework megatron-deepspeed; default 1)")
    group.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel degree (default 1); --grad-accum micro-batches flow through it")
    group.add_argument("--pp-schedule", choices=choices_of(PipelineSchedule),
                       help="pipeline schedule, with --pp 2 or more (default 1f1b)")
    group.add_argument("--virtual-stages", type=positive_int,
                       help="stages per pipeline rank (default 1; 2 for interleaved-1f1b and zero-bubble)")
    group.add_argument("--device-map", choices=["auto", *choices_of(DeviceMap)],
                       help="framework hf: transformers' from_pretrained(device_map=...) over the --gpus GPUs of one "
                            "process, the layers split by accelerate's rule and one micro-batch at a time through them "
                            "('auto' is 'balanced'; LoRA/QLoRA only; docs/parallelism.md)")
    group.add_argument("--ep", type=positive_int, default=1,
                       help="expert-parallel degree for a mixture of experts (default 1): each MoE block's experts split "
                            "ep ways, borrowed from the data-parallel ranks as torchtitan does (docs/moe.md)")
    group.add_argument("--moe-capacity-factor", type=positive_float, metavar="CF",
                       help="route with DeepSpeed-MoE's capacity factor (each expert takes at most ceil(k x tokens x CF / E) "
                            "tokens, padded) instead of dropless routing (default: dropless, as torchtitan and Megatron-LM)")


def parallel_from_args(args: argparse.Namespace) -> ParallelSpec:
    """The layout the flags describe; none for a command without them (plan's search does not
    sweep model parallelism yet)."""
    if not hasattr(args, "tp"):
        return ParallelSpec()
    if args.pp_schedule is not None and args.pp == 1:
        # Refused as --virtual-stages without --pp is (ParallelSpec): a schedule of no pipeline
        # would change nothing the user expects it to.
        raise ZeroplanError("--pp-schedule", "needs pipeline parallelism (allowed: with --pp 2 or more)")
    schedule = PipelineSchedule(args.pp_schedule or PipelineSchedule.one_f_one_b.value)
    sequence_parallel = args.sequence_parallel
    if sequence_parallel is None:
        # torchtitan 0.3.0 config/configs.py ParallelismConfig.enable_sequence_parallel = True.
        sequence_parallel = args.tp > 1 and args.framework == Framework.torchtitan.value
    virtual = args.virtual_stages or (2 if schedule.interleaved and args.pp > 1 else 1)
    device_map = getattr(args, "device_map", None)
    # transformers' _get_device_map treats every string but "sequential" as balanced.
    device_map = None if device_map is None else DeviceMap.sequential if device_map == "sequential" else DeviceMap.balanced
    # A device map's pipeline ranks are the GPUs (--pp left out takes --gpus).
    pp = args.gpus if device_map is not None and args.pp == 1 else args.pp
    # --async-tp left out: off, or the framework's own configuration's (PlanRequest._framework_recipe_launch).
    async_tp = getattr(args, "async_tp", None)
    return ParallelSpec(tp=args.tp, sequence_parallel=sequence_parallel, **({} if async_tp is None else {"async_tp": async_tp}),
                        cp=args.cp, pp=pp, pp_schedule=schedule, virtual_stages=virtual, ep=args.ep, device_map=device_map)


def add_optimizer_loop_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--optimizer-loop", choices=choices_of(OptimizerLoop), default=None,
        help="how torch.optim steps the tensors: foreach (torch's CUDA default), for-loop (foreach=False) or "
             "fused (fused=True); decides the step's temporary (default: the framework's own)",
    )


def add_fused_loss_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fused-linear-cross-entropy", action="store_true",
        help="liger-kernel's fused linear cross-entropy instead of the logits (hf only: use_liger_kernel)",
    )
    parser.add_argument(
        "--fused-cross-entropy", action="store_true",
        help="flash-attn's fused CrossEntropyLoss on the compute-dtype logits instead of torch's on an fp32 copy "
             "(llm-foundry's default loss_fn; framework zeroplan only)",
    )
    parser.add_argument(
        "--torch-multihead-attention", action="store_true",
        help="framework zeroplan: each block's attention is torch's nn.MultiheadAttention called as self-attention "
             "(packed in_proj_weight; DeepSpeedExamples' bf16_master_weight model): under DeepSpeed's ZeRO-3 engine "
             "its gathered in-projection stays alive from the block's forward to its backward",
    )
    parser.add_argument(
        "--deepspeed-fused-adam", action="store_true",
        help="framework hf, DeepSpeed's stage 0 in fp16: the script hands deepspeed.initialize its own FusedAdam "
             "(DeepSpeed-Chat), which DeepSpeed wraps in FP16_Optimizer, whose step makes each group's flat fp32 "
             "gradients beside the fp16 ones",
    )
    parser.add_argument(
        "--deepspeed-torch-linear", action="store_true",
        help="framework zeroplan: under DeepSpeed's ZeRO-3 engine the linears run torch's own F.linear (DeepSpeed "
             "0.3.12-0.3.13; 0.3.14 to 0.19.3 for a model built outside zero.Init), which keeps each released "
             "linear's gathered weight alive until its backward",
    )
    parser.add_argument(
        "--use-cache", action="store_true",
        help="hf: the model keeps transformers' KV cache (config use_cache=True, its default, which only its own "
             "gradient_checkpointing turns off): under checkpointing applied from outside transformers (torch's "
             "checkpoint_wrapper, as llama-recipes' FSDP) every layer's K and V stay alive with the output object",
    )
    parser.add_argument(
        "--keep-outputs", action="store_true",
        help="hf: the training loop holds the model's output object (logits, cache) through backward "
             "(outputs = model(**batch); loss = outputs.loss) instead of only the loss; torchtune: its recipes "
             "before August 2024 hold the fp32 copy of the shifted logits through backward; zeroplan: the loop "
             "holds the logits the model returns through backward (logits = model(ids); loss = loss_fn(logits, ...))",
    )
    parser.add_argument(
        "--uncast-loss", action="store_true",
        help="framework zeroplan: the loop's torch nn.CrossEntropyLoss on the logits as the model returns them, "
             "without an fp32 upcast (outside autocast its log-softmax and gradients in the logits' dtype; under "
             "CUDA autocast the log-softmax in that dtype, nll_loss's copy and gradient in fp32); framework litgpt: "
             "a loop's F.cross_entropy on the GPT's returned logits, held through backward (lightning-thunder's "
             "benchmark_litgpt.py), instead of litgpt fit()'s chunked fp32 loss",
    )
    parser.add_argument(
        "--checkpoint-reentrant", action=argparse.BooleanOptionalAction, default=None,
        help="hf, under --activation-checkpointing full: torch's reentrant block checkpoint (the default: transformers' "
             "gradient_checkpointing_enable) or, --no-checkpoint-reentrant, the non-reentrant one "
             "(gradient_checkpointing_kwargs use_reentrant False; ms-swift 1.x patches torch's checkpoint to it), "
             "under which bitsandbytes before 0.43.2 keeps every block's 4-bit matmul inputs through backward",
    )
    parser.add_argument(
        "--objective", choices=[o.value for o in Objective], default=Objective.sft.value,
        help="sft: a causal-LM step; dpo: torchtune's LoRA DPO recipes (chosen and rejected in one forward, a "
             "no-grad reference forward with the adapters disabled); reward: DeepSpeed-Chat's step-2 reward model (the "
             "bare decoder, a scalar v_head, a pairwise loss; --framework hf under DeepSpeed's engine); under dpo and "
             "reward --micro-batch counts rows, 2 x pairs",
    )
    parser.add_argument(
        "--unchunked-loss", action="store_true",
        help="torchtitan: its unchunked CrossEntropyLoss instead of the ChunkedLossWrapper its Llama-3 configs use; "
             "torchtune: a plain torch.nn.CrossEntropyLoss as the recipe's loss instead of CEWithChunkedOutputLoss",
    )


DEFAULT_HFU = None
"""--hfu left out: the fitted default of the request's mechanism (zeroplan.core.default_efficiency)."""


def add_efficiency_arguments(parser: argparse.ArgumentParser) -> None:
    """The rate compute runs at: a hardware FLOPs utilisation (docs/communication-time.md, "Compute")."""
    parser.add_argument(
        "--hfu", type=positive_float, default=DEFAULT_HFU,
        help="hardware FLOPs utilisation: the fraction of peak bf16 FLOP/s at which the matrix products' and "
             "attention's executed FLOPs (recomputation included) run; the memory-bound kernels and the optimizer step "
             "run at the GPU's copy bandwidth apart from it (A100, H100, H200; another GPU's HFU covers them) (default: the HFU fitted on published rows for the GPU generation and "
             "attention kernel, zeroplan.core.default_efficiency; 0.4 for a GPU without rows); MFU is reported, "
             "not an input",
    )
    parser.add_argument(
        "--compute-model", choices=("hfu", "roofline"), default="hfu",
        help="how compute is timed: hfu (executed FLOPs at --hfu x peak, memory-bound kernels at the copy bandwidth; the default) or roofline (kernel by "
             "kernel against the GPU's measured matmul, attention and memory-bandwidth ceilings, the optimizer "
             "step included; a100-40gb, a100-80gb, h100-80gb, h200-141gb)",
    )
    parser.add_argument(
        "--attention-rate", choices=ATTENTION_RATES, default=DEFAULT_ATTENTION_RATE,
        help="rate of attention's own FLOPs under --compute-model hfu: matmul (at --hfu like every FLOP), "
             "published (--hfu x the kernel's published rate relative to the GPU's matmul rate) or "
             "kernel (the kernel's published TFLOP/s x its fitted efficiency, the default); "
             "docs/communication-time.md, 'Compute'",
    )
    from zeroplan.cli.efficiency import add_efficiency_file_argument

    add_efficiency_file_argument(parser)
    # The former --mfu timed executed FLOPs, so it was an HFU under another name; it is refused
    # with a pointer rather than read under either meaning.
    parser.add_argument("--mfu", type=positive_float, help=argparse.SUPPRESS)


def add_collective_model_arguments(parser: argparse.ArgumentParser) -> None:
    """How collectives are timed: NCCL's algorithm choice and nominal vs achievable bandwidth."""
    parser.add_argument(
        "--algorithm", "--all-reduce", dest="algorithm", default="auto",
        choices=["auto", "ring", "tree", "nvls", "nvls_tree", "collnet"],
        help="NCCL algorithm of each call: auto = the one NCCL's tuning model predicts fastest (default); "
             "a name forces it where NCCL offers it, ring elsewhere",
    )
    parser.add_argument(
        "--bandwidth", choices=["achievable", "nominal"], default="achievable",
        help="achievable: published/calibrated nccl-tests efficiency where the GPU has one (default); "
             "nominal: datasheet link rates",
    )
    parser.add_argument(
        "--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=None,
        help="gradient reductions during the backward (hidden as far as it lasts) or, with --no-overlap-grad-reduce, "
             "after it (exposed); default: the framework's stack (hf: DeepSpeed ZeRO-1/2 do not overlap, "
             "overlap_comm being on for stage 3 only; the others do)",
    )
    parser.add_argument(
        "--deepspeed-grad-accum-dtype", choices=["fp32"], default=None,
        help="DeepSpeed's data_types.grad_accum_dtype (default: the model's dtype); fp32 under bf16 at ZeRO-1 "
             "runs DeepSpeed's BF16_Optimizer (--framework megatron-deepspeed)",
    )
    parser.add_argument(
        "--overlap-param-gather", action="store_true",
        help="the parameter all-gather after a ZeRO-1/2 step runs in the next forward (Megatron-LM's "
             "--overlap-param-gather) instead of exposed in the step",
    )
    parser.add_argument(
        "--tp-comm-overlap", action="store_true",
        help="tensor-parallel all-gathers and reduce-scatters overlap the matrix products (Megatron-LM's "
             "--tp-comm-overlap) instead of blocking them",
    )


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    output = add_request_arguments(parser)["output"]
    output.add_argument("--format", choices=["table", "json", "csv"], default="table")
    output.add_argument("--unit", choices=["GiB", "GB"], default="GiB", help="unit of the table (default GiB)")
    view = output.add_mutually_exclusive_group()
    view.add_argument("--detail", action="store_true",
                      help="the full table of every term (the first screen shows the verdict and a compact table)")
    view.add_argument("--explain", metavar="STRATEGY", choices=choices_of(StrategyKind),
                      help="one strategy's terms, each with its value, what it is made of and its source in the docs")


def _gpu(args: argparse.Namespace):
    from zeroplan.presets.gpus import get_gpu, load_gpu_file

    gpu = load_gpu_file(args.gpu) if args.gpu.endswith(".json") else get_gpu(args.gpu)
    if args.gpu_memory_gib is not None:
        from zeroplan.specs.hardware import MAX_DEVICE_MEMORY_BYTES

        # model_copy does not validate: GpuSpec's own bound on memory_bytes is applied here (the
        # flag's generic 2^40 GiB overflowed the plan search's int64 arrays at 2^70 bytes).
        memory_bytes = int(args.gpu_memory_gib * GiB)
        if not 1 <= memory_bytes <= MAX_DEVICE_MEMORY_BYTES:
            what = "more than any device holds" if memory_bytes > 1 else "less than a byte"
            raise ZeroplanError("--gpu-memory-gib", f"{args.gpu_memory_gib:g} GiB is {what} "
                                                    f"(allowed: up to {MAX_DEVICE_MEMORY_BYTES // GiB:,} GiB)")
        gpu = gpu.model_copy(update={"memory_bytes": memory_bytes})
    return gpu


def parse_strategies(text: str | None) -> tuple[StrategyKind, ...] | None:
    """The strategies named on the command line; None (all the framework runs) when none are."""
    if text is None:
        return None
    allowed = choices_of(StrategyKind)
    kinds = []
    for name in (part.strip() for part in text.split(",")):
        if name not in allowed:
            raise ZeroplanError("strategies", f"unknown {name!r} (allowed: {', '.join(allowed)})")
        if StrategyKind(name) in kinds:
            raise ZeroplanError("strategies", f"{name!r} is listed twice (each of {', '.join(allowed)} at most once)")
        kinds.append(StrategyKind(name))
    return tuple(kinds)


def host_from_args(args: argparse.Namespace) -> HostSpec:
    """--host's node, with --host-cores and --host-memory-bandwidth-gbs in place of its own."""
    from zeroplan.presets.hosts import get_host

    host = get_host(getattr(args, "host", "dgx-h100"))
    update = {}
    if getattr(args, "host_cores", None) is not None:
        update["cores_per_node"] = args.host_cores
    if getattr(args, "host_memory_bandwidth_gbs", None) is not None:
        update["memory_bandwidth_bytes_per_s"] = args.host_memory_bandwidth_gbs * GB
    if getattr(args, "nvme_bandwidth", None) is not None:
        from zeroplan.specs.nvme import parse_nvme_bandwidth

        update["nvme_read_bytes_per_s"], update["nvme_write_bytes_per_s"] = parse_nvme_bandwidth(args.nvme_bandwidth)
    return host.model_copy(update=update) if update else host


def request_from_args(args: argparse.Namespace, kind: StrategyKind | None = None) -> PlanRequest:
    """Build the PlanRequest the flags describe; bad values raise one-line ZeroplanErrors. The
    base strategy where ``kind`` is None: ddp, or for a gptq-int4 base zero2 (GPTQ_STRATEGIES)."""
    from zeroplan.core.compiled import check_compiled
    from zeroplan.core.profiles import accumulates_without_sync, check_framework_request, default_precision
    from zeroplan.presets.models import get_model

    launch = _megatron_launch(args)
    model = launch.model if launch is not None else get_model(args.model)
    if getattr(args, "moe_capacity_factor", None) is not None:
        model = ModelSpec(**{**dict(model), "moe_capacity_factor": args.moe_capacity_factor})
    cluster = cluster_from_gpus(_gpu(args), args.gpus, args.gpus_per_node, args.nodes)
    cluster = cluster.model_copy(update={"host": host_from_args(args)})
    if getattr(args, "cuda_context_mib", None) is not None:
        # Validated again (model_validate): a context at least the GPU's memory is refused in one line.
        cluster = ClusterSpec.model_validate({**dict(cluster), "cuda_context_bytes": int(args.cuda_context_mib * MiB)})
    if args.host_memory_gib is not None or args.host_memory_gb is not None:
        host_bytes = int(args.host_memory_gib * GiB) if args.host_memory_gib is not None else int(args.host_memory_gb * GB)
        cluster = cluster.model_copy(update={"host_memory_bytes_per_node": host_bytes})
    if getattr(args, "nvme_capacity_gb", None) is not None:
        cluster = cluster.model_copy(update={"nvme_capacity_bytes_per_node": int(args.nvme_capacity_gb * GB)})
    framework = Framework(args.framework)
    deepspeed_file = _deepspeed_file(args)
    if args.precision:
        precision = Precision(args.precision)
    elif deepspeed_file is not None and deepspeed_file.precision is not None:
        precision = deepspeed_file.precision  # the file's bf16 / fp16 blocks (neither: fp32)
    else:
        precision = default_precision(framework, cluster.gpu)
    # torchtune 0.6.1 data/_collate.py padded_collate_dpo and DeepSpeed-Chat's DataCollatorReward:
    # each pair gives a chosen and a rejected row, so a DPO or reward forward has an even number.
    objective = Objective(getattr(args, "objective", Objective.sft.value))
    if objective.pairwise and (args.micro_batch or 1) % 2:
        raise ZeroplanError("--micro-batch", f"{(args.micro_batch or 1)}: under --objective {objective.value} it counts "
                            "chosen and rejected rows (allowed: even, 2 x the script's pairs a micro-batch)")
    training = TrainingSpec(
        precision=precision,
        framework=framework,
        **_deepspeed_checkpointing(args, framework, deepspeed_file),
        fused_linear_cross_entropy=args.fused_linear_cross_entropy,
        fused_cross_entropy=args.fused_cross_entropy,
        torch_multihead_attention=getattr(args, "torch_multihead_attention", False),
        deepspeed_torch_linear=getattr(args, "deepspeed_torch_linear", False),
        deepspeed_fused_adam=getattr(args, "deepspeed_fused_adam", False),
        # torchtitan 9dec370 train.py loss_fn: its only loss, unchunked.
        objective=Objective(getattr(args, "objective", Objective.sft.value)),
        unchunked_loss=args.unchunked_loss or (framework is Framework.torchtitan and getattr(args, "torchtitan_release", None) == "9dec370"),
        torchtitan_release=getattr(args, "torchtitan_release", None),
        deepspeed_release=getattr(args, "deepspeed_release", None),
        use_cache=getattr(args, "use_cache", False),
        keep_outputs=getattr(args, "keep_outputs", False),
        uncast_loss=getattr(args, "uncast_loss", False),
        checkpoint_reentrant=getattr(args, "checkpoint_reentrant", None),
        transformers_version=getattr(args, "transformers_version", None),
        torch_release=getattr(args, "torch_release", None),
        model_load=ModelLoad(args.model_load) if getattr(args, "model_load", None) else None,
        litgpt_fork=getattr(args, "litgpt_fork", None),
        # compile, float8, float8_skips_output and optimizer_in_backward likewise.
        **_named(optimizer_in_backward=args.optimizer_in_backward, compile=getattr(args, "compile", None),
                 float8_skips_output=getattr(args, "float8_skip_output", None)),
        **({} if getattr(args, "float8", None) is None
           else {"float8": None if args.float8 == "none" else Float8Recipe(args.float8)}),
        **_named(paged_optimizer=args.paged_optimizer, fsdp_cpu_offload=args.fsdp_cpu_offload,
                 activation_offloading=args.activation_offloading),
        fsdp_state_dict=FsdpStateDict(args.fsdp_state_dict) if getattr(args, "fsdp_state_dict", None) else None,
        accelerate_version=getattr(args, "accelerate_version", None),
        # --optimizer, --optimizer-loop, --paged-optimizer and --fsdp-cpu-offload not given: the
        # planner's own, or the framework's own configuration's (PlanRequest._framework_recipe_launch).
        **({} if args.optimizer is None else {"optimizer": Optimizer(args.optimizer)}),
        **({} if getattr(args, "optimizer_loop", None) is None else {"optimizer_loop": OptimizerLoop(args.optimizer_loop)}),
        # Not given: none, or the framework's own configuration's (PlanRequest._framework_recipe_checkpointing).
        **({} if args.activation_checkpointing is None
           else {"activation_checkpointing": ActivationCheckpointing(args.activation_checkpointing)}),
        selective_layer_interval=args.selective_layer_interval or DEFAULT_SELECTIVE_LAYER_INTERVAL,
        attention_kernel=AttentionKernel(args.attention) if args.attention else default_attention_kernel(model, Framework(args.framework)),
        attention_implementation=AttentionImplementation(getattr(args, "attention_impl", None)
                                                         or AttentionImplementation.flash_attn_2.value),
        state_convention=StateConvention(args.state_convention) if args.state_convention else None,
        finetune=finetune_from_args(args),
        float8_all_gather=getattr(args, "float8_all_gather", False),
    )
    if kind is None:
        kind = GPTQ_STRATEGIES[-1] if training.finetune.quantize is Quantization.gptq_int4 else StrategyKind.ddp
    check_framework_request(training, model)
    parallel = parallel_from_args(args)
    micro_batch, grad_accum = args.micro_batch or 1, args.grad_accum or 1
    if deepspeed_file is not None:
        from zeroplan.cli.deepspeed_config import batch_counts

        micro_batch, grad_accum = batch_counts(
            deepspeed_file, args.micro_batch, args.grad_accum, cluster.world_size // parallel.model_parallel_size)
    batch = BatchSpec(
        micro_batch_size=micro_batch, seq_len=seq_len_of(args, model.max_positions),
        grad_accum_steps=grad_accum, allow_longer_seq=args.allow_longer_seq,
        target_len=getattr(args, "target_len", None), varying_lengths=getattr(args, "varying_lengths", None),
        padded_batches=_yes_no(getattr(args, "padded_batches", None)),
    )
    check_optimizer_in_backward(training, batch.grad_accum_steps)
    if args.hsdp_group is not None and cluster.world_size % args.hsdp_group:
        from zeroplan.specs.hardware import divisor_words

        raise ZeroplanError("--hsdp-group", f"{args.hsdp_group} does not divide the {cluster.world_size} GPUs "
                                            f"(allowed: {divisor_words(cluster.world_size)})")
    if parallel.ep > 1 and kind.value not in EXPERT_PARALLEL_STRATEGIES:
        # The base request only carries the knobs (fit plans each strategy); under expert
        # parallelism it must be one that runs there.
        kind = StrategyKind.fsdp_full_shard
    strategy = StrategySpec(kind=kind, shard_group_size=args.hsdp_group,
                            hpz_partition_size=getattr(args, "hpz_partition_size", None),
                            mics_shard_size=getattr(args, "mics_shard_size", None),
                            nvme_pipeline_read=getattr(args, "nvme_pipeline", None) in ("read", "both"),
                            nvme_pipeline_write=getattr(args, "nvme_pipeline", None) in ("write", "both"),
                            keep_unsharded_grads_on_accum=getattr(args, "keep_unsharded_grads_on_accum", False)
                            or accumulates_without_sync(framework, cluster.world_size // parallel.model_parallel_size),
                            deepspeed_grad_accum_fp32=getattr(args, "deepspeed_grad_accum_dtype", None) == "fp32",
                            fsdp1_root_stays_gathered=_fsdp1_from_args(args, framework),
                            offload_optimizer_ratio=getattr(args, "offload_ratio", None),
                            **_bucket_from_args(args))
    if deepspeed_file is not None and getattr(args, "reduce_bucket_size", None) is not None:
        raise ZeroplanError("--reduce-bucket-size", "and --deepspeed-config both set the reduce bucket; give one "
                                                    "(the file's reduce_bucket_size)")
    if args.mfu is not None:
        raise ZeroplanError(
            "mfu", "is no longer an input: give --hfu (executed FLOPs over peak; a published MFU converts as "
            "HFU = MFU x executed / model FLOPs, docs/communication-time.md 'Compute'); MFU is in the output",
        )
    if args.hfu is not None and args.hfu > 1:
        raise ZeroplanError("hfu", f"must be in (0, 1], got {args.hfu}")
    if args.compute_model == "roofline":
        if args.hfu != DEFAULT_HFU:
            raise ZeroplanError("hfu", "has no effect under --compute-model roofline (its kernels run at the GPU's "
                                "measured ceilings); drop --hfu or use --compute-model hfu")
        from zeroplan.core.roofline.ceilings import gpu_ceilings

        gpu_ceilings(cluster.gpu)
    hfu = args.hfu
    attention_efficiency = None
    if getattr(args, "efficiency", None) is not None:
        from zeroplan.cli.efficiency import efficiency_attention, efficiency_hfu

        hfu = efficiency_hfu(args, cluster.gpu.name, framework)
        attention_efficiency = efficiency_attention(args)
    performance = PerformanceAssumptions(
        hardware_flops_utilization=hfu, attention_efficiency=attention_efficiency, algorithm=args.algorithm,
        bandwidth=args.bandwidth,
        compute_model=args.compute_model, attention_rate=getattr(args, "attention_rate", DEFAULT_ATTENTION_RATE),
        overlap_grad_reduce=getattr(args, "overlap_grad_reduce", None),
        overlap_param_gather=getattr(args, "overlap_param_gather", False),
        tp_comm_overlap=getattr(args, "tp_comm_overlap", False),
    )
    request = PlanRequest(
        model=model, training=training, batch=batch, cluster=cluster, strategy=strategy, performance=performance,
        parallel=parallel, assumptions=MemoryAssumptions(**_allocator_conf(args)),
    )
    # On the request's training: what the framework's own configuration sets is in it.
    check_compiled(request.training, model, cluster.gpu)
    if deepspeed_file is not None:
        from zeroplan.cli.deepspeed_config import apply_deepspeed_config

        request = apply_deepspeed_config(deepspeed_file, request, kind)
    if getattr(args, "efficiency", None) is not None:
        from zeroplan.calibrate.step import check_calibrated_under, load_efficiency, with_carried_hfu

        efficiency = load_efficiency(args.efficiency)
        check_calibrated_under(efficiency, args.efficiency, request)
        request = with_carried_hfu(efficiency, request)
    return request


def _named(**flags: bool | None) -> dict[str, bool]:
    """The flags given on the command line (a BooleanOptionalAction left out is None)."""
    return {field: value for field, value in flags.items() if value is not None}


def _deepspeed_checkpointing(args: argparse.Namespace, framework: Framework, deepspeed_file) -> dict[str, bool]:
    """TrainingSpec's DeepSpeed checkpointing fields from the flags or a --deepspeed-config file's
    activation_checkpointing block. The block acts only on models that call
    deepspeed.checkpointing (Megatron-DeepSpeed, the Megatron-LM of DeepSpeed's examples, which
    zeroplan's own model stands for); Hugging Face's Trainer checkpoints with torch's own, so
    under another framework the file's block changes nothing."""
    partition, on_host = getattr(args, "partition_activations", False), getattr(args, "checkpoint_in_cpu", False)
    if deepspeed_file is not None and framework in (Framework.megatron_deepspeed, Framework.zeroplan):
        partition = partition or deepspeed_file.partition_activations
        on_host = on_host or deepspeed_file.cpu_checkpointing
    return {"partition_activations": partition, "cpu_checkpointing": on_host}


def _deepspeed_file(args: argparse.Namespace):
    """--deepspeed-config's file as a zeroplan.specs.deepspeed_config.DeepSpeedConfig; None
    without the flag (the module is imported only with it)."""
    if getattr(args, "deepspeed_config", None) is None:
        return None
    from zeroplan.cli.deepspeed_config import deepspeed_config_from_args

    return deepspeed_config_from_args(args)


def _megatron_launch(args: argparse.Namespace):
    """MODEL's Megatron-LM arguments, applied to ``args`` (zeroplan.cli.megatron_args), where
    MODEL is a file of them; None for a preset (the reader is not imported) or a config.json."""
    from zeroplan.presets.models import is_preset_name

    model = getattr(args, "model", None)
    if model is None or is_preset_name(model):
        return None
    from zeroplan.cli.megatron_args import launch_of

    return launch_of(args)


def strategies_asked(args: argparse.Namespace) -> tuple[StrategyKind, ...] | None:
    """The strategies --strategies names, or a --deepspeed-config file's (which --strategies may
    only name); None: every one the framework runs. A Megatron-LM arguments file's
    --use-distributed-optimizer names zero1, its absence ddp."""
    _megatron_launch(args)
    kinds = parse_strategies(args.strategies)
    deepspeed_file = _deepspeed_file(args)
    if deepspeed_file is None:
        return kinds
    from zeroplan.cli.deepspeed_config import kinds_of_config

    return kinds_of_config(deepspeed_file, kinds)


def _allocator_conf(args: argparse.Namespace) -> dict[str, str | bool | None]:
    """MemoryAssumptions' allocator_conf from the flags: None (the flat reserve) under
    --flat-reserve or for a command without the allocator flags (the plan search judges
    millions of configurations on the flat reserve); left unset without --allocator-conf, so
    the framework's launch default applies (launch_allocator_conf; PyTorch's own otherwise)."""
    if getattr(args, "flat_reserve", True):
        if getattr(args, "exact_capacity", False):
            raise ZeroplanError("exact-capacity", "has no effect with --flat-reserve (no replay, no OOM capacity); drop one")
        if getattr(args, "exact_allocator", False):
            raise ZeroplanError("exact-allocator", "has no effect with --flat-reserve (no replay); drop one")
        return {"allocator_conf": None}
    exact = {"exact_capacity": True} if args.exact_capacity else {}
    if getattr(args, "exact_allocator", False):
        exact["exact_allocator"] = True
    # No default on the flag itself: argparse would not see an explicit "" beside
    # --flat-reserve as a conflict when it equals the default.
    return exact if args.allocator_conf is None else {"allocator_conf": args.allocator_conf, **exact}


DEFAULT_SELECTIVE_LAYER_INTERVAL = TrainingSpec.model_fields["selective_layer_interval"].default


def check_options_apply(args: argparse.Namespace) -> None:
    """Refuse, in one line, an option that would have no effect on the answer (a user who
    typed it expects one)."""
    selective_layer = ActivationCheckpointing.selective_layer.value
    if args.selective_layer_interval is not None and args.activation_checkpointing != selective_layer:
        raise ZeroplanError(
            "--selective-layer-interval",
            f"applies only with --activation-checkpointing {selective_layer} "
            f"(got {args.activation_checkpointing or 'no --activation-checkpointing'})",
        )


def run_fit(args: argparse.Namespace) -> int:
    return _run(args, compare=False)


def run_compare(args: argparse.Namespace) -> int:
    return _run(args, compare=True)


def _run(args: argparse.Namespace, compare: bool) -> int:
    from zeroplan.core.plan import fit

    check_options_apply(args)
    kinds = strategies_asked(args)
    check_offload_ratio(args, kinds)
    check_model_load_strategies(args, kinds)
    if args.explain is not None and kinds is not None and StrategyKind(args.explain) not in kinds:
        raise ZeroplanError("--explain", f"{args.explain!r} is not among the strategies planned "
                                         f"({','.join(k.value for k in kinds)})")
    # The base request's strategy carries the knobs; a ratio is valid on the strategies it applies to.
    request = request_from_args(args, kinds[0]) if getattr(args, "offload_ratio", None) is not None else request_from_args(args)
    report = fit(request, kinds)
    if args.format == "json":
        from zeroplan.cli.efficiency import time_basis_text

        report = report.model_copy(update={"step_time_basis": time_basis_text(args, request)})
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    elif args.format == "csv":
        sys.stdout.write(report.to_dataframe().to_csv())
    else:
        sys.stdout.write(_rendered(report, args, compare) + "\n")
        if args.explain is None:  # fit's tok/s/GPU column rests on the same basis as compare's
            from zeroplan.cli.efficiency import time_basis

            sys.stdout.write(time_basis(args, request) + "\n")
        launch = _megatron_launch(args)
        if launch is not None:
            import textwrap

            from zeroplan.cli.megatron_args import ignored_line
            from zeroplan.cli.parser import screen_width

            line = ignored_line(launch)
            wrapped = textwrap.wrap(line, screen_width(), break_on_hyphens=False)
            sys.stdout.write((line if args.detail else "\n".join(wrapped)) + "\n")
        if getattr(args, "deepspeed_config", None) is not None:
            import textwrap

            from zeroplan.cli.deepspeed_config import deepspeed_config_line
            from zeroplan.cli.parser import screen_width

            line = deepspeed_config_line(args.deepspeed_config, request)
            sys.stdout.write((line if args.detail else "\n".join(textwrap.wrap(line, screen_width()))) + "\n")
    return 0


def _rendered(report, args: argparse.Namespace, compare: bool) -> str:
    """The text view asked for: one strategy's terms, the full tables, or the first screen."""
    unit = ByteUnit(args.unit)
    if args.explain is not None:
        from zeroplan.report.explain import render_explain

        planned = [p.strategy.value for p in report.plans]
        if args.explain not in planned:
            # Without --strategies the plans are the framework's default set, which leaves out
            # the variants (zero3-nvme, zero3-hpz, ...) that only --strategies asks for.
            framework = report.training.framework
            where = "by default" if framework is Framework.zeroplan else f"for {framework.value}"
            raise ZeroplanError("--explain", f"{args.explain!r} is not planned {where} (allowed: {', '.join(planned)}; "
                                             f"or name it in --strategies)")
        return render_explain(report, args.explain, unit, screen_width())
    if args.detail and compare:
        from zeroplan.report.compare_table import render_compare_table

        return render_compare_table(report)
    if args.detail:
        from zeroplan.report.table import render_table

        return render_table(report, unit)
    from zeroplan.report.summary import render_compare_summary, render_fit_summary

    return render_compare_summary(report, screen_width()) if compare else render_fit_summary(report, unit, screen_width())
