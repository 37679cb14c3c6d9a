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
        request = _request(flags + " --flat-reserve", kind)
        expected = bisect_max_micro_batch_size(request)
    except Exception as error:  # a strategy the setup's framework does not run is refused alike
        with pytest.raises(type(error)):
            max_micro_batch_size(_request(flags, kind))
        return
    solved = _max_micro_batch_affine(request)
    assert solved in (None, expected), (solved, expected)
    assert max_micro_batch_size(request) == expected


def test_a_loss_not_affine_in_the_micro_batch_is_bisected() -> None:
    """liger's fused linear cross-entropy sizes its logits chunk by a power of two of the tokens
    (64 rows at micro-batch 1, 128 at 2 and 3, 256 at 4 to 7 here), so no line through
    micro-batches 1 and 2 gives the largest that fits: the line said 9 where 10 fits."""
    from zeroplan.core.plan import step_fits

    request = _request("qwen2.5-32b --framework hf --gpu h100-80gb --gpus 8 --seq-len 1024 --grad-accum 4 "
                       "--activation-checkpointing full --lora-rank 64 --fused-linear-cross-entropy --flat-reserve",
                       StrategyKind.zero1)
    largest = max_micro_batch_size(request)
    assert step_fits(request.with_micro_batch(largest))
    assert not step_fits(request.with_micro_batch(largest + 1))
    assert _max_micro_batch_affine(request) is None


@pytest.mark.parametrize("strategy, conf", [("fsdp-full-shard", ""), ("zero3", "expandable_segments:True"), ("ddp", "")])
def test_the_allocator_fit_check_agrees_with_the_bisected_capacity(strategy, conf) -> None:
    """Under --allocator-conf the largest-micro-batch search asks only whether the OOM capacity
    is within the usable memory (one or two replays); that answer is the whole breakdown's, at
    micro-batches on both sides of the largest that fits."""
    from zeroplan.core.feasibility import usable_memory_bytes
    from zeroplan.core.plan import max_micro_batch_size, memory_breakdown, step_fits
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.presets.models import get_model
    from zeroplan.specs import BatchSpec, MemoryAssumptions, PlanRequest, StrategySpec, cluster_from_gpus

    request = PlanRequest(model=get_model("llama-2-7b"), batch=BatchSpec(seq_len=2048),
                          cluster=cluster_from_gpus(get_gpu("a100-40gb"), 8), strategy=StrategySpec(kind=strategy),
                          assumptions=MemoryAssumptions(allocator_conf=conf))
    largest = max_micro_batch_size(request)
    for micro in sorted({1, max(largest, 1), largest + 1}):
        at = request.with_micro_batch(micro)
        breakdown, _ = memory_breakdown(at)
        assert step_fits(at) == (breakdown.peak_bytes <= usable_memory_bytes(at)), micro
    assert largest == 0 or step_fits(request.with_micro_batch(largest))
    assert not step_fits(request.with_micro_batch(largest + 1))


@pytest.mark.parametrize("flags", [SETUPS[2], SETUPS[5], SETUPS[11]])
def test_under_the_allocator_model_the_solved_bound_is_checked_by_replays(flags: str) -> None:
    """By default the allocator model judges: the closed form bounds the largest micro-batch
    from above (no step completes past its allocated peak) and replays decide at and below it,
    giving the doubling-and-bisection search's answer."""
    request = _request(flags, StrategyKind.fsdp_full_shard)
    assert request.assumptions.allocator_conf == ""
    bound = _max_micro_batch_affine(request)
    largest = max_micro_batch_size(request)
    assert bound is not None and largest <= bound
    assert largest == bisect_max_micro_batch_size(request)


def _fsdp_request(flags: str):
    return _request(flags, StrategyKind.fsdp_full_shard)


def test_under_the_allocator_model_max_mb_runs_and_so_does_every_smaller_one() -> None:
    """A replay of the caching allocator need not complete at every micro-batch below one that
    completes (when its device allocations fail it frees its cache and retries, and how tightly
    the step then packs moves with the micro-batch): here micro-batch 24 completes where some
    below it run out. max-mb is the largest below which none runs out."""
    from zeroplan.core.plan import step_fits

    request = _fsdp_request("tinyllama-1.1b --framework litgpt --gpu rtx-4090 --gpus 32 --seq-len 2048 "
                            "--activation-checkpointing full")
    largest = max_micro_batch_size(request)
    assert largest >= 1
    assert all(step_fits(request.with_micro_batch(b)) for b in range(1, largest + 1))
    assert not step_fits(request.with_micro_batch(largest + 1))
    # The case the answer guards against: a larger micro-batch completes again.
    assert any(step_fits(request.with_micro_batch(b)) for b in range(largest + 2, largest + 8))


