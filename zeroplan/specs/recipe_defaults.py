"""What a framework's own shipped configuration of a model sets where the planner would otherwise
assume something else: torchtitan ships one Python configuration per model it trains
(models/*/config_registry.py), torchtune one YAML file per model, method and device count
(recipes/configs/), and a user who runs one without overrides runs its activation
checkpointing, its compile, float8 and asynchronous tensor parallelism (torchtitan's
llama3_405b), its optimizer and where it steps (torchtune's 8B full single-device and 70B full
ones). A request
that names none of these is planned with the configuration's (PlanRequest._framework_recipe_checkpointing,
PlanRequest._framework_recipe_launch), and the header says so."""

from __future__ import annotations

from enum import Enum

from zeroplan.specs.finetune import Quantization
from zeroplan.specs.framework import Framework
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs.training import ActivationCheckpointing, Float8Recipe, Optimizer, OptimizerLoop, TrainingSpec

SELECTIVE_OP, FULL = ActivationCheckpointing.selective_op, ActivationCheckpointing.full

TORCHTITAN_CONFIGS: dict[str, str] = {
    "llama-3-8b": "llama3_8b", "llama-3.1-8b": "llama3_8b",
    "llama-3-70b": "llama3_70b", "llama-3.1-70b": "llama3_70b",
    "llama-3.1-405b": "llama3_405b",
    "qwen3-0.6b": "qwen3_0_6b", "qwen3-1.7b": "qwen3_1_7b", "qwen3-14b": "qwen3_14b",
    "qwen3-30b-a3b": "qwen3_30b_a3b", "qwen3-32b": "qwen3_32b",
}
"""The torchtitan 0.3.0 configuration function (models/llama3/config_registry.py,
models/qwen3/config_registry.py) that trains each preset; presets without one (qwen3-4b, qwen3-8b:
only an nvfp4 variant of the 8B) are absent."""

# torchtitan 0.3.0 models/llama3/config_registry.py: llama3_8b sets
# activation_checkpoint=SelectiveAC.Config() (line 211), llama3_70b and llama3_405b FullAC.Config()
# (lines 287, 340); models/qwen3/config_registry.py: qwen3_0_6b and qwen3_1_7b SelectiveAC (lines
# 202, 231), qwen3_14b, qwen3_30b_a3b and qwen3_32b FullAC (lines 291, 326, 361).
# distributed/activation_checkpoint.py SelectiveAC is the per-op policy (selective-op). The
# December 2024 release (9dec370) ships the Llama ones as train_configs/llama3_{8b,70b,405b}.toml
# with the same modes ([activation_checkpoint] mode "selective" with selective_ac_option "op" for
# 8B, "full" for 70B and 405B: the modes its published benchmark rows list).
TORCHTITAN_CONFIG_CHECKPOINTING: dict[str, ActivationCheckpointing] = {
    "llama3_8b": SELECTIVE_OP, "llama3_70b": FULL, "llama3_405b": FULL,
    "qwen3_0_6b": SELECTIVE_OP, "qwen3_1_7b": SELECTIVE_OP,
    "qwen3_14b": FULL, "qwen3_30b_a3b": FULL, "qwen3_32b": FULL,
}
"""Each configuration's activation checkpointing."""

# torchtitan 0.3.0 models/llama3/config_registry.py llama3_405b (lines 295-346): compile_config =
# CompileConfig(enable=True, enable_async_tensor_parallel=True) (lines 296-299; components left at
# config/configs.py:298's ["model", "loss"]), passed as compile=compile_config (line 341), and the
# model built with converters=[Float8LinearConverter.Config(filter_fqns=["lm_head"], ...)] (lines
# 300-310; recipe_name left at components/quantization/float8.py:58's "rowwise"; lm_head is the
# output projection, models/common/decoder.py:204). No other configuration above sets compile, a
# converter or async TP (llama3_8b lines 184-216, llama3_70b 257-292; qwen3_0_6b, qwen3_1_7b,
# qwen3_14b, qwen3_30b_a3b, qwen3_32b in models/qwen3/config_registry.py lines 176-362), and every
# one builds ChunkedLossWrapper(CrossEntropyLoss) (llama3_405b line 312), the loss the profile
# plans (TrainingSpec.unchunked_loss False).
TORCHTITAN_CONFIG_TRAINING: dict[str, dict[str, object]] = {
    # models/llama3/config_registry.py lines 296-299 and 341 (compile), 300-310 (float8, lm_head kept bf16).
    "llama3_405b": {"compile": True, "float8": Float8Recipe.rowwise, "float8_skips_output": True},
}
"""What each 0.3.0 configuration sets beside its checkpointing (TrainingSpec fields -> values)."""

