"""Step time: alpha-beta communication, FLOPs-based compute, overlap, offload transfers."""

from __future__ import annotations

import pytest

from zeroplan.core.communication import Phase, collectives
from zeroplan.core.flops import step_flops
from zeroplan.core.params import block_linear_weight_elements, total_parameters
from zeroplan.core.plan import plan
from zeroplan.core.timing import (
    collective_time_s, cpu_optimizer_bytes_per_element, cpu_optimizer_time_s, host_transfer_bytes,
    step_time,
)
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    ActivationCheckpointing, BatchSpec, GpuSpec, HostSpec, LinkSpec, NodeNetworkSpec, Optimizer, PerformanceAssumptions,
    PlanRequest,
    StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus,
)
from zeroplan.units import GiB

FAST = LinkSpec(name="fast", bandwidth_bytes_per_s=400e9, latency_s=0.0)
SLOW = LinkSpec(name="slow", bandwidth_bytes_per_s=50e9, latency_s=0.0)
GPU = GpuSpec(name="t", display_name="t", memory_bytes=80 * GiB, peak_bf16_flops_per_s=1e15,
              intra_node_link=FAST, inter_node_link=SLOW, host_link=SLOW, source="test")


def _request(kind, gpus=8, gpus_per_node=8, model="llama-2-7b", accum=1, **training) -> PlanRequest:
    return PlanRequest(
        model=get_model(model), training=TrainingSpec(**training),
        batch=BatchSpec(micro_batch_size=1, seq_len=4096, grad_accum_steps=accum),
        cluster=cluster_from_gpus(GPU, gpus, gpus_per_node=gpus_per_node), strategy=StrategySpec(kind=kind),
    )


def test_bandwidth_term_is_sent_bytes_over_link() -> None:
    request = _request(StrategyKind.ddp)
    (all_reduce,) = collectives(request)
    assert collective_time_s(request, all_reduce) == pytest.approx(all_reduce.sent_bytes_per_step / 400e9)


def test_crossing_nodes_is_bound_by_the_node_nics_not_one_gpu_share() -> None:
    inside = _request(StrategyKind.zero3, gpus=8)
    across = _request(StrategyKind.zero3, gpus=16)
    t_inside = sum(collective_time_s(inside, c) for c in collectives(inside))
    t_across = sum(collective_time_s(across, c) for c in collectives(across))
    # No node network declared: one NIC per GPU at the 50 GB/s share, 8 x 50 = 400 GB/s = the
    # intra-node link, so only the bytes change: (15/16)/(7/8) more per rank.
    assert t_across / t_inside == pytest.approx((15 / 16) / (7 / 8), rel=1e-3)
    # Two 50 GB/s NICs for the node: the rings share 100 GB/s, 4x slower than NVLink.
    two_nics = GPU.model_copy(update={"node_network": NodeNetworkSpec(nics_per_node=2, nic_bandwidth_bytes_per_s=50e9, source="t")})
    narrow = across.model_copy(update={"cluster": cluster_from_gpus(two_nics, 16)})
    t_narrow = sum(collective_time_s(narrow, c) for c in collectives(narrow))
    assert t_narrow / t_inside == pytest.approx(4 * (15 / 16) / (7 / 8), rel=1e-3)


