"""What DeepSpeed-Chat's own RewardModel saves for backward at its head, against the planner's
terms for the same shape (zeroplan.core.reward_model).

DeepSpeed-Chat's utils/model/reward_model.py is loaded from a path (it is not vendored here), e.g.

    git -C DeepSpeedExamples show 3a77097a7b6ce67b78ea7c05129b90915cfebbb0:applications/DeepSpeed-Chat/training/utils/model/reward_model.py > /tmp/reward_model.py
    python benchmarks/reward_model_head.py /tmp/reward_model.py

(writes benchmarks/reward-model-head-records.json, which tests/test_reward_model.py reads).

It wraps a small OPTModel (the bare decoder AutoModel gives; hidden 64, 4 heads, 2 blocks,
vocabulary 128) in fp16 on the CPU, as create_critic_model does, and runs one training forward
and backward on pairs of rows (SHAPES) whose chosen and rejected ids differ from position 1 and carry no
padding: the loss then spans s - 1 positions a pair, the most reward_model.py:84-97 lets it.
Saved-tensor hooks record every storage autograd keeps from the v_head's forward on (the head),
parameters left out; the v_head's input is the decoder's output, counted with the activations as
a causal LM's lm_head input is, and is reported apart. Prints JSON: the measured bytes and the
planner's for the same request.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

import torch  # noqa: E402

HIDDEN, HEADS, FFN, LAYERS, VOCAB, PAD = 64, 4, 256, 2, 128, 1
SHAPES = ((1, 16), (2, 32), (4, 64))
"""(pairs, sequence length) measured."""
RECORDS = ROOT / "benchmarks" / "reward-model-head-records.json"


def load_reward_model(path: str):
    spec = importlib.util.spec_from_file_location("dschat_reward_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RewardModel


def measure(path: str, PAIRS: int, SEQ: int) -> dict[str, int]:
    from transformers import OPTConfig, OPTModel

    torch.manual_seed(0)
    config = OPTConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_dim=FFN, num_hidden_layers=LAYERS,
                       vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=HIDDEN, dropout=0.0,
                       attention_dropout=0.0, do_layer_norm_before=True, pad_token_id=PAD)
    config._attn_implementation = "eager"

    class Tokenizer:
        pad_token_id = PAD

    model = load_reward_model(path)(OPTModel(config), Tokenizer(), num_padding_at_beginning=1).half().train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    in_head, head_input = [False], [0]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        pointer = t.untyped_storage().data_ptr()
        if in_head[0] and pointer not in params and pointer != head_input[0]:
            saved.setdefault(pointer, t.untyped_storage().nbytes())
        return t

    def enter_head(module, args):
        in_head[0], head_input[0] = True, args[0].untyped_storage().data_ptr()

    model.v_head.register_forward_pre_hook(enter_head)
    chosen = torch.randint(3, VOCAB, (PAIRS, SEQ))
    rejected = chosen.clone()
    rejected[:, 1:] = (chosen[:, 1:] + 1 - 3) % (VOCAB - 3) + 3  # differs from position 1, never the pad id
    ids = torch.cat([chosen, rejected])
    outputs_shape = []
    model.v_head.register_forward_hook(lambda module, args, out: outputs_shape.append(tuple(out.shape)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    out["loss"].backward()
    return {"pairs": PAIRS, "seq_len": SEQ, "v_head_output_elements": int(torch.Size(outputs_shape[0]).numel()),
            "head_saved_bytes": sum(saved.values())}


def planned(PAIRS: int, SEQ: int) -> dict[str, int]:
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.reward_model import reward_forward_tensors
    from zeroplan.specs.strategy import StrategyKind

    # The head's terms read the micro-batch, the length and the precision alone: any hf decoder.
    args = build_parser().parse_args([
        "fit", str(ROOT / "tests" / "fixtures" / "hf" / "opt-1.3b.json"), "--gpus", "1", "--micro-batch", str(2 * PAIRS),
        "--seq-len", str(SEQ), "--precision", "fp16-mixed", "--framework", "hf", "--objective", "reward"])
    request = request_from_args(args, StrategyKind.zero2)
    rewards, sigmoids, _, _ = reward_forward_tensors(request)
    return {"pairs": PAIRS, "seq_len": SEQ, "v_head_output_elements": rewards // 2, "head_saved_bytes": sigmoids}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    records = [measure(sys.argv[1], pairs, seq) for pairs, seq in SHAPES]
    RECORDS.write_text(json.dumps(records, indent=1) + "\n")
    for record in records:
        plan = planned(record["pairs"], record["seq_len"])
        print(json.dumps({"measured": record, "planned": plan, "agree": record == plan}))
