"""Which NCCL algorithm runs each collective call, and how long it takes.

NCCL predicts, for every call, the time of each algorithm it may use as
``latency + nBytes / algorithm bandwidth`` (src/graph/tuning.cc, ``ncclTopoTuneModel`` fills the
tables, ``ncclTopoGetAlgoTime`` adds the size) and runs the fastest (src/enqueue.cc,
``topoGetAlgoInfo``). This module transcribes that model for the Simple protocol, NCCL v2.28.3-1,
in zeroplan's terms (docs/communication-time.md, "Algorithms"):

- B_intra: the GPU's intra-node link; B_inter: the NIC bandwidth a group's node crossings reach;
  B_ring: the ring's bus bandwidth (zeroplan/core/network.py), which stands for NCCL's
  nChannels x per-channel bandwidth of each graph;
- alpha_intra / alpha_inter: the links' per-step latencies;
- N ranks in the group, m of them on each node, n = N/m nodes.

The ring keeps zeroplan's alpha-beta time (every step pays the slowest hop's latency, sent bytes
over B_ring), so ring-only predictions are what they were before this model.
"""

import functools
from collections.abc import Callable, Iterable
from dataclasses import field
from enum import Enum
from math import floor, log2

from pydantic import ConfigDict

from zeroplan.core.communication import Collective, CollectiveOp, Phase, ring_sent_bytes
from zeroplan.core.memo import batch_keyed
from zeroplan.core.network import (
    contiguous_ranks_per_node,
    inter_node_hop_bandwidth_bytes_per_s,
    node_nics,
    ring_bandwidth_bytes_per_s,
    ring_latency_link,
)
from zeroplan.core.record import frozen
from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen
from zeroplan.specs.hardware import AchievedBusBandwidth, GpuArchitecture, GpuSpec
from zeroplan.specs.request import PlanRequest


class Algorithm(str, Enum):
    """NCCL's algorithms (src/include/device.h, NCCL_ALGO_*); collnet stands for CollNet Direct
    on NVSwitch nodes and CollNet Chain elsewhere."""

    ring = "ring"
    tree = "tree"
    nvls = "nvls"
    nvls_tree = "nvls_tree"
    collnet = "collnet"


# NCCL v2.28.3-1 src/graph/tuning.cc, nvlsEfficiency[compCapIndex]: 0 for Volta and Ampere.
NVLS_EFFICIENCY = {GpuArchitecture.hopper: 0.85, GpuArchitecture.blackwell: 0.74}
# NCCL v2.28.3-1 src/graph/tuning.cc, hwLatencies[NVLINK][NVLS and NVLS_TREE][Simple] = 25 us.
NVLS_LATENCY_S = 25e-6
# NCCL v2.28.3-1 src/graph/tuning.cc, perChMaxNVLSTreeBws[compCap][nNodes: 1, 2, >2], GB/s per channel.
NVLS_TREE_MAX_BYTES_PER_S_PER_CHANNEL = {
    GpuArchitecture.hopper: (0.0, 57.7e9, 45.5e9),
    GpuArchitecture.blackwell: (0.0, 96.0e9, 43.1e9),
}
# NCCL v2.28.3-1 src/graph/tuning.cc: Tree busBw = min(busBw * .92, ...) for all-reduce.
TREE_BANDWIDTH_FACTOR = 0.92
# NCCL v2.28.3-1 src/graph/tuning.cc, treeCorrectionFactor[Simple][log2i(nBytes >> 6)], 64 B to 256 MiB.
TREE_CORRECTION_SIMPLE = (
    0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5,
    0.5, 0.5, 0.5, 0.6, 0.7, 0.8, 0.7, 0.7, 0.8, 0.9, 0.9,
)
# NCCL v2.28.3-1 src/graph/tuning.cc: CollNet Direct adds 0.4 us of arity serialisation per local
# rank, and runs .85 as fast on sm_90+; src/enqueue.cc: CollNet Direct takes at most 8 local GPUs.
COLLNET_ARITY_LATENCY_S = 0.4e-6
COLLNET_DIRECT_HOPPER_FACTOR = 0.85
COLLNET_DIRECT_MAX_LOCAL_RANKS = 8


