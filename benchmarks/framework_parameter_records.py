"""Count the parameters the frameworks' own LoRA/QLoRA builders make and write the records the
planner's model-state terms are checked against.

    python benchmarks/framework_parameter_records.py [OUT_DIR [GROUP ...]]
        (default benchmarks/framework-parameter-records; GROUP meta (RUNS, on the meta device),
        bnb (BNB_RUNS, hf QLoRA on real CPU tensors) or int8 (INT8_RUNS, hf LoRA over
        bitsandbytes' LLM.int8 base, real CPU tensors); default all three)

Each run (zeroplan.frameworks.parameters.measure_parameters) builds two full-width blocks, the
embedding, the final norm and the LM head on the meta device (torchao's NF4 quantization of a
meta weight makes meta inner tensors of the real sizes), and records their bytes, trainable and
frozen, by dtype. Needs torch and the frameworks (scripts/install-frameworks); a few seconds a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.parameters import measure_parameters
from zeroplan.presets.models import get_model
from zeroplan.specs import StrategyKind, TrainingSpec

DEFAULT_OUT = Path(__file__).resolve().parent / "framework-parameter-records"

ALL_LINEARS = ["q", "k", "v", "o", "gate", "up", "down"]
# (model, framework, strategy, precision, finetune): torchtune's 8B_lora / 8B_qlora_single_device
# (r 8) and 70B_lora / 405B_qlora's r 16, in its bf16; PEFT r 16 over a base loaded in fp32 and in
# bf16 (DDP with autocast; accelerate's FSDP2 upcasts the whole module, base and adapters, to fp32,
# so under FSDP its bytes are the fp32 ones).
RUNS = [
    ("llama-3.1-8b", "torchtune", "fsdp-full-shard", "bf16-pure", {"lora_rank": 8}),
    ("llama-3.1-8b", "torchtune", "fsdp-full-shard", "bf16-pure", {"lora_rank": 8, "quantize": "nf4"}),
    ("llama-3.1-70b", "torchtune", "fsdp-full-shard", "bf16-pure", {"lora_rank": 16}),
    ("llama-3.1-70b", "torchtune", "fsdp-full-shard", "bf16-pure", {"lora_rank": 16, "quantize": "nf4"}),
] + [
    ("llama-3.1-8b", "hf", "ddp", "bf16-mixed", {**finetune, "base_dtype": base})
    for base in ("fp32", "bf16") for finetune in ({"lora_rank": 16, "lora_targets": ALL_LINEARS}, {"lora_rank": 16})
] + [
    # DoRA: torchtune's DoRALinear (r 8, its 8B_lora targets) and PEFT's use_dora (r 16, every linear).
    ("llama-3.1-8b", "torchtune", "fsdp-full-shard", "bf16-pure", {"lora_rank": 8, "dora": True}),
] + [
    ("llama-3.1-8b", "hf", "ddp", "bf16-mixed", {"lora_rank": 16, "lora_targets": ALL_LINEARS, "dora": True, "base_dtype": base})
    for base in ("bf16", "fp32")
]
# hf QLoRA with bitsandbytes (zeroplan.frameworks.lora.hf_bnb_qlora_llama): built on real CPU
# tensors, quantized by bitsandbytes (about 30 s for 8B, a few minutes and ~15 GB of memory for 70B).
BNB_RUNS = [
    (model, "hf", "ddp", "bf16-mixed", {"lora_rank": 16, "quantize": "nf4", **finetune})
    for model in ("llama-3.1-8b", "llama-3.1-70b") for finetune in ({"lora_targets": ALL_LINEARS}, {})
] + [("llama-3.1-8b", "hf", "ddp", "bf16-mixed", {"lora_rank": 16, "quantize": "nf4", "lora_targets": ALL_LINEARS,
                                                  "double_quant": False})]
# hf LoRA over an LLM.int8 base (BitsAndBytesConfig(load_in_8bit=True): bitsandbytes Linear8bitLt),
# built as BNB_RUNS are (real CPU tensors; Int8Params quantizes on its move to a device too).
INT8_RUNS = [("llama-3.1-8b", "hf", "ddp", "bf16-mixed", {"lora_rank": 16, "quantize": "int8", **finetune})
             for finetune in ({"lora_targets": ALL_LINEARS}, {})]
GROUPS = {"meta": RUNS, "bnb": BNB_RUNS, "int8": INT8_RUNS}


def main(out: Path = DEFAULT_OUT, groups: list[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, framework, strategy, precision, finetune in [run for g in groups or list(GROUPS) for run in GROUPS[g]]:
        training = TrainingSpec(framework=framework, precision=precision, finetune=finetune)
        record = measure_parameters(get_model(model_name), StrategyKind(strategy), training)
        write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
        block = record.blocks[0]
        print(f"{record.name:72s} block trainable {block.trainable} frozen {block.frozen} "
              f"({record.wall_time_s:.1f} s)", flush=True)


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__)
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT, sys.argv[2:] or None)
