"""A DeepSpeed config file (the user's ds_config.json, or the one ``--emit`` writes) read as the
planner's inputs: the ZeRO strategy it runs and the StrategySpec knobs it sets, each key left
out taking DeepSpeed's own default (what the engine runs then, not what ``--emit`` would write).

The file is read with ``json`` only. Every key is either mapped onto the request, checked
against the command line's flags, known to leave a rank's memory and traffic as planned (named
in IGNORED_TOP_LEVEL / IGNORED_ZERO with why), or refused in one line naming the key and what is
allowed: a setting that changes the step in a way zeroplan does not plan would otherwise give a
wrong answer silently. Nothing here imports torch or the core.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeroplan.errors import ZeroplanError, nested_too_deeply_error
from zeroplan.specs.base import Frozen
# DeepSpeed's ZeRO defaults live beside StrategySpec, whose knobs they fill: the core reads them
# without importing this module's config model (zeroplan.core.deepspeed_coordinator).
from zeroplan.specs.strategy import DEEPSPEED_ZERO_DEFAULTS, PARTIAL_OFFLOAD_KINDS, StrategyKind
from zeroplan.specs.training import Optimizer, Precision

FLAG = "--deepspeed-config"

# deepspeed 0.19.8 runtime/utils.py all_gather_dp_groups: with all_gather_into_tensor (NCCL's)
# the stage 1-2 parameter all-gather writes into the flat buffers without a bucket, and
# allgather_bucket_size is not read; stage 3 never reads it. The other keys here are read at a
# checkpoint's save or load, or only log.
IGNORED_ZERO = ("allgather_bucket_size", "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters",
                "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save", "log_trace_cache_warnings", "enable_sanity_checks",
                "gather_16bit_weights_on_model_save")

# Keys that only schedule the learning rate, clip (in place, on the partitions the step holds
# anyway), print or log.
IGNORED_TOP_LEVEL = ("gradient_clipping", "scheduler", "steps_per_print", "wall_clock_breakdown",
                     "zero_allow_untested_optimizer", "tensorboard", "wandb", "csv_monitor", "comet",
                     "flops_profiler", "comms_logger", "memory_breakdown", "dump_state", "prescale_gradients",
                     "gradient_predivide_factor")

# A value DeepSpeed's engine takes as given that would change what the planner plans: the
# default is the only value allowed.
FIXED_ZERO = {"reduce_scatter": True, "use_multi_rank_bucket_allreduce": True, "allgather_partitions": True,
              "memory_efficient_linear": True, "stage3_module_granularity_threshold": 0,
              "stage3_use_all_reduce_for_fetch_params": False, "stage3_allgather_sequential": False,
              "zero_quantized_nontrainable_weights": False, "mics_hierarchical_params_gather": False}

MAPPED_ZERO = ("stage", "reduce_bucket_size", "contiguous_gradients", "overlap_comm", "sub_group_size",
               "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
               "stage3_max_reuse_distance", "zero_hpz_partition_size", "zero_quantized_weights",
               "zero_quantized_gradients", "mics_shard_size", "offload_optimizer", "offload_param")
MAPPED_TOP_LEVEL = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "bf16",
                    "fp16", "optimizer", "zero_optimization", "data_types", "aio", "activation_checkpointing",
                    "torch_autocast")

# Hugging Face's Trainer and accelerate fill these "auto" entries from their own arguments
# (transformers 4.56.2 integrations/deepspeed.py trainer_config_process / trainer_config_finalize).
HF_AUTO_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping", "bf16.enabled", "fp16.enabled", "zero_optimization.reduce_bucket_size",
                "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold")

OPTIMIZER_TYPES = {"adam": Optimizer.adam, "adamw": Optimizer.adamw, "fusedadam": Optimizer.adam,
                   "cpuadam": Optimizer.adam, "deepspeedcpuadam": Optimizer.adam, "muon": Optimizer.muon}
"""DeepSpeed optimizer types (runtime/config.py ADAM_OPTIMIZER, ADAMW_OPTIMIZER, MUON_OPTIMIZER;
case-insensitive) and the zeroplan optimizer with their states. Adam's config without adam_w_mode:
DeepSpeed runs AdamW for "Adam" too (engine._configure_basic_optimizer: adam_w_mode defaults True);
both keep two fp32 states, which is what the planner counts. "Muon" is MuonWithAuxAdam
(zeroplan.core.muon)."""

OFFLOAD_KEYS = {"offload_optimizer": ("device", "pin_memory", "nvme_path", "buffer_count", "pipeline_read",
                                      "pipeline_write", "fast_init", "ratio"),
                "offload_param": ("device", "pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu")}


class DeepSpeedConfig(Frozen):
    """What a DeepSpeed config file sets, as zeroplan's terms."""

    kind: StrategyKind
    """The strategy the stage and offload devices run."""
    zero_bucket_elements: int | None
    """reduce_bucket_size; None where the file says "auto" (Hugging Face fills it)."""
    contiguous_gradients: bool
    overlap_comm: bool | None
    """None: DeepSpeed's default (true at stage 3, false below)."""
    sub_group_elements: int
    prefetch_bucket_elements: int | None
    persistence_threshold: int | None
    """None where the file says "auto"."""
    max_live_parameters: int
    max_reuse_distance: int
    hpz_partition_size: int | None
    mics_shard_size: int | None
    offload_optimizer_ratio: float | None
    """offload_optimizer.ratio below 1.0 (StrategySpec.offload_optimizer_ratio); None at 1.0."""
    nvme_pipeline_read: bool
    nvme_pipeline_write: bool
    grad_accum_fp32: bool
    micro_batch_size: int | None
    """None where the file leaves it out or says "auto"; as gradient_accumulation_steps."""
    grad_accum_steps: int | None
    train_batch_size: int | None
    precision: Precision | None
    """None: "auto" (the flags decide)."""
    optimizer: Optimizer | None
    """None: the file names no optimizer (the script builds its own)."""
    nvme_settings: tuple[tuple[str, int], ...]
    """The NVMe swappers' sizes the file sets (offload_optimizer.buffer_count, offload_param's
    buffer_count, buffer_size and max_in_cpu): checked against what the planner plans."""
    aio: tuple[tuple[str, Any], ...]
    """The aio block's keys and values the file sets."""
    partition_activations: bool
    """activation_checkpointing.partition_activations (TrainingSpec.partition_activations)."""
    cpu_checkpointing: bool
    """activation_checkpointing.cpu_checkpointing (TrainingSpec.cpu_checkpointing)."""
    bf16_autocast: bool = False
    """bf16_master_weights_and_grads and bf16_optimizer_states under torch_autocast in bf16
    (TrainingSpec.deepspeed_bf16_autocast; precision then bf16-pure)."""

    def strategy_updates(self) -> dict[str, Any]:
        """StrategySpec fields (other than kind) this file sets; "auto" entries left out. Stage 0
        (ddp) reads none of them (zeroplan.core.deepspeed_stage0)."""
        if self.kind is StrategyKind.ddp:
            return {}
        updates: dict[str, Any] = {
            "deepspeed_contiguous_gradients": self.contiguous_gradients, "deepspeed_overlap_comm": self.overlap_comm,
            "nvme_pipeline_read": self.nvme_pipeline_read, "nvme_pipeline_write": self.nvme_pipeline_write,
            "deepspeed_grad_accum_fp32": self.grad_accum_fp32,
        }
        if self.zero_bucket_elements is not None:
            updates["zero_bucket_elements"] = self.zero_bucket_elements
        if self.kind.zero_stage == 3:  # stages 1 and 2 read none of these
            updates |= {"deepspeed_sub_group_elements": self.sub_group_elements,
                        "deepspeed_max_live_parameters": self.max_live_parameters,
                        "deepspeed_max_reuse_distance": self.max_reuse_distance}
            if self.prefetch_bucket_elements is not None:
                updates["deepspeed_prefetch_bucket_elements"] = self.prefetch_bucket_elements
            if self.persistence_threshold is not None:
                updates["deepspeed_param_persistence_threshold"] = self.persistence_threshold
        if self.hpz_partition_size is not None:
            updates["hpz_partition_size"] = self.hpz_partition_size
        if self.mics_shard_size is not None:
            updates["mics_shard_size"] = self.mics_shard_size
        if self.offload_optimizer_ratio is not None:
            updates["offload_optimizer_ratio"] = self.offload_optimizer_ratio
        return updates


