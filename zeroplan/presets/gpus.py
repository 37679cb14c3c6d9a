"""The GPU catalog: memory in bytes as the driver reports it, dense bf16 throughput, and the
links a GPU of that kind typically sits behind. docs/gpus.md lists the sources and the
assumptions (per-GPU share of the node's network, latencies)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from zeroplan.errors import ZeroplanError, unknown_name_error
from zeroplan.specs.base import first_error
from zeroplan.specs.hardware import GpuSpec, LinkSpec
from zeroplan.units import GB, GiB, MiB

# Latencies (alpha) are typical small-message figures, named assumptions: NCCL over NVLink
# a few microseconds, over InfiniBand somewhat more, over Ethernet/TCP tens.
NVLINK_LATENCY_S = 3e-6
PCIE_LATENCY_S = 5e-6
INFINIBAND_LATENCY_S = 8e-6
ETHERNET_LATENCY_S = 25e-6


def _link(name: str, bandwidth_gb_per_s: float, latency_s: float) -> LinkSpec:
    return LinkSpec(name=name, bandwidth_bytes_per_s=bandwidth_gb_per_s * GB, latency_s=latency_s)


# Unidirectional per-GPU bandwidths: NVLink is quoted bidirectional by NVIDIA, so half of it;
# a network card's bit rate / 8; PCIe x16 per direction.
PCIE3 = _link("PCIe 3.0 x16", 16, PCIE_LATENCY_S)
PCIE4 = _link("PCIe 4.0 x16", 32, PCIE_LATENCY_S)
PCIE5 = _link("PCIe 5.0 x16", 64, PCIE_LATENCY_S)
NVLINK2 = _link("NVLink 2 (300 GB/s bidirectional)", 150, NVLINK_LATENCY_S)
NVLINK3 = _link("NVLink 3 / NVSwitch (600 GB/s bidirectional)", 300, NVLINK_LATENCY_S)
NVLINK4 = _link("NVLink 4 / NVSwitch (900 GB/s bidirectional)", 450, NVLINK_LATENCY_S)
NVLINK5 = _link("NVLink 5 / NVSwitch (1.8 TB/s bidirectional)", 900, NVLINK_LATENCY_S)
INFINITY_FABRIC = _link("Infinity Fabric (7 x 64 GB/s peer links)", 448, NVLINK_LATENCY_S)
IB_EDR = _link("InfiniBand EDR 100 Gb/s per GPU", 12.5, INFINIBAND_LATENCY_S)
IB_HDR = _link("InfiniBand HDR 200 Gb/s per GPU", 25, INFINIBAND_LATENCY_S)
IB_NDR = _link("InfiniBand NDR 400 Gb/s per GPU", 50, INFINIBAND_LATENCY_S)
ETH_100G = _link("100 GbE per GPU", 12.5, ETHERNET_LATENCY_S)
ETH_100G_SHARED_8 = _link("100 GbE shared by 8 GPUs (AWS g5.48xlarge)", 12.5 / 8, ETHERNET_LATENCY_S)
ETH_10G = _link("10 GbE per node", 1.25, ETHERNET_LATENCY_S)


def _gpu(name, display, memory_bytes, tflops, intra, inter, host, source) -> GpuSpec:
    return GpuSpec(
        name=name, display_name=display, memory_bytes=memory_bytes,
        peak_bf16_flops_per_s=tflops * 1e12, intra_node_link=intra, inter_node_link=inter,
        host_link=host, source=source,
    )


_CATALOG: dict[str, GpuSpec] = {
    gpu.name: gpu
    for gpu in [
        # V100 has no bf16: the fp16 tensor-core figure is used.
        _gpu("v100-16gb", "NVIDIA V100 16GB SXM2", 16 * GiB, 125, NVLINK2, IB_EDR, PCIE3,
             "NVIDIA Tesla V100 datasheet (fp16 tensor 125 TFLOPS, NVLink 300 GB/s)"),
        _gpu("v100-32gb", "NVIDIA V100 32GB SXM2", 32 * GiB, 125, NVLINK2, IB_EDR, PCIE3,
             "NVIDIA Tesla V100 datasheet (fp16 tensor 125 TFLOPS, NVLink 300 GB/s)"),
        _gpu("a100-40gb", "NVIDIA A100 40GB SXM", 40 * GiB, 312, NVLINK3, IB_HDR, PCIE4,
             "NVIDIA A100 Tensor Core GPU datasheet (bf16 312 TFLOPS dense, NVLink 600 GB/s)"),
        _gpu("a100-80gb", "NVIDIA A100 80GB SXM", 80 * GiB, 312, NVLINK3, IB_HDR, PCIE4,
             "NVIDIA A100 Tensor Core GPU datasheet (bf16 312 TFLOPS dense, NVLink 600 GB/s)"),
        _gpu("h100-80gb", "NVIDIA H100 80GB SXM", 80 * GiB, 989, NVLINK4, IB_NDR, PCIE5,
             "NVIDIA H100 Tensor Core GPU datasheet (bf16 1979 TFLOPS with sparsity, 989 dense; NVLink 900 GB/s)"),
        # 141 GB of HBM3e; the driver reports 143,771 MiB.
        _gpu("h200-141gb", "NVIDIA H200 141GB SXM", 143_771 * MiB, 989, NVLINK4, IB_NDR, PCIE5,
             "NVIDIA H200 Tensor Core GPU datasheet (141 GB HBM3e, bf16 989 TFLOPS dense, NVLink 900 GB/s)"),
        # DGX B200: 1,440 GB of GPU memory over 8 GPUs.
        _gpu("b200", "NVIDIA B200 SXM", 180 * GB, 2250, NVLINK5, IB_NDR, PCIE5,
             "NVIDIA DGX B200 datasheet (1,440 GB per 8 GPUs; HGX B200 18 PFLOPS fp16/bf16 dense per 8 GPUs; NVLink 1.8 TB/s)"),
        _gpu("mi300x", "AMD Instinct MI300X", 192 * GiB, 1307, INFINITY_FABRIC, IB_NDR, PCIE5,
             "AMD Instinct MI300X data sheet (192 GB HBM3, bf16 1307.4 TFLOPS dense, 7 Infinity Fabric links)"),
        # 48 GB GDDR6; the driver reports 46,068 MiB with ECC on. No NVLink: peers talk over PCIe.
        _gpu("l40s", "NVIDIA L40S", 46_068 * MiB, 362, PCIE4, ETH_100G, PCIE4,
             "NVIDIA L40S datasheet (bf16 362 TFLOPS dense, 733 with sparsity)"),
        # AWS's A10G: the A10 datasheet's bf16 figure (AWS publishes no separate one); 23,028 MiB reported.
        _gpu("a10g", "NVIDIA A10G (AWS)", 23_028 * MiB, 125, PCIE4, ETH_100G_SHARED_8, PCIE4,
             "NVIDIA A10 datasheet (bf16 125 TFLOPS dense); AWS EC2 G5 instance page (100 Gb/s per 8 GPUs)"),
        _gpu("rtx-4090", "NVIDIA GeForce RTX 4090", 24_564 * MiB, 165, PCIE4, ETH_10G, PCIE4,
             "NVIDIA Ada GPU architecture whitepaper (bf16 tensor with fp32 accumulate 165.2 TFLOPS dense)"),
    ]
}

_ALIASES = {
    "v100": "v100-32gb", "a100": "a100-80gb", "h100": "h100-80gb",
    "h200": "h200-141gb", "4090": "rtx-4090",
}


def gpu_names() -> list[str]:
    """Canonical catalog names."""
    return sorted(_CATALOG)


def get_gpu(name: str) -> GpuSpec:
    """A catalog GPU by name or alias, case-insensitively."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _CATALOG:
        raise unknown_name_error("gpu", name, _CATALOG)
    return _CATALOG[key]