# models/llama3/config_registry.py line 298 (enable_async_tensor_parallel=True).
TORCHTITAN_CONFIG_ASYNC_TP = frozenset({"llama3_405b"})
"""The 0.3.0 configurations that enable asynchronous tensor parallelism (ParallelSpec.async_tp),
which torchtitan applies only where there is a tensor-parallel mesh (distributed/compile.py:49-51,
80: _maybe_enable_async_tp returns without one)."""

TORCHTITAN_9DEC370_CONFIGS = frozenset({"llama3_8b", "llama3_70b", "llama3_405b"})
"""The configurations the December 2024 release ships (no Qwen3 model then)."""


def torchtitan_config_name(model_name: str, release: str | None) -> str | None:
    """The torchtitan configuration that trains this preset at this release (None: the profile's
    0.3.0), or None where that release ships none."""
    config = TORCHTITAN_CONFIGS.get(model_name)
    if config is None or (release == "9dec370" and config not in TORCHTITAN_9DEC370_CONFIGS):
        return None
    return config


TORCHTUNE_CONFIGS: dict[str, str] = {
    "llama-3.1-8b": "llama3_1/8B", "llama-3.1-70b": "llama3_1/70B", "llama-3.1-405b": "llama3_1/405B",
    "llama-3-8b": "llama3/8B", "llama-3-70b": "llama3/70B", "llama-2-7b": "llama2/7B",
    "llama-2-13b": "llama2/13B", "llama-2-70b": "llama2/70B", "mistral-7b": "mistral/7B",
    "codellama-7b": "code_llama2/7B",
}
"""torchtune 0.6.1 recipes/configs/ folder and size of each preset it ships configurations of."""

# torchtune 0.6.1 recipes/configs/<name>.yaml enable_activation_checkpointing (its line in each
# file); True is training.set_activation_checkpointing on every TransformerSelfAttentionLayer
# (full recomputation of each block). Only the files 0.6.1 ships: no 70B or 405B single-device
# configuration, no llama2/13B full single-device one, no Llama 2 70B full one; llama2/7B,
# code_llama2/7B and mistral/7B train a full fine-tune on one device with their
# 7B_full_low_memory.yaml (torchtune/_recipe_registry.py lists them under
# full_finetune_single_device: FULL_LOW_MEMORY).
TORCHTUNE_CONFIG_CHECKPOINTING: dict[str, ActivationCheckpointing] = {
    "llama3_1/8B_full": FULL,  # line 74
    "llama3_1/8B_full_single_device": FULL,  # 74
    "llama3_1/8B_lora": ActivationCheckpointing.none,  # 91
    "llama3_1/8B_lora_single_device": FULL,  # 92
    "llama3_1/8B_qlora_single_device": FULL,  # 91
    "llama3_1/70B_full": FULL,  # 75
    "llama3_1/70B_lora": FULL,  # 78
    "llama3_1/405B_qlora": FULL,  # 86 (lora_finetune_distributed)
    "llama3/8B_full": FULL,  # 71
    "llama3/8B_full_single_device": FULL,  # 74
    "llama3/8B_lora": ActivationCheckpointing.none,  # 88
    "llama3/8B_lora_single_device": FULL,  # 89
    "llama3/8B_qlora_single_device": FULL,  # 88
    "llama3/70B_full": FULL,  # 73
    "llama3/70B_lora": FULL,  # 79
    "llama2/7B_full": FULL,  # 71
    "llama2/7B_lora": ActivationCheckpointing.none,  # 90
    "llama2/7B_lora_single_device": FULL,  # 90
    "llama2/7B_qlora_single_device": FULL,  # 89
    "llama2/13B_full": FULL,  # 72
    "llama2/13B_lora": ActivationCheckpointing.none,  # 93
    "llama2/13B_qlora_single_device": FULL,  # 89
    "llama2/70B_lora": FULL,  # 79
    "mistral/7B_full": FULL,  # 74
    "mistral/7B_lora": FULL,  # 87
    "mistral/7B_lora_single_device": FULL,  # 84
    "mistral/7B_qlora_single_device": FULL,  # 85
    "llama2/7B_full_low_memory": FULL,  # 75
    "mistral/7B_full_low_memory": FULL,  # 73
    "code_llama2/7B_full_low_memory": FULL,  # 74
    "code_llama2/7B_lora_single_device": FULL,  # 82
    "code_llama2/7B_qlora_single_device": FULL,  # 81
}

