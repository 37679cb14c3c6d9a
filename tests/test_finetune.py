"""LoRA, QLoRA and frozen parameters in the planner: what trains, what the frozen base occupies,
what the collectives carry, and one-line refusals. The comparison with the frameworks' own
LoRA code is in tests/test_finetune_records.py."""

from __future__ import annotations

import json

import pytest

from zeroplan.core.finetune.storage import nf4_tensor_bytes
from zeroplan.core.finetune.units import trainable_parameters
from zeroplan.core.collective import CollectiveOp
from zeroplan.core.plan import plan
from zeroplan.core.params import parameter_units, total_parameters
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, FineTuneSpec, Framework, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus,
)
from zeroplan.specs.finetune import LoraTarget

LLAMA_8B = get_model("llama-3.1-8b")


def request(finetune: FineTuneSpec = FineTuneSpec(), kind: str = "fsdp-full-shard", gpus: int = 8,
            framework: str = "torchtune", precision: str = "bf16-pure", **training) -> PlanRequest:
    return PlanRequest(model=LLAMA_8B, cluster=cluster_from_gpus(get_gpu("h100-80gb"), gpus),
                       strategy=StrategySpec(kind=kind), batch=BatchSpec(seq_len=4096),
                       # No recomputation unless asked (torchtune's configurations set their own otherwise).
                       training=TrainingSpec(framework=framework, precision=precision, finetune=finetune,
                                             **{"activation_checkpointing": "none", **training}))


def lora_elements(rank: int, targets: tuple[LoraTarget, ...]) -> int:
    """r x (in + out) per wrapped linear of a Llama-3.1-8B block (hidden 4096, kv 1024, ffn 14336)."""
    shapes = {LoraTarget.q: (4096, 4096), LoraTarget.k: (4096, 1024), LoraTarget.v: (4096, 1024),
              LoraTarget.o: (4096, 4096), LoraTarget.gate: (4096, 14336), LoraTarget.up: (4096, 14336),
              LoraTarget.down: (14336, 4096)}
    return 32 * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def test_lora_trains_only_its_adapters_with_each_framework_default_targets() -> None:
    units = parameter_units(LLAMA_8B)
    torchtune = FineTuneSpec(lora_rank=8)
    assert torchtune.targets(Framework.torchtune) == (LoraTarget.q, LoraTarget.v, LoraTarget.o, LoraTarget.gate,
                                                      LoraTarget.up, LoraTarget.down)
    assert trainable_parameters(units, torchtune, Framework.torchtune, LLAMA_8B) == lora_elements(8, torchtune.targets(Framework.torchtune))
    assert trainable_parameters(units, FineTuneSpec(lora_rank=16), Framework.hf, LLAMA_8B) == lora_elements(16, (LoraTarget.q, LoraTarget.v))


def test_lora_model_states_are_the_frozen_base_plus_the_adapters_states() -> None:
    full = plan(request(kind="ddp", gpus=1)).memory
    lora = plan(request(FineTuneSpec(lora_rank=8), kind="ddp", gpus=1)).memory
    adapters = lora_elements(8, FineTuneSpec(lora_rank=8).targets(Framework.torchtune))
    # bf16-pure (torchtune): 2-byte parameters, gradients and AdamW moments; the base is frozen in bf16.
    assert lora.parameter_bytes == full.parameter_bytes + 2 * adapters
    assert lora.gradient_bytes == 2 * adapters
    # Two bf16 AdamW moments per adapter element, plus a step counter per adapter tensor.
    assert 4 * adapters <= lora.optimizer_state_bytes < 4 * adapters + 8 * 1024


def test_frozen_base_is_sharded_by_zero3_and_fsdp_and_replicated_by_ddp_zero1_zero2() -> None:
    finetune = FineTuneSpec(lora_rank=8)
    base_bytes = 2 * total_parameters(LLAMA_8B)
    replicated = plan(request(finetune, kind="zero2", framework="hf", precision="bf16-mixed")).memory.parameter_bytes
    sharded = plan(request(finetune, kind="zero3", framework="hf", precision="bf16-mixed")).memory.parameter_bytes
    assert replicated >= base_bytes
    assert base_bytes / 8 <= sharded < base_bytes / 8 + 2**20


