"""Ring bandwidth over the NICs of a node (zeroplan/core/network.py), checked by hand against
the catalog's DGX H100 figures: NVLink 4 450 GB/s per GPU and direction, 8 x 400 Gb/s NICs."""

from __future__ import annotations

import pytest

from zeroplan.core.communication import CollectiveOp, collectives
from zeroplan.core.network import inter_node_hop_bandwidth_bytes_per_s, ring_bandwidth_bytes_per_s
from zeroplan.core.timing import collective_time_s
from zeroplan.presets.gpus import get_gpu, load_gpu_file
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, PerformanceAssumptions, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus,
)
from zeroplan.units import GB

H100 = get_gpu("h100-80gb")
NIC_BYTES_PER_S = 400 / 8 * GB  # ConnectX-7, 400 Gb/s
NVLINK_BYTES_PER_S = 450 * GB
IB_LATENCY_S = 10e-6
# These checks derive the ring's time by hand, so they force NCCL's ring on the datasheet figures;
# tests/test_algorithms.py checks which algorithm NCCL's model picks and what it costs.
RING_NOMINAL = PerformanceAssumptions(algorithm="ring", bandwidth="nominal")


def _request(kind: StrategyKind, gpus: int, shard_group: int | None = None, gpu=H100) -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-2-7b"), training=TrainingSpec(),
        batch=BatchSpec(micro_batch_size=1, seq_len=4096),
        cluster=cluster_from_gpus(gpu, gpus, gpus_per_node=8),
        strategy=StrategySpec(kind=kind, shard_group_size=shard_group), performance=RING_NOMINAL,
    )


def test_catalog_h100_declares_eight_400g_nics() -> None:
    network = H100.node_network
    assert network is not None and network.nics_per_node == 8
    assert network.nic_bandwidth_bytes_per_s == NIC_BYTES_PER_S
    # The per-GPU share the inter-node link keeps is the node's NICs over its 8 GPUs.
    assert H100.inter_node_link.bandwidth_bytes_per_s == network.nics_per_node * NIC_BYTES_PER_S / 8


def test_ddp_all_reduce_on_two_h100_nodes_by_hand() -> None:
    request = _request(StrategyKind.ddp, 16)
    (all_reduce,) = collectives(request)
    assert all_reduce.op is CollectiveOp.all_reduce and all_reduce.spans_nodes
    # Each rank sends 2 (N-1)/N of every bucket: 30 ceil(S/16) bytes for N = 16.
    buckets_bytes = all_reduce.buffer_bytes
    assert abs(all_reduce.sent_bytes_per_call_sum - 30 * buckets_bytes / 16) <= 30 * all_reduce.calls
    # The rings leave each node over all 8 NICs: min(450 GB/s NVLink, 8 x 50 GB/s) = 400 GB/s,
    # and every one of the 2 (N-1) = 30 ring steps of every bucket pays the 10 us IB latency.
    by_hand_s = all_reduce.calls * 30 * IB_LATENCY_S + all_reduce.sent_bytes_per_call_sum / (8 * NIC_BYTES_PER_S)
    assert collective_time_s(request, all_reduce) == pytest.approx(by_hand_s, rel=1e-12)
    # Charged at one GPU's 50 GB/s share, the bandwidth term would be 8x longer.
    bandwidth_s = collective_time_s(request, all_reduce) - all_reduce.calls * 30 * IB_LATENCY_S
    assert 8 * bandwidth_s == pytest.approx(all_reduce.sent_bytes_per_call_sum / NIC_BYTES_PER_S, rel=1e-9)


def test_hsdp_replica_group_has_one_member_per_node_and_one_nic() -> None:
    request = _request(StrategyKind.hsdp, 16)  # shard group = the 8 GPUs of a node
    inside = [c for c in collectives(request) if c.op is not CollectiveOp.all_reduce]
    (replica,) = [c for c in collectives(request) if c.op is CollectiveOp.all_reduce]
    assert all(not c.spans_nodes and c.group_size == 8 for c in inside)
    assert replica.group_size == 2 and replica.spans_nodes and replica.ranks_per_node == 1
    # Eight replica groups (one per local rank) run at once, each on its GPU's own NIC.
    by_hand_s = replica.calls * 2 * IB_LATENCY_S + replica.sent_bytes_per_call_sum / NIC_BYTES_PER_S
    assert collective_time_s(request, replica) == pytest.approx(by_hand_s, rel=1e-12)
    for collective in inside:
        steps = collective.calls * 7 * H100.intra_node_link.latency_s
        assert collective_time_s(request, collective) == pytest.approx(
            collective.occurrences_per_step * (steps + collective.sent_bytes_per_call_sum / NVLINK_BYTES_PER_S), rel=1e-12)


def test_hsdp_half_node_shard_groups_give_replica_groups_two_members_per_node() -> None:
    request = _request(StrategyKind.hsdp, 16, shard_group=4)
    (replica,) = [c for c in collectives(request) if c.op is CollectiveOp.all_reduce]
    assert replica.group_size == 4 and replica.ranks_per_node == 2
    # Four such groups share the node's 8 NICs: 2 NICs each, 100 GB/s.
    assert inter_node_hop_bandwidth_bytes_per_s(H100, 8, 2) == 2 * NIC_BYTES_PER_S


@pytest.mark.parametrize("ranks_per_node", [1, 2, 4, 8])
def test_fewer_nics_than_gpus_share_them(ranks_per_node: int) -> None:
    # DGX-1: 4 x 100 Gb/s EDR for 8 GPUs; the groups of one collective split the node's 50 GB/s.
    v100 = get_gpu("v100-32gb")
    node_bytes_per_s = 4 * 100 / 8 * GB
    expected = node_bytes_per_s * ranks_per_node / 8
    assert inter_node_hop_bandwidth_bytes_per_s(v100, 8, ranks_per_node) == pytest.approx(expected)
    assert ring_bandwidth_bytes_per_s(v100, 8, ranks_per_node, spans_nodes=True) == pytest.approx(expected)


def test_one_node_rings_stay_on_the_intra_node_link() -> None:
    for m in (1, 4, 8):
        assert ring_bandwidth_bytes_per_s(H100, 8, m, spans_nodes=False) == NVLINK_BYTES_PER_S


def test_old_gpu_files_without_a_node_network_still_load(tmp_path) -> None:
    data = H100.model_dump()
    del data["node_network"]
    path = tmp_path / "old.json"
    path.write_text(__import__("json").dumps(data), encoding="utf-8")
    gpu = load_gpu_file(path)
    assert gpu.node_network is None
    # One NIC per GPU at the per-GPU share: the same 400 GB/s node as the catalog's.
    assert inter_node_hop_bandwidth_bytes_per_s(gpu, 8, 8) == 8 * NIC_BYTES_PER_S
