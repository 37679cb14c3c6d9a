"""Activation memory against Korthikanti et al. 2022 and the checkpointing modes."""

from __future__ import annotations

import pytest

from zeroplan.core.activations import (
    activation_bytes, attention_core_terms, checkpointed_layers_bytes, korthikanti_layer_bytes,
    layer_bytes, logits_bytes, norm_bytes,
)
from zeroplan.presets.models import get_model
from zeroplan.specs import ActivationCheckpointing, AttentionKernel, Framework, Kernels, ModelSpec, Precision, TrainingSpec

EAGER = TrainingSpec(attention_kernel=AttentionKernel.eager)


@pytest.mark.parametrize("name", ["gpt2", "gpt2-xl", "gpt3-175b"])
@pytest.mark.parametrize("s,b", [(1024, 1), (2048, 4), (512, 3)])
def test_generalised_layer_reproduces_korthikanti_eq1(name: str, s: int, b: int) -> None:
    # GPT presets have MHA, a 4h GeLU MLP, LayerNorm and dropout: exactly eq. (1)'s setting.
    model = get_model(name)
    assert layer_bytes(model, EAGER, s, b) == korthikanti_layer_bytes(s, b, model.hidden_size, model.num_heads)


def test_selective_recompute_keeps_34sbh() -> None:
    # Korthikanti sec. 5: selective recomputation leaves 34*s*b*h bytes per layer.
    model = get_model("gpt3-175b")
    training = EAGER.model_copy(update={"activation_checkpointing": ActivationCheckpointing.selective})
    s, b = 2048, 1
    assert checkpointed_layers_bytes(model, training, s, b) == model.num_layers * 34 * s * b * model.hidden_size


def test_full_recompute_keeps_block_inputs_plus_one_block() -> None:
    model = get_model("llama-2-7b")
    training = TrainingSpec(activation_checkpointing=ActivationCheckpointing.full)
    s, b = 4096, 2
    expected = model.num_layers * 2 * s * b * model.hidden_size + layer_bytes(model, training, s, b)
    assert checkpointed_layers_bytes(model, training, s, b) == expected


def test_modes_order_none_selective_full() -> None:
    model = get_model("llama-2-13b")
    sizes = [
        activation_bytes(model, EAGER.model_copy(update={"activation_checkpointing": mode}), 4096, 1)
        for mode in ActivationCheckpointing
    ]
    assert sizes[0] > sizes[1] > sizes[2]


def test_flash_attention_removes_quadratic_term() -> None:
    model = get_model("llama-2-7b")
    flash = TrainingSpec(attention_kernel=AttentionKernel.flash)
    short = sum(attention_core_terms(model, flash, 1024, 1).values())
    long = sum(attention_core_terms(model, flash, 4096, 1).values())
    assert long == 4 * short  # linear in s
    assert sum(attention_core_terms(model, EAGER, 4096, 1).values()) > 4 * sum(attention_core_terms(model, EAGER, 1024, 1).values())


def test_gqa_stores_smaller_keys_and_values() -> None:
    mha = get_model("llama-2-7b")
    gqa = mha.model_copy(update={"num_kv_heads": 8})
    flash = TrainingSpec()
    s, b, e = 4096, 1, 2
    saved = sum(attention_core_terms(mha, flash, s, b).values()) - sum(attention_core_terms(gqa, flash, s, b).values())
    assert saved == e * s * b * 2 * (mha.kv_size - gqa.kv_size)


def test_activations_are_linear_in_micro_batch() -> None:
    model = get_model("mixtral-8x7b")
    one = activation_bytes(model, TrainingSpec(), 2048, 1)
    assert activation_bytes(model, TrainingSpec(), 2048, 5) == 5 * one


CPU = TrainingSpec(kernels=Kernels.cpu)


def test_fp32_doubles_activations_without_masks_except_the_fp32_rms_norms_on_cpu() -> None:
    model = get_model("llama-2-7b")  # no dropout: every saved tensor but the norms' scales with the dtype
    bf16 = activation_bytes(model, CPU.model_copy(update={"attention_kernel": AttentionKernel.eager}), 1024, 1)
    fp32 = activation_bytes(model, CPU.model_copy(update={"attention_kernel": AttentionKernel.eager, "precision": Precision.fp32}), 1024, 1)
    norms = (2 * model.num_layers + 1) * norm_bytes(model, CPU, 1024, 1)
    assert norms == (2 * model.num_layers + 1) * 2 * 4 * 1024 * model.hidden_size
    assert fp32 - norms == 2 * (bf16 - norms)


