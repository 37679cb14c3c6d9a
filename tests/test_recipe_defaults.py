"""A request that names no activation checkpointing is planned with the one its framework's own
configuration of the model sets (zeroplan.specs.recipe_defaults), and says so."""

from __future__ import annotations

import pytest

from zeroplan.cli.main import main
from zeroplan.emit.formats import torchtitan_config_name, torchtitan_module
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.finetune import FineTuneSpec, Quantization
from zeroplan.specs.framework import Framework
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs.training import ActivationCheckpointing as AC


def _request(model: str = "llama-3.1-8b", gpus: int = 8, parallel: ParallelSpec | None = None, **training) -> PlanRequest:
    return PlanRequest(model=get_model(model), cluster=cluster_from_gpus(get_gpu("h100-80gb"), gpus),
                       strategy=StrategySpec(kind="fsdp-full-shard"), batch=BatchSpec(seq_len=4096, micro_batch_size=1),
                       training=TrainingSpec(**training), parallel=parallel or ParallelSpec())


@pytest.mark.parametrize(("model", "release", "expected"), [
    ("llama-3.1-8b", None, AC.selective_op),
    ("llama-3-8b", "9dec370", AC.selective_op),
    ("llama-3.1-70b", None, AC.full),
    ("llama-3.1-405b", "9dec370", AC.full),
    ("qwen3-0.6b", None, AC.selective_op),
    ("qwen3-14b", None, AC.full),
    # No configuration ships: qwen3-8b's only one is an nvfp4 variant; 9dec370 has no Qwen3; Llama 2 none.
    ("qwen3-8b", None, AC.none),
    ("qwen3-0.6b", "9dec370", AC.none),
    ("llama-2-7b", None, AC.none),
])
def test_torchtitan_plans_its_configuration_policy_when_none_is_named(model, release, expected) -> None:
    extra = {"unchunked_loss": True} if release == "9dec370" else {}
    request = _request(model, framework=Framework.torchtitan, torchtitan_release=release, **extra)
    assert request.training.activation_checkpointing is expected
    assert (request.recipe_checkpointing_name is not None) is (expected is not AC.none)


def test_a_named_policy_and_other_frameworks_keep_their_own() -> None:
    assert _request(framework=Framework.torchtitan, activation_checkpointing=AC.none).training.activation_checkpointing is AC.none
    assert _request(framework=Framework.torchtitan, activation_checkpointing="full").recipe_checkpointing_name is None
    for framework in (Framework.zeroplan, Framework.hf):
        assert _request(framework=framework).training.activation_checkpointing is AC.none
    # torchtune 0.6.1 ships no configuration of Qwen2.5-7B.
    assert _request("qwen2.5-7b", framework=Framework.torchtune, precision="bf16-pure").training.activation_checkpointing is AC.none


def test_a_default_the_request_refuses_is_named_as_the_default() -> None:
    # A float8 tensor-parallel compiled block was measured without selective-op; without
    # checkpointing the same request plans.
    asked = dict(framework=Framework.torchtitan, compile=True, float8="tensorwise")
    layout = ParallelSpec(tp=2, sequence_parallel=True)
    with pytest.raises(ZeroplanError, match="activation_checkpointing: not named, so torchtitan's llama3_8b config's "
                                            "selective-op was planned, and float8 refuses it"):
        _request(parallel=layout, **asked)
    assert _request(parallel=layout, activation_checkpointing="none", **asked).training.activation_checkpointing is AC.none


def test_a_refusal_of_the_request_itself_is_its_own() -> None:
    # tp 16 on 8 GPUs is refused whatever the policy: the refusal is not laid on the default.
    with pytest.raises(ZeroplanError) as refused:
        _request(parallel=ParallelSpec(tp=16), framework=Framework.torchtitan)
    assert refused.value.field != "activation_checkpointing"


def test_the_header_says_whose_policy_it_is(capsys) -> None:
    main(["fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--framework", "torchtitan"])
    said = " ".join(capsys.readouterr().out.split())
    assert "activation checkpointing selective-op (torchtitan's llama3_8b config)" in said
    main(["fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--framework", "torchtitan",
          "--activation-checkpointing", "none"])
    said = " ".join(capsys.readouterr().out.split())
    assert "activation checkpointing none." in said and "llama3_8b config" not in said


