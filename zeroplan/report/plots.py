"""matplotlib figures of planner results (imported only by notebooks, benchmarks and
`zeroplan validate`, never by the planner itself)."""

from __future__ import annotations

import math
from collections.abc import Mapping

# No backend is forced: headless processes fall back to Agg, notebooks show figures inline.
import matplotlib
import matplotlib.ticker
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from zeroplan.answers import FitReport
from zeroplan.errors import ZeroplanError
from zeroplan.units import ByteUnit, to_unit

_STACK = (
    ("parameters", "parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer states", "optimizer_state_bytes"),
    ("activations", "activation_bytes"),
    ("logits", "logits_bytes"),
    ("optimizer-step temporary", "step_temporary_bytes"),
    ("buffers", "peak_buffer_bytes"),
    ("allocator reserve", "allocator_reserve_bytes"),
)
"""Segments in stack order; each bar stacks the terms alive at its plan's peak moment
(MemoryBreakdown.peak_terms), so every bar ends at its peak."""


def _require_step_times(*reports: FitReport) -> None:
    """A time figure needs every plan's step time; an encoder-decoder's is not modelled."""
    for report in reports:
        if any(p.time is None for p in report.plans):
            raise ZeroplanError("model", f"{report.model.name} has no modelled step time (an encoder-decoder), "
                                         "so its time figures cannot be drawn (allowed: memory_stack_figure)")


def memory_stack_figure(report: FitReport) -> Figure:
    """Stacked horizontal bars of each strategy's per-GPU memory at its peak moment (so a bar ends
    at its peak, marked by a tick) and the usable memory as a line. Horizontal, so strategy names
    read level; the legend sits right of the axes, never over a bar. Segments too thin to see are
    named with their size beside the bar's end, so no term vanishes."""
    names = [p.strategy.value for p in report.plans]
    figure, axes = plt.subplots(figsize=(11, 0.45 * len(names) + 1.8), layout="constrained")
    positions = list(range(len(names)))
    lefts = [0.0] * len(names)
    peaks = [to_unit(p.memory.peak_bytes, ByteUnit.GiB) for p in report.plans]
    usable = to_unit(report.cluster.usable_memory_bytes, ByteUnit.GiB)
    span = max([usable, *peaks]) or 1.0
    thin: list[list[str]] = [[] for _ in names]
    for label, field in _STACK:
        widths = [to_unit(p.memory.peak_terms().get(field, 0), ByteUnit.GiB) for p in report.plans]
        axes.barh(positions, widths, left=lefts, label=label, edgecolor="white", linewidth=0.4)
        for index, width in enumerate(widths):
            # Under 1 % of the axis a segment is a hairline: say it in words.
            if 0 < width < 0.01 * span:
                thin[index].append(f"{label} {width:.2f}")
        lefts = [left + width for left, width in zip(lefts, widths)]
    axes.scatter(peaks, positions, marker="|", s=300, color="black", label="peak", zorder=3)
    for position, (peak, words) in enumerate(zip(peaks, thin)):
        if words:
            axes.annotate(" + " + ", ".join(words), (peak, position), xytext=(6, 0), textcoords="offset points",
                          va="center", fontsize=7)
    axes.axvline(usable, color="red", linestyle="--", label=f"usable ({usable:.1f} GiB)")
    axes.set_yticks(positions, names)
    axes.invert_yaxis()
    axes.set_xlabel("per-GPU memory (GiB)")
    axes.set_title(f"{report.model.name} on {report.cluster.world_size} x {report.cluster.gpu.display_name}\n"
                   f"{_run_line(report)}", fontsize=10)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return figure


def _run_line(report: FitReport) -> str:
    """Micro-batch, sequence, accumulation, checkpointing and precision: what sets the bars."""
    t, b = report.training, report.batch
    return (f"micro-batch {b.micro_batch_size} x seq {b.seq_len}, grad-accum {b.grad_accum_steps}, "
            f"checkpointing {t.activation_checkpointing.value}, {t.precision.value}, {t.framework.value}")


STEP_PARTS = (
    ("compute", "compute s", "forward + backward compute", "tab:blue"),
    ("model_parallel_communication_s", "model-parallel s", "tensor/context/pipeline collectives", "tab:purple"),
    ("pipeline_bubble_s", "bubble s", "pipeline bubble", "tab:gray"),
    ("exposed_communication_s", "exposed s", "exposed communication and host copies", "tab:orange"),
    ("cpu_optimizer_s", "cpu-step s", "CPU optimizer step (offload)", "tab:brown"),
    ("optimizer_step_s", "opt-step s", "GPU optimizer step", "tab:olive"),
)
"""The parts of StepTime.step_with_overlap_s, in the order a step runs them: (StepTime field,
column name, legend label, colour)."""


def step_parts_s(time) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """A StepTime's step with overlap split into STEP_PARTS, by column name (they add up to it)."""
    return {column: time.compute_s if field == "compute" else getattr(time, field) for field, column, _, _ in STEP_PARTS}


