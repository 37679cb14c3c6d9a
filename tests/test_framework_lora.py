"""The frameworks' own LoRA/QLoRA builders (zeroplan.frameworks.lora) on a tiny Llama: what trains,
what is quantized, the record names and the one-line refusals. The full-width records are
written by benchmarks/framework_records.py --finetune, framework_step_records.py --finetune and
framework_parameter_records.py."""

from __future__ import annotations

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.presets.models import get_model
from zeroplan.specs import ActivationCheckpointing, StrategyKind, TrainingSpec
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.framework import Framework

pytest.importorskip("torch")

TINY = get_model("llama-3.1-8b").model_copy(update={"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_size": 16,
                                                    "ffn_hidden_size": 128, "vocab_size": 256})
NF4_TINY = TINY.model_copy(update={"hidden_size": 256, "head_size": 64, "ffn_hidden_size": 512})
"""torchao's NF4Tensor needs each weight to hold whole scaler blocks (64 x 256 elements)."""
LAYERS = 3


def _build(framework: Framework, policy: str = "none", **finetune):
    import torch

    from zeroplan.frameworks.build import build

    dtype = torch.float32 if framework is Framework.hf else torch.bfloat16
    model = NF4_TINY if finetune.get("quantize") == "nf4" else TINY
    return build(framework, model, LAYERS, ActivationCheckpointing(policy), dtype, finetune=FineTuneSpec(**finetune))


def _trainable(built) -> list[str]:
    return [name for name, p in built.module.named_parameters() if p.requires_grad]


def test_torchtune_lora_trains_only_its_default_adapters() -> None:
    pytest.importorskip("torchtune")
    built = _build(Framework.torchtune, lora_rank=4)
    names = _trainable(built)
    # 8B_lora.yaml's targets: q_proj, v_proj, output_proj and w1, w2, w3; lora_a and lora_b each.
    assert len(names) == LAYERS * 6 * 2
    assert {n.split(".")[-2] for n in names} == {"lora_a", "lora_b"}
    assert {n.split(".")[-3] for n in names} == {"q_proj", "v_proj", "output_proj", "w1", "w2", "w3"}
    assert built.module.layers[0].attn.q_proj.lora_a.weight.shape == (4, TINY.hidden_size)


def test_torchtune_qlora_quantizes_every_block_linear_and_trains_the_same_adapters() -> None:
    pytest.importorskip("torchtune")
    from torchao.dtypes.nf4tensor import NF4Tensor

    built = _build(Framework.torchtune, lora_rank=4, quantize="nf4", lora_targets=["q", "k"])
    nf4 = [name for name, p in built.module.named_parameters() if isinstance(p, NF4Tensor)]
    # Seven linears a block (k_proj unwrapped too: FrozenNF4Linear); the LM head stays bf16.
    assert len(nf4) == LAYERS * 7 and not any(name.startswith("output") for name in nf4)
    assert len(_trainable(built)) == LAYERS * 2 * 2


def test_hf_peft_lora_trains_only_the_named_targets_in_fp32() -> None:
    pytest.importorskip("peft")
    built = _build(Framework.hf, lora_rank=4, lora_targets=["q", "k", "v", "o", "gate", "up", "down"])
    names = _trainable(built)
    assert len(names) == LAYERS * 7 * 2
    assert all(".lora_A." in n or ".lora_B." in n for n in names)
    default = _build(Framework.hf, lora_rank=4)
    assert {n.split(".")[-4] for n in _trainable(default)} == {"q_proj", "v_proj"}


@pytest.mark.slow
def test_a_tiny_lora_forward_keeps_less_than_the_full_fine_tune() -> None:
    pytest.importorskip("torchtune")
    from zeroplan.frameworks.measure import measure
    from zeroplan.specs import BatchSpec

    batch = BatchSpec(seq_len=32, micro_batch_size=1)
    full_training = TrainingSpec(framework="torchtune", precision="bf16-pure")
    full = {model.hidden_size: measure(model, StrategyKind.fsdp_full_shard, training, batch)
            for model, training in ((TINY, full_training), (NF4_TINY, full_training))}
    for model, finetune in ((TINY, {"lora_rank": 4}), (NF4_TINY, {"lora_rank": 4, "quantize": "nf4"})):
        training = TrainingSpec(framework="torchtune", precision="bf16-pure", finetune=finetune)
        lora = measure(model, StrategyKind.fsdp_full_shard, training, batch)
        assert 0 < lora.block_kept_bytes < full[model.hidden_size].block_kept_bytes
        assert lora.name != full[model.hidden_size].name


