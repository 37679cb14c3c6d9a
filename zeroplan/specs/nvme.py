"""NVMe drive presets for --nvme-bandwidth: sequential read and write as their vendors announce
them (docs/communication-time.md, "NVMe offload", says how to measure one's own drive with fio)."""

from __future__ import annotations

from zeroplan.errors import ZeroplanError

GB = 10**9

NVME_PRESETS: dict[str, tuple[float, float]] = {
    # Samsung PM9A3 (PCIe 4.0 x4, U.2), Samsung's announcement (OCP Virtual Global Summit, May 2020):
    # up to 6,500 MB/s sequential read and 3,500 MB/s sequential write.
    "pm9a3": (6.5 * GB, 3.5 * GB),
    # Samsung PM1743 (PCIe 5.0 x4), Samsung's announcement (December 2021): 13,000 MB/s
    # sequential read, 6,600 MB/s sequential write.
    "pm1743": (13.0 * GB, 6.6 * GB),
    # Four PM1743 striped (RAID 0), as ZeRO-Infinity's DGX-2 nodes striped their drives: the sum.
    "4x-pm1743": (52.0 * GB, 26.4 * GB),
}
"""Preset name -> (read, write) bytes per second of one node's swap drive(s)."""


def parse_nvme_bandwidth(text: str) -> tuple[float, float]:
    """--nvme-bandwidth: a preset name, one figure in GB/s (read and write alike) or READ,WRITE."""
    text = text.strip().lower()
    if text in NVME_PRESETS:
        return NVME_PRESETS[text]
    parts = text.split(",")
    try:
        figures = [float(p) for p in parts]
    except ValueError:
        figures = []
    if len(figures) not in (1, 2) or not all(0 < f <= 1e6 for f in figures):
        raise ZeroplanError("--nvme-bandwidth", f"{text!r} is not a drive (allowed: {', '.join(NVME_PRESETS)}, "
                            "GB/s as one figure, or READ,WRITE in GB/s)")
    read, write = figures[0], figures[-1]
    return read * GB, write * GB
