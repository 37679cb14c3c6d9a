"""Which parameters train: LoRA adapters over a frozen (optionally quantized) base, frozen
embeddings or blocks. The default trains every parameter (a full fine-tune)."""

# No postponed annotations: pydantic reads these fields' types as objects (zeroplan/specs/base.py).

import re
from enum import Enum

from pydantic import Field, model_validator

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen, JsonTuple
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import ModelSpec


class Quantization(str, Enum):
    """Storage of the frozen base weights of the linear layers."""

    none = "none"
    """The compute dtype (bf16; fp32 under fp32 training)."""
    nf4 = "nf4"
    """4-bit NormalFloat in blocks of ``quant_block_size`` elements, each with an absmax scale
    (Dettmers et al. 2023, "QLoRA", sec. 3): bitsandbytes' Linear4bit, torchao's NF4Tensor."""
    int8 = "int8"
    """8-bit integers with one fp32 scale per output row (Dettmers et al. 2022, "LLM.int8()":
    bitsandbytes' Linear8bitLt, transformers' ``load_in_8bit=True``)."""
    fp8 = "fp8"
    """float8 e4m3 with one fp32 scale per output row (torchao's float8 weight-only quantization)."""
    gptq_int4 = "gptq-int4"
    """A GPTQ checkpoint's 4-bit integers (Frantar et al. 2023, "GPTQ"), eight packed in each
    int32, with an fp16 scale and a 4-bit zero point per group of ``gptq_group_size`` input rows:
    auto-gptq's QuantLinear as transformers' GPTQConfig(bits=4, disable_exllama=True) loads it
    (zeroplan.core.finetune.storage.gptq_layout)."""

    @property
    def is_quantized(self) -> bool:
        return self is not Quantization.none


class BaseDtype(str, Enum):
    """The dtype a LoRA base is loaded in (before any engine casts it)."""

    bf16 = "bf16"
    """``from_pretrained(..., torch_dtype=torch.bfloat16)`` (or TRL's "auto" on a bf16
    checkpoint); torchtune's recipes (``dtype: bf16``)."""
    fp32 = "fp32"
    """transformers 4.56's default ``from_pretrained`` dtype: float32 weights, which the
    Trainer's bf16 autocast casts per matmul."""


class LoraTarget(str, Enum):
    """The linear layers of a decoder block an adapter can wrap (``output``: the LM head)."""

    q = "q"
    k = "k"
    v = "v"
    o = "o"
    gate = "gate"
    up = "up"
    down = "down"
    output = "output"


class SavedModule(str, Enum):
    """A module PEFT trains whole beside the adapters (LoraConfig ``modules_to_save``)."""

    embed = "embed"
    """The token embedding (Llama's ``embed_tokens``, Qwen-1's ``wte``)."""
    head = "head"
    """The untied LM head (``lm_head``)."""


# torchtune 0.6.1 recipes/configs/llama3_1/8B_lora.yaml (and 70B_lora, 8B_qlora_single_device):
# lora_attn_modules ['q_proj', 'v_proj', 'output_proj'], apply_lora_to_mlp True.
# peft 0.17.1 utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"]:
# ["q_proj", "v_proj"], what LoraConfig() wraps when target_modules is not given.
DEFAULT_LORA_TARGETS: dict[Framework, tuple[LoraTarget, ...]] = {
    Framework.torchtune: (LoraTarget.q, LoraTarget.v, LoraTarget.o, LoraTarget.gate, LoraTarget.up, LoraTarget.down),
    Framework.hf: (LoraTarget.q, LoraTarget.v),
    # litgpt 0.4.13.dev1 (commit 00af8b0) finetune/lora.py setup: lora_query True, lora_key False,
    # lora_value True, lora_projection, lora_mlp and lora_head False.
    Framework.litgpt: (LoraTarget.q, LoraTarget.v),
}
"""The layers each framework wraps when the user names none (zeroplan: every linear of a block)."""

ALL_BLOCK_TARGETS = (LoraTarget.q, LoraTarget.k, LoraTarget.v, LoraTarget.o, LoraTarget.gate, LoraTarget.up, LoraTarget.down)


def default_lora_targets(framework: Framework) -> tuple[LoraTarget, ...]:
    return DEFAULT_LORA_TARGETS.get(framework, ALL_BLOCK_TARGETS)


FUSED_QKV = (LoraTarget.q, LoraTarget.k, LoraTarget.v)
"""The projections a fused attention input linear computes (ModelSpec.fused_qkv)."""
FUSED_GATE_UP = (LoraTarget.gate, LoraTarget.up)
"""The projections a fused gated-MLP input linear computes (ModelSpec.fused_gate_up)."""