def test_the_cli_names_the_flag_when_the_default_is_refused(capsys) -> None:
    code = main(["fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--framework", "torchtitan", "--tp", "2",
                 "--compile", "--float8", "tensorwise"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(error) == 1 and "--activation-checkpointing: not named" in error[0]


def test_the_emitted_launch_names_the_module_and_configuration() -> None:
    qwen = _request("qwen3-0.6b", framework=Framework.torchtitan)
    assert (torchtitan_module(qwen), torchtitan_config_name(qwen)) == ("qwen3", "qwen3_0_6b")
    llama = _request("llama-3.1-70b", framework=Framework.torchtitan)
    assert (torchtitan_module(llama), torchtitan_config_name(llama)) == ("llama3", "llama3_70b")


@pytest.mark.parametrize(("model", "gpus", "finetune", "expected", "config"), [
    ("llama-3.1-8b", 1, FineTuneSpec(lora_rank=8), AC.full, "llama3_1/8B_lora_single_device"),
    # The distributed LoRA configurations of the 8B, 7B and 13B models leave checkpointing off.
    ("llama-3.1-8b", 8, FineTuneSpec(lora_rank=8), AC.none, "llama3_1/8B_lora"),
    ("llama-2-13b", 8, FineTuneSpec(lora_rank=8), AC.none, "llama2/13B_lora"),
    ("llama-3.1-8b", 1, FineTuneSpec(lora_rank=8, quantize=Quantization.nf4), AC.full, "llama3_1/8B_qlora_single_device"),
    ("llama-3.1-8b", 8, FineTuneSpec(), AC.full, "llama3_1/8B_full"),
    ("mistral-7b", 8, FineTuneSpec(lora_rank=8), AC.full, "mistral/7B_lora"),
    # 0.6.1 ships no 70B single-device configuration and no Llama 2 7B full single-device one.
    ("llama-3.1-70b", 1, FineTuneSpec(lora_rank=8, quantize=Quantization.nf4), AC.none, None),
    ("llama-2-7b", 1, FineTuneSpec(), AC.none, None),
])
def test_torchtune_plans_its_configuration_per_method_and_device_count(model, gpus, finetune, expected, config) -> None:
    request = PlanRequest(model=get_model(model), cluster=cluster_from_gpus(get_gpu("h100-80gb"), gpus),
                          strategy=StrategySpec(kind="ddp" if gpus == 1 else "fsdp-full-shard"),
                          batch=BatchSpec(seq_len=2048, micro_batch_size=1),
                          training=TrainingSpec(framework=Framework.torchtune, precision="bf16-pure", finetune=finetune))
    assert request.training.activation_checkpointing is expected
    assert request.recipe_checkpointing_name == config
    if config is not None:
        from zeroplan.emit.formats import torchtune_recipe

        assert torchtune_recipe(request)[1] == config


def test_a_suggested_gpu_count_keeps_the_policy_the_request_was_planned_with() -> None:
    # One GPU: llama3_1/8B_lora_single_device's full recomputation; the request, once made,
    # names it, so a copy on 8 GPUs (the smallest-change search's) does not switch to the
    # distributed configuration's none.
    one = PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 1),
                      strategy=StrategySpec(kind="ddp"), batch=BatchSpec(seq_len=2048, micro_batch_size=1),
                      training=TrainingSpec(framework=Framework.torchtune, precision="bf16-pure",
                                            finetune=FineTuneSpec(lora_rank=8)))
    eight = one.model_copy(update={"cluster": cluster_from_gpus(get_gpu("h100-80gb"), 8)})
    assert PlanRequest.model_validate(dict(eight)).training.activation_checkpointing is AC.full


def test_a_request_given_as_dicts_takes_the_cluster_defaults_gpu_count() -> None:
    # ClusterSpec's own defaults (one node of 8) decide single-device or distributed.
    def request(**cluster):
        return PlanRequest.model_validate({
            "model": get_model("llama-3.1-8b"), "cluster": {"gpu": get_gpu("h100-80gb"), **cluster},
            "strategy": {"kind": "ddp" if cluster else "fsdp-full-shard"}, "batch": {"seq_len": 2048},
            "training": {"framework": "torchtune", "precision": "bf16-pure", "finetune": {"lora_rank": 8}}})

    assert request().recipe_checkpointing_name == "llama3_1/8B_lora"
    assert request().training.activation_checkpointing is AC.none
    one = request(gpus_per_node=1)
    assert (one.recipe_checkpointing_name, one.training.activation_checkpointing) == ("llama3_1/8B_lora_single_device", AC.full)
