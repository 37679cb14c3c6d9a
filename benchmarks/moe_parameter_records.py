"""Parameter counts of mixture-of-experts models, measured from the transformers modeling code.

Each config.json under tests/fixtures/hf/ (written from the published Hugging Face configs;
docs/moe.md names each source) is turned into its transformers model on the meta device (no
memory is allocated, no weights downloaded) and every ``named_parameters()`` entry is counted
and sorted into the planner's categories. The result is
tests/fixtures/moe_parameter_counts.json, against which tests/test_moe.py checks the planner's
counts to the element.

    python benchmarks/moe_parameter_records.py   # rewrites the records (needs torch, transformers)
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from zeroplan.atomic import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
RECORDS = ROOT / "tests" / "fixtures" / "moe_parameter_counts.json"
MODELS = ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "deepseek-v2-lite", "deepseek-v3")

# Categories by the parameter's name in the transformers module tree (4.56 naming): Mixtral's
# block_sparse_moe.{gate,experts}, Qwen-MoE's mlp.{gate,experts,shared_expert,shared_expert_gate},
# DeepSeek's mlp.{gate,experts,shared_experts}; a dense block's MLP is mlp.{gate,up,down}_proj.
_RULES = (
    (r"^model\.embed_tokens\.", "embedding"),
    (r"^lm_head\.", "lm_head"),
    (r"^model\.norm\.", "final_norm"),
    (r"\.self_attn\.", "attention"),
    (r"layernorm\.", "norms"),
    (r"\.(mlp|block_sparse_moe)\.experts\.", "routed_experts"),
    (r"\.mlp\.shared_experts?\.", "shared_experts"),
    (r"\.mlp\.shared_expert_gate\.", "shared_expert_gate"),
    (r"\.(mlp|block_sparse_moe)\.gate\.", "router"),
    (r"\.mlp\.(gate_proj|up_proj|down_proj)\.", "dense_mlp"),
)


def category(name: str) -> str:
    for pattern, label in _RULES:
        if re.search(pattern, name):
            return label
    raise ValueError(f"parameter {name!r} fits no category")


def measure(name: str) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = json.loads((FIXTURES / f"{name}.json").read_text())
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    totals: dict[str, int] = defaultdict(int)
    per_layer: dict[int, int] = defaultdict(int)
    shapes: dict[str, list[int]] = {}
    for param_name, param in model.named_parameters():
        totals[category(param_name)] += param.numel()
        layer = re.match(r"^model\.layers\.(\d+)\.", param_name)
        if layer:
            per_layer[int(layer.group(1))] += param.numel()
            # One layer's attention and router shapes, to check the MLA projections tensor by tensor.
            if layer.group(1) == str(len(model.model.layers) - 1) and not re.search(r"experts\.(?!0\.)\d+\.", param_name):
                shapes[param_name.split(".", 3)[3]] = list(param.shape)
    buffers = {n: b.numel() for n, b in model.named_buffers() if "inv_freq" not in n}
    return {
        "model_type": config_dict["model_type"],
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "architecture": type(model).__name__,
        "total_parameters": sum(p.numel() for p in model.parameters()),
        "by_category": dict(sorted(totals.items())),
        "per_layer": [per_layer[i] for i in range(len(per_layer))],
        "last_layer_shapes": shapes,
        "non_rotary_buffer_elements": sum(buffers.values()),
    }


def measure_torchtitan_16b() -> dict:
    """torchtitan 0.3.0's own DeepSeek "16B" flavour (models/deepseek_v3/__init__.py _16b: the
    DeepSeek-V2-Lite shapes), built on the meta device: every parameter's name and shape, so the
    per-rank shards under its EP + FSDP2 placement (distributed/fsdp.py) can be derived from the
    module it trains, grouped experts (w1_EFD, w2_EDF, w3_EFD) included."""
    import torch
    from torchtitan.models.deepseek_v3 import model_registry

    with torch.device("meta"):
        model = model_registry("16B", attn_backend="flex").model.build()
    return {
        "source": "torchtitan 0.3.0 models/deepseek_v3 model_registry('16B').model.build() on the meta device",
        "total_parameters": sum(p.numel() for p in model.parameters()),
        "shapes": {name: list(param.shape) for name, param in model.named_parameters()},
    }


def main() -> int:
    records = {name: measure(name) for name in MODELS}
    records["torchtitan-deepseek-16b"] = measure_torchtitan_16b()
    write_text_atomic(RECORDS, json.dumps(records, indent=1) + "\n")
    for name, record in records.items():
        print(f"{name:20s} {record['total_parameters']:>16,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
