"""Byte and time units.

Everything inside zeroplan is an integer number of bytes (``*_bytes``) or a float number of
seconds (``*_s``). Conversions to GiB (2**30) or GB (10**9) happen only at the edges, and the
caller always says which one it wants: papers usually mean GB, ``nvidia-smi`` shows MiB.
"""

from __future__ import annotations

from enum import Enum

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40

MB = 10**6
GB = 10**9

FP32_BYTES = 4
BF16_BYTES = 2
"""Bytes of one fp32 and one bf16 element."""


class ByteUnit(str, Enum):
    """A unit for printing byte counts; the name says binary or decimal."""

    GiB = "GiB"
    GB = "GB"
    MiB = "MiB"
    MB = "MB"

    @property
    def size_bytes(self) -> int:
        return {"GiB": GiB, "GB": GB, "MiB": MiB, "MB": MB}[self.value]


def to_unit(num_bytes: int | float, unit: ByteUnit) -> float:
    """Convert a byte count to ``unit`` (a float, for display only)."""
    return num_bytes / unit.size_bytes


def format_bytes(num_bytes: int | float, unit: ByteUnit = ByteUnit.GiB) -> str:
    """Render ``num_bytes`` as e.g. ``'12.34 GiB'``."""
    return f"{to_unit(num_bytes, unit):.2f} {unit.value}"


def ceil_div(numerator: int, denominator: int) -> int:
    """Integer ceiling division for non-negative integers."""
    return -(-numerator // denominator)


def even_split(total: int, count: int) -> tuple[int, ...]:
    """``total`` bytes as ``count`` nearly equal integer parts summing to it exactly (the larger
    first; zero parts left out): a tensor split into equal chunks."""
    quotient, remainder = divmod(total, max(count, 1))
    return tuple(p for p in [quotient + 1] * remainder + [quotient] * (max(count, 1) - remainder) if p > 0)