def _refuse(key: str, message: str) -> ZeroplanError:
    return ZeroplanError(f"{FLAG} {key}", message)


def read_deepspeed_json(path: str | Path) -> dict[str, Any]:
    """A DeepSpeed config file's JSON object (what the planner's --deepspeed-config and the
    harness's read); a missing, unreadable or non-object file is refused in one line."""
    import json  # here: the planner imports this module's defaults on every command

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ZeroplanError(FLAG, f"cannot read {str(path)!r} ({type(error).__name__}: {error})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ZeroplanError(FLAG, f"{str(path)!r} is not JSON ({error})") from None
    except RecursionError:
        raise nested_too_deeply_error(FLAG, path, "a DeepSpeed config nests a few") from None
    if not isinstance(config, dict):
        raise ZeroplanError(FLAG, f"{str(path)!r} holds a JSON {type(config).__name__}, not an object")
    return config


def read_deepspeed_config(path: str | Path, hf_auto: bool) -> DeepSpeedConfig:
    """The file at ``path`` as a DeepSpeedConfig; ``hf_auto``: whether "auto" entries are
    allowed (a Hugging Face run fills them). One-line errors name the key."""
    return deepspeed_config_of(read_deepspeed_json(path), hf_auto)


def _auto(value: Any, key: str, hf_auto: bool) -> bool:
    """Whether ``value`` is an "auto" entry (refused outside a Hugging Face run, or for a key
    Hugging Face does not fill)."""
    if value != "auto":
        return False
    if not hf_auto or key not in HF_AUTO_KEYS:
        where = "only Hugging Face's Trainer and accelerate fill it (give --framework hf)" if key in HF_AUTO_KEYS \
            else "Hugging Face fills no such entry"
        raise _refuse(key, f'"auto": {where}; give a number')
    return True


MAX_BUFFER_ELEMENTS = 2**36
"""The largest buffer a file may size (reduce_bucket_size, the prefetch bucket, the NVMe buffers):
the command line's --reduce-bucket-size bound (zeroplan.cli.parser.MAX_BUCKET_ELEMENTS; 2^36
16-bit elements are 128 GiB, more than a GPU holds)."""
MAX_COUNT_ELEMENTS = 2**62
"""The largest bound or threshold (sub_group_size, live parameters, reuse distance, persistence):
past any model's elements each means "everything" (DeepSpeed 0.3.13's sub_group_size was 1e12)."""

BUFFER_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "buffer_count", "buffer_size")


