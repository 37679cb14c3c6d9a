"""GPUs, the links between them, and the cluster they form."""

# No postponed annotations: pydantic reads these fields' types as objects (zeroplan/specs/base.py).

from enum import Enum

from pydantic import Field, model_validator

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen, JsonTuple
from zeroplan.units import MiB


# Upper bounds on what a GPU description may claim (docs/input-bounds.md, "GPU files"): each is
# orders of magnitude past any device or link announced, so a typo (1e30 bytes, a latency of
# 1e9 s) is refused rather than planned with.
MAX_LINK_BYTES_PER_S = 1e15
"""1 PB/s: NVLink 5 is 1.8 TB/s per GPU."""
MAX_LATENCY_S = 1.0
"""One second per hop: NCCL's per-step latencies are microseconds."""
MAX_FLOPS_PER_S = 1e17
"""100 PFLOP/s: a B200 is 2.25 PFLOP/s dense bf16."""
MAX_DEVICE_MEMORY_BYTES = 2**44
"""16 TiB: the largest accelerators hold under 0.3 TiB."""


class LinkSpec(Frozen):
    """One kind of link, in the alpha-beta model: time = latency_s + bytes / bandwidth_bytes_per_s."""

    name: str = Field(min_length=1)
    """E.g. 'NVLink 4 (NVSwitch)' or 'InfiniBand NDR 400G'."""
    bandwidth_bytes_per_s: float = Field(gt=0, le=MAX_LINK_BYTES_PER_S, allow_inf_nan=False)
    """Unidirectional bandwidth one GPU can drive over this link, in bytes per second."""
    latency_s: float = Field(ge=0, le=MAX_LATENCY_S, allow_inf_nan=False)
    """Per-message start-up latency (alpha), in seconds."""


class NodeNetworkSpec(Frozen):
    """The network interfaces of one node, which the rings of a collective spanning nodes
    share (NCCL puts each ring's node crossing on one NIC and spreads the rings over all)."""

    nics_per_node: int = Field(gt=0)
    """Compute-fabric NICs in one node (storage NICs excluded), e.g. 8 in a DGX H100."""
    nic_bandwidth_bytes_per_s: float = Field(gt=0, le=MAX_LINK_BYTES_PER_S, allow_inf_nan=False)
    """Unidirectional bandwidth of one NIC, bytes per second (400 Gb/s = 50e9)."""
    source: str = Field(min_length=1)
    """Where the NIC count and speed come from (system datasheet)."""
    sharp: bool = False
    """Whether the fabric offers in-network reduction (InfiniBand SHARP) that NCCL's CollNet
    plugin uses; only a cluster that declares it gets the collnet algorithm (and multi-node NVLS)."""


class GpuArchitecture(str, Enum):
    """The GPU generation, which NCCL's tuning model keys some constants by (src/graph/tuning.cc)."""

    volta = "volta"
    turing = "turing"
    ampere = "ampere"
    ada = "ada"
    hopper = "hopper"
    blackwell = "blackwell"
    cdna3 = "cdna3"


FLOAT8_ARCHITECTURES = (GpuArchitecture.ada, GpuArchitecture.hopper, GpuArchitecture.blackwell, GpuArchitecture.cdna3)
"""torchtitan 0.3.0 components/quantization/float8.py Float8LinearConverter: "float8 is only
supported on NVIDIA SM89 or later, or AMD gfx942 (MI300) or later"."""


class AchievedBusBandwidth(Frozen):
    """One published nccl-tests result: the bus bandwidth a collective reached on a real system.
    Kept apart from the datasheet figures of the links (docs/gpus.md, "Achievable bandwidth")."""

    collective: str = Field(pattern="^(all_reduce|all_gather|reduce_scatter)$")
    """all_reduce, all_gather or reduce_scatter."""
    scope: str = Field(pattern="^(intra_node|inter_node)$")
    """intra_node (one node, NVLink/NVSwitch) or inter_node (the run spans nodes)."""
    bus_bandwidth_bytes_per_s: float = Field(gt=0, le=MAX_LINK_BYTES_PER_S, allow_inf_nan=False)
    """nccl-tests' busbw at ``message_bytes``, bytes per second (GB/s x 1e9)."""
    num_nodes: int = Field(gt=0)
    """Nodes of the run."""
    gpus_per_node: int = Field(gt=0)
    """Ranks (GPUs) per node of the run."""
    message_bytes: int = Field(gt=0)
    """nccl-tests' size column of the row quoted, bytes."""
    nccl_version: str = Field(min_length=1)
    """NCCL release the run used, as the source states it."""
    source: str = Field(min_length=1)
    """Where the figure is published (URL), or the log file it was fitted from."""
    note: str = ""
    """What else the source says (system, in-place or out-of-place, algorithm)."""


