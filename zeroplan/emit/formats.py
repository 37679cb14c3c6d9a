"""The run configurations of one planned request, one function per format. Each returns the
file's content, or raises NotApplicable with the one-line reason the format is skipped.

Nothing here imports torch or a framework: every value is read from the typed request
(zeroplan.specs) and the planner's own assumptions (StrategySpec's defaults, the buffer model
of zeroplan/core/buffers.py, the launch allocator of zeroplan.specs.framework). The versions the
formats were written against are the ones the planner's profiles were read from: DeepSpeed
0.19.8, accelerate 1.10.1, torchtitan 0.3.0, torchtune 0.6.1."""

from __future__ import annotations

import json
import shlex
from typing import Any

from zeroplan.core.buffers import optimizer_loop
from zeroplan.core.checkpoint_save import state_dict_type
from zeroplan.specs.finetune import LoraTarget, Quantization
from zeroplan.specs.framework import Framework, launch_allocator_conf
from zeroplan.specs.recipe_defaults import (
    TORCHTITAN_CONFIG_TRAINING, TORCHTUNE_CONFIG_TRAINING, torchtitan_config_name as recipe_config_name,
    torchtune_config_name,
)
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind, StrategySpec
from zeroplan.specs.training import ActivationCheckpointing, FsdpStateDict, Optimizer, OptimizerLoop, Precision


class NotApplicable(Exception):
    """A format that cannot express the planned run; the message says why, in one line."""


# ---------------------------------------------------------------------------- shared values

def allocator_conf(request: PlanRequest) -> str:
    """The PYTORCH_CUDA_ALLOC_CONF the plan assumed: the request's MemoryAssumptions.allocator_conf,
    or, where the request was judged on the flat reserve (None: the plan search), what the
    framework's own launcher sets for the node count (launch_allocator_conf); "" is PyTorch's defaults."""
    conf = request.assumptions.allocator_conf
    if conf is None:
        conf = launch_allocator_conf(request.training.framework, request.cluster.num_nodes) or ""
    return conf


def model_parallel(request: PlanRequest) -> str:
    """'' under data parallelism only, else the degrees in words ('tp=2, pp=2')."""
    p = request.parallel
    parts = [f"{name}={value}" for name, value in (("tp", p.tp), ("cp", p.cp), ("pp", p.pp), ("ep", p.ep)) if value > 1]
    return ", ".join(parts)


def _refuse_model_parallel(request: PlanRequest, what: str) -> None:
    layout = model_parallel(request)
    if layout:
        raise NotApplicable(f"{what} carries no {layout}; the planned layout runs in torchtitan (--framework torchtitan)")


# torchtitan's and torchtune's files run FSDP2 (fully_shard), as accelerate's does unless the plan
# is hf's FSDP1 (accelerate_fsdp1_config): none of them runs another FSDP1 plan.
def _refuse_fsdp1(request: PlanRequest, what: str) -> None:
    if request.strategy.kind.is_fsdp and request.strategy.fsdp1_root_stays_gathered:
        raise NotApplicable(f"{what} would run FSDP2; the plan is FSDP1's (--fsdp-version 1)")


# ---------------------------------------------------------------------------- DeepSpeed

DEEPSPEED_STRATEGIES = (StrategyKind.zero1, StrategyKind.zero2, StrategyKind.zero3, StrategyKind.zero2_offload,
                        StrategyKind.zero3_offload, StrategyKind.zero3_param_offload, StrategyKind.zero3_nvme,
                        StrategyKind.zero3_param_nvme, StrategyKind.zero3_hpz, StrategyKind.zero3_zeropp)



def runs_deepspeed(request: PlanRequest) -> bool:
    """Whether DeepSpeed's engine runs the plan: a ZeRO strategy, or ddp under DeepSpeed's state
    convention (its stage 0, zeroplan.core.deepspeed_stage0)."""
    from zeroplan.core.deepspeed_stage0 import runs_deepspeed_stage0

    return request.strategy.kind in DEEPSPEED_STRATEGIES or runs_deepspeed_stage0(request)


def _refuse_deepspeed_stage0(request: PlanRequest, what: str) -> None:
    """A file that would run torch's DDP where the plan is DeepSpeed's stage 0."""
    if request.strategy.kind is StrategyKind.ddp and runs_deepspeed(request):
        raise NotApplicable(f"{what} would run torch's DDP; the plan is DeepSpeed's stage 0 (deepspeed.json)")


NVME_PATH = "/local_nvme"
"""The swap directory written into deepspeed.json (DeepSpeed's ZeRO-Infinity tutorial's); the
emitted README says to point it at the node's drive."""


# deepspeed 0.19.8 runtime/swap_tensor/constants.py AIO_BLOCK_SIZE_DEFAULT ... AIO_USE_GDS_DEFAULT:
# the aio settings the planner's swap buffers assume (AIO_ALIGNED_BYTES x intra_op_parallelism 1,
# zeroplan.core.nvme.io_aligned_elements), written out so that the file says what was planned.
AIO_CONFIG = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
              "overlap_events": True, "use_gds": False}


def nvme_offload_blocks(request: PlanRequest) -> dict[str, Any]:
    """zero_optimization's offload blocks for zero3-nvme / zero3-param-nvme, every buffer as
    zeroplan.core.nvme counts it: the optimizer swapper's buffer_count (4, or what the pipelined
    swapper holds at once) and pipeline flags, the parameter swapper's 5 buffers of 1e8 elements
    (or the largest parameter partition, parameter_buffer_elements) and 1e9 elements kept on the host, and the strategy's sub_group_size (DeepSpeed's 1e9), which sets the swap buffers' size."""
    from zeroplan.core import nvme

    strategy = request.strategy
    blocks: dict[str, Any] = {
        "sub_group_size": strategy.deepspeed_sub_group_elements,
        "offload_optimizer": {
            "device": "nvme", "nvme_path": NVME_PATH, "pin_memory": True,
            "buffer_count": nvme.optimizer_swap_buffer_count(request),
            "pipeline_read": strategy.nvme_pipeline_read, "pipeline_write": strategy.nvme_pipeline_write,
        },
    }
    if strategy.kind.parameters_on_nvme:
        blocks["offload_param"] = {
            "device": "nvme", "nvme_path": NVME_PATH, "pin_memory": True, "buffer_count": nvme.PARAM_BUFFER_COUNT,
            "buffer_size": nvme.parameter_buffer_elements(request), "max_in_cpu": nvme.PARAM_MAX_IN_CPU,
        }
    return blocks


