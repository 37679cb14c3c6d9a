"""The 2022-bigscience DeepSpeed release of the megatron-deepspeed profile (zeroplan.core.deepspeed_2022)."""

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.buffers import (
    backward_end_buffer_bytes,
    block_backward_transient_bytes,
    optimizer_step_temporary_bytes,
    transient_buffer_bytes,
)
from zeroplan.core.deepspeed_2022 import group_numels, partition_pieces
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.plan import deepspeed_accumulated_gradient_bytes
from zeroplan.core.profiles import check_deepspeed_release
from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import Framework
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import TrainingSpec


def test_unknown_release_is_refused_naming_the_allowed_ones():
    training = TrainingSpec(framework=Framework.megatron_deepspeed, deepspeed_release="0.6.0")
    with pytest.raises(ZeroplanError, match=r"deepspeed_release.*allowed: 0\.19\.8, 2022-bigscience"):
        check_deepspeed_release(training)


def test_partition_keeps_every_whole_gradient_it_overlaps():
    # Two ranks, tensors of 6, 4 and 6 elements: the flat group of 16 (aligned to 4 per rank)
    # splits at 8, so rank 0 holds the first tensor whole and half the second, rank 1 the rest:
    # each keeps two whole .grad tensors (10 and 10 elements), the largest piece 6.
    assert partition_pieces([6, 4, 6], 2) == (8, 10, 6)
    # One rank keeps everything and its partition is the padded group.
    assert partition_pieces([6, 4, 6], 1) == (16, 16, 6)


def _request(*flags: str):
    args = build_parser().parse_args(["fit", "gpt2-124m", "--gpus", "2", "--gpu", "a100-80gb", "--tp", "2",
                                      "--framework", "megatron-deepspeed", "--precision", "fp16-mixed",
                                      "--grad-accum", "4", *flags])
    return request_from_args(args, StrategyKind.zero1)


def test_2022_terms_at_one_data_parallel_rank():
    """At dp 1 the 2022 step keeps every 16-bit .grad (2 bytes a trainable element) beside the
    weight-decay group's flat 16-bit copy and fp32 cast; the micro-steps carry the 16-bit
    gradients with no bucket; the reduction copies its largest bucket."""

    old, new = _request(), _request("--deepspeed-release", "2022-bigscience")
    states = model_state_bytes(new)
    assert states == model_state_bytes(old)
    decayed, no_decay = group_numels(new)
    trainable = sum(decayed) + sum(no_decay)
    flat = sum(decayed) + sum(decayed) % 2  # one rank: the group padded to 2 elements
    assert deepspeed_accumulated_gradient_bytes(new) == 2 * trainable < deepspeed_accumulated_gradient_bytes(old)
    assert optimizer_step_temporary_bytes(new, states.optimizer_elements) == 2 * trainable + 6 * flat - states.gradient_bytes
    # Buckets of whole tensors up to 5e8 elements: the model's 16-bit gradients in one.
    assert backward_end_buffer_bytes(new) == transient_buffer_bytes(new) == 2 * trainable
    assert backward_end_buffer_bytes(old) is None
    assert block_backward_transient_bytes(_request("--deepspeed-release", "2022-bigscience", "--grad-accum", "1")) == 0


def test_the_replayed_rank_is_the_one_with_the_largest_piece():
    # Tensors 10, 2, 2, 2 over two ranks (partition 8): rank 0 holds a piece of 8 of the first
    # tensor, rank 1 the last 2 of it and three whole small ones (more .grad elements kept,
    # 16 against 10): the copies of rank 0's piece are the step's largest, so its step is taken.
    from zeroplan.core.deepspeed_2022 import partition_tensor_pieces

    assert partition_pieces([10, 2, 2, 2], 2) == (8, 16, 2)
    assert partition_tensor_pieces([10, 2, 2, 2], 2) == (8, (0,), (8,))


def test_the_step_replayed_tensor_by_tensor_peaks_at_the_planners_step():
    """The 2022 step's allocations in their order (kept .grad tensors, overflow and norm copies,
    flat 16-bit and fp32 partitions), replayed at one rank, reach step_peak_bytes at their most."""
    from zeroplan.core.deepspeed_2022 import FP32_BYTES, OVERFLOW_COPY_BYTES, step_allocations, step_peak_bytes
    from zeroplan.core.deepspeed_step import NORM_COPY_BYTES

    request = _request("--deepspeed-release", "2022-bigscience")
    grads, kept, group_kept, groups = step_allocations(request)
    alive = sum(grads[i] for i in kept)
    most = alive + max(OVERFLOW_COPY_BYTES * p for _, _, pieces in groups for p in pieces)
    for (flat, fp32, pieces), members in zip(groups, group_kept):
        most = max(most, alive + NORM_COPY_BYTES * max(pieces))
        alive += fp32
        most = max(most, alive + flat)
        alive -= sum(grads[i] for i in members)
    assert most == step_peak_bytes(request)
    assert all(fp32 == FP32_BYTES * flat // 2 for flat, fp32, _ in groups)  # fp16 flat, fp32 cast
