"""The loss's moments in the planner's allocation trace are the tensors each is made of
(zeroplan.core.framework_loss.framework_logits_tensors), not one block per moment: their bytes
are the planner's, tensor by tensor they add up to each moment (PeakTerms.logits_pieces)."""

from __future__ import annotations

import pytest

from zeroplan.allocator.fsdp_schedule import loss_allocations
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.feasibility import usable_memory_bytes
from zeroplan.core.plan import memory_breakdown, peak_terms
from zeroplan.specs import StrategyKind

QLORA = ("llama-2-7b --gpus 2 --gpu rtx-4090 --micro-batch 10 --seq-len 2048 --activation-checkpointing full "
         "--precision bf16-pure --framework hf --lora-rank 64 --quantize nf4 --lora-targets q,k,v,o,gate,up,down "
         "--lora-dropout 0.1 --bitsandbytes-version 0.43.0")
TUNE = "llama-3.1-8b --framework torchtune --gpus 8 --micro-batch 1 --seq-len 4096 --activation-checkpointing full"
CASES = [
    (QLORA, StrategyKind.fsdp_full_shard),
    (QLORA, StrategyKind.ddp),
    (TUNE, StrategyKind.fsdp_shard_grad_op),
    (TUNE + " --unchunked-loss", StrategyKind.fsdp_full_shard),
    ("llama-3.1-8b --framework torchtitan --gpus 8 --micro-batch 2 --seq-len 8192", StrategyKind.fsdp_full_shard),
    ("llama-3-8b --framework litgpt --gpus 4 --micro-batch 4 --seq-len 512", StrategyKind.fsdp_full_shard),
    ("llama-3-8b --framework litgpt --gpus 1 --micro-batch 4 --seq-len 512 --lora-rank 8", StrategyKind.ddp),
    ("llama-2-7b --framework megatron --gpus 8 --micro-batch 2 --seq-len 2048", StrategyKind.ddp),
    ("llama-2-7b --framework hf --gpus 8 --micro-batch 2 --seq-len 2048 --fused-linear-cross-entropy", StrategyKind.zero2),
]


def _request(flags: str, kind: StrategyKind):
    base = request_from_args(build_parser().parse_args(["fit", *flags.split()]))
    return base.model_copy(update={"strategy": base.strategy.model_copy(update={"kind": kind})})


@pytest.mark.parametrize("flags, kind", CASES)
def test_each_loss_moment_is_allocated_as_the_tensors_that_make_it(flags: str, kind: StrategyKind) -> None:
    request = _request(flags, kind)
    _, terms = peak_terms(request)
    moments = loss_allocations(request, terms)
    assert [sum(moment) for moment in moments] == list(terms.logits_pieces)
    assert all(size > 0 for moment in moments for size in moment)
    # The largest moment is never one block (a moment may be one tensor: liger's backward holds
    # only its weight gradient outside FSDP).
    assert max(max(moment) for moment in moments) < max(terms.logits_pieces)


def test_hf_loss_is_its_three_fp32_tensors_beside_the_gathered_units() -> None:
    # zeroplan.core.activations.logits_bytes: the saved log-softmax and two fp32 gradients, each
    # 4 x b x s x V; under FSDP2 the root unit (embedding, head) and the prefetched last block.
    request = _request(QLORA, StrategyKind.fsdp_full_shard)
    (moment,) = loss_allocations(request, peak_terms(request)[1])
    sbv = 10 * 2048 * request.model.vocab_size
    assert moment[:3] == [4 * sbv] * 3 and len(moment) == 6


def test_the_qlora_step_published_on_24_gb_fits_there() -> None:
    # Answer.AI fsdp_qlora, Llama-2-7B QLoRA at b10 x 2048 on two 24 GB cards: completed,
    # 20.97 GiB reserved (benchmarks/published_memory/rows.csv fq-3090-7b-qlora-b10). With the
    # loss as one 7.9 GiB block the second step's replay made a new segment for it (25.0 GiB).
    request = _request(QLORA, StrategyKind.fsdp_full_shard)
    breakdown, _ = memory_breakdown(request)
    assert breakdown.reserved_peak_bytes is not None
    assert breakdown.peak_bytes == breakdown.reserved_peak_bytes <= usable_memory_bytes(request)
