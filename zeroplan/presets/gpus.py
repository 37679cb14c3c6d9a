"""The GPU catalog: device memory, dense bf16 throughput, and the links a GPU of each kind
typically sits behind, plus GPUs of the user's own (a JSON file, or numbers from flags).

Where the figures come from (docs/gpus.md has the table and the assumptions):

- **Memory** is the total the driver reports (``nvidia-smi``'s "Total", NVML; ``rocm-smi``
  for AMD), in exact bytes. It is not the marketing figure: NVIDIA's "80GB" A100 reports
  81,920 MiB (exactly 80 GiB) but the "80GB" H100 reports 81,559 MiB; the "141GB" H200
  reports 143,771 MiB; GDDR cards with ECC on (L40S, L40, A40, A10G, A10, L4, T4) report about
  1/16 less than their nominal size, and the RTX A6000 is held as published outputs show it,
  with ECC off. Where no reported total was found (A40 with ECC on, H800, MI325X) the figure is
  derived from a sibling's, and its comment says how.
- **Throughput** is the vendor datasheet's dense (no 2:4 sparsity) bf16 tensor figure; the
  V100 and T4 have no bf16, so their fp16 tensor figures stand in. GeForce cards use the figure with
  fp32 accumulation, which is what mixed-precision training runs.
- **Intra-node bandwidth** is per GPU and per direction: NVIDIA quotes NVLink as the
  bidirectional total of all of a GPU's links, so half of that; PCIe x16 per direction.
- **Inter-node bandwidth** is the per-GPU share of a typical node's network (the NICs' bit
  rate / 8 / GPUs per node); ``node_network`` holds the NIC count and speed it comes from,
  which a ring spanning nodes uses (zeroplan/core/network.py, docs/communication-time.md).
- **Latencies** (alpha) are per ring step. NVLink and PCIe take NCCL's own tuning-model values
  for its Simple protocol (src/graph/tuning.cc: 3.4 us and 5.7 us); InfiniBand/RoCE and TCP
  are assumptions (10 us, 30 us).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from zeroplan.errors import ZeroplanError, nested_too_deeply_error, unknown_name_error
from zeroplan.specs.base import first_error
from zeroplan.specs.hardware import AchievedBusBandwidth, GpuArchitecture, GpuSpec, LinkSpec, NodeNetworkSpec
from zeroplan.units import GB, GiB, MiB

NVLINK_LATENCY_S = 3.4e-6
PCIE_LATENCY_S = 5.7e-6
RDMA_LATENCY_S = 10e-6
TCP_LATENCY_S = 30e-6


def _link(name: str, gb_per_s: float, latency_s: float) -> LinkSpec:
    return LinkSpec(name=name, bandwidth_bytes_per_s=gb_per_s * GB, latency_s=latency_s)


# Inside a node and to the host.
PCIE3 = _link("PCIe 3.0 x16", 16, PCIE_LATENCY_S)
PCIE4 = _link("PCIe 4.0 x16", 32, PCIE_LATENCY_S)
PCIE5 = _link("PCIe 5.0 x16", 64, PCIE_LATENCY_S)
NVLINK2 = _link("NVLink 2 (300 GB/s bidirectional)", 150, NVLINK_LATENCY_S)
NVLINK3 = _link("NVLink 3 / NVSwitch (600 GB/s bidirectional)", 300, NVLINK_LATENCY_S)
NVLINK4 = _link("NVLink 4 / NVSwitch (900 GB/s bidirectional)", 450, NVLINK_LATENCY_S)
# The A800 and H800 (export variants of the A100 and H100 SXM) keep NVSwitch but run 8 NVLink
# lanes instead of 12 / 18: 400 GB/s bidirectional each (NVIDIA A800 and H800 datasheets).
NVLINK3_A800 = _link("NVLink 3 / NVSwitch, A800 (400 GB/s bidirectional)", 200, NVLINK_LATENCY_S)
NVLINK4_H800 = _link("NVLink 4 / NVSwitch, H800 (400 GB/s bidirectional)", 200, NVLINK_LATENCY_S)
NVLINK5 = _link("NVLink 5 / NVSwitch (1.8 TB/s bidirectional)", 900, NVLINK_LATENCY_S)
# MI300X: seven Infinity Fabric links of 128 GB/s bidirectional each, one to every peer of an
# 8-GPU node; counted like NVLink, as the total one GPU can send.
INFINITY_FABRIC = _link("Infinity Fabric (7 x 128 GB/s bidirectional)", 448, NVLINK_LATENCY_S)

# Across nodes: the per-GPU share of the node's network.
IB_EDR_PER_2 = _link("InfiniBand EDR, 100 Gb/s per 2 GPUs", 100 / 8 / 2, RDMA_LATENCY_S)
IB_HDR = _link("InfiniBand HDR, 200 Gb/s per GPU", 200 / 8, RDMA_LATENCY_S)
IB_NDR = _link("InfiniBand NDR, 400 Gb/s per GPU", 400 / 8, RDMA_LATENCY_S)
ROCE_100G = _link("RoCE, 100 Gb/s per GPU", 100 / 8, RDMA_LATENCY_S)
ETH_100G_PER_8 = _link("Ethernet, 100 Gb/s per 8 GPUs", 100 / 8 / 8, TCP_LATENCY_S)
ETH_25G_PER_8 = _link("Ethernet, 25 Gb/s per 8 GPUs", 25 / 8 / 8, TCP_LATENCY_S)


def _nics(count: int, gbit_per_s: float, source: str) -> NodeNetworkSpec:
    return NodeNetworkSpec(nics_per_node=count, nic_bandwidth_bytes_per_s=gbit_per_s / 8 * GB, source=source)


# The node networks the inter-node links above are the per-GPU shares of (8-GPU nodes).
DGX1_NICS = _nics(4, 100, "NVIDIA DGX-1 with Tesla V100 datasheet: 4x InfiniBand EDR 100 Gb/s")
DGX_A100_NICS = _nics(8, 200, "NVIDIA DGX A100 datasheet: 8x single-port ConnectX-6 HDR 200 Gb/s (compute)")
DGX_H100_NICS = _nics(8, 400, "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s (compute, via 4 OSFP ports)")
DGX_H200_NICS = _nics(8, 400, "NVIDIA DGX H200 datasheet: 8x ConnectX-7 400 Gb/s (compute)")
DGX_B200_NICS = _nics(8, 400, "NVIDIA DGX B200 datasheet: 8x ConnectX-7 400 Gb/s (compute)")
MI300X_NICS = _nics(8, 400, "AMD Instinct MI300X platform: one 400 Gb/s NIC per GPU (assumed, as the catalog's per-GPU link)")
ROCE_100G_NICS = _nics(8, 100, "assumed: one 100 Gb/s RoCE NIC per GPU (as the catalog's per-GPU link)")
G5_NICS = _nics(1, 100, "Amazon EC2 G5 instance specifications: g5.48xlarge 100 Gb/s")
ETH_25G_NICS = _nics(1, 25, "assumed: one 25 GbE port per 8-card server")
G6_NICS = _nics(1, 100, "Amazon EC2 G6 instance specifications: g6.48xlarge (8 x L4) 100 Gb/s")
G4DN_NICS = _nics(1, 100, "Amazon EC2 G4 instance specifications: g4dn.metal (8 x T4) 100 Gb/s")
A800_NICS = _nics(8, 200, "assumed: as the DGX A100, 8x 200 Gb/s HDR (compute)")
H800_NICS = _nics(8, 400, "assumed: as the DGX H100, 8x 400 Gb/s (compute)")


# Published nccl-tests results (docs/gpus.md, "Achievable bandwidth"): what NCCL reached on real
# systems, kept apart from the links' datasheet rates. Sizes are nccl-tests' size column (its
# "8G" row is 2^33 bytes); GB/s are nccl-tests' 1e9 bytes/s.
def _achieved(
    collective: str, scope: str, gb_per_s: float, nodes: int, message_bytes: int, nccl: str, source: str, note: str,
) -> AchievedBusBandwidth:
    return AchievedBusBandwidth(
        collective=collective, scope=scope, bus_bandwidth_bytes_per_s=gb_per_s * GB, num_nodes=nodes,
        gpus_per_node=8, message_bytes=message_bytes, nccl_version=nccl, source=source, note=note,
    )


_AZURE = "https://github.com/Azure/AI-benchmarking-guide/blob/main/"
H100_ACHIEVED = (
    _achieved("all_reduce", "intra_node", 478.87, 1, 8 * GiB, "2.18.5", _AZURE + "Azure%20Results/ND_H100_v5_results.md",
              "Azure ND H100 v5, 8 x H100 80GB HBM3 on NVSwitch; in-place busbw; the page names the NVLS algorithm"),
    _achieved("all_reduce", "inter_node", 464.6, 2, 16 * GiB, "2.21.5",
              "https://oracle-japan.github.io/ocitutorials/hpc/benchmark/run-nccltests-h100/",
              "OCI BM.GPU.H100.8 x 2 on the RoCE cluster network (3.2 Tb/s per node); the page rounds it to 465 GB/s"),
)
H200_ACHIEVED = (
    _achieved("all_reduce", "intra_node", 479.98, 1, 8 * GiB, "2.20.5", _AZURE + "Azure_Results/ND_H200_v5_results.md",
              "Azure ND H200 v5, 8 x H200 141GB on NVSwitch; in-place busbw; the page names the NVLS algorithm"),
)
A100_80GB_ACHIEVED = (
    _achieved("all_reduce", "intra_node", 231.58, 1, 8 * GiB, "2.18.5", _AZURE + "Azure_Results/ND_A100_v4_results.md",
              "Azure ND A100 v4, 8 x A100-SXM4-80GB on NVSwitch; in-place busbw (the page's NVLS label cannot "
              "apply: NCCL has no NVLS below sm_90)"),
)


def _gpu(
    name: str, display_name: str, memory_bytes: int, tflops: float,
    intra: LinkSpec, inter: LinkSpec, host: LinkSpec, source: str, nics: NodeNetworkSpec,
    architecture: GpuArchitecture, nvswitch: bool = False, achievable: tuple[AchievedBusBandwidth, ...] = (),
    fp8_tflops: float | None = None,
) -> GpuSpec:
    return GpuSpec(
        name=name, display_name=display_name, memory_bytes=memory_bytes,
        peak_bf16_flops_per_s=tflops * 1e12, intra_node_link=intra, inter_node_link=inter,
        host_link=host, source=source, node_network=nics, architecture=architecture, nvswitch=nvswitch,
        achievable=achievable, peak_fp8_flops_per_s=None if fp8_tflops is None else fp8_tflops * 1e12,
    )


_V100 = "NVIDIA Tesla V100 GPU Accelerator datasheet; NVIDIA DGX-1 with Tesla V100 datasheet"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet; NVIDIA DGX A100 datasheet"

_CATALOG: dict[str, GpuSpec] = {
    gpu.name: gpu
    for gpu in [
        # fp16 tensor (the V100 has no bf16), SXM2: 125 TFLOP/s. nvidia-smi: 16,160 / 32,510 MiB.
        # DGX-1: four 100 Gb/s EDR ports for eight GPUs.
        _gpu("v100-16gb", "NVIDIA V100 16GB SXM2", 16_160 * MiB, 125, NVLINK2, IB_EDR_PER_2, PCIE3, _V100, DGX1_NICS,
             GpuArchitecture.volta),
        _gpu("v100-32gb", "NVIDIA V100 32GB SXM2", 32_510 * MiB, 125, NVLINK2, IB_EDR_PER_2, PCIE3, _V100, DGX1_NICS,
             GpuArchitecture.volta),
        # bf16 312 TFLOP/s dense (624 with sparsity). nvidia-smi: 40,960 MiB (older drivers
        # showed 40,536) and 81,920 MiB. DGX A100: one 200 Gb/s HDR port per GPU.
        _gpu("a100-40gb", "NVIDIA A100 40GB SXM", 40 * GiB, 312, NVLINK3, IB_HDR, PCIE4, _A100, DGX_A100_NICS,
             GpuArchitecture.ampere, nvswitch=True),
        _gpu("a100-80gb", "NVIDIA A100 80GB SXM", 80 * GiB, 312, NVLINK3, IB_HDR, PCIE4, _A100, DGX_A100_NICS,
             GpuArchitecture.ampere, nvswitch=True, achievable=A100_80GB_ACHIEVED),
        # bf16 1,979 TFLOP/s with sparsity, 989 dense; FP8 3,958 with sparsity, 1,979 dense.
        # nvidia-smi: 81,559 MiB (79.65 GiB). DGX H100: one 400 Gb/s NDR port per GPU.
        _gpu("h100-80gb", "NVIDIA H100 80GB SXM", 81_559 * MiB, 989, NVLINK4, IB_NDR, PCIE5,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM); NVIDIA DGX H100 datasheet", DGX_H100_NICS,
             GpuArchitecture.hopper, nvswitch=True, achievable=H100_ACHIEVED, fp8_tflops=1979),
        # Same compute as the H100 SXM (FP8 3,958 TFLOP/s with sparsity, 1,979 dense); 141 GB
        # HBM3e, which nvidia-smi shows as 143,771 MiB.
        _gpu("h200-141gb", "NVIDIA H200 141GB SXM", 143_771 * MiB, 989, NVLINK4, IB_NDR, PCIE5,
             "NVIDIA H200 Tensor Core GPU datasheet (SXM); NVIDIA DGX H200 datasheet", DGX_H200_NICS,
             GpuArchitecture.hopper, nvswitch=True, achievable=H200_ACHIEVED, fp8_tflops=1979),
        # HGX B200: 18 PFLOP/s fp16/bf16 dense for 8 GPUs = 2.25 each. DGX B200: 1,440 GB of GPU
        # memory for 8 GPUs, which nvidia-smi shows as 183,359 MiB each; 8 x 400 Gb/s.
        _gpu("b200", "NVIDIA B200 SXM", 183_359 * MiB, 2250, NVLINK5, IB_NDR, PCIE5,
             "NVIDIA HGX B200 datasheet; NVIDIA DGX B200 datasheet", DGX_B200_NICS,
             GpuArchitecture.blackwell, nvswitch=True),
        # bf16 1,307.4 TFLOP/s dense. 192 GB HBM3, exactly 192 GiB on bare metal (an SR-IOV
        # virtual function reports 196,288 MiB). Network: eight 400 Gb/s NICs per node.
        _gpu("mi300x", "AMD Instinct MI300X", 192 * GiB, 1307.4, INFINITY_FABRIC, IB_NDR, PCIE5,
             "AMD Instinct MI300X accelerator data sheet", MI300X_NICS, GpuArchitecture.cdna3),
        # bf16 362.05 TFLOP/s dense (733 with sparsity). 48 GB GDDR6, 46,068 MiB with ECC on.
        # No NVLink: peers talk over PCIe.
        _gpu("l40s", "NVIDIA L40S", 46_068 * MiB, 362.05, PCIE4, ROCE_100G, PCIE4,
             "NVIDIA L40S GPU datasheet", ROCE_100G_NICS, GpuArchitecture.ada),
        # AWS's variant of the A10 (no public datasheet of its own). Tensor rate: the figure cloud
        # providers publish for the A10G, 70 TFLOP/s fp16/bf16 dense (the A10's 125 is an upper
        # bound). 24 GB GDDR6, 23,028 MiB with ECC on. g5.48xlarge: 8 GPUs share 100 Gb/s.
        _gpu("a10g", "NVIDIA A10G (AWS)", 23_028 * MiB, 70, PCIE4, ETH_100G_PER_8, PCIE4,
             "NVIDIA A10 Tensor Core GPU datasheet (memory, PCIe); Amazon EC2 G5 instance specifications (network)", G5_NICS,
             GpuArchitecture.ampere),
        # bf16 with fp32 accumulate 165.2 TFLOP/s dense (330.4 with fp16 accumulate, the
        # figure often quoted). 24 GB GDDR6X, 24,564 MiB. Peer-to-peer is off on GeForce, so
        # peers go through host memory. Assumed an 8-card server on one 25 GbE port.
        _gpu("rtx-4090", "NVIDIA GeForce RTX 4090", 24_564 * MiB, 165.2, PCIE4, ETH_25G_PER_8, PCIE4,
             "NVIDIA Ada Lovelace GPU Architecture whitepaper (GeForce RTX 4090)", ETH_25G_NICS,
             GpuArchitecture.ada),
        # MI325X: the MI300X's compute (bf16 1,307.4 TFLOP/s dense) and Infinity Fabric, 256 GB
        # HBM3E. No published rocm-smi total found: 256 GiB, derived as the MI300X's 192 GB reports
        # exactly 192 GiB on bare metal.
        _gpu("mi325x", "AMD Instinct MI325X", 256 * GiB, 1307.4, INFINITY_FABRIC, IB_NDR, PCIE5,
             "AMD Instinct MI325X accelerator data sheet", MI300X_NICS, GpuArchitecture.cdna3),
        # Boards of the same dies in other form factors and export variants. An NVLink bridge that
        # joins two PCIe cards (RTX 3090, RTX A6000, A40, A100 PCIe, H100 PCIe / NVL) links one pair,
        # not every GPU of the node, which intra_node_link cannot say: their peers are on PCIe here.
        # V100 PCIe: fp16 tensor 112 TFLOP/s (no bf16). nvidia-smi: 16,160 / 32,510 MiB, as the SXM2.
        _gpu("v100-pcie-16gb", "NVIDIA V100 16GB PCIe", 16_160 * MiB, 112, PCIE3, ROCE_100G, PCIE3,
             "NVIDIA Tesla V100 GPU Accelerator datasheet (PCIe)", ROCE_100G_NICS, GpuArchitecture.volta),
        _gpu("v100-pcie-32gb", "NVIDIA V100 32GB PCIe", 32_510 * MiB, 112, PCIE3, ROCE_100G, PCIE3,
             "NVIDIA Tesla V100 GPU Accelerator datasheet (PCIe)", ROCE_100G_NICS, GpuArchitecture.volta),
        # A100 PCIe: bf16 312 TFLOP/s dense as the SXM (the datasheet gives both form factors one
        # figure; the PCIe card's 250-300 W sustains less). nvidia-smi: 40,960 and 81,920 MiB.
        _gpu("a100-pcie-40gb", "NVIDIA A100 40GB PCIe", 40 * GiB, 312, PCIE4, ROCE_100G, PCIE4,
             "NVIDIA A100 Tensor Core GPU datasheet (PCIe)", ROCE_100G_NICS, GpuArchitecture.ampere),
        _gpu("a100-pcie-80gb", "NVIDIA A100 80GB PCIe", 80 * GiB, 312, PCIE4, ROCE_100G, PCIE4,
             "NVIDIA A100 Tensor Core GPU datasheet (PCIe)", ROCE_100G_NICS, GpuArchitecture.ampere),
        # A800 SXM: the A100 SXM's compute and memory, NVLink cut to 400 GB/s bidirectional.
        # nvidia-smi "NVIDIA A800-SXM4-80GB": 81,920 MiB (https://github.com/dexmal/dexbotic/issues/41).
        _gpu("a800-80gb", "NVIDIA A800 80GB SXM", 80 * GiB, 312, NVLINK3_A800, IB_HDR, PCIE4,
             "NVIDIA A800 Tensor Core GPU datasheet (SXM)", A800_NICS, GpuArchitecture.ampere, nvswitch=True),
        # H100 PCIe: bf16 1,513 TFLOP/s with sparsity, 756 dense; FP8 3,026 / 1,513. nvidia-smi
        # "NVIDIA H100 PCIe": 81,559 MiB, as the SXM.
        _gpu("h100-pcie", "NVIDIA H100 80GB PCIe", 81_559 * MiB, 756, PCIE5, ROCE_100G, PCIE5,
             "NVIDIA H100 Tensor Core GPU datasheet (PCIe)", ROCE_100G_NICS, GpuArchitecture.hopper, fp8_tflops=1513),
        # H100 NVL (per GPU): bf16 1,671 TFLOP/s with sparsity, 835.5 dense; FP8 3,341 / 1,670.5.
        # 94 GB HBM3; nvidia-smi "NVIDIA H100 NVL": 95,830 MiB
        # (https://github.com/NVIDIA/gpu-admin-tools/issues/4).
        _gpu("h100-nvl", "NVIDIA H100 NVL 94GB", 95_830 * MiB, 835.5, PCIE5, ROCE_100G, PCIE5,
             "NVIDIA H100 NVL GPU datasheet", ROCE_100G_NICS, GpuArchitecture.hopper, fp8_tflops=1670.5),
        # H800 SXM: the H100 SXM's compute (bf16 989 dense, FP8 1,979 dense), NVLink cut to 400 GB/s
        # bidirectional. Memory: the H100 SXM's reported 81,559 MiB for the same 80 GB HBM3 (no
        # published H800 total found).
        _gpu("h800-80gb", "NVIDIA H800 80GB SXM", 81_559 * MiB, 989, NVLINK4_H800, IB_NDR, PCIE5,
             "NVIDIA H800 Tensor Core GPU datasheet (SXM)", H800_NICS, GpuArchitecture.hopper, nvswitch=True,
             fp8_tflops=1979),
        # GeForce RTX 3090: bf16 with fp32 accumulate 71 TFLOP/s dense (142 with fp16 accumulate,
        # 284 with sparsity). 24 GB GDDR6X without ECC; nvidia-smi: 24,576 MiB
        # (https://github.com/noonghunna/club-3090/issues/390). Peer-to-peer off, as the RTX 4090.
        _gpu("rtx-3090", "NVIDIA GeForce RTX 3090", 24_576 * MiB, 71, PCIE4, ETH_25G_PER_8, PCIE4,
             "NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, Appendix A (GeForce RTX 3090)", ETH_25G_NICS,
             GpuArchitecture.ampere),
        # RTX A6000: bf16 with fp32 accumulate 154.8 TFLOP/s dense (309.7 with sparsity). 48 GB
        # GDDR6; nvidia-smi: 49,140 MiB with ECC off, as published outputs show it (ECC on takes
        # 1/16: 46,068 MiB, as the A40). Assumed a server on one 25 GbE port, as the GeForce cards.
        _gpu("rtx-a6000", "NVIDIA RTX A6000", 49_140 * MiB, 154.8, PCIE4, ETH_25G_PER_8, PCIE4,
             "NVIDIA RTX A6000 datasheet; NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, Appendix C",
             ETH_25G_NICS, GpuArchitecture.ampere),
        # A40: bf16 149.7 TFLOP/s dense (299.4 with sparsity). 48 GB GDDR6 with ECC on (the data
        # center default): 46,068 MiB, 1/16 less than the 49,140 MiB it reports with ECC off.
        _gpu("a40", "NVIDIA A40", 46_068 * MiB, 149.7, PCIE4, ROCE_100G, PCIE4, "NVIDIA A40 datasheet", ROCE_100G_NICS,
             GpuArchitecture.ampere),
        # A10: bf16 125 TFLOP/s dense (250 with sparsity). 24 GB GDDR6; NVML total with ECC on
        # 24,146,608,128 bytes = 23,028 MiB (https://github.com/mayooot/detect-gpu/issues/3).
        _gpu("a10", "NVIDIA A10", 23_028 * MiB, 125, PCIE4, ROCE_100G, PCIE4, "NVIDIA A10 Tensor Core GPU datasheet",
             ROCE_100G_NICS, GpuArchitecture.ampere),
        # L40: bf16 181.05 TFLOP/s dense (362.1 with sparsity; the L40S doubles it). 48 GB GDDR6;
        # nvidia-smi with ECC on: 46,068 MiB, as the L40S.
        _gpu("l40", "NVIDIA L40", 46_068 * MiB, 181.05, PCIE4, ROCE_100G, PCIE4, "NVIDIA L40 GPU datasheet",
             ROCE_100G_NICS, GpuArchitecture.ada),
        # L4: bf16 242 TFLOP/s with sparsity, 121 dense. 24 GB GDDR6; nvidia-smi with ECC on:
        # 23,034 MiB. g6.48xlarge: 8 GPUs share 100 Gb/s.
        _gpu("l4", "NVIDIA L4", 23_034 * MiB, 121, PCIE4, ETH_100G_PER_8, PCIE4,
             "NVIDIA L4 Tensor Core GPU datasheet; Amazon EC2 G6 instance specifications (network)", G6_NICS,
             GpuArchitecture.ada),
        # T4: mixed-precision (fp16 with fp32 accumulate) tensor 65 TFLOP/s; no bf16 tensor cores.
        # 16 GB GDDR6; nvidia-smi with ECC on: 15,360 MiB (16 GiB less 1/16; some drivers show
        # 15,109). g4dn.metal: 8 GPUs share 100 Gb/s.
        _gpu("t4", "NVIDIA T4", 15_360 * MiB, 65, PCIE3, ETH_100G_PER_8, PCIE3,
             "NVIDIA T4 Tensor Core GPU datasheet; Amazon EC2 G4 instance specifications (network)", G4DN_NICS,
             GpuArchitecture.turing),
    ]
}

_ALIASES = {
    "v100": "v100-32gb",
    "v100-pcie": "v100-pcie-32gb",
    "a100-pcie": "a100-pcie-80gb",
    "a800": "a800-80gb",
    "h100-nvl-94gb": "h100-nvl",
    "h100-pcie-80gb": "h100-pcie",
    "h800": "h800-80gb",
    "rtx3090": "rtx-3090",
    "3090": "rtx-3090",
    "a6000": "rtx-a6000",
    "rtxa6000": "rtx-a6000",
    "a100": "a100-80gb",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h200": "h200-141gb",
    "rtx4090": "rtx-4090",
    "4090": "rtx-4090",
}


def gpu_names() -> list[str]:
    """Canonical catalog names, sorted."""
    return sorted(_CATALOG)


def get_gpu(name: str) -> GpuSpec:
    """A catalog GPU by canonical name or alias, case-insensitively."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in _CATALOG:
        raise unknown_name_error("gpu", name, _CATALOG)
    return _CATALOG[key]


