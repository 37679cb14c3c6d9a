"""The published CPU-Adam figure that anchors HostSpec.optimizer_elements_per_core_s, and the
one function that derives the per-core rate from it (docs/communication-time.md, "CPU
optimizer step"). Torch-free data; the test compares timing.cpu_step_time_s against it."""

from __future__ import annotations

from zeroplan.specs.base import Frozen
from zeroplan.specs.hardware import HostSpec


class PublishedAdamLatency(Frozen):
    """One row of a published table of CPU Adam step latencies."""

    parameters: int
    """Parameters updated in one step (the table's model size)."""
    latency_s: float
    """Seconds of one DeepSpeed CPU-Adam step over all of them."""


class CpuAdamAnchor(Frozen):
    """A published CPU-Adam latency table with the host it ran on."""

    source: str
    """Paper, section and table the rows come from."""
    host_description: str
    """The CPU the table was measured on, with the sources of its figures."""
    host: HostSpec
    """That host as zeroplan models it (peak memory bandwidth, physical cores)."""
    threads: str
    """How many threads the step ran on, as far as the sources say."""
    rows: tuple[PublishedAdamLatency, ...]
    """The table's CPU-Adam column."""


# Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC '21
# (arXiv 2101.06840), sec. 6.2 and Table 3: Adam latency of CPU-Adam against PyTorch's CPU Adam
# for 1-10 B parameters, measured on the paper's DGX-2 host (its Table 2: 2 x Xeon Platinum 8168).
# DGX-2: 2 x Intel Xeon Platinum 8168 @ 2.7 GHz (NVIDIA DGX-2 system specification); 8168:
# 24 cores, 6 DDR4-2666 channels per socket (Intel ark), so 12 x 2666 MT/s x 8 B = 255.9 GB/s peak.
# Figures transcribed from the paper's table; see docs/communication-time.md for the caveat.
ZERO_OFFLOAD_TABLE3 = CpuAdamAnchor(
    source="Ren et al. 2021, ZeRO-Offload (USENIX ATC '21, arXiv 2101.06840), sec. 6.2, Table 3 (CPU-Adam column)",
    host_description=(
        "NVIDIA DGX-2 host: 2 x Intel Xeon Platinum 8168 @ 2.7 GHz, 24 cores and 6 DDR4-2666 channels "
        "each (Intel ark), 1.5 TB DDR4"
    ),
    host=HostSpec(
        memory_bandwidth_bytes_per_s=2 * 6 * 2666e6 * 8,
        cores_per_node=48,
        gpus_per_host_link=1,
    ),
    threads=(
        "not stated in the table; DeepSpeed's CPU Adam runs its tiles under `#pragma omp parallel for` "
        "(csrc/includes/cpu_adam.h, Step_AVX), whose default is one thread per logical CPU (96 here)"
    ),
    rows=(
        PublishedAdamLatency(parameters=1_000_000_000, latency_s=0.22),
        PublishedAdamLatency(parameters=2_000_000_000, latency_s=0.51),
        PublishedAdamLatency(parameters=4_000_000_000, latency_s=1.03),
        PublishedAdamLatency(parameters=8_000_000_000, latency_s=2.41),
        PublishedAdamLatency(parameters=10_000_000_000, latency_s=2.57),
    ),
)


# Least squares through the origin of the compute bound t_i = E_i / (C * r) over the table's rows
# (one rank on the whole host, so G = 1): with s = 1/(C r), s = sum(E_i t_i) / sum(E_i^2), and
#   r = 1 / (C * s)        elements per core per second.
# The published step runs below the host's peak memory bandwidth (28 B x 1e9 / 0.22 s = 127 GB/s
# against 255.9 GB/s peak), so the memory bound does not explain it; the rate carries it instead.
def per_core_rate_from_published(anchor: CpuAdamAnchor = ZERO_OFFLOAD_TABLE3) -> float:
    """Parameters one core updates per second, fitted to ``anchor``'s latency table."""
    seconds_per_element = sum(row.parameters * row.latency_s for row in anchor.rows) / sum(
        row.parameters * row.parameters for row in anchor.rows
    )
    return 1.0 / (anchor.host.cores_per_node * seconds_per_element)
