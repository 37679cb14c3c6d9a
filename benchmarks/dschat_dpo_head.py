"""What DeepSpeed-Chat's DPO step keeps at its head and holds in its loop, against the planner's
terms for the same shape (zeroplan.core.dschat_dpo).

DeepSpeed-Chat's step2_dpo_finetuning/main.py is read from a path (not vendored here); only its
get_batch_logps function is executed (main.py imports deepspeed at module level), e.g.

    git -C DeepSpeedExamples show 1842b4fddfcfaedffbb697f53ffe3a57aea718c4:applications/DeepSpeed-Chat/training/step2_dpo_finetuning/main.py > /tmp/dpo_main.py
    python benchmarks/dschat_dpo_head.py /tmp/dpo_main.py

(writes benchmarks/dschat-dpo-head-records.json, which tests/test_dschat_dpo.py reads). A small
OPTForCausalLM in fp16 on the CPU (hidden 64, 4 heads, 2 blocks, vocabulary 128, eager attention)
stands for the policy and a second one for the reference; one step as main.py:472-494 runs it:
the policy's forward with use_cache=False, the reference's under no_grad with the config's
use_cache, get_batch_logps on both, the DPO loss, backward. Recorded: the bytes autograd saves
inside get_batch_logps on the policy's logits (parameters and the logits themselves left out:
the logits are the model's output, held by the loop), and the bytes of what the loop's two names
hold (the logits of each, the reference's past_key_values).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

import torch  # noqa: E402

HIDDEN, HEADS, FFN, LAYERS, VOCAB, PAD = 64, 4, 256, 2, 128, 1
SHAPES = ((1, 16), (2, 32))
"""(pairs, sequence length) measured."""
RECORDS = ROOT / "benchmarks" / "dschat-dpo-head-records.json"


def load_get_batch_logps(path: str):
    """main.py's own get_batch_logps, executed alone."""
    tree = ast.parse(Path(path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_batch_logps")
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace["get_batch_logps"]


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().nbytes()
    if hasattr(value, "layers"):  # transformers' Cache classes (4.56.2): each layer's keys and values
        return sum(_tensor_bytes(layer.keys) + _tensor_bytes(layer.values) for layer in value.layers)
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def measure(path: str, pairs: int, seq: int) -> dict[str, int]:
    from transformers import OPTConfig, OPTForCausalLM

    get_batch_logps = load_get_batch_logps(path)
    torch.manual_seed(0)
    config = OPTConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_dim=FFN, num_hidden_layers=LAYERS,
                       vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=HIDDEN, dropout=0.0,
                       attention_dropout=0.0, do_layer_norm_before=True, pad_token_id=PAD, use_cache=True)
    config._attn_implementation = "eager"
    model = OPTForCausalLM(config).half().train()
    ref_model = OPTForCausalLM(config).half().eval()
    chosen = torch.randint(3, VOCAB, (pairs, seq))
    rejected = chosen.clone()
    rejected[:, 1:] = (chosen[:, 1:] + 1 - 3) % (VOCAB - 3) + 3
    batch = {"input_ids": torch.cat([chosen, rejected])}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    label_mask = (batch["input_ids"] != PAD).int()
    outputs = model(**batch, use_cache=False)
    with torch.no_grad():
        ref_outputs = ref_model(**batch)
    held = {outputs.logits.untyped_storage().data_ptr()}
    held |= {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        pointer = t.untyped_storage().data_ptr()
        if pointer not in held:
            saved.setdefault(pointer, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logps = get_batch_logps(outputs.logits, batch["input_ids"], label_mask)
    ref_logps = get_batch_logps(ref_outputs.logits, batch["input_ids"], label_mask)
    logits = 0.1 * ((logps[:pairs] - ref_logps[:pairs]) - (logps[pairs:] - ref_logps[pairs:]))
    (-torch.nn.functional.logsigmoid(logits)).mean(0).backward()
    log_softmax = max(saved.values())  # beside it get_batch_logps saves the int64 labels' index
    return {"pairs": pairs, "seq_len": seq, "policy_log_softmax_bytes": log_softmax,
            "policy_logits_bytes": _tensor_bytes(outputs.logits), "reference_logits_bytes": _tensor_bytes(ref_outputs.logits),
            "reference_cache_bytes": _tensor_bytes(ref_outputs.past_key_values)}


def planned(pairs: int, seq: int) -> dict[str, int]:
    import tempfile

    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.dschat_dpo import dschat_dpo_logits_tensors, held_outputs_tensors
    from zeroplan.specs.strategy import StrategyKind

    config = {"model_type": "opt", "hidden_size": HIDDEN, "num_attention_heads": HEADS, "ffn_dim": FFN,
              "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 64, "word_embed_proj_dim": HIDDEN,
              "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "layerdrop": 0.0,
              "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True, "pad_token_id": PAD}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config))
        args = build_parser().parse_args([
            "fit", str(path), "--gpus", "1", "--micro-batch", str(2 * pairs), "--seq-len", str(seq), "--precision",
            "fp16-mixed", "--framework", "hf", "--objective", "dpo", "--state-convention", "deepspeed"])
        request = request_from_args(args, StrategyKind.ddp)
    held = held_outputs_tensors(request)
    return {"pairs": pairs, "seq_len": seq, "policy_log_softmax_bytes": dschat_dpo_logits_tensors(request)[0][0],
            "policy_logits_bytes": held[0], "reference_logits_bytes": held[1], "reference_cache_bytes": sum(held[2:])}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    records = [measure(sys.argv[1], pairs, seq) for pairs, seq in SHAPES]
    RECORDS.write_text(json.dumps(records, indent=1) + "\n")
    for record in records:
        plan = planned(record["pairs"], record["seq_len"])
        print(json.dumps({"measured": record, "planned": plan, "agree": record == plan}))