def load_gpu_file(path: str | Path) -> GpuSpec:
    """A custom GPU from a JSON file holding an object with GpuSpec's fields."""
    import json  # only for a file: a preset name never loads it

    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ZeroplanError("gpu", f"cannot read {str(path)!r}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ZeroplanError("gpu", f"{str(path)!r} is not a UTF-8 text file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ZeroplanError(
            "gpu", f"{str(path)!r} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})"
        ) from None
    except RecursionError:
        raise nested_too_deeply_error("gpu", path, "a GPU file nests two") from None
    if not isinstance(data, dict):
        raise ZeroplanError("gpu", f"{str(path)!r} must hold a JSON object with the fields of a GPU")
    try:
        # Strict: JSON's "yes" is not a boolean nor "8" a count; enum values stay strings.
        return GpuSpec.model_validate_json(text, strict=True)
    except ValidationError as error:
        raise first_error(error, prefix="gpu") from None


def custom_gpu(
    name: str,
    memory_bytes: int,
    peak_bf16_flops_per_s: float,
    intra_bandwidth_bytes_per_s: float,
    inter_bandwidth_bytes_per_s: float,
    host_bandwidth_bytes_per_s: float = PCIE4.bandwidth_bytes_per_s,
    *,
    display_name: str | None = None,
    intra_latency_s: float = NVLINK_LATENCY_S,
    inter_latency_s: float = RDMA_LATENCY_S,
    host_latency_s: float = PCIE_LATENCY_S,
) -> GpuSpec:
    """A GPU described by numbers alone (e.g. from command-line flags). Bandwidths are per GPU
    and per direction; latencies default to the catalog's NVLink, RDMA and PCIe values and
    the host link to PCIe 4.0 x16."""
    def link(kind: str, bandwidth: float, latency: float) -> dict:
        return {"name": f"{kind} (user)", "bandwidth_bytes_per_s": bandwidth, "latency_s": latency}

    # Validated as one document, so that an error names the nested field (gpu.host_link...).
    try:
        return GpuSpec.model_validate({
            "name": name,
            "display_name": display_name or name,
            "memory_bytes": memory_bytes,
            "peak_bf16_flops_per_s": peak_bf16_flops_per_s,
            "intra_node_link": link("intra-node", intra_bandwidth_bytes_per_s, intra_latency_s),
            "inter_node_link": link("inter-node", inter_bandwidth_bytes_per_s, inter_latency_s),
            "host_link": link("host", host_bandwidth_bytes_per_s, host_latency_s),
            "source": "user-supplied figures",
        })
    except ValidationError as error:
        raise first_error(error, prefix="gpu") from None
