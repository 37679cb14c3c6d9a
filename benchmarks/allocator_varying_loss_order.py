"""Does the order of the loss's tensors change what varying lengths leave reserved? A hand-written
Qwen-7B LoRA step (checkpointed blocks, then the loss), chained at lengths drawn from ms-swift's
page statistics and replayed through zeroplan's allocator (zeroplan.allocator.replay): the
planner's schematic loss (three fp32 b s V tensors, then three again in backward) against the
order the source runs it in (zeroplan.core.own_loss). That order is Qwen-1's modeling_qwen.py
(bf16 logits and their shifted .contiguous() copy); torch 2.1's cross_entropy_loss under CUDA
autocast: log_softmax with the explicit bf16 dtype cross_entropy_loss_symint passes (autocast's
fp32_set_opt_dtype keeps it), then nll_loss, on autocast's fp32 list, on an fp32 copy of the
log-probabilities that its backward keeps; accelerate's convert_outputs_to_fp32 copy dropped after
compute_loss; then nll_loss's fp32 gradient and the bf16 ones. Prints each replay's reserved peak
and the growth over one batch at the longest length, in fp32 logit rows of that length, and the
planner's record rule for the same lengths (new segments per record: 3 for the reference's upcast
loss, 2 for Qwen-1's own). About 20 s:

    python benchmarks/allocator_varying_loss_order.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_varying_lengths import lengths_of  # noqa: E402
from zeroplan.allocator.config import parse_alloc_conf  # noqa: E402
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, replay  # noqa: E402

GIB = 2**30
VOCAB, HIDDEN, FFN, BLOCKS = 151_936, 4096, 11_008, 32
"""Qwen-7B's shapes."""
STATES_BYTES = int(14.4 * GIB)
"""The model states, allocated once."""


class Trace:
    """Allocations and frees as the replay's ops."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, int, int, int]] = []
        self.next_id = 0

    def alloc(self, size: int) -> int:
        self.next_id += 1
        self.ops.append((ALLOC_OP, self.next_id, int(size), 0))
        return self.next_id

    def free(self, *idents: int) -> None:
        self.ops.extend((FREE_OP, ident, 0, 0) for ident in idents)


def schematic_loss(trace: Trace, tokens: int) -> None:
    """The planner's reference loss: three fp32 b s V tensors in forward, three in backward."""
    for _ in range(2):
        tensors = [trace.alloc(4 * VOCAB * tokens) for _ in range(3)]
        trace.free(*tensors)


def source_loss(trace: Trace, tokens: int) -> int:
    """Qwen-1's loss under HF 4.36 / accelerate autocast on torch 2.1, tensor by tensor; returns the
    gradient of the logits, which lm_head's backward frees."""
    logits = trace.alloc(2 * VOCAB * tokens)             # lm_head output, bf16
    shifted = trace.alloc(2 * VOCAB * (tokens - 1))      # shift_logits.contiguous()
    log_probs = trace.alloc(2 * VOCAB * (tokens - 1))    # log_softmax(dtype=bf16), saved
    cast = trace.alloc(4 * VOCAB * (tokens - 1))         # nll_loss's fp32 input, saved
    trace.free(shifted)                                  # the forward returns
    outputs = trace.alloc(4 * VOCAB * tokens)            # accelerate's convert_outputs_to_fp32
    trace.free(logits, outputs)                          # dropped after compute_loss
    grad_cast = trace.alloc(4 * VOCAB * (tokens - 1))    # nll_loss backward, fp32
    trace.free(cast)
    grad_log_probs = trace.alloc(2 * VOCAB * (tokens - 1))  # the cast's backward, bf16
    trace.free(grad_cast)
    grad_shifted = trace.alloc(2 * VOCAB * (tokens - 1))    # log_softmax backward, bf16
    trace.free(grad_log_probs, log_probs)
    grad_logits = trace.alloc(2 * VOCAB * tokens)            # the slice's backward
    trace.free(grad_shifted)
    return grad_logits


def step(trace: Trace, tokens: int, in_source_order: bool) -> None:
    saved = [trace.alloc(2 * HIDDEN * tokens) for _ in range(BLOCKS)]  # checkpointed block inputs
    hidden = trace.alloc(2 * HIDDEN * tokens)
    if in_source_order:
        trace.free(source_loss(trace, tokens))
    else:
        schematic_loss(trace, tokens)
    grad_hidden = trace.alloc(2 * HIDDEN * tokens)
    trace.free(hidden)
    for block in reversed(saved):  # each block's recompute and backward workspace
        workspace = trace.alloc(2 * (4 * HIDDEN + 3 * FFN) * tokens)
        trace.free(workspace, block)
    trace.free(grad_hidden)


def reserved_after(lengths: list[int], in_source_order: bool) -> float:
    trace = Trace()
    trace.alloc(STATES_BYTES)
    for tokens in lengths:
        step(trace, tokens, in_source_order)
    return replay(trace.ops, parse_alloc_conf("")).reserved_peak_bytes / GIB


def records_of(lengths: list[int]) -> list[int]:
    """The batches longer than every batch before them."""
    out: list[int] = []
    for tokens in lengths:
        if not out or tokens > out[-1]:
            out.append(tokens)
    return out


def main() -> int:
    for longest, batches in ((512, 289), (2048, 1971), (8192, 949)):
        row_gib = 4 * VOCAB * longest / GIB
        for in_source_order in (False, True):
            one = reserved_after([longest], in_source_order)
            figures, rules = [], []
            for seed in range(6):
                # ms-swift's page statistics (benchmarks/gpu_varying_lengths.py), then the longest.
                lengths = lengths_of(longest, batches, seed) + [longest]
                figures.append(reserved_after(lengths, in_source_order))
                # zeroplan.allocator.varying_lengths: each record below the longest keeps one
                # segment per largest loss tensor.
                rules.append(sum(4 * VOCAB * tokens for tokens in records_of(lengths)[:-1]) / GIB / row_gib)
            growth = statistics.mean((figure - one) / row_gib for figure in figures)
            per_record = 2 if in_source_order else 3
            name = "source order" if in_source_order else "schematic 3 x fp32"
            print(f"longest {longest:5d} {name:18s}: one batch {one:6.2f} GiB; after {batches} batches "
                  + ", ".join(f"{figure:.1f}" for figure in figures)
                  + f" GiB; growth {growth:.1f} fp32 rows of the longest; the rule's {per_record} a record: "
                  + f"{per_record * statistics.mean(rules):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