def load_gpu_file(path: str | Path) -> GpuSpec:
    """A custom GPU from a JSON file holding GpuSpec's fields."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise ZeroplanError("gpu", f"cannot read {str(path)!r}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ZeroplanError("gpu", f"{str(path)!r} is not valid JSON (line {error.lineno}: {error.msg})") from None
    try:
        return GpuSpec.model_validate(data)
    except ValidationError as error:
        raise first_error(error, prefix="gpu") from None


def custom_gpu(
    name: str, memory_bytes: int, peak_bf16_flops_per_s: float, intra_bandwidth_bytes_per_s: float,
    inter_bandwidth_bytes_per_s: float, host_bandwidth_bytes_per_s: float = PCIE4.bandwidth_bytes_per_s,
) -> GpuSpec:
    """A GPU described by numbers alone, with the catalog's default latencies."""
    try:
        return GpuSpec(
            name=name, display_name=name, memory_bytes=memory_bytes, peak_bf16_flops_per_s=peak_bf16_flops_per_s,
            intra_node_link=LinkSpec(name="intra-node", bandwidth_bytes_per_s=intra_bandwidth_bytes_per_s, latency_s=NVLINK_LATENCY_S),
            inter_node_link=LinkSpec(name="inter-node", bandwidth_bytes_per_s=inter_bandwidth_bytes_per_s, latency_s=INFINIBAND_LATENCY_S),
            host_link=LinkSpec(name="host", bandwidth_bytes_per_s=host_bandwidth_bytes_per_s, latency_s=PCIE_LATENCY_S),
            source="user-supplied figures",
        )
    except ValidationError as error:
        raise first_error(error, prefix="gpu") from None