class Layout(Frozen):
    """Where the ranks of one collective's group sit."""

    group_size: int
    """N: ranks of the group."""
    ranks_per_node: int
    """m: members of the group on each node it touches."""
    gpus_per_node: int
    """GPUs of a node (all groups of one collective share the node's NICs)."""
    spans_nodes: bool
    """Whether the group crosses nodes."""

    @property
    def num_nodes(self) -> int:
        """n: nodes the group spans."""
        return self.group_size // self.ranks_per_node if self.spans_nodes else 1


class CollectiveTime(Frozen):
    """Seconds and NCCL algorithm of one kind of collective of a step."""

    # The planner builds it unvalidated (Frozen.trusted), so its validator is built on first use
    # (a caller's validation, a JSON dump), not at each command's start.
    model_config = ConfigDict(defer_build=True)

    op: CollectiveOp
    """The collective."""
    phase: Phase
    """When it runs."""
    what: str
    """Which tensors it moves."""
    algorithm: Algorithm
    """The algorithm that moves most of its bytes (NCCL chooses per call)."""
    algorithms: tuple[Algorithm, ...]
    """Every algorithm its calls use, by bytes moved, most first."""
    bus_bandwidth_bytes_per_s: float
    """Bus bandwidth (nccl-tests' busbw) of ``algorithm`` as charged, bytes per second."""
    bandwidth_basis: str
    """'achievable' when ``algorithm`` ran at a published or calibrated efficiency, else 'nominal'."""
    seconds: float
    """Seconds per optimizer step."""


def _log2i(value: int) -> int:
    return floor(log2(value)) if value >= 1 else -1


def _nvls_efficiency(gpu: GpuSpec) -> float:
    return NVLS_EFFICIENCY.get(gpu.architecture, 0.0) if gpu.nvswitch else 0.0


def multicast_capable(gpu: GpuSpec) -> bool:
    """Whether the GPU's node gives NVLS its multicast objects (Hopper or newer behind NVSwitches)."""
    return _nvls_efficiency(gpu) > 0


def _sharp(gpu: GpuSpec) -> bool:
    return gpu.node_network is not None and gpu.node_network.sharp


# NCCL v2.28.3-1 src/graph/tuning.cc (ncclTopoTuneModel: which functions each algorithm serves, and
# the algoEnable rules): ring always; tree all-reduce only; NVLS and NVLS Tree need NVSwitch and
# sm_90+ (search.cc), at least 2 local ranks (one channel per local GPU, at least 2); NVLS Tree is
# off on one node, NVLS and CollNet across nodes need collnet (SHARP); multi-node NVLS all-gather /
# reduce-scatter need a NIC (head) per local rank. Tree is left out on one node: there its latency
# equals the ring's and its bandwidth is lower, so it never wins there in NCCL's model.
def available_algorithms(gpu: GpuSpec, op: CollectiveOp, layout: Layout) -> tuple[Algorithm, ...]:
    """Algorithms NCCL's tuning model may pick for ``op`` on ``layout``, ring first."""
    result = [Algorithm.ring]
    if layout.group_size < 2 or op in (CollectiveOp.broadcast, CollectiveOp.send):
        return tuple(result)
    nvls = _nvls_efficiency(gpu) > 0 and layout.ranks_per_node >= 2
    multi = layout.spans_nodes
    if op is CollectiveOp.all_reduce:
        if multi:
            result.append(Algorithm.tree)
        if nvls and (not multi or _sharp(gpu)):
            result.append(Algorithm.nvls)
        if nvls and multi:
            result.append(Algorithm.nvls_tree)
        if multi and _sharp(gpu):
            result.append(Algorithm.collnet)
    elif nvls:
        heads, _ = node_nics(gpu, layout.gpus_per_node)
        if not multi or (_sharp(gpu) and layout.ranks_per_node <= heads):
            result.append(Algorithm.nvls)
    return tuple(result)


