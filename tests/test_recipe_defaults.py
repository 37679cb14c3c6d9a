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
from zeroplan.specs.training import ActivationCheckpointing as AC, Float8Recipe, Optimizer, OptimizerLoop


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
    # 0.6.1 ships no 70B single-device configuration and no Llama 2 13B full single-device one;
    # the 7B models' one-device full fine-tune is their 7B_full_low_memory configuration.
    ("llama-3.1-70b", 1, FineTuneSpec(lora_rank=8, quantize=Quantization.nf4), AC.none, None),
    ("llama-2-13b", 1, FineTuneSpec(), AC.none, None),
    ("llama-2-7b", 1, FineTuneSpec(), AC.full, "llama2/7B_full_low_memory"),
    ("mistral-7b", 1, FineTuneSpec(), AC.full, "mistral/7B_full_low_memory"),
    ("codellama-7b", 1, FineTuneSpec(lora_rank=8), AC.full, "code_llama2/7B_lora_single_device"),
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


@pytest.mark.parametrize("model", ["llama-2-7b", "mistral-7b", "codellama-7b"])
def test_the_low_memory_full_configuration_pages_steps_in_backward_and_offloads(model) -> None:
    # torchtune 0.6.1 recipes/configs/<model>/7B_full_low_memory.yaml: bitsandbytes PagedAdamW,
    # optimizer_in_bwd True, enable_activation_checkpointing and enable_activation_offloading True.
    request = PlanRequest(model=get_model(model), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 1),
                          strategy=StrategySpec(kind="ddp"), batch=BatchSpec(seq_len=2048, micro_batch_size=1),
                          training=TrainingSpec(framework=Framework.torchtune, precision="bf16-pure"))
    t = request.training
    assert (t.optimizer, t.paged_optimizer, t.optimizer_in_backward, t.activation_offloading,
            t.activation_checkpointing) == (Optimizer.adamw, True, True, True, AC.full)
    assert request.recipe_launch_words[1][-1] == "activation offloading"


