"""The parameter units of a fine-tune: the model's tensors marked frozen or trainable (and
quantized where the base is), with each LoRA adapter's tensors after the weight it wraps."""

from __future__ import annotations

from zeroplan.core.params import ParamTensor, ParamUnit
from zeroplan.specs.finetune import FineTuneSpec, LoraTarget, lora_adapters
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import ModelSpec

# The weight each target names in zeroplan.core.params' unit layout.
TARGET_WEIGHT = {
    LoraTarget.q: "attention.q.weight",
    LoraTarget.k: "attention.k.weight",
    LoraTarget.v: "attention.v.weight",
    LoraTarget.o: "attention.o.weight",
    LoraTarget.gate: "mlp.gate.weight",
    LoraTarget.up: "mlp.up.weight",
    LoraTarget.down: "mlp.down.weight",
    LoraTarget.output: "lm_head.weight",
}

GPT_MLP_TARGET_WEIGHT = {LoraTarget.up: "mlp.fc1.weight", LoraTarget.down: "mlp.fc2.weight"}
"""A two-linear (GPT) MLP's weights, which up and down name (litgpt's GptNeoxMLP fc and proj under
lora_mlp: zeroplan.specs.finetune.check_finetune); a gated MLP has none of them."""


# Hu et al. 2021 ("LoRA") sec. 4.1: W0 x + B A x with A (r x in) and B (out x r) trainable,
# W0 frozen. peft 0.17.1 tuners/lora/layer.py LoraLayer.update_layer: lora_A Linear(in, r),
# lora_B Linear(r, out), no biases; torchtune 0.6.1 modules/peft/lora.py LoRALinear: lora_a,
# lora_b the same. DoRA (Liu et al. 2024; peft tuners/lora/dora.py DoraLinearLayer,
# torchtune modules/peft/dora.py DoRALinear) adds a magnitude vector of `out` elements.
def adapter_tensors(weight: ParamTensor, rank: int, dora: bool, vera: bool = False,
                    lora_fa: bool = False) -> list[ParamTensor]:
    """The tensors of the adapter wrapping ``weight`` (out x in): trainable but lora_a under
    LoRA-FA; VeRA's two vectors in place of A and B (vera_tensors)."""
    out_features, in_features = weight.shape
    prefix = weight.name.removesuffix(".weight")
    if vera:
        return vera_tensors(prefix, rank, out_features)
    # peft 51c2ff6 optimizers/lorafa.py:241-243 create_lorafa_optimizer: every parameter named
    # lora_A is set requires_grad_(False): no gradient, no optimizer state (LoraFAOptimizer.step,
    # lines 115-123, keeps exp_avg_B and exp_avg_sq_B per pair only).
    tensors = [ParamTensor(name=f"{prefix}.lora_a.weight", shape=(rank, in_features), trainable=not lora_fa),
               ParamTensor(name=f"{prefix}.lora_b.weight", shape=(out_features, rank))]
    if dora:
        tensors.append(ParamTensor(name=f"{prefix}.lora_magnitude", shape=(out_features,)))
    return tensors


# peft 51c2ff6 tuners/vera/layer.py:88-90 VeraLayer.update_layer: each wrapped linear trains
# vera_lambda_b, out_features elements (registered first), and vera_lambda_d, r elements; A and B
# are the model's shared buffers (vera_buffers).
def vera_tensors(prefix: str, rank: int, out_features: int) -> list[ParamTensor]:
    """The trainable vectors of the VeRA adapter of the linear ``prefix`` (out_features wide)."""
    return [ParamTensor(name=f"{prefix}.vera_lambda_b", shape=(out_features,)),
            ParamTensor(name=f"{prefix}.vera_lambda_d", shape=(rank,))]


VERA_BUFFER_NAMES = ("vera_A", "vera_B")
"""VeRA's shared frozen projections, one of each per model (vera_buffers)."""


