"""LoRA and QLoRA fine-tunes as the frameworks build them: torchtune's lora_llama3_1 builder with
its LoRA recipes' set-up, and Hugging Face PEFT's get_peft_model over transformers' Llama.

Only the frameworks' constructors and set-up calls run here (each cited on the line above it);
nothing of their adapter layers is re-written. ``zeroplan.frameworks.build.build`` routes here
whenever ``TrainingSpec.finetune`` is not a full fine-tune.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from zeroplan.errors import ZeroplanError
from zeroplan.specs import ActivationCheckpointing, ModelSpec
from zeroplan.specs.finetune import FineTuneSpec, LoraTarget, Quantization, check_int8_base
from zeroplan.specs.framework import Framework

TORCHTUNE_ATTENTION = {LoraTarget.q: "q_proj", LoraTarget.k: "k_proj", LoraTarget.v: "v_proj", LoraTarget.o: "output_proj"}
"""torchtune 0.6.1 modules/peft/_utils.py LORA_ATTN_MODULES: the names lora_attn_modules takes."""
TORCHTUNE_MLP = (LoraTarget.gate, LoraTarget.up, LoraTarget.down)
"""torchtune 0.6.1 models/llama3_1/_component_builders.py lora_llama3_mlp: apply_lora_to_mlp wraps
w1 (gate), w2 (down) and w3 (up) together, never a subset."""

PEFT_MODULES = {
    LoraTarget.q: "q_proj", LoraTarget.k: "k_proj", LoraTarget.v: "v_proj", LoraTarget.o: "o_proj",
    LoraTarget.gate: "gate_proj", LoraTarget.up: "up_proj", LoraTarget.down: "down_proj", LoraTarget.output: "lm_head",
}
"""transformers 4.56.2 models/llama/modeling_llama.py: the nn.Linear names LoraConfig.target_modules matches."""

BNB_NF4_BLOCK = 64
"""bitsandbytes 0.50.2 nn/modules.py Params4bit(blocksize=64): the block transformers' Linear4bit
weights are quantized in (BitsAndBytesConfig has no block size); the scales are quantized again
in blocks of 256 with bnb_4bit_use_double_quant (functional.py quantize_4bit, compress_statistics)."""

TORCHTUNE_NF4_BLOCK = 64
"""torchao 0.14.1 dtypes/nf4tensor.py to_nf4(block_size=64, scaler_block_size=256): what
torchtune's LoRALinear(quantize_base=True) calls without quantization kwargs (lora_llama3_1
passes none)."""


def check_finetune(framework: Framework, finetune: FineTuneSpec, policy: ActivationCheckpointing,
                   activation_offloading: bool = False) -> None:
    """Refuse, in one line naming the field, a fine-tune the frameworks' own code cannot build."""
    if finetune.trains_everything:
        return
    if not finetune.is_lora:
        field = "finetune.freeze_embeddings" if finetune.freeze_embeddings else "finetune.frozen_blocks"
        raise ZeroplanError(field, "a partly frozen full fine-tune cannot be measured yet (measured: full fine-tunes, "
                                   "and LoRA/QLoRA with finetune.lora_rank >= 1)")
    if framework not in (Framework.torchtune, Framework.hf):
        raise ZeroplanError("finetune.lora_rank", f"LoRA is measured for torchtune and hf (PEFT) only, not {framework.value}")
    if finetune.vera or finetune.lora_fa:
        # The harness builds LoraConfig adapters only; VeRA and LoRA-FA were measured on peft's own
        # modules directly (tests/test_peft_variants.py).
        raise ZeroplanError("finetune.vera" if finetune.vera else "finetune.lora_fa",
                            "the harness builds LoRA adapters only (allowed: false)")
    if finetune.quantize not in (Quantization.none, Quantization.nf4, Quantization.int8):
        raise ZeroplanError("finetune.quantize", f"{finetune.quantize.value!r} cannot be measured (allowed: none, nf4, int8)")
    if finetune.quantize is Quantization.int8:
        # The planner's own refusals of an int8 base (hf only, no DoRA, a bf16 load).
        check_int8_base(finetune, framework)
    if policy not in (ActivationCheckpointing.none, ActivationCheckpointing.full):
        # torchtune 0.6.1 recipes/lora_finetune_*.py read only enable_activation_checkpointing.
        raise ZeroplanError("--activation-checkpointing", f"{policy.value!r} is not offered with LoRA (allowed: none, full)")
    if activation_offloading and framework is not Framework.torchtune:
        # PEFT's recipes have no activation offloading; torchtune's LoRA recipes wrap the model
        # as the full ones do (recipes/lora_finetune_*.py get_act_offloading_ctx_manager).
        raise ZeroplanError("--activation-offloading", f"is torchtune's, not {framework.value}'s (allowed: false)")
    targets = finetune.targets(framework)
    if framework is Framework.torchtune:
        mlp = [t for t in targets if t in TORCHTUNE_MLP]
        if mlp and len(mlp) != len(TORCHTUNE_MLP):
            raise ZeroplanError("finetune.lora_targets", "torchtune's apply_lora_to_mlp wraps gate, up and down together "
                                                         "(allowed: any of q, k, v, o; all or none of gate, up, down; output)")
        if finetune.quantize is Quantization.nf4:
            if finetune.quant_block_size != TORCHTUNE_NF4_BLOCK:
                raise ZeroplanError("finetune.quant_block_size", f"torchtune's QLoRA quantizes in blocks of {TORCHTUNE_NF4_BLOCK} (allowed: {TORCHTUNE_NF4_BLOCK})")
            if not finetune.double_quant:
                raise ZeroplanError("finetune.double_quant", "torchao's NF4Tensor always quantizes its block scales (allowed: true)")
    if framework is Framework.hf and finetune.quantize.is_quantized:
        # bitsandbytes quantizes a Params4bit (Int8Params) on its move to a real device
        # (nn/modules.py Params4bit._quantize, Int8Params._quantize), so hf QLoRA is built on
        # real CPU tensors (hf_bnb_qlora_llama).
        if finetune.quantize is Quantization.nf4 and finetune.quant_block_size != BNB_NF4_BLOCK:
            # transformers 4.56.2 integrations/bitsandbytes.py _replace_with_bnb_linear passes no
            # blocksize to bnb.nn.Linear4bit (BitsAndBytesConfig has no such field).
            raise ZeroplanError("finetune.quant_block_size", f"transformers' bitsandbytes integration quantizes in blocks "
                                                             f"of {BNB_NF4_BLOCK} (allowed: {BNB_NF4_BLOCK})")
        if not finetune.loads_base_in_bf16:
            raise ZeroplanError("finetune.base_dtype", "hf QLoRA is measured loaded with dtype=torch.bfloat16 "
                                                       "(prepare_model_for_kbit_training casts what is not 4-bit to fp32 "
                                                       "either way; allowed: bf16)")