def deepspeed_config(request: PlanRequest) -> dict[str, Any]:
    """DeepSpeed's config (deepspeed/runtime/config.py, zero/config.py) as the planner assumed it.

    - reduce/allgather buckets: StrategySpec.zero_bucket_elements (DeepSpeed's 5e8) capped at
      the rank's trainable elements, rounded up to even (DeepSpeed requires it), as the buffer
      model counts the ipg bucket (core/buffers.py zero_reduce_bucket_bytes); uncapped under
      --framework hf, as planned there;
    - overlap_comm false and contiguous_gradients on unless StrategySpec's deepspeed_overlap_comm
      / deepspeed_contiguous_gradients say otherwise; reduce_scatter and the multi-rank bucket
      all-reduce on: the collectives core/deepspeed_buckets.py counts and the setting every
      DeepSpeed record of benchmarks/ was measured under (harness/deepspeed_engine.py);
    - stage 3: StrategySpec.prefetch_units units gathered ahead (stage3_prefetch_bucket_size in
      elements of the largest unit), every parameter sharded (param_persistence_threshold 0)
      and released after use (max_reuse_distance 0), and at most the current unit and the
      prefetched ones resident (stage3_max_live_parameters, (1 + prefetch_units) largest
      units): the gathers of core/buffers.py gathered_unit_bytes. The last bound is needed:
      DeepSpeed 0.19.8's prefetch (runtime/zero/partitioned_param_coordinator.py,
      _fetch_sub_module_impl) takes up to stage3_prefetch_bucket_size more elements at every
      module fetch, bounded only by max_live_parameters less those resident (default 1e9), and
      marks each resident parameter its scan passes over as needed at that later use, which
      __params_to_release then keeps: unbounded, the scan runs into the backward's entries
      within the forward, and every parameter gathered in the forward stays gathered until its
      backward (measured on tiny-llama: nothing but the embedding released in the forward).
      Where the strategy sets these four (a --deepspeed-config file), or under hf (DeepSpeed's
      defaults: accelerate and the Trainer write none), the file carries the values planned.
    - offload: optimizer (and for zero3-param-offload parameters) on the CPU, unpinned
      (pin_memory false, set explicitly: DeepSpeed 0.19.8's default is true,
      runtime/zero/offload_config.py);
    - NVMe (zero3-nvme, zero3-param-nvme): device "nvme" at NVME_PATH, the aio block and the
      swappers' buffers as planned (nvme_offload_blocks);
    - ZeRO++ (zero3-hpz, zero3-zeropp): zero_hpz_partition_size, the secondary partition's group
      as planned (PlanRequest.hpz_group_size, core/zero3_groups.py), and for zero3-zeropp
      zero_quantized_weights and zero_quantized_gradients (qwZ, qgZ: core/zeropp.py), the three
      keys of DeepSpeed's ZeRO++ tutorial (runtime/zero/config.py DeepSpeedZeroConfig);
    - activation_checkpointing: partition_activations and cpu_checkpointing where the plan placed
      the checkpointed block inputs by them (core/deepspeed_checkpointing.py)."""
    kind = request.strategy.kind
    if not runs_deepspeed(request):
        if kind is StrategyKind.ddp:
            raise NotApplicable("ddp is planned as torch's DDP; DeepSpeed's stage 0 is ddp under --state-convention deepspeed")
        raise NotApplicable(f"{kind.value} is not a DeepSpeed ZeRO strategy")
    _refuse_model_parallel(request, "DeepSpeed's ZeRO config")
    precision = request.training.precision
    if precision is Precision.bf16_pure:
        raise NotApplicable("DeepSpeed keeps an fp32 master copy; bf16-pure (no fp32 copy) has no DeepSpeed config")
    if kind is StrategyKind.ddp:
        # Stage 0 reads no ZeRO key; no optimizer block, so the script's torch optimizer runs
        # under FP16_UnfusedOptimizer as planned (zeroplan.specs.deepspeed_config _check_stage0).
        return {"train_micro_batch_size_per_gpu": request.batch.micro_batch_size,
                "gradient_accumulation_steps": request.batch.grad_accum_steps,
                "bf16": {"enabled": precision is Precision.bf16_mixed},
                "fp16": {"enabled": precision is Precision.fp16_mixed},
                "zero_optimization": {"stage": 0}}
    from zeroplan.core.parallel.units import rank_trainable_elements

    trainable = rank_trainable_elements(request)
    buckets = min(request.strategy.zero_bucket_elements, trainable + trainable % 2)
    if request.training.framework is Framework.hf:
        # Planned uncapped under hf (core/deepspeed_accumulation.py _bucket_elements): the
        # config says what was planned.
        buckets = request.strategy.zero_bucket_elements
    zero: dict[str, Any] = {
        "stage": kind.zero_stage,
        "reduce_bucket_size": buckets,
        "allgather_bucket_size": buckets,
        # StrategySpec's DeepSpeed switches (unset overlap_comm: off, what the records ran).
        "overlap_comm": bool(request.strategy.deepspeed_overlap_comm),
        "contiguous_gradients": request.strategy.deepspeed_contiguous_gradients,
        "reduce_scatter": True,
        "use_multi_rank_bucket_allreduce": True,
    }
    if kind.zero_stage == 3:
        from zeroplan.core import deepspeed_coordinator as planned

        # The values the step was planned with: the strategy's (a --deepspeed-config file's),
        # else under hf DeepSpeed's defaults, else the bounds described above.
        zero.update({
            "stage3_prefetch_bucket_size": planned.prefetch_bucket_elements(request),
            "stage3_param_persistence_threshold": planned.persistence_threshold(request),
            "stage3_max_reuse_distance": planned.max_reuse_distance(request),
            "stage3_max_live_parameters": planned.max_live_parameters(request),
        })
        if request.strategy.deepspeed_sub_group_elements != StrategySpec.model_fields["deepspeed_sub_group_elements"].default:
            zero["sub_group_size"] = request.strategy.deepspeed_sub_group_elements
    if kind.uses_hpz:
        zero["zero_hpz_partition_size"] = request.hpz_group_size
    if kind.quantizes_communication:
        zero.update({"zero_quantized_weights": True, "zero_quantized_gradients": True})
    if kind.optimizer_on_nvme:
        zero.update(nvme_offload_blocks(request))
    else:
        if kind.offloads_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
            if request.strategy.offload_optimizer_ratio is not None:
                # ZeRO-Offload++'s share of the sub-groups on the host, as planned
                # (zeroplan.core.deepspeed_partial_offload).
                zero["offload_optimizer"]["ratio"] = request.strategy.offload_optimizer_ratio
        if kind.offloads_parameters:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": request.batch.micro_batch_size,
        "gradient_accumulation_steps": request.batch.grad_accum_steps,
        "bf16": {"enabled": precision is Precision.bf16_mixed},
        "fp16": {"enabled": precision is Precision.fp16_mixed},
        "zero_optimization": zero,
    }
    if kind.optimizer_on_nvme:
        config["aio"] = dict(AIO_CONFIG)
    training = request.training
    if training.partition_activations or training.cpu_checkpointing:
        # What the planner placed the checkpointed block inputs by (core/deepspeed_checkpointing.py);
        # read by models that call deepspeed.checkpointing.configure with this file.
        config["activation_checkpointing"] = {"partition_activations": training.partition_activations,
                                              "cpu_checkpointing": training.cpu_checkpointing}
    adam = training.optimizer in (Optimizer.adamw, Optimizer.adam)
    if kind.offloads_optimizer:
        # ZeRO-Offload steps on the host with DeepSpeedCPUAdam, which DeepSpeed builds from
        # this block (runtime/engine.py _configure_basic_optimizer); lr etc. are the user's.
        # Another planned optimizer is not written as AdamW: that file would step two fp32
        # states a parameter the plan did not count (and fit --deepspeed-config refuses it
        # beside --optimizer lion, sgd or adafactor).
        if not adam:
            raise NotApplicable(f"its offload_optimizer block would name DeepSpeed's CPU AdamW, not the planned "
                                f"{training.optimizer.value}")
        config["optimizer"] = {"type": "AdamW", "params": {}}
    elif not adam:
        # Without an optimizer block the script's own optimizer runs, and under ZeRO DeepSpeed
        # asserts on one outside ZERO_SUPPORTED_OPTIMIZERS (torch's Adam/AdamW, its fused and
        # CPU ones, Adagrad, Lion's fused: runtime/zero/utils.py) unless the file allows it
        # (runtime/engine.py _do_optimizer_sanity_check, 0.19.8 lines 2294-2301); HF's Trainer
        # sets the key itself, other scripts read it from this file.
        config["zero_allow_untested_optimizer"] = True
    return config