# peft 51c2ff6 tuners/vera/model.py:112-144 VeraModel._find_dim takes the largest (out, in) over
# every wrapped linear, element by element, and :146-159 _init_vera_A_vera_B makes vera_A (r x
# in) and vera_B (out x r) once, in the BufferDict every VeraLayer references (layer.py:92-94;
# update_layer stores the same tensor for each layer). Their dtype and place: measured in
# tests/test_peft_variants.py (fp32 on the base's device: zeroplan.core.finetune.storage).
def vera_buffers(shapes: list[tuple[int, int]], rank: int) -> list[ParamTensor]:
    """The frozen vera_A and vera_B for adapted linears of (out, in) ``shapes``."""
    out_features = max(shape[0] for shape in shapes)
    in_features = max(shape[1] for shape in shapes)
    return [ParamTensor(name="vera_A", shape=(rank, in_features), trainable=False),
            ParamTensor(name="vera_B", shape=(out_features, rank), trainable=False)]


# QLoRA (Dettmers et al. 2023, sec. 3): the frozen weights of the linear layers are stored in
# 4 bits. transformers 4.56.2 integrations/bitsandbytes.py replace_with_bnb_linear converts every
# nn.Linear except those get_keys_to_not_convert returns (the output embedding, lm_head);
# torchtune 0.6.1 models/llama3_1/_component_builders.py lora_llama3_1 with quantize_base builds
# FrozenNF4Linear for every block projection a LoRA does not wrap and LoRALinear(quantize_base)
# for those it does ("quantize_base is not applied to final output_proj currently").
# litgpt 0.4.13.dev1 (lightning 2.4 fabric/plugins/precision/bitsandbytes.py
# BitsandbytesPrecision.module_init_context) replaces torch.nn.Linear itself while its GPT is
# built, so its lm_head (litgpt/lora.py LoRALinear's `linear`) is 4-bit too.
def _is_quantized_weight(tensor: ParamTensor, unit: ParamUnit, framework: Framework) -> bool:
    if framework is Framework.litgpt and tensor.name == "lm_head.weight":
        return True
    return unit.name.startswith("block.") and tensor.name.endswith(".weight") and len(tensor.shape) == 2


def _frozen(tensor: ParamTensor, quantized: bool) -> ParamTensor:
    return tensor.model_copy(update={"trainable": False, "quantized": quantized})


FUSED_MODULE_PREFIX = {(LoraTarget.q, LoraTarget.k, LoraTarget.v): "attention.qkv",
                       (LoraTarget.gate, LoraTarget.up): "mlp.gate_up"}
"""The name an adapter over a fused module (zeroplan.specs.finetune.fused_modules) takes."""


# A fused module (peft wraps it whole: zeroplan.specs.finetune.fused_modules) computes its
# projections' outputs side by side from one input: its adapter is A (r x in) and B (sum of the
# outputs x r), placed after the module's last projection weight.
def _fused_weight(unit: ParamUnit, module: tuple[LoraTarget, ...]) -> ParamTensor:
    weights = [t for t in unit.tensors if t.name in {TARGET_WEIGHT[p] for p in module}]
    return ParamTensor(name=f"{FUSED_MODULE_PREFIX[module]}.weight",
                       shape=(sum(w.shape[0] for w in weights), weights[0].shape[1]))


def finetune_units(units: tuple[ParamUnit, ...], finetune: FineTuneSpec, framework: Framework,
                   model: ModelSpec) -> tuple[ParamUnit, ...]:
    """``units`` as the fine-tune trains them: frozen tensors marked, adapters added (one per
    module the framework's model wraps: zeroplan.specs.finetune.lora_adapters)."""
    if finetune.trains_everything:
        return units
    if not finetune.is_lora:
        return tuple(_freeze_full_finetune(unit, finetune) for unit in units)
    adapters = lora_adapters(finetune, model, framework)
    single = {TARGET_WEIGHT[m[0]] for m in adapters if len(m) == 1}
    single |= {GPT_MLP_TARGET_WEIGHT[m[0]] for m in adapters if len(m) == 1 and m[0] in GPT_MLP_TARGET_WEIGHT}
    fused_after = {TARGET_WEIGHT[m[-1]]: m for m in adapters if len(m) > 1}
    quantize = finetune.quantize.is_quantized
    wrapped = [(unit, tensor if tensor.name in single else _fused_weight(unit, fused_after[tensor.name]))
               for unit in units for tensor in unit.tensors if tensor.name in single or tensor.name in fused_after]
    # VeRA's shared pair is placed with the first wrapped linear's unit (its first VeraLayer).
    buffers = vera_buffers([w.shape for _, w in wrapped], finetune.lora_rank) if finetune.vera and wrapped else []
    result = []
    for unit in units:
        tensors: list[ParamTensor] = []
        for tensor in unit.tensors:
            tensors.append(_frozen(tensor, quantize and _is_quantized_weight(tensor, unit, framework)))
            if tensor.name in single or tensor.name in fused_after:
                weight = tensor if tensor.name in single else _fused_weight(unit, fused_after[tensor.name])
                tensors.extend(adapter_tensors(weight, finetune.lora_rank, finetune.dora, finetune.vera, finetune.lora_fa))
        if buffers and unit is wrapped[0][0]:
            tensors.extend(buffers)
        result.append(ParamUnit(name=unit.name, tensors=tuple(tensors)))
    return tuple(result)


