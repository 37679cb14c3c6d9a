"""A gptq-int4 LoRA base (auto-gptq 0.4.2's qlinear_cuda_old QuantLinear under hf's peft and
DeepSpeed ZeRO-1/2 in fp16): its buffers' bytes, what each base linear keeps for backward, the
dequantization's peak, and one-line refusals. The module's own forward and backward on CPU:
benchmarks/gptq_quantlinear_memory.py."""

from __future__ import annotations

import pytest

from zeroplan.core.finetune.activations import dequantized_weight_bytes
from zeroplan.core.plan import plan
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.hf_config import config_quantization
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, FineTuneSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus

QWEN_7B = get_model("qwen-7b")
ALL = ("q", "k", "v", "o", "gate", "up", "down")
# Qwen-1's QuantLinears per block (modeling_qwen.py: c_attn h -> 3h, attn.c_proj h -> h, mlp.w1 and
# w2 h -> f, mlp.c_proj f -> h), as (in, out): hidden 4096, ffn 11008.
MODULES = ((4096, 3 * 4096), (4096, 4096), (4096, 11008), (4096, 11008), (11008, 4096))


def request(quantize: str = "gptq-int4", kind: str = "zero2", checkpointing: str = "none", seq: int = 1024,
            **finetune) -> PlanRequest:
    return PlanRequest(model=QWEN_7B, cluster=cluster_from_gpus(get_gpu("a100-80gb"), 1),
                       strategy=StrategySpec(kind=kind), batch=BatchSpec(seq_len=seq),
                       training=TrainingSpec(framework="hf", precision="fp16-mixed", activation_checkpointing=checkpointing,
                                             finetune=FineTuneSpec(lora_rank=64, lora_targets=ALL, quantize=quantize,
                                                                   **finetune)))


