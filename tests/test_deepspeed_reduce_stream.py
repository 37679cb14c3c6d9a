"""DeepSpeed ZeRO-3's reduce-and-partition stream (zeroplan.core.deepspeed_reduce_stream): the
bucket flushes' flat copies in backward and fp16's overflow check, allocated on a stream of their
own where overlap_comm is on, and the previous step's kept cached there."""

from __future__ import annotations

from zeroplan.allocator.schedule import record_step, step_inputs, step_trace
from zeroplan.allocator.trace import AllocEvent, Stream
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.deepspeed_accumulation import _tensor_numels
from zeroplan.core.deepspeed_reduce_stream import backward_flushes, flushes_by_block, overflow_check_bytes
from zeroplan.core.plan import peak_allocated_bytes, peak_terms
from zeroplan.specs import StrategyKind

# The gpjt Llama-3-8B ZeRO-3 sweep: HF Trainer 4.40, DeepSpeed 0.14.2 (stage-3 defaults), fp16.
GPJT = ("llama-3-8b --framework hf --gpus 8 --gpus-per-node 8 --gpu a100-80gb --micro-batch 12 --seq-len 2048 "
        "--precision fp16-mixed --activation-checkpointing full --transformers-version 4.40.0 --torch-release 2.2 "
        "--deepspeed-release 0.14.2 --model-load full-per-rank")


def _request(flags: str = GPJT, kind: StrategyKind = StrategyKind.zero3):
    return request_from_args(build_parser().parse_args(["fit", *flags.split()]), kind)


def test_each_flush_copies_the_bucket_it_reduces_padded_to_the_ranks() -> None:
    """stage3.py:1221-1224 at v0.14.2: a bucket of at most reduce_bucket_size (5e8) elements is
    flushed before the gradient that would overflow it; reduce_scatter_coalesced copies it into
    one flat buffer, each tensor padded to 8 chunks, in fp16. lm_head (525,336,576 elements, more
    than a bucket, divisible by 8) goes alone and is reduce-scattered in place: no copy."""
    request = _request()
    flushes = backward_flushes(request)
    assert flushes[0] == (525_336_576, 0)
    arrived = [at for at, _ in flushes]
    assert arrived == sorted(arrived) and arrived[-1] < sum(_tensor_numels(request))
    assert all(0 < size <= 2 * 500_000_000 for _, size in flushes[1:])
    by_block = flushes_by_block(request, 32)
    assert len(by_block) == 32 and sorted(s for sizes in by_block for s in sizes) == sorted(s for _, s in flushes if s)


def test_fp16s_overflow_check_is_a_bool_per_element_of_the_gradient_partition() -> None:
    """stage3.py:2138-2143 at v0.14.2: torch.isinf(grad_partitions_flat_buffer) and torch.isnan
    of it, one byte an element; bf16 checks no overflow there."""
    request = _request()
    assert overflow_check_bytes(request) == sum(-(-n // 8) for n in _tensor_numels(request)) == 1_003_782_656
    assert overflow_check_bytes(_request(GPJT.replace("fp16-mixed", "bf16-mixed"))) == 0


def test_nothing_goes_to_a_reduce_stream_without_overlap_comm_or_below_stage_3() -> None:
    """With overlap_comm off, reduce_and_partition_stream is the default stream (stage3.py:227-228)."""
    request = _request()
    off = request.model_copy(update={"strategy": request.strategy.model_copy(update={"deepspeed_overlap_comm": False})})
    assert backward_flushes(off) == () and overflow_check_bytes(off) == 0
    assert overflow_check_bytes(_request(kind=StrategyKind.zero2)) == 0


def test_the_step_trace_puts_them_on_the_reduce_stream_under_the_planners_peak() -> None:
    """The trace allocates the flat copies and the checks on the reduce-scatter stream, the
    previous step's first (they stay cached into this step's loss), each freed at once: its
    requested peak stays the planner's allocated peak, and that stream's requested peak is the
    largest of them."""
    request = _request()
    states, terms = peak_terms(request)
    trace = step_trace(request, states, terms)
    sizes = [e.size_bytes for e in trace.events if isinstance(e, AllocEvent) and e.stream == Stream.reduce_scatter]
    copies = [size for _, size in backward_flushes(request) if size]
    assert sizes == 2 * (copies + [overflow_check_bytes(request)] * 2)
    inputs = step_inputs(request, states, terms)
    assert record_step(inputs).requested_peak_bytes == peak_allocated_bytes(states, terms, 1)[0]