# peft 0.17.1 tuners/tuners_utils.py:443 BaseTuner.inject_adapter matches target_modules against
# module names and replaces each matching nn.Linear (or transformers' Conv1D) whole:
# tuners/lora/layer.py:217-218 (LoraLayer.update_layer) builds one lora_A Linear(in_features, r)
# and one lora_B Linear(r, out_features) over the module's full in and out widths, so a fused q/k/v
# module (c_attn, query_key_value, Wqkv, qkv_proj) gets one adapter of r x h and (q + 2 kv) x r,
# and nothing can wrap part of it (the early MergedLinear with enable_lora did: pet at 73d7224b5,
# src/pet/tuners/lora.py; 0.17.1 has no such layer). Only hf runs the models' Hugging Face modules: torchtune's builders, litgpt's GPT
# (its LoRAQKVLinear adapts q, k and v apart) and zeroplan's reference model have q, k and v apart.
def fused_modules(model: ModelSpec, framework: Framework) -> tuple[tuple[LoraTarget, ...], ...]:
    """The groups of projections that are one linear module where an adapter wraps the model."""
    if framework is not Framework.hf:
        return ()
    return ((FUSED_QKV,) if model.fused_qkv else ()) + ((FUSED_GATE_UP,) if model.fused_gate_up else ())


def linear_modules(targets: tuple[LoraTarget, ...], model: ModelSpec,
                   framework: Framework) -> tuple[tuple[LoraTarget, ...], ...]:
    """The linear modules that compute ``targets``' projections in the framework's model, in
    target order: one per projection, or every projection of a fused module any target names
    (fused_modules)."""
    fused = fused_modules(model, framework)
    modules: list[tuple[LoraTarget, ...]] = []
    for target in targets:
        module = next((group for group in fused if target in group), (target,))
        if module not in modules:
            modules.append(module)
    return tuple(modules)


def lora_adapters(finetune: "FineTuneSpec", model: ModelSpec, framework: Framework) -> tuple[tuple[LoraTarget, ...], ...]:
    """One entry per adapter of a block (and the head's): the linear modules its targets name
    (linear_modules; the framework's default q, v over a fused q/k/v module is peft's default,
    the fused module)."""
    return linear_modules(finetune.targets(framework), model, framework)


# bitsandbytes 0.50.2 functional.quantize_4bit raises "invalid blocksize" for any other.
NF4_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Elements per nf4 scale block that bitsandbytes quantizes in: the powers of two 32 to 4096."""

GPTQ_GROUP_SIZE = 128
"""Input rows per GPTQ scale and zero point: auto-gptq's BaseQuantizeConfig default and Qwen's
Int4 checkpoints' quantize_config (group_size 128)."""

GPTQ_CUDA_KERNEL_TOKENS = 128
"""auto-gptq 0.4.2 qlinear_cuda_old.py:85, 199-201 (QuantLinear.kernel_switch_threshold): under
this many rows of input its CUDA kernel multiplies (where its extension is built and the module
is not ``trainable``: lines 39-40), at or above it the torch path dequantizes."""

BITSANDBYTES_VERSION = "0.50.2"
"""The bitsandbytes an nf4 base is planned with unless told (what the hf records run)."""
BITSANDBYTES_FIRST_4BIT = (0, 39, 0)
"""bitsandbytes 0.39.0 brought Linear4bit and MatMul4Bit (QLoRA, May 2023): the oldest it models."""
BNB_4BIT_KEEPS_SOURCE_DTYPE = (0, 43, 0)
"""bitsandbytes 0.43.0 (Params4bit._quantize, commit dcfb6f8, #970) quantizes a weight as loaded;
before it Params4bit.cuda quantized an fp16 copy, so each dequantization wrote fp16 first
(zeroplan.core.finetune.activations.bnb_dequantizes_via_fp16)."""
BNB_4BIT_DROPS_INPUT = (0, 43, 2)
"""bitsandbytes 0.43.2 (commit 9e75374, "fix QLoRA mem bug: delete useless buffered activation",
#1270) changed MatMul4Bit.forward's ``ctx.tensors = (A, B)`` to ``(None, B)``: before it every
4-bit matmul kept its input until backward (zeroplan.core.finetune.activations)."""

PEFT_VERSION = "0.20.0"
"""The peft release hf's LoRA is planned with unless told: the newest (v0.20.0), whose adapter
dtype is that of every release from 0.12.0 (FineTuneSpec.peft_version)."""
PEFT_FIRST_READ = (0, 4, 0)
"""The oldest peft whose LoRA layers were read (v0.4.0 tuners/lora.py)."""
PEFT_NEWEST_READ = (0, 20)
"""The newest peft minor release read (v0.20.0)."""
PEFT_ADAPTERS_FOLLOW_BASE = (0, 7, 0)
"""peft 0.7.0 tuners/lora/layer.py:96-100 LoraLayer.update_layer: ``self.to(weight.device,
dtype=weight.dtype)`` with the base layer's weight (get_base_layer), which the new base_layer
design hands it while the adapter is made: adapters in the base's floating dtype. Before it
(0.4.0 tuners/lora.py:691 and 0.5.0:158 ``self.to(self.weight.device)``; 0.6.0-0.6.2
tuners/lora/layer.py:79-86, where Linear's weight is not yet set while update_layer runs, and
model.py _replace_module moves the new module to the weight's device only) the adapters keep
nn.Linear's fp32 (zeroplan.core.finetune.adapter_dtype)."""
PEFT_UPCASTS_ADAPTERS = (0, 12, 0)
"""peft 0.12.0 (#1706, "Autocast adapter weights if fp16/bf16") mapping.py:138 get_peft_model's
autocast_adapter_dtype=True and peft_model.py:159 -> tuners/tuners_utils.py:316-356
_cast_adapter_dtype upcast every fp16 or bf16 adapter tensor to fp32 after the layers cast them
to the base's dtype (the same in 0.17.1 and 0.20.0: tuners_utils.py _cast_adapter_dtype)."""