def _ring_steps(op: CollectiveOp, n: int) -> int:
    return 2 * (n - 1) if op is CollectiveOp.all_reduce else n - 1


def bus_factor(op: CollectiveOp, n: int) -> float:
    """nccl-tests doc/PERFORMANCE.md: busbw = algbw x 2(n-1)/n (all-reduce), x (n-1)/n
    (all-gather, reduce-scatter), x 1 (broadcast; a send moves its buffer once too)."""
    if op in (CollectiveOp.broadcast, CollectiveOp.send):
        return 1.0
    return _ring_steps(op, n) / n


def latency_s(gpu: GpuSpec, algorithm: Algorithm, op: CollectiveOp, layout: Layout) -> float:
    """Latency of one call (NCCL v2.28.3-1 src/graph/tuning.cc, ``comm->latencies``), with the
    links' per-step latencies for NCCL's per-hop hardware latencies."""
    m, n = layout.ranks_per_node, layout.num_nodes
    intra, inter = gpu.intra_node_link.latency_s, gpu.inter_node_link.latency_s
    if algorithm is Algorithm.ring:
        # zeroplan's ring: every one of the ring's steps waits for its slowest hop.
        return _ring_steps(op, layout.group_size) * ring_latency_link(gpu, layout.spans_nodes).latency_s
    if algorithm is Algorithm.tree:
        # tuning.cc: 2 * ((nRanks/nNodes - 1) * intraLat + log2i(nNodes) * interLat)
        return 2 * ((m - 1) * intra + _log2i(n) * inter)
    if algorithm is Algorithm.nvls:
        # tuning.cc: latencies = intraLat (+ interLat across nodes)
        return NVLS_LATENCY_S + (inter if layout.spans_nodes else 0.0)
    if algorithm is Algorithm.nvls_tree:
        # tuning.cc: intraLat + 2 * log2i(nNodes) * interLat
        return NVLS_LATENCY_S + 2 * _log2i(n) * inter
    if _collnet_direct(gpu, layout):
        # tuning.cc: 2 * (min(1, nRanks/nNodes - 1) * intraLat + (nRanks/nNodes - 1) * 0.4) + interLat
        return 2 * (min(1, m - 1) * intra + (m - 1) * COLLNET_ARITY_LATENCY_S) + inter
    # tuning.cc, CollNet Chain: 2 * (nRanks/nNodes - 1) * intraLat + interLat
    return 2 * (m - 1) * intra + inter


def _collnet_direct(gpu: GpuSpec, layout: Layout) -> bool:
    return gpu.nvswitch and layout.ranks_per_node <= COLLNET_DIRECT_MAX_LOCAL_RANKS


def _tree_correction(message_bytes: int) -> float:
    index = _log2i(message_bytes >> 6)
    return TREE_CORRECTION_SIMPLE[index] if 0 <= index < len(TREE_CORRECTION_SIMPLE) else 1.0


# tuning.cc: bw = bwIntra on <= 2 nodes, else bwInter; busBw = .92 nCh bw; algbw = busBw / 2,
# times treeCorrectionFactor for the size (ncclTopoGetAlgoTime)
def _tree_bandwidth_parts(gpu: GpuSpec, layout: Layout) -> tuple[float, float]:
    """The tree's algorithm bandwidth before the size's correction factor, and the node's NIC
    bandwidth that bounds it."""
    bandwidth = gpu.intra_node_link.bandwidth_bytes_per_s if layout.num_nodes <= 2 else \
        ring_bandwidth_bytes_per_s(gpu, layout.gpus_per_node, layout.ranks_per_node, layout.spans_nodes)
    return (TREE_BANDWIDTH_FACTOR * bandwidth * 0.5,
            inter_node_hop_bandwidth_bytes_per_s(gpu, layout.gpus_per_node, layout.ranks_per_node))


