"""Device memory one NCCL communicator holds outside PyTorch's caching allocator, read from NCCL's
own source at v2.28.3-1 (the release zeroplan's algorithm model reads, zeroplan.core.algorithms;
NVLS's buffers and the trees connected at initialisation also at the earlier releases a torch
release loads, zeroplan.core.nccl_release).
Every term is a rank's share; docs/memory-model.md, "Memory outside the allocator". Nothing here
imports torch."""

from __future__ import annotations

from functools import lru_cache

from zeroplan.core.nccl_release import NCCL_MODELLED, NVLS_CHUNKED_FROM, NVLS_FROM, RUNTIME_CONNECT_FROM
from zeroplan.units import KiB, MiB

# src/include/device.h:24 NCCL_STEPS 8: every protocol's buffer is NCCL_STEPS slots.
NCCL_STEPS = 8

# src/init.cc:677 DEFAULT_LL_BUFFSIZE = NCCL_LL_LINES_PER_THREAD (8, device.h:93) x
# NCCL_LL_MAX_NTHREADS (512, device.h:92) x NCCL_STEPS x sizeof(union ncclLLFifoLine) (16 bytes,
# device.h:70: four 32-bit words).
LL_BUFFER_BYTES = 8 * 512 * NCCL_STEPS * 16
"""The LL protocol's buffer of one connection: 512 KiB."""

# src/init.cc:678 DEFAULT_LL128_BUFFSIZE = NCCL_LL128_ELEMS_PER_THREAD (120, device.h:110) x
# NCCL_LL128_MAX_NTHREADS (640, device.h:109) x NCCL_STEPS x sizeof(uint64_t).
LL128_BUFFER_BYTES = 120 * 640 * NCCL_STEPS * 8
"""The LL128 protocol's buffer of one connection: 4.6875 MiB."""

# src/init.cc:679 DEFAULT_BUFFSIZE (1 << 22), NCCL_BUFFSIZE's default.
SIMPLE_BUFFER_BYTES = 4 * MiB
"""The Simple protocol's buffer of one connection (NCCL_BUFFSIZE): 4 MiB."""

# src/init.cc:684 NCCL_P2P_NET_CHUNKSIZE (1 << 17), the step of a send/recv over the network.
P2P_NET_CHUNK_BYTES = 128 * KiB

# src/transport/net.cc:628 NCCL_SHARED_STEPS 16: slots of the shared send/recv buffers.
NCCL_SHARED_STEPS = 16

# src/transport/nvls.cc:147 NVLS_NCHANNELS_SM90 16 (Hopper; nvls.cc:195) and :152 NCCL_NVLS_CHUNKSIZE
# 128 KiB.
NVLS_CHANNELS_SM90 = 16
NVLS_CHUNK_BYTES = 128 * KiB

# src/graph/connect.cc:452 and src/include/device.h MAXCHANNELS 64.
MAX_CHANNELS = 64


# A connection's protocol buffers: src/transport/p2p.cc:447 (recvSetup) sizes the receiver's
# buffer as every protocol's buffSizes[p] (Simple left out under P2P read, when p2p.cc:379
# sendSetup puts it on the sender instead): inside a node the pair of connectors holds one
# buffer per protocol between them.
def connection_bytes() -> int:
    """Device bytes one connection (a channel's link to one peer, one direction) holds inside a
    node: LL + LL128 + Simple, 9.1875 MiB at NCCL's defaults."""
    return LL_BUFFER_BYTES + LL128_BUFFER_BYTES + SIMPLE_BUFFER_BYTES


# src/transport/net.cc:881 (sendProxyConnect): a network send connector also stages LL128 and
# Simple on the device when GPUDirect RDMA is used (useGdr; the receiver's buffers,
# net.cc:1048, are the three of connection_bytes). Without GPUDirect RDMA they live in host
# memory; zeroplan assumes GPUDirect RDMA, what InfiniBand/RoCE training clusters run.
def network_send_staging_bytes() -> int:
    """Device bytes a connection that crosses the network adds on its sending GPU."""
    return LL128_BUFFER_BYTES + SIMPLE_BUFFER_BYTES


# With NCCL_RUNTIME_CONNECT (on by default, src/init.cc:1224) a ring is connected the first time a
# collective runs the ring algorithm (src/enqueue.cc:436), on every one of the communicator's
# channels: each rank then receives from its ring predecessor and sends to its successor on each.
# A group spanning nodes leaves each node once per channel; NCCL puts each channel's crossing on
# a different GPU (one NIC each), so the network connections of a channel fall on 1 / ranks_per_node
# of its ranks on average: each such rank holds its send connector's staging on top.
def ring_bytes(group_size: int, ranks_per_node: int, channels: int) -> int:
    """A rank's device bytes of a communicator of ``group_size`` ranks, ``ranks_per_node`` of
    them on each node, after its first ring collective on ``channels`` channels."""
    if group_size < 2:
        return 0
    spans_nodes = group_size > ranks_per_node
    crossing = network_send_staging_bytes() * channels // ranks_per_node if spans_nodes else 0
    return channels * connection_bytes() + crossing


