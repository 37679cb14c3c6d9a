"""DeepSpeed ZeRO-3's gathers under megatron-deepspeed, module by module
(zeroplan.core.deepspeed_coordinator), on the DeepSpeed-on-Azure 1T row's request."""

from __future__ import annotations

import pytest

from zeroplan.core.buffers import transient_buffer_bytes
from zeroplan.core.layout import element_bytes, gradient_wire_bytes
from zeroplan.core.deepspeed_coordinator import peak_gathered_bytes, replays_gathers
from zeroplan.units import ceil_div
from zeroplan.validate.step_time import load_published_throughput

ROW = next(r for r in load_published_throughput().rows if r.name == "deepspeed azure gpt-1t a100 x1024 zero3-offload b8 s1024")
REQUEST = ROW.request()
H, F, N = 25_600, 102_400, 1024


def _with(**strategy) -> object:
    return REQUEST.with_strategy(REQUEST.strategy.model_copy(update=strategy))


def _padded(elements: int) -> int:
    return ceil_div(elements, N) * N * element_bytes(REQUEST.training.precision, REQUEST.convention).compute_parameter


def test_the_largest_moment_is_the_mlp_output_backward_with_the_next_linear_prefetched() -> None:
    # At dense_4h_to_h's backward its weight is gathered, its prefetch (wanted: min(3e9 - 2.6e9,
    # 5e7) elements, whole parameters) has brought dense_h_to_4h's weight, and its full gradient
    # is alive: two F x H weights gathered and one gradient, not a whole 15.7 GB block and more.
    assert replays_gathers(REQUEST)
    expected = 2 * _padded(F * H) + F * H * gradient_wire_bytes(REQUEST)
    assert peak_gathered_bytes(REQUEST) == expected
    assert transient_buffer_bytes(REQUEST) == expected


def test_without_room_to_prefetch_one_module_and_its_gradient() -> None:
    # stage3_max_live_parameters below what is available: nothing is prefetched, so the most held
    # is the largest module (dense_h_to_4h: its weight and its 102,400-element bias, above the
    # persistence threshold) with its gradients.
    request = _with(deepspeed_max_live_parameters=1)
    module = F * H + F
    assert peak_gathered_bytes(request) == _padded(F * H) + _padded(F) + module * gradient_wire_bytes(request)


def test_the_reference_convention_keeps_the_unit_model() -> None:
    # The harness's own ZeRO-3 engine (the zero state convention) gathers whole units: not replayed.
    from zeroplan.specs.framework import Framework
    from zeroplan.specs.training import StateConvention

    other = REQUEST.model_copy(update={"training": REQUEST.training.model_copy(
        update={"framework": Framework.zeroplan, "state_convention": StateConvention.zero})})
    assert other.convention is StateConvention.zero and not replays_gathers(other)


def test_hf_plans_the_release_defaults_and_peft_lora_adapters_as_modules() -> None:
    # Under hf the stage-3 settings the strategy leaves unset are DeepSpeed's defaults (0.13.3
    # runtime/zero/config.py): LoRA's 8 x 8,192 adapters of Llama-2-70B persist (1e5), its
    # 8 x 28,672 ones are fetched as modules of their own.
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.deepspeed_coordinator import (
        _modules, max_live_parameters, max_reuse_distance, persistence_threshold, persistent_elements, replay,
    )
    from zeroplan.specs.strategy import StrategyKind

    row = ("llama-2-70b --gpus 8 --gpu h100-80gb --micro-batch 8 --seq-len 2048 --activation-checkpointing full "
           "--precision bf16-mixed --framework hf --lora-rank 8 --lora-targets q,k,v,o,gate,up,down --deepspeed-release 0.13.3")
    request = request_from_args(build_parser().parse_args(["fit", *row.split()]), StrategyKind.zero3)
    assert (max_live_parameters(request), max_reuse_distance(request), persistence_threshold(request)) == (10**9, 10**9, 10**5)
    assert replays_gathers(request)
    modules, params, _, _ = _modules(request)
    block = [[params[p].name for p in ids] for unit, ids in modules if unit == 1]
    assert ["block.0.mlp.down.lora_a.weight"] in block and ["block.0.attention.q.weight"] in block
    assert [] in block  # the norms and the 8 x 8,192 adapters persist: their modules fetch nothing
    # Per block 2 norms (8,192), six lora_A and three lora_B of 8 x 8,192, two lora_B of 8 x 1,024; the final norm.
    assert persistent_elements(request) == 80 * (2 * 8_192 + 9 * 65_536 + 2 * 8_192) + 8_192
    # After an optimizer step the counter starts that far below zero: the prefetch runs further.
    assert replay(request).peak_bytes > replay(request, 0).peak_bytes


