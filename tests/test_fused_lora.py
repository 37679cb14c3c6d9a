"""LoRA over fused projections (zeroplan.specs.finetune.fused_modules): a model whose Hugging Face
implementation computes q, k and v (or gate and up) with one linear gets one peft adapter there.
Measured on peft's own code: each family's tiny transformers model under LoraConfig(target_modules=
[the fused module]), its trainable bytes and what its adapters save for backward, against the
planner's parameter units and activation terms for the spec read from the same config."""

from __future__ import annotations

import pytest

from zeroplan.core.finetune.activations import (
    INPUT_GROUPS, _group_input_bytes, adapter_matmul_bytes, group_adapters,
)
from zeroplan.core.finetune.units import finetune_units, trainable_parameters
from zeroplan.core.params import parameter_units
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.hf_config import parse_hf_config
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, FineTuneSpec, Framework, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.finetune import FUSED_GATE_UP, FUSED_QKV, LoraTarget, check_finetune, lora_adapters
from zeroplan.specs.training import Kernels

Q, K, V, O = LoraTarget.q, LoraTarget.k, LoraTarget.v, LoraTarget.o
GATE, UP, DOWN = LoraTarget.gate, LoraTarget.up, LoraTarget.down
RANK = 4
SEQ, BATCH = 16, 2

# Each family's tiny config and the module names peft 0.17.1 matches (its
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, and Phi-3's two fused modules).
FAMILIES = {
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64), ["c_attn"]),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                                       vocab_size=128, max_position_embeddings=64), ["query_key_value"]),
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=128), ["query_key_value"]),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128),
               ["query_key_value"]),
    "mpt": ("MptConfig", dict(d_model=64, n_heads=4, n_layers=2, vocab_size=128), ["Wqkv"]),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64), ["c_attn"]),
    "phi3": ("Phi3Config", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=128, vocab_size=128, max_position_embeddings=64, pad_token_id=0),
             ["qkv_proj", "gate_up_proj"]),
}


def _config(family: str):
    transformers = pytest.importorskip("transformers")
    name, fields, _ = FAMILIES[family]
    return getattr(transformers, name)(**fields)


def _targets(family: str) -> tuple[LoraTarget, ...]:
    return FUSED_QKV + (FUSED_GATE_UP if family == "phi3" else ())


def _request(spec, finetune: FineTuneSpec) -> PlanRequest:
    # fp32 on the CPU's kernels: what the measurement below runs (no autocast, fp32 adapters).
    return PlanRequest(model=spec, cluster=cluster_from_gpus(get_gpu("h100-80gb"), 1), strategy=StrategySpec(kind="ddp"),
                       batch=BatchSpec(seq_len=SEQ, micro_batch_size=BATCH),
                       training=TrainingSpec(framework="hf", precision="fp32", kernels=Kernels.cpu, finetune=finetune))


def _peft_model(family: str, dropout: float):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    return peft.get_peft_model(model, peft.LoraConfig(r=RANK, target_modules=FAMILIES[family][2], lora_dropout=dropout))