class GpuSpec(Frozen):
    """One accelerator model and the links it typically sits behind."""

    name: str = Field(min_length=1)
    """Catalog key, lower case, e.g. 'a100-80gb'."""
    display_name: str = Field(min_length=1)
    """As the vendor writes it, e.g. 'NVIDIA A100 80GB SXM'."""
    memory_bytes: int = Field(gt=0, le=MAX_DEVICE_MEMORY_BYTES)
    """Device memory as the driver reports it, in bytes."""
    peak_bf16_flops_per_s: float = Field(gt=0, le=MAX_FLOPS_PER_S, allow_inf_nan=False)
    """Dense (no sparsity) bf16/fp16 tensor throughput, FLOP/s; fp16 for chips without bf16."""
    peak_fp8_flops_per_s: float | None = Field(default=None, gt=0, le=MAX_FLOPS_PER_S, allow_inf_nan=False)
    """Dense (no sparsity) fp8 tensor throughput, FLOP/s, from the same datasheet; None where the
    catalog has none (float8 matmuls are then timed at the bf16 rate)."""
    intra_node_link: LinkSpec
    """GPU-to-GPU inside a node (NVLink/NVSwitch, Infinity Fabric, or PCIe)."""
    inter_node_link: LinkSpec
    """GPU-to-GPU across nodes: the per-GPU share of the node's network (its latency is the
    per-step latency of a ring hop between nodes)."""
    host_link: LinkSpec
    """GPU-to-host, used by offload (PCIe)."""
    source: str = Field(min_length=1)
    """Where the figures come from (datasheet)."""
    node_network: NodeNetworkSpec | None = None
    """The node's NICs; None means one NIC per GPU of the node, each at inter_node_link's
    bandwidth (rail-optimised)."""
    architecture: GpuArchitecture | None = None
    """GPU generation (NCCL's NVLS efficiency is keyed by it); None: unknown, no NVLS."""
    nvswitch: bool = False
    """Whether the GPUs of a node all meet at NVSwitches (NCCL's NVLS needs them, and Hopper or
    newer: src/graph/search.cc refuses the NVLS pattern without an NVS node or below sm_90)."""
    achievable: JsonTuple[AchievedBusBandwidth] = ()
    """Published (or calibrated) nccl-tests bus bandwidths, each with its source; the planner
    uses them by default (PerformanceAssumptions.bandwidth) and the links keep the nominal figures."""

    @property
    def has_bf16_tensor_cores(self) -> bool:
        """Whether its tensor cores multiply bf16: every catalog generation from Ampere on (and
        CDNA3), not Volta or Turing (V100 and T4 tensor cores take fp16 only). torch still runs
        bf16 there, emulated (torch 2.13 cuda/__init__.py is_bf16_supported: compute capability
        >= 8, or with its default including_emulation=True whether a bf16 tensor can be created,
        which sm70 and sm75 can), so this is a matter of which precision the GPU runs at its
        tensor rate, not of what runs at all. An unknown generation (None) is taken to have them."""
        return self.architecture not in (GpuArchitecture.volta, GpuArchitecture.turing)


class HostSpec(Frozen):
    """The host CPUs and memory of one node, shared by its GPUs (used by offload's CPU step).

    Defaults describe an NVIDIA DGX H100 node: two Intel Xeon Platinum 8480C (56 cores each,
    NVIDIA DGX H100 user guide, "Hardware overview"), eight DDR5-4800 channels per socket
    (Intel ark, Xeon Platinum 8480+): 16 channels x 4800 MT/s x 8 B = 614.4 GB/s peak."""

    memory_bandwidth_bytes_per_s: float = Field(default=614.4e9, gt=0)
    """Host memory bandwidth of the node, bytes per second (peak; STREAM-measured is lower)."""
    cores_per_node: int = Field(default=112, gt=0)
    """CPU cores of the node (physical, all sockets)."""
    optimizer_elements_per_core_s: float = Field(default=7.66e7, gt=0)
    """Parameters one core updates per second when not memory-bound (DeepSpeed CPU Adam):
    fitted to ZeRO-Offload's CPU-Adam latencies on a DGX-2 host (Ren et al. 2021, Table 3;
    zeroplan.core.cpu_adam_anchor.per_core_rate_from_published), see docs/communication-time.md."""
    nvme_read_bytes_per_s: float = Field(default=6.5e9, gt=0, le=1e15, allow_inf_nan=False)
    """Sequential read bandwidth of the node's NVMe swap drive(s), shared by its ranks (default:
    one PCIe 4.0 datacenter drive, zeroplan.specs.nvme's "pm9a3" preset, 6.5 GB/s)."""
    nvme_write_bytes_per_s: float = Field(default=3.5e9, gt=0, le=1e15, allow_inf_nan=False)
    """Sequential write bandwidth of the same drive(s) (the "pm9a3" preset's, 3.5 GB/s)."""
    gpus_per_host_link: int = Field(default=1, gt=0)
    """GPUs that share one PCIe path to the host (e.g. 2 behind each PCIe switch in a DGX A100);
    1 means each GPU has its own full host link."""


