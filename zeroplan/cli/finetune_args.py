"""The fine-tuning flags of a request (--lora-rank, --quantize, --freeze-embeddings, ...) and the
FineTuneSpec they describe, a config.json's quantization_config included."""

from __future__ import annotations

import argparse
from enum import Enum
from pathlib import Path

from zeroplan.cli.parser import choices_of, positive_float, positive_int
from zeroplan.errors import ZeroplanError
from zeroplan.specs.finetune import BaseDtype, FineTuneSpec, LoraTarget, Quantization, SavedModule


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (allowed: 0 <= p < 1)") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is outside 0 <= p < 1")
    return value


def _names(text: str, kind: type[Enum], noun: str, empty_allowed: bool) -> tuple:
    """Comma-separated values of ``kind``; an unknown one (or none, unless ``empty_allowed``) is refused."""
    allowed = choices_of(kind)
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names and not empty_allowed:
        raise argparse.ArgumentTypeError(f"names no {noun} (allowed: {', '.join(allowed)})")
    for name in names:
        if name not in allowed:
            raise argparse.ArgumentTypeError(f"unknown {noun} {name!r} (allowed: {', '.join(allowed)})")
    return tuple(kind(name) for name in names)


def _targets(text: str) -> tuple[LoraTarget, ...]:
    return _names(text, LoraTarget, "layer", empty_allowed=True)


def _saved_modules(text: str) -> tuple[SavedModule, ...]:
    return _names(text, SavedModule, "module", empty_allowed=False)


def add_finetune_arguments(group: argparse._ArgumentGroup) -> None:
    """The fine-tuning flags, into --help's "fine-tuning" group."""
    group.add_argument("--lora-rank", type=positive_int, metavar="R",
                       help="train LoRA adapters of rank R over a frozen base (default: a full fine-tune)")
    group.add_argument("--lora-alpha", type=positive_float, metavar="A", help="LoRA alpha (changes no byte; default 2R)")
    group.add_argument("--lora-targets", type=_targets, metavar="LAYERS",
                       help="comma-separated layers the adapters wrap, of q,k,v,o,gate,up,down,output "
                            "(default: the framework's; torchtune q,v,o,gate,up,down; hf (PEFT) and litgpt q,v; zeroplan all seven of a block); "
                            "under hf a model's fused module (Qwen-1, GPT-2, BLOOM, Falcon c_attn or query_key_value; Phi-3 "
                            "qkv_proj, gate_up_proj) takes one adapter: name all its layers (q,k,v; gate,up) or none")
    group.add_argument("--lora-dropout", type=_fraction, default=0.0, metavar="P",
                       help="dropout on each adapter's input (default 0: no mask or copy is kept)")
    group.add_argument("--lora-modules-to-save", type=_saved_modules, metavar="MODULES",
                       help="comma-separated modules of embed,head that PEFT (hf) trains whole beside the adapters "
                            "(LoraConfig modules_to_save: a trainable copy beside each frozen original; default none)")
    group.add_argument("--dora", action="store_true",
                       help="weight-decomposed LoRA (DoRA: peft use_dora, torchtune use_dora): a trainable magnitude per "
                            "output row, and the weight norm recomputed in every forward")
    group.add_argument("--vera", action="store_true",
                       help="hf (PEFT) VeRA in place of LoRA (VeraConfig r = --lora-rank): one frozen random vera_A and "
                            "vera_B shared by every wrapped linear, trainable vectors lambda_d (r) and lambda_b (out); "
                            "DDP, bf16-pure or fp32, no recomputation")
    group.add_argument("--lora-fa", action="store_true",
                       help="hf (PEFT) LoRA-FA: create_lorafa_optimizer freezes every lora_A and steps each lora_B with "
                            "its projected AdamW (with --optimizer adamw --optimizer-loop for-loop); DDP, bf16-pure or "
                            "fp32, no recomputation")
    group.add_argument("--base-dtype", choices=choices_of(BaseDtype),
                       help="dtype the LoRA base is loaded in (default bf16, as torch_dtype=torch.bfloat16 or TRL's "
                            "'auto'; fp32 is transformers' from_pretrained default, cast per matmul by the Trainer's autocast)")
    group.add_argument("--quantize", choices=choices_of(Quantization),
                       help="store the frozen base linears quantized (QLoRA: nf4; int8: bitsandbytes' LLM.int8, "
                            "load_in_8bit; gptq-int4: a GPTQ checkpoint under auto-gptq's QuantLinear; default none, "
                            "or what the config.json's quantization_config says)")
    group.add_argument("--quant-block-size", type=positive_int, metavar="N", help="elements per nf4 scale (default 64)")
    group.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=None,
                       help="quantize the nf4 scales to 8 bits (default on, or the config's bnb_4bit_use_double_quant)")
    group.add_argument("--gptq-group-size", type=positive_int, metavar="N",
                       help="input rows per scale and zero point of a gptq-int4 base (default 128, Qwen's Int4 "
                            "checkpoints)")
    group.add_argument("--bitsandbytes-version", metavar="V",
                       help="the bitsandbytes release an nf4 base runs on (default 0.50.2; before 0.43.2 each 4-bit "
                            "matmul keeps its input for backward)")
    group.add_argument("--peft-version", metavar="V",
                       help="hf: the peft release the LoRA runs on (default 0.20.0; 0.4 to 0.20): before 0.7.0 and from "
                            "0.12.0 the adapters are fp32 over a bf16 base, 0.7.0 to 0.11.1 in the base's dtype")
    group.add_argument("--kbit-fp32-cast", action=argparse.BooleanOptionalAction, default=None,
                       help="hf, quantized base: peft's prepare_model_for_kbit_training casts the embeddings, head and "
                            "norms to fp32 (default on, transformers' QLoRA recipe; --no-kbit-fp32-cast: they stay as "
                            "loaded, as ms-swift 1.x runs QLoRA)")
    group.add_argument("--freeze-embeddings", action="store_true", help="full fine-tune with the embedding (and an untied head) frozen")
    group.add_argument("--frozen-blocks", type=positive_int, metavar="K", help="full fine-tune with the first K blocks frozen")