def deepspeed_json(request: PlanRequest) -> str:
    return json.dumps(deepspeed_config(request), indent=2) + "\n"


# ---------------------------------------------------------------------------- accelerate

def yaml_text(mapping: dict[str, Any], indent: int = 0) -> str:
    """A YAML block mapping of scalars and nested mappings (strings double-quoted, which YAML
    reads as JSON strings): the few shapes accelerate's config takes, without a YAML library."""
    lines = []
    for key, value in mapping.items():
        pad = " " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(yaml_text(value, indent + 2).rstrip("\n"))
        elif isinstance(value, bool):
            lines.append(f"{pad}{key}: {'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            lines.append(f"{pad}{key}: {value}")
        else:
            lines.append(f"{pad}{key}: {json.dumps(str(value))}")
    return "\n".join(lines) + "\n"


ACCELERATE_MIXED_PRECISION = {Precision.fp32: "no", Precision.bf16_mixed: "bf16", Precision.fp16_mixed: "fp16"}


def accelerate_config(request: PlanRequest, deepspeed_file: str = "deepspeed.json") -> dict[str, Any]:
    """accelerate 1.10.1's config file (commands/config/config_args.py ClusterConfig): FSDP2
    (fsdp_version 2, reshard_after_forward for full shard vs shard-grad-op, HSDP through
    parallelism_config's dp_replicate/dp_shard sizes), hf's FSDP1 where the plan is
    (accelerate_fsdp1_config), DeepSpeed through the JSON beside it, or DDP (MULTI_GPU)."""
    framework = request.training.framework
    if framework not in (Framework.hf, Framework.zeroplan):
        raise NotApplicable(f"framework {framework.value} is not launched through accelerate")
    _refuse_model_parallel(request, "the accelerate config")
    precision = request.training.precision
    if precision not in ACCELERATE_MIXED_PRECISION:
        raise NotApplicable(f"accelerate's mixed_precision has no {precision.value} (allowed: no, bf16, fp16)")
    kind = request.strategy.kind
    cluster = request.cluster
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU",
        "mixed_precision": ACCELERATE_MIXED_PRECISION[precision],
        "num_machines": cluster.num_nodes,
        "num_processes": cluster.world_size,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static" if cluster.num_nodes == 1 else "c10d",
        "same_network": True,
        "use_cpu": False,
    }
    checkpointing = request.training.activation_checkpointing
    if checkpointing not in (ActivationCheckpointing.none, ActivationCheckpointing.full):
        raise NotApplicable(f"accelerate checkpoints whole blocks (full) or none, not {checkpointing.value}")
    if kind.is_fsdp and request.strategy.fsdp1_root_stays_gathered:
        config.update(distributed_type="FSDP", fsdp_config=accelerate_fsdp1_config(request))
    elif kind.is_fsdp:
        fsdp: dict[str, Any] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": kind is not StrategyKind.fsdp_shard_grad_op,
            "fsdp_offload_params": request.training.fsdp_cpu_offload,
            "fsdp_activation_checkpointing": checkpointing is ActivationCheckpointing.full,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
        }
        config.update(distributed_type="FSDP", fsdp_config=fsdp)
        if kind is StrategyKind.hsdp:
            shard = request.shard_group_size
            config["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": request.state_group_size // shard,
                "parallelism_config_dp_shard_size": shard,
            }
    elif runs_deepspeed(request):
        deepspeed_config(request)  # the same refusals as the JSON it points at
        config.update(distributed_type="DEEPSPEED", deepspeed_config={
            "deepspeed_config_file": deepspeed_file,
            "zero3_init_flag": kind.zero_stage == 3,
        })
        # accelerate takes mixed precision from the DeepSpeed JSON when a file is given.
        del config["mixed_precision"]
    elif cluster.world_size == 1:
        config.update(distributed_type="NO", num_processes=1)
    return config


