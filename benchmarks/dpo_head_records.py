"""Run the DPO step of torchtune's LoRA/full DPO recipes over torchtune's own TransformerDecoder
with no blocks (embedding, final norm, output projection) on fake tensors, and write what its
logits and log-probs hold: the part of a DPO step that is not the blocks' activations.

    python benchmarks/dpo_head_records.py [OUT_FILE]   (default benchmarks/dpo-head-records.json)

The step follows torchtune 0.6.1 recipes/lora_dpo_single_device.py train() (lines 535-568, the
same order in full_dpo_distributed.py): concatenated_forward of the policy (chosen and rejected
stacked, 2 x micro-batch rows), get_batch_log_probs, the logits' detached means, ``del`` of the
logits, the reference's concatenated_forward under no_grad, DPOLoss, mean, backward. The reference
here is the same module (the LoRA recipes' disable_adapter runs the same weights; with no blocks
there is no adapter to disable). torch's MemTracker counts every storage made, fake ones included;
parameters and their gradients are left out of the figures (the planner counts them elsewhere).
Nothing here knows the planner's formulas: tests/test_dpo.py puts the two side by side.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from torch import nn

from zeroplan.atomic import write_text_atomic
from zeroplan.presets.models import get_model
from zeroplan.simulate import _torch_private as private

DEFAULT_OUT = Path(__file__).resolve().parent / "dpo-head-records.json"
SHAPES = [("llama-3.1-8b", 1, 1024), ("llama-3.1-8b", 2, 2048), ("qwen2.5-0.5b", 4, 512)]
"""(model, micro-batch of preference pairs, sequence length) of each run."""


class _NoBlock(nn.Module):
    """Stands in for the decoder's blocks (their activations are the SFT formulas at 2 x the
    micro-batch, measured by framework_step_records.py): returns its input, holds no cache.
    TransformerDecoder asks ``layers[0].caches_are_enabled()`` before each forward."""

    def caches_are_enabled(self) -> bool:
        return False

    def forward(self, h: torch.Tensor, **_) -> torch.Tensor:
        return h


def _decoder(model_name: str) -> nn.Module:
    """torchtune 0.6.1 modules/transformer.py TransformerDecoder around one _NoBlock: its forward
    is tok_embeddings, norm, then unembed's ``self.output(h).float()`` (no output chunks: the DPO
    recipes never call set_num_output_chunks)."""
    from torchtune.modules import RMSNorm, TransformerDecoder

    spec = get_model(model_name)
    head_dim = spec.hidden_size // spec.num_heads
    return TransformerDecoder(
        tok_embeddings=nn.Embedding(spec.vocab_size, spec.hidden_size),
        layers=nn.ModuleList([_NoBlock()]), max_seq_len=131072, num_heads=spec.num_heads, head_dim=head_dim,
        norm=RMSNorm(spec.hidden_size, eps=1e-5),
        output=nn.Linear(spec.hidden_size, spec.vocab_size, bias=False))


def _concatenated_forward(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor):
    """torchtune 0.6.1 recipes/lora_dpo_single_device.py concatenated_forward (its body, less the
    device move and the activation-offloading context, which is a no-op unless enabled)."""
    from torchtune import rlhf

    len_chosen = tokens.shape[0] // 2
    all_logits = model(tokens)
    all_log_probs = rlhf.get_batch_log_probs(all_logits, labels)
    return (all_log_probs[:len_chosen], all_log_probs[len_chosen:], all_logits[:len_chosen], all_logits[len_chosen:])


def run(model_name: str, pairs: int, seq_len: int) -> dict:
    from torchtune.rlhf.loss import DPOLoss

    spec = get_model(model_name)
    gc.collect()
    # Built on the meta device, then given fake storage (as zeroplan.frameworks.build does).
    with torch.device("meta"):
        decoder = _decoder(model_name).to(torch.bfloat16)
    with private.fake_tensor_mode():
        decoder.to_empty(device="cpu")
        tokens = torch.randint(0, spec.vocab_size, (2 * pairs, seq_len))
        labels = torch.randint(0, spec.vocab_size, (2 * pairs, seq_len))
        tracker = private.live_bytes_tracker()
        private.track_existing(tracker, decoder)
        loss_fn = DPOLoss(beta=0.1)
        with tracker:
            start = private.tracker_live_bytes(tracker)
            policy_chosen, policy_rejected, chosen_logits, rejected_logits = _concatenated_forward(decoder, tokens, labels)
            chosen_mean, rejected_mean = chosen_logits.detach().mean(), rejected_logits.detach().mean()
            del chosen_logits, rejected_logits
            gc.collect()
            retained = private.tracker_live_bytes(tracker) - start
            # The reference forward calls the same modules again; the tracker's live and peak
            # bytes, not its per-module stats, are what is read.
            tracker.reset_mod_stats()
            with torch.no_grad():
                reference_chosen, reference_rejected, _, _ = _concatenated_forward(decoder, tokens, labels)
            loss, _, _ = loss_fn(policy_chosen, policy_rejected, reference_chosen, reference_rejected)
            loss.mean().backward()
            peak = private.mem_tracker_peak_bytes(tracker)
        del chosen_mean, rejected_mean
    parameter_bytes = sum(p.numel() * p.element_size() for p in decoder.parameters())
    # Peak less what was live before the step (parameters) and the gradients backward made.
    step_peak = peak["total"] - start - peak.get("gradient", 0)
    return {"model": model_name, "pairs": pairs, "seq_len": seq_len, "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size, "parameter_bytes": parameter_bytes,
            "retained_after_policy_bytes": retained, "step_peak_bytes": step_peak,
            "peak_by_category_bytes": peak, "torch": torch.__version__}


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    records = [run(*shape) for shape in SHAPES]
    for record in records:
        print(f"{record['model']} pairs={record['pairs']} seq={record['seq_len']}: retained after policy "
              f"{record['retained_after_policy_bytes']:,} B, step peak {record['step_peak_bytes']:,} B")
    write_text_atomic(out, json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