def finetune_from_args(args: argparse.Namespace) -> FineTuneSpec:
    """The FineTuneSpec the flags describe; a config.json with a quantization_config supplies
    the quantization the flags leave unset (a quantized base without --lora-rank is refused)."""
    fields: dict = {}
    model_path = Path(args.model)
    if model_path.suffix == ".json" and model_path.is_file():
        from zeroplan.presets.hf_config import read_config_quantization

        from_config = read_config_quantization(model_path)
        if from_config:
            fields.update(from_config)
            if not getattr(args, "lora_rank", None):
                raise ZeroplanError("lora_rank", f"{args.model} holds {from_config['quantize']} weights, which only adapters "
                                    "can train over: give --lora-rank R")
    if getattr(args, "lora_rank", None):
        fields["lora_rank"] = args.lora_rank
    optional = {"lora_alpha": "lora_alpha", "lora_targets": "lora_targets", "quant_block_size": "quant_block_size",
                "double_quant": "double_quant", "base_dtype": "base_dtype",
                "bitsandbytes_version": "bitsandbytes_version", "kbit_fp32_cast": "kbit_fp32_cast",
                "peft_version": "peft_version",
                "gptq_group_size": "gptq_group_size",
                "modules_to_save": "lora_modules_to_save"}
    for field, flag in optional.items():
        value = getattr(args, flag, None)
        if value is not None:
            fields[field] = value
    if getattr(args, "quantize", None) is not None:
        fields["quantize"] = args.quantize
    if getattr(args, "lora_dropout", 0.0):
        fields["lora_dropout"] = args.lora_dropout
    if getattr(args, "dora", False):
        fields["dora"] = True
    if getattr(args, "vera", False):
        fields["vera"] = True
    if getattr(args, "lora_fa", False):
        fields["lora_fa"] = True
    if Quantization(fields.get("quantize", Quantization.none)) is not Quantization.nf4:
        # The spec cannot tell 64 typed from its default: a flag typed for an nf4 base that is
        # not there is refused whatever its value.
        for field, flag in (("quant_block_size", "--quant-block-size"), ("double_quant", "--double-quant"),
                            ("bitsandbytes_version", "--bitsandbytes-version")):
            if getattr(args, field, None) is not None:
                raise ZeroplanError(flag, "applies to an nf4 base only (allowed: with --quantize nf4, or a config.json "
                                          "whose quantization_config is nf4)")
    fields["freeze_embeddings"] = getattr(args, "freeze_embeddings", False)
    fields["frozen_blocks"] = getattr(args, "frozen_blocks", None) or 0
    return FineTuneSpec(**fields)