def build_finetune(framework: Framework, model: ModelSpec, layers: int, policy: ActivationCheckpointing,
                   dtype: torch.dtype, finetune: FineTuneSpec, interval: int = 2, offloading: bool = False, *,
                   hf_base: Callable, hf_shard: Callable, torchtune_wrap: Callable):
    """The fine-tune's BuiltModel (zeroplan.frameworks.build.BuiltModel), from build's own pieces:
    ``hf_base`` (build._hf_llama), ``hf_shard`` (build._hf_fsdp2) and ``torchtune_wrap``
    (build.torchtune_built)."""
    check_finetune(framework, finetune, policy, offloading)
    if framework is Framework.torchtune:
        return torchtune_lora_llama(model, layers, policy, dtype, finetune, torchtune_wrap, offloading)
    if finetune.quantize.is_quantized:
        return hf_bnb_qlora_llama(model, layers, policy, finetune, hf_base)
    return hf_peft_llama(model, layers, policy, dtype, finetune, hf_base, hf_shard)


def lora_alpha(finetune: FineTuneSpec) -> float:
    return finetune.scaling * finetune.lora_rank


def torchtune_lora_llama(model: ModelSpec, layers: int, policy: ActivationCheckpointing, dtype: torch.dtype,
                         finetune: FineTuneSpec, torchtune_wrap: Callable, offloading: bool = False):
    """torchtune 0.6.1 recipes/lora_finetune_distributed.py _setup_model, on the meta device
    (``offloading``: its enable_activation_offloading, get_act_offloading_ctx_manager as the full
    recipe's)."""
    from torchtune import training
    from torchtune.models.llama3_1._component_builders import lora_llama3_1
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    targets = finetune.targets(Framework.torchtune)
    quantized = finetune.quantize is Quantization.nf4
    # recipes/lora_finetune_distributed.py _setup_model: `with training.set_default_dtype(self._dtype),
    # torch.device("meta"): model = config.instantiate(cfg_model)`; cfg_model is
    # models/llama3_1/_model_builders.py lora_llama3_1_8b/70b (qlora_*: quantize_base=True), which
    # call models/llama3_1/_component_builders.py lora_llama3_1 with the preset's sizes.
    with training.set_default_dtype(dtype), torch.device("meta"):
        module = lora_llama3_1(
            lora_attn_modules=[name for t, name in TORCHTUNE_ATTENTION.items() if t in targets],
            apply_lora_to_mlp=LoraTarget.gate in targets, apply_lora_to_output=LoraTarget.output in targets,
            vocab_size=model.vocab_size, num_layers=layers, num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads or model.num_heads, embed_dim=model.hidden_size,
            max_seq_len=model.max_positions, intermediate_dim=model.ffn_hidden_size,
            lora_rank=finetune.lora_rank, lora_alpha=lora_alpha(finetune), lora_dropout=finetune.lora_dropout,
            use_dora=finetune.dora, quantize_base=quantized,
        )
    # recipes/lora_finetune_distributed.py _setup_model: set_trainable_params(model,
    # get_adapter_params(model)) (modules/peft/_utils.py): requires_grad only on the adapters.
    set_trainable_params(module, get_adapter_params(module))
    # _setup_model then applies set_activation_checkpointing and shard_model exactly as the full
    # recipe does, with custom_sharded_layers from the config: none of the shipped
    # llama3_1/*_lora.yaml or 405B_qlora.yaml sets it (cfg.get(..., None)).
    built = torchtune_wrap(module, policy, 2, offloading, None)
    if quantized:
        built.empty = empty_with_nf4
    return built


