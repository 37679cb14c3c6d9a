"""Shared fixtures: a catalog-independent GPU so core tests do not depend on the catalog."""

from __future__ import annotations

import pytest

from zeroplan.specs import GpuSpec, LinkSpec
from zeroplan.units import GiB


@pytest.fixture
def gpu_80gib() -> GpuSpec:
    link = LinkSpec(name="test link", bandwidth_bytes_per_s=100e9, latency_s=5e-6)
    return GpuSpec(
        name="test-80gib", display_name="Test 80 GiB", memory_bytes=80 * GiB,
        peak_bf16_flops_per_s=300e12, intra_node_link=link, inter_node_link=link,
        host_link=link, source="test fixture",
    )