def test_hf_qlora_is_built_as_from_pretrained_quantizes_it_with_bitsandbytes() -> None:
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    import torch

    built = _build(Framework.hf, lora_rank=4, quantize="nf4", lora_targets=["q", "k", "v", "o", "gate", "up", "down"])
    assert built.real
    params = dict(built.module.named_parameters())
    quantized = [name for name, p in params.items() if type(p).__name__ == "Params4bit"]
    # Every block linear (lm_head left out by get_modules_to_not_convert), packed in bf16 quant storage.
    assert len(quantized) == LAYERS * 7 and all(params[n].dtype == torch.bfloat16 for n in quantized)
    assert all(not p.is_meta for p in params.values())
    # prepare_model_for_kbit_training: everything not 4-bit is fp32 and frozen; adapters fp32.
    others = [p for n, p in params.items() if n not in quantized]
    assert all(p.dtype == torch.float32 for p in others)
    assert {n for n, p in params.items() if p.requires_grad} == {n for n in params if ".lora_A." in n or ".lora_B." in n}
    q = built.module.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert q.quant_state.blocksize == 64 and q.quant_state.nested and q.quant_state.state2.blocksize == 256


def test_hf_qlora_parameter_record_counts_every_quant_state_tensor() -> None:
    pytest.importorskip("bitsandbytes")
    from zeroplan.frameworks.parameters import measure_parameters

    training = TrainingSpec(framework="hf", precision="bf16-mixed", finetune={"lora_rank": 4, "quantize": "nf4"})
    record = measure_parameters(NF4_TINY, StrategyKind.ddp, training)
    elements = 2 * NF4_TINY.hidden_size * (NF4_TINY.hidden_size + NF4_TINY.kv_heads * NF4_TINY.head_size) \
        + 3 * NF4_TINY.hidden_size * NF4_TINY.ffn_hidden_size
    storage = record.quantized_storage
    assert storage["data"] == elements // 2  # four bits a weight, whatever the storage dtype
    assert storage["absmax"] == elements // 64  # one uint8 scale per block of 64 (double quantization)
    assert storage["state2.absmax"] == 4 * elements // 64 // 256  # one fp32 scale per 256 absmax (whole blocks here)
    assert storage["code"] == 7 * 16 * 4 and storage["state2.code"] == 7 * 256 * 4 and storage["offset"] == 7 * 4
    assert record.blocks[0].frozen["nf4"] == sum(storage.values())
    # PEFT's default q, v: fp32 adapters, r x in and out x r each.
    h, kv = NF4_TINY.hidden_size, NF4_TINY.kv_heads * NF4_TINY.head_size
    assert record.blocks[0].trainable == {"float32": 4 * 4 * (h + h + h + kv)}
    assert record.name.endswith("+qlora-nf4-r4-qv:parameters")


def test_hf_int8_base_is_bitsandbytes_linear8bitlt_with_a_scale_per_row() -> None:
    pytest.importorskip("bitsandbytes")
    import torch

    from zeroplan.frameworks.parameters import measure_parameters

    built = _build(Framework.hf, lora_rank=4, quantize="int8")
    params = dict(built.module.named_parameters())
    quantized = {name: p for name, p in params.items() if type(p).__name__ == "Int8Params"}
    assert len(quantized) == LAYERS * 7 and all(p.dtype == torch.int8 for p in quantized.values())
    assert all(p.SCB.dtype == torch.float32 and p.SCB.shape == p.shape[:1] for p in quantized.values())
    training = TrainingSpec(framework="hf", precision="bf16-mixed", finetune={"lora_rank": 4, "quantize": "int8"})
    record = measure_parameters(TINY, StrategyKind.ddp, training)
    h, kv, f = TINY.hidden_size, TINY.kv_heads * TINY.head_size, TINY.ffn_hidden_size
    elements, rows = 2 * h * (h + kv) + 3 * h * f, (h + kv + kv + h + f + f + h)
    assert record.quantized_storage == {"data": elements, "SCB": 4 * rows}
    assert record.blocks[0].frozen["int8"] == elements + 4 * rows
    assert record.name.endswith("+qlora-int8-r4-qv:parameters")


def test_the_int8_records_run_the_autograd_function_a_gpu_runs() -> None:
    # bitsandbytes.matmul picks MatMul8bitFp for a CPU tensor and MatMul8bitLt for a CUDA one;
    # int8_matmul_as_on_cuda makes the CPU forward take the GPU's function, and only inside it.
    pytest.importorskip("bitsandbytes")
    import torch

    from zeroplan.frameworks.lora import int8_matmul_as_on_cuda

    built = _build(Framework.hf, lora_rank=4, quantize="int8")
    layer = built.module.base_model.model.model.layers[0].mlp.down_proj  # not wrapped: q, v are
    x = torch.randn(2, 8, TINY.ffn_hidden_size, requires_grad=True)
    with int8_matmul_as_on_cuda():
        on_gpu_path = layer(x)
    on_cpu_path = layer(x)
    assert type(on_gpu_path.grad_fn).__name__ == "MatMul8bitLtBackward"
    assert type(on_cpu_path.grad_fn).__name__ == "MatMul8bitFpBackward"
    # MatMul8bitLt keeps the input itself for the input's gradient (the weight is frozen).
    assert on_gpu_path.grad_fn.tensors[2].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