def algorithm_bandwidth_bytes_per_s(
    gpu: GpuSpec, algorithm: Algorithm, op: CollectiveOp, layout: Layout, message_bytes: int,
) -> float:
    """NCCL's algorithm bandwidth (time = latency + nBytes / this) of one call of S bytes."""
    n_ranks, m, n = layout.group_size, layout.ranks_per_node, layout.num_nodes
    intra = gpu.intra_node_link.bandwidth_bytes_per_s
    ring = ring_bandwidth_bytes_per_s(gpu, layout.gpus_per_node, m, layout.spans_nodes)
    inter = inter_node_hop_bandwidth_bytes_per_s(gpu, layout.gpus_per_node, m)
    steps = _ring_steps(op, n_ranks)
    if algorithm is Algorithm.ring:
        # tuning.cc: algorithm bandwidth = busBw * nRanks / nsteps (a broadcast's busbw is its algbw)
        return ring if op in (CollectiveOp.broadcast, CollectiveOp.send) or steps == 0 else ring * n_ranks / steps
    if algorithm is Algorithm.tree:
        base, nics = _tree_bandwidth_parts(gpu, layout)
        # Not in tuning.cc: a node's NICs carry the whole buffer once each way, so the tree cannot
        # beat them (NCCL's bwIntra on two nodes would, on NVLink 5 nodes).
        return min(base * _tree_correction(message_bytes), nics)
    efficiency = _nvls_efficiency(gpu)
    if algorithm in (Algorithm.nvls, Algorithm.nvls_tree):
        # tuning.cc: intraBw = bwIntra * nvlsEfficiency * (nCh-1)/nCh, x2 for all-reduce (two
        # pipelined operations), x (ppn-1)/ppn otherwise; NVLS has one channel per local GPU
        # (search.cc: maxChannels = local GPUs, forced on one node), so nCh = m.
        per_node = intra * efficiency * (m - 1) / m
        per_node *= 2 if op is CollectiveOp.all_reduce else (m - 1) / m
        if algorithm is Algorithm.nvls:
            # bw = min(intraBw, interBw) across nodes; on one node the network does not bound it.
            bus = min(per_node, inter) if layout.spans_nodes else per_node
        else:
            # bw = min(intraBw, interBw x (2 on <= 2 nodes), perChMaxNVLSTreeBw)
            cap = NVLS_TREE_MAX_BYTES_PER_S_PER_CHANNEL[gpu.architecture][min(n, 3) - 1] * m
            bus = min(per_node, inter * (2 if n <= 2 else 1), cap)
        # tuning.cc: all-reduce converts busBw to algbw by nRanks / nsteps; NVLS all-gather and
        # reduce-scatter keep busBw as the algorithm bandwidth.
        return bus * n_ranks / steps if op is CollectiveOp.all_reduce else bus
    # CollNet (SHARP) all-reduce: bw = bwIntra; algbw = busBw / 2.
    bus = intra
    if _collnet_direct(gpu, layout):
        # tuning.cc: factor = ppn / nChannels (GPUs per NIC), factor -= (factor - 1) / 2, busBw /= factor,
        # x .85 on sm_90+; the CollNet Direct graph has one channel per NIC (head).
        nics, _ = node_nics(gpu, layout.gpus_per_node)
        factor = m / nics
        factor -= (factor - 1) / 2
        bus /= factor
        if gpu.architecture in NVLS_EFFICIENCY:
            bus *= COLLNET_DIRECT_HOPPER_FACTOR
    return bus * 0.5


def call_time_s(
    gpu: GpuSpec, algorithm: Algorithm, op: CollectiveOp, layout: Layout, message_bytes: int, efficiency: float = 1.0,
) -> float:
    """Seconds of one call of ``message_bytes`` (S); ``efficiency`` scales the bandwidth term."""
    latency = latency_s(gpu, algorithm, op, layout)
    if algorithm is Algorithm.ring:
        ring = ring_bandwidth_bytes_per_s(gpu, layout.gpus_per_node, layout.ranks_per_node, layout.spans_nodes)
        return latency + ring_sent_bytes(op, message_bytes, layout.group_size) / (ring * efficiency)
    bandwidth = algorithm_bandwidth_bytes_per_s(gpu, algorithm, op, layout, message_bytes)
    return latency + message_bytes / (bandwidth * efficiency)


