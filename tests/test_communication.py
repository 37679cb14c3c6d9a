"""Collectives per step: ring bytes, the ZeRO paper's volumes, accumulation and HSDP."""

from __future__ import annotations

import pytest

from zeroplan.core.communication import CollectiveOp, Phase, collectives, ddp_bucket_sizes, ring_sent_bytes
from zeroplan.core.deepspeed_buckets import flat_group_elements, gradient_all_reduce_elements
from zeroplan.core.layout import element_bytes
from zeroplan.core.params import parameter_units, total_parameters
from zeroplan.core.zero_paper import zero_communication_volume
from zeroplan.specs import (
    BatchSpec, ModelSpec, PlanRequest, StrategyKind, StrategySpec, ZeroGradientReduce, cluster_from_gpus,
)

MODEL = ModelSpec(name="divisible", vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, ffn_hidden_size=1024)
PSI = total_parameters(MODEL)


def _request(gpu, kind, gpus=8, gpus_per_node=8, accum=1, **strategy) -> PlanRequest:
    return PlanRequest(
        model=MODEL, batch=BatchSpec(grad_accum_steps=accum),
        cluster=cluster_from_gpus(gpu, gpus, gpus_per_node=gpus_per_node),
        strategy=StrategySpec(kind=kind, **strategy),
    )


def test_ring_bytes() -> None:
    assert ring_sent_bytes(CollectiveOp.all_reduce, 800, 8) == 2 * 7 * 100
    assert ring_sent_bytes(CollectiveOp.all_gather, 800, 8) == ring_sent_bytes(CollectiveOp.reduce_scatter, 800, 8) == 700
    assert ring_sent_bytes(CollectiveOp.all_gather, 800, 1) == 0
    assert ring_sent_bytes(CollectiveOp.broadcast, 800, 8) == 800
    assert ring_sent_bytes(CollectiveOp.broadcast, 800, 1) == 0


def test_zero_redundancy_optimizer_all_reduces_and_broadcasts(gpu_80gib) -> None:
    request = _request(gpu_80gib, StrategyKind.zero1, zero_gradient_reduce=ZeroGradientReduce.ddp_buckets)
    steps = collectives(request)
    assert [(c.op, c.phase) for c in steps] == [
        (CollectiveOp.all_reduce, Phase.backward), (CollectiveOp.broadcast, Phase.step)]
    grads, params = steps
    eb = element_bytes(request.training.precision, request.convention)
    assert (grads.buffer_bytes, params.buffer_bytes) == (eb.gradient * PSI, eb.compute_parameter * PSI)
    assert params.calls == sum(len(u.tensors) for u in parameter_units(MODEL))


@pytest.mark.parametrize(
    "kind,stage",
    [(StrategyKind.ddp, 0), (StrategyKind.zero1, 1), (StrategyKind.zero2, 2), (StrategyKind.zero3, 3), (StrategyKind.fsdp_full_shard, 3)],
)
def test_volume_matches_zero_paper_sec_7(gpu_80gib, kind, stage) -> None:
    # The paper's stages 1-2 reduce-scatter, as zeroplan's reference engine does (per-unit).
    knobs = {"zero_gradient_reduce": ZeroGradientReduce.per_unit} if stage in (1, 2) else {}
    steps = collectives(_request(gpu_80gib, kind, **knobs))
    assert sum(c.volume_elements_per_step for c in steps) == zero_communication_volume(PSI, stage)


def test_ddp_sends_2_n_minus_1_over_n_of_the_gradients(gpu_80gib) -> None:
    # PyTorch DDP under autocast all-reduces its fp32 gradients.
    (all_reduce,) = collectives(_request(gpu_80gib, StrategyKind.ddp))
    assert all_reduce.op is CollectiveOp.all_reduce and all_reduce.buffer_bytes == 4 * PSI
    assert all_reduce.sent_bytes_per_step == pytest.approx(2 * 7 / 8 * 4 * PSI, rel=1e-6)


def test_ddp_buckets_start_with_one_mib() -> None:
    sizes = ddp_bucket_sizes(60 * 2**20, 25 * 2**20)
    assert sizes == [2**20, 25 * 2**20, 25 * 2**20, 9 * 2**20]


