"""DeepSpeed ZeRO-3 on one rank gathers nothing (zeroplan.core.deepspeed_one_rank): no gathered
unit on the allgather stream, none kept at the epilogue; a unit's transient is one module's
autograd gradients. The epilogue's flat copy is made on the reduce stream. Qwen2's per-layer
rotary caches stay on the device under DeepSpeed's engine in the releases that build them."""

from __future__ import annotations

import json

from zeroplan.allocator.schedule import _gather_stream, step_inputs
from zeroplan.allocator.trace import Stream
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core import deepspeed_one_rank
from zeroplan.core.buffers import block_backward_transient_bytes, engine_module_buffer_bytes, transient_buffer_bytes
from zeroplan.core.deepspeed_epilogue import first_module_gathered_bytes, flat_copy_bytes
from zeroplan.core.plan import peak_terms
from zeroplan.core.transformers_release import layer_rope_cache_elements
from zeroplan.specs import StrategyKind

QWEN = "benchmarks/published_memory/configs/qwen1.5-0.5b.json"
FLAGS = (f"{QWEN} --gpu rtx-4090 --micro-batch 1 --seq-len 2048 --activation-checkpointing full "
         "--precision fp16-mixed --framework hf --transformers-version 4.40.0 --torch-release 2.2 "
         "--deepspeed-release 0.14.2 --model-load full-per-rank")


def _request(gpus: int, kind: StrategyKind = StrategyKind.zero3, extra: str = ""):
    argv = ["fit", *FLAGS.split(), "--gpus", str(gpus), "--gpus-per-node", str(gpus), *extra.split()]
    return request_from_args(build_parser().parse_args(argv), kind)


def _config() -> dict:
    with open(QWEN) as f:
        return json.load(f)


def test_one_rank_holds_no_gathered_unit() -> None:
    one = _request(1)
    assert deepspeed_one_rank.gathers_nothing(one)
    config = _config()
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    # The largest module's gradient is the (tied) embedding's, in fp16; a block's, an MLP linear's.
    assert transient_buffer_bytes(one) == config["vocab_size"] * hidden * 2
    assert block_backward_transient_bytes(one) == hidden * ffn * 2
    assert first_module_gathered_bytes(one) == 0
    assert _gather_stream(one) == Stream.compute
    assert step_inputs(one, *peak_terms(one)).gather_stream == Stream.compute


def test_two_ranks_and_offloaded_parameters_still_gather() -> None:
    two = _request(2)
    assert not deepspeed_one_rank.gathers_nothing(two)
    assert transient_buffer_bytes(two) > _config()["vocab_size"] * _config()["hidden_size"] * 2
    assert first_module_gathered_bytes(two) > 0
    assert _gather_stream(two) == Stream.all_gather
    # offload_param: the handle's .to(device) copies the host partition (partition_parameters.py:54-55).
    assert not deepspeed_one_rank.gathers_nothing(_request(1, StrategyKind.zero3_param_offload))


def test_epilogue_flat_copy_is_made_on_the_reduce_stream() -> None:
    for gpus in (1, 2):
        request = _request(gpus)
        states, terms = peak_terms(request)
        inputs = step_inputs(request, states, terms)
        assert inputs.backward_end_reduce_copy == flat_copy_bytes(request) > 0
        assert inputs.backward_end_buffers >= inputs.backward_end_reduce_copy
    off = _request(1)
    off = off.model_copy(update={"strategy": off.strategy.model_copy(update={"deepspeed_overlap_comm": False})})
    assert step_inputs(off, *peak_terms(off)).backward_end_reduce_copy == 0


def test_qwen2_rotary_caches_per_layer_until_4_45() -> None:
    config = _config()
    head = config["hidden_size"] // config["num_attention_heads"]
    per_layer = 2 * config["max_position_embeddings"] * head + head // 2
    request = _request(1)
    assert layer_rope_cache_elements(request.model, request.training) == config["num_hidden_layers"] * per_layer
    assert engine_module_buffer_bytes(request) == config["num_hidden_layers"] * per_layer * 2
    later = _request(1, extra="--transformers-version 4.45.0")
    assert layer_rope_cache_elements(later.model, later.training) == 0
    llama = request.model_copy(update={"model": request.model.model_copy(update={"qkv_bias": False})})
    assert layer_rope_cache_elements(llama.model, llama.training) == 0
    plain = _request(1, StrategyKind.ddp)
    assert engine_module_buffer_bytes(plain) == 0


def test_stage3_step_norm_copies_the_largest_partition_in_fp64() -> None:
    from zeroplan.core.deepspeed_stage3_step import norm_copy_bytes

    embedding = _config()["vocab_size"] * _config()["hidden_size"]
    one, two = _request(1), _request(2)
    assert norm_copy_bytes(one) == 8 * embedding
    assert norm_copy_bytes(two) == 8 * -(-embedding // 2)
    assert step_inputs(one, *peak_terms(one)).norm_copy == 8 * embedding
    assert norm_copy_bytes(_request(1, StrategyKind.zero2)) == 0
