"""Each validated quantity's marker and colour, the same in every plot (zeroplan validate's and
zeroplan.report.plots'); no matplotlib here."""

from __future__ import annotations

import hashlib

_MARKERS = "osD^vP*Xh<>p"
_KNOWN_QUANTITIES = (
    "parameters", "gradients", "optimizer states", "activations (saved)", "activations (saved, per micro-batch)",
    "peak (CPU allocator)", "peak (CUDA allocated)", "peak (tracked tensors)", "host (offloaded)",
)
"""The memory quantities compare_record writes, in a fixed order: each keeps its marker and
colour in every plot, whichever of them a plot shows."""


def quantity_style(quantity: str) -> tuple[str, str]:
    """(marker, colour) of a quantity, the same in every plot: the known ones by their place,
    the collectives' ("all_gather bytes/step", ...) by a stable digest of the name."""
    if quantity in _KNOWN_QUANTITIES:
        index = _KNOWN_QUANTITIES.index(quantity)
    else:
        index = len(_KNOWN_QUANTITIES) + int(hashlib.sha256(quantity.encode()).hexdigest(), 16) % 97
    return _MARKERS[index % len(_MARKERS)], f"C{index % 10}"
