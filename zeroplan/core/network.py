"""Which bandwidth and latency bound a ring collective, with NICs per node and rail-optimised
multi-node rings as NCCL builds them. docs/communication-time.md ("Which link") derives it.

NCCL (src/graph/search.cc, v2.18-2.23) builds one ring per channel; a ring that spans nodes
enters and leaves each node once, through the NIC nearest the GPU at that end (rail-optimised:
GPU i uses NIC i), and the channels are spread over all NICs of the node. Its tuning model
(src/graph/tuning.cc, ncclTopoTuneModel) then takes bus bandwidth = nChannels x per-channel
bandwidth. So the bus bandwidth of a node-spanning ring is the NIC bandwidth its node crossings
can use, not one GPU's share of it.
"""

from __future__ import annotations

from zeroplan.specs.hardware import GpuSpec, LinkSpec


def node_nics(gpu: GpuSpec, gpus_per_node: int) -> tuple[int, float]:
    """(NICs per node, bytes/s of one NIC); without a declared node network, one NIC per GPU of
    the node at the inter-node link's (per-GPU share) bandwidth."""
    if gpu.node_network is None:
        return gpus_per_node, gpu.inter_node_link.bandwidth_bytes_per_s
    return gpu.node_network.nics_per_node, gpu.node_network.nic_bandwidth_bytes_per_s


# NCCL src/graph/search.cc: each channel of a node-spanning ring leaves a node through the NIC of
# its exit GPU, and the channels are spread over the NICs, so m members of the group on a node
# reach min(m, NICs) of them; all the groups of one collective (G/m per node, e.g. HSDP's
# replica groups) run at once and share the node's NICs: at most m/G of the node's bandwidth.
def inter_node_hop_bandwidth_bytes_per_s(gpu: GpuSpec, gpus_per_node: int, ranks_per_node: int) -> float:
    """Bandwidth of one node's crossings of a ring with ``ranks_per_node`` (m) members per node."""
    nics, nic_bytes_per_s = node_nics(gpu, gpus_per_node)
    member_nics_bytes_per_s = min(ranks_per_node, nics) * nic_bytes_per_s
    node_share_bytes_per_s = nics * nic_bytes_per_s * min(ranks_per_node, gpus_per_node) / gpus_per_node
    return min(member_nics_bytes_per_s, node_share_bytes_per_s)


# Bus bandwidth of a ring = its slowest hop (NCCL src/graph/tuning.cc: busBw = nChannels x bw, the
# per-channel bw bounded by both the intra-node path and the NIC in search.cc): intra-node hops
# (NVLink) exist when the group has m > 1 members on a node; node crossings when it spans nodes.
def ring_bandwidth_bytes_per_s(gpu: GpuSpec, gpus_per_node: int, ranks_per_node: int, spans_nodes: bool) -> float:
    """Bytes per second one rank of the ring sends (NCCL's bus bandwidth)."""
    if not spans_nodes:
        return gpu.intra_node_link.bandwidth_bytes_per_s
    inter = inter_node_hop_bandwidth_bytes_per_s(gpu, gpus_per_node, ranks_per_node)
    if ranks_per_node > 1:
        return min(gpu.intra_node_link.bandwidth_bytes_per_s, inter)
    return inter


# Alpha-beta model: every ring step waits for its slowest hop, so a node-spanning ring pays the
# inter-node latency per step (Thakur, Rabenseifner & Gropp 2005, sec. 4).
def ring_latency_link(gpu: GpuSpec, spans_nodes: bool) -> LinkSpec:
    """The link whose latency each ring step pays."""
    return gpu.inter_node_link if spans_nodes else gpu.intra_node_link


def contiguous_ranks_per_node(group_size: int, gpus_per_node: int) -> int:
    """Members per node of a group of consecutive ranks (DDP, ZeRO, FSDP, HSDP's shard group)."""
    return min(group_size, gpus_per_node)


def strided_ranks_per_node(shard_group_size: int, gpus_per_node: int) -> int:
    """Members per node of HSDP's replica group (ranks r, r+G, r+2G, ...): one per node when
    the shard group G fills a node or more, else G-per-node apart within a node."""
    return max(1, gpus_per_node // shard_group_size)