def _adapter_saved_bytes(peft_model, block: int) -> int:
    """Bytes of the distinct tensors (parameters left out) that the adapters of one block
    (lora_dropout, lora_A, lora_B) save for backward in a training forward."""
    import torch

    inside: list[bool] = [False]
    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in peft_model.parameters()}
    hooks = []
    for name, module in peft_model.named_modules():
        parts = name.split(".")
        if f"{block}" in parts and any(p in ("lora_A", "lora_B", "lora_dropout") for p in parts) and not list(module.children()):
            hooks.append(module.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
            hooks.append(module.register_forward_hook(lambda *_: inside.__setitem__(0, False)))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    peft_model.train()
    ids = torch.randint(0, 128, (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        peft_model(input_ids=ids).logits.sum()
    for hook in hooks:
        hook.remove()
    return sum(saved.values())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_reader_marks_the_fused_modules(family: str) -> None:
    spec = parse_hf_config(_config(family).to_dict(), family)
    assert spec.fused_qkv
    assert spec.fused_gate_up == (family == "phi3")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trainable_bytes_equal_peft_on_the_fused_module(family: str) -> None:
    spec = parse_hf_config(_config(family).to_dict(), family)
    finetune = FineTuneSpec(lora_rank=RANK, lora_targets=_targets(family))
    check_finetune(finetune, spec, Framework.hf, 1)
    planned = trainable_parameters(parameter_units(spec), finetune, Framework.hf, spec) * 4  # fp32 adapters
    measured = sum(p.numel() * p.element_size() for p in _peft_model(family, 0.0).parameters() if p.requires_grad)
    assert planned == measured
    # Three adapters would hold r (h + q) + 2 r (h + kv) a block where the fused one holds r (h + q + 2 kv).
    separate = trainable_parameters(parameter_units(spec), finetune, Framework.torchtune, spec) * 4
    assert separate - planned == 4 * spec.num_layers * RANK * spec.hidden_size * (2 + (1 if family == "phi3" else 0))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapter_saved_activations_equal_peft(family: str, dropout: float) -> None:
    spec = parse_hf_config(_config(family).to_dict(), family)
    request = _request(spec, FineTuneSpec(lora_rank=RANK, lora_targets=_targets(family), lora_dropout=dropout))
    tokens = SEQ * BATCH
    planned = 0
    for group, kind, kept_anyway in INPUT_GROUPS:
        if group_adapters(request, group):
            planned += _group_input_bytes(request, group, kind, kept_anyway)
            planned += group_adapters(request, group) * adapter_matmul_bytes(request) * tokens * RANK
    # The last block: its input needs a gradient, as every block's does once the first has an adapter.
    assert planned == _adapter_saved_bytes(_peft_model(family, dropout), block=1)
    assert group_adapters(request, FUSED_QKV) == 1


@pytest.mark.parametrize("name, layers, hidden", [("qwen-1.8b", 24, 2048), ("qwen-7b", 32, 4096), ("qwen-14b", 40, 5120)])
def test_qwen1_plans_one_adapter_over_c_attn(name: str, layers: int, hidden: int) -> None:
    model = get_model(name)
    assert model.fused_qkv and not model.fused_gate_up
    units = parameter_units(model)
    qkv = FineTuneSpec(lora_rank=64, lora_targets=(Q, K, V))
    assert lora_adapters(qkv, model, Framework.hf) == (FUSED_QKV,)
    # c_attn: A 64 x h, B 3h x 64 (4rh a block) where three adapters would hold 6rh.
    assert trainable_parameters(units, qkv, Framework.hf, model) == layers * 4 * 64 * hidden
    every = FineTuneSpec(lora_rank=64, lora_targets=(Q, K, V, O, GATE, UP, DOWN))
    assert lora_adapters(every, model, Framework.hf) == (FUSED_QKV, (O,), (GATE,), (UP,), (DOWN,))
    assert (trainable_parameters(units, every, Framework.torchtune, model)
            - trainable_parameters(units, every, Framework.hf, model)) == layers * 2 * 64 * hidden
    names = [t.name for unit in finetune_units(units, qkv, Framework.hf, model) for t in unit.tensors if t.trainable]
    assert names[:2] == ["attention.qkv.lora_a.weight", "attention.qkv.lora_b.weight"]


def test_peft_default_targets_wrap_the_fused_module() -> None:
    # peft's default for bloom, gpt2, gpt_neox, falcon, mpt and gpt_bigcode is the fused module;
    # zeroplan's hf default names q and v, which on a fused model is that module.
    falcon = get_model("falcon-7b")
    assert lora_adapters(FineTuneSpec(lora_rank=8), falcon, Framework.hf) == (FUSED_QKV,)
    assert lora_adapters(FineTuneSpec(lora_rank=8), get_model("llama-3.1-8b"), Framework.hf) == ((Q,), (V,))


def test_other_frameworks_keep_q_k_v_apart() -> None:
    # torchtune's builders, litgpt's LoRAQKVLinear and zeroplan's model adapt q, k and v apart.
    falcon = get_model("falcon-7b")
    qv = FineTuneSpec(lora_rank=8, lora_targets=(Q, V))
    assert lora_adapters(qv, falcon, Framework.litgpt) == ((Q,), (V,))
    check_finetune(qv, falcon, Framework.litgpt, 1)


@pytest.mark.parametrize("targets, named", [((Q,), "'q'"), ((Q, V), "'q,v'"), ((K, O), "'k'")])
def test_part_of_a_fused_qkv_is_refused(targets: tuple[LoraTarget, ...], named: str) -> None:
    with pytest.raises(ZeroplanError) as error:
        check_finetune(FineTuneSpec(lora_rank=8, lora_targets=targets), get_model("qwen-7b"), Framework.hf, 1)
    assert error.value.field == "finetune.lora_targets"
    assert named in str(error.value) and "allowed: q,k,v together" in str(error.value)
    assert "\n" not in str(error.value)


def test_part_of_a_fused_gate_up_is_refused() -> None:
    phi3 = parse_hf_config(_config("phi3").to_dict(), "phi3")
    with pytest.raises(ZeroplanError, match="allowed: gate,up together"):
        check_finetune(FineTuneSpec(lora_rank=4, lora_targets=(Q, K, V, GATE)), phi3, Framework.hf, 1)
    whole = FineTuneSpec(lora_rank=4, lora_targets=(Q, K, V, O, GATE, UP, DOWN))
    check_finetune(whole, phi3, Framework.hf, 1)
    assert lora_adapters(whole, phi3, Framework.hf) == (FUSED_QKV, (O,), FUSED_GATE_UP, (DOWN,))


def test_fused_gate_up_needs_a_gated_mlp() -> None:
    from zeroplan.specs.model import MlpKind, ModelSpec

    with pytest.raises(ZeroplanError) as error:
        ModelSpec(name="m", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=256,
                  mlp=MlpKind.gelu, fused_gate_up=True)
    assert error.value.field == "model.fused_gate_up"