def empty_with_nf4(module: nn.Module, device: object) -> None:
    """``module.to_empty(device)``, then the inner tensors each torchao NF4Tensor parameter (or
    FSDP2 shard of one) left behind allocated on ``device`` too: NF4Tensor's aten.empty_like
    (torchao 0.14.1 dtypes/nf4tensor.py nf4_empty_like) moves only quantized_data,
    quantized_scalers and quantization_factor (what FSDP2 shards and all-gathers) and keeps the
    scalar scaler_mean and the 16-entry nf4 lookup table where they were (meta)."""
    from torchao.dtypes.nf4tensor import NF4Tensor

    from zeroplan.simulate import _torch_private as private

    module.to_empty(device=device)
    for param in module.parameters():
        local = private.dtensor_local_storage(param)
        if isinstance(local, NF4Tensor):
            for name, inner in private.inner_tensors(local).items():
                if inner.device != local.device:
                    setattr(local, name, torch.empty_like(inner, device=local.device))


def hf_peft_llama(model: ModelSpec, layers: int, policy: ActivationCheckpointing, dtype: torch.dtype,
                  finetune: FineTuneSpec, hf_base: Callable, hf_shard: Callable):
    """peft 0.17.1 get_peft_model(LlamaForCausalLM, LoraConfig(...)) over build._hf_llama's model."""
    from importlib.metadata import version

    from peft import LoraConfig, get_peft_model

    # build._hf_llama enables gradient checkpointing (Trainer's gradient_checkpointing_enable,
    # use_reentrant=True) before PEFT wraps the model: peft 0.17.1 peft_model.py PeftModel.__init__
    # then sees model.is_gradient_checkpointing and calls model.enable_input_require_grads()
    # (_prepare_model_for_gradient_checkpointing), which a reentrant checkpoint over frozen
    # embeddings needs for any adapter to get a gradient (the order PEFT's docs show; the
    # Trainer itself never calls enable_input_require_grads).
    base = hf_base(model, layers, policy, dtype)
    # peft 0.17.1 tuners/lora/config.py LoraConfig and mapping_func.py get_peft_model (default
    # autocast_adapter_dtype=True: tuners_utils.py _cast_adapter_dtype upcasts bf16/fp16 adapter
    # weights to fp32; the frozen base keeps its dtype).
    config = LoraConfig(
        r=finetune.lora_rank, lora_alpha=lora_alpha(finetune),
        target_modules=[PEFT_MODULES[t] for t in finetune.targets(Framework.hf)],
        lora_dropout=finetune.lora_dropout, use_dora=finetune.dora, task_type="CAUSAL_LM",
    )
    module = get_peft_model(base.module, config)
    module.train()

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        return module(input_ids=tokens).logits

    def shard(mesh: object, reshard_after_forward: bool) -> str:
        return hf_shard(module, mesh, reshard_after_forward)

    return dataclasses.replace(base, module=module, forward=forward, shard=shard,
                               version=f"transformers {version('transformers')}, peft {version('peft')}")


