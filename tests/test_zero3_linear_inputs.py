"""DeepSpeed ZeRO-3's zero.Init replaces torch.nn.functional.linear for good with
zero3_linear_wrap, whose LinearFunctionForZeroStage3 saves every linear's input, frozen weight
or not (zeroplan.core.finetune.activations.zero3_linear_keeps_input): under LoRA each frozen base
linear keeps the input it reads, against DeepSpeed's own function on transformers' Llama block."""

from __future__ import annotations

import argparse
import functools

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.finetune.activations import lora_layer_delta_bytes, zero3_linear_keeps_input
from zeroplan.presets.models import get_model
from zeroplan.specs.strategy import StrategyKind

FLAGS = "--gpus 2 --micro-batch 2 --seq-len 64 --precision fp32 --framework hf --lora-rank 8 --lora-dropout 0.1"


@functools.lru_cache(maxsize=None)
def _args(model: str, flags: str):
    return build_parser().parse_args(["fit", model, *flags.split()])


def _request(model: str, kind: str, flags: str = FLAGS, **changed):
    args = argparse.Namespace(**{**vars(_args(model, flags)), **changed})
    return request_from_args(args, StrategyKind(kind))


def test_only_hf_stage_3_under_deepspeed_keeps_the_frozen_inputs() -> None:
    assert zero3_linear_keeps_input(_request("llama-2-7b", "zero3"))
    assert zero3_linear_keeps_input(_request("llama-2-7b", "zero3-param-offload"))
    assert not zero3_linear_keeps_input(_request("llama-2-7b", "zero2"))
    assert not zero3_linear_keeps_input(_request("llama-2-7b", "fsdp-full-shard"))
    assert not zero3_linear_keeps_input(_request("llama-2-7b", "zero3", framework="zeroplan"))
    # transformers enters no zero.Init for a quantized model; its base linears are bitsandbytes'.
    assert not zero3_linear_keeps_input(_request("llama-2-7b", "zero3", quantize="nf4"))


def test_the_kept_inputs_are_the_unwrapped_linears_inputs() -> None:
    # PEFT's default q,v on Llama-2-7B: q/k/v's input (the adapters keep only their dropped
    # copies), gate/up's and down's; o's is the attention kernel's own output, kept anyway.
    model = get_model("llama-2-7b")
    extra = lora_layer_delta_bytes(_request("llama-2-7b", "zero3")) - lora_layer_delta_bytes(_request("llama-2-7b", "zero2"))
    assert extra == 4 * 2 * 64 * (2 * model.hidden_size + model.ffn_hidden_size)


@pytest.mark.slow
def test_deepspeeds_linear_keeps_what_the_planner_adds() -> None:
    """Saved-tensor hooks on transformers' LlamaDecoderLayer under peft's LoRA (q,v, dropout 0.1,
    fp32, SDPA, CPU), run once with torch's F.linear and once with DeepSpeed 0.19.8's
    zero3_linear_wrap in its place: the storages kept beyond the plain run are the planner's
    difference between the same request at stage 3 and at stage 2, to the byte."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    linear_module = pytest.importorskip("deepspeed.runtime.zero.linear")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    h, f, heads, s, b = 256, 688, 4, 64, 2
    config = LlamaConfig(hidden_size=h, intermediate_size=f, num_attention_heads=heads, num_key_value_heads=heads,
                         num_hidden_layers=1, vocab_size=64, attention_dropout=0.0)
    config._attn_implementation = "sdpa"

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = LlamaDecoderLayer(config, layer_idx=0)

        def forward(self, x, position_embeddings):
            return self.layer(x, position_embeddings=position_embeddings)

    torch.manual_seed(0)
    block = get_peft_model(Block(), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
    block.train()
    x = torch.randn(b, s, h, requires_grad=True)
    position_embeddings = LlamaRotaryEmbedding(config)(x, torch.arange(s)[None].expand(b, s))

    def kept_bytes() -> int:
        skipped = {t.untyped_storage().data_ptr() for t in (*block.parameters(), x, *position_embeddings)}
        storages: dict[int, int] = {}

        def pack(tensor):
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in skipped and tensor.numel() > 1:
                storages[pointer] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = block(x, position_embeddings)
        del output
        return sum(storages.values())

    plain = kept_bytes()
    original = torch.nn.functional.linear
    torch.nn.functional.linear = linear_module.zero3_linear_wrap
    try:
        patched = kept_bytes()
    finally:
        torch.nn.functional.linear = original

    model = get_model("llama-2-7b").model_copy(update={
        "hidden_size": h, "ffn_hidden_size": f, "num_heads": heads, "num_kv_heads": heads, "head_dim": None, "num_layers": 1})
    flags = FLAGS.replace("--micro-batch 2 --seq-len 64", f"--micro-batch {b} --seq-len {s}")
    stage3, stage2 = (_request("llama-2-7b", kind, flags).model_copy(update={"model": model}) for kind in ("zero3", "zero2"))
    assert patched - plain == lora_layer_delta_bytes(stage3) - lora_layer_delta_bytes(stage2) == 4 * b * s * (2 * h + f)
