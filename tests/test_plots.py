"""The notebook's figures: strategy names read level and legends never sit over the bars."""

from __future__ import annotations

import pytest

from zeroplan.core.plan import fit
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PlanRequest, StrategyKind, StrategySpec, cluster_from_gpus

from tests.scripts import load_script

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


@pytest.mark.parametrize("figure_name", ["memory_stack_figure", "step_time_figure"])
def test_names_are_level_and_the_legend_is_outside_the_bars(gpu_80gib, figure_name) -> None:
    from zeroplan.report import plots

    request = PlanRequest(model=get_model("llama-2-7b"), batch=BatchSpec(seq_len=4096),
                          cluster=cluster_from_gpus(gpu_80gib, 8), strategy=StrategySpec(kind=StrategyKind.zero3))
    report = fit(request)
    figure = getattr(plots, figure_name)(report)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    axes = figure.axes[0]
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


def test_the_memory_figure_names_the_run_and_every_thin_segment(gpu_80gib) -> None:
    from zeroplan.report.plots import memory_stack_figure

    request = PlanRequest(model=get_model("llama-2-70b"), batch=BatchSpec(seq_len=4096, micro_batch_size=2),
                          cluster=cluster_from_gpus(gpu_80gib, 8), strategy=StrategySpec(kind=StrategyKind.zero3))
    report = fit(request)
    axes = memory_stack_figure(report).axes[0]
    title = axes.get_title()
    assert "micro-batch 2 x seq 4096" in title and "checkpointing" in title
    usable = report.cluster.usable_memory_bytes / 2**30
    assert f"usable ({usable:.1f} GiB)" in axes.get_legend_handles_labels()[1]
    # A segment under 1 % of the axis is a hairline: each one is named, with its size, beside
    # its bar's end (the buffers and the reserve, beside the states, for most strategies here).
    span = max(usable, *(p.memory.peak_bytes / 2**30 for p in report.plans))
    notes = [t.get_text() for t in axes.texts]
    thin = [(plan, field) for plan in report.plans for field, value in plan.memory.peak_terms().items()
            if 0 < value / 2**30 < 0.01 * span]
    assert thin and len(notes) == len({plan.strategy for plan, _ in thin})


def _rows():
    from zeroplan.validate.rows import ComparisonRow

    def row(run, quantity, predicted, measured):
        return ComparisonRow(run_id=run, strategy="zero3", engine="zeroplan", world_size=2, rank=0, category="memory",
                             quantity=quantity, predicted_bytes=predicted, measured_bytes=measured)
    return [row("run-a", "parameters", 300 * 2**20, 300 * 2**20), row("run-a", "gradients", 300 * 2**20, 301 * 2**20),
            row("run-b", "peak (CPU allocator)", 3000 * 2**20, 2900 * 2**20),
            row("run-b", "all_gather bytes/step", 600 * 2**20, 600 * 2**20)]