BNB_QUANT_STORAGE = torch.bfloat16
"""bnb_4bit_quant_storage: the dtype the packed 4-bit data is stored in (two bytes hold four
weights). bfloat16, what PEFT's and accelerate's FSDP/DeepSpeed QLoRA guides set (so that FSDP
can flatten it with the bf16 rest); the default uint8 holds the same bytes."""


def bnb_config(finetune: FineTuneSpec):
    """transformers 4.56.2 BitsAndBytesConfig for QLoRA (Dettmers et al. 2023 and PEFT's
    developer_guides/quantization.md): nf4, double quantization from the spec, bf16 compute; or
    LLM.int8 (Dettmers et al. 2022) as ``load_in_8bit=True`` asks for it, every other field at
    its default (llm_int8_threshold 6.0: outlier columns of the input stay in 16 bits)."""
    from transformers import BitsAndBytesConfig

    if finetune.quantize is Quantization.int8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=finetune.double_quant,
                              bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=BNB_QUANT_STORAGE)


def hf_bnb_qlora_llama(model: ModelSpec, layers: int, policy: ActivationCheckpointing, finetune: FineTuneSpec,
                       hf_base: Callable):
    """PEFT QLoRA as its quantization guide does it, on real CPU tensors (random weights):
    ``LlamaForCausalLM.from_pretrained(..., quantization_config=BitsAndBytesConfig(...),
    dtype=torch.bfloat16)``, ``prepare_model_for_kbit_training``, ``get_peft_model``."""
    from importlib.metadata import version

    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import LlamaForCausalLM

    # build._hf_llama's model on meta: its config, and the shapes of the checkpoint from_pretrained
    # would read (every tensor of the model, bf16, random values: they change no byte).
    meta = hf_base(model, layers, policy, torch.bfloat16)
    config = meta.module.config
    shapes = {name: t.shape for name, t in meta.module.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    state_dict = {name: torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=generator)
                  for name, shape in shapes.items()}
    # transformers 4.56.2 modeling_utils.py from_pretrained (None with config and state_dict):
    # quantizers/quantizer_bnb_4bit.py _process_model_before_weight_loading calls
    # integrations/bitsandbytes.py replace_with_bnb_linear (every nn.Linear but lm_head, the
    # get_modules_to_not_convert default, becomes bnb.nn.Linear4bit), then create_quantized_param
    # makes each weight `bnb.nn.Params4bit(value, requires_grad=False, ...).to("cpu")`, which
    # quantizes it (bitsandbytes 0.50.2 nn/modules.py Params4bit.to -> _quantize ->
    # functional.quantize_4bit); the rest loads in dtype.
    module = LlamaForCausalLM.from_pretrained(None, config=config, state_dict=state_dict, quantization_config=bnb_config(finetune),
                                              dtype=torch.bfloat16, device_map={"": "cpu"})
    del state_dict
    # peft 0.17.1 utils/other.py prepare_model_for_kbit_training (docs developer_guides/
    # quantization.md; TRL's SFTTrainer calls it too for a QLoRA not sharded by FSDP/ZeRO-3):
    # freezes everything, casts every bf16/fp16 parameter that is not a Params4bit to fp32
    # (embedding, norms, lm_head), and with use_gradient_checkpointing (default True) calls
    # enable_input_require_grads and gradient_checkpointing_enable (reentrant), what
    # Trainer(gradient_checkpointing=True) calls as well; ac none passes False.
    module = prepare_model_for_kbit_training(module, use_gradient_checkpointing=policy is ActivationCheckpointing.full)
    lora_config = LoraConfig(
        r=finetune.lora_rank, lora_alpha=lora_alpha(finetune),
        target_modules=[PEFT_MODULES[t] for t in finetune.targets(Framework.hf)],
        lora_dropout=finetune.lora_dropout, use_dora=finetune.dora, task_type="CAUSAL_LM",
    )
    # peft 0.17.1 tuners/lora/bnb.py dispatch_bnb_4bit wraps each targeted bnb.nn.Linear4bit in
    # lora.bnb.Linear4bit (base_layer(x).clone() plus the adapter; fp32 adapters:
    # autocast_adapter_dtype=True).
    module = get_peft_model(module, lora_config)
    # Trainer.train() puts the model in training mode (bnb.nn.Linear4bit.forward repacks its
    # weight for the CPU inference kernel only when not training).
    module.train()

    keeps_input = finetune.bnb_4bit_keeps_input

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        if finetune.quantize is Quantization.int8:
            with int8_matmul_as_on_cuda():
                return module(input_ids=tokens).logits
        if keeps_input:
            with matmul_4bit_keeps_input():
                return module(input_ids=tokens).logits
        return module(input_ids=tokens).logits

    versions = f"transformers {version('transformers')}, peft {version('peft')}, bitsandbytes {version('bitsandbytes')}"
    if keeps_input:
        versions += f" with MatMul4Bit keeping its input as bitsandbytes {finetune.bitsandbytes_version} does"
    blocks = list(module.base_model.model.model.layers)
    return dataclasses.replace(meta, module=module, blocks=blocks, forward=forward, shard=None, version=versions, real=True)