ACCELERATE_FSDP1_SHARDING = {StrategyKind.fsdp_full_shard: "FULL_SHARD", StrategyKind.fsdp_shard_grad_op: "SHARD_GRAD_OP"}
"""The planned strategies under hf's FSDP1 (specs.request.HF_FSDP1_STRATEGIES) -> accelerate 1.10.1's
FSDP_SHARDING_STRATEGY name (utils/constants.py line 38)."""


# accelerate 1.10.1, fsdp_version 1. `accelerate launch` turns each fsdp_config key into an FSDP_*
# variable (commands/launch.py lines 1087-1098 copy fsdp_config.x to args.fsdp_x; utils/launch.py
# lines 304-330 prepare_multi_gpu_env) that FullyShardedDataParallelPlugin.__post_init__ reads
# (utils/dataclasses.py lines 1761-1954), and Accelerator.prepare_model hands the plugin to
# FullyShardedDataParallel (accelerator.py lines 1850-1889). What each key must say for the plan:
# - fsdp_sharding_strategy: launch always sets FSDP_SHARDING_STRATEGY (utils/launch.py line 313, default
#   FULL_SHARD, commands/launch.py line 541), __post_init__ reads it whenever fsdp_version is 1
#   (dataclasses.py lines 1782-1791) and prepare_model prefers it to reshard_after_forward
#   (accelerator.py line 1865): the strategy is named here, not only in fsdp_reshard_after_forward,
#   which `accelerate config` writes for FSDP1 (commands/config/cluster.py lines 405-411) and which
#   is written beside it with the same value.
# - fsdp_backward_prefetch NO_PREFETCH (None, dataclasses.py lines 1832-1833) and
#   fsdp_forward_prefetch false: no unit gathered ahead, the Trainer's defaults the planner assumes
#   (PlanRequest._accelerate_fsdp1_settings; transformers 4.56.2 training_args.py lines
#   2020-2022). Absent, launch sets no FSDP_BACKWARD_PREFETCH and the plugin's None is the same; the
#   file says it rather than rely on that.
# - fsdp_use_orig_params true (dataclasses.py lines 1876-1877; False where absent): the
#   use_orig_params views of the gathered root whose gradients backward concatenates
#   (core.buffers._fsdp1_root_cats_gradients).
# - fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap: one
#   unit per decoder layer of the model's own class, read from model._no_split_modules
#   (set_auto_wrap_policy, dataclasses.py lines 2011-2016), as the measured step wraps it
#   (zeroplan.frameworks.hf_fsdp1_step.hf_fsdp1_wrap) and whatever the Llama-layout model's class
#   is called (LlamaDecoderLayer, MistralDecoderLayer).
# - fsdp_cpu_ram_efficient_loading true needs fsdp_sync_module_states true (launch.py lines 306-307
#   refuse it otherwise); the broadcast at wrapping leaves nothing behind
#   (hf_fsdp1_step.SYNC_MODULE_STATES_NOTE).
# - fsdp_offload_params false (check_hf_fsdp1 refuses CPUOffload), fsdp_activation_checkpointing
#   for full recomputation, mixed_precision bf16 at the top level (set_mixed_precision: param,
#   reduce and buffer dtype bf16, as measured).
ACCELERATE_STATE_DICT_TYPES = {FsdpStateDict.full: "FULL_STATE_DICT", FsdpStateDict.sharded: "SHARDED_STATE_DICT",
                               FsdpStateDict.none: "FULL_STATE_DICT"}
"""accelerate's fsdp_state_dict_type of each planned save (none: the run saves nothing, and
accelerate's own default stands)."""


def accelerate_fsdp1_config(request: PlanRequest) -> dict[str, Any]:
    """accelerate's fsdp_config for hf under FSDP1 (StrategySpec.fsdp1_root_stays_gathered)."""
    kind = request.strategy.kind
    if request.training.framework is not Framework.hf:
        # The reference model's FSDP1 is the harness's torch-fsdp1 engine (its prefetch and
        # wrapping are not accelerate's): planned under --framework hf, accelerate's is written.
        raise NotApplicable(f"accelerate's FSDP1 is planned under --framework hf; this FSDP1 plan is "
                            f"{request.training.framework.value}'s (--fsdp-version 1)")
    if kind not in ACCELERATE_FSDP1_SHARDING:
        raise NotApplicable(f"hf's FSDP1 was planned for {', '.join(k.value for k in ACCELERATE_FSDP1_SHARDING)}, "
                            f"not {kind.value}")
    if request.strategy.prefetch_units:
        raise NotApplicable(f"the plan prefetches {request.strategy.prefetch_units} FSDP1 unit(s); accelerate's FSDP1 "
                            "was planned with the Trainer's NO_PREFETCH (allowed: prefetch_units 0)")
    sharding = ACCELERATE_FSDP1_SHARDING[kind]
    return {
        "fsdp_version": 1,
        "fsdp_sharding_strategy": sharding,
        "fsdp_reshard_after_forward": sharding,
        "fsdp_offload_params": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_backward_prefetch": "NO_PREFETCH",
        "fsdp_forward_prefetch": False,
        "fsdp_use_orig_params": True,
        # The checkpoint save planned (zeroplan.core.checkpoint_save: accelerate's FULL_STATE_DICT
        # unless the request names another).
        "fsdp_state_dict_type": ACCELERATE_STATE_DICT_TYPES[state_dict_type(request)],
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_sync_module_states": True,
        "fsdp_activation_checkpointing": request.training.activation_checkpointing is ActivationCheckpointing.full,
    }


def accelerate_yaml(request: PlanRequest) -> str:
    return yaml_text(accelerate_config(request))