# Before NCCL_RUNTIME_CONNECT (v2.22.3-1; zeroplan.core.nccl_release) a communicator's
# initialisation connects every channel's tree beside its ring ("Connect Trees", v2.19.3-1
# src/init.cc:1120-1127, v2.10.3-1 :782-789): each rank to its tree parent and children, both
# ways (ncclTransportP2pConnect on connIndex 0, which skips a peer already connected in that
# direction, src/transport.cc:48-54). Inside a node the tree is a chain (src/graph/connect.cc:56-57,
# tree.up = treeIntra[i-1], tree.down[0] = treeIntra[i+1]), and on NVSwitch nodes both searches
# take adjacent GPUs first (src/graph/search.cc:265-276: the ring the next GPU, the tree the
# previous; v2.11.4-1 search.cc:214-245 sorts equal GPUs by their distance from the current one,
# the next first, for both), so the chain links the ring's neighbours: the direction the ring
# already has is reused and the other is a new connection, one per channel on each rank inside
# the chain. The chain's one reverse link where a node holds 2 ranks of a group that spans nodes
# is not counted; the tree's links between nodes are tree_network_bytes.
def tree_chain_bytes(ranks_per_node: int, channels: int) -> int:
    """A rank's device bytes of the tree connections a communicator with ``ranks_per_node`` of its
    ranks on the rank's node adds at initialisation (NCCL before v2.22.3-1), for a rank inside
    the node's chain: 0 where the node holds 2 ranks or fewer."""
    return channels * connection_bytes() if ranks_per_node > 2 else 0


# src/graph/trees.cc ncclGetBtree (v2.11.4-1 and v2.19.3-1 alike): the binary tree over the
# nodes, rooted at 0, whose links follow the lowest set bit of a node's index.
def btree_neighbours(nodes: int, node: int) -> tuple[int, ...]:
    """The parent and children of ``node`` in NCCL's binary tree over ``nodes`` nodes."""
    bit = 1
    while bit < nodes and not bit & node:
        bit <<= 1
    if node == 0:
        return (bit >> 1,) if nodes > 1 else ()
    up = (node ^ bit) | (bit << 1)
    if up >= nodes:
        up = node ^ bit
    low = bit >> 1
    if low == 0:
        return (up,)
    down0, down1 = node - low, node + low
    while down1 >= nodes:
        down1 = node + low if low else -1
        low >>= 1
    return (up, down0) if down1 < 0 else (up, down0, down1)