def step_time_figure(report: FitReport) -> Figure:
    """Where each strategy's step goes: stacked horizontal bars of compute, the collectives that
    block it, the pipeline bubble, what communication and offload copies leave exposed, and the
    optimizer steps; each bar's length is the step time with overlap."""
    _require_step_times(report)
    names = [p.strategy.value for p in report.plans]
    figure, axes = plt.subplots(figsize=(11, 0.45 * len(names) + 1.8), layout="constrained")
    positions = list(range(len(names)))
    left = [0.0] * len(names)
    parts = [step_parts_s(p.time) for p in report.plans]
    for _, column, label, colour in STEP_PARTS:
        widths = [part[column] for part in parts]
        if not any(widths):
            continue
        axes.barh(positions, widths, left=left, label=label, color=colour)
        left = [a + b for a, b in zip(left, widths)]
    axes.set_yticks(positions, names)
    axes.invert_yaxis()
    compute = "roofline kernels" if report.compute_model == "roofline" else "FLOPs at the HFU, memory-bound kernels at the copy bandwidth"
    axes.set_xlabel(f"seconds per optimizer step (compute: {compute})")
    axes.legend(fontsize=8, ncol=2, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
    figure.suptitle(f"{report.model.name} on {report.cluster.world_size} x {report.cluster.gpu.display_name}: "
                    f"{_run_line(report)}", fontsize=10)
    return figure


def network_communication_figure(reports: Mapping[str, FitReport]) -> Figure:
    """Communication per step by strategy and network: the same plans on clusters that differ
    in their links (``reports`` by setting, e.g. one NVLink node against nodes joined by
    InfiniBand). Left, the GB each GPU sends per step (one bar per setting, or a single bar where
    every setting sends the same); right, the seconds those collectives take per setting, light,
    with the part left exposed after overlap dark. Legends sit above the axes, never over a bar."""
    from matplotlib.patches import Patch

    settings = list(reports)
    _require_step_times(*reports.values())
    first = reports[settings[0]]
    names = [p.strategy.value for p in first.plans]
    plans = {setting: {p.strategy.value: p for p in reports[setting].plans} for setting in settings}
    figure, (sent_axes, time_axes) = plt.subplots(
        1, 2, figsize=(11, 0.5 * len(names) + 2.2), sharey=True, layout="constrained", gridspec_kw={"width_ratios": [1, 1.4]}
    )
    sent = {setting: [plans[setting][n].sent_bytes_per_step / 1e9 for n in names] for setting in settings}
    same = all(sent[setting] == sent[settings[0]] for setting in settings)
    sent_settings = settings[:1] if same else settings
    height = 0.8 / len(sent_settings)
    for index, setting in enumerate(sent_settings):
        positions = [row - 0.4 + height * (index + 0.5) for row in range(len(names))]
        sent_axes.barh(positions, sent[setting], height=height, color="0.45" if same else f"C{index}",
                       label="the same on every network" if same else setting)
    height = 0.8 / len(settings)
    for index, setting in enumerate(settings):
        positions = [row - 0.4 + height * (index + 0.5) for row in range(len(names))]
        time_axes.barh(positions, [plans[setting][n].time.communication_s for n in names], height=height,
                       color=f"C{index}", alpha=0.4)
        time_axes.barh(positions, [plans[setting][n].time.exposed_communication_s for n in names], height=height,
                       color=f"C{index}")
    sent_axes.set_yticks(range(len(names)), names)
    sent_axes.invert_yaxis()
    sent_axes.set_xlabel("GB sent per GPU per step (ring)")
    time_axes.set_xlabel("communication per step (s)")
    handles = [Patch(color=f"C{index}", label=setting) for index, setting in enumerate(settings)]
    handles += [Patch(color="0.5", alpha=0.4, label="light: all collectives"),
                Patch(color="0.5", label="dark: exposed (not overlapped)")]
    time_axes.legend(handles=handles, fontsize=8, ncol=2, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
    sent_axes.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
    figure.suptitle(f"{first.model.name}, {first.cluster.world_size} x {first.cluster.gpu.display_name}: "
                    f"{_run_line(first)}", fontsize=10)
    return figure


def tradeoff_figure(reports: FitReport | Mapping[str, FitReport]) -> Figure:
    """The memory/time trade-off: each strategy's peak per-GPU memory (GiB) against its step
    time with overlap (s), one series per setting when ``reports`` maps settings to reports.
    A plan that fits is a filled point, one that does not a hollow one; the usable memory is a
    dashed line, so the strategies under it and furthest left are the ones to choose."""
    series = {"": reports} if isinstance(reports, FitReport) else dict(reports)
    _require_step_times(*series.values())
    first = next(iter(series.values()))
    figure, axes = plt.subplots(figsize=(11, 6), layout="constrained")
    markers = "osD^v"
    all_x = [p.time.step_with_overlap_s for r in series.values() for p in r.plans]
    all_y = [math.log10(max(p.memory.peak_bytes, 1)) for r in series.values() for p in r.plans]
    spans = ((max(all_x) - min(all_x)) or 1.0, (max(all_y) - min(all_y)) or 1.0)
    for index, (setting, report) in enumerate(series.items()):
        colour = f"C{index}"
        xs = [p.time.step_with_overlap_s for p in report.plans]
        ys = [to_unit(p.memory.peak_bytes, ByteUnit.GiB) for p in report.plans]
        faces = [colour if p.fits else "none" for p in report.plans]
        axes.scatter(xs, ys, s=60, marker=markers[index % len(markers)], facecolors=faces, edgecolors=colour,
                     linewidths=1.3, label=setting or "strategies", zorder=3)
        for names, x, y in _nearby_groups([p.strategy.value for p in report.plans], xs, ys, spans):
            axes.annotate(", ".join(names), (x, y), xytext=(7, 3 - 11 * index), textcoords="offset points",
                          fontsize=7, color=colour)
    usable = to_unit(first.cluster.usable_memory_bytes, ByteUnit.GiB)
    axes.axhline(usable, color="red", linestyle="--", label=f"usable ({usable:.1f} GiB)")
    axes.set_yscale("log")
    # Labels at 1, 2 and 5 of each decade, so a peak can be read off between powers of ten.
    axes.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:,.6g}"))
    axes.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes.set_xlabel("step time with overlap (s)")
    axes.set_ylabel("peak per-GPU memory (GiB, log scale)")
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
                title="filled: fits; hollow: does not", title_fontsize=8)
    axes.set_title(f"{first.model.name}, {first.cluster.world_size} x {first.cluster.gpu.display_name}\n"
                   f"{_run_line(first)}", fontsize=10)
    return figure


