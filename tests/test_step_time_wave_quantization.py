"""benchmarks/step_time_mechanisms.py's tile and wave quantization variants and
benchmarks/step_time_hfu_spread.py's rank correlation (docs/validation.md, "What the HFU tracks
within a source"): the busy share of a product's waves against hand-computed cases, its
direction with the model's width, and Spearman's rho on small cases."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.scripts import load_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
MECHANISMS = load_script(BENCHMARKS / "step_time_mechanisms.py")
SPREAD = load_script(BENCHMARKS / "step_time_hfu_spread.py")


def test_busy_share_of_a_products_waves_by_hand() -> None:
    largest = MECHANISMS.LARGEST_TILES
    # 1,536 x 1,536 on 132 SMs: 6 x 12 = 72 tiles of 256 x 128, one wave of 132 slots
    assert MECHANISMS.quantized_busy(1536, 1536, 132, largest) == pytest.approx(1536 * 1536 / (132 * 256 * 128))
    # 4,608 x 1,536: 18 x 12 = 216 tiles (either orientation), two waves
    assert MECHANISMS.quantized_busy(4608, 1536, 132, largest) == pytest.approx(216 / 264)
    # a partial tile: 300 x 256 takes two 256-row tiles (or three 128-row ones), one wave of 108
    assert MECHANISMS.quantized_busy(300, 256, 108, largest) == pytest.approx(300 * 256 / (108 * 256 * 128))
    # exactly 132 full tiles: nothing idles
    assert MECHANISMS.quantized_busy(256 * 12, 128 * 11, 132, largest) == 1.0
    # the best of several tiles is at least as busy as any one of them
    assert (MECHANISMS.quantized_busy(4608, 1536, 132, MECHANISMS.GUIDE_TILES)
            >= MECHANISMS.quantized_busy(4608, 1536, 132, largest))


def _row_request(name: str):  # type: ignore[no-untyped-def]
    from zeroplan.validate.step_time import load_published_throughput

    return next(row for row in load_published_throughput().rows if row.name == name).request()


def test_a_narrow_models_weight_gradients_idle_more_than_a_wide_ones() -> None:
    narrow = _row_request("mpt-760m h100 x8 s2048 b24x2 no AC")
    wide = _row_request("mpt-7b h100 x8 s2048 b6x1 no AC")
    tiles = MECHANISMS.LARGEST_TILES
    narrow_forward, narrow_backward = MECHANISMS.wave_multipliers(narrow, tiles, False)
    wide_forward, wide_backward = MECHANISMS.wave_multipliers(wide, tiles, False)
    assert narrow_backward > wide_backward > 1.0
    # split over their long reduction, the weight gradients fill the SMs and the gap shrinks
    _, split_narrow = MECHANISMS.wave_multipliers(narrow, tiles, True)
    assert 1.0 <= split_narrow < narrow_backward
    # no multiplier below full waves
    assert min(narrow_forward, wide_forward) >= 1.0


def test_spearman_by_hand() -> None:
    assert SPREAD.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert SPREAD.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take their mean rank: x ranks 0, 1.5, 1.5, 3
    rx, ry = [0, 1.5, 1.5, 3], [0, 1, 2, 3]
    mean = 1.5
    expected = sum((a - mean) * (b - mean) for a, b in zip(rx, ry)) / math.sqrt(
        sum((a - mean) ** 2 for a in rx) * sum((b - mean) ** 2 for b in ry))
    assert SPREAD.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(expected)
    assert SPREAD.spearman([1, 1, 1], [1, 2, 3]) is None
