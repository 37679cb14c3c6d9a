"""The notebook's figures: strategy names read level and legends never sit over the bars."""

from __future__ import annotations

import pytest

from zeroplan.core.plan import fit
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PlanRequest, StrategyKind, StrategySpec, cluster_from_gpus

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


@pytest.mark.parametrize("figure_name", ["memory_stack_figure", "communication_figure"])
def test_names_are_level_and_the_legend_is_outside_the_bars(gpu_80gib, figure_name) -> None:
    from zeroplan.report import plots

    request = PlanRequest(model=get_model("llama-2-7b"), batch=BatchSpec(seq_len=4096),
                          cluster=cluster_from_gpus(gpu_80gib, 8), strategy=StrategySpec(kind=StrategyKind.zero3))
    report = fit(request)
    figure = getattr(plots, figure_name)(report)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    axes = figure.axes[-1] if figure_name == "communication_figure" else figure.axes[0]
    names_axes = figure.axes[0]
    labels = [t.get_text() for t in names_axes.get_yticklabels()]
    assert labels == [p.strategy.value for p in report.plans]
    assert all(t.get_rotation() == 0 for t in names_axes.get_yticklabels())
    legend = axes.get_legend().get_window_extent(renderer)
    box = axes.get_window_extent(renderer)
    # Entirely beside or above the axes: it overlaps no bar.
    assert legend.x0 >= box.x1 - 1 or legend.y0 >= box.y1 - 1, (legend, box)


def test_each_memory_bar_ends_at_its_peak(gpu_80gib) -> None:
    from zeroplan.report.plots import memory_stack_figure

    request = PlanRequest(model=get_model("llama-2-70b"), batch=BatchSpec(seq_len=4096),
                          cluster=cluster_from_gpus(gpu_80gib, 8), strategy=StrategySpec(kind=StrategyKind.zero3))
    report = fit(request)
    axes = memory_stack_figure(report).axes[0]
    ends = {}
    for patch in axes.patches:
        y = round(patch.get_y() + patch.get_height() / 2)
        ends[y] = max(ends.get(y, 0.0), patch.get_x() + patch.get_width())
    for position, plan in enumerate(report.plans):
        assert ends[position] == pytest.approx(plan.memory.peak_bytes / 2**30, rel=1e-9)