def _int(block: dict[str, Any], name: str, key: str, hf_auto: bool, minimum: int) -> int | None:
    """A whole number (JSON's 5e8 included) from ``minimum`` to its bound (MAX_BUFFER_ELEMENTS for
    a buffer, else MAX_COUNT_ELEMENTS); None if absent or "auto"."""
    if name not in block:
        return None
    value = block[name]
    if _auto(value, key, hf_auto):
        return None
    buffer = key.rsplit(".", 1)[-1] in BUFFER_KEYS
    maximum, words = (MAX_BUFFER_ELEMENTS, "2^36") if buffer else (MAX_COUNT_ELEMENTS, "2^62")
    if (isinstance(value, bool) or not isinstance(value, int | float) or value != value
            or value in (float("inf"), float("-inf")) or value != int(value) or not minimum <= value <= maximum):
        raise _refuse(key, f"{value!r} is not a whole number from {minimum} to {words} ({maximum:,})")
    return int(value)


def _bool(block: dict[str, Any], name: str, key: str, default: bool | None) -> bool | None:
    value = block.get(name, default)
    if value is not None and not isinstance(value, bool):
        raise _refuse(key, f"{value!r} is not true or false")
    return value


def _object(config: dict[str, Any], name: str, key: str) -> dict[str, Any]:
    """A nested block; absent or null (DeepSpeed reads null as unset) is an empty one."""
    block = config.get(name)
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise _refuse(key, f"{block!r} is not a JSON object")
    return block


