"""torch's loss_parallel() cross-entropy under torchtitan 9dec370's tensor parallelism: the
planner's loss moment (zeroplan.core.framework_loss.loss_parallel_logits_tensors) against torch's
own handlers measured on a fake process group (zeroplan.frameworks.loss_parallel)."""

from __future__ import annotations

import pytest

from zeroplan.cli.fit import check_options_apply, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.framework_loss import (
    fsdp_head_gathered_parts,
    loss_parallel_applies,
    loss_parallel_logits_tensors,
)
from zeroplan.core.parallel.activations import chunk_request, rank_logits_pieces
from zeroplan.core.plan import checked_peak_terms
from zeroplan.specs.strategy import StrategyKind

FP32 = 4


def _request(seq_len: int, *release: str):
    args = build_parser().parse_args([
        "fit", "llama-3.1-70b", "--gpus", "256", "--gpu", "h100-80gb", "--micro-batch", "1", "--seq-len", str(seq_len),
        "--activation-checkpointing", "full", "--framework", "torchtitan", "--tp", "8", "--unchunked-loss", *release])
    check_options_apply(args)
    return request_from_args(args, StrategyKind.fsdp_full_shard)


def test_under_9dec370s_tensor_parallelism_the_loss_holds_four_fp32_logit_shards() -> None:
    request = _request(8192, "--torchtitan-release", "9dec370")
    assert loss_parallel_applies(request)
    shard = FP32 * 8192 * (128256 // 8)
    chunk = chunk_request(request, split_heads=True)
    (moment,) = loss_parallel_logits_tensors(chunk)
    assert moment[:4] == (shard,) * 4
    assert rank_logits_pieces(request, None) == (4 * shard + sum(fsdp_head_gathered_parts(chunk)),)
    assert checked_peak_terms(request)[1].logits == 4 * shard + sum(fsdp_head_gathered_parts(chunk))
    # torchtitan 0.3.0 has its own vocab-parallel loss (components/loss.py): not this moment.
    assert not loss_parallel_applies(_request(8192))


@pytest.mark.slow
def test_torchs_loss_parallel_peaks_at_four_fp32_logit_shards_in_backward() -> None:
    from zeroplan.frameworks.loss_parallel import measure_loss_parallel

    tokens = 512
    measured = measure_loss_parallel(tokens=tokens, vocab_size=128256, tp=8)
    (moment,) = loss_parallel_logits_tensors(chunk_request(_request(tokens, "--torchtitan-release", "9dec370"),
                                                           split_heads=True))
    planned = sum(moment[:4])
    assert measured.local_logit_fp32_bytes == moment[0]
    # The measured moment also holds the labels and the per-token vectors (max, sum of exp).
    assert planned <= measured.backward_peak_bytes <= 1.01 * planned
    # The forward (bf16 logits, the fp32 upcast, `shifted`, exp(shifted)) stays below it.
    assert measured.forward_peak_bytes < measured.backward_peak_bytes



def _schedule_loss_events(seq_len: int, request=None, steps: int = 2) -> list[float]:
    """The allocator schedule's first-step fp32 and bf16 local-logit allocations (+) and frees
    (-), in order, in fp32 local-logit tensors, for 4 of Llama-3.1-70B's blocks at TP 8 (or
    ``request``, of one sequence of ``seq_len`` a micro-batch, whose schedule records ``steps``)."""
    from zeroplan.allocator.schedule import step_trace
    from zeroplan.allocator.trace import AllocEvent
    from zeroplan.core.plan import peak_terms

    if request is None:
        request = _request(seq_len, "--torchtitan-release", "9dec370")
        request = request.model_copy(update={"model": request.model.model_copy(update={"num_layers": 4})})
    shard = FP32 * seq_len * (128256 // 8)
    sizes: dict[int, int] = {}
    events: list[float] = []
    for event in step_trace(request, *peak_terms(request)).events:
        if isinstance(event, AllocEvent):
            sizes[event.id] = event.size_bytes
            if event.size_bytes in (shard, shard // 2):
                events.append(event.size_bytes / shard)
        elif sizes.get(event.id) in (shard, shard // 2):
            events.append(-sizes[event.id] / shard)
    return events[:len(events) // steps]


def test_the_fsdp_schedule_runs_loss_parallel_tensor_by_tensor() -> None:
    # Forward: bf16 logits, upcast, shifted, exp (freed), log-softmax; shifted, upcast, logits
    # freed. Backward: zeros, exp, sum, exp freed, product; sum, zeros, log-softmax freed; the
    # bf16 gradient, the product freed; the bf16 gradient freed after the head's weight gradient.
    # (At 2,048 tokens no unit of Llama-3.1-70B's has a logit tensor's size.)
    assert _schedule_loss_events(2048) == [.5, 1, 1, 1, -1, 1, -1, -1, -.5, 1, 1, 1, -1, 1, -1, -1, -1, .5, -1, -.5]


def test_the_pipeline_schedule_runs_the_last_stages_loss_parallel_tensor_by_tensor() -> None:
    # Llama-3.1-405B at TP 8 x PP 8 (1F1B), 8 micro-batches of 1 x 2048: the last stage's loss in
    # the pipelined (coarse) schedule, in the same order, from logits the stage holds (counted
    # with its activations: parallel.activations.pipeline_stage_output_bytes).
    args = build_parser().parse_args([
        "fit", "llama-3.1-405b", "--gpus", "512", "--gpu", "h100-80gb", "--micro-batch", "1", "--seq-len", "2048",
        "--grad-accum", "8", "--activation-checkpointing", "full", "--framework", "torchtitan", "--tp", "8", "--pp", "8",
        "--pp-schedule", "1f1b", "--unchunked-loss", "--torchtitan-release", "9dec370"])
    check_options_apply(args)
    last = request_from_args(args, StrategyKind.fsdp_full_shard).at_pipeline_rank(7)
    events = _schedule_loss_events(2048, last, steps=1)  # the pipelined schedule records one step
    assert events == [1, 1, 1, -1, 1, -1, -1, 1, 1, 1, -1, 1, -1, -1, -1, .5, -1, -.5]


@pytest.mark.slow
def test_the_schedules_loss_order_is_torchs_handlers() -> None:
    from zeroplan.frameworks.loss_parallel import measure_loss_parallel

    measured = measure_loss_parallel(tokens=512, vocab_size=128256, tp=8)
    # Up to the fp32 gradient's free after its bf16 cast (the measurement's logits are a product,
    # whose backward is not the output projection's).
    order = [e / measured.local_logit_fp32_bytes for e in measured.large_events]
    assert order[:19] == _schedule_loss_events(2048)[:19]


@pytest.mark.slow
def test_the_schedules_requested_peak_is_the_planners_loss_moment() -> None:
    from zeroplan.allocator.schedule import step_trace
    from zeroplan.core.plan import memory_breakdown, peak_terms

    # At 8,192 tokens the loss's backward is the peak: the schedule's requested peak is the
    # planner's loss moment but for the padding of the held units (the planner's loss term pads
    # the chunk's units, fsdp_head_gathered_parts of chunk_request; the schedule holds the rank's).
    request = _request(8192, "--torchtitan-release", "9dec370")
    allocated = memory_breakdown(request)[0].allocated_peak_bytes
    assert 0 <= allocated - step_trace(request, *peak_terms(request)).requested_peak_bytes() <= 8 << 20




def test_the_roots_head_gradient_is_the_ranks_vocabulary_rows() -> None:
    # Under tensor parallelism each rank's head is V/tp rows (loss parallel), and so is the
    # unsharded gradient its root holds from the loss's backward to its own post-backward.
    from zeroplan.core.buffers import head_weight_gradient_bytes

    request = _request(8192, "--torchtitan-release", "9dec370")
    model = request.model
    assert head_weight_gradient_bytes(request) == model.vocab_size * model.hidden_size * 2 // 8