@pytest.mark.slow
def test_hf_qlora_base_linears_save_no_input_from_bitsandbytes_0_43_2() -> None:
    pytest.importorskip("bitsandbytes")
    from zeroplan.frameworks.measure import measure
    from zeroplan.specs import BatchSpec

    training = TrainingSpec(framework="hf", precision="bf16-mixed", finetune={"lora_rank": 4, "quantize": "nf4"})
    record = measure(NF4_TINY, StrategyKind.ddp, training, BatchSpec(seq_len=32, micro_batch_size=1))
    assert record.block_kept_bytes > 0 and record.block_forward_peak_bytes >= record.block_growth_bytes[-1]
    # bitsandbytes' MatMul4Bit keeps only the packed weight (ctx.tensors = (None, B)), never A:
    # nothing saved is the size of a bf16 weight.
    weight_bytes = 2 * NF4_TINY.hidden_size * NF4_TINY.hidden_size
    assert not any(entry.split()[2] == str(weight_bytes) for entry in record.block_saved_tensors)
    # MatMul4Bit as 0.43.1 ran it (lora.py matmul_4bit_keeps_input): each of q, k, v, gate, up
    # and down keeps its own bf16 copy of its fp32 input (Linear4bit's x.to(compute_dtype)); o's
    # bf16 input is the attention's own.
    legacy = TrainingSpec(framework="hf", precision="bf16-mixed",
                          finetune={"lora_rank": 4, "quantize": "nf4", "bitsandbytes_version": "0.43.1"})
    kept = measure(NF4_TINY, StrategyKind.ddp, legacy, BatchSpec(seq_len=32, micro_batch_size=1)).block_kept_bytes
    h, f = NF4_TINY.hidden_size, NF4_TINY.ffn_hidden_size
    assert kept - record.block_kept_bytes == 2 * 32 * (5 * h + f)


def test_record_names_carry_the_fine_tune_and_are_distinct() -> None:
    from zeroplan.frameworks.record import finetune_tag

    finetunes = [{}, {"lora_rank": 8}, {"lora_rank": 16}, {"lora_rank": 8, "quantize": "nf4"},
                 {"lora_rank": 8, "lora_targets": ["q", "v"]}, {"lora_rank": 8, "lora_dropout": 0.1},
                 {"lora_rank": 8, "dora": True}, {"lora_rank": 8, "lora_alpha": 8},
                 {"lora_rank": 8, "quantize": "nf4", "quant_block_size": 128}, {"frozen_blocks": 2}]
    tags = [finetune_tag(TrainingSpec(framework="torchtune", finetune=f)) for f in finetunes]
    assert tags[0] == "" and len(set(tags)) == len(tags)
    assert tags[1] == "+lora-r8-qvogud" and tags[3] == "+qlora-nf4-r8-qvogud"
    assert finetune_tag(TrainingSpec(framework="hf", finetune={"lora_rank": 16})) == "+lora-r16-qv"


@pytest.mark.parametrize("framework, policy, finetune, field", [
    ("torchtune", "none", {"lora_rank": 8, "lora_targets": ["q", "gate"]}, "finetune.lora_targets"),
    ("torchtune", "none", {"lora_rank": 8, "quantize": "nf4", "quant_block_size": 128}, "finetune.quant_block_size"),
    ("torchtune", "none", {"lora_rank": 8, "quantize": "int8"}, "finetune.quantize"),
    ("torchtune", "selective-layer", {"lora_rank": 8}, "--activation-checkpointing"),
    ("hf", "none", {"lora_rank": 8, "quantize": "nf4", "quant_block_size": 128}, "finetune.quant_block_size"),
    ("hf", "none", {"lora_rank": 8, "quantize": "nf4", "base_dtype": "fp32"}, "finetune.base_dtype"),
    ("hf", "none", {"lora_rank": 8, "quantize": "int8", "dora": True}, "finetune.dora"),
    ("hf", "none", {"lora_rank": 8, "quantize": "fp8"}, "finetune.quantize"),
    ("torchtitan", "none", {"lora_rank": 8}, "finetune.lora_rank"),
    ("torchtune", "none", {"frozen_blocks": 2}, "finetune.frozen_blocks"),
])
def test_a_fine_tune_the_framework_cannot_build_is_one_line_naming_the_field(framework, policy, finetune, field) -> None:
    from zeroplan.frameworks.lora import check_finetune

    with pytest.raises(ZeroplanError) as error:
        check_finetune(Framework(framework), FineTuneSpec(**finetune), ActivationCheckpointing(policy))
    assert error.value.field == field and "\n" not in str(error.value)


def test_only_torchtunes_lora_runs_a_single_device_step() -> None:
    from zeroplan.frameworks.step import check_step, step_training

    lora = step_training(Framework.torchtune).model_copy(update={"finetune": FineTuneSpec(lora_rank=8)})
    check_step(Framework.torchtune, StrategyKind.ddp, lora, 1, 0)
    with pytest.raises(ZeroplanError, match="--strategy"):
        check_step(Framework.torchtune, StrategyKind.ddp, step_training(Framework.torchtune), 1, 0)