# trees.cc ncclGetDtree: the second tree of the double binary tree mirrors the first (an even
# number of nodes) or shifts it by one node (an odd number).
def dtree_neighbours(nodes: int, node: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``node``'s tree neighbours in NCCL's first and second tree over ``nodes`` nodes."""
    first = btree_neighbours(nodes, node)
    if nodes % 2:
        second = tuple((n + 1) % nodes for n in btree_neighbours(nodes, (node - 1) % nodes))
    else:
        second = tuple(nodes - 1 - n for n in btree_neighbours(nodes, nodes - 1 - node))
    return first, second


# src/graph/connect.cc connectTrees (v2.11.4-1:122-165; v2.19.3-1 alike): each channel's tree links
# the nodes of ncclGetDtree, the first half of the channels on the first tree and their
# duplicates (connect.cc:60-63) on the second, between the ranks of the node's chain that face the
# network (treeToParent and treeToChild0/1: the chain's first ranks). Every link is connected
# both ways at initialisation: on each end a receive (connection_bytes, under GPUDirect RDMA) and a
# send staging (network_send_staging_bytes). The ring's network links join a node's last chain
# rank to the next node's first (connectRings), so with 3 or more ranks on a node no tree link is
# a ring link (the chains' orders taken as the ring's; with 2, where the last rank is the second
# and a link may be the ring's, none is taken as reused either), and a node's links are shared among its
# ranks as the ring's crossings are (ring_bytes); with one rank a node, a tree link to the ring's
# predecessor reuses the ring's receive and one to its successor the ring's send.
@lru_cache(maxsize=1024)
def tree_network_bytes(group_size: int, ranks_per_node: int, channels: int) -> int:
    """A rank's device bytes, averaged over the group's nodes, of the tree links between nodes that
    a communicator spanning nodes connects at initialisation (NCCL before v2.22.3-1)."""
    if group_size <= ranks_per_node:
        return 0
    nodes = group_size // ranks_per_node
    receive, send = connection_bytes(), network_send_staging_bytes()
    if ranks_per_node > 1:
        # Each tree has nodes - 1 links, each with an end on two nodes: 2 (nodes - 1) link ends.
        ends = 2 * (nodes - 1) * 2
        return channels * ends * (receive + send) // (2 * nodes * ranks_per_node)
    total = 0
    for node in range(nodes):
        prev, nxt = (node - 1) % nodes, (node + 1) % nodes
        for tree in dtree_neighbours(nodes, node):
            total += sum((0 if peer == prev else receive) + (0 if peer == nxt else send) for peer in tree)
    # Half the channels run each tree: channels / 2 x both trees' links, per node.
    return channels * total // (2 * nodes)


# Send/recv (connIndex 1) connects each peer lazily on first use, on p2pnChannelsPerPeer channels
# (src/enqueue.cc:2409). Inside a node every channel of a peer is a P2P connection per direction
# (connection_bytes, p2p.cc:447); to a peer across the network the connectors share per-rank
# buffers of p2pnChannels x NCCL_SHARED_STEPS x P2P_NET_CHUNKSIZE, one for sends and one for
# receives (net.cc:294/336 shared; net.cc:647), on the GPU under GPUDirect RDMA, whatever the
# number of remote peers.
def send_recv_bytes(local_peers: int, remote_peers: int, channels_per_peer: int, p2p_channels: int) -> int:
    """A rank's device bytes of the send/recv connections of one communicator: ``local_peers``
    peers on its node and ``remote_peers`` on other nodes, each exchanged with both ways."""
    local = 2 * local_peers * channels_per_peer * connection_bytes()
    remote = 2 * p2p_channels * NCCL_SHARED_STEPS * P2P_NET_CHUNK_BYTES if remote_peers else 0
    return local + remote


# src/graph/paths.cc:866 p2pnChannelsPerPeer = pow2Up(the fewest channels any peer gets): 2 to a
# peer across the network (paths.cc:824, one NIC), 2 over PCIe (paths.cc:817), 2 x the NVLinks
# between the pair over NVLink (paths.cc:815: every link of the GPU through NVSwitches, 12 on
# A100, 18 on H100); capped at p2pnChannels, pow2Up(min(nChannels, 64)) (paths.cc:847).
def p2p_channels(channels: int) -> int:
    """p2pnChannels: the communicator's channels, rounded up to a power of two."""
    return _pow2_up(min(channels, MAX_CHANNELS))


def p2p_channels_per_peer(channels: int, spans_nodes: bool, nvlink: bool) -> int:
    """p2pnChannelsPerPeer of a communicator: 2 if any peer is across the network or the node
    has no NVLink, else its p2pnChannels (NVSwitch nodes give every pair at least 24)."""
    if spans_nodes or not nvlink:
        return min(2, p2p_channels(channels))
    return p2p_channels(channels)


# src/transport/nvls.cc at v2.19.3-1:240 NVLS_MEM_ALIGN_SIZE (1 << 21): before v2.22.3-1 each NVLS
# buffer carried this much more for its head and tail words (nvls.cc:355-356).
NVLS_MEM_ALIGN_BYTES = 2 * MiB


# src/transport/nvls.cc:335-337 (ncclNvlsBufferSetup): NVLS keeps, per head (one per local GPU:
# search.cc:1014, at most NCCL_MAX_NVLS_ARITY), 2 x nvlsChannels buffers of NCCL_STEPS x
# NVLS_CHUNKSIZE, allocated on first use of the NVLS algorithm (enqueue.cc:436). Earlier releases
# (``nccl``, zeroplan.core.nccl_release) sized them in ncclNvlsSetup at initialisation:
# v2.17.1-1 to v2.20.5-1 (v2.19.3-1 nvls.cc:320-323) as nHeads x nvlsChannels (16, :243) x 2 x
# (NCCL_BUFFSIZE + NVLS_MEM_ALIGN_SIZE), v2.21.5-1 (:310-314) as nHeads x nvlsChannels x 2 x
# (NCCL_STEPS x NVLS_CHUNKSIZE + NVLS_MEM_ALIGN_SIZE). The multicast granularity the size is
# rounded up to (nvlsGetProperties, a driver query) is not modelled.
def nvls_bytes(ranks_per_node: int, nccl: tuple[int, int, int] = NCCL_MODELLED) -> int:
    """A rank's device bytes of a communicator's NVLS buffers on a Hopper NVSwitch node under
    NCCL release ``nccl`` (0 before NVLS existed, v2.17.1-1)."""
    if nccl < NVLS_FROM:
        return 0
    buffers = ranks_per_node * 2 * NVLS_CHANNELS_SM90
    if nccl < NVLS_CHUNKED_FROM:
        return buffers * (SIMPLE_BUFFER_BYTES + NVLS_MEM_ALIGN_BYTES)
    if nccl < RUNTIME_CONNECT_FROM:
        return buffers * (NCCL_STEPS * NVLS_CHUNK_BYTES + NVLS_MEM_ALIGN_BYTES)
    return buffers * NCCL_STEPS * NVLS_CHUNK_BYTES


def _pow2_up(value: int) -> int:
    result = 1
    while result < value:
        result *= 2
    return result