def test_the_configurations_offloading_with_checkpointing_named_off_is_refused_as_its_own(capsys) -> None:
    # torchtune's recipe raises when offloading is on without checkpointing: the refusal says
    # the offloading was the configuration's and names the flag that turns it off.
    argv = ["fit", "llama-2-7b", "--gpus", "1", "--gpu", "a100-80gb", "--framework", "torchtune",
            "--activation-checkpointing", "none"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("zeroplan: error: --activation-offloading: not named, so torchtune's "
                          "llama2/7B_full_low_memory config's activation offloading was planned")
    assert main([*argv, "--no-activation-offloading"]) == 0


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


# ---------------------------------------------------------------- compile, float8, async TP, optimizer in backward

def _titan_405b(gpu: str = "h100-80gb", parallel: ParallelSpec | None = None, batch: BatchSpec | None = None,
                **training) -> PlanRequest:
    return PlanRequest(model=get_model("llama-3.1-405b"), cluster=cluster_from_gpus(get_gpu(gpu), 64),
                       strategy=StrategySpec(kind="fsdp-full-shard"), batch=batch or BatchSpec(seq_len=8192),
                       training=TrainingSpec(framework=Framework.torchtitan, **training), parallel=parallel or ParallelSpec())


_TP8 = ParallelSpec(tp=8, sequence_parallel=True)


def test_torchtitan_405b_is_planned_as_its_configuration_compiles_it() -> None:
    # torchtitan 0.3.0 llama3_405b: compile with async TP, rowwise float8 but lm_head, FullAC.
    request = _titan_405b(parallel=_TP8)
    t = request.training
    assert (t.compile, t.float8, t.float8_skips_output, t.activation_checkpointing) == (True, Float8Recipe.rowwise, True, AC.full)
    assert request.parallel.async_tp
    assert request.recipe_launch_words == ("llama3_405b", ("torch.compile", "float8 rowwise", "output projection in bf16",
                                                           "async tensor parallelism"))
    # Without a tensor-parallel mesh torchtitan enables no async TP.
    assert not _titan_405b().parallel.async_tp


@pytest.mark.parametrize(("model", "release"), [
    ("llama-3.1-70b", None), ("llama-3.1-8b", None), ("qwen3-14b", None), ("llama-3.1-405b", "9dec370"),
])
def test_configurations_that_set_no_compile_leave_it_off(model, release) -> None:
    extra = {"unchunked_loss": True} if release else {}
    t = _request(model, framework=Framework.torchtitan, torchtitan_release=release, **extra).training
    assert (t.compile, t.float8, t.float8_skips_output) == (False, None, False)


def test_a_named_setting_is_kept_off_included() -> None:
    no_async = ParallelSpec(tp=8, sequence_parallel=True, async_tp=False)
    off = _titan_405b(parallel=no_async, compile=False, float8=None, float8_skips_output=False)
    assert (off.training.compile, off.training.float8, off.training.float8_skips_output) == (False, None, False)
    assert not off.parallel.async_tp
    assert not _titan_405b(parallel=no_async).parallel.async_tp
    # A named recipe keeps the configuration's filter_fqns (the output projection in bf16).
    tensorwise = _titan_405b(float8="tensorwise").training
    assert (tensorwise.float8, tensorwise.float8_skips_output, tensorwise.compile) == (Float8Recipe.tensorwise, True, True)
    assert not _titan_405b(float8_skips_output=False).training.float8_skips_output
    assert _titan_405b(compile=False, float8=None).recipe_launch_words == ("", ())


def test_a_recorded_run_is_planned_as_it_ran_without_configuration_defaults() -> None:
    # A measured or recorded run's spec says all it trained with (zeroplan.validate builds its
    # requests through as_run): the configuration's compile, float8 and checkpointing stay out.
    from zeroplan.specs.recipe_defaults import as_run

    training = TrainingSpec(framework=Framework.torchtitan)
    ran = as_run(training)
    assert ran == training and ran.model_fields_set == set(TrainingSpec.model_fields)
    assert _titan_405b(parallel=_TP8).training.compile  # the configuration's, for contrast
    as_recorded = PlanRequest(model=get_model("llama-3.1-405b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 64),
                              strategy=StrategySpec(kind="fsdp-full-shard"), batch=BatchSpec(seq_len=8192),
                              training=ran, parallel=ParallelSpec(tp=8, sequence_parallel=True, async_tp=False))
    t = as_recorded.training
    assert (t.compile, t.float8, t.activation_checkpointing) == (False, None, AC.none)


def test_the_defaults_plan_as_the_same_settings_named() -> None:
    from zeroplan.core.plan import plan

    defaulted = plan(_titan_405b(parallel=_TP8))
    named = plan(_titan_405b(parallel=ParallelSpec(tp=8, sequence_parallel=True, async_tp=True), compile=True,
                             float8="rowwise", float8_skips_output=True))
    eager = plan(_titan_405b(parallel=ParallelSpec(tp=8, sequence_parallel=True, async_tp=False), compile=False,
                             float8=None))
    assert defaulted.memory == named.memory and defaulted.time == named.time
    # Compiled float8 blocks run faster than the eager bf16 ones the planner assumed before.
    assert defaulted.time.forward_compute_s < eager.time.forward_compute_s


@pytest.mark.parametrize(("kwargs", "flag", "words"), [
    # torchtitan's converter raises on a GPU without float8 matmuls.
    ({"gpu": "a100-80gb"}, "float8", "float8 rowwise"),
    ({"compile": False}, "float8", "float8 rowwise"),
    ({"parallel": ParallelSpec(tp=8, sequence_parallel=False)}, "parallel.async_tp", "async tensor parallelism"),
])
def test_a_configuration_setting_the_request_refuses_is_named_as_the_configurations(kwargs, flag, words) -> None:
    with pytest.raises(ZeroplanError) as refused:
        _titan_405b(**kwargs)
    assert refused.value.field == flag
    assert refused.value.detail.startswith(f"not named, so torchtitan's llama3_405b config's {words} was planned, and ")


def test_a_refusal_of_what_the_request_names_is_its_own() -> None:
    # float8 named on an A100: refused with or without the configuration's compile.
    with pytest.raises(ZeroplanError) as refused:
        _titan_405b(gpu="a100-80gb", float8="tensorwise")
    assert refused.value.field == "float8" and not refused.value.detail.startswith("not named")


def test_the_header_names_the_configurations_settings(capsys) -> None:
    args = ["fit", "llama-3.1-405b", "--gpus", "64", "--gpu", "h100-80gb", "--framework", "torchtitan", "--tp", "8",
            "--strategies", "fsdp-full-shard"]
    main(args)
    said = " ".join(capsys.readouterr().out.split())
    assert ("activation checkpointing full (torchtitan's llama3_405b config, as are its torch.compile, float8 rowwise, "
            "output projection in bf16, async tensor parallelism)") in said
    main([*args, "--no-compile", "--float8", "none", "--no-async-tp"])
    said = " ".join(capsys.readouterr().out.split())
    assert "activation checkpointing full (torchtitan's llama3_405b config)." in said and "torch.compile" not in said
    main([*args, "--activation-checkpointing", "none", "--no-async-tp"])
    said = " ".join(capsys.readouterr().out.split())
    assert ("activation checkpointing none (torch.compile, float8 rowwise, output projection in bf16: torchtitan's "
            "llama3_405b config)") in said


@pytest.mark.parametrize(("extra", "flag"), [
    (["--gpu", "a100-80gb"], "--float8"), (["--gpu", "h100-80gb", "--no-compile"], "--float8"),
    (["--gpu", "h100-80gb", "--tp", "8", "--no-sequence-parallel"], "--async-tp"),
])
def test_the_cli_refuses_a_configuration_setting_in_one_line(capsys, extra, flag) -> None:
    code = main(["fit", "llama-3.1-405b", "--gpus", "64", "--framework", "torchtitan", *extra])
    error = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(error) == 1 and f"{flag}: not named, so torchtitan's llama3_405b config's" in error[0]


def _tune_full(model: str = "llama-3.1-8b", gpus: int = 1, grad_accum: int = 1, **training) -> PlanRequest:
    return PlanRequest(model=get_model(model), cluster=cluster_from_gpus(get_gpu("h100-80gb"), gpus),
                       strategy=StrategySpec(kind="ddp" if gpus == 1 else "fsdp-full-shard"),
                       batch=BatchSpec(seq_len=2048, grad_accum_steps=grad_accum),
                       training=TrainingSpec(framework=Framework.torchtune, precision="bf16-pure", **training))


_PAGED_IN_BACKWARD = ("adam-8bit optimizer", "paged optimizer", "optimizer in backward")


@pytest.mark.parametrize(("model", "gpus", "finetune", "words"), [
    # llama3_1/8B_full_single_device.yaml and llama3/8B_full_single_device.yaml: PagedAdamW8bit, optimizer_in_bwd True.
    ("llama-3.1-8b", 1, FineTuneSpec(), _PAGED_IN_BACKWARD), ("llama-3-8b", 1, FineTuneSpec(), _PAGED_IN_BACKWARD),
    # llama3_1/70B_full.yaml and llama3/70B_full.yaml: fsdp_cpu_offload True, AdamW fused False.
    ("llama-3.1-70b", 8, FineTuneSpec(), ("FSDP CPU offload", "foreach optimizer step")),
    ("llama-3-70b", 8, FineTuneSpec(), ("FSDP CPU offload", "foreach optimizer step")),
    # The others build fused AdamW on the GPU and step after backward: the planner's own.
    ("llama-3.1-8b", 8, FineTuneSpec(), ()), ("llama-3.1-8b", 1, FineTuneSpec(lora_rank=8), ()),
    ("llama-3.1-70b", 8, FineTuneSpec(lora_rank=8), ()), ("mistral-7b", 8, FineTuneSpec(), ()),
])
def test_torchtune_plans_its_configurations_optimizer(model, gpus, finetune, words) -> None:
    t = _tune_full(model, gpus, finetune=finetune).training
    paged = words == _PAGED_IN_BACKWARD
    offloaded = bool(words) and not paged
    assert (t.optimizer is Optimizer.adam_8bit, t.paged_optimizer, t.optimizer_in_backward) == (paged, paged, paged)
    assert (t.fsdp_cpu_offload, t.optimizer_loop is OptimizerLoop.foreach) == (offloaded, offloaded)
    assert _tune_full(model, gpus, finetune=finetune).recipe_launch_words[1] == words


def test_an_optimizer_named_in_place_of_the_configurations_is_not_paged() -> None:
    # PagedAdamW8bit is one component: naming another optimizer replaces it, paging included.
    t = _tune_full(optimizer="adamw").training
    assert (t.optimizer, t.paged_optimizer, t.optimizer_in_backward) == (Optimizer.adamw, False, True)
    assert not _tune_full("llama-3.1-70b", 8, fsdp_cpu_offload=False).training.fsdp_cpu_offload
    # ... and its fused: False with it: a Lion named on the 70B configuration steps as the profile's.
    lion = _tune_full("llama-3.1-70b", 8, optimizer="lion").training
    assert (lion.optimizer_loop, lion.fsdp_cpu_offload) == (None, True)


def test_torchtune_optimizer_in_backward_named_off_or_refused_with_accumulation(capsys) -> None:
    assert not _tune_full(grad_accum=4, optimizer_in_backward=False).training.optimizer_in_backward
    with pytest.raises(ZeroplanError, match="optimizer_in_backward: not named, so torchtune's "
                                            "llama3_1/8B_full_single_device config's optimizer in backward was planned"):
        _tune_full(grad_accum=4)
    code = main(["fit", "llama-3.1-8b", "--gpus", "1", "--gpu", "h100-80gb", "--framework", "torchtune", "--grad-accum", "4"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(error) == 1 and "--optimizer-in-backward: not named" in error[0]
    main(["fit", "llama-3.1-8b", "--gpus", "1", "--gpu", "h100-80gb", "--framework", "torchtune"])
    said = " ".join(capsys.readouterr().out.split())
    assert ("(torchtune's llama3_1/8B_full_single_device config, as are its adam-8bit optimizer, paged optimizer, "
            "optimizer in backward)") in said