def test_gradient_collectives_carry_only_the_trainable_parameters() -> None:
    finetune = FineTuneSpec(lora_rank=8)
    adapters = lora_elements(8, finetune.targets(Framework.torchtune))
    result = plan(request(finetune))
    reduce = [c for c in result.collectives if c.op is CollectiveOp.reduce_scatter]
    gather = [c for c in result.collectives if c.op is CollectiveOp.all_gather]
    # torchtune's FSDP2 reduces in bf16: the adapters' gradients (padded for 8 ranks) only.
    assert reduce and adapters * 2 <= sum(c.buffer_bytes for c in reduce) < adapters * 2 + 2**20
    # The all-gathers still bring the whole frozen base in.
    assert sum(c.buffer_bytes for c in gather if c.phase.value == "forward") >= 2 * total_parameters(LLAMA_8B)
    ddp = plan(request(finetune, kind="ddp", framework="hf", precision="bf16-mixed"))
    (all_reduce,) = [c for c in ddp.collectives if c.op is CollectiveOp.all_reduce]
    assert all_reduce.buffer_bytes == 4 * lora_elements(8, (LoraTarget.q, LoraTarget.v))


# QLoRA (Dettmers et al. 2023) sec. 3: 4-bit codes, one 8-bit scale per 64 elements and one
# 32-bit constant per 256 scales: 4.127 bits per element with bitsandbytes' fp32 constants.
def test_nf4_storage_is_qlora_papers_bits_per_parameter() -> None:
    numel = 4096 * 4096
    assert nf4_tensor_bytes(numel, 64, True, 4) * 8 / numel == pytest.approx(4.127, abs=5e-4)
    assert nf4_tensor_bytes(numel, 64, False, 4) * 8 / numel == pytest.approx(4.5)
    qlora = plan(request(FineTuneSpec(lora_rank=8, quantize="nf4"), kind="ddp", gpus=1)).memory
    lora = plan(request(FineTuneSpec(lora_rank=8), kind="ddp", gpus=1)).memory
    # The block linears (6.98e9 of 8.03e9 parameters) shrink from 2 bytes to ~0.52.
    assert 0.3 < qlora.parameter_bytes / lora.parameter_bytes < 0.4