def hf_training_arguments(request: PlanRequest) -> list[str]:
    """transformers 4.56.2 TrainingArguments flags of the planned run (HfArgumentParser names)."""
    training, batch = request.training, request.batch
    args = [f"--per_device_train_batch_size {batch.micro_batch_size}", f"--gradient_accumulation_steps {batch.grad_accum_steps}"]
    if training.precision is Precision.bf16_mixed:
        args.append("--bf16")
    elif training.precision is Precision.fp16_mixed:
        args.append("--fp16")
    if training.activation_checkpointing is ActivationCheckpointing.full and not request.strategy.kind.is_fsdp:
        args.append("--gradient_checkpointing")  # under FSDP, fsdp_activation_checkpointing does it
    if runs_deepspeed(request):
        args.append("--deepspeed deepspeed.json")
    if training.fused_linear_cross_entropy:
        args.append("--use_liger_kernel")
    if training.compile:
        args.append("--torch_compile")
    args.append("--skip_memory_metrics False")  # the train metrics zeroplan validate --from-log reads
    return args


# fairseq c6006678 fairseq/dataclass/configs.py (CommonConfig --fp16; DistributedTrainingConfig
# --ddp-backend c10d | fully_sharded, --no-reshard-after-forward, --cpu-offload; DatasetConfig
# --batch-size; OptimizationConfig --update-freq), models/transformer_lm.py
# --checkpoint-activations and tasks/language_modeling.py --tokens-per-sample, as the
# fully-sharded README's commands pass them; --optimizer cpu_adam steps the offloaded states.
def fairseq_train_arguments(request: PlanRequest) -> list[str]:
    """fairseq-train flags of the planned run (DATA_BIN and --arch are the user's)."""
    training, batch, kind = request.training, request.batch, request.strategy.kind
    _refuse_deepspeed_stage0(request, "fairseq")
    args = ["DATA_BIN", "--task language_modeling", f"--tokens-per-sample {batch.seq_len}",
            f"--batch-size {batch.micro_batch_size}", f"--update-freq {batch.grad_accum_steps}",
            "--ddp-backend " + ("c10d" if kind is StrategyKind.ddp else "fully_sharded")]
    if kind is StrategyKind.fsdp_shard_grad_op:
        args.append("--no-reshard-after-forward")
    if training.precision is Precision.fp16_mixed:
        args.append("--fp16")
    if training.activation_checkpointing is ActivationCheckpointing.full:
        args.append("--checkpoint-activations")
    if training.fsdp_cpu_offload:
        args += ["--cpu-offload", "--optimizer cpu_adam"]
    else:
        args.append("--optimizer adam")
    return args


# ---------------------------------------------------------------------------- torchtitan

TORCHTITAN_STRATEGIES = (StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op, StrategyKind.hsdp, StrategyKind.ddp)

TORCHTITAN_CHECKPOINTING = {
    ActivationCheckpointing.none: "none",
    ActivationCheckpointing.full: "full",
    ActivationCheckpointing.selective_op: "selective",
}
"""zeroplan's policy -> torchtitan 0.3.0's activation_checkpoint subcommand
(distributed/activation_checkpoint.py ActivationCheckpointingConfig)."""

YOUR_CONFIG_FUNCTION = "YOUR_CONFIG_FUNCTION"
"""The `--config` of a request no shipped torchtitan configuration trains as planned (the user's own)."""


# torchtitan 0.3.0 builds its float8 converters inside the config function's model_spec
# (models/llama3/config_registry.py llama3_405b lines 300-310: Float8LinearConverter.Config with
# filter_fqns ["lm_head"]), a list of converter configs its command line (tyro over
# Trainer.Config, config/manager.py) does not set: a plan whose float8 is not what the
# configuration converts runs only from a config function of the user's own.
def torchtitan_config_name(request: PlanRequest) -> str:
    """The 0.3.0 config function (`--config`) that runs the plan: the model's shipped one where it
    converts the linears to float8 as planned, else YOUR_CONFIG_FUNCTION."""
    config = recipe_config_name(request.model.name, request.training.torchtitan_release)
    if config is None:
        return YOUR_CONFIG_FUNCTION
    settings = TORCHTITAN_CONFIG_TRAINING.get(config, {})
    training = request.training
    converts = (settings.get("float8"), bool(settings.get("float8_skips_output")))
    planned = (training.float8, training.float8_skips_output if training.float8 is not None else False)
    return config if converts == planned else YOUR_CONFIG_FUNCTION


def torchtitan_module(request: PlanRequest) -> str:
    """torchtitan 0.3.0's --module of the model's code: models/qwen3 for Qwen3, models/llama3 otherwise
    (the config functions are named after their module: llama3_8b, qwen3_0_6b)."""
    return "qwen3" if request.model.name.startswith("qwen3") else "llama3"