def call_timer(gpu: GpuSpec, algorithm: Algorithm, op: CollectiveOp, layout: Layout,
               efficiency: float = 1.0) -> Callable[[int], float]:
    """call_time_s of one algorithm as a function of the size alone: the latency and every
    bandwidth that does not depend on the size taken once, the same operations after them
    (the same seconds, to the bit)."""
    latency = latency_s(gpu, algorithm, op, layout)
    if algorithm is Algorithm.ring:
        ring = ring_bandwidth_bytes_per_s(gpu, layout.gpus_per_node, layout.ranks_per_node, layout.spans_nodes)
        denominator, n_ranks = ring * efficiency, layout.group_size
        return lambda message_bytes: latency + ring_sent_bytes(op, message_bytes, n_ranks) / denominator
    if algorithm is Algorithm.tree:
        base, nics = _tree_bandwidth_parts(gpu, layout)
        return lambda message_bytes: latency + message_bytes / (min(base * _tree_correction(message_bytes), nics) * efficiency)
    # NVLS, NVLS tree and CollNet: a bandwidth the size does not change.
    denominator = algorithm_bandwidth_bytes_per_s(gpu, algorithm, op, layout, 0) * efficiency
    return lambda message_bytes: latency + message_bytes / denominator


def bus_bandwidth_bytes_per_s(gpu: GpuSpec, algorithm: Algorithm, op: CollectiveOp, layout: Layout, message_bytes: int) -> float:
    """The algorithm's bandwidth as nccl-tests reports it (busbw = algbw x bus factor)."""
    return algorithm_bandwidth_bytes_per_s(gpu, algorithm, op, layout, message_bytes) * bus_factor(op, layout.group_size)


def fastest_algorithm(gpu, op, layout, message_bytes, candidates, efficiencies) -> tuple[Algorithm, float]:
    return least_time((algorithm, call_time_s(gpu, algorithm, op, layout, message_bytes, efficiencies.get(algorithm, 1.0)))
                      for algorithm in candidates)


# src/enqueue.cc (topoGetAlgoInfo): the algorithm of least predicted time; ties keep the earlier.
def least_time(timed: Iterable[tuple[Algorithm, float]]) -> tuple[Algorithm, float]:
    """The (algorithm, seconds) of least seconds, the earlier of equal ones."""
    best = None
    for candidate in timed:
        if best is None or candidate[1] < best[1]:
            best = candidate
    return best


def entry_layout(entry: AchievedBusBandwidth) -> Layout:
    """The layout of a published run: all GPUs of ``num_nodes`` nodes in one group."""
    return Layout(group_size=entry.num_nodes * entry.gpus_per_node, ranks_per_node=entry.gpus_per_node,
                  gpus_per_node=entry.gpus_per_node, spans_nodes=entry.num_nodes > 1)


def entry_algorithm(gpu: GpuSpec, entry: AchievedBusBandwidth) -> Algorithm:
    """The algorithm NCCL's model (nominal figures) picks for the published run's size and layout."""
    op, layout = CollectiveOp(entry.collective), entry_layout(entry)
    return fastest_algorithm(gpu, op, layout, entry.message_bytes, available_algorithms(gpu, op, layout), {})[0]


# The measured busbw fixes the time of the run: t = S x bus factor / busbw. Keeping the model's
# latency, the bandwidth term of the run's algorithm is scaled by k so that the model gives t back:
#   latency + X / k = t   =>   k = X / (t - latency),  X = the model's bandwidth term at k = 1.
def entry_efficiency(gpu: GpuSpec, entry: AchievedBusBandwidth) -> tuple[Algorithm, float] | None:
    """(algorithm, k) of a published run on ``gpu``; None if the model's latency alone exceeds it."""
    op, layout = CollectiveOp(entry.collective), entry_layout(entry)
    algorithm = entry_algorithm(gpu, entry)
    latency = latency_s(gpu, algorithm, op, layout)
    measured_s = entry.message_bytes * bus_factor(op, layout.group_size) / entry.bus_bandwidth_bytes_per_s
    bandwidth_s = call_time_s(gpu, algorithm, op, layout, entry.message_bytes) - latency
    if measured_s <= latency:
        return None
    return algorithm, bandwidth_s / (measured_s - latency)


