"""Stack profiles for time (zeroplan/core/stack_time.py): every stack the published rows and the
planner's frameworks name has one, each fact with the file it was read from."""

from __future__ import annotations

from zeroplan.core.attention_rate import RATES
from zeroplan.core.stack_time import FRAMEWORK_STACKS, PROFILES, kernel_class, stack_profile
from zeroplan.specs.framework import Framework
from zeroplan.validate.step_calibration import stack_of
from zeroplan.validate.step_time import load_published_throughput

STACKS = {"torchtitan", "llm-foundry", "megatron-lm", "megatron-deepspeed", "hf", "fms-fsdp", "torchtune", "deepspeed",
          "llm.c", "tinyllama"}


def test_each_stack_has_a_profile_with_its_sources() -> None:
    assert set(PROFILES) == STACKS
    for name, profile in PROFILES.items():
        assert profile.stack == name
        for cited in (profile.attention_source, profile.fused_source, profile.compile_source, profile.overlap_source):
            assert any(kind in cited for kind in (".py", ".yaml", "README")), (name, cited)
        assert profile.fused_ops and profile.overlap


def test_every_published_rows_stack_has_a_profile() -> None:
    assert {stack_of(row) for row in load_published_throughput().rows} <= set(PROFILES)


def test_a_profiles_attention_kernel_is_a_kernel_the_rate_table_names_or_cudnn() -> None:
    named = {rate.kernel for rate in RATES}
    for profile in PROFILES.values():
        assert profile.attention_kernel in named | {"cudnn"}, profile.stack


def test_the_framework_picks_its_stacks_profile() -> None:
    assert stack_profile(Framework.zeroplan) is None
    for framework, stack in FRAMEWORK_STACKS.items():
        assert stack_profile(framework) is PROFILES[stack]


def test_kernel_class_names_the_kernel_and_compilation() -> None:
    assert kernel_class("flash-attn-2", True) == "flash-attn-2, compiled"
    assert kernel_class("flash-attn-triton", False) == "flash-attn-triton, not compiled"
    assert kernel_class("flash-attn-triton", False, "te-delayed") == "flash-attn-triton, not compiled, float8 te-delayed"
