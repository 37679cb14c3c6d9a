"""Under a pipeline the step is the slowest pipeline rank's (zeroplan.core.plan.pipeline_step_time),
not the rank nearest to running out of memory, whose stages may reduce fewer gradients."""

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.communication import collectives
from zeroplan.core.plan import nearest_rank_memory, pipeline_rank_requests, plan, rank_memories
from zeroplan.core.timing import step_time
from zeroplan.specs.strategy import StrategyKind

# gpt2-medium on 32 RTX 4090s, tp 2 pp 2 cp 2: rank 0 (the embedding) reduces more gradients over
# the slow inter-node link than rank 1; the memory peak moves from rank 0 to rank 1 at micro-batch 5.
_LINE = ("compare gpt2-medium --framework zeroplan --gpu rtx-4090 --gpus 32 --micro-batch {micro} --seq-len {seq} "
         "--activation-checkpointing full --tp 2 --pp 2 --cp 2 --grad-accum 2 --no-sequence-parallel "
         "--partition-activations --checkpoint-in-cpu --flat-reserve")


def _request(kind: str, micro: int, seq: int = 512):  # type: ignore[no-untyped-def]
    args = build_parser("compare").parse_args(_LINE.format(micro=micro, seq=seq).split())
    return request_from_args(args, StrategyKind(kind))


def _rank_steps(request) -> list[float]:  # type: ignore[no-untyped-def]
    return [step_time(rank, tuple(collectives(rank))).step_with_overlap_s for rank in pipeline_rank_requests(request)]


def test_the_step_is_the_slowest_ranks_where_the_memory_peaks_on_another() -> None:
    request = _request("zero1", 5)
    peak_rank = nearest_rank_memory(rank_memories(request)).request.parallel.pipeline_rank
    steps = _rank_steps(request)
    assert steps[peak_rank] < max(steps)  # the case this covers: memory and time on different ranks
    assert plan(request, largest_micro_batch=False).time.step_with_overlap_s == max(steps)


def test_a_larger_micro_batch_or_sequence_never_shortens_the_pipelined_step() -> None:
    for kind in ("zero1", "fsdp-shard-grad-op", "fsdp-full-shard", "hsdp"):
        base = plan(_request(kind, 4), largest_micro_batch=False).time.step_with_overlap_s
        for grown in (_request(kind, 5), _request(kind, 4, seq=1024)):
            assert plan(grown, largest_micro_batch=False).time.step_with_overlap_s >= base, kind