def achievable_efficiencies(gpu: GpuSpec, op: CollectiveOp, layout: Layout) -> dict[Algorithm, float]:
    """Per algorithm, the efficiency of the published run of ``op`` in the same scope (one node or
    several) that used it; the run with the node count nearest ``layout``'s wins a tie."""
    scope = "inter_node" if layout.spans_nodes else "intra_node"
    found: dict[Algorithm, tuple[int, float]] = {}
    for entry in gpu.achievable:
        if entry.collective != op.value or entry.scope != scope:
            continue
        result = entry_efficiency(gpu, entry)
        if result is None:
            continue
        algorithm, k = result
        distance = abs(entry.num_nodes - layout.num_nodes)
        if algorithm not in found or distance < found[algorithm][0]:
            found[algorithm] = (distance, k)
    return {algorithm: k for algorithm, (_, k) in found.items()}


def collective_layout(request: PlanRequest, collective: Collective) -> Layout:
    cluster = request.cluster
    per_node = collective.ranks_per_node
    if per_node is None:
        per_node = contiguous_ranks_per_node(collective.group_size, cluster.gpus_per_node)
    # Unvalidated (Frozen.trusted): the collective's and the cluster's fields are of these
    # fields' types already; every collective of every plan is priced through one.
    return Layout.trusted(group_size=collective.group_size, ranks_per_node=per_node,
                          gpus_per_node=cluster.gpus_per_node, spans_nodes=collective.spans_nodes)