class ClusterSpec(Frozen):
    """How many GPUs, of which kind, in how many nodes."""

    gpu: GpuSpec
    """The GPU model (all GPUs are alike)."""
    num_nodes: int = Field(default=1, gt=0)
    """Number of nodes."""
    gpus_per_node: int = Field(default=8, gt=0)
    """GPUs in each node."""
    host_memory_bytes_per_node: int | None = Field(default=None, gt=0)
    """Host RAM per node, for the offload check; None means unknown (not checked)."""
    nvme_capacity_bytes_per_node: int | None = Field(default=None, gt=0)
    """NVMe bytes per node for the NVMe strategies' swap files; None means unknown (not checked)."""
    host: HostSpec = Field(default_factory=HostSpec)
    """Host CPUs, memory bandwidth and PCIe sharing per node, for offload's CPU step."""
    cuda_context_bytes: int = Field(default=512 * MiB, ge=0)
    """Device memory taken by the CUDA context and library workspaces before any tensor
    (about 0.5 GiB with lazy module loading, torch's setting from 1.13 on a CUDA 11.7+ runtime;
    more where modules load eagerly: docs/memory-model.md, "The CUDA context"); not usable by
    the allocator."""

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def usable_memory_bytes(self) -> int:
        """Device memory left for the caching allocator."""
        return self.gpu.memory_bytes - self.cuda_context_bytes

    @model_validator(mode="after")
    def _check_context(self) -> "ClusterSpec":
        if self.cuda_context_bytes >= self.gpu.memory_bytes:
            raise ZeroplanError("cluster.cuda_context_bytes", f"must be smaller than the GPU memory (a context of "
                                                              f"{self.cuda_context_bytes / 2**20:g} MiB on "
                                                              f"{self.gpu.memory_bytes / 2**20:g} MiB; allowed: a "
                                                              "context below the GPU's memory)")
        return self


def divisor_words(count: int, shown: int = 8) -> str:
    """The first ``shown`` divisors of ``count`` (GPUs per node or nodes that lay it out), in words."""
    divisors = [d for d in range(1, min(count, 4096) + 1) if count % d == 0][:shown + 1]
    more = len(divisors) > shown
    return ", ".join(map(str, divisors[:shown])) + (", ..." if more else "")


def cluster_from_gpus(
    gpu: GpuSpec, num_gpus: int, gpus_per_node: int | None = None, num_nodes: int | None = None
) -> ClusterSpec:
    """Lay ``num_gpus`` GPUs out in nodes; errors name the flag that is inconsistent."""
    if num_gpus <= 0:
        raise ZeroplanError("gpus", f"must be a positive integer, got {num_gpus}")
    if gpus_per_node is not None and gpus_per_node <= 0:
        raise ZeroplanError("gpus_per_node", f"must be a positive integer, got {gpus_per_node}")
    if num_nodes is not None and num_nodes <= 0:
        raise ZeroplanError("nodes", f"must be a positive integer, got {num_nodes}")
    if num_nodes is not None and gpus_per_node is None:
        if num_gpus % num_nodes:
            raise ZeroplanError("nodes", f"{num_gpus} GPUs do not divide into {num_nodes} nodes "
                                         f"(allowed: {divisor_words(num_gpus)})")
        gpus_per_node = num_gpus // num_nodes
    defaulted = gpus_per_node is None
    if gpus_per_node is None:
        gpus_per_node = min(num_gpus, 8)
    if num_gpus % gpus_per_node:
        if defaulted:
            # Neither the GPUs per node nor the nodes were given: nodes of 8 were assumed.
            raise ZeroplanError("gpus", f"{num_gpus} GPUs do not fill nodes of 8, the default GPUs per node "
                                        f"(allowed: a multiple of 8, or gpus_per_node or nodes of {divisor_words(num_gpus)})")
        raise ZeroplanError(
            "gpus_per_node", f"{num_gpus} GPUs do not divide into nodes of {gpus_per_node} "
                             f"(allowed: {divisor_words(num_gpus)})"
        )
    nodes = num_gpus // gpus_per_node
    if num_nodes is not None and num_nodes != nodes:
        raise ZeroplanError(
            "nodes", f"{num_nodes} nodes x {gpus_per_node} GPUs per node is not {num_gpus} GPUs"
        )
    return ClusterSpec(gpu=gpu, num_nodes=nodes, gpus_per_node=gpus_per_node)