def hf_sharded_qlora_llama(model: ModelSpec, layers: int, policy: ActivationCheckpointing, finetune: FineTuneSpec,
                           hf_base: Callable):
    """PEFT QLoRA as its FSDP guide loads it for sharding, on the meta device, quantized on the
    fake device by ``empty_with_bnb_nf4``: every block linear a bnb.nn.Linear4bit whose packed
    weight is stored in bnb_4bit_quant_storage bf16 (so FSDP can flatten it with the bf16 rest),
    nothing cast to fp32, then ``get_peft_model``.

    transformers 4.56.2 quantizers/quantizer_bnb_4bit.py _process_model_before_weight_loading
    calls integrations/bitsandbytes.py replace_with_bnb_linear (every nn.Linear but lm_head).
    trl's SFTTrainer (and transformers' Trainer) skip peft's prepare_model_for_kbit_training for a
    Params4bit stored in a float dtype (trl sft_trainer.py is_sharded_qlora): the embedding, norms
    and head stay bf16, which FSDP1 needs (a flat parameter holds one dtype). Gradient
    checkpointing (reentrant) is enabled before PEFT wraps, as in hf_peft_llama."""
    from importlib.metadata import version

    from peft import LoraConfig, get_peft_model
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    if finetune.quantize is not Quantization.nf4 or finetune.kbit_fp32_cast or finetune.dora:
        raise ZeroplanError("finetune", "a sharded hf QLoRA is nf4 without prepare_model_for_kbit_training's fp32 cast, "
                                        "without DoRA (allowed: quantize nf4, kbit_fp32_cast false, dora false)")
    base = hf_base(model, layers, policy, torch.bfloat16)
    module = replace_with_bnb_linear(base.module, modules_to_not_convert=["lm_head"], quantization_config=bnb_config(finetune))
    # peft 0.17.1 tuners/lora/model.py _create_and_replace reads the model's is_loaded_in_4bit
    # (from_pretrained sets it) to dispatch tuners/lora/bnb.py Linear4bit.
    module.is_loaded_in_4bit = True
    config = LoraConfig(
        r=finetune.lora_rank, lora_alpha=lora_alpha(finetune),
        target_modules=[PEFT_MODULES[t] for t in finetune.targets(Framework.hf)],
        lora_dropout=finetune.lora_dropout, task_type="CAUSAL_LM",
    )
    # peft 0.17.1 peft_model.py _prepare_model_for_gradient_checkpointing leaves a 4-bit model's
    # input gradients to prepare_model_for_kbit_training, which is skipped here; trl's SFTTrainer
    # (sft_trainer.py at 58c0888, lines 189-226, for a sharded QLoRA) calls
    # enable_input_require_grads itself, which the reentrant checkpoint needs.
    module.enable_input_require_grads()
    with torch.device("meta"):
        module = get_peft_model(module, config)
    module.train()
    double = finetune.double_quant
    # functional.py create_dynamic_map builds the 256-entry map the double quantization reads from
    # Python floats, which a fake tensor cannot take: made here on the real CPU, where
    # quantize_blockwise caches it (name2qmap) as it does on its first call.
    from bitsandbytes import functional

    if "dynamic" not in functional.name2qmap:
        functional.name2qmap["dynamic"] = functional.create_dynamic_map()

    def empty(module: nn.Module, device: object) -> None:
        empty_with_bnb_nf4(module, device, double)

    versions = f"transformers {version('transformers')}, peft {version('peft')}, bitsandbytes {version('bitsandbytes')}"
    return dataclasses.replace(base, module=module, blocks=list(module.base_model.model.model.layers), shard=None,
                               empty=empty, version=versions)


