"""The verdict's margin: how far the GPU's real peak may lie from the predicted one, as measured
against published runs, and whether a prediction is close enough to the usable memory that the
measured error could turn the verdict ("borderline")."""

from __future__ import annotations

from zeroplan.core.record import frozen


@frozen
class PeakErrorBand:
    """The middle half of measured / predicted peak over published runs."""

    low: float
    """25th percentile of measured / predicted."""
    high: float
    """75th percentile of measured / predicted."""
    rows: int
    """Published runs the quartiles are over."""


# benchmarks/published_memory_accuracy.py prints these ("error band"): the quartiles of measured
# / predicted over the published runs that report max_memory_reserved, the figure the allocator
# model's verdict rests on (benchmarks/published_memory/rows.csv; docs/validation.md), one band
# for runs of one sequence length and one for runs whose batches vary in length (planned with
# --varying-lengths: their reserve is an expectation over an epoch, and its error is its own). A
# test recomputes them from the rows, so they move with the model and the data.
PEAK_ERROR_BAND = PeakErrorBand(low=0.968, high=1.053, rows=85)
VARYING_LENGTHS_PEAK_ERROR_BAND = PeakErrorBand(low=0.923, high=1.007, rows=87)
# The same quartiles over the published runs that report max_memory_allocated: the allocated peak
# is the floor under any reserve, so a fit whose allocated peak alone may reach the usable memory
# is borderline whatever its reserve's band says (the varying-length band lies lower: its reserve
# is over-predicted, its allocated step is not).
ALLOCATED_PEAK_ERROR_BAND = PeakErrorBand(low=1.000, high=1.021, rows=116)


def error_band(varying_lengths: bool) -> PeakErrorBand:
    """The band of the published runs like the request: of varying-length batches or not."""
    return VARYING_LENGTHS_PEAK_ERROR_BAND if varying_lengths else PEAK_ERROR_BAND


def peak_range_bytes(peak_bytes: int, band: PeakErrorBand = PEAK_ERROR_BAND) -> tuple[int, int]:
    """Where the real peak of a run predicted at ``peak_bytes`` lies for the middle half of
    published runs."""
    return int(peak_bytes * band.low), int(peak_bytes * band.high)


def allocated_reaches_usable(allocated_peak_bytes: int, usable_bytes: int) -> bool:
    """Whether the allocated peak alone, at the high end of ALLOCATED_PEAK_ERROR_BAND, reaches
    the usable memory."""
    return usable_bytes <= int(allocated_peak_bytes * ALLOCATED_PEAK_ERROR_BAND.high)


def is_borderline(peak_bytes: int, usable_bytes: int, band: PeakErrorBand = PEAK_ERROR_BAND,
                  split_segment_bytes: int = 0, allocated_peak_bytes: int = 0) -> bool:
    """Whether the measured error alone could turn the verdict: a predicted fit whose range
    reaches past the usable memory, or a predicted OOM whose range reaches below it. Where the
    band lies wholly above the prediction (low > 1), a fit just under the usable memory whose whole
    range is past it is borderline too, not a fit with room. A fit whose run may need one more
    segment of ``split_segment_bytes`` than its step, in the orders of lengths where tensors made
    inside the epoch take or split one (zeroplan.allocator.lazy_states), is borderline whatever
    the band; so is a fit whose allocated peak alone may reach the usable memory
    (allocated_reaches_usable)."""
    low, high = peak_range_bytes(peak_bytes, band)
    if peak_bytes <= usable_bytes:
        return (usable_bytes <= high or split_segment_bytes > 0
                or allocated_reaches_usable(allocated_peak_bytes, usable_bytes))
    return low <= usable_bytes


def band_capacities_bytes(usable_bytes: int, band: PeakErrorBand = PEAK_ERROR_BAND) -> tuple[int, int]:
    """The memories on which the prediction's step stands as a real run on ``usable_bytes`` does,
    where the real bytes are the predicted ones times the band's low to high: the usable memory
    over high, to over low (every allocation scaled alike, what the device holds against its
    memory scales alike)."""
    return int(usable_bytes / band.high), int(usable_bytes / band.low)


