"""Host nodes whose CPUs and memory run offload's optimizer step (HostSpec), each with its source."""

from __future__ import annotations

from zeroplan.errors import unknown_name_error
from zeroplan.specs.hardware import HostSpec

# NVIDIA DGX H100 user guide, "Hardware overview": two Intel Xeon Platinum 8480C, 56 cores each;
# Intel ark (Xeon Platinum 8480+): eight DDR5-4800 channels a socket, 16 x 4800 MT/s x 8 B =
# 614.4 GB/s. HostSpec's defaults.
DGX_H100 = HostSpec()

# NVIDIA DGX A100 user guide, "Hardware overview": two AMD EPYC 7742, 64 cores each, and the GPUs
# in pairs behind four PCIe switches; AMD's EPYC 7742 product page: eight DDR4-3200 channels a
# socket, 16 x 3200 MT/s x 8 B = 409.6 GB/s.
DGX_A100 = HostSpec(memory_bandwidth_bytes_per_s=409.6e9, cores_per_node=128, gpus_per_host_link=2)

# NVIDIA DGX-2 (16 V100 SXM3; the host of ZeRO-Offload's single-GPU figures): two Intel Xeon
# Platinum 8168, 24 cores each (NVIDIA DGX-2 datasheet); Intel ark (Xeon Platinum 8168): six
# DDR4-2666 channels a socket, 12 x 2666 MT/s x 8 B = 255.9 GB/s. How its GPUs share the PCIe
# switches is not taken from a source here, so each GPU is given its own link (the rows on it
# run one GPU). zeroplan.core.cpu_adam_anchor fits the CPU-Adam rate on this host.
DGX_2 = HostSpec(memory_bandwidth_bytes_per_s=2 * 6 * 2666e6 * 8, cores_per_node=48)

HOST_PRESETS: dict[str, HostSpec] = {"dgx-h100": DGX_H100, "dgx-a100": DGX_A100, "dgx-2": DGX_2}


def get_host(name: str) -> HostSpec:
    key = name.strip().lower()
    if key not in HOST_PRESETS:
        raise unknown_name_error("host", name, HOST_PRESETS)
    return HOST_PRESETS[key]
