"""The largest micro-batch that fits, solved from the moments at micro-batches 1 and 2
(zeroplan.core.plan._max_micro_batch_affine), against the bisection over whole breakdowns that
it replaces where every moment is affine in the micro-batch."""

from __future__ import annotations

import itertools

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import _max_micro_batch_affine, bisect_max_micro_batch_size, max_micro_batch_size
from zeroplan.specs import StrategyKind

SETUPS = [
    "llama-2-7b --gpus 8",
    "llama-2-70b --gpus 64 --gpu h100-80gb --seq-len 8192",
    "llama-3.1-8b --framework torchtune --gpus 8 --activation-checkpointing full",
    "llama-3.1-8b --framework torchtune --gpus 8 --activation-offloading --activation-checkpointing full",
    "llama-3.1-8b --framework torchtune --gpus 8 --unchunked-loss",
    "llama-3.1-8b --framework hf --gpus 8 --seq-len 2048 --grad-accum 4",
    "llama-3.1-8b --framework torchtitan --gpus 8 --seq-len 8192 --activation-checkpointing selective-op",
    "llama-3.1-8b --framework torchtune --lora-rank 8 --gpus 2 --gpu a10g --activation-checkpointing full",
    "llama-3.1-8b --framework torchtune --lora-rank 8 --dora --gpus 8",
    "llama-3.1-70b --framework hf --lora-rank 16 --quantize nf4 --gpus 2 --gpu rtx-4090 --activation-checkpointing full",
    "llama-3.1-70b --framework torchtune --fsdp-cpu-offload --gpus 8 --activation-checkpointing full",
    "gpt2-xl --gpus 4 --seq-len 1024 --activation-checkpointing selective",
    "llama-2-13b --gpus 16 --tp 2 --activation-checkpointing full",
    "llama-2-7b --gpus 1 --gpu a10g --activation-checkpointing full",
]
KINDS = [StrategyKind.ddp, StrategyKind.zero2, StrategyKind.zero3, StrategyKind.fsdp_full_shard,
         StrategyKind.fsdp_shard_grad_op, StrategyKind.zero3_offload]


def _request(flags: str, kind: StrategyKind):
    base = request_from_args(build_parser().parse_args(["fit", *flags.split()]))
    return base.model_copy(update={"strategy": base.strategy.model_copy(update={"kind": kind})})


@pytest.mark.parametrize("flags, kind", list(itertools.product(SETUPS, KINDS)))
def test_the_solved_largest_micro_batch_is_the_bisections(flags: str, kind: StrategyKind) -> None:
    try:
        request = _request(flags, kind)
        expected = bisect_max_micro_batch_size(request)
    except Exception as error:  # a strategy the setup's framework does not run is refused alike
        with pytest.raises(type(error)):
            max_micro_batch_size(_request(flags, kind))
        return
    solved = _max_micro_batch_affine(request)
    assert solved in (None, expected), (solved, expected)
    assert max_micro_batch_size(request) == expected
