"""What peft's own LoRA holds over a bf16 base without autocast, by release, on the CPU: the
adapters' dtype, what the q and v adapters of one block save for backward in a training forward,
and the bytes of the parameters, gradients and AdamW states after one step (torch.optim.AdamW,
foreach, as the MetaMathQA loop steps). One JSON record per peft release, read by
tests/test_peft_adapter_dtype.py against zeroplan.core.finetune.adapter_dtype.

    python benchmarks/peft_adapter_dtype_records.py [--peft-src DIR]

--peft-src: the ``src`` folder of a peft source tree (a release's tag checked out), put first on
the import path; without it the installed peft runs. Records go to
benchmarks/peft-adapter-dtype-records/peft-<version>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "peft-adapter-dtype-records"
RANK = 8
SEQ, BATCH = 16, 2
TARGET_MODULES = ("q_proj", "v_proj")
CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              vocab_size=128, max_position_embeddings=64)


def adapter_saved_bytes(model, block: int) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the distinct tensors (parameters and buffers left out) that the wrapped q_proj and
    v_proj of one block save for backward in a training forward."""
    import torch

    inside = [False]
    saved: dict[int, int] = {}
    held = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    hooks = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if str(block) in parts and parts[-1] in TARGET_MODULES:
            hooks.append(module.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
            hooks.append(module.register_forward_hook(lambda *_: inside.__setitem__(0, False)))

    def pack(tensor):  # type: ignore[no-untyped-def]
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids).logits.float().sum()
    for hook in hooks:
        hook.remove()
    return sum(saved.values())


def measure() -> dict:
    """The record of the peft that ``import peft`` finds."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                                                       target_modules=list(TARGET_MODULES)))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in trainable})
    saved = [adapter_saved_bytes(model, block) for block in range(CONFIG["num_hidden_layers"])]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1, foreach=True)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    gradient_bytes = sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    optimizer.step()
    state_bytes = sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
                      if isinstance(v, torch.Tensor))
    return {
        "peft_version": peft.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "config": CONFIG, "rank": RANK, "target_modules": list(TARGET_MODULES), "seq_len": SEQ, "micro_batch": BATCH,
        "base_dtype": "bfloat16", "autocast": False,
        "adapter_dtypes": dtypes,
        "adapter_element_bytes": trainable[0].element_size(),
        "trainable_elements": sum(p.numel() for p in trainable),
        "adapter_saved_bytes_per_block": saved,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "gradient_bytes": gradient_bytes,
        "optimizer_state_bytes": state_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peft-src", type=Path, help="a peft source tree's src folder (default: the installed peft)")
    args = parser.parse_args()
    if args.peft_src:
        sys.path.insert(0, str(args.peft_src.resolve()))
    record = measure()
    OUT.mkdir(exist_ok=True)
    version = record["peft_version"].split(".dev")[0]
    path = OUT / f"peft-{version}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(path.name, json.dumps({k: record[k] for k in ("adapter_dtypes", "adapter_saved_bytes_per_block",
                                                         "gradient_bytes", "optimizer_state_bytes")}))


if __name__ == "__main__":
    main()