def _check_keys(block: dict[str, Any], allowed: tuple[str, ...], prefix: str) -> None:
    for name in block:
        if name not in allowed:
            raise _refuse(f"{prefix}{name}", f"not a key zeroplan plans (allowed: {', '.join(allowed)})")


# deepspeed 0.19.8 runtime/precision_config.py DeepSpeedBF16Config and DeepSpeedFP16Config: their
# keys; the loss scaler's only set numbers. The 16-bit master weight, gradient and state switches
# change the model states, which zeroplan plans in fp32 under DeepSpeed: refused where set, but
# for bf16's two together with torch_autocast in bf16 (BF16_AUTOCAST_KEYS).
PRECISION_KEYS = {"bf16": ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                           "bf16_optimizer_states"),
                  "fp16": ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                           "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")}
SIXTEEN_BIT_STATES = ("bf16_master_weights_and_grads", "bf16_optimizer_states", "fp16_master_weights_and_grads")
BF16_AUTOCAST_KEYS = ("bf16_master_weights_and_grads", "bf16_optimizer_states")
"""bf16's switches of DeepSpeed PR 7700 (first in 0.18.3), planned together and with torch_autocast in
bf16 (zeroplan.core.deepspeed_bf16_autocast; DeepSpeedExamples' training/bf16_master_weight
configs/bf16_full.json)."""

# deepspeed 0.19.8 runtime/config.py get_torch_autocast_dtype (DtypeEnum.bf16's names) and
# constants.py TORCH_AUTOCAST_*: the block's keys. A missing dtype leaves torch.autocast's own
# default on CUDA, fp16 (runtime/torch_autocast.py autocast_if_enabled passes None); the safe
# modules list changes which parameters are communicated in 16 bits (init_autocast_params).
TORCH_AUTOCAST_KEYS = ("enabled", "dtype")
BF16_DTYPE_NAMES = ("torch.bfloat16", "bf16", "bfloat16")

# deepspeed 0.19.8 runtime/activation_checkpointing/config.py: the block's keys (its settings
# apply to models that call deepspeed.checkpointing: zeroplan.core.deepspeed_checkpointing).
CHECKPOINTING_KEYS = ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                      "number_checkpoints", "synchronize_checkpoint_boundary", "profile")


def _precision(config: dict[str, Any], hf_auto: bool) -> Precision | None:
    """bf16.enabled / fp16.enabled: bf16-mixed, fp16-mixed, fp32 (neither); None if "auto"."""
    enabled = {}
    for name in ("bf16", "fp16"):
        block = _object(config, name, name)
        _check_keys(block, PRECISION_KEYS[name], f"{name}.")
        for key in SIXTEEN_BIT_STATES:
            if block.get(key) and not (name == "bf16" and key in BF16_AUTOCAST_KEYS):
                raise _refuse(f"{name}.{key}", "16-bit master weights, gradients or states under DeepSpeed are not "
                                               "planned (allowed: false)")
        value = block.get("enabled", False)
        if _auto(value, f"{name}.enabled", hf_auto):
            return None
        if not isinstance(value, bool):
            raise _refuse(f"{name}.enabled", f"{value!r} is not true or false")
        enabled[name] = value
    if enabled["bf16"] and enabled["fp16"]:
        raise _refuse("bf16.enabled", "and fp16.enabled are both true (allowed: at most one)")
    if enabled["bf16"] and bf16_autocast(config):
        return Precision.bf16_pure
    return Precision.bf16_mixed if enabled["bf16"] else Precision.fp16_mixed if enabled["fp16"] else Precision.fp32