FULL_LOW_MEMORY = "_full_low_memory"
"""The name torchtune 0.6.1 gives the one-device full fine-tune of the 7B models whose folder
has no _full_single_device configuration (llama2, code_llama2, mistral)."""


# torchtune 0.6.1 recipes/configs/llama3_1/8B_full_single_device.yaml and
# llama3/8B_full_single_device.yaml: optimizer bitsandbytes.optim.PagedAdamW8bit (lines 60 and 57:
# 8-bit AdamW states, paged) and optimizer_in_bwd: True (line 66 of each, with
# gradient_accumulation_steps: 1 at line 65). llama3_1/70B_full.yaml and llama3/70B_full.yaml:
# fsdp_cpu_offload: True (lines 78 and 76) and torch.optim.AdamW with fused: False (lines 63 and
# 62: torch's foreach step, its CUDA default). Every other configuration above builds
# torch.optim.AdamW with fused: True (the profile's fused_optimizer), sets optimizer_in_bwd False or
# leaves it out, and no fsdp_cpu_offload; every one sets compile: False,
# enable_activation_offloading: False, dtype: bf16 and loss CEWithChunkedOutputLoss: the
# profile's own defaults (bf16-pure, 8 loss chunks).
_PAGED_8BIT_IN_BACKWARD = {"optimizer": Optimizer.adam_8bit, "paged_optimizer": True, "optimizer_in_backward": True}
_OFFLOADED_UNFUSED = {"fsdp_cpu_offload": True, "optimizer_loop": OptimizerLoop.foreach}
# recipes/configs/{llama2,code_llama2,mistral}/7B_full_low_memory.yaml: bitsandbytes.optim.PagedAdamW
# (32-bit states, paged), optimizer_in_bwd: True and enable_activation_offloading: True.
_PAGED_IN_BACKWARD_OFFLOADED = {"optimizer": Optimizer.adamw, "paged_optimizer": True, "optimizer_in_backward": True,
                                "activation_offloading": True}
TORCHTUNE_CONFIG_TRAINING: dict[str, dict[str, object]] = {
    # recipes/configs/llama3_1/8B_full_single_device.yaml lines 60 (PagedAdamW8bit) and 66 (optimizer_in_bwd).
    "llama3_1/8B_full_single_device": _PAGED_8BIT_IN_BACKWARD,
    # recipes/configs/llama3/8B_full_single_device.yaml lines 57 and 66.
    "llama3/8B_full_single_device": _PAGED_8BIT_IN_BACKWARD,
    # recipes/configs/llama3_1/70B_full.yaml lines 63 (fused: False) and 78 (fsdp_cpu_offload).
    "llama3_1/70B_full": _OFFLOADED_UNFUSED,
    # recipes/configs/llama3/70B_full.yaml lines 62 and 76.
    "llama3/70B_full": _OFFLOADED_UNFUSED,
    # recipes/configs/llama2/7B_full_low_memory.yaml lines 58 (PagedAdamW), 63 (optimizer_in_bwd), 76 (offloading).
    "llama2/7B_full_low_memory": _PAGED_IN_BACKWARD_OFFLOADED,
    # recipes/configs/code_llama2/7B_full_low_memory.yaml lines 62, 64 and 75.
    "code_llama2/7B_full_low_memory": _PAGED_IN_BACKWARD_OFFLOADED,
    # recipes/configs/mistral/7B_full_low_memory.yaml lines 61, 67 and 74.
    "mistral/7B_full_low_memory": _PAGED_IN_BACKWARD_OFFLOADED,
}
"""What each configuration sets beside its checkpointing that the planner would otherwise not."""


def torchtune_config_name(model_name: str, lora: bool, nf4: bool, single_device: bool) -> str | None:
    """The torchtune 0.6.1 configuration a run of this preset, method (full, LoRA, QLoRA) and
    device count launches (`tune run ... --config NAME`), or None where 0.6.1 ships none."""
    base = TORCHTUNE_CONFIGS.get(model_name)
    if base is None:
        return None
    method = "qlora" if nf4 and lora else "lora" if lora else "full"
    name = f"{base}_{method}" + ("_single_device" if single_device else "")
    if name not in TORCHTUNE_CONFIG_CHECKPOINTING and single_device and method == "full":
        name = base + FULL_LOW_MEMORY
    return name if name in TORCHTUNE_CONFIG_CHECKPOINTING else None


