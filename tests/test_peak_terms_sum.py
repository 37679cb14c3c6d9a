"""MemoryBreakdown.peak_terms() names what is alive at the peak moment, and its values add up to
the peak shown (the table's cells without ( ), --explain's terms): at every moment, including
those where only part of the activations or of the gradients is alive (the first layer's
backward, DeepSpeed's accumulated buffers, ZeRO-1's gradients reduced after backward)."""

from __future__ import annotations

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import memory_breakdown
from zeroplan.results import PeakMoment
from zeroplan.specs import StrategyKind

# (command-line flags, strategy, the moment the peak is at), one or more per moment.
CASES = [
    ("mistral-7b --framework torchtune --gpus 16 --gpu a100-80gb --micro-batch 3 --seq-len 256 "
     "--activation-checkpointing full", StrategyKind.fsdp_full_shard, PeakMoment.first_layer_backward),
    ("llama-2-7b --framework megatron-deepspeed --gpus 8 --gpu a100-80gb --micro-batch 16 --seq-len 512 "
     "--activation-checkpointing full", StrategyKind.zero1, PeakMoment.backward_end),
    ("llama-2-7b --framework megatron --gpus 4 --gpu a100-80gb --micro-batch 16 --seq-len 256",
     StrategyKind.zero1, PeakMoment.loss_backward),
    ("mistral-7b --framework hf --gpus 16 --gpu a100-80gb --micro-batch 6 --seq-len 1024 --grad-accum 4 "
     "--activation-checkpointing full", StrategyKind.zero1, PeakMoment.loss_backward),
    ("llama-2-7b --gpus 8 --gpu a100-80gb --micro-batch 1 --seq-len 1024", StrategyKind.fsdp_full_shard,
     PeakMoment.block_backward),
    ("llama-2-7b --gpus 8 --gpu a100-80gb --micro-batch 1 --seq-len 512 --activation-checkpointing full",
     StrategyKind.ddp, PeakMoment.optimizer_step),
]


@pytest.mark.parametrize("flags, kind, moment", CASES, ids=lambda c: c.value if hasattr(c, "value") else None)
@pytest.mark.parametrize("reserve", ["flat", "allocator"])
def test_peak_terms_add_up_to_the_peak_at_every_moment(flags, kind, moment, reserve) -> None:
    argv = ["fit", *flags.split(), *(["--flat-reserve"] if reserve == "flat" else [])]
    base = request_from_args(build_parser().parse_args(argv))
    request = base.model_copy(update={"strategy": base.strategy.model_copy(update={"kind": kind})})
    memory = memory_breakdown(request)[0]
    assert memory.peak_moment is moment
    alive = memory.peak_terms()
    assert sum(alive.values()) == memory.peak_bytes
    # Only what the moment holds: the activations' part at most, the gradients' at most.
    assert alive.get("activation_bytes", 0) <= memory.activation_bytes
    assert alive["peak_buffer_bytes"] == memory.peak_buffer_bytes
