"""A framework's launcher sets the allocator configuration its users run under: torchtitan's
run_train.sh exports expandable_segments:True, so a torchtitan request is judged under it unless
it names another, and the header says so."""

from __future__ import annotations

import pytest

from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import MemoryAssumptions, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.framework import LAUNCH_ALLOCATOR_CONF, Framework


def _request(framework: str, **fields) -> PlanRequest:
    return PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 8),
                       strategy=StrategySpec(kind="fsdp-full-shard"), training=TrainingSpec(framework=framework), **fields)


def test_torchtitan_requests_take_the_launchers_allocator_conf() -> None:
    assert LAUNCH_ALLOCATOR_CONF[Framework.torchtitan] == "expandable_segments:True"
    request = _request("torchtitan")
    assert request.assumptions.allocator_conf == "expandable_segments:True"
    assert request.allocator_conf_is_launch_default
    # Any other assumption given leaves the allocator's to the launcher.
    shifted = _request("torchtitan", assumptions=MemoryAssumptions(nccl_channels=8))
    assert shifted.assumptions.allocator_conf == "expandable_segments:True" and shifted.assumptions.nccl_channels == 8
    as_dict = _request("torchtitan", assumptions={"nccl_channels": 8})
    assert as_dict.assumptions.allocator_conf == "expandable_segments:True"


@pytest.mark.parametrize("conf", ["", None, "max_split_size_mb:128"])
def test_a_named_allocator_conf_wins_over_the_launchers(conf) -> None:
    request = _request("torchtitan", assumptions=MemoryAssumptions(allocator_conf=conf))
    assert request.assumptions.allocator_conf == conf and not request.allocator_conf_is_launch_default


@pytest.mark.parametrize("framework", ["zeroplan", "hf", "torchtune"])
def test_other_launchers_set_none(framework: str) -> None:
    request = _request(framework)
    assert request.assumptions.allocator_conf == "" and not request.allocator_conf_is_launch_default


def test_revalidation_keeps_the_launch_default() -> None:
    request = _request("torchtitan").with_strategy(StrategySpec(kind="hsdp"))
    assert request.assumptions.allocator_conf == "expandable_segments:True"


def test_the_header_names_the_allocator_and_where_it_comes_from(zeroplan_cli) -> None:
    flags = ("fit", "--detail", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--strategies", "fsdp-full-shard")
    code, out, err = zeroplan_cli(*flags, "--framework", "torchtitan")
    assert code == 0, err
    assert ("allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's launch default; "
            "--allocator-conf \"\" for PyTorch's defaults)") in out.splitlines()
    code, out, _ = zeroplan_cli(*flags, "--framework", "torchtitan", "--allocator-conf=")
    assert code == 0 and "allocator:" not in out
    code, out, _ = zeroplan_cli(*flags, "--allocator-conf", "expandable_segments:True")
    assert "allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (--allocator-conf)" in out.splitlines()


def test_torchtitans_multi_node_launcher_sets_none() -> None:
    # torchtitan's multinode_trainer.slurm (the README's multi-node instructions) starts torchrun
    # without PYTORCH_CUDA_ALLOC_CONF; only the single-node script sets expandable segments.
    request = PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 16),
                          strategy=StrategySpec(kind="fsdp-full-shard"), training=TrainingSpec(framework="torchtitan"))
    assert request.cluster.num_nodes == 2
    assert request.assumptions.allocator_conf == "" and request.allocator_conf_is_launch_default
    named = request.model_copy(update={"assumptions": MemoryAssumptions(allocator_conf="expandable_segments:True")})
    assert not named.allocator_conf_is_launch_default