def test_the_validation_plot_keeps_each_quantitys_style_and_names_the_runs(tmp_path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    from zeroplan.validate.report import quantity_style, save_validation_plot

    kept = []
    monkeypatch.setattr(plt, "close", lambda figure=None: kept.append(figure))
    rows = _rows()
    save_validation_plot(rows, tmp_path / "all.png")
    save_validation_plot([r for r in rows if r.quantity != "parameters"], tmp_path / "some.png")
    for figure in kept:
        scatter_axes = figure.axes[0]
        for collection in scatter_axes.collections:
            quantity = collection.get_label()
            marker, colour = quantity_style(quantity)
            assert matplotlib.colors.same_color(collection.get_edgecolor()[0], colour), quantity
        assert "run-a" in figure.get_suptitle() and "run-b" in figure.get_suptitle()
        # Values between powers of ten are labelled (200, 500, 2,000 ...), not decades only.
        figure.canvas.draw()
        labels = [t.get_text() for t in scatter_axes.get_xticklabels() if t.get_text()]
        assert any(label.startswith(("2", "5")) for label in labels), labels
        # The ratio panel shows every quantity on its own row.
        assert len(figure.axes[1].get_yticklabels()) == len({c.get_label() for c in scatter_axes.collections})
    assert quantity_style("gradients") == quantity_style("gradients") != quantity_style("parameters")


@pytest.mark.parametrize("compute_model", ["hfu", "roofline"])
@pytest.mark.parametrize("layout, strategies", [
    ({"tp": 2, "pp": 2}, ["zero1", "fsdp-full-shard"]),
    ({}, ["zero3", "zero2-offload"]),
])
def test_the_step_time_figure_stacks_the_parts_of_each_step(compute_model, layout, strategies) -> None:
    """Each strategy's bar is its step with overlap, split into parts that add up to it: compute,
    the exposed communication, the CPU step under offload, the GPU's optimizer step otherwise,
    and under a pipeline its collectives and bubble."""
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.report.plots import step_parts_s, step_time_figure
    from zeroplan.specs import PerformanceAssumptions
    from zeroplan.specs.parallel import ParallelSpec

    request = PlanRequest(model=get_model("llama-2-13b"), batch=BatchSpec(seq_len=4096, grad_accum_steps=4),
                          cluster=cluster_from_gpus(get_gpu("a100-80gb"), 16), strategy=StrategySpec(kind=StrategyKind.zero1),
                          parallel=ParallelSpec(**layout), performance=PerformanceAssumptions(compute_model=compute_model))
    report = fit(request, strategies=strategies)
    for plan in report.plans:
        parts = step_parts_s(plan.time)
        assert sum(parts.values()) == pytest.approx(plan.time.step_with_overlap_s)
        assert (parts["bubble s"] > 0 and parts["model-parallel s"] > 0) == bool(layout)
        # The GPU's optimizer step at the copy bandwidth, under either compute model (an A100 has one).
        assert (parts["opt-step s"] > 0) == (not plan.strategy.offloads_optimizer)
        assert (parts["cpu-step s"] > 0) == plan.strategy.offloads_optimizer
    figure = step_time_figure(report)
    axes = figure.axes[0]
    ends = {}
    for patch in axes.patches:
        row = round(patch.get_y() + patch.get_height() / 2)
        ends[row] = max(ends.get(row, 0.0), patch.get_x() + patch.get_width())
    assert [ends[row] for row in sorted(ends)] == pytest.approx([p.time.step_with_overlap_s for p in report.plans])


def _seed(gpus_per_node: int):
    from zeroplan.presets.gpus import get_gpu

    return fit(PlanRequest(model=get_model("llama-2-13b"), batch=BatchSpec(seq_len=4096),
                           cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8, gpus_per_node=gpus_per_node),
                           strategy=StrategySpec(kind=StrategyKind.zero3)))


@pytest.fixture(scope="module")
def networks():
    return {"1 node x 8 GPUs (NVLink)": _seed(8), "8 nodes x 1 GPU (InfiniBand)": _seed(1)}


def _bar_ends(axes) -> list[float]:
    return [patch.get_x() + patch.get_width() for patch in axes.patches]