def test_zero3_gathers_twice_per_micro_batch(gpu_80gib) -> None:
    steps = collectives(_request(gpu_80gib, StrategyKind.zero3, accum=4))
    by_phase = {(c.op, c.phase): c for c in steps}
    assert by_phase[(CollectiveOp.all_gather, Phase.forward)].occurrences_per_step == 4
    assert by_phase[(CollectiveOp.all_gather, Phase.backward)].occurrences_per_step == 4
    assert by_phase[(CollectiveOp.reduce_scatter, Phase.backward)].occurrences_per_step == 4
    assert by_phase[(CollectiveOp.all_gather, Phase.forward)].calls == MODEL.num_layers + 2


@pytest.mark.parametrize("mode,gradient_op", [
    (ZeroGradientReduce.per_unit, CollectiveOp.reduce_scatter), (ZeroGradientReduce.bucket, CollectiveOp.all_reduce),
])
def test_zero1_reduces_once_zero2_every_micro_batch(gpu_80gib, mode, gradient_op) -> None:
    def by_what(kind):
        return {c.what: c for c in collectives(_request(gpu_80gib, kind, accum=4, zero_gradient_reduce=mode))}
    zero1, zero2 = by_what(StrategyKind.zero1), by_what(StrategyKind.zero2)
    assert zero1["gradients"].op is zero2["gradients"].op is gradient_op
    assert zero1["gradients"].occurrences_per_step == 1
    assert zero2["gradients"].occurrences_per_step == 4
    assert zero1["parameters"].occurrences_per_step == zero2["parameters"].occurrences_per_step == 1


@pytest.mark.parametrize("kind", [StrategyKind.zero1, StrategyKind.zero2, StrategyKind.zero2_offload])
def test_deepspeed_zero12_all_reduces_gradients_and_gathers_the_flat_group(gpu_80gib, kind) -> None:
    # DeepSpeed 0.19.8 defaults (use_multi_rank_bucket_allreduce=True): no reduce-scatter; the
    # whole model fits one 5e8-element bucket, so one bf16 all-reduce of PSI and one all-gather.
    steps = collectives(_request(gpu_80gib, kind))
    assert CollectiveOp.reduce_scatter not in {c.op for c in steps}
    by_what = {c.what: c for c in steps}
    grads, params = by_what["gradients"], by_what["parameters"]
    assert (grads.op, grads.calls, grads.buffer_bytes) == (CollectiveOp.all_reduce, 1, 2 * PSI)
    assert (params.op, params.calls, params.buffer_bytes) == (CollectiveOp.all_gather, 1, 2 * flat_group_elements(PSI, 8))
    # bf16: the overflow flag (uint8) and the gradient norm (fp32), one element each.
    assert (by_what["overflow flag"].buffer_bytes, by_what["gradient norm"].buffer_bytes) == (1, 4)
    # 2*PSI (all-reduce) + PSI (all-gather): half again the paper's 2*PSI for stages 1-2.
    big = sum(c.volume_elements_per_step for c in steps if c.what in ("gradients", "parameters"))
    assert big == 2 * PSI + flat_group_elements(PSI, 8)


def test_deepspeed_flat_group_pads_to_twice_the_ranks() -> None:
    assert flat_group_elements(16, 8) == 16
    assert flat_group_elements(17, 8) == 32
    assert flat_group_elements(17, 3) == 18


def test_deepspeed_reduce_buckets() -> None:
    # Greedy buckets of at most the cap, flushed before a gradient that would overflow it.
    assert gradient_all_reduce_elements([4, 4, 4], [2, 1, 0], 8, 2) == [8, 4]
    assert gradient_all_reduce_elements([3, 4, 4], [0, 1, 2], 8, 2) == [7, 4]
    # A gradient above the cap goes alone, cut at the rank partitions (flat 24 -> 12 each, over 2
    # ranks: pieces 2..12 and 12..22); pieces are all-reduced once their sum exceeds the cap.
    assert gradient_all_reduce_elements([2, 20, 2], [2, 1, 0], 8, 2) == [2, 10, 10, 2]
    assert gradient_all_reduce_elements([2, 20, 2], [2, 1, 0], 12, 2) == [2, 20, 2]


def test_shard_grad_op_skips_backward_gather(gpu_80gib) -> None:
    phases = {(c.op, c.phase) for c in collectives(_request(gpu_80gib, StrategyKind.fsdp_shard_grad_op))}
    assert (CollectiveOp.all_gather, Phase.backward) not in phases
    assert (CollectiveOp.all_gather, Phase.forward) in phases


