"""The end of backward where its last reduction is modelled tensor by tensor: FSDP2 full
sharding's last unit (zeroplan.core.buffers.backward_end_buffer_bytes) and DeepSpeed ZeRO-3's
gradient epilogue (zeroplan.core.deepspeed_epilogue); DeepSpeed ZeRO-1's gradients, unreduced
until backward ends; and the copy gloo's reduce-scatter adds on the CPU (zeroplan.validate.gloo),
against the committed DeepSpeed runs and the runs of the emitted files. Reads JSON records only;
no torch."""

from __future__ import annotations

from pathlib import Path

from zeroplan.core import deepspeed_epilogue
from zeroplan.core.buffers import (
    backward_end_buffer_bytes, backward_end_gradient_bytes, block_backward_gradient_bytes, last_reduce_scatter_input_bytes,
)
from zeroplan.core.deepspeed_accumulation import kept_scalar_bytes, stage3_resident_bytes
from zeroplan.core.model_states import padded_unit_elements_of
from zeroplan.core.peak import peak_moments
from zeroplan.core.plan import checked_peak_terms, memory_breakdown
from zeroplan.harness.record import read_record
from zeroplan.results import PeakMoment
from zeroplan.specs.framework import Framework
from zeroplan.validate.compare import compare_record, request_for
from zeroplan.validate.gloo import gloo_allocated_peak_bytes

EMITTED = Path(__file__).resolve().parents[1] / "benchmarks" / "emitted-records"
DEEPSPEED = EMITTED.parent / "deepspeed-records"
PSI = 12_586_368  # tiny-llama's parameters; every tensor splits evenly over 2 ranks
EMBEDDING = HEAD = 8192 * 384


def _request(run: str):
    return request_for(read_record(EMITTED / run / "rank00000.json").description)


def test_deepspeed_epilogue_holds_the_flat_copy_and_the_gathered_embedding() -> None:
    request = _request("tiny-llama-zero3-deepspeed-n2")
    # The bucket (reduce_bucket_size = Ψ) holds every gradient at the epilogue: one flat copy of Ψ.
    assert sum(deepspeed_epilogue.last_bucket_numels(request)) == PSI
    assert deepspeed_epilogue.flat_copy_bytes(request) == 4 * PSI == last_reduce_scatter_input_bytes(request)
    assert deepspeed_epilogue.first_module_gathered_bytes(request) == 4 * EMBEDDING
    assert backward_end_buffer_bytes(request) == 4 * PSI + 4 * EMBEDDING
    assert backward_end_gradient_bytes(request) == 0  # the fp32 partition is made at the step
    states, terms = checked_peak_terms(request)
    end = peak_moments(states, terms, 1)[PeakMoment.backward_end]
    resident = stage3_resident_bytes(request) + kept_scalar_bytes(request)
    assert (end.gradients, end.buffers) == (0, resident + 4 * PSI + 4 * EMBEDDING)


def test_deepspeed_epilogue_reduces_one_even_tensor_in_place() -> None:
    request = _request("tiny-llama-zero3-deepspeed-n2")
    # A bucket of the embedding's size: the backward ends with the embedding's gradient alone.
    small = request.with_strategy(request.strategy.model_copy(update={"zero_bucket_elements": EMBEDDING}))
    assert deepspeed_epilogue.last_bucket_numels(small) == [EMBEDDING]
    assert deepspeed_epilogue.flat_copy_bytes(small) == 0
    assert last_reduce_scatter_input_bytes(small) == 4 * EMBEDDING


def test_fsdp2_ends_backward_with_the_roots_reduce_input_and_the_head_gradient() -> None:
    request = _request("tiny-llama-fsdp-full-shard-accelerate-n2")
    elements = padded_unit_elements_of(request, 2)
    root = elements[0] + elements[-1]  # embedding; final norm and head
    assert root == EMBEDDING + 384 + HEAD
    assert last_reduce_scatter_input_bytes(request) == 4 * root
    # Beside the flat input: at the copy-in the root's unsharded gradients (less its sharded one,
    # not made yet), at the reduce-scatter the head's; at 2 ranks the copy-in's by 768 bytes.
    copy_in = 4 * root - 4 * (root // 2)
    assert copy_in - 4 * HEAD == 768
    assert backward_end_buffer_bytes(request) == 4 * root + copy_in
    assert backward_end_gradient_bytes(request) is None
    # torchtune's full fine-tune makes the embedding a unit of its own, reduced last, and the
    # head is reduced after the loss's backward.
    tune = request.model_copy(update={"training": request.training.model_copy(update={"framework": Framework.torchtune})})
    assert backward_end_buffer_bytes(tune) == 4 * EMBEDDING + 2 * EMBEDDING


def test_deepspeed_stage1_keeps_every_gradient_until_backward_ends() -> None:
    """ZeRO-1 without overlap_comm reduces after backward: the head's gradient (and the final
    norm's) at the first block's backward, every full gradient at its end; ZeRO-2 reduces in
    its hooks."""
    record = read_record(DEEPSPEED / "tiny-llama-zero1-deepspeed-fp32-n2" / "rank00000.json")
    request = request_for(record.description)
    assert deepspeed_epilogue.stage1_keeps_gradients(request)
    assert block_backward_gradient_bytes(request) == 4 * (HEAD + 384)
    assert backward_end_gradient_bytes(request) == 4 * PSI
    states, terms = checked_peak_terms(request)
    moments = peak_moments(states, terms, 1)
    assert moments[PeakMoment.block_backward].gradients == 4 * (HEAD + 384)
    assert moments[PeakMoment.backward_end].gradients == 4 * PSI
    # Accumulating, the earlier micro-batches' full gradients are carried already.
    accumulating = request.model_copy(update={"batch": request.batch.model_copy(update={"grad_accum_steps": 2})})
    assert block_backward_gradient_bytes(accumulating) == 0
    # Stage 2 reduces in its hooks: the head's gradient is there while its hook copies it into
    # the bucket it has just allocated, and the step takes the fp32 partition.
    stage2 = request_for(read_record(DEEPSPEED / "tiny-llama-zero2-deepspeed-fp32-n2" / "rank00000.json").description)
    assert not deepspeed_epilogue.stage1_keeps_gradients(stage2)
    assert block_backward_gradient_bytes(stage2) == 4 * HEAD and backward_end_gradient_bytes(stage2) is None


def test_gloo_copies_the_last_reduce_scatter_input_where_that_moment_is_the_largest() -> None:
    for run, copy in (("tiny-llama-zero3-deepspeed-n2", 4 * PSI),
                      ("tiny-llama-fsdp-full-shard-accelerate-n2", 4 * (EMBEDDING + 384 + HEAD))):
        request = _request(run)
        states, terms = checked_peak_terms(request)
        end = peak_moments(states, terms, 1)[PeakMoment.backward_end].total
        planned = memory_breakdown(request)[0].allocated_peak_bytes
        assert gloo_allocated_peak_bytes(request, planned) == max(planned, end + copy) == end + copy
        rows = {row.quantity: row for row in compare_record(read_record(EMITTED / run / "rank00000.json"))}
        assert rows["peak (CPU allocator)"].predicted_bytes == end + copy