def test_latency_term_counts_ring_steps_and_calls() -> None:
    # An idealised link past LinkSpec's bounds (model_construct skips them): latency alone.
    gpu = GPU.model_copy(update={"intra_node_link": LinkSpec.model_construct(name="l", bandwidth_bytes_per_s=1e30, latency_s=1e-5)})
    request = _request(StrategyKind.zero3).model_copy(update={"cluster": cluster_from_gpus(gpu, 8)})
    forward = next(c for c in collectives(request) if c.phase.value == "forward")
    assert collective_time_s(request, forward) == pytest.approx(forward.calls * 7 * 1e-5, rel=1e-6)
    # NCCL's tree all-reduce (tuning.cc v2.28.3): 2 ((ranks per node - 1) alpha_intra + log2i(nodes)
    # alpha_inter) per call. On 2 nodes of 8 with 10 us on both links: 2 (7 + 1) x 10 us = 160 us,
    # where the ring pays 2 (16 - 1) = 30 steps of 10 us.
    link = LinkSpec.model_construct(name="l", bandwidth_bytes_per_s=1e30, latency_s=1e-5)
    two_nodes = GPU.model_copy(update={"intra_node_link": link, "inter_node_link": link})
    tree = _request(StrategyKind.ddp, gpus=16).model_copy(update={
        "cluster": cluster_from_gpus(two_nodes, 16),
        "performance": PerformanceAssumptions(algorithm="tree", bandwidth="nominal"),
    })
    (all_reduce,) = collectives(tree)
    assert collective_time_s(tree, all_reduce) == pytest.approx(all_reduce.calls * 2 * (7 + 1) * 1e-5, rel=1e-6)
    ring = tree.model_copy(update={"performance": PerformanceAssumptions(algorithm="ring", bandwidth="nominal")})
    assert collective_time_s(ring, all_reduce) == pytest.approx(all_reduce.calls * 30 * 1e-5, rel=1e-6)


def test_compute_is_the_matmul_weights_times_6_plus_causal_flash_attention() -> None:
    # Llama 2 7B: the blocks' linear weights and the output projection, 2 FLOPs each per token
    # forward and 4 backward (the embedding lookup none); QK^T and AV 4*s*d*a per block forward,
    # half of it causal, 3.5x for forward + flash backward; full recomputation adds the blocks'
    # forward again, less each block's down projection (h x f), which the harness's
    # non-reentrant checkpoint stops before.
    model = get_model("llama-2-7b")
    s, h, a, d, L = 4096, model.hidden_size, model.num_heads, model.head_size, model.num_layers
    matmul_weights = L * block_linear_weight_elements(model) + model.vocab_size * h
    attention = L * 4 * s * d * a / 2
    flops = step_flops(_request(StrategyKind.ddp, accum=2))
    assert flops.forward_flops == pytest.approx(2 * s * (2 * matmul_weights + attention), rel=1e-12)
    assert flops.forward_flops + flops.backward_flops == pytest.approx(2 * s * (6 * matmul_weights + 3.5 * attention), rel=1e-12)
    flops = step_flops(_request(StrategyKind.ddp, activation_checkpointing=ActivationCheckpointing.full))
    recomputed = 2 * L * (block_linear_weight_elements(model) - h * model.ffn_hidden_size) + attention
    assert flops.forward_flops + flops.backward_flops == pytest.approx(s * (6 * matmul_weights + 3.5 * attention + recomputed), rel=1e-12)


def test_moe_compute_uses_active_parameters() -> None:
    # Mixtral 8x7B: 12,879,925,248 active parameters, less the embedding (V h) and the norms
    # ((2L + 1) h), are the matmul weights a token passes through (router included).
    model = get_model("mixtral-8x7b")
    h, L = model.hidden_size, model.num_layers
    matmul_weights = 12_879_925_248 - model.vocab_size * h - (2 * L + 1) * h
    forward = step_flops(_request(StrategyKind.zero3, model="mixtral-8x7b")).forward_flops
    assert forward == pytest.approx(4096 * (2 * matmul_weights + L * 4 * 4096 * model.head_size * model.num_heads / 2), rel=1e-12)


def test_overlap_never_slower_and_exposed_bounded() -> None:
    from zeroplan.errors import ZeroplanError
    from zeroplan.presets.gpus import get_gpu

    for kind in StrategyKind:
        request = _request(kind, gpus=16)
        if kind.quantizes_communication:
            # ZeRO++'s quantization kernels are timed at a measured memory bandwidth (the
            # roofline's ceilings): refused on this made-up GPU, checked on an A100.
            with pytest.raises(ZeroplanError, match="allowed: a100-40gb"):
                step_time(request, tuple(collectives(request)))
            request = request.model_copy(update={"cluster": cluster_from_gpus(get_gpu("a100-80gb"), 16, gpus_per_node=8)})
        t = step_time(request, tuple(collectives(request)))
        assert t.step_with_overlap_s <= t.step_without_overlap_s + 1e-12
        assert 0 <= t.exposed_communication_s <= t.communication_s + t.host_transfer_s + t.nvme_transfer_s + 1e-12
        assert t.step_with_overlap_s == pytest.approx(t.compute_s + t.exposed_communication_s + t.cpu_optimizer_s
                                                      + t.optimizer_step_s)
        assert (t.cpu_optimizer_s > 0) == kind.offloads_optimizer