@pytest.mark.slow
def test_max_mb_stops_below_a_wide_run_of_micro_batches_that_run_out() -> None:
    from zeroplan.core.plan import step_fits

    request = _fsdp_request("llama-2-7b --gpu mi300x --gpus 8 --seq-len 512 --activation-checkpointing full "
                            "--lora-rank 16 --quantize nf4 --fsdp-version 1")
    largest = max_micro_batch_size(request)
    assert all(step_fits(request.with_micro_batch(b)) for b in range(1, largest + 1))
    assert not step_fits(request.with_micro_batch(largest + 1))
    assert any(step_fits(request.with_micro_batch(b)) for b in range(largest + 2, 2 * largest))


@pytest.mark.slow
def test_max_mb_walks_below_where_the_reserved_peak_falls_with_a_larger_micro_batch() -> None:
    """What the allocator reserves without a limit need not grow with the micro-batch: here a
    micro-batch below one whose step is never refused memory runs out, and max-mb stays below it."""
    from pathlib import Path

    from zeroplan.core.plan import step_fits

    config = Path(__file__).resolve().parent / "fixtures" / "hf" / "qwen3-30b-a3b.json"
    request = _fsdp_request(f"{config} --framework hf --gpu a100-80gb --gpus 16 --seq-len 1024 --grad-accum 2 "
                            "--activation-checkpointing full")
    largest = max_micro_batch_size(request)
    assert all(step_fits(request.with_micro_batch(b)) for b in range(max(1, largest - 4), largest + 1))
    assert not step_fits(request.with_micro_batch(largest + 1))
    assert any(step_fits(request.with_micro_batch(b)) for b in range(largest + 2, largest + 6))


def test_max_mb_walks_below_a_rise_in_the_reserved_peak_not_seen_above_it() -> None:
    """The reserved peak without a limit can rise toward smaller micro-batches where no
    micro-batch above showed a rise: here 63 to 65 complete unrefused, but at 62 the second
    micro-batch's logits miss the first's cached blocks and 59 to 62 run out. The walk below the
    largest unrefused micro-batch goes down by at least one segment of the largest request."""
    from zeroplan.core.plan import step_fits

    request = _request("qwen2.5-1.5b --framework hf --gpu b200 --gpus 1 --seq-len 512 --grad-accum 2 "
                       "--activation-checkpointing none", StrategyKind.fsdp_full_shard)
    largest = max_micro_batch_size(request)
    assert all(step_fits(request.with_micro_batch(b)) for b in range(max(1, largest - 4), largest + 1))
    assert not step_fits(request.with_micro_batch(largest + 1))
    assert any(step_fits(request.with_micro_batch(b)) for b in range(largest + 2, largest + 8))


@pytest.mark.parametrize("flags, kind", [
    ("qwen2.5-1.5b --framework hf --gpu b200 --gpus 1 --seq-len 512 --grad-accum 2 --activation-checkpointing none",
     StrategyKind.fsdp_full_shard),
    ("llama-2-7b --gpus 8", StrategyKind.zero3),
    ("gpt2 --gpus 2 --seq-len 64", StrategyKind.zero2),
    ("gpt2 --gpus 2 --seq-len 64 micro-llama", StrategyKind.zero2),
    ("llama-2-7b --gpus 8 --framework megatron --tp 2", StrategyKind.ddp),
    ("llama-2-7b --gpus 8 --allocator-conf roundup_power2_divisions:4", StrategyKind.ddp),
])
def test_the_largest_segment_is_the_largest_over_every_request_of_the_trace(flags: str, kind: StrategyKind) -> None:
    """The max-mb walk's segment (plan._largest_segment_bytes), read from what is known of the
    trace (its largest request) where the verdicts replay the same terms, is the largest
    allocation_size of any request's rounded size in the planned terms' trace built afresh
    (step_ops), whether or not the trace was replayed before (a kept shape); asking it first
    leaves the verdicts' kept shapes as they would be (megatron's resident gradient buffer
    replays other terms); the harness's micro-llama (a flag's last word: the model instead),
    whose requests all get the small pool's segment."""
    from zeroplan.allocator.planner import _config, forget_replays
    from zeroplan.allocator.replay import ALLOC_OP
    from zeroplan.allocator.rules import allocation_size, round_size
    from zeroplan.allocator.schedule import step_ops
    from zeroplan.core.plan import _largest_segment_bytes, _unlimited_reserved_bytes, checked_peak_terms, step_fits_unrefused
    from zeroplan.harness.presets import harness_model
    from zeroplan.specs.request import revalidated

    *flags_, last = flags.split()
    request = _request(" ".join(flags_) if last == "micro-llama" else flags, kind).with_micro_batch(2)
    if last == "micro-llama":
        request = revalidated(request, model=harness_model(last))
    states, terms = checked_peak_terms(request)
    config = _config(request.assumptions.allocator_conf or "")
    expected = max((allocation_size(round_size(size, config))
                    for kind_, _, size, _ in step_ops(request, states, terms) if kind_ == ALLOC_OP), default=0)
    forget_replays()
    reserved = _unlimited_reserved_bytes(request)
    forget_replays()
    assert _largest_segment_bytes(request) == expected
    assert _unlimited_reserved_bytes(request) == reserved
    step_fits_unrefused(request)
    assert _largest_segment_bytes(request) == expected