def bf16_autocast(config: dict[str, Any]) -> bool:
    """Whether the file runs DeepSpeed's bf16 master weights, gradients and Adam states under
    torch_autocast in bf16 (PR 7700); one of the switches without the others is refused in one
    line (deepspeed 0.19.8 runtime/config.py _do_error_check asserts bf16_optimizer_states needs
    bf16_master_weights_and_grads; bf16 masters under fp32 Adam states, or the states without
    autocast, are not planned)."""
    bf16 = _object(config, "bf16", "bf16")
    autocast = _object(config, "torch_autocast", "torch_autocast")
    switches = {key: _bool(bf16, key, f"bf16.{key}", False) for key in BF16_AUTOCAST_KEYS}
    enabled = _bool(autocast, "enabled", "torch_autocast.enabled", False)
    if not any(switches.values()) and not enabled:
        return False
    _check_keys(autocast, TORCH_AUTOCAST_KEYS, "torch_autocast.")
    master, states = (switches[key] for key in BF16_AUTOCAST_KEYS)
    together = "with bf16_master_weights_and_grads, bf16_optimizer_states and torch_autocast.enabled all true"
    if states and not master:
        raise _refuse("bf16.bf16_optimizer_states", f"true without bf16_master_weights_and_grads, which DeepSpeed "
                                                    f"asserts (allowed: false, or {together})")
    if enabled and not master:
        # deepspeed 0.19.8 runtime/torch_autocast.py: the engine runs the forward under autocast
        # over fp32 master states, a regime zeroplan's precisions do not have.
        raise _refuse("torch_autocast.enabled", f"true over fp32 master weights is not planned (allowed: false, or {together})")
    if not states:
        raise _refuse("bf16.bf16_master_weights_and_grads", f"true beside fp32 Adam states is not planned (allowed: false, "
                                                            f"or {together})")
    if not enabled:
        raise _refuse("torch_autocast.enabled", "false beside bf16 master weights and optimizer states: planned under "
                                                "torch_autocast only (allowed: true)")
    if not bf16.get("enabled", False):
        raise _refuse("bf16.enabled", "false beside torch_autocast: planned over DeepSpeed's bf16 module (allowed: true)")
    if autocast.get("dtype") not in BF16_DTYPE_NAMES:
        raise _refuse("torch_autocast.dtype", f"{autocast.get('dtype')!r} is not planned (allowed: "
                                              f"{', '.join(BF16_DTYPE_NAMES)})")
    return True


def _optimizer(config: dict[str, Any]) -> Optimizer | None:
    block = _object(config, "optimizer", "optimizer")
    if not block:
        return None
    name = str(block.get("type", "")).lower()
    if name not in OPTIMIZER_TYPES:
        raise _refuse("optimizer.type", f"{block.get('type')!r} is not planned under DeepSpeed "
                                        f"(allowed: Adam, AdamW, FusedAdam, CPUAdam, Muon)")
    params = block.get("params") or {}
    if OPTIMIZER_TYPES[name] is Optimizer.muon and isinstance(params, dict) and params.get("per_head_muon"):
        # deepspeed 0.19.8 original_muon.py _per_head_orthogonalize: one Newton-Schulz per head, batched.
        raise _refuse("optimizer.params.per_head_muon", "per-head Newton-Schulz is not modelled (allowed: false)")
    return OPTIMIZER_TYPES[name]


def _offload_device(zero: dict[str, Any], name: str) -> str:
    block = _object(zero, name, f"zero_optimization.{name}")
    _check_keys(block, OFFLOAD_KEYS[name], f"zero_optimization.{name}.")
    device = block.get("device", "none") if block else "none"
    if device not in ("none", "cpu", "nvme"):
        raise _refuse(f"zero_optimization.{name}.device", f"{device!r} (allowed: none, cpu, nvme)")
    return device


RATIO_KEY = "zero_optimization.offload_optimizer.ratio"