def test_fp32_doubles_activations_without_masks_except_the_rstd_on_cuda() -> None:
    # The fused kernel saves the input in its own dtype, so only the fp32 rstd does not scale.
    model = get_model("llama-2-7b")
    bf16 = activation_bytes(model, EAGER, 1024, 1)
    fp32 = activation_bytes(model, EAGER.model_copy(update={"precision": Precision.fp32}), 1024, 1)
    rstd = (2 * model.num_layers + 1) * 4 * 1024
    assert fp32 - rstd == 2 * (bf16 - rstd)


def test_rms_norm_saves_two_fp32_tensors_on_cpu_and_layer_norm_its_input() -> None:
    llama, gpt = get_model("llama-2-7b"), get_model("gpt2")
    for precision in (Precision.fp32, Precision.bf16_mixed):
        for autocast in (False, True):
            training = CPU.model_copy(update={"precision": precision})
            assert norm_bytes(llama, training, 8, 2, autocast=autocast) == 2 * 4 * 8 * 2 * llama.hidden_size
            assert norm_bytes(gpt, training, 8, 2) == precision.compute_bytes * 8 * 2 * gpt.hidden_size


@pytest.mark.parametrize("precision,autocast,input_bytes", [
    (Precision.fp32, False, 4), (Precision.bf16_pure, False, 2),
    (Precision.bf16_mixed, False, 2),  # FSDP2 param_dtype / DeepSpeed: bf16 input and weight
    (Precision.bf16_mixed, True, 4),  # CUDA autocast's fp32 list casts both to fp32
])
def test_fused_rms_norm_saves_its_input_and_an_fp32_rstd_per_token(precision, autocast, input_bytes) -> None:
    llama = get_model("llama-2-7b")
    for framework in (Framework.zeroplan, Framework.torchtitan):
        training = TrainingSpec(precision=precision, framework=framework)
        assert norm_bytes(llama, training, 8, 2, autocast=autocast) == input_bytes * 8 * 2 * llama.hidden_size + 4 * 8 * 2


@pytest.mark.parametrize("framework,precision", [
    (Framework.hf, Precision.bf16_mixed), (Framework.hf, Precision.fp32),  # explicit ops: never F.rms_norm
    (Framework.torchtune, Precision.bf16_pure),  # F.rms_norm(x.float(), weight=bf16): dtypes differ
])
def test_rms_norms_that_take_the_composite_path_on_cuda_save_what_the_cpu_saves(framework, precision) -> None:
    llama = get_model("llama-2-7b")
    cuda = TrainingSpec(framework=framework, precision=precision)
    assert norm_bytes(llama, cuda, 8, 2) == norm_bytes(llama, cuda.model_copy(update={"kernels": Kernels.cpu}), 8, 2)


def test_torchtune_in_fp32_takes_the_fused_path() -> None:
    llama = get_model("llama-2-7b")
    training = TrainingSpec(framework=Framework.torchtune, precision=Precision.fp32)
    assert norm_bytes(llama, training, 8, 2) == 4 * 8 * 2 * llama.hidden_size + 4 * 8 * 2


@pytest.mark.parametrize("name", ["llama-2-7b", "mixtral-8x7b", "gpt2"])
@pytest.mark.parametrize("precision", list(Precision))
def test_cuda_never_saves_more_than_the_cpu(name: str, precision: Precision) -> None:
    model = get_model(name)
    for autocast in (False, True):
        cuda = TrainingSpec(precision=precision)
        cpu = cuda.model_copy(update={"kernels": Kernels.cpu})
        assert activation_bytes(model, cuda, 512, 2, autocast=autocast) <= activation_bytes(model, cpu, 512, 2, autocast=autocast)


def test_the_loss_backward_holds_three_fp32_logit_sized_tensors_in_any_precision() -> None:
    # the saved log-softmax, the log-probabilities' gradient and the logits' gradient
    model = ModelSpec(name="v", vocab_size=1000, hidden_size=64, num_layers=1, num_heads=4, ffn_hidden_size=128)
    assert logits_bytes(model, TrainingSpec(), 10, 2) == 3 * 4 * 10 * 2 * 1000
    assert logits_bytes(model, TrainingSpec(precision=Precision.fp32), 10, 2) == 3 * 4 * 10 * 2 * 1000