def empty_with_bnb_nf4(module: nn.Module, device: object, double_quant: bool) -> None:
    """``module.to_empty(device)``, then each bnb.nn.Linear4bit's weight quantized as
    Params4bit._quantize does it on its move to the device (bitsandbytes 0.50.2 nn/modules.py:
    functional.quantize_4bit(blocksize 64, nf4, quant_storage bf16), the packed data as the
    weight, the QuantState on the parameter and on its module, which is where
    fix_4bit_weight_quant_state_from_module finds it again once FSDP has replaced the
    parameter by a view of its flat parameter). Under fake-tensor mode the quantize operators run
    their registered fake kernels (the double quantization's dynamic map made before,
    hf_sharded_qlora_llama)."""
    import bitsandbytes as bnb
    from bitsandbytes import functional

    module.to_empty(device=device)
    for layer in module.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            # transformers 4.56.2 from_pretrained(dtype=torch.bfloat16) hands create_quantized_param
            # the bf16 checkpoint tensor, and quantize_4bit records its dtype in the QuantState
            # (functional.py QuantState(dtype=A.dtype)), which dequantize_4bit returns in
            # MatMul4Bit's backward; replace_with_bnb_linear made these weights in torch's default fp32.
            weight = layer.weight.to(torch.bfloat16)
            packed, state = functional.quantize_4bit(weight, blocksize=BNB_NF4_BLOCK, compress_statistics=double_quant,
                                                     quant_type="nf4", quant_storage=BNB_QUANT_STORAGE)
            layer.weight = nn.Parameter(packed, requires_grad=False)
            layer.weight.quant_state = state
            layer.quant_state = state