def recipe_checkpointing(framework: Framework, model_name: str, release: str | None, *, lora: bool = False,
                         nf4: bool = False, single_device: bool = False) -> tuple[ActivationCheckpointing, str] | None:
    """The activation checkpointing the framework's own configuration of this model sets (for
    torchtune, of this method on one device or several), and that configuration's name; None
    where the framework ships none for it (the planner's default, none, stands)."""
    if framework is Framework.torchtitan:
        config = torchtitan_config_name(model_name, release)
        return None if config is None else (TORCHTITAN_CONFIG_CHECKPOINTING[config], config)
    if framework is Framework.torchtune:
        config = torchtune_config_name(model_name, lora, nf4, single_device)
        return None if config is None else (TORCHTUNE_CONFIG_CHECKPOINTING[config], config)
    return None


def training_recipe_checkpointing(model_name: str, training: TrainingSpec,
                                  world_size: int) -> tuple[ActivationCheckpointing, str] | None:
    """recipe_checkpointing of a request's model, training (its framework, torchtitan release and
    fine-tune) and GPU count."""
    finetune = training.finetune
    lora = finetune.is_lora
    nf4 = lora and finetune.quantize is Quantization.nf4
    return recipe_checkpointing(training.framework, model_name, training.torchtitan_release, lora=lora, nf4=nf4,
                                single_device=world_size == 1)


def planned_recipe_config(model_name: str, training: TrainingSpec, world_size: int) -> str | None:
    """The framework configuration whose activation checkpointing ``training`` plans (the mode it
    names is that configuration's), None where it is not one's."""
    default = training_recipe_checkpointing(model_name, training, world_size)
    return default[1] if default is not None and default[0] is training.activation_checkpointing else None


SETTING_WORDS: dict[str, str] = {
    "compile": "torch.compile", "float8": "float8 {}", "float8_skips_output": "output projection in bf16",
    "optimizer_in_backward": "optimizer in backward", "async_tp": "async tensor parallelism",
    "optimizer": "{} optimizer", "paged_optimizer": "paged optimizer", "fsdp_cpu_offload": "FSDP CPU offload",
    "optimizer_loop": "{} optimizer step", "activation_offloading": "activation offloading",
}
"""How the header and a refusal name each launch setting (async_tp: ParallelSpec's)."""


def recipe_launch_settings(model_name: str, training: TrainingSpec,
                           world_size: int) -> tuple[dict[str, object], bool, str] | None:
    """The TrainingSpec fields the framework's own configuration of this request's model (and,
    for torchtune, method and device count) sets beside its checkpointing, whether it enables
    asynchronous tensor parallelism, and its name; None where it sets none of them (the
    torchtitan 9dec370 release's TOML configurations are not read for them)."""
    if training.framework is Framework.torchtitan:
        if training.torchtitan_release is not None:
            return None
        config = torchtitan_config_name(model_name, None)
        settings = TORCHTITAN_CONFIG_TRAINING.get(config or "")
        return None if settings is None else (settings, config in TORCHTITAN_CONFIG_ASYNC_TP, config)
    if training.framework is Framework.torchtune:
        default = training_recipe_checkpointing(model_name, training, world_size)
        settings = None if default is None else TORCHTUNE_CONFIG_TRAINING.get(default[1])
        return None if settings is None else (settings, False, default[1])
    return None


def setting_words(field: str, value: object) -> str:
    """A launch setting as the header says it."""
    words = SETTING_WORDS[field]
    return words.format(value.value) if isinstance(value, Enum) else words


def planned_recipe_settings(model_name: str, training: TrainingSpec, parallel: ParallelSpec | None,
                            world_size: int) -> tuple[str, tuple[str, ...]]:
    """The framework configuration whose launch settings ``training`` (and ``parallel``) plan,
    and the words for each planned at that configuration's value; ("", ()) where none is."""
    found = recipe_launch_settings(model_name, training, world_size)
    if found is None:
        return "", ()
    settings, async_tp, config = found
    words = tuple(setting_words(field, value) for field, value in settings.items() if getattr(training, field) == value)
    if async_tp and parallel is not None and parallel.async_tp:
        words += (SETTING_WORDS["async_tp"],)
    return (config, words) if words else ("", ())


def as_run(training: TrainingSpec) -> TrainingSpec:
    """``training`` with every field named: a run that was measured or recorded trained exactly
    what its spec says, so no framework configuration's default (its checkpointing, compile,
    float8, optimizer, offload) may fill a field the record left at the spec's default."""
    return training.model_copy(update={name: getattr(training, name) for name in type(training).model_fields})
