"""Each pipeline rank is judged against its own usable memory: a middle stage opens an NCCL
communicator per neighbour, a first or last stage one (zeroplan.core.communicators), so a middle
rank has less memory for the allocator (zeroplan.core.plan.nearest_rank)."""

from __future__ import annotations

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.feasibility import usable_memory_bytes
from zeroplan.core.plan import max_micro_batch_size, memory_breakdown, pipeline_rank_requests, plan, step_fits
from zeroplan.specs import StrategyKind

# Llama-2-13B under torchtitan on 8 H200s, pp 4 x cp 2: ranks 0 and 3 have 0.287 GiB more usable
# memory than ranks 1 and 2.
LAYOUT = ("llama-2-13b --framework torchtitan --gpu h200-141gb --gpus 8 --seq-len 512 --activation-checkpointing "
          "selective-op --pp 4 --cp 2 --grad-accum 4 --fsdp-cpu-offload")


def _request(flags: str):
    base = request_from_args(build_parser().parse_args(["fit", *flags.split()]))
    return base.with_strategy(base.strategy.model_copy(update={"kind": StrategyKind.fsdp_full_shard}))


def _rank_fits(request) -> list[bool]:
    return [memory_breakdown(rank)[0].peak_bytes <= usable_memory_bytes(rank) for rank in pipeline_rank_requests(request)]


def test_a_middle_rank_that_runs_out_on_its_own_memory_is_oom() -> None:
    """At micro-batch 7 rank 0 peaks highest (28.71 GiB) and rank 1 just below (28.58), and on
    30.42 GiB rank 0 fits its 28.79 usable where rank 1 has 28.50: the step runs out on rank 1,
    though rank 0's peak is within rank 0's memory (the verdict said fits)."""
    request = _request(LAYOUT + " --gpu-memory-gib 30.42 --flat-reserve --micro-batch 7")
    assert _rank_fits(request) == [True, False, True, True]
    answer = plan(request, largest_micro_batch=False, timed=False)
    assert not answer.fits and not step_fits(request)
    assert answer.peak_rank_reason.startswith("pipeline rank 1 of 4")
    assert answer.headroom_bytes < 0


def test_max_mb_is_the_same_from_every_pipeline_rank() -> None:
    """plan() asks max-mb of the request at the rank it reports, and each rank's step is judged
    on its own memory whichever that is (it said 129 from rank 1, whose memory it used for rank
    0's step, where every rank fits at 130)."""
    request = _request(LAYOUT + " --allocator-conf expandable_segments:True --micro-batch 1")
    answers = {max_micro_batch_size(request.at_pipeline_rank(rank)) for rank in range(4)}
    assert len(answers) == 1
    largest = answers.pop()
    assert all(_rank_fits(request.with_micro_batch(largest)))
    assert not all(_rank_fits(request.with_micro_batch(largest + 1)))


def test_the_allocator_shortfall_quotes_the_rank_nearest_to_running_out() -> None:
    """At micro-batch 6 rank 0 reserves most (26.93 GiB of 28.79) but rank 1 has less left
    (26.65 of 28.50): the caution names rank 1's figures, not rank 0's memory beside the highest
    peak of any rank."""
    from zeroplan.core.plan import allocator_shortfall, nearest_rank, under_allocator_model

    request = _request(LAYOUT + " --gpu-memory-gib 30.42 --flat-reserve --micro-batch 6")
    ranks = pipeline_rank_requests(under_allocator_model(request))
    peaks = [memory_breakdown(rank)[0].peak_bytes for rank in ranks]
    usables = [usable_memory_bytes(rank) for rank in ranks]
    nearest = nearest_rank(peaks, usables)
    assert nearest == 1 and peaks.index(max(peaks)) == 0
    message = allocator_shortfall(request)
    assert f"runs out of the {usables[1] / 2**30:.1f} GiB usable (it would reserve {peaks[1] / 2**30:.1f} GiB" in message