def test_the_network_figure_has_a_bar_per_strategy_and_setting_with_units(networks) -> None:
    from zeroplan.report.plots import network_communication_figure

    nvlink, infiniband = networks.values()
    figure = network_communication_figure(networks)
    figure.canvas.draw()
    sent_axes, time_axes = figure.axes
    assert sent_axes.get_xlabel() == "GB sent per GPU per step (ring)"
    assert time_axes.get_xlabel() == "communication per step (s)"
    names = [p.strategy.value for p in nvlink.plans]
    assert [t.get_text() for t in sent_axes.get_yticklabels()] == names
    # The bytes sent do not depend on the links: one bar per strategy, said so in the legend.
    assert _bar_ends(sent_axes) == pytest.approx([p.sent_bytes_per_step / 1e9 for p in nvlink.plans])
    assert sent_axes.get_legend_handles_labels()[1] == ["the same on every network"]
    # Per setting: all collectives, then the exposed part; InfiniBand's take longer than NVLink's.
    expected = []
    for report in (nvlink, infiniband):
        expected += [p.time.communication_s for p in report.plans] + [p.time.exposed_communication_s for p in report.plans]
    assert _bar_ends(time_axes) == pytest.approx(expected)
    assert all(b.time.communication_s > a.time.communication_s for a, b in zip(nvlink.plans, infiniband.plans))
    legend = [t.get_text() for t in time_axes.get_legend().get_texts()]
    assert legend[:2] == list(networks) and "dark: exposed (not overlapped)" in legend


def test_the_tradeoff_figure_has_a_point_per_strategy_and_setting(networks) -> None:
    from zeroplan.report.plots import tradeoff_figure

    figure = tradeoff_figure(networks)
    figure.canvas.draw()
    axes = figure.axes[0]
    assert axes.get_xlabel() == "step time with overlap (s)"
    assert axes.get_ylabel() == "peak per-GPU memory (GiB, log scale)"
    assert len(axes.collections) == 2
    for collection, report in zip(axes.collections, networks.values()):
        points = collection.get_offsets()
        assert [v for point in points for v in point] == pytest.approx(
            [v for p in report.plans for v in (p.time.step_with_overlap_s, p.memory.peak_bytes / 2**30)])
        # Filled where it fits, hollow where it does not.
        faces = collection.get_facecolors()
        assert [face[3] > 0 for face in faces] == [p.fits for p in report.plans]
    # Every strategy is named once per setting, those drawn on the same spot together.
    labels = [t.get_text() for t in axes.texts]
    assert sorted(n for text in labels for n in text.split(", ")) == sorted(
        p.strategy.value for report in networks.values() for p in report.plans)
    usable = next(iter(networks.values())).cluster.usable_memory_bytes / 2**30
    assert f"usable ({usable:.1f} GiB)" in axes.get_legend_handles_labels()[1]


def test_the_validation_figure_shows_every_row_and_the_published_error_band() -> None:
    from zeroplan.core.margin import PEAK_ERROR_BAND
    from zeroplan.report.plots import validation_figure

    rows = _rows()
    figure = validation_figure(rows)
    figure.canvas.draw()
    axes = figure.axes[0]
    assert axes.get_xlabel() == "predicted per rank (MiB, log scale)" and axes.get_ylabel() == "measured / predicted"
    points = sorted(tuple(p) for c in axes.collections if c.get_offsets().size for p in c.get_offsets())
    expected = sorted((r.predicted_bytes / 2**20, r.measured_bytes / r.predicted_bytes) for r in rows)
    assert [v for point in points for v in point] == pytest.approx([v for point in expected for v in point])
    band = [p for p in axes.patches if p.get_label().startswith("published peaks")]
    assert len(band) == 1
    y0, y1 = band[0].get_extents().transformed(axes.transData.inverted()).intervaly
    assert (y0, y1) == pytest.approx((PEAK_ERROR_BAND.low, PEAK_ERROR_BAND.high), rel=1e-3)
    assert f"{PEAK_ERROR_BAND.low:.3f}-{PEAK_ERROR_BAND.high:.3f} x ({PEAK_ERROR_BAND.rows} runs)" in band[0].get_label()
    assert "4 measured quantities of 2 harness runs" in axes.get_title()


def test_the_docs_figures_render(tmp_path) -> None:
    """notebooks/render_figures.py writes one PNG per figure the docs show."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "notebooks" / "render_figures.py"
    written = load_script(script).render(tmp_path)
    assert sorted(p.name for p in written) == sorted(p.name for p in (script.parents[1] / "docs" / "figures").glob("*.png"))
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