def torchtitan_overrides(request: PlanRequest) -> list[str]:
    """torchtitan 0.3.0's command-line overrides (config/manager.py ConfigManager: tyro over
    Trainer.Config; `--section.field value`, booleans as `--section.field` /
    `--section.no-field`, the activation_checkpoint policy a subcommand that comes last).
    torchtitan 0.3.0 reads no TOML: its configs are Python functions (--module/--config)."""
    framework = request.training.framework
    if framework not in (Framework.torchtitan, Framework.zeroplan):
        raise NotApplicable(f"framework {framework.value} is not torchtitan")
    kind = request.strategy.kind
    if kind not in TORCHTITAN_STRATEGIES:
        raise NotApplicable(f"torchtitan runs no {kind.value} (it runs FSDP2, HSDP and DDP)")
    _refuse_fsdp1(request, "torchtitan")
    _refuse_deepspeed_stage0(request, "torchtitan")
    training, batch, p = request.training, request.batch, request.parallel
    checkpointing = TORCHTITAN_CHECKPOINTING.get(training.activation_checkpointing)
    if checkpointing is None:
        raise NotApplicable(f"torchtitan 0.3.0 has no {training.activation_checkpointing.value} checkpointing")
    if training.precision is Precision.fp16_mixed:
        raise NotApplicable("torchtitan 0.3.0 trains in bf16 or fp32, not fp16")
    if not training.finetune.trains_everything:
        raise NotApplicable("torchtitan 0.3.0 has no LoRA or frozen-parameter option")
    if training.torchtitan_release is not None and training.torchtitan_release != "0.3.0":
        # 9dec370 read TOML job configs with other keys; these overrides are 0.3.0's.
        raise NotApplicable(f"the overrides are torchtitan 0.3.0's, not {training.torchtitan_release}'s")
    dp = request.data_parallel_size
    if kind is StrategyKind.ddp:
        replicate, shard = dp, 1
    elif kind is StrategyKind.hsdp:
        if request.shard_group_size % p.cp:
            raise NotApplicable(f"torchtitan shards over dp_shard x cp; the shard group {request.shard_group_size} "
                                f"is not a multiple of cp={p.cp}")
        shard = request.shard_group_size // p.cp
        replicate = dp // shard
    else:
        replicate, shard = 1, dp
    args = [
        f"--parallelism.data_parallel_replicate_degree {replicate}",
        f"--parallelism.data_parallel_shard_degree {shard}",
        f"--parallelism.fsdp_reshard_after_forward {'never' if kind is StrategyKind.fsdp_shard_grad_op else 'default'}",
        f"--parallelism.tensor_parallel_degree {p.tp}",
    ]
    if p.tp > 1:
        args.append("--parallelism.enable_sequence_parallel" if p.sequence_parallel else "--parallelism.no-enable_sequence_parallel")
    args += [f"--parallelism.context_parallel_degree {p.cp}", f"--parallelism.pipeline_parallel_degree {p.pp}"]
    if p.ep > 1:
        args.append(f"--parallelism.expert_parallel_degree {p.ep}")
    if p.pp > 1:
        # Micro-batches flow through the pipeline: torchtitan's local batch is all of them
        # (pipeline_parallel.py: n_microbatches = local_batch_size // microbatch_size).
        local = batch.micro_batch_size * batch.grad_accum_steps
        args += [f"--parallelism.pipeline_parallel_schedule {p.pp_schedule.torch_name}",
                 f"--parallelism.pipeline_parallel_microbatch_size {batch.micro_batch_size}"]
        if p.virtual_stages > 1:
            stages = p.pp * p.virtual_stages
            if request.model.num_layers % stages:
                raise NotApplicable(f"{request.model.num_layers} layers do not split into {stages} equal stages "
                                    "(pipeline_parallel_layers_per_stage)")
            args.append(f"--parallelism.pipeline_parallel_layers_per_stage {request.model.num_layers // stages}")
        global_batch = local * dp
    else:
        local = batch.micro_batch_size
        global_batch = local * batch.grad_accum_steps * dp
    args += [f"--training.local_batch_size {local}", f"--training.global_batch_size {global_batch}",
             f"--training.seq_len {batch.seq_len}"]
    if training.precision is Precision.bf16_pure:
        args += ["--training.dtype bfloat16", "--training.mixed_precision_param bfloat16"]
    else:
        param = "bfloat16" if training.precision is Precision.bf16_mixed else "float32"
        args += ["--training.dtype float32", f"--training.mixed_precision_param {param}"]
    args.append("--training.enable_cpu_offload" if training.fsdp_cpu_offload else "--training.no-enable_cpu_offload")
    args.append("--compile.enable" if training.compile else "--compile.no-enable")
    # config/configs.py CompileConfig.enable_async_tensor_parallel (llama3_405b's config sets it):
    # said either way, so the run pipelines its tensor-parallel collectives as planned.
    args.append("--compile.enable_async_tensor_parallel" if p.async_tp else "--compile.no-enable_async_tensor_parallel")
    args.append(f"activation_checkpoint:{checkpointing}")
    return args


def torchtitan_text(request: PlanRequest) -> str:
    return "\n".join(torchtitan_overrides(request)) + "\n"


# ---------------------------------------------------------------------------- torchtune

TORCHTUNE_DTYPE = {Precision.bf16_pure: "bf16", Precision.fp32: "fp32"}
YOUR_CONFIG = "YOUR_CONFIG.yaml"
"""The `--config` of a request no shipped configuration trains (the user's own)."""


def torchtune_recipe(request: PlanRequest) -> tuple[str, str]:
    """(recipe, config) of torchtune 0.6.1's `tune run`."""
    finetune = request.training.finetune
    single = request.cluster.world_size == 1
    kind = "lora" if finetune.is_lora else "full"
    recipe = f"{kind}_finetune_{'single_device' if single else 'distributed'}"
    config = torchtune_config_name(request.model.name, finetune.is_lora, finetune.quantize is Quantization.nf4, single)
    # Only the configurations 0.6.1 ships (no 70B single-device one, QLoRA distributed for 405B alone).
    return recipe, config or YOUR_CONFIG


# The optimizer components torchtune 0.6.1's configurations build (recipes/configs/*.yaml
# `optimizer: _component_`), by the planner's optimizer and whether it is paged.
TORCHTUNE_OPTIMIZERS: dict[tuple[Optimizer, bool], str] = {
    (Optimizer.adamw, False): "torch.optim.AdamW",
    (Optimizer.adamw, True): "bitsandbytes.optim.PagedAdamW",
    (Optimizer.adam_8bit, False): "bitsandbytes.optim.AdamW8bit",
    (Optimizer.adam_8bit, True): "bitsandbytes.optim.PagedAdamW8bit",
}
TORCH_ADAMW = TORCHTUNE_OPTIMIZERS[Optimizer.adamw, False]


def _torchtune_config_optimizer(config: str) -> tuple[str, OptimizerLoop | None]:
    """The component a shipped configuration builds and, for torch's AdamW, the loop its
    `fused` key sets (recipe_defaults.TORCHTUNE_CONFIG_TRAINING's entries; every other
    configuration builds torch.optim.AdamW with fused: True)."""
    settings = TORCHTUNE_CONFIG_TRAINING.get(config, {})
    component = TORCHTUNE_OPTIMIZERS[settings.get("optimizer", Optimizer.adamw), bool(settings.get("paged_optimizer"))]
    loop = settings.get("optimizer_loop", OptimizerLoop.fused) if component == TORCH_ADAMW else None
    return component, loop