def version_tuple(text: str) -> tuple[int, int, int]:
    """``"0.43.1"`` as (0, 43, 1); a missing patch number is 0. ValueError for anything else."""
    match = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if match is None:
        raise ValueError(text)
    return int(match[1]), int(match[2]), int(match[3] or 0)


def check_release_range(field: str, text: str | None, oldest: tuple[int, ...], newest: tuple[int, ...],
                        newest_text: str) -> None:
    """Refuse, in one line naming ``field``, a version that is not a release number or whose
    leading numbers (as many as ``oldest`` gives) lie outside oldest..newest; None passes."""
    if text is None:
        return
    allowed = f"allowed: MAJOR.MINOR[.PATCH] from {'.'.join(map(str, oldest))} to {newest_text}"
    try:
        release = version_tuple(text)
    except ValueError:
        raise ZeroplanError(field, f"{text!r} is not a release number ({allowed})") from None
    if not oldest <= release[:len(oldest)] <= newest:
        raise ZeroplanError(field, f"{text} is not modelled ({allowed})")


class FineTuneSpec(Frozen):
    """What trains and how the frozen part is stored. ``lora_rank`` 0 and nothing frozen: every
    parameter trains."""

    lora_rank: int = Field(default=0, ge=0, le=65536)
    """r: rank of each adapter (Hu et al. 2021, "LoRA", sec. 4.1); 0 = no adapters."""
    lora_alpha: float | None = Field(default=None, gt=0)
    """alpha: the adapter's output is scaled by alpha / r. Changes no byte; None = 2 r (the
    torchtune configs' convention)."""
    lora_targets: JsonTuple[LoraTarget] | None = None
    """Linear layers wrapped by an adapter; None = the framework's default (DEFAULT_LORA_TARGETS)."""
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input: above 0 the adapter keeps its own dropped copy of the
    input and a mask for backward (0, the shipped configs' value, keeps neither)."""
    dora: bool = False
    """Weight-decomposed LoRA (Liu et al. 2024, "DoRA"): a trainable magnitude per output row."""
    vera: bool = Field(default=False, exclude_if=lambda vera: not vera)
    """VeRA (Kopiczko et al. 2024; peft VeraConfig, r = lora_rank) in place of LoRA: one frozen
    random pair vera_A (r x the widest input) and vera_B (the widest output x r) shared by every
    adapted linear, which trains only its vectors lambda_d (r) and lambda_b (out)
    (zeroplan.core.finetune.units.vera_tensors). Left out of the JSON when false."""
    lora_fa: bool = Field(default=False, exclude_if=lambda lora_fa: not lora_fa)
    """LoRA-FA (Zhang et al. 2023): peft's create_lorafa_optimizer freezes every lora_A and steps
    each lora_B with LoraFAOptimizer, a projected AdamW (zeroplan.core.finetune.units,
    zeroplan.core.finetune.activations). Left out of the JSON when false."""
    base_dtype: BaseDtype = BaseDtype.bf16
    """The dtype the frozen base is loaded in (LoRA only; an engine may cast it again:
    zeroplan.core.finetune.storage.frozen_element_bytes)."""
    quantize: Quantization = Quantization.none
    """Storage of the frozen base linears (QLoRA: nf4)."""
    quant_block_size: int = Field(default=64, gt=0, le=4096)
    """Elements per nf4 scale block (QLoRA's 64; bitsandbytes' bnb_4bit_blocksize)."""
    double_quant: bool = True
    """Quantize the nf4 block scales themselves to 8 bits in blocks of 256 (QLoRA sec. 3,
    bitsandbytes' bnb_4bit_use_double_quant; torchao's NF4Tensor always does)."""
    gptq_group_size: int = Field(default=GPTQ_GROUP_SIZE, gt=0, le=65536,
                                 exclude_if=lambda size: size == GPTQ_GROUP_SIZE)
    """Input rows per scale and zero point of a gptq-int4 base (the checkpoint's quantize_config
    group_size; 128 in Qwen's Int4 checkpoints). Left out of the JSON at its default."""
    bitsandbytes_version: str = BITSANDBYTES_VERSION
    """The bitsandbytes release an nf4 base runs on (hf and zeroplan; torchtune's nf4 is
    torchao's): before 0.43.2 each 4-bit matmul kept its input for backward
    (zeroplan.core.finetune.activations.bnb_4bit_keeps_input)."""
    peft_version: str = Field(default=PEFT_VERSION, exclude_if=lambda version: version == PEFT_VERSION)
    """The peft release hf's LoRA runs on (zeroplan.core.finetune.adapter_dtype): before 0.7.0 and
    from 0.12.0 the adapters are fp32 over a bf16 base, 0.7.0 to 0.11.1 in the base's dtype. Left
    out of the JSON at its default."""
    kbit_fp32_cast: bool = True
    """Hugging Face's quantized base (QLoRA, int8): whether the recipe runs peft's
    prepare_model_for_kbit_training, which casts every parameter that is not 4- or 8-bit
    (embeddings, head, norms) to fp32 (transformers' and peft's QLoRA recipes); False: they stay
    in the dtype the base was loaded in, as ms-swift 1.x's sft (swift/llm/sft.py at cfcb672:
    from_pretrained with torch_dtype and a BitsAndBytesConfig, then its own LoRA, nothing cast)."""
    modules_to_save: JsonTuple[SavedModule] = Field(default=(), exclude_if=lambda saved: not saved)
    """Modules PEFT trains whole beside the adapters (LoraConfig ``modules_to_save``): each is
    wrapped in a ModulesToSaveWrapper that keeps the original frozen and trains a deep copy
    (zeroplan.core.finetune.modules_to_save). Empty: none (PEFT's default), left out of the JSON,
    so requests and records dump as before the field existed."""
    freeze_embeddings: bool = False
    """Freeze the token embedding (and an untied LM head) in a full fine-tune."""
    frozen_blocks: int = Field(default=0, ge=0)
    """Freeze the first K decoder blocks in a full fine-tune (at most the model's blocks)."""

    @model_validator(mode="after")
    def _check(self) -> "FineTuneSpec":
        lora_only = {"lora_alpha": self.lora_alpha is not None, "lora_targets": self.lora_targets is not None,
                     "lora_dropout": self.lora_dropout > 0, "dora": self.dora,
                     "quantize": self.quantize.is_quantized, "base_dtype": self.base_dtype is not BaseDtype.bf16,
                     "modules_to_save": bool(self.modules_to_save), "vera": self.vera, "lora_fa": self.lora_fa,
                     "peft_version": self.peft_version != PEFT_VERSION}
        if not self.lora_rank:
            given = [name for name, set_ in lora_only.items() if set_]
            if given:
                raise ZeroplanError(f"finetune.{given[0]}", "applies only with adapters (set lora_rank, --lora-rank, to 1 or more)")
        if self.lora_targets is not None and not self.lora_targets:
            raise ZeroplanError("finetune.lora_targets", f"must name at least one layer (allowed: {', '.join(t.value for t in LoraTarget)})")
        if self.lora_targets is not None and len(set(self.lora_targets)) != len(self.lora_targets):
            raise ZeroplanError("finetune.lora_targets", "names a layer twice")
        if len(set(self.modules_to_save)) != len(self.modules_to_save):
            raise ZeroplanError("finetune.modules_to_save", "names a module twice (allowed: embed, head, each once)")
        nf4_only = {"quant_block_size": self.quant_block_size != 64, "double_quant": not self.double_quant,
                    "bitsandbytes_version": self.bitsandbytes_version != BITSANDBYTES_VERSION}
        given = [name for name, set_ in nf4_only.items() if set_]
        if given and self.quantize is not Quantization.nf4:
            raise ZeroplanError(f"finetune.{given[0]}", "applies to an nf4 base only (set quantize, --quantize, to nf4)")
        if self.gptq_group_size != GPTQ_GROUP_SIZE and self.quantize is not Quantization.gptq_int4:
            raise ZeroplanError("finetune.gptq_group_size", "applies to a gptq-int4 base only (set quantize, --quantize, "
                                "to gptq-int4)")
        try:
            version = version_tuple(self.bitsandbytes_version)
        except ValueError:
            raise ZeroplanError("finetune.bitsandbytes_version", f"{self.bitsandbytes_version!r} is not a release number "
                                "(allowed: MAJOR.MINOR[.PATCH], e.g. 0.43.1)") from None
        if version < BITSANDBYTES_FIRST_4BIT:
            raise ZeroplanError("finetune.bitsandbytes_version", f"{self.bitsandbytes_version} has no 4-bit layers "
                                "(allowed: 0.39.0 or later)")
        check_release_range("finetune.peft_version", self.peft_version, PEFT_FIRST_READ[:2], PEFT_NEWEST_READ,
                            f"{PEFT_NEWEST_READ[0]}.{PEFT_NEWEST_READ[1]}.x")
        if self.quant_block_size not in NF4_BLOCK_SIZES:
            raise ZeroplanError("finetune.quant_block_size", f"{self.quant_block_size} is not a 4-bit block size bitsandbytes "
                                f"quantizes in (allowed: {', '.join(map(str, NF4_BLOCK_SIZES))})")
        if not self.kbit_fp32_cast and not self.quantize.is_quantized:
            raise ZeroplanError("finetune.kbit_fp32_cast", "applies to a quantized base only (set quantize, --quantize, "
                                "to nf4, int8 or gptq-int4)")
        check_adapter_variant(self)
        if self.lora_rank and (self.freeze_embeddings or self.frozen_blocks):
            raise ZeroplanError("finetune.frozen_blocks", "applies to a full fine-tune; under LoRA every base weight is frozen already")
        return self

    @property
    def bnb_4bit_keeps_input(self) -> bool:
        """An nf4 base on a bitsandbytes whose MatMul4Bit keeps its input (before 0.43.2); the
        framework decides whether bitsandbytes runs it at all (torchtune's nf4 is torchao's)."""
        return self.quantize is Quantization.nf4 and version_tuple(self.bitsandbytes_version) < BNB_4BIT_DROPS_INPUT

    @property
    def is_lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def loads_base_in_bf16(self) -> bool:
        """A LoRA whose base is loaded in bf16 (not a full fine-tune, not an fp32 base)."""
        return self.is_lora and self.base_dtype is BaseDtype.bf16

    def module_in_bf16(self, framework: Framework) -> bool:
        """Whether the model outside the adapters is held in bf16 between the Trainer's autocast
        casts: a LoRA base loaded in bf16, except hf's QLoRA, whose recipe runs peft 0.17.1
        utils/other.py prepare_model_for_kbit_training, casting every parameter that is not
        4-bit (embeddings, head, norms) to fp32, so the residual stream is fp32 again."""
        return self.loads_base_in_bf16 and not self.hf_casts_rest_to_fp32(framework)

    def hf_casts_rest_to_fp32(self, framework: Framework) -> bool:
        """Whether hf's recipe casts what is not quantized to fp32 (kbit_fp32_cast)."""
        # peft 0.5.0 utils/other.py:92-101 prepare_model_for_kbit_training casts nothing of a
        # GPTQ model (quantization_method "gptq"), in every release since.
        return (framework is Framework.hf and self.quantize.is_quantized and self.kbit_fp32_cast
                and self.quantize is not Quantization.gptq_int4)

    @property
    def trains_everything(self) -> bool:
        return not (self.is_lora or self.freeze_embeddings or self.frozen_blocks)

    def targets(self, framework: Framework) -> tuple[LoraTarget, ...]:
        """The wrapped layers in force (the framework's default when none were named)."""
        if self.lora_targets is not None:
            return self.lora_targets
        return default_lora_targets(framework)

    @property
    def scaling(self) -> float:
        """alpha / r, the factor on the adapter's output."""
        alpha = self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank
        return alpha / self.lora_rank


def check_adapter_variant(finetune: "FineTuneSpec") -> None:
    """Refuse, in one line naming the field, VeRA or LoRA-FA beside what was not measured with
    them (their source: zeroplan.core.finetune.units; the measurement: tests/test_peft_variants.py)."""
    if not (finetune.vera or finetune.lora_fa):
        return
    field = "finetune.vera" if finetune.vera else "finetune.lora_fa"
    name = "VeRA" if finetune.vera else "LoRA-FA"
    refusals = (
        # peft 51c2ff6 tuners/vera/config.py VeraConfig has no alpha (lambda_d, lambda_b scale).
        ("a lora_alpha (VeraConfig has none; allowed: leave --lora-alpha out)", finetune.vera and finetune.lora_alpha is not None),
        ("LoRA-FA (allowed: one of them)", finetune.vera and finetune.lora_fa),
        ("DoRA (allowed: dora false)", finetune.dora),
        ("a quantized base (allowed: quantize none)", finetune.quantize.is_quantized),
        ("dropout (allowed: lora_dropout 0, --lora-dropout 0)", finetune.lora_dropout > 0),
        ("modules_to_save (allowed: none)", bool(finetune.modules_to_save)),
        ("a base loaded in fp32 (allowed: base_dtype bf16)", finetune.base_dtype is not BaseDtype.bf16),
    )
    for detail, refused in refusals:
        if refused:
            raise ZeroplanError(field, f"{name} is not measured with {detail}")


# peft 51c2ff6 (the MetaMathQA method comparison's) tuners/vera/model.py VeraModel and
# optimizers/lorafa.py create_lorafa_optimizer act on PEFT models only; what was measured of
# them (tests/test_peft_variants.py) is peft's own code on one process without autocast: the
# adapters as get_peft_model leaves them (fp32, tuners_utils.py:2243-2288 cast_adapter_dtype),
# no engine or sharding wrapper casting or splitting them.
def check_adapter_variant_training(finetune: FineTuneSpec, framework: Framework, strategy_is_plain_ddp: bool,
                                   on_device_map: bool, autocast: bool, optimizer_is_adamw: bool,
                                   optimizer_loop: str | None, checkpointing: bool, compile: bool,
                                   objective_is_sft: bool = True) -> None:
    """Refuse, in one line naming the field, VeRA or LoRA-FA under what they were not measured
    with: hf (PEFT), plain DDP without a device map, no autocast (bf16-pure or fp32), no
    recomputation or compile; LoRA-FA with its own AdamW, whose step walks one tensor after
    another (--optimizer adamw --optimizer-loop for-loop)."""
    if not (finetune.vera or finetune.lora_fa):
        return
    field = "finetune.vera" if finetune.vera else "finetune.lora_fa"
    name = "VeRA" if finetune.vera else "LoRA-FA"
    refusals = (
        ("framework", framework is not Framework.hf, f"{name} is PEFT's (allowed: --framework hf)"),
        ("strategy", not strategy_is_plain_ddp or on_device_map,
         f"{name} is measured under DDP only (allowed: --strategies ddp, one GPU or several, no device map)"),
        ("precision", autocast, f"{name} is measured without autocast only (allowed: bf16-pure, fp32)"),
        ("activation_checkpointing", checkpointing, f"{name} under recomputation is not measured (allowed: none)"),
        ("compile", compile, f"{name} under torch.compile is not measured (allowed: without --compile)"),
        ("objective", not objective_is_sft, f"{name} is measured for supervised fine-tuning only (allowed: sft)"),
        ("finetune.lora_targets", LoraTarget.output in finetune.targets(framework),
         f"{name} on the LM head is not modelled (allowed: the block layers q,k,v,o,gate,up,down)"),
        ("optimizer", finetune.lora_fa and not optimizer_is_adamw,
         "LoRA-FA is peft's LoraFAOptimizer, an AdamW (allowed: --optimizer adamw)"),
        ("optimizer_loop", finetune.lora_fa and optimizer_loop != "for-loop",
         "LoRA-FA's LoraFAOptimizer.step updates one tensor after another (allowed: --optimizer-loop for-loop)"),
    )
    for which, refused, detail in refusals:
        if refused:
            raise ZeroplanError(field if which == "framework" else which, detail)


def check_finetune(finetune: FineTuneSpec, model: ModelSpec, framework: Framework, model_parallel_size: int,
                   checkpointing: bool = False) -> None:
    """Refuse, in one line naming the field, a fine-tune this model, framework or layout cannot take."""
    if finetune.frozen_blocks > model.num_layers:
        raise ZeroplanError("finetune.frozen_blocks", f"{finetune.frozen_blocks} exceeds {model.name}'s "
                            f"{model.num_layers} blocks (allowed: 0 to {model.num_layers})")
    if finetune.trains_everything:
        return
    if framework.megatron_layout:
        # megatron-core's DDP builds its gradient buffer from requires_grad parameters, but its
        # PEFT paths live outside megatron-core (NeMo); no fine-tune of it has been read, nor
        # of the Megatron-DeepSpeed fork.
        raise ZeroplanError("finetune", f"frozen parameters and LoRA are not modelled for {framework.value} "
                            "(allowed: full training)")
    if model_parallel_size > 1:
        raise ZeroplanError("finetune", "frozen parameters and LoRA are modelled under data parallelism only "
                            "(tp, cp, pp and ep must be 1)")
    if not finetune.is_lora:
        return
    if model.is_moe or model.is_mla:
        raise ZeroplanError("finetune.lora_rank", f"{model.name!r}: LoRA is modelled for dense models with q, k and v "
                            "projections (not mixture-of-experts or latent attention) yet")
    if framework is Framework.torchtitan:
        raise ZeroplanError("finetune.lora_rank", "LoRA is modelled for hf (PEFT), torchtune, litgpt and zeroplan, not "
                            "torchtitan yet (allowed frameworks: hf, torchtune, litgpt, zeroplan)")
    if not finetune.kbit_fp32_cast and framework is not Framework.hf:
        # peft's prepare_model_for_kbit_training is hf's recipe; the other frameworks keep what
        # is not quantized as loaded already.
        raise ZeroplanError("finetune.kbit_fp32_cast", f"is hf's recipe step; {framework.value} casts nothing to fp32 "
                            "(allowed only with framework hf)")
    if finetune.peft_version != PEFT_VERSION and framework is not Framework.hf:
        # Only the hf profile builds its adapters with peft (torchtune and zeroplan their own).
        raise ZeroplanError("finetune.peft_version", f"{framework.value} does not run peft (allowed only with "
                            "framework hf)")
    if finetune.base_dtype is BaseDtype.fp32 and framework is Framework.torchtune:
        # torchtune 0.6.1 recipes load the whole model in the recipe's `dtype` (bf16 in every LoRA config).
        raise ZeroplanError("finetune.base_dtype", "torchtune loads the base in its recipe's dtype (allowed: bf16)")
    if finetune.bitsandbytes_version != BITSANDBYTES_VERSION and framework is Framework.torchtune:
        # torchtune 0.6.1 modules/peft/lora.py LoRALinear(quantize_base=True) quantizes with torchao's to_nf4.
        raise ZeroplanError("finetune.bitsandbytes_version", "torchtune's nf4 base is torchao's NF4Tensor, not bitsandbytes "
                            f"(allowed: {BITSANDBYTES_VERSION}, the default, or --framework hf or zeroplan)")
    if finetune.bnb_4bit_keeps_input and framework is Framework.zeroplan and checkpointing:
        # bitsandbytes before 0.43.2 keeps MatMul4Bit's input in ctx.tensors, a plain attribute
        # that the reference model's non-reentrant checkpoint (torch/utils/checkpoint.py, saved-
        # tensor hooks) never sees, so every checkpointed block would keep it (fsdp_qlora's
        # README warns of "high memory usage" there); no record measures it.
        raise ZeroplanError("finetune.bitsandbytes_version", f"{finetune.bitsandbytes_version} under the reference model's "
                            "non-reentrant checkpoint is not measured (allowed: 0.43.2 or later, or "
                            "--activation-checkpointing none)")
    if finetune.dora and finetune.quantize.is_quantized and framework not in (Framework.torchtune, Framework.hf):
        raise ZeroplanError("finetune.dora", "DoRA over a quantized base is measured for torchtune's QDoRA and PEFT's "
                            "over bitsandbytes nf4 only (allowed: --framework torchtune or hf, or --quantize none)")
    if finetune.dora and finetune.lora_dropout > 0:
        # peft 0.17.1 tuners/lora/layer.py: with dropout DoRA recomputes the base output from the
        # dropped input, a path no record measures.
        raise ZeroplanError("finetune.dora", "DoRA with lora_dropout is not measured yet (allowed: --lora-dropout 0)")
    if finetune.quantize is Quantization.fp8:
        # peft 0.17.1 tuners/lora/torchao.py TorchaoLoraLinear._check_dtype_supported raises for
        # any torchao weight but int8; torchtune 0.6.1 quantizes a LoRA base to NF4 only.
        raise ZeroplanError("finetune.quantize", "'fp8': no framework here trains LoRA over an fp8 base (peft's torchao "
                                                 "LoRA takes int8 weights only; allowed: none, nf4, int8, gptq-int4)")
    if finetune.quantize is Quantization.int8:
        check_int8_base(finetune, framework)
    if finetune.quantize is Quantization.gptq_int4:
        check_gptq_base(finetune, model, framework)
    if (finetune.vera or finetune.lora_fa) and model.encoder_decoder is not None:
        raise ZeroplanError("finetune.vera" if finetune.vera else "finetune.lora_fa", f"{model.name!r}: VeRA and "
                            "LoRA-FA are modelled for decoder-only models (allowed: a model with one stack of blocks)")
    check_lora_rank(finetune, model, framework)
    if finetune.modules_to_save:
        check_saved_module_model(finetune, model, framework)
    present = {LoraTarget.q, LoraTarget.k, LoraTarget.v, LoraTarget.o}
    if model.mlp.gated:
        present |= {LoraTarget.gate, LoraTarget.up, LoraTarget.down}
    elif framework is Framework.litgpt:
        # litgpt 0.4.13.dev1 litgpt/lora.py GptNeoxMLP: lora_mlp wraps its fc and proj (a GPT MLP's
        # two linears), planned as up (h -> f) and down (f -> h): zeroplan.core.finetune.units.
        present |= {LoraTarget.up, LoraTarget.down}
    present |= set() if model.tied_embeddings else {LoraTarget.output}
    for target in finetune.targets(framework):
        if target not in present:
            allowed = ", ".join(t.value for t in LoraTarget if t in present)
            raise ZeroplanError("finetune.lora_targets", f"{target.value!r}: {model.name} has no such layer "
                                f"(allowed: {allowed})")
    check_fused_targets(finetune, model, framework)


def check_fused_targets(finetune: FineTuneSpec, model: ModelSpec, framework: Framework) -> None:
    """Refuse, in one line, named targets that cover part of a fused module (peft wraps the
    module whole: fused_modules); the framework's default names none."""
    if finetune.lora_targets is None:
        return
    for group in fused_modules(model, framework):
        named = [t for t in group if t in finetune.lora_targets]
        if named and len(named) < len(group):
            whole = ",".join(t.value for t in group)
            raise ZeroplanError("finetune.lora_targets", f"{','.join(t.value for t in named)!r} is part of one linear "
                                f"module in {model.name} ({whole}), which peft wraps whole (allowed: {whole} together, "
                                "or none of them)")


def check_int8_base(finetune: FineTuneSpec, framework: Framework) -> None:
    """Refuse, in one line, an int8 base outside what was measured (hf, no DoRA, a bf16 load;
    the strategies: zeroplan.specs.request.INT8_STRATEGIES)."""
    if framework is not Framework.hf:
        # torchtune 0.6.1 quantizes a LoRA base to NF4 only (LoRALinear(quantize_base=True)).
        raise ZeroplanError("finetune.quantize", "an int8 base is bitsandbytes' Linear8bitLt under hf "
                                                 "(allowed: --framework hf, or --quantize nf4)")
    if finetune.dora:
        raise ZeroplanError("finetune.dora", "DoRA over an int8 base is not measured (allowed: false)")
    if not finetune.loads_base_in_bf16:
        raise ZeroplanError("finetune.base_dtype", "an int8 base is measured loaded with dtype=torch.bfloat16 (allowed: bf16)")


# transformers 4.32 GPTQConfig loads a GPTQ checkpoint through optimum's GPTQQuantizer, which
# replaces every nn.Linear inside the decoder blocks by auto-gptq's QuantLinear (the one
# dynamically_import_QuantLinear picks: auto-gptq 0.4.2 utils/import_utils.py:31-45, with
# disable_exllama and desc_act false qlinear_cuda_old); peft 0.5.0 tuners/lora.py wraps it in its
# own QuantLinear (forward at lines 1254-1277), and prepare_model_for_kbit_training (peft 0.5.0
# utils/other.py:92-101) casts nothing of a GPTQ model to fp32. Modelled as Qwen's Q-LoRA scripts
# run it (finetune/finetune_qlora_single_gpu.sh, finetune_qlora_ds.sh at e8e1596: --fp16 under
# DeepSpeed ZeRO-2); the strategies and precision: zeroplan.specs.request.
def check_gptq_base(finetune: FineTuneSpec, model: ModelSpec, framework: Framework) -> None:
    """Refuse, in one line, a gptq-int4 base outside what is modelled (hf's peft over auto-gptq's
    QuantLinear, no DoRA, groups that divide every quantized linear's input)."""
    if framework is not Framework.hf:
        raise ZeroplanError("finetune.quantize", "a gptq-int4 base is auto-gptq's QuantLinear under transformers and "
                                                 "peft (allowed: --framework hf)")
    if finetune.dora:
        raise ZeroplanError("finetune.dora", "DoRA over a gptq-int4 base is not modelled (allowed: false)")
    group = finetune.gptq_group_size
    widths = {"hidden": model.hidden_size, "attention": model.attention_output_size, "ffn": model.ffn_hidden_size}
    for name, width in widths.items():
        # qlinear_cuda_old.py:242 reshapes the unpacked weight into (-1, group_size, out).
        if width % group:
            raise ZeroplanError("finetune.gptq_group_size", f"{group} does not divide {model.name}'s {name} width "
                                f"{width} (allowed: a divisor of {', '.join(str(w) for w in widths.values())})")


def _adapted_shapes(model: ModelSpec) -> dict[LoraTarget, tuple[int, int]]:
    """(input, output) width of each linear an adapter can wrap."""
    h = model.hidden_size
    return {LoraTarget.q: (h, model.q_size), LoraTarget.k: (h, model.kv_size), LoraTarget.v: (h, model.kv_size),
            LoraTarget.o: (model.q_size, h), LoraTarget.gate: (h, model.ffn_hidden_size),
            LoraTarget.up: (h, model.ffn_hidden_size), LoraTarget.down: (model.ffn_hidden_size, h),
            LoraTarget.output: (h, model.vocab_size)}


def check_lora_rank(finetune: FineTuneSpec, model: ModelSpec, framework: Framework) -> None:
    """Refuse a rank above the smallest width of an adapted layer: the adapter B A of a d_in x
    d_out layer has rank at most min(d_in, d_out) (Hu et al. 2021, sec. 4.1), so a larger r adds
    bytes that no update can use."""
    shapes = _adapted_shapes(model)
    target, (d_in, d_out) = min(((t, shapes[t]) for t in finetune.targets(framework)), key=lambda item: min(item[1]))
    bound = min(d_in, d_out)
    if finetune.lora_rank > bound:
        raise ZeroplanError("finetune.lora_rank", f"{finetune.lora_rank} exceeds {bound}, the smallest width of the adapted "
                            f"layers ({target.value}: {d_in} x {d_out} in {model.name}) (allowed: 1 to {bound})")


def check_saved_module_model(finetune: FineTuneSpec, model: ModelSpec, framework: Framework) -> None:
    """Refuse, in one line, modules_to_save outside PEFT or on a model whose embedding and head
    are one tensor."""
    if framework is not Framework.hf:
        # PEFT's LoraConfig(modules_to_save=...) (peft 0.17.1 utils/other.py ModulesToSaveWrapper);
        # torchtune 0.6.1 and litgpt 0.4.13.dev1 train a module whole only by leaving it unfrozen
        # in a full fine-tune.
        raise ZeroplanError("finetune.modules_to_save", "is PEFT's LoraConfig(modules_to_save=...) (allowed only with "
                            "framework hf)")
    if model.tied_embeddings:
        # peft 0.17.1 ModulesToSaveWrapper.update deep-copies each wrapped module on its own, which
        # unties a tied head from its embedding; no record measures that.
        raise ZeroplanError("finetune.modules_to_save", f"{model.name} ties its head to its embedding; modelled for "
                            "untied models only (allowed: a model with tie_word_embeddings false)")
    if SavedModule.head in finetune.modules_to_save and LoraTarget.output in finetune.targets(framework):
        raise ZeroplanError("finetune.modules_to_save", "'head' is also an adapter target (output); PEFT wraps a "
                            "module one way (allowed: drop output from --lora-targets, or head from modules_to_save)")


def check_saved_module_training(finetune: FineTuneSpec, strategy_is_plain_ddp: bool, on_device_map: bool,
                                optimizer_elementwise: bool, paged_optimizer: bool, fp16_mixed: bool) -> None:
    """Refuse, in one line, modules_to_save under what its trainable copy is not modelled with:
    DDP (one GPU or several) without a device map, an element-wise optimizer, not paged."""
    if not finetune.modules_to_save:
        return
    if not strategy_is_plain_ddp or on_device_map:
        # ZeRO's and FSDP's engines cast and shard the copy with the rest; not read yet.
        raise ZeroplanError("finetune.modules_to_save", "is modelled under DDP only (allowed: --strategies ddp, one GPU "
                            "or several, no device map)")
    if not optimizer_elementwise:
        raise ZeroplanError("finetune.modules_to_save", "is modelled with element-wise optimizers only (allowed: "
                            "adamw, adam, sgd, sgd-momentum, lion)")
    if paged_optimizer:
        raise ZeroplanError("finetune.modules_to_save", "with a paged optimizer is not modelled (allowed: "
                            "without --paged-optimizer)")
    if fp16_mixed and finetune.base_dtype is not BaseDtype.fp32:
        # torch 2.13 amp/grad_scaler.py _unscale_grads_ (allow_fp16=False) raises "Attempting to
        # unscale FP16 gradients" for the 16-bit copy's gradients under the Trainer's fp16.
        raise ZeroplanError("finetune.modules_to_save", "under fp16-mixed the Trainer's GradScaler refuses a 16-bit "
                            "copy's gradients (allowed: bf16-mixed, bf16-pure or fp32, or --base-dtype fp32)")