def test_zero1_parameter_gather_is_exposed() -> None:
    request = _request(StrategyKind.zero1)
    t = step_time(request, tuple(collectives(request)))
    gather = next(c for c in collectives(request) if c.phase.value == "step")
    assert t.exposed_communication_s >= collective_time_s(request, gather)


def test_offload_moves_gradients_down_and_parameters_up() -> None:
    # deepspeed 0.19.8 stage3.py partition_grads: one bf16 copy down and one up per micro-batch,
    # the fp32 gradient down at the boundary; the bf16 partition up after the CPU step
    # (zeroplan.core.deepspeed_offload_time).
    request = _request(StrategyKind.zero3_offload, accum=3)
    moved = host_transfer_bytes(request)
    shard = total_parameters(request.model) / 8  # padding aside
    assert moved[Phase.step] == pytest.approx(2 * shard, rel=1e-6)
    assert moved[Phase.backward] == 8 * moved[Phase.step] and moved[Phase.forward] == 0  # 3 x (2 + 2) + 4
    with_params = host_transfer_bytes(_request(StrategyKind.zero3_param_offload, accum=3))
    assert with_params[Phase.forward] == 3 * moved[Phase.step]
    assert with_params[Phase.backward] == 11 * moved[Phase.step] and with_params[Phase.step] == 0
    assert sum(host_transfer_bytes(_request(StrategyKind.zero3)).values()) == 0


def test_zero2_offload_copies_block_the_backward_without_overlap_comm() -> None:
    # stage_1_and_2.py copy_grads_in_partition: the fp32 slice down at the boundary, and with
    # accumulation the bf16 sum down every micro-batch and up from the second on; on the
    # current stream unless overlap_comm.
    from zeroplan.core.timing import offloaded_optimizer_elements

    one = host_transfer_bytes(_request(StrategyKind.zero2_offload, accum=1))
    three = host_transfer_bytes(_request(StrategyKind.zero2_offload, accum=3))
    step = 2 * offloaded_optimizer_elements(_request(StrategyKind.zero2_offload))  # the bf16 partition up
    assert one[Phase.backward] == 0 and three[Phase.backward] == 0
    # in units of 2 E: up 1 after the step; the fp32 gradient 2; 3 sums down, 2 up.
    assert one[Phase.step] == 3 * step and three[Phase.step] == (1 + 2 + 3 + 2) * step
    overlapped = _request(StrategyKind.zero2_offload, accum=3)
    overlapped = overlapped.model_copy(update={"strategy": StrategySpec(kind=StrategyKind.zero2_offload,
                                                                        deepspeed_overlap_comm=True)})
    moved = host_transfer_bytes(overlapped)
    assert moved[Phase.backward] == 7 * step and moved[Phase.step] == step