def _freeze_full_finetune(unit: ParamUnit, finetune: FineTuneSpec) -> ParamUnit:
    """A full fine-tune's unit with the embedding (and an untied head) or its block frozen."""
    if unit.name == "embedding":
        frozen = finetune.freeze_embeddings
    elif unit.name.startswith("block."):
        frozen = int(unit.name.split(".")[1]) < finetune.frozen_blocks
    else:
        # The untied head is the output embedding; the final norm trains.
        frozen = False
        if finetune.freeze_embeddings:
            return ParamUnit(name=unit.name, tensors=tuple(
                _frozen(t, False) if t.name == "lm_head.weight" else t for t in unit.tensors))
    if not frozen:
        return unit
    return ParamUnit(name=unit.name, tensors=tuple(_frozen(t, False) for t in unit.tensors))


def trainable_view(units: tuple[ParamUnit, ...]) -> tuple[ParamUnit, ...]:
    """The units reduced to their trainable tensors (a unit with none is left out): what has
    gradients, optimizer states and master copies. The units themselves when all train."""
    cached = _TRAINABLE.get(id(units))
    if cached is not None and cached[0] is units:
        return cached[1]
    if all(t.trainable for unit in units for t in unit.tensors):
        view = units
    else:
        view = tuple(ParamUnit(name=unit.name, tensors=tuple(t for t in unit.tensors if t.trainable))
                     for unit in units if any(t.trainable for t in unit.tensors))
    if len(_TRAINABLE) > 1024:
        _TRAINABLE.clear()
    # The entry keeps ``units`` alive, so its identity cannot be reused while cached.
    _TRAINABLE[id(units)] = (units, view)
    return view


_TRAINABLE: dict[int, tuple[tuple[ParamUnit, ...], tuple[ParamUnit, ...]]] = {}


def trainable_parameters(units: tuple[ParamUnit, ...], finetune: FineTuneSpec, framework: Framework,
                         model: ModelSpec) -> int:
    """Elements the optimizer steps under ``finetune`` (adapters, or the unfrozen part)."""
    return sum(t.numel for unit in finetune_units(units, finetune, framework, model) for t in unit.tensors if t.trainable)


# A linear's forward is 2 x its weight's elements in FLOPs per token, and its backward two such
# matmuls, one for the input's gradient and one for the weight's (zeroplan.core.flops); a frozen
# weight has no gradient, so its backward runs only the first.
def frozen_matmul_weight_elements(units: tuple[ParamUnit, ...], tied_embeddings: bool) -> int:
    """Elements of the frozen weights that enter a matmul (the blocks' linears and the head; the
    embedding's lookup is no matmul unless it is tied to the head)."""
    total = 0
    for unit in units:
        for t in unit.tensors:
            # VeRA's shared buffers are sliced into every adapter's matmuls, never the model's
            # own (their FLOPs are not modelled: docs/finetuning.md, "VeRA and LoRA-FA").
            if t.trainable or len(t.shape) != 2 or t.name in VERA_BUFFER_NAMES:
                continue
            if unit.name == "embedding" and not (tied_embeddings and t.name == "token.weight"):
                continue
            total += t.numel
    return total


def adapter_weight_elements(units: tuple[ParamUnit, ...]) -> int:
    """Elements of the LoRA adapters' matrices (each a matmul of its own)."""
    return sum(t.numel for unit in units for t in unit.tensors if ".lora_" in t.name)