_NEAR = (0.06, 0.04)
"""How close (x, y), as fractions of the axes' span, two labelled points may be before they share a label."""


def _nearby_groups(names: list[str], xs: list[float], ys: list[float],
                   spans: tuple[float, float]) -> list[tuple[list[str], float, float]]:
    """Points within _NEAR (x, y) of the axes' span of one another (y on a log scale) labelled once,
    with their names joined, at the first of them: strategies with the same peak and step time
    would otherwise write their names over each other."""
    groups: list[tuple[list[str], float, float]] = []
    for name, x, y in zip(names, xs, ys):
        for group in groups:
            if (abs(group[1] - x) / spans[0] < _NEAR[0]
                    and abs(math.log10(max(group[2], 1e-12)) - math.log10(max(y, 1e-12))) / spans[1] < _NEAR[1]):
                group[0].append(name)
                break
        else:
            groups.append(([name], x, y))
    return groups


def validation_figure(rows) -> Figure:  # type: ignore[no-untyped-def]
    """Predicted against measured: measured / predicted for each quantity of each measured run
    (zeroplan.validate rows), against the predicted size (MiB, log scale), with 1 (exact) drawn
    and the published-peaks error band shaded (zeroplan.core.margin.PEAK_ERROR_BAND: the middle
    half of the published runs' measured / predicted peak). Only rows with both sizes positive."""
    from zeroplan.core.margin import PEAK_ERROR_BAND
    from zeroplan.validate.styles import quantity_style

    band = PEAK_ERROR_BAND
    figure, axes = plt.subplots(figsize=(11, 6), layout="constrained")
    axes.axhspan(band.low, band.high, color="0.9", zorder=0,
                 label=f"published peaks, middle half: {band.low:.3f}-{band.high:.3f} x ({band.rows} runs)")
    axes.axhline(1.0, color="black", linewidth=0.8, label="measured = predicted")
    kept = [r for r in rows if r.predicted_bytes > 0 and r.measured_bytes > 0]
    by_quantity: dict[str, list] = {}
    for row in kept:
        by_quantity.setdefault(row.quantity, []).append(row)
    for quantity in sorted(by_quantity, key=quantity_style):
        group = by_quantity[quantity]
        marker, colour = quantity_style(quantity)
        axes.scatter([r.predicted_bytes / 2**20 for r in group], [r.measured_bytes / r.predicted_bytes for r in group],
                     s=45, marker=marker, facecolors="none", edgecolors=colour, linewidths=1.2, label=quantity, zorder=3)
    axes.set_xscale("log")
    axes.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:,.6g}"))
    axes.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ratios = [r.measured_bytes / r.predicted_bytes for r in kept]
    axes.set_ylim(min([band.low, *ratios]) - 0.05, max([band.high, *ratios]) + 0.05)
    axes.set_xlabel("predicted per rank (MiB, log scale)")
    axes.set_ylabel("measured / predicted")
    axes.grid(True, which="major", linewidth=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    runs = sorted({r.run_id for r in kept})
    axes.set_title(f"{len(kept)} measured quantities of {len(runs)} harness runs against their predictions", fontsize=10)
    return figure