# DeepSpeed 0.13.3's own engine on the 70B LoRA row's shapes over 1,024
# (benchmarks/deepspeed_zero3_allocator_replay.py, stage3_param_persistence_threshold 4,096) frees
# each forward gather's buffer 5 gathers after it in step 1 and 14 in step 2
# (benchmarks/deepspeed_coordinator_check.py): one block ahead, then three. Step 2 is the first to
# start the coordinator's counter below zero by the persistent elements, which that run's
# narrow adapters make 1.59 x its stage3_max_live_parameters (the row's own: 0.05 x).
@pytest.mark.slow
def test_the_prefetch_runs_as_many_blocks_ahead_as_the_engine_after_an_optimizer_step() -> None:
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.deepspeed_coordinator import _modules, _trace, replay
    from zeroplan.specs.strategy import StrategyKind

    row = ("llama-2-70b --gpus 8 --gpu h100-80gb --micro-batch 8 --seq-len 2048 --activation-checkpointing full "
           "--precision bf16-mixed --framework hf --lora-rank 8 --lora-targets q,k,v,o,gate,up,down --deepspeed-release 0.13.3")
    request = request_from_args(build_parser().parse_args(["fit", *row.split()]), StrategyKind.zero3)
    modules, _, blocks, _ = _modules(request)
    trace = _trace(request, modules, blocks)
    at = next(step for step, (m, _) in enumerate(trace) if m >= 0 and modules[m][0] == 41)  # block.40's first fetch

    def blocks_ahead(counter_start: int | None) -> int:
        gathered = [int(name.split(".")[1]) for step, name in replay(request, counter_start).gathers
                    if step <= at and name.startswith("block.")]
        return max(gathered) - 40

    assert blocks_ahead(0) == 1  # step 1
    assert blocks_ahead(None) == 1  # the row's steady state: 49.8 M persistent elements below zero
    assert blocks_ahead(-1_594_098_480) == 3  # the scaled run's offset, at the row's scale


# DeepSpeed counts the elements of the tensor it partitions (partition_parameters.py
# _convert_to_deepspeed_param: ds_numel = param.numel()); under bitsandbytes that is Params4bit's
# packed codes. Measured on DeepSpeed 0.19.8's own engine with bitsandbytes 0.50.2 (nf4, double
# quantization, bnb_4bit_quant_storage bf16; transformers 4.56.2 from_pretrained, 2 gloo ranks):
# on a Llama of hidden 256, FFN 896 and one KV head of 32, q_proj's ds_numel is 16,384 and
# gate_proj's 57,344, and under stage3_param_persistence_threshold 4,096 k_proj and v_proj (2,048
# each) persist while gate_proj's lora_B (7,168) is gathered.
def _tiny_request(tmp_path, flags: str):
    """deepspeed_zero3_qlora_step.py's 4-block Llama (hidden 256, FFN 896, one KV head of 32) on 2
    ranks under zero3 and hf LoRA, its stage-3 settings DeepSpeed's defaults over 1,024."""
    import json

    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.specs.strategy import StrategyKind

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 896,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 1, "vocab_size": 512,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    common = ("--gpus 2 --gpu a100-40gb --micro-batch 2 --seq-len 512 --precision bf16-mixed --framework hf --lora-rank 8 "
              "--lora-targets q,k,v,o,gate,up,down --activation-checkpointing full --attention flash ")
    request = request_from_args(build_parser().parse_args(["fit", str(path), *(common + flags).split()]), StrategyKind.zero3)
    return request.with_strategy(request.strategy.model_copy(update={
        "deepspeed_prefetch_bucket_elements": 48_828, "deepspeed_max_live_parameters": 976_562,
        "deepspeed_max_reuse_distance": 976_562, "deepspeed_param_persistence_threshold": 4096}))


def test_a_4bit_base_counts_its_packed_elements_as_deepspeed_does(tmp_path) -> None:
    from zeroplan.core.deepspeed_coordinator import _modules

    request = _tiny_request(tmp_path, "--quantize nf4 --double-quant")
    _, params, _, _ = _modules(request)
    numel = {p.name: p.numel for p in params}
    assert numel["block.0.attention.q.weight"] == 16_384 and numel["block.0.mlp.gate.weight"] == 57_344
    assert "block.0.attention.k.weight" not in numel and "block.0.attention.v.weight" not in numel
    assert numel["block.0.mlp.gate.lora_b.weight"] == 7_168


# DeepSpeed 0.19.3's recompute attribution (deepspeed_coordinator.holds_recomputed_frozen): on
# DeepSpeed 0.19.8's own engine (benchmarks/deepspeed_zero3_qlora_step.py --bf16-base, the same
# shapes, transformers' reentrant checkpoint) the gathered parameters at each block's down_proj
# backward are 1.89, 3.43, 5.10 and 6.77 MB for blocks 3 to 0: each recomputed block's frozen
# weights (1.67 MB) stay to the end of the backward. DeepSpeed 0.13.3 has no such attribution.
def test_a_reentrant_recompute_keeps_each_blocks_frozen_weights_from_deepspeed_0_19_3(tmp_path) -> None:
    from zeroplan.core.deepspeed_coordinator import _modules, _trace, holds_recomputed_frozen, replay

    def at_down_backward(request) -> list[float]:
        modules, params, blocks, _ = _modules(request)
        steps = [step for step, (m, backward) in enumerate(_trace(request, modules, blocks)) if m >= 0 and backward
                 and any(params[p].name.endswith("mlp.down.weight") for p in modules[m][1])]
        return [round(replay(request).held_bytes[step] / 1e6, 2) for step in steps]

    current, earlier = _tiny_request(tmp_path, ""), _tiny_request(tmp_path, "--deepspeed-release 0.13.3")
    assert holds_recomputed_frozen(current.training) and not holds_recomputed_frozen(earlier.training)
    assert at_down_backward(current) == [1.99, 3.37, 5.04, 6.71]
    assert at_down_backward(earlier) == [2.45, 2.45, 2.45, 1.96]