def _call_sizes(collective: Collective) -> tuple[tuple[int, int], ...]:
    if collective.call_sizes:
        return collective.call_sizes
    return ((collective.buffer_bytes // max(collective.calls, 1), collective.calls),)


@frozen
class CallPricing:
    """What pricing one call of a collective needs besides its size: the GPU, the op as timed,
    the ranks' layout, the algorithms it may run and their achievable efficiencies."""

    gpu: GpuSpec
    op: CollectiveOp
    layout: Layout
    candidates: tuple[Algorithm, ...]
    efficiencies: dict
    # A call's price is a function of its size alone once the rest is fixed, and the same sizes
    # come back (one call per block; the same data-parallel buckets in each strategy of a fit):
    # each size is priced once per pricing.
    priced: dict = field(default_factory=dict, compare=False, repr=False)
    # Each candidate's call_timer, made at the first size priced: a 405B fit on 65,536 GPUs
    # prices ~800 distinct sizes, each of whose ~3 candidates read the same links and NICs.
    timers: list = field(default_factory=list, compare=False, repr=False)

    def call_seconds(self, message_bytes: int) -> tuple[Algorithm, float]:
        """The algorithm one call of ``message_bytes`` runs and its seconds (fastest_algorithm)."""
        answer = self.priced.get(message_bytes)
        if answer is None:
            if len(self.priced) >= PRICED_SIZES_LIMIT:
                self.priced.clear()
            timers = self.timers
            if not timers:
                timers.extend((algorithm, call_timer(self.gpu, algorithm, self.op, self.layout,
                                                     self.efficiencies.get(algorithm, 1.0)))
                              for algorithm in self.candidates)
            answer = self.priced[message_bytes] = least_time((algorithm, timer(message_bytes)) for algorithm, timer in timers)
        return answer


PRICED_SIZES_LIMIT = 4096
"""Sizes one CallPricing keeps the price of (a plan search asks each call size times every
micro-batch); cleared when full."""


def call_pricing(request: PlanRequest, collective: Collective) -> CallPricing:
    """Each call of ``collective`` runs on the algorithm NCCL's model predicts fastest (or the
    forced one, ring where it cannot run)."""
    gpu, performance = request.cluster.gpu, request.performance
    layout = collective_layout(request, collective)
    # An all-to-all is timed as a ring all-gather of the same buffer (CollectiveOp.all_to_all).
    op = CollectiveOp.all_gather if collective.op is CollectiveOp.all_to_all else collective.op
    candidates = (Algorithm.ring,) if collective.op is CollectiveOp.all_to_all else available_algorithms(gpu, op, layout)
    if performance.algorithm != "auto":
        forced = Algorithm(performance.algorithm)
        candidates = (forced,) if forced in candidates else (Algorithm.ring,)
    return shared_pricing(gpu, op, layout, tuple(candidates), performance.bandwidth == "achievable")


# Every collective of the same GPU, op, layout and algorithms shares one pricing, and with it the
# prices of its calls (a 405B fit: 4,732 calls priced, 791 of them distinct).
@functools.lru_cache(maxsize=256)
def shared_pricing(gpu: GpuSpec, op: CollectiveOp, layout: Layout, candidates: tuple[Algorithm, ...],
                   achievable: bool) -> CallPricing:
    """The CallPricing of these; ``achievable``: at the published runs' efficiencies (else nominal)."""
    efficiencies = achievable_efficiencies(gpu, op, layout) if achievable else {}
    return CallPricing(gpu=gpu, op=op, layout=layout, candidates=candidates, efficiencies=efficiencies)


# ZeRO++'s (de)quantization kernels (zeroplan.core.zeropp) need CUDA to be measured: they are
# priced as a memory-bound pass, the bytes they read and write at the GPU's achievable memory
# bandwidth (zeroplan.core.roofline.ceilings: a device copy's rate), an assumption
# (docs/communication-time.md, "ZeRO++ qwZ and qgZ").
def quantization_kernel_seconds(gpu: GpuSpec, kernel_bytes: int) -> float:
    """Seconds of kernels moving ``kernel_bytes`` through the GPU's memory."""
    from zeroplan.core.roofline.ceilings import CEILINGS

    ceilings = CEILINGS.get(gpu.name)
    if ceilings is None:
        raise ZeroplanError("strategy", f"zero3-zeropp's quantization kernels are timed at a measured memory bandwidth, "
                                        f"none for gpu {gpu.name!r} (allowed: {', '.join(sorted(CEILINGS))})")
    return kernel_bytes / ceilings.memory_bytes_per_s


# A collective's price reads the cluster, the GPU and the performance assumptions, not the batch
# (the collective carries its sizes): fit() prices the same collectives at every micro-batch.
@batch_keyed()
def collective_cost(request: PlanRequest, collective: Collective) -> CollectiveTime:
    """Seconds per step of ``collective`` and the algorithms its calls run (call_pricing)."""
    pricing = call_pricing(request, collective)
    gpu, op, layout, efficiencies = pricing.gpu, pricing.op, pricing.layout, pricing.efficiencies
    seconds = 0.0
    moved: dict[Algorithm, int] = {}
    for size, calls in _call_sizes(collective):
        algorithm, call_s = pricing.call_seconds(size)
        seconds += calls * call_s
        moved[algorithm] = moved.get(algorithm, 0) + calls * size
    ranked = tuple(sorted(moved, key=lambda a: -moved[a]))
    main = ranked[0]
    largest = max(size for size, _ in _call_sizes(collective))
    k = efficiencies.get(main, 1.0)
    if collective.kernel_bytes:
        seconds += quantization_kernel_seconds(gpu, collective.kernel_bytes)
    # Unvalidated (Frozen.trusted): the enums and strings are the collective's, the seconds and
    # the bandwidth floats (k and the sum start as floats); every collective of a plan is priced.
    return CollectiveTime.trusted(
        op=collective.op, phase=collective.phase, what=collective.what, algorithm=main, algorithms=ranked,
        bus_bandwidth_bytes_per_s=float(k * bus_bandwidth_bytes_per_s(gpu, main, op, layout, largest)),
        bandwidth_basis="achievable" if main in efficiencies else "nominal",
        seconds=float(collective.occurrences_per_step * seconds),
    )