def test_hsdp_shards_in_node_and_all_reduces_across(gpu_80gib) -> None:
    steps = collectives(_request(gpu_80gib, StrategyKind.hsdp, gpus=32, gpus_per_node=8))
    across = [c for c in steps if c.op is CollectiveOp.all_reduce]
    inside = [c for c in steps if c.op is not CollectiveOp.all_reduce]
    assert all(c.group_size == 8 and not c.spans_nodes for c in inside)
    (all_reduce,) = across
    assert all_reduce.group_size == 4 and all_reduce.spans_nodes
    assert all_reduce.buffer_bytes == 4 * PSI // 8  # one fp32 gradient shard (reduce_dtype=fp32)


def test_fsdp_reduce_dtype_knob(gpu_80gib) -> None:
    fp32 = {c.what: c for c in collectives(_request(gpu_80gib, StrategyKind.fsdp_full_shard))}
    bf16 = {c.what: c for c in collectives(_request(gpu_80gib, StrategyKind.fsdp_full_shard, fsdp_reduce_in_fp32=False))}
    assert fp32["gradients"].buffer_bytes == 2 * bf16["gradients"].buffer_bytes == 4 * PSI
    assert fp32["parameters"].buffer_bytes == bf16["parameters"].buffer_bytes == 2 * PSI


def test_single_gpu_has_no_collectives(gpu_80gib) -> None:
    assert collectives(_request(gpu_80gib, StrategyKind.zero3, gpus=1, gpus_per_node=1)) == []


@pytest.mark.parametrize("kind", [StrategyKind.zero1, StrategyKind.zero2, StrategyKind.zero2_offload])
def test_deepspeed_zero_1_2_reduce_gradients_outside_the_backward_unless_overlap_comm(gpu_80gib, kind) -> None:
    # deepspeed 0.19.8 runtime/zero/config.py overlap_comm_valid: false below stage 3 unless set;
    # stage_1_and_2.py average_tensor reduces on the compute stream without it.
    def gradient_phases(**strategy) -> set[Phase]:  # type: ignore[no-untyped-def]
        return {c.phase for c in collectives(_request(gpu_80gib, kind, **strategy)) if c.what == "gradients"}

    assert gradient_phases() == {Phase.step}
    assert gradient_phases(deepspeed_overlap_comm=True) == {Phase.backward}
    if kind is not StrategyKind.zero2_offload:
        # zeroplan's per-unit reference ZeRO reduces from its backward hooks, as DDP does
        assert gradient_phases(zero_gradient_reduce=ZeroGradientReduce.per_unit) == {Phase.backward}
    # stage 3 overlaps by DeepSpeed's default
    assert {c.phase for c in collectives(_request(gpu_80gib, StrategyKind.zero3)) if c.what == "gradients"} == {Phase.backward}


def test_ring_sent_bytes_sum_is_the_per_call_sum() -> None:
    """collective_of_sizes sums the ring's sent bytes per size in closed form: the same integers
    as ring_sent_bytes call by call, for every op, one rank or many, sizes not dividing the group."""
    from collections import Counter

    from zeroplan.core.collective import ring_sent_bytes_sum

    calls = [0, 1, 7, 1023, 2**20, 2**20 + 3, 25 * 2**20, 10**11 + 1, 7, 7, 1023]
    for op in CollectiveOp:
        for group in (1, 2, 3, 8, 65536):
            sizes = Counter(calls)
            assert ring_sent_bytes_sum(op, sizes, group) == sum(ring_sent_bytes(op, s, group) for s in calls)


def test_ddp_bucket_counts_count_ddp_bucket_sizes() -> None:
    """The DDP collective counts its buckets without listing them: the same sizes, counts and
    first-met order as counting the list (a cap equal to the first bucket, or to the last, merges)."""
    from collections import Counter

    from zeroplan.core.communication import ddp_bucket_counts

    mib = 2**20
    for total in (0, 1, mib - 1, mib, mib + 1, 2 * mib, 26 * mib, 27 * mib + 5, 3 * mib + mib // 2):
        for cap in (mib, mib // 2, 25 * mib, 3, mib + mib // 2):
            counted = ddp_bucket_counts(total, cap)
            assert list(counted.items()) == list(Counter(ddp_bucket_sizes(total, cap)).items())
