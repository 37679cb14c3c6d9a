"""bitsandbytes before 0.43.2 kept each 4-bit matmul's input (MatMul4Bit ``ctx.tensors = (A, B)``,
dropped by commit 9e75374): the planner's term, pinned against the hf QLoRA block records
measured with that line restored (zeroplan/frameworks/lora.py matmul_4bit_keeps_input)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.record import FrameworkRecord
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, FineTuneSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus

RECORDS = Path(__file__).resolve().parent.parent / "benchmarks" / "framework-finetune-records"
PAIRS = [  # (bitsandbytes 0.50.2 record, the same run on 0.43.1's MatMul4Bit)
    (f"hf_llama-3.1-8b_ddp_bf16-mixed+qlora-nf4-r16-{t}_ac=none_s1024_b1.json",
     f"hf_llama-3.1-8b_ddp_bf16-mixed+qlora-nf4-r16-{t}-bnb0.43.1_ac=none_s1024_b1.json") for t in ("qkvogud", "qv")
]


def _record(name: str) -> FrameworkRecord:
    return FrameworkRecord.model_validate_json((RECORDS / name).read_text(encoding="utf-8"))


def _predicted(record: FrameworkRecord) -> int:
    sys.path.insert(0, str(RECORDS.parent))
    import framework_accuracy

    return framework_accuracy.predicted_block_bytes(record)


@pytest.mark.parametrize("current, legacy", PAIRS, ids=["qkvogud", "qv"])
def test_the_kept_inputs_the_planner_adds_are_what_the_old_matmul_keeps(current: str, legacy: str) -> None:
    now, then = _record(current), _record(legacy)
    measured = then.block_kept_bytes - now.block_kept_bytes
    # Llama-3.1-8B at s 1024: a bf16 copy of its fp32 input per 4-bit linear that reads the
    # residual stream or the MLP (q, k, v, gate, up: 4096 wide; down: 14336), none for o, whose
    # bf16 input the attention keeps anyway.
    assert _predicted(then) - _predicted(now) == 2 * 1024 * (5 * 4096 + 14336)
    assert abs((_predicted(then) - _predicted(now)) - measured) <= 0.02 * measured, measured


def _request(version: str, framework: str = "zeroplan", checkpointing: str = "none") -> PlanRequest:
    finetune = FineTuneSpec(lora_rank=32, quantize="nf4", lora_targets=("q", "v"), bitsandbytes_version=version)
    return PlanRequest(model=get_model("llama-2-7b"), cluster=cluster_from_gpus(get_gpu("a10g"), 1),
                       strategy=StrategySpec(kind="ddp"), batch=BatchSpec(seq_len=512, micro_batch_size=2),
                       training=TrainingSpec(framework=framework, precision="bf16-pure", finetune=finetune,
                                             activation_checkpointing=checkpointing))


def test_the_reference_model_keeps_each_shared_input_once_before_0_43_2() -> None:
    from zeroplan.core.finetune.activations import lora_layer_delta_bytes

    # litgpt's bf16 model: Linear4bit's x.to(bf16) is the shared input itself, so the gate/up
    # input and the down input are kept once each; q, k and v's is the adapters' already, o's
    # the attention's own.
    added = lora_layer_delta_bytes(_request("0.42.0")) - lora_layer_delta_bytes(_request("0.43.2"))
    assert added == 2 * 2 * 512 * (4096 + 11008)
    assert lora_layer_delta_bytes(_request("0.50.2")) == lora_layer_delta_bytes(_request("0.43.2"))


def test_an_old_bitsandbytes_under_the_non_reentrant_checkpoint_is_refused() -> None:
    with pytest.raises(ZeroplanError, match="finetune.bitsandbytes_version"):
        _request("0.43.1", checkpointing="full")
    _request("0.43.2", checkpointing="full")
    _request("0.43.1", framework="hf", checkpointing="full")


def test_each_profile_that_plans_an_nf4_base_names_its_library_and_releases() -> None:
    from zeroplan.core.profiles import PROFILES
    from zeroplan.specs import Framework

    assert "bitsandbytes 0.39.0 and later" in PROFILES[Framework.hf].nf4_library
    assert "bitsandbytes 0.39.0 and later" in PROFILES[Framework.zeroplan].nf4_library
    assert PROFILES[Framework.torchtune].nf4_library.startswith("torchao")


@pytest.mark.slow
def test_the_previous_steps_matmul_inputs_are_what_bitsandbytes_leaves_alive_after_backward() -> None:
    # bitsandbytes' own Linear4bit on CPU (benchmarks/bnb_ctx_retention.py): the step's output
    # referenced as litgpt's fit() references it, each MatMul4Bit input still alive is counted.
    sys.path.insert(0, str(RECORDS.parent))
    import bnb_ctx_retention
    from zeroplan.core.finetune.activations import previous_step_matmul_inputs_bytes

    assert bnb_ctx_retention.measure(keeps_input=False) == 0
    kept = bnb_ctx_retention.measure(keeps_input=True)
    assert kept > 0
    assert kept == previous_step_matmul_inputs_bytes(bnb_ctx_retention.request("0.42.0"))
    assert previous_step_matmul_inputs_bytes(bnb_ctx_retention.request("0.43.2")) == 0


def _swift_request(version: str = "0.41.3", reentrant: bool | None = False, cast: bool = False,
                   checkpointing: str = "full", precision: str = "bf16-pure") -> PlanRequest:
    """ms-swift's December 2023 QLoRA row: Qwen-1 7B, bf16 base, one 2048-token sample."""
    finetune = FineTuneSpec(lora_rank=8, quantize="nf4", lora_targets=("q", "k", "v"), bitsandbytes_version=version,
                            kbit_fp32_cast=cast)
    return PlanRequest(model=get_model("qwen-7b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 1),
                       strategy=StrategySpec(kind="ddp"), batch=BatchSpec(seq_len=2048, micro_batch_size=1),
                       training=TrainingSpec(framework="hf", precision=precision, finetune=finetune,
                                             activation_checkpointing=checkpointing, checkpoint_reentrant=reentrant))


def test_the_non_reentrant_checkpoint_keeps_each_blocks_4bit_inputs_before_0_43_2() -> None:
    from zeroplan.core.finetune.activations import checkpoint_escaping_inputs_bytes

    # A bf16 module: the attention norm's output (q, k, v), the attention output (o), the MLP
    # norm's output (gate, up) and the gated product (down), one bf16 tensor each.
    assert checkpoint_escaping_inputs_bytes(_swift_request()) == 2 * 2048 * (3 * 4096 + 11008)
    # prepare_model_for_kbit_training's fp32 stream under the Trainer's autocast: a bf16 copy per
    # 4-bit linear, o's input (the attention's bf16 output) shared; Qwen-1's q, k, v are one
    # linear (c_attn), its w1 and w2 two: one copy for c_attn, one each for w1 and w2.
    fp32_stream = _swift_request(cast=True, precision="bf16-mixed")
    assert checkpoint_escaping_inputs_bytes(fp32_stream) == 2 * 2048 * (4 * 4096 + 11008)
    assert checkpoint_escaping_inputs_bytes(_swift_request(reentrant=None)) == 0  # hf's own: reentrant
    assert checkpoint_escaping_inputs_bytes(_swift_request(reentrant=True)) == 0
    assert checkpoint_escaping_inputs_bytes(_swift_request(version="0.43.2")) == 0


def test_the_escaping_inputs_join_every_block_and_leave_the_recomputed_one() -> None:
    from zeroplan.core.frameworks import framework_activation_bytes, framework_recompute_bytes

    old, new = _swift_request(), _swift_request(version="0.43.2")
    per_block = 2 * 2048 * (3 * 4096 + 11008)
    # Kept by every block; the recomputed block's own copies die with its recomputation, which
    # under the reentrant checkpoint kept gate/up's input and the product: the same tensors as
    # the forward's (o's is the attention's; q/k/v's is the bf16 tensor their adapters keep
    # uncast, peft's bnb Linear4bit casting it to their bf16 at no copy).
    assert framework_activation_bytes(old) - framework_activation_bytes(new) == 32 * per_block
    assert framework_recompute_bytes(old) == framework_recompute_bytes(new)
    reentrant = _swift_request(reentrant=True)
    assert framework_recompute_bytes(reentrant) - framework_recompute_bytes(new) == 2 * 2048 * (4096 + 11008)


def test_checkpoint_reentrant_and_kbit_fp32_cast_are_refused_where_they_mean_nothing() -> None:
    from zeroplan.core.profiles import check_framework_request

    # Without checkpointing the choice stands and changes nothing (the plan search tries both).
    check_framework_request(_swift_request(checkpointing="none").training)
    from zeroplan.core.frameworks import framework_activation_bytes

    assert framework_activation_bytes(_swift_request(checkpointing="none")) == \
        framework_activation_bytes(_swift_request(checkpointing="none", reentrant=None))
    with pytest.raises(ZeroplanError, match="checkpoint_reentrant.*allowed only with framework hf"):
        check_framework_request(TrainingSpec(framework="torchtune", activation_checkpointing="full",
                                             checkpoint_reentrant=False))
    check_framework_request(_swift_request().training)
    with pytest.raises(ZeroplanError, match="finetune.kbit_fp32_cast.*quantized base"):
        FineTuneSpec(lora_rank=8, kbit_fp32_cast=False)
    with pytest.raises(ZeroplanError, match="finetune.kbit_fp32_cast.*allowed only with framework hf"):
        PlanRequest(model=get_model("llama-2-7b"), cluster=cluster_from_gpus(get_gpu("a10g"), 1),
                    strategy=StrategySpec(kind="ddp"), batch=BatchSpec(seq_len=512, micro_batch_size=1),
                    training=TrainingSpec(framework="litgpt", precision="bf16-pure",
                                          finetune=FineTuneSpec(lora_rank=8, quantize="nf4", kbit_fp32_cast=False)))


def test_without_the_fp32_cast_the_rest_of_the_base_stays_bf16() -> None:
    from zeroplan.core.finetune.storage import frozen_element_bytes

    assert frozen_element_bytes(_swift_request(cast=True)) == 4
    assert frozen_element_bytes(_swift_request(cast=False)) == 2


def test_before_0_43_0_a_weight_dequantizes_to_fp16_then_to_the_input_dtype() -> None:
    from zeroplan.core.finetune.activations import dequantized_weight_bytes, largest_quantized_elements

    largest = largest_quantized_elements(_swift_request())
    assert dequantized_weight_bytes(_swift_request(version="0.42.0")) == largest * (2 + 2)
    assert dequantized_weight_bytes(_swift_request(version="0.43.0")) == largest * 2


@pytest.mark.slow
def test_what_escapes_the_checkpoint_is_what_bitsandbytes_leaves_alive() -> None:
    # bitsandbytes' own Linear4bit on CPU under torch's two checkpoints
    # (benchmarks/bnb_checkpoint_escape.py): the inputs alive after the forward and the backward.
    sys.path.insert(0, str(RECORDS.parent))
    import bnb_checkpoint_escape as bench
    from zeroplan.core.finetune.activations import checkpoint_escaping_inputs_bytes

    planned = bench.LAYERS * checkpoint_escaping_inputs_bytes(bench.request("0.41.3", reentrant=False))
    assert planned > 0
    assert bench.measure(keeps_input=True, reentrant=False) == (planned, planned)
    assert bench.measure(keeps_input=True, reentrant=True) == (0, 0)
    assert bench.measure(keeps_input=False, reentrant=False) == (0, 0)


def test_llm_int8_inputs_escape_the_non_reentrant_checkpoint_in_every_release() -> None:
    from zeroplan.core.finetune.activations import checkpoint_escaping_inputs_bytes
    from zeroplan.core.frameworks import framework_recompute_bytes

    def int8(reentrant: bool) -> PlanRequest:
        finetune = FineTuneSpec(lora_rank=8, quantize="int8", lora_targets=("q", "v"))
        return PlanRequest(model=get_model("llama-2-7b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 1),
                           strategy=StrategySpec(kind="ddp"), batch=BatchSpec(seq_len=1024, micro_batch_size=1),
                           training=TrainingSpec(framework="hf", precision="bf16-mixed", finetune=finetune,
                                                 activation_checkpointing="full", checkpoint_reentrant=reentrant))

    # MatMul8bitLt's ctx.tensors = (CAt, subA, A): the fp32 inputs of q/k/v and of gate/up, the
    # fp32 product down reads, the attention's bf16 output o reads.
    assert checkpoint_escaping_inputs_bytes(int8(False)) == 1024 * (4 * (4096 + 11008 + 4096) + 2 * 4096)
    assert checkpoint_escaping_inputs_bytes(int8(True)) == 0
    # The recomputed block's own kept inputs die with its recomputation.
    assert framework_recompute_bytes(int8(True)) - framework_recompute_bytes(int8(False)) == 1024 * 4 * (2 * 4096 + 11008)
