"""PEFT's modules_to_save (--lora-modules-to-save): the input's accepted values and refusals, and
the trainable copy's bytes measured on peft's own ModulesToSaveWrapper on the CPU
(zeroplan.core.finetune.modules_to_save)."""

from __future__ import annotations

import json

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.buffers import optimizer_step_temporary_bytes, resident_buffer_bytes
from zeroplan.core.finetune import modules_to_save
from zeroplan.core.model_states import model_state_bytes
from zeroplan.specs.finetune import SavedModule

LORA = ["--framework", "hf", "--lora-rank", "8", "--gpus", "1", "--gpu", "h100-80gb", "--seq-len", "1024"]


def _request(*flags: str):
    args = build_parser().parse_args(["fit", *flags])
    return request_from_args(args, "ddp")


@pytest.mark.parametrize("value, saved", [
    ("embed,head", (SavedModule.embed, SavedModule.head)),
    ("head", (SavedModule.head,)),
    (" embed ", (SavedModule.embed,)),
])
def test_the_flag_names_the_modules_trained_whole(value, saved) -> None:
    request = _request("qwen-7b", *LORA, "--lora-modules-to-save", value)
    assert request.training.finetune.modules_to_save == saved


@pytest.mark.parametrize("flags, words", [
    (["qwen-7b", *LORA, "--lora-modules-to-save", "wte,lm_head"], ["unknown module 'wte'", "allowed: embed, head"]),
    (["qwen-7b", *LORA, "--lora-modules-to-save", ","], ["names no module", "allowed: embed, head"]),
    (["qwen-7b", *LORA, "--lora-modules-to-save", "head,head"], ["modules_to_save", "names a module twice"]),
    (["qwen-7b", "--framework", "hf", "--lora-modules-to-save", "embed"], ["modules_to_save", "only with adapters"]),
    (["qwen-7b", *LORA[2:], "--framework", "torchtune", "--lora-modules-to-save", "embed"],
     ["modules_to_save", "allowed only with framework hf"]),
    (["qwen-7b", *LORA, "--lora-modules-to-save", "embed", "--strategies", "zero3"],
     ["modules_to_save", "allowed: --strategies ddp"]),
    (["qwen2-0.5b", *LORA, "--lora-modules-to-save", "embed"], ["modules_to_save", "ties its head"]),
    (["qwen-7b", *LORA, "--lora-targets", "q,v,output", "--lora-modules-to-save", "head"],
     ["modules_to_save", "also an adapter target"]),
    (["qwen-7b", *LORA, "--lora-modules-to-save", "embed", "--optimizer", "adafactor"],
     ["modules_to_save", "element-wise optimizers"]),
    (["qwen-7b", *LORA, "--lora-modules-to-save", "embed", "--precision", "fp16-mixed"],
     ["modules_to_save", "GradScaler"]),
])
def test_unmodelled_values_are_refused_in_one_line(zeroplan_cli, flags, words) -> None:
    code, _, err = zeroplan_cli("fit", *flags)
    assert code == 2 and err.count("\n") == 1, err
    for word in words:
        assert word in err, err


def test_the_copies_add_a_bf16_embedding_and_head_with_their_gradients_and_adamw_states() -> None:
    flags = ["qwen-7b", *LORA, "--precision", "bf16-mixed", "--lora-targets", "q,k,v"]
    base = _request(*flags)
    saved = _request(*flags, "--lora-modules-to-save", "embed,head")
    copied = 2 * 151_936 * 4_096  # Qwen-7B's wte and lm_head, untied
    without, with_ = model_state_bytes(base), model_state_bytes(saved)
    assert with_.parameter_bytes - without.parameter_bytes == 2 * copied
    assert with_.gradient_bytes - without.gradient_bytes == 2 * copied
    assert with_.optimizer_state_bytes - without.optimizer_state_bytes == 2 * 2 * copied + 2 * 4  # + two step counters
    # An fp32 load copies fp32 modules: twice the bytes.
    fp32 = model_state_bytes(_request(*flags, "--base-dtype", "fp32", "--lora-modules-to-save", "embed,head"))
    fp32_base = model_state_bytes(_request(*flags, "--base-dtype", "fp32"))
    assert fp32.gradient_bytes - fp32_base.gradient_bytes == 4 * copied


def test_ddp_buckets_hold_the_copys_gradient_too() -> None:
    flags = ["qwen-7b", *LORA, "--gpus", "2", "--lora-targets", "q,k,v"]
    extra = resident_buffer_bytes(_request(*flags, "--lora-modules-to-save", "head")) - resident_buffer_bytes(_request(*flags))
    assert extra == 2 * 151_936 * 4_096


def test_peft_trains_a_copy_in_the_modules_dtype_and_adamw_steps_it_as_its_own_group(tmp_path) -> None:
    """peft 0.17.1's ModulesToSaveWrapper over a bf16 LlamaForCausalLM on the CPU, one
    torch.optim.AdamW(foreach=True) step traced by the CPU allocator's profiler: the copies'
    parameters, gradients and states, and the step's sqrt temporaries, byte for byte against
    the planner for the same shapes."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeroplan.harness.allocator_trace import AllocatorTrace

    config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                         max_position_embeddings=256)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    request = _request(str(path), "--framework", "hf", "--lora-rank", "4", "--lora-targets", "q,v", "--gpus", "1",
                       "--gpu", "h100-80gb", "--seq-len", "32", "--precision", "bf16-mixed", "--optimizer-loop", "foreach",
                       "--lora-modules-to-save", "embed,head")

    with AllocatorTrace() as trace:
        torch.manual_seed(0)
        module = LlamaForCausalLM(config).to(torch.bfloat16)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"],
                          task_type="CAUSAL_LM")
        model = get_peft_model(module, lora)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=True)
        tokens = torch.randint(0, config.vocab_size, (1, 32))
        for step in range(2):
            model(input_ids=tokens, labels=tokens).loss.backward()
            with trace.step(step):
                optimizer.step()
    copies = [p for name, p in model.named_parameters() if ".modules_to_save." in name]
    originals = [p for name, p in model.named_parameters() if ".original_module." in name]
    assert len(copies) == 2 and all(not p.requires_grad for p in originals)
    assert sum(p.numel() * p.element_size() for p in copies) == modules_to_save.copy_parameter_bytes(request)
    assert sum(p.grad.numel() * p.grad.element_size() for p in copies) == modules_to_save.copy_gradient_bytes(request)
    states = sum(v.numel() * v.element_size() for p in copies for v in optimizer.state[p].values())
    assert states == modules_to_save.copy_optimizer_state_bytes(request) + modules_to_save.copy_step_counter_bytes(request)
    # The second step's peak: both dtype groups' sqrt lists alive at once (the fp32 adapters' and
    # the bf16 copies'), as the planner's step temporary counts them.
    at_peak = trace.peaks()[1].live_bytes_by_operator
    adapters = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    assert at_peak["aten::sqrt"] == 4 * adapters + modules_to_save.copy_parameter_bytes(request)
    assert at_peak["aten::sqrt"] == optimizer_step_temporary_bytes(request, model_state_bytes(request).optimizer_elements)