def quant_linear_bytes(fan_in: int, fan_out: int, group: int = 128) -> int:
    """qweight (int32, in // 8 x out), qzeros (int32, in / group x out // 8), scales (fp16,
    in / group x out), g_idx (int32, in): qlinear_cuda_old.py lines 47-62 at v0.4.2."""
    groups = -(-fan_in // group)
    return 4 * (fan_in // 8) * fan_out + 4 * groups * (fan_out // 8) + 2 * groups * fan_out + 4 * fan_in


def test_the_base_linears_are_quantlinear_buffers_and_the_rest_fp16() -> None:
    gptq = plan(request()).memory.parameter_bytes
    fp16 = plan(request("none")).memory.parameter_bytes
    # Under DeepSpeed's fp16 engine the unquantized base is fp16; everything but the block
    # linears' weights (embedding, head, norms, biases, adapters) is the same in both.
    assert fp16 - gptq == 32 * sum(2 * i * o - quant_linear_bytes(i, o) for i, o in MODULES)


def test_a_group_size_changes_only_the_scales_and_zero_points() -> None:
    g128 = plan(request()).memory.parameter_bytes
    g64 = plan(request(gptq_group_size=64)).memory.parameter_bytes
    assert g64 - g128 == 32 * sum(quant_linear_bytes(i, o, 64) - quant_linear_bytes(i, o) for i, o in MODULES)


def test_each_base_linear_keeps_its_dequantized_fp16_weight_for_backward() -> None:
    # torch.matmul(x.half(), weight) with x needing a gradient and the weight not: mm keeps the
    # weight (2 bytes an element) and nothing of x; the fp16 base (a frozen nn.Linear) keeps nothing.
    gptq = plan(request()).memory.activation_bytes
    fp16 = plan(request("none")).memory.activation_bytes
    assert gptq - fp16 == 32 * sum(2 * i * o for i, o in MODULES)


def test_under_full_checkpointing_only_the_recomputed_block_holds_them() -> None:
    def memory(quantize: str):
        return plan(request(quantize, checkpointing="full")).memory

    gptq, fp16 = memory("gptq-int4"), memory("none")
    assert gptq.activation_bytes == fp16.activation_bytes  # the checkpointed blocks keep their inputs only
    # The block rebuilt in backward (the workspace) holds its five weights and the unpacking's peak.
    fan_in, fan_out = 4096, 3 * 4096
    unpacking = 5 * fan_in * fan_out + fan_in // 128 * fan_out - 2 * fan_in * fan_out
    assert gptq.temporary_bytes - fp16.temporary_bytes == sum(2 * i * o for i, o in MODULES) + unpacking


def test_the_dequantization_peak_is_the_unpacking_above_the_weight_it_leaves() -> None:
    # Line 240's int32 shift (4 bytes an element) and its int8 cast (1) beside the int8 zero points
    # (one per group and output), less the fp16 weight the block keeps anyway, for the largest
    # module (c_attn, 4096 x 12288).
    fan_in, fan_out = 4096, 3 * 4096
    assert dequantized_weight_bytes(request()) == 5 * fan_in * fan_out + fan_in // 128 * fan_out - 2 * fan_in * fan_out


def test_the_qwen_rows_flags_plan_and_print_the_layout(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "--detail", "qwen-7b", "--gpus", "1", "--gpu", "a100-80gb", "--seq-len", "2048",
                                  "--activation-checkpointing", "full", "--precision", "fp16-mixed", "--framework", "hf",
                                  "--lora-rank", "64", "--quantize", "gptq-int4", "--lora-targets", ",".join(ALL))
    assert code == 0, err
    assert "frozen in gptq-int4 (auto-gptq QuantLinear" in out and "per 128 input rows" in out
    strategies = [line.split()[0] for line in out.splitlines() if line.split()[:1] in (["ddp"], ["zero1"], ["zero2"], ["zero3"])]
    assert strategies == ["zero1", "zero2"]


@pytest.mark.parametrize("argv, flag, words", [
    (("--framework", "torchtune"), "--quantize", "allowed: --framework hf"),
    (("--strategies", "ddp"), "--strategies", "allowed: zero1, zero2"),
    (("--strategies", "zero3"), "--strategies", "allowed: zero1, zero2"),
    (("--precision", "bf16-mixed"), "--precision", "allowed: fp16-mixed"),
    (("--seq-len", "64"), "--seq-len", "128 or more"),
    (("--gptq-group-size", "96"), "--gptq-group-size", "allowed: a divisor of"),
    (("--dora",), "--dora", "allowed: false"),
])
def test_what_is_not_modelled_is_refused_in_one_line(zeroplan_cli, argv, flag, words) -> None:
    base = {"--framework": "hf", "--precision": "fp16-mixed", "--strategies": "zero2", "--seq-len": "1024"}
    given = dict(zip(argv[::2], argv[1::2])) if len(argv) % 2 == 0 else {}
    args = [item for key, value in base.items() if key not in given for item in (key, value)]
    code, _, err = zeroplan_cli("fit", "qwen-7b", "--gpus", "1", "--lora-rank", "64", "--quantize", "gptq-int4",
                                "--lora-targets", ",".join(ALL), *args, *argv)
    assert code == 2 and err.count("\n") == 1, err
    assert flag in err and words in err, err


def test_a_group_size_without_a_gptq_base_is_refused() -> None:
    with pytest.raises(ZeroplanError, match="finetune.gptq_group_size.*gptq-int4 base only"):
        FineTuneSpec(lora_rank=8, quantize="nf4", gptq_group_size=64)


def test_a_config_json_gptq_quantization_config_sets_the_base() -> None:
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    assert config_quantization({"quantization_config": quant}) == {"quantize": "gptq-int4", "gptq_group_size": 128}
    with pytest.raises(ZeroplanError, match="gptq bits 8 is not modelled"):
        config_quantization({"quantization_config": {**quant, "bits": 8}})
    with pytest.raises(ZeroplanError, match="desc_act true is not modelled"):
        config_quantization({"quantization_config": {**quant, "desc_act": True}})
