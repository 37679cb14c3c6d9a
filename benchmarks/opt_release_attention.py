"""What transformers' own OPTForCausalLM saves for backward, by block and at the loss, against
the planner's terms for the same shapes (zeroplan.core.transformers_release.OPT_OWN_FORWARD_UNTIL).

A small OPT (hidden 64, 4 heads, ffn 256, 2 blocks, vocabulary 128, dropout 0.1, attention dropout
0) runs one training forward in fp16 on the CPU, eager attention, a causal mask, labels given;
saved-tensor hooks record every tensor autograd keeps (parameters left out), by storage, and
whether it was saved inside a decoder layer. The planner is asked for the same model at the
release that is importable: the installed one (4.56.2, the profile's own) or an older one put on
PYTHONPATH, e.g. a wheel unpacked from `pip download --no-deps transformers==4.28.1` (4.28.1 checks
tokenizers<0.14 at import: set dependency_versions_check.py's pkgs_to_check_at_runtime to []; the
modelling code is the release's own). Usage:

    python benchmarks/opt_release_attention.py
    PYTHONPATH=/path/to/transformers-4.28.1 python benchmarks/opt_release_attention.py --release 4.31.0
    python benchmarks/opt_release_attention.py --opt-350m

(--opt-350m: OPT-350m's layout, post-norm blocks without a final norm (do_layer_norm_before False)
and an embedding half the blocks' width joined by project_in / project_out (word_embed_proj_dim
32); the blocks then save what the pre-norm blocks do, byte for byte, and the tensors outside them
move as ModelSpec.embedding_projection and final_norm say.)

(--release: the release the planner is asked for; 4.31.0 is the oldest modelled, whose OPT runs
4.28.1's ops: zeroplan/core/transformers_release.py.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

import torch  # noqa: E402

HIDDEN, HEADS, FFN, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 256, 2, 128, 32, 2
CONFIG = {
    "model_type": "opt", "hidden_size": HIDDEN, "num_attention_heads": HEADS, "ffn_dim": FFN,
    "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 64, "word_embed_proj_dim": HIDDEN,
    "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0, "layerdrop": 0.0,
    "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True, "pad_token_id": 1,
    "layer_norm_elementwise_affine": True, "_remove_final_layer_norm": False, "tie_word_embeddings": True,
}


def measure() -> tuple[str, int, int]:
    """(the release, bytes saved inside the decoder layers, bytes saved outside them)."""
    import transformers
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    config._attn_implementation = "eager"
    model = OPTForCausalLM(config).half().train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = [0]
    saved: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in saved:
            saved[storage.data_ptr()] = (storage.nbytes(), inside[0] > 0)
        return t

    for layer in model.model.decoder.layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + 1))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] - 1))
    ids = torch.randint(2, VOCAB, (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    blocks = sum(n for n, layer in saved.values() if layer)
    outside = sum(n for n, layer in saved.values() if not layer)
    return transformers.__version__, blocks, outside


def opt_350m_layout() -> None:
    """CONFIG as OPT-350m's layout (--opt-350m)."""
    CONFIG.update(do_layer_norm_before=False, word_embed_proj_dim=HIDDEN // 2)


def planned(release: str | None) -> tuple[int, int, int]:
    """(the planner's bytes saved by all blocks, by the loss, outside the blocks) for the measured model."""
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.activations import layer_bytes, outside_layers_bytes, saved_logits_bytes
    from zeroplan.core.frameworks import eager_attention_extra_bytes
    from zeroplan.core.transformers_release import opt_loss_tensors, runs_opt_own_forward
    from zeroplan.specs.strategy import StrategyKind

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(CONFIG))
        argv = ["fit", str(path), "--gpus", "1", "--micro-batch", str(BATCH), "--seq-len", str(SEQ),
                "--precision", "fp16-mixed", "--framework", "hf", "--attention", "eager"]
        if release:
            argv += ["--transformers-version", release]
        request = request_from_args(build_parser().parse_args(argv), StrategyKind.ddp)
    model, training = request.model, request.training
    block = layer_bytes(model, training, SEQ, BATCH) + eager_attention_extra_bytes(request)
    loss = (opt_loss_tensors(model, training, SEQ, BATCH)[1][0] if runs_opt_own_forward(model, training)
            else saved_logits_bytes(model, SEQ, BATCH))
    return LAYERS * block, loss, outside_layers_bytes(model, training, SEQ, BATCH)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", help="the transformers release the planner is asked for (default: its own)")
    parser.add_argument("--opt-350m", action="store_true", help="OPT-350m's layout: post-norm blocks, no final norm, "
                                                                  "project_in/project_out around a narrower embedding")
    args = parser.parse_args()
    if args.opt_350m:
        opt_350m_layout()
    version, blocks, outside = measure()
    planned_blocks, planned_loss, planned_outside = planned(args.release)
    scores = LAYERS * BATCH * HEADS * SEQ * SEQ
    print(f"transformers {version} (planned as {args.release or 'the profile default'}), OPT h {HIDDEN}, "
          f"{HEADS} heads, {LAYERS} blocks, b {BATCH} x s {SEQ}, fp16, eager"
          + (", OPT-350m's layout" if args.opt_350m else ""))
    print(f"  blocks: measured {blocks:,} B, planned {planned_blocks:,} B ({blocks / scores:.3f} and "
          f"{planned_blocks / scores:.3f} bytes a score)")
    print(f"  outside the blocks (embeddings, final norm, head input, loss): measured {outside:,} B; "
          f"the loss's log-softmax planned {planned_loss:,} B, the rest {planned_outside:,} B "
          f"(zeroplan.core.activations.outside_layers_bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