def torchtune_optimizer_overrides(request: PlanRequest, config: str | None) -> list[str]:
    """The overrides that make the configuration build the planned optimizer: its component
    where it is not the configuration's, and torch AdamW's fused or foreach flag (a
    bitsandbytes optimizer takes neither, so a configuration's `fused` key is removed with
    config/_utils.py's `~key`); none where the configuration already builds it. ``config``:
    the shipped configuration, None for the user's own (its optimizer is not known, so the
    component is always named)."""
    training = request.training
    component = TORCHTUNE_OPTIMIZERS.get((training.optimizer, training.paged_optimizer))
    if component is None:
        raise NotApplicable(f"torchtune's configurations build AdamW (torch's or bitsandbytes' 8-bit, paged or not), "
                            f"not {training.optimizer.value}")
    # The loop the plan stepped (core.buffers.optimizer_loop: the request's, else its stack's).
    loop = optimizer_loop(request) if component == TORCH_ADAMW else None
    built = _torchtune_config_optimizer(config) if config is not None else None
    if built == (component, loop):
        return []
    args = [f"optimizer={component}"]
    if loop is not None:
        # torch/optim/adamw.py: fused=True runs _fused_adamw; foreach=False the per-tensor loop.
        args += [f"optimizer.fused={loop is OptimizerLoop.fused}", *(["optimizer.foreach=False"] if loop is OptimizerLoop.for_loop else [])]
    elif built is not None and built[0] == TORCH_ADAMW:
        args.append("~optimizer.fused")
    return args


def torchtune_overrides(request: PlanRequest) -> list[str]:
    """torchtune 0.6.1's key=value overrides (config/_parse.py TuneRecipeArgumentParser, merged
    by config/_utils.py _merge_yaml_and_cli_args), the keys recipes/full_finetune_distributed.py
    and lora_finetune_distributed.py read."""
    framework = request.training.framework
    if framework not in (Framework.torchtune, Framework.zeroplan):
        raise NotApplicable(f"framework {framework.value} is not torchtune")
    kind = request.strategy.kind
    single = request.cluster.world_size == 1
    if not single and kind not in (StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op):
        raise NotApplicable(f"torchtune's distributed recipes run FSDP2 only, not {kind.value}")
    _refuse_model_parallel(request, "torchtune's recipes")
    _refuse_fsdp1(request, "torchtune's recipes")
    training, batch = request.training, request.batch
    dtype = TORCHTUNE_DTYPE.get(training.precision)
    if dtype is None:
        raise NotApplicable(f"torchtune trains in bf16 or fp32 throughout (dtype), not {training.precision.value}")
    if training.finetune.quantize not in (Quantization.none, Quantization.nf4):
        raise NotApplicable(f"torchtune's QLoRA quantizes to nf4, not {training.finetune.quantize.value}")
    if training.keep_outputs:
        # zeroplan.core.kv_cache.torchtune_kept_logits_bytes: the recipes' loop before August 2024.
        raise NotApplicable("the overrides are torchtune 0.6.1's, whose recipes free the logits before backward "
                            "(keep_outputs plans the loop of its 2024 recipes)")
    args = [f"batch_size={batch.micro_batch_size}", f"gradient_accumulation_steps={batch.grad_accum_steps}",
            f"tokenizer.max_seq_len={batch.seq_len}", f"dtype={dtype}"]
    checkpointing = training.activation_checkpointing
    if checkpointing is ActivationCheckpointing.selective_layer:
        args += ["enable_activation_checkpointing=False", "ac_mode=selective", f"ac_option={training.selective_layer_interval}"]
    elif checkpointing in (ActivationCheckpointing.none, ActivationCheckpointing.full):
        args.append(f"enable_activation_checkpointing={checkpointing is ActivationCheckpointing.full}")
    else:
        raise NotApplicable(f"torchtune 0.6.1 has no {checkpointing.value} checkpointing")
    args.append(f"enable_activation_offloading={training.activation_offloading}")
    if not single:
        args += [f"fsdp_reshard_after_forward={kind is not StrategyKind.fsdp_shard_grad_op}",
                 f"fsdp_cpu_offload={training.fsdp_cpu_offload}"]
    args += [f"optimizer_in_bwd={training.optimizer_in_backward}", f"compile={training.compile}"]
    config = torchtune_recipe(request)[1]
    args += torchtune_optimizer_overrides(request, None if config == YOUR_CONFIG else config)
    if training.finetune.is_lora:
        args.append(f"model.lora_rank={training.finetune.lora_rank}")
        if training.finetune.lora_alpha is not None:
            args.append(f"model.lora_alpha={training.finetune.lora_alpha:g}")
    if training.unchunked_loss:
        args.append("loss=torch.nn.CrossEntropyLoss")
    args.append("log_peak_memory_stats=True")  # the Step lines zeroplan validate --from-log reads
    return args


def torchtune_text(request: PlanRequest) -> str:
    return "\n".join(torchtune_overrides(request)) + "\n"


# ---------------------------------------------------------------------------- litgpt

LITGPT_PRECISION = {Precision.bf16_pure: "bf16-true", Precision.bf16_mixed: "bf16-mixed",
                    Precision.fp16_mixed: "16-mixed", Precision.fp32: "32-true"}
"""litgpt 0.4.13.dev1 finetune/*.py setup(precision): Fabric's names of the planned numerics."""

_LITGPT_LORA_FLAGS = (("lora_query", (LoraTarget.q,)), ("lora_key", (LoraTarget.k,)), ("lora_value", (LoraTarget.v,)),
                      ("lora_projection", (LoraTarget.o,)), ("lora_mlp", (LoraTarget.gate, LoraTarget.up, LoraTarget.down)),
                      ("lora_head", (LoraTarget.output,)))


