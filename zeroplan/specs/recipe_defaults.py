"""What a framework's own shipped configuration of a model sets where the planner would otherwise
assume something else: torchtitan ships one Python configuration per model it trains
(models/*/config_registry.py), and a user who runs it without overrides runs that
configuration's activation checkpointing. A request that names no activation_checkpointing is
planned with it (PlanRequest._framework_recipe_checkpointing), and the header says so."""

from __future__ import annotations

from zeroplan.specs.framework import Framework
from zeroplan.specs.training import ActivationCheckpointing

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

TORCHTITAN_9DEC370_CONFIGS = frozenset({"llama3_8b", "llama3_70b", "llama3_405b"})
"""The configurations the December 2024 release ships (no Qwen3 model then)."""


def torchtitan_config_name(model_name: str, release: str | None) -> str | None:
    """The torchtitan configuration that trains this preset at this release (None: the profile's
    0.3.0), or None where that release ships none."""
    config = TORCHTITAN_CONFIGS.get(model_name)
    if config is None or (release == "9dec370" and config not in TORCHTITAN_9DEC370_CONFIGS):
        return None
    return config


def recipe_checkpointing(framework: Framework, model_name: str, release: str | None) -> tuple[ActivationCheckpointing, str] | None:
    """The activation checkpointing the framework's own configuration of this model sets, and
    that configuration's name; None where the framework ships none for it (the planner's default,
    none, stands)."""
    if framework is not Framework.torchtitan:
        return None
    config = torchtitan_config_name(model_name, release)
    return None if config is None else (TORCHTITAN_CONFIG_CHECKPOINTING[config], config)
