"""Record accelerate's own device maps: transformers' from_pretrained(device_map=...) split of a
model over its GPUs, as transformers 4.56.2 modeling_utils.py _get_device_map computes it (the
balanced caps of accelerate's get_balanced_memory, or each GPU's free memory for "sequential",
bitsandbytes' 4-bit target dtype and 90 % caps), run on meta-device models built from each
config.json with accelerate's init_empty_weights. zeroplan.core.parallel.device_map replays the
same rule; tests/test_device_map.py compares its split with these records.

Free memory per GPU is given (the planner's capacity less the CUDA context), as get_max_memory
would read it from torch.cuda.mem_get_info on a fresh process.

    python benchmarks/device_map_records.py   # writes benchmarks/device-map-records/splits.json
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from pathlib import Path

import accelerate
import torch
import transformers
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config
from transformers.modeling_utils import _get_device_map

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "device-map-records" / "splits.json"
GIB = 1 << 30
CONTEXT = 512 << 20
"""zeroplan's CUDA context (ClusterSpec.cuda_context_bytes)."""

# (zeroplan model, config source) per case: a config.json the planner parses too, or qwen-72b's
# preset shapes (zeroplan/presets/models.py) as a Qwen2Config.
MODELS = {
    "qwen2.5-7b": "tests/fixtures/hf/qwen2.5-7b.json",
    "llama-3.2-1b": "benchmarks/published_memory/configs/llama-3.2-1b.json",
    "yi-34b": "tests/fixtures/hf/yi-34b.json",
    "qwen3-8b": "tests/fixtures/hf/qwen3-8b.json",
    "qwen-72b": None,
}
CASES = [
    # model, mode, gpus, GPU memory GiB, quantize
    ("qwen-72b", "balanced", 2, 80, "none"),
    ("qwen-72b", "balanced", 4, 80, "none"),
    ("qwen-72b", "sequential", 2, 80, "none"),
    ("qwen-72b", "balanced", 2, 40, "nf4"),
    ("qwen2.5-7b", "balanced", 2, 24, "none"),
    ("qwen2.5-7b", "balanced", 3, 24, "none"),
    ("qwen2.5-7b", "sequential", 2, 16, "none"),
    ("qwen2.5-7b", "balanced", 4, 24, "nf4"),
    ("llama-3.2-1b", "balanced", 2, 24, "none"),
    ("llama-3.2-1b", "balanced", 8, 24, "none"),
    ("yi-34b", "balanced", 2, 80, "none"),
    ("yi-34b", "balanced", 8, 80, "none"),
    ("qwen3-8b", "balanced", 2, 24, "none"),
]


def _config(model: str):
    path = MODELS[model]
    if path is None:
        return Qwen2Config(hidden_size=8192, intermediate_size=24576, num_hidden_layers=80, num_attention_heads=64,
                           num_key_value_heads=64, vocab_size=152064, tie_word_embeddings=False,
                           max_position_embeddings=32768)
    return AutoConfig.for_model(**json.loads((ROOT / path).read_text()))


class _Bnb4Quantizer:
    """What _get_device_map reads of transformers' Bnb4BitHfQuantizer (quantizers/
    quantizer_bnb_4bit.py, which needs bitsandbytes installed): get_special_dtypes_update keeps
    modules_to_not_convert (the output projection, integrations/bitsandbytes.py
    get_keys_to_not_convert) in the load dtype, adjust_target_dtype answers CustomDtype.INT4,
    adjust_max_memory takes 90 %."""

    def get_special_dtypes_update(self, model, dtype):
        return {name: dtype for name, _ in model.named_parameters() if name.startswith("lm_head")}

    def adjust_target_dtype(self, dtype):
        return accelerate.utils.CustomDtype.INT4

    def adjust_max_memory(self, max_memory):
        return {key: value * 0.90 for key, value in max_memory.items()}

    def validate_environment(self, *args, **kwargs):
        return None


@contextlib.contextmanager
def _cuda_device_names():
    """get_balanced_memory counts the GPUs with torch.device(i).type == "cuda" (accelerate 1.10.1
    utils/modeling.py:991), which a torch without a GPU refuses to build; for the length of the
    call an integer names cuda:i, as it does on a machine with GPUs. Nothing else changes."""
    device = torch.device

    def named(spec, *rest):
        return device("cuda", spec) if isinstance(spec, int) and not rest else device(spec, *rest)

    torch.device = named
    try:
        yield
    finally:
        torch.device = device


def record(model: str, mode: str, gpus: int, memory_gib: int, quantize: str) -> dict:
    config = _config(model)
    with init_empty_weights():
        module = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    module.tie_weights()
    free = memory_gib * GIB - CONTEXT
    quantizer = _Bnb4Quantizer() if quantize == "nf4" else None
    with warnings.catch_warnings(), _cuda_device_names():
        warnings.simplefilter("ignore")
        device_map = _get_device_map(module, mode, {i: free for i in range(gpus)}, quantizer, torch.bfloat16, None)
    layers = config.num_hidden_layers
    placed = dict(device_map)

    def device_of(name: str):
        # clean_device_map merges a module whose children share a GPU into it ("" = the model).
        while name not in placed:
            if name == "":
                return None
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return placed[name]

    blocks = [device_of(f"model.layers.{i}") for i in range(layers)]
    return {
        "model": model, "device_map": mode, "gpus": gpus, "gpu_memory_gib": memory_gib, "quantize": quantize,
        "blocks_per_gpu": [blocks.count(d) for d in range(gpus)],
        "embedding_gpu": device_of("model.embed_tokens"), "head_gpu": device_of("lm_head"),
        "norm_gpu": device_of("model.norm"), "device_map_entries": {k: v for k, v in device_map.items()},
    }


def main() -> int:
    records = [record(*case) for case in CASES]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"accelerate": accelerate.__version__, "transformers": transformers.__version__,
                               "torch": torch.__version__, "cuda_context_bytes": CONTEXT, "records": records},
                              indent=1) + "\n")
    for r in records:
        print(f"{r['model']:14s} {r['device_map']:10s} {r['gpus']} x {r['gpu_memory_gib']:3d} GiB {r['quantize']:4s} "
              f"blocks {r['blocks_per_gpu']} embedding {r['embedding_gpu']} head {r['head_gpu']} norm {r['norm_gpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