# litgpt 0.4.13.dev1 (commit 00af8b0): __main__.py's finetune_full and finetune_lora commands;
# args.py TrainArgs.gradient_accumulation_iters(devices) divides global_batch_size by the
# per-node `devices` and the micro-batch (not by the world size); finetune/lora.py setup's
# lora_* switches (lora_mlp wraps every MLP linear at once) and its quantize "bnb.nf4" or
# "bnb.nf4-dq" (lightning's _NF4Linear / _NF4DQLinear: double quantization with -dq).
def litgpt_command(request: PlanRequest) -> str:
    """The litgpt command line of the planned run (the checkpoint directory left to fill in)."""
    training, batch, cluster = request.training, request.batch, request.cluster
    finetune = training.finetune
    _refuse_deepspeed_stage0(request, "litgpt")
    if finetune.frozen_blocks or finetune.freeze_embeddings or finetune.dora:
        raise NotApplicable("litgpt's finetune scripts freeze no blocks or embeddings alone and train no DoRA")
    # finetune/*.py setup: FSDPStrategy(activation_checkpointing_policy={Block}) on more than one
    # device, strategy "auto" without checkpointing on one; neither is a command-line choice.
    sharded = request.strategy.kind is not StrategyKind.ddp
    if sharded != (training.activation_checkpointing is ActivationCheckpointing.full) or (
            cluster.world_size > 1) != sharded:
        raise NotApplicable("litgpt checkpoints every block under FSDP on several GPUs and none on one "
                            "(allowed: --activation-checkpointing full with fsdp-full-shard, none with ddp on one GPU)")
    global_batch = batch.micro_batch_size * batch.grad_accum_steps * cluster.gpus_per_node
    args = [f"--devices {cluster.gpus_per_node}", f"--num_nodes {cluster.num_nodes}",
            f"--precision {LITGPT_PRECISION[training.precision]}", f"--train.micro_batch_size {batch.micro_batch_size}",
            f"--train.global_batch_size {global_batch}", f"--train.max_seq_length {batch.seq_len}"]
    if not finetune.is_lora:
        return "litgpt finetune_full checkpoints/YOUR_MODEL " + " ".join(args)
    targets = set(finetune.targets(training.framework))
    args += [f"--lora_r {finetune.lora_rank}", f"--lora_alpha {finetune.lora_rank * finetune.scaling:g}",
             f"--lora_dropout {finetune.lora_dropout:g}"]
    for flag, wrapped in _LITGPT_LORA_FLAGS:
        if flag == "lora_mlp" and not request.model.mlp.gated:
            wrapped = (LoraTarget.up, LoraTarget.down)  # GptNeoxMLP's fc and proj
        present = [t in targets for t in wrapped]
        if any(present) and not all(present):
            raise NotApplicable("litgpt's lora_mlp wraps every MLP linear or none (allowed: "
                                f"{', '.join(t.value for t in wrapped)} together)")
        args.append(f"--{flag} {str(all(present)).lower()}")
    if finetune.quantize is Quantization.nf4:
        args.append(f"--quantize bnb.nf4{'-dq' if finetune.double_quant else ''}")
    elif finetune.quantize is not Quantization.none:
        raise NotApplicable(f"this plan's {finetune.quantize.value} base is not one of litgpt's bnb.nf4 settings")
    return "litgpt finetune_lora checkpoints/YOUR_MODEL " + " ".join(args)


# ---------------------------------------------------------------------------- launch

def _env(request: PlanRequest) -> str:
    conf = allocator_conf(request)
    return f"export PYTORCH_CUDA_ALLOC_CONF={shlex.quote(conf)}" if conf else "unset PYTORCH_CUDA_ALLOC_CONF"


def launch_script(request: PlanRequest, formats: dict[str, str]) -> str:
    """A torchrun line per node (bash), with the allocator setting the plan assumed."""
    cluster = request.cluster
    framework = request.training.framework
    lines = ["#!/usr/bin/env bash",
             "# Launch the planned run on each node (NODE_RANK, MASTER_ADDR set per node; sbatch sets them in job.sbatch).",
             "set -euo pipefail", 'HERE="$(cd "$(dirname "$0")" && pwd)"',
             f"{_env(request)}  # the allocator setting the plan was judged under"]
    if framework is Framework.litgpt:
        # lightning 2.4 fabric/plugins/environments/lightning.py LightningEnvironment reads
        # MASTER_ADDR, MASTER_PORT and NODE_RANK; litgpt starts one process per device itself.
        lines.append('export NODE_RANK="${NODE_RANK:-0}" MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" '
                     'MASTER_PORT="${MASTER_PORT:-29500}"')
        try:
            lines.append(litgpt_command(request))
        except NotApplicable as reason:
            lines.append(f"echo {shlex.quote(f'litgpt cannot run this plan: {reason}')} >&2; exit 1")
    elif framework is Framework.torchtune:
        recipe, config = torchtune_recipe(request)
        lines.append(f"tune run --nnodes {cluster.num_nodes} --nproc_per_node {cluster.gpus_per_node} "
                     f"{recipe} --config {config} $(cat \"$HERE/torchtune-overrides.txt\")")
    else:
        if framework is Framework.fairseq:
            target = "-m fairseq_cli.train " + " ".join(fairseq_train_arguments(request))
        elif framework is Framework.torchtitan or (framework is Framework.zeroplan and "torchtitan" in formats):
            target = (f"-m torchtitan.train --module {torchtitan_module(request)} --config {torchtitan_config_name(request)} "
                      f"$(cat \"$HERE/torchtitan-overrides.txt\")")
        else:
            target = "YOUR_TRAIN_SCRIPT.py " + " ".join(hf_training_arguments(request)).replace(
                "--deepspeed deepspeed.json", "--deepspeed \"$HERE/deepspeed.json\"")
            if runs_deepspeed(request):
                try:
                    deepspeed_config(request)  # the file the line points at, or why it was not written
                except NotApplicable as reason:
                    lines.append(f"echo {shlex.quote(f'deepspeed.json was not written: {reason}')} >&2; exit 1")
                    return "\n".join(lines) + "\n"
        lines.append(f"torchrun --nnodes {cluster.num_nodes} --nproc_per_node {cluster.gpus_per_node} "
                     f"--node_rank \"${{NODE_RANK:-0}}\" --master_addr \"${{MASTER_ADDR:-127.0.0.1}}\" "
                     f"--master_port \"${{MASTER_PORT:-29500}}\" {target}")
    return "\n".join(lines) + "\n"


def sbatch_script(request: PlanRequest) -> str:
    """A Slurm batch script: one task per node, each running launch.sh."""
    cluster = request.cluster
    return "\n".join([
        "#!/usr/bin/env bash",
        f"#SBATCH --nodes={cluster.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={cluster.gpus_per_node}",
        "#SBATCH --exclusive",
        "set -euo pipefail",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_ADDR MASTER_PORT=29500",
        _env(request),
        'srun --kill-on-bad-exit=1 bash -c \'NODE_RANK=$SLURM_NODEID bash "$SLURM_SUBMIT_DIR/launch.sh"\'',
    ]) + "\n"