# LLM.int8 (Dettmers et al. 2022) as bitsandbytes stores it: one byte per element and an fp32
# absmax per output row (Int8Params data and SCB).
def test_int8_storage_is_a_byte_per_element_and_an_fp32_scale_per_row() -> None:
    def hf(finetune: FineTuneSpec) -> PlanRequest:
        return request(finetune, kind="ddp", gpus=1, framework="hf", precision="bf16-mixed")

    int8 = plan(hf(FineTuneSpec(lora_rank=16, quantize="int8"))).memory
    nf4 = plan(hf(FineTuneSpec(lora_rank=16, quantize="nf4"))).memory
    rows = 4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096
    linears = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336
    codes_nf4 = 32 * sum(-(-n // 2) for n in (4096 * 4096, 4096 * 1024, 4096 * 1024, 4096 * 4096, 4096 * 14336, 4096 * 14336, 14336 * 4096))
    # Everything else (embedding, head, norms, adapters) is the same in both; the nf4 constants
    # are bitsandbytes' QuantState per weight (zeroplan.core.finetune.storage).
    nf4_scales = 32 * sum(n // 64 + 4 * (n // 64 // 256) + 1092 for n in
                          (4096 * 4096, 4096 * 1024, 4096 * 1024, 4096 * 4096, 4096 * 14336, 4096 * 14336, 14336 * 4096))
    assert int8.parameter_bytes - nf4.parameter_bytes == 32 * (linears + 4 * rows) - codes_nf4 - nf4_scales


def test_an_int8_base_keeps_the_input_of_every_linear_in_fp32() -> None:
    # bitsandbytes MatMul8bitLt keeps its input for the input's gradient, frozen weight or not:
    # per block the q/k/v input and the gate/up input (s x h) and the down input (s x f), fp32
    # under prepare_model_for_kbit_training; the attention output o reads is kept anyway.
    def activations(quantize: str) -> int:
        return plan(request(FineTuneSpec(lora_rank=16, quantize=quantize), kind="ddp", gpus=1, framework="hf",
                            precision="bf16-mixed")).memory.activation_bytes

    assert activations("int8") - activations("nf4") == 32 * 4 * 4096 * (2 * 4096 + 14336)


def test_an_int8_base_is_planned_under_ddp_only_and_refused_elsewhere_in_one_line(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "--detail", "llama-3.1-8b", "--framework", "hf", "--lora-rank", "16", "--quantize", "int8",
                                  "--gpus", "2", "--gpu", "a10g", "--activation-checkpointing", "full", "--seq-len", "1024")
    assert code == 0, err
    assert "base linears frozen in int8 (LLM.int8" in out
    rows = [line.split()[0] for line in out.splitlines() if line.split()[:1] and line.split()[0] in ("ddp", "zero1", "zero3", "fsdp-full-shard")]
    assert rows == ["ddp"]
    code, _, err = zeroplan_cli("fit", "--detail", "llama-3.1-8b", "--framework", "hf", "--lora-rank", "16", "--quantize", "int8",
                                "--strategies", "zero3")
    assert code == 2 and err.count("\n") == 1 and "'zero3' cannot hold an int8 base" in err and "allowed: ddp" in err
    code, _, err = zeroplan_cli("fit", "--detail", "llama-3.1-8b", "--framework", "hf", "--lora-rank", "16", "--quantize", "int8", "--dora")
    assert code == 2 and err.count("\n") == 1 and "--dora" in err


def test_lora_activations_drop_the_inputs_of_unwrapped_linears() -> None:
    full = plan(request(kind="ddp", gpus=1)).memory.activation_bytes
    all_seven = plan(request(FineTuneSpec(lora_rank=8, lora_targets=tuple(LoraTarget)[:7]), kind="ddp", gpus=1)).memory.activation_bytes
    only_q = plan(request(FineTuneSpec(lora_rank=8, lora_targets=(LoraTarget.q,)), kind="ddp", gpus=1)).memory.activation_bytes
    assert only_q < all_seven < full  # frozen norms keep less even with every linear wrapped


def test_peft_adapters_copy_their_input_under_ddp_but_not_under_fsdp() -> None:
    targets = (LoraTarget.q, LoraTarget.k, LoraTarget.v)
    ddp = plan(request(FineTuneSpec(lora_rank=8, lora_targets=targets), kind="ddp", framework="hf", precision="bf16-mixed"))
    one = plan(request(FineTuneSpec(lora_rank=8, lora_targets=targets[:1]), kind="ddp", framework="hf", precision="bf16-mixed"))
    # Two more bf16 copies of the normed input (s x h) per block.
    assert ddp.memory.activation_bytes - one.memory.activation_bytes == 32 * (2 * 2 * 4096 * 4096 + 2 * 2 * 4096 * 8)


def test_a_quantized_bases_adapters_copy_only_the_fp32_inputs_autocast_casts() -> None:
    """peft's bnb Linear4bit casts nothing under the Trainer's autocast: q's adapter keeps
    autocast's bf16 copy of the fp32 normed input, o's the attention's bf16 output itself."""
    from zeroplan.core.finetune.activations import lora_layer_delta_bytes

    def block(*targets: LoraTarget) -> int:
        finetune = FineTuneSpec(lora_rank=8, quantize="nf4", lora_targets=targets)
        return lora_layer_delta_bytes(request(finetune, kind="ddp", gpus=1, framework="hf", precision="bf16-mixed"))

    q = block(LoraTarget.q)
    rank_output = 2 * 4096 * 8  # A's bf16 r-wide output, which B keeps
    assert block(LoraTarget.q, LoraTarget.o) - q == rank_output
    assert block(LoraTarget.q, LoraTarget.k) - q == 2 * 4096 * 4096 + rank_output


def test_frozen_weights_skip_their_gradient_matmuls() -> None:
    full = plan(request(kind="ddp", gpus=1)).time
    lora = plan(request(FineTuneSpec(lora_rank=8), kind="ddp", gpus=1)).time
    assert lora.compute_s < full.compute_s


@pytest.mark.parametrize("fields, field", [
    ({"quantize": "nf4"}, "finetune.quantize"),
    ({"lora_rank": 8, "frozen_blocks": 2}, "finetune.frozen_blocks"),
    ({"lora_rank": 8, "lora_targets": ()}, "finetune.lora_targets"),
    ({"lora_rank": 8, "dora": True, "lora_dropout": 0.1}, "finetune.dora"),
    ({"lora_rank": 8, "quantize": "int8"}, "finetune.quantize"),  # torchtune: NF4 bases only
    ({"lora_rank": 8, "quantize": "fp8"}, "finetune.quantize"),
    ({"lora_rank": 8, "quantize": "int8", "quant_block_size": 128}, "finetune.quant_block_size"),
    ({"lora_rank": 8, "quantize": "none", "double_quant": False}, "finetune.double_quant"),
    ({"frozen_blocks": 33}, "finetune.frozen_blocks"),
    ({"lora_rank": 8, "bitsandbytes_version": "0.42.0"}, "finetune.bitsandbytes_version"),  # no nf4 base
    ({"lora_rank": 8, "quantize": "nf4", "bitsandbytes_version": "0.42.0"}, "finetune.bitsandbytes_version"),  # torchtune: torchao
    ({"lora_rank": 8, "quantize": "nf4", "bitsandbytes_version": "0.38.1"}, "finetune.bitsandbytes_version"),
    ({"lora_rank": 8, "quantize": "nf4", "bitsandbytes_version": "latest"}, "finetune.bitsandbytes_version"),
])
def test_unmodelled_fine_tunes_are_refused_naming_the_field(fields, field) -> None:
    with pytest.raises((ZeroplanError, ValueError)) as error:
        request(FineTuneSpec(**fields))
    assert field in str(error.value)


def test_the_issues_fine_tuning_commands_answer(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "llama-3.1-70b", "--framework", "hf", "--lora-rank", "16", "--quantize", "nf4",
                         "--gpus", "2", "--gpu", "rtx-4090", "--strategies", "fsdp-full-shard", "--activation-checkpointing", "full")
    assert code == 0, err
    assert "LoRA rank 16 on q,v: 32,768,000 trainable" in out and "nf4" in out and "the rest frozen in fp32" in out
    code, out, err = zeroplan_cli("fit", "llama-3.1-8b", "--framework", "torchtune", "--lora-rank", "8", "--gpus", "1", "--gpu", "a10g")
    assert code == 0, err
    assert "LoRA rank 8 on q,v,o,gate,up,down" in out


def test_a_config_json_with_nf4_weights_is_planned_as_qlora(zeroplan_cli, tmp_path) -> None:
    config = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                      "bnb_4bit_use_double_quant": True}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, _, err = zeroplan_cli("fit", str(path), "--gpus", "1")
    assert code == 2 and err.count("\n") == 1 and "--lora-rank" in err
    code, out, err = zeroplan_cli("fit", str(path), "--gpus", "1", "--lora-rank", "16", "--format", "json")
    assert code == 0, err
    report = json.loads(out)
    assert report["training"]["finetune"]["quantize"] == "nf4"
    assert "quantization_config" not in json.dumps(report["model"])  # read, not cautioned
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0}
    path.write_text(json.dumps(config))
    code, out, err = zeroplan_cli("fit", str(path), "--gpus", "1", "--lora-rank", "16", "--framework", "hf", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["training"]["finetune"]["quantize"] == "int8"
    config["quantization_config"]["llm_int8_has_fp16_weight"] = True
    path.write_text(json.dumps(config))
    code, _, err = zeroplan_cli("fit", str(path), "--gpus", "1", "--lora-rank", "16", "--framework", "hf")
    assert code == 2 and "llm_int8_has_fp16_weight" in err and err.count("\n") == 1
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    path.write_text(json.dumps(config))
    code, _, err = zeroplan_cli("fit", str(path), "--gpus", "1", "--lora-rank", "16")
    assert code == 2 and "quant_method 'awq'" in err and err.count("\n") == 1
    # A GPTQ checkpoint is read (tests/test_gptq.py), and planned where modelled: hf under ZeRO-1/2.
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    path.write_text(json.dumps(config))
    code, out, err = zeroplan_cli("fit", str(path), "--gpus", "1", "--lora-rank", "16", "--framework", "hf",
                                  "--precision", "fp16-mixed", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["training"]["finetune"]["quantize"] == "gptq-int4"
    code, _, err = zeroplan_cli("fit", str(path), "--gpus", "1", "--lora-rank", "16")
    assert code == 2 and "gptq-int4" in err and "allowed: --framework hf" in err and err.count("\n") == 1


def test_torchtune_on_one_gpu_is_its_single_device_recipe(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "llama-3.1-8b", "--framework", "torchtune", "--lora-rank", "8", "--gpus", "1",
                         "--gpu", "a10g", "--activation-checkpointing", "full", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["plans"][0]["strategy"] == "ddp"
    code, _, err = zeroplan_cli("fit", "llama-3.1-8b", "--framework", "torchtune", "--gpus", "2", "--strategies", "ddp")
    assert code == 2 and "'ddp' is not run by torchtune" in err


def test_frozen_blocks_below_a_frozen_embedding_keep_nothing() -> None:
    from zeroplan.core.frameworks import block_input_bytes, framework_activation_bytes, framework_layer_bytes

    full = request(kind="fsdp-full-shard")
    frozen = request(FineTuneSpec(frozen_blocks=12, freeze_embeddings=True))
    layer = framework_layer_bytes(full)
    assert framework_activation_bytes(full) - framework_activation_bytes(frozen) == 12 * layer
    full_ac = request(activation_checkpointing="full")
    frozen_ac = request(FineTuneSpec(frozen_blocks=12, freeze_embeddings=True), activation_checkpointing="full")
    assert framework_activation_bytes(full_ac) - framework_activation_bytes(frozen_ac) == 12 * block_input_bytes(full_ac, 4096, 1)
    # With the embedding training, the frozen blocks still pass the gradient down: they keep
    # less than a trained block (no linear inputs, frozen norms) but not nothing.
    passing = request(FineTuneSpec(frozen_blocks=12))
    assert framework_activation_bytes(frozen) < framework_activation_bytes(passing) < framework_activation_bytes(full)


def test_frozen_blocks_are_refused_under_policies_not_modelled() -> None:
    with pytest.raises(ZeroplanError) as error:
        plan(request(FineTuneSpec(frozen_blocks=2), activation_checkpointing="selective-layer"))
    assert error.value.field == "finetune.frozen_blocks"


def test_dora_answers_from_the_command_line(zeroplan_cli) -> None:
    # --dora was refused before DoRA was measured (benchmarks/framework-finetune-records: its
    # blocks; framework-finetune-step-records: its whole steps).
    code, out, err = zeroplan_cli("fit", "llama-3.1-8b", "--framework", "torchtune", "--lora-rank", "8", "--dora",
                                  "--gpus", "8", "--strategies", "fsdp-full-shard")
    assert code == 0, err
    # r 8 on q,v,o,gate,up,down: 614,400 adapter and 41,984 magnitude elements a block, 32 blocks.
    assert "DoRA (magnitudes included) rank 8 on q,v,o,gate,up,down: 21,004,288 trainable" in out


def test_dora_keeps_both_products_operands_and_its_weight_norm_temporaries() -> None:
    from zeroplan.core.finetune.activations import dora_kept_bytes, dora_weight_norm_bytes

    plain, dora = request(FineTuneSpec(lora_rank=8)), request(FineTuneSpec(lora_rank=8, dora=True))
    tokens, outs = 4096, 4096 + 1024 + 4096 + 14336 + 14336 + 4096
    assert dora_kept_bytes(plain) == dora_weight_norm_bytes(plain) == 0
    assert dora_kept_bytes(dora) == 2 * 2 * tokens * outs + 3 * 2 * outs
    # The down projection (in 14336): identity, A's and B's outputs, s * BA and W + s * BA in bf16.
    assert dora_weight_norm_bytes(dora) == 2 * (14336 * 14336 + 14336 * 8 + 3 * 14336 * 4096)


def test_qdora_is_measured_for_torchtune_and_peft_over_bitsandbytes_nf4() -> None:
    # torchtune's QDoRA (configs/llama3/8B_qdora_single_device.yaml) dequantizes the NF4 weight
    # for the norm: benchmarks/framework-finetune-records' qlora-nf4 ... -dora blocks.
    from zeroplan.core.finetune.activations import TORCHAO_NF4_DEQUANTIZE_COPIES, dora_weight_norm_bytes

    qdora = request(FineTuneSpec(lora_rank=8, dora=True, quantize="nf4"))
    down = 14336 * 4096 * 2
    identity = 2 * (14336 * 14336 + 14336 * 8) + down
    assert dora_weight_norm_bytes(qdora) == identity + TORCHAO_NF4_DEQUANTIZE_COPIES * down
    # PEFT's DoRA over bitsandbytes nf4 (the hf QDoRA block record): Linear4bit returns its
    # output in its input's dtype, so the base outputs DoRA keeps are fp32 but o's.
    from zeroplan.core.finetune.activations import dora_kept_bytes

    def hf(finetune: FineTuneSpec) -> PlanRequest:
        return request(finetune, framework="hf", kind="ddp", precision="bf16-mixed")

    targets = (LoraTarget.q, LoraTarget.o)
    over_nf4 = dora_kept_bytes(hf(FineTuneSpec(lora_rank=16, dora=True, quantize="nf4", lora_targets=targets)))
    over_bf16 = dora_kept_bytes(hf(FineTuneSpec(lora_rank=16, dora=True, lora_targets=targets)))
    assert over_nf4 - over_bf16 == (4 - 2) * 4096 * 4096  # q's base output, fp32 over nf4
    with pytest.raises(ZeroplanError, match="finetune.dora"):
        request(FineTuneSpec(lora_rank=16, dora=True, quantize="int8"), framework="hf", kind="ddp", precision="bf16-mixed")


# The adapters' dtype under a 4-bit base, by stack. peft 0.17.1 mapping_func.py get_peft_model
# (autocast_adapter_dtype=True) -> tuners/tuners_utils.py _cast_adapter_dtype upcasts bf16/fp16
# adapter weights to fp32 after they took the base weight's dtype
# (_move_adapter_to_device_of_base_layer), so the Trainer's AdamW (torch optim/adamw.py: states
# zeros_like the parameter) keeps fp32 moments and the gradients are fp32: 4 + 4 + 8 bytes per
# adapter element (the hf records measure it). torchtune 0.6.1's recipes build the model,
# adapters included, under training.set_default_dtype(bf16): 2 + 2 + 4.
def test_qlora_adapter_states_follow_each_stacks_adapter_dtype() -> None:
    finetune = FineTuneSpec(lora_rank=16, quantize="nf4")
    adapters = lora_elements(16, finetune.targets(Framework.hf))
    hf = plan(request(finetune, kind="ddp", gpus=1, framework="hf", precision="bf16-mixed")).memory
    assert hf.gradient_bytes == 4 * adapters
    assert 8 * adapters <= hf.optimizer_state_bytes < 8 * adapters + 8 * 1024
    finetune = FineTuneSpec(lora_rank=16, quantize="nf4")
    adapters = lora_elements(16, finetune.targets(Framework.torchtune))
    tune = plan(request(finetune, kind="ddp", gpus=1, framework="torchtune", precision="bf16-pure")).memory
    assert tune.gradient_bytes == 2 * adapters
    assert 4 * adapters <= tune.optimizer_state_bytes < 4 * adapters + 8 * 1024


# The QLoRA paper's headline (Dettmers et al. 2023, sec. 1: a 65B model fine-tuned on one 48 GB
# GPU) with its repository's 65B script (scripts/finetune_guanaco_65b.sh: nf4, double quant,
# LoRA r 64 on every linear, gradient checkpointing, per-device batch 4 of at most 16 + 512
# tokens; qlora.py's optim default paged_adamw_32bit). Even with the adapters planned in fp32
# (qlora.py casts its LoRA layers to bf16, which would save 2 x 1.5 GiB more), it fits.
def test_the_qlora_papers_65b_fits_one_48gb_gpu_with_paged_adamw(zeroplan_cli, tmp_path) -> None:
    config = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 22016, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 32000, "max_position_embeddings": 2048}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = ("fit", str(path), "--gpus", "1", "--gpu-memory-gib", "48", "--framework", "hf", "--lora-rank", "64",
            "--lora-alpha", "16", "--lora-targets", "q,k,v,o,gate,up,down", "--lora-dropout", "0.05", "--quantize", "nf4",
            "--activation-checkpointing", "full", "--micro-batch", "4", "--seq-len", "528", "--strategies", "ddp",
            "--format", "json")
    code, out, err = zeroplan_cli(*argv, "--paged-optimizer")
    assert code == 0, err
    (paged,) = json.loads(out)["plans"]
    assert paged["fits"] is True
