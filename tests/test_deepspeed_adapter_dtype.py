"""DeepSpeed from 0.19.2 no longer casts a zero.Init model to 16 bits (runtime/engine.py
_cast_module_mixed_precision), so under hf's ZeRO-3 peft's fp32 adapters stay fp32
(zeroplan.core.finetune.activations.adapters_stay_fp32): each adapter keeps its fp32 dropped
input and dropout mask, and lora_B A's fp32 output; deepspeed_release 0.13.3 plans the earlier
engines' module.bfloat16(). Measured on DeepSpeed's own engine: benchmarks/deepspeed_zero3_lora_step.py."""

from __future__ import annotations

import argparse
import functools

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.finetune.activations import adapters_stay_fp32, lora_layer_delta_bytes
from zeroplan.core.profiles import check_deepspeed_release
from zeroplan.errors import ZeroplanError
from zeroplan.presets.models import get_model
from zeroplan.specs.strategy import StrategyKind

FLAGS = ("--gpus 2 --micro-batch 2 --seq-len 64 --precision bf16-mixed --framework hf --lora-rank 8 "
         "--lora-targets q,k,v,o,gate,up,down --lora-dropout 0.1")


@functools.lru_cache(maxsize=None)
def _args(flags: str):
    return build_parser().parse_args(["fit", "llama-2-7b", *flags.split()])


def _request(kind: str, flags: str = FLAGS, **changed):
    args = argparse.Namespace(**{**vars(_args(flags)), **changed})
    return request_from_args(args, StrategyKind(kind))


def test_only_zero3_under_a_recent_release_keeps_fp32_adapters() -> None:
    assert adapters_stay_fp32(_request("zero3"))
    assert adapters_stay_fp32(_request("zero3", deepspeed_release="0.19.8"))
    assert not adapters_stay_fp32(_request("zero3", deepspeed_release="0.13.3"))
    # ZeRO-2 never enters zero.Init: the engine's cast reaches the adapters.
    assert not adapters_stay_fp32(_request("zero2"))
    # fp32 training: the adapters and their input are fp32 either way, nothing is copied.
    assert not adapters_stay_fp32(_request("zero3", precision="fp32"))
    # A quantized base enters no zero.Init (transformers' init_empty_weights instead).
    assert not adapters_stay_fp32(_request("zero3", quantize="nf4"))


def test_fp32_adapters_keep_two_more_bytes_per_saved_element() -> None:
    # Per adapter: lora_A's dropped input 4 bytes instead of 2 (the bool mask on a GPU is the same
    # byte either way), and lora_B's saved r-wide product 4 instead of 2.
    model = get_model("llama-2-7b")
    tokens, rank = 2 * 64, 8
    inputs = 6 * model.hidden_size + model.ffn_hidden_size  # q, k, v, o, gate, up read h-wide inputs; down f-wide
    extra = lora_layer_delta_bytes(_request("zero3")) - lora_layer_delta_bytes(_request("zero3", deepspeed_release="0.13.3"))
    assert extra == 2 * tokens * inputs + 7 * 2 * tokens * rank


def test_without_dropout_each_adapter_keeps_its_own_fp32_copy() -> None:
    # lora_A saves peft's fp32 cast of the shared input (_cast_input_dtype), one per adapter,
    # where bf16 adapters read the shared bf16 input that zero3's F.linear keeps once.
    model = get_model("llama-2-7b")
    tokens, rank = 2 * 64, 8
    fresh = lora_layer_delta_bytes(_request("zero3", lora_dropout=0.0))
    cast = lora_layer_delta_bytes(_request("zero3", lora_dropout=0.0, deepspeed_release="0.13.3"))
    assert fresh - cast == 4 * tokens * (6 * model.hidden_size + model.ffn_hidden_size) + 7 * 2 * tokens * rank


def test_a_release_outside_the_hf_list_is_refused() -> None:
    training = _request("zero3").training.model_copy(update={"deepspeed_release": "2022-bigscience"})
    with pytest.raises(ZeroplanError, match=r"deepspeed_release.*allowed: 0\.19\.8, 0\.13\.3"):
        check_deepspeed_release(training)