@contextlib.contextmanager
def matmul_4bit_keeps_input():
    """Run bitsandbytes' MatMul4Bit as releases before 0.43.2 did.

    bitsandbytes 0.39.1 to 0.43.1 autograd/_functions.py MatMul4Bit.forward ends
    `if any(ctx.needs_input_grad[:2]): ctx.tensors = (A, B)`; commit 9e75374 (#1270, released
    in 0.43.2) made it `(None, B)`, the only change to what the function keeps (its backward
    never reads A: the 4-bit weight has no gradient). The installed forward runs, then that one
    line is restored."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    original = MatMul4Bit.forward

    def forward(ctx, A, B, out=None, bias=None, quant_state=None):
        output = original(ctx, A, B, out, bias, quant_state)
        if not ctx.is_empty and any(ctx.needs_input_grad[:2]):
            ctx.tensors = (A, ctx.tensors[1])
        return output

    MatMul4Bit.forward = staticmethod(forward)
    try:
        yield
    finally:
        MatMul4Bit.forward = staticmethod(original)


@contextlib.contextmanager
def int8_matmul_as_on_cuda():
    """Run Linear8bitLt's training forward through the autograd function a GPU runs.

    bitsandbytes 0.50.2 autograd/_functions.py matmul sends a training forward on a CPU tensor to
    MatMul8bitFp (dequantize the weight, F.linear: autocast makes its output bf16, and it keeps
    only its input) and on a CUDA tensor to MatMul8bitLt (int8 product of the fp16-quantized
    input, output in the input's dtype, keeping the input and its outlier columns). The records
    are of the GPU's path: for the forward bitsandbytes.matmul is its own CUDA branch (the same
    lines without the device test); MatMul8bitLt then runs bitsandbytes' default kernels, which
    have the CUDA kernels' schemas (shapes and dtypes, _ops.py)."""
    import logging

    import bitsandbytes
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState

    def matmul(A, B, out=None, state=None, threshold=0.0, bias=None):
        state = state or MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return MatMul8bitLt.apply(A, B, out, bias, state)

    original = bitsandbytes.matmul
    quiet = logging.getLogger("bitsandbytes.autograd._functions")
    level = quiet.level
    # MatMul8bitLt warns on every call that it quantizes a non-fp16 input through fp16.
    quiet.setLevel(logging.ERROR)
    bitsandbytes.matmul = matmul
    try:
        yield
    finally:
        bitsandbytes.matmul = original
        quiet.setLevel(level)


def quantization_tensors(param: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The tensors a bitsandbytes Params4bit or Int8Params keeps beside its data, by name (an
    Int8Params its ``SCB`` row scales; a Params4bit its
    QuantState, bitsandbytes 0.50.2 functional.py: ``absmax`` (uint8 with double quantization,
    fp32 without), ``code`` (the 16-entry fp32 NF4 table), ``offset`` (fp32 scalar, the
    absmax mean subtracted before double quantization) and ``state2.absmax`` / ``state2.code``
    (fp32: one scale per 256 absmax values, the 256-entry 8-bit dynamic map)); None for any
    other parameter."""
    if type(param).__name__ == "Int8Params":
        # bitsandbytes 0.50.2 nn/modules.py Int8Params._quantize: the int8 codes are the
        # parameter's data (CB is the same tensor) and SCB the fp32 absmax of each output row
        # (functional.py int8_vectorwise_quant); Linear8bitLt's first forward moves both onto its
        # MatmulLtState (init_8bit_state), so they are read before any forward runs.
        return {"SCB": param.SCB} if isinstance(param.SCB, torch.Tensor) else {}
    state = getattr(param, "quant_state", None)
    if state is None or type(param).__name__ != "Params4bit":
        return None
    tensors = {name: getattr(state, name) for name in ("absmax", "code", "offset")}
    if state.state2 is not None:
        tensors |= {f"state2.{name}": getattr(state.state2, name) for name in ("absmax", "code")}
    return {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