def test_fsdp_cpu_offload_moves_shards_per_gather_and_steps_on_the_host() -> None:
    # It left step time unchanged before: 70B's shards per rank cross PCIe three times a
    # micro-batch (forward and backward gathers up, the gradient down), and torch's AdamW runs
    # on the host at 20 element passes in the parameters' dtype.
    from zeroplan.core.timing import TORCH_CPU_ADAM_ACCESSES_PER_ELEMENT, offloaded_optimizer_elements

    request = _request(StrategyKind.fsdp_full_shard, accum=2, framework="torchtune", precision="bf16-pure",
                       fsdp_cpu_offload=True)
    shard = offloaded_optimizer_elements(request)
    moved = host_transfer_bytes(request)
    assert moved[Phase.forward] == 2 * 2 * shard and moved[Phase.backward] == 2 * (2 + 2) * shard and moved[Phase.step] == 0
    host = request.cluster.host
    expected = shard * TORCH_CPU_ADAM_ACCESSES_PER_ELEMENT * 2 / (host.memory_bandwidth_bytes_per_s / 8)
    assert cpu_optimizer_time_s(request) == pytest.approx(expected, rel=1e-12)
    plain = request.model_copy(update={"training": request.training.model_copy(update={"fsdp_cpu_offload": False})})
    offloaded, kept = step_time(request, tuple(collectives(request))), step_time(plain, tuple(collectives(plain)))
    assert offloaded.step_with_overlap_s >= kept.step_with_overlap_s + expected


def test_plan_carries_the_step_time() -> None:
    result = plan(_request(StrategyKind.hsdp, gpus=32))
    assert result.time.communication_s > 0 and result.time.compute_s > 0


def _with_host(request: PlanRequest, **host) -> PlanRequest:
    cluster = request.cluster.model_copy(update={"host": HostSpec(**host)})
    return request.model_copy(update={"cluster": cluster})


def test_cpu_adam_bytes_per_parameter() -> None:
    # fp32 param, grad, m, v read (16 B); param, m, v written (12 B).
    assert cpu_optimizer_bytes_per_element(Optimizer.adamw) == 28
    assert cpu_optimizer_bytes_per_element(Optimizer.sgd) == 12
    assert cpu_optimizer_bytes_per_element(Optimizer.lion) == 20


def test_cpu_step_hand_computed_memory_and_compute_bound() -> None:
    request = _request(StrategyKind.zero3_offload)
    shard = total_parameters(request.model) / 8  # padding aside
    # 8 GPUs share 614.4 GB/s: 76.8 GB/s each, 28 B per parameter for Adam, then 14 B for
    # DeepSpeed's stage-3 unscale (fp32 read + write) and cast to bf16 (fp32 read, bf16 write).
    passes_s = shard * 14 / 76.8e9
    memory = _with_host(request, memory_bandwidth_bytes_per_s=614.4e9, cores_per_node=112,
                        optimizer_elements_per_core_s=1e9)
    assert cpu_optimizer_time_s(memory) == pytest.approx(shard * 28 / 76.8e9 + passes_s, rel=1e-6)
    # 8 cores for 8 GPUs at 1e8 parameters/s each: the compute bound wins the kernel.
    compute = _with_host(request, memory_bandwidth_bytes_per_s=614.4e9, cores_per_node=8,
                         optimizer_elements_per_core_s=1e8)
    assert cpu_optimizer_time_s(compute) == pytest.approx(shard / 1e8 + passes_s, rel=1e-6)
    t = step_time(compute, tuple(collectives(compute)))
    assert t.cpu_optimizer_s == cpu_optimizer_time_s(compute)
    assert t.step_without_overlap_s == pytest.approx(
        t.compute_s + t.communication_s + t.host_transfer_s + t.cpu_optimizer_s)


def test_pcie_shared_by_gpus_behind_one_switch() -> None:
    request = _request(StrategyKind.zero3_offload)
    alone = step_time(request, tuple(collectives(request)))
    shared = _with_host(request, gpus_per_host_link=2)
    paired = step_time(shared, tuple(collectives(shared)))
    assert paired.host_transfer_s == pytest.approx(2 * alone.host_transfer_s)
    assert paired.pcie_s == paired.host_transfer_s
    assert sum(host_transfer_bytes(shared).values()) / 25e9 == pytest.approx(paired.host_transfer_s)


def test_non_offload_rows_ignore_the_host() -> None:
    request = _request(StrategyKind.zero3)
    slow_host = _with_host(request, memory_bandwidth_bytes_per_s=1.0, cores_per_node=1, gpus_per_host_link=8)
    assert step_time(request, tuple(collectives(request))) == step_time(slow_host, tuple(collectives(slow_host)))