def borderline_words(peak_bytes: int, usable_bytes: int, band: PeakErrorBand = PEAK_ERROR_BAND,
                     turns_on_bytes: int | None = None, fits: bool = True, allocated_peak_bytes: int = 0) -> str:
    """'borderline: 93-108 % of usable' for a person; where the caching-allocator model finds the
    step going the other way on ``turns_on_bytes`` within the band, that memory instead; where only
    the allocated peak reaches the usable memory (a fit whose band lies below it), the allocated
    peak's range."""
    if turns_on_bytes is not None:
        way = "runs out" if fits else "completes the step"
        return (f"borderline: the caching allocator {way} on {100 * turns_on_bytes / usable_bytes:.1f} % of usable, "
                "where a refused cudaMalloc frees its cache at another moment")
    low, high = peak_range_bytes(peak_bytes, band)
    if fits and high < usable_bytes and allocated_reaches_usable(allocated_peak_bytes, usable_bytes):
        low, high = peak_range_bytes(allocated_peak_bytes, ALLOCATED_PEAK_ERROR_BAND)
        return f"borderline: the allocated peak alone at {100 * low / usable_bytes:.0f}-{100 * high / usable_bytes:.0f} % of usable"
    return f"borderline: {100 * low / usable_bytes:.0f}-{100 * high / usable_bytes:.0f} % of usable"


SPLIT_SEGMENT_NOTE = ("the gradients and optimizer states the loop makes inside an epoch of varying lengths can take a "
                      "segment of the step's largest request, with no room for one more: whether the run completes "
                      "depends on the order of its lengths (docs/memory-model.md, \"Gradients and optimizer states "
                      "made inside the epoch\")")
"""What a table's * says of a fit borderline by split_segment_words."""


def split_segment_words(split_segment_bytes: int) -> str:
    """Why a fit is borderline where tensors made inside the epoch may take one of the step's
    largest segments (zeroplan.allocator.lazy_states), for a person."""
    return f"borderline: {_split_segment_reason(split_segment_bytes)}"


def _split_segment_reason(split_segment_bytes: int) -> str:
    return (f"may run out in some orders of lengths (gradients and optimizer states made inside "
            f"the epoch can take a {split_segment_bytes / 2**30:.2f} GiB segment of the step's largest request, "
            f"and the usable memory has no room for one more)")


def borderline_by_band(peak_bytes: int, usable_bytes: int, band: PeakErrorBand, turns_on_bytes: int | None,
                       allocated_peak_bytes: int = 0) -> bool:
    """Whether the error band makes a verdict borderline: the usable memory within the band
    around the peak (or the allocated peak's), or the caching-allocator model's step turning on a
    memory within its reach (``turns_on_bytes``), whatever the segment tensors made inside the
    epoch may take."""
    return turns_on_bytes is not None or is_borderline(peak_bytes, usable_bytes, band,
                                                       allocated_peak_bytes=allocated_peak_bytes)


def margin_words(peak_bytes: int, usable_bytes: int, band: PeakErrorBand, turns_on_bytes: int | None,
                 fits: bool, split_segment_bytes: int, allocated_peak_bytes: int = 0) -> str:
    """Every reason a verdict is borderline, for a person: the error band's (or the caching
    allocator's turn within it) and, for a fit, the segment tensors made inside the epoch may take;
    both where both hold, so neither hides the other."""
    by_band = borderline_by_band(peak_bytes, usable_bytes, band, turns_on_bytes, allocated_peak_bytes)
    by_segment = fits and split_segment_bytes > 0
    if not by_band:
        return split_segment_words(split_segment_bytes) if by_segment else ""
    words = borderline_words(peak_bytes, usable_bytes, band, turns_on_bytes, fits, allocated_peak_bytes)
    if turns_on_bytes is None:
        words += " for the middle half of published runs"
    return f"{words}, and {_split_segment_reason(split_segment_bytes)}" if by_segment else words