# deepspeed 0.19.8 runtime/zero/offload_config.py:99 ratio = Field(1.0, ge=0.0, le=1.0), ZeRO-Offload++'s
# Twin-Flow: the share of stage 3's sub-groups the CPU Adam steps (stage3.py:1100-1108); config.py:396-400
# offload_ratio_check asserts stage 3 below 1.0. A ratio of 0 (nothing on the host, yet a CPU Adam
# built) is not planned.
def _offload_ratio(zero: dict[str, Any], kind: StrategyKind) -> float | None:
    """offload_optimizer.ratio; None where absent or 1.0 (DeepSpeed's default: everything offloaded)."""
    block = zero.get("offload_optimizer") or {}
    if not isinstance(block, dict) or "ratio" not in block:
        return None
    ratio = block["ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise _refuse(RATIO_KEY, f"{ratio!r} (allowed: a number greater than 0, at most 1)")
    if ratio == 1:
        return None
    if kind not in PARTIAL_OFFLOAD_KINDS:
        raise _refuse(RATIO_KEY, f"{ratio!r} below 1 is ZeRO-3's offload to the CPU (DeepSpeed asserts stage 3; "
                                 f"allowed: 1.0, or stage 3 with offload_optimizer.device cpu)")
    return float(ratio)


# The stage and offload devices that name each strategy (deepspeed 0.19.8 runtime/zero/config.py
# offload_optimizer / offload_param; offload_param needs stage 3 and offload_optimizer).
_KINDS = {(1, "none", "none"): StrategyKind.zero1, (2, "none", "none"): StrategyKind.zero2,
          (2, "cpu", "none"): StrategyKind.zero2_offload, (3, "none", "none"): StrategyKind.zero3,
          (3, "cpu", "none"): StrategyKind.zero3_offload, (3, "cpu", "cpu"): StrategyKind.zero3_param_offload,
          (3, "nvme", "none"): StrategyKind.zero3_nvme, (3, "nvme", "nvme"): StrategyKind.zero3_param_nvme}


def _kind(zero: dict[str, Any]) -> StrategyKind:
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise _refuse("zero_optimization.stage", f"{stage!r} (allowed: 0, 1, 2, 3)")
    devices = (stage, _offload_device(zero, "offload_optimizer"), _offload_device(zero, "offload_param"))
    if stage == 0:
        if devices != (0, "none", "none"):
            # runtime/engine.py _configure_optimizer wraps no ZeRO optimizer at stage 0 (zero_enabled
            # is stage > 0, runtime/config.py), so nothing is offloaded; zero_use_cpu_optimizer
            # would still build DeepSpeedCPUAdam over the GPU's parameters.
            name = "offload_param" if devices[2] != "none" else "offload_optimizer"
            raise _refuse(f"zero_optimization.{name}", f"device {devices[1] if name == 'offload_optimizer' else devices[2]} "
                                                       "at stage 0 is not planned: stage 0 offloads nothing (allowed: none)")
        return StrategyKind.ddp
    if devices not in _KINDS:
        allowed = "; ".join(f"stage {s}, optimizer {o}, parameters {p}" for s, o, p in _KINDS)
        raise _refuse("zero_optimization.offload_param" if devices[2] != "none" else "zero_optimization.offload_optimizer",
                      f"stage {stage} with the optimizer on {devices[1]} and the parameters on {devices[2]} is not "
                      f"planned (allowed: {allowed})")
    kind = _KINDS[devices]
    hpz = zero.get("zero_hpz_partition_size", 1)
    quantized = (bool(zero.get("zero_quantized_weights", False)), bool(zero.get("zero_quantized_gradients", False)))
    mics = zero.get("mics_shard_size", -1)
    if kind is StrategyKind.zero3 and quantized == (True, True) and hpz not in (0, 1):
        return StrategyKind.zero3_zeropp
    if any(quantized):
        raise _refuse("zero_optimization.zero_quantized_weights",
                      "qwZ and qgZ are planned together with hpZ at stage 3 without offload (ZeRO++'s recipe: "
                      "zero_hpz_partition_size > 1 and both true)")
    if hpz not in (0, 1):
        if kind is not StrategyKind.zero3:
            raise _refuse("zero_optimization.zero_hpz_partition_size", "is planned at stage 3 without offload")
        return StrategyKind.zero3_hpz
    if mics not in (-1, 0):
        if kind is not StrategyKind.zero3:
            raise _refuse("zero_optimization.mics_shard_size", "is planned at stage 3 without offload")
        return StrategyKind.zero3_mics
    return kind


# deepspeed 0.19.8 runtime/engine.py at stage 0: _do_optimizer_sanity_check raises
# NotImplementedError where grad_accum_dtype is not the model dtype (BF16_Optimizer only under the
# pipeline engine); _configure_fp16_optimizer wraps a FusedAdam (the "Adam"/"AdamW" types without
# torch_adam: get_optimizer_configuration) in FP16_Optimizer, whose flat fp32 gradient copy is
# not measured, and a torch optimizer in FP16_UnfusedOptimizer, measured
# (benchmarks/deepspeed-accumulation-records records-zero0-*.json); CPU Adam needs offload.
def _check_stage0(config: dict[str, Any], grad_accum_dtype: str | None, hf_auto: bool) -> None:
    precision = _precision(config, hf_auto)
    model_dtype = {Precision.fp32: "fp32", Precision.bf16_mixed: "bf16", Precision.fp16_mixed: "fp16"}.get(precision)
    if grad_accum_dtype is not None and grad_accum_dtype != model_dtype:
        raise _refuse("data_types.grad_accum_dtype", f"{grad_accum_dtype!r} at stage 0: DeepSpeed accumulates in the "
                                                     f"model dtype there (allowed: leave it out)")
    block = _object(config, "optimizer", "optimizer")
    if str(block.get("type", "")).lower() in ("cpuadam", "deepspeedcpuadam"):
        raise _refuse("optimizer.type", f"{block['type']!r} at stage 0 is not planned (it needs offload_optimizer; "
                                        "allowed: Adam, AdamW)")
    if not block or precision is Precision.fp32:
        return
    params = block.get("params") or {}
    if not (isinstance(params, dict) and params.get("torch_adam") is True):
        raise _refuse("optimizer.params.torch_adam", "unset at stage 0 under fp16 or bf16: DeepSpeed then wraps FusedAdam "
                                                     "in FP16_Optimizer, not planned (allowed: true, which runs "
                                                     "FP16_UnfusedOptimizer, or no optimizer block)")


def deepspeed_config_of(config: dict[str, Any], hf_auto: bool) -> DeepSpeedConfig:
    """A parsed config's keys as zeroplan's terms (read_deepspeed_config without the file)."""
    for name in config:
        if name not in MAPPED_TOP_LEVEL + IGNORED_TOP_LEVEL:
            raise _refuse(name, f"not a key zeroplan plans (allowed: {', '.join(MAPPED_TOP_LEVEL + IGNORED_TOP_LEVEL)})")
    # Absent or empty, the block is stage 0 (runtime/zero/config.py DeepSpeedZeroConfig stage
    # defaults to 0): DeepSpeed's unpartitioned optimizer.
    zero = _object(config, "zero_optimization", "zero_optimization")
    _check_keys(zero, MAPPED_ZERO + IGNORED_ZERO + tuple(FIXED_ZERO), "zero_optimization.")
    for name, value in FIXED_ZERO.items():
        if zero.get(name, value) != value:
            allowed = str(value).lower() if isinstance(value, bool) else value
            raise _refuse(f"zero_optimization.{name}", f"{zero[name]!r} is not planned (allowed: {allowed})")
    kind = _kind(zero)

    def number(name: str, minimum: int = 0) -> int | None:
        return _int(zero, name, f"zero_optimization.{name}", hf_auto, minimum)

    def default(name: str) -> int:
        value = number(name)
        return DEEPSPEED_ZERO_DEFAULTS[name] if value is None else value

    def default_or_auto(name: str) -> int | None:
        """The file's value, DeepSpeed's default where it has none, None where it says "auto"."""
        value = default(name)  # refuses an "auto" outside a Hugging Face run
        return None if zero.get(name) == "auto" else value
    offload_optimizer = zero.get("offload_optimizer") or {}
    offload_param = zero.get("offload_param") or {}
    nvme = [(f"offload_optimizer.{k}", offload_optimizer[k]) for k in ("buffer_count",) if k in offload_optimizer]
    nvme += [(f"offload_param.{k}", offload_param[k]) for k in ("buffer_count", "buffer_size", "max_in_cpu")
             if k in offload_param]
    for key, value in nvme:
        _int({"v": value}, "v", f"zero_optimization.{key}", False, 1)
    data_types = _object(config, "data_types", "data_types")
    _check_keys(data_types, ("grad_accum_dtype",), "data_types.")
    grad_accum_dtype = data_types.get("grad_accum_dtype")
    if grad_accum_dtype not in (None, "fp32", "fp16", "bf16"):
        raise _refuse("data_types.grad_accum_dtype", f"{grad_accum_dtype!r} (allowed: fp32, fp16, bf16)")
    if kind is StrategyKind.ddp:
        _check_stage0(config, grad_accum_dtype, hf_auto)
    autocast = bf16_autocast(config)
    if autocast and kind is not StrategyKind.zero3:
        # Measured on DeepSpeed's ZeRO-3 engine only (benchmarks/deepspeed_bf16mw_step.py --bf16full).
        raise _refuse("zero_optimization.stage", f"{kind.value} with bf16 master weights under torch_autocast is not "
                                                 "planned (allowed: stage 3 without offload)")
    aio = _object(config, "aio", "aio")
    checkpointing = _object(config, "activation_checkpointing", "activation_checkpointing")
    _check_keys(checkpointing, CHECKPOINTING_KEYS, "activation_checkpointing.")
    partition = bool(_bool(checkpointing, "partition_activations", "activation_checkpointing.partition_activations", False))
    on_host = bool(_bool(checkpointing, "cpu_checkpointing", "activation_checkpointing.cpu_checkpointing", False))
    if _bool(checkpointing, "contiguous_memory_optimization", "activation_checkpointing.contiguous_memory_optimization",
             False) and not (partition and on_host):
        # checkpointing.py partition_activations (lines 403-425): the contiguous buffers hold every
        # block's partition, on the device unless cpu_checkpointing puts them on the host; configure
        # (line 1229) asserts partitioning. Buffers on the device kept across steps are not planned.
        raise _refuse("activation_checkpointing.contiguous_memory_optimization",
                      "true is planned with partition_activations and cpu_checkpointing (allowed: false, or with both)")
    hpz = number("zero_hpz_partition_size")
    mics = _int(zero, "mics_shard_size", "zero_optimization.mics_shard_size", False, -1)
    return DeepSpeedConfig(
        kind=kind,
        zero_bucket_elements=default_or_auto("reduce_bucket_size"),
        contiguous_gradients=_bool(zero, "contiguous_gradients", "zero_optimization.contiguous_gradients", True),
        overlap_comm=_bool(zero, "overlap_comm", "zero_optimization.overlap_comm", None),
        sub_group_elements=max(1, default("sub_group_size")),
        prefetch_bucket_elements=default_or_auto("stage3_prefetch_bucket_size"),
        persistence_threshold=default_or_auto("stage3_param_persistence_threshold"),
        max_live_parameters=max(1, default("stage3_max_live_parameters")),
        max_reuse_distance=default("stage3_max_reuse_distance"),
        hpz_partition_size=hpz if kind in (StrategyKind.zero3_hpz, StrategyKind.zero3_zeropp) else None,
        mics_shard_size=int(mics) if kind is StrategyKind.zero3_mics else None,
        offload_optimizer_ratio=_offload_ratio(zero, kind),
        nvme_pipeline_read=bool(_bool(offload_optimizer, "pipeline_read", "zero_optimization.offload_optimizer.pipeline_read", False)),
        nvme_pipeline_write=bool(_bool(offload_optimizer, "pipeline_write", "zero_optimization.offload_optimizer.pipeline_write", False)),
        grad_accum_fp32=grad_accum_dtype == "fp32",
        micro_batch_size=_int(config, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu", hf_auto, 1),
        grad_accum_steps=_int(config, "gradient_accumulation_steps", "gradient_accumulation_steps", hf_auto, 1),
        train_batch_size=_int(config, "train_batch_size", "train_batch_size", hf_auto, 1),
        precision=_precision(config, hf_auto),
        optimizer=_optimizer(config),
        nvme_settings=tuple((key, int(value)) for key, value in nvme),
        aio=tuple(sorted(aio.items())),
        partition_activations=partition,
        cpu_checkpointing=on_host,
        bf16_autocast=autocast,
    )
