"""Validation tables (text, DataFrame) and the predicted-vs-measured plot."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from zeroplan.atomic import writable_directory, write_atomic
from zeroplan.validate.rows import ComparisonRow
from zeroplan.validate.styles import quantity_style  # noqa: F401 (also this module's)


def comparison_frame(rows: list[ComparisonRow]) -> pd.DataFrame:
    frame = pd.DataFrame([{**row.model_dump(), "ratio": row.ratio} for row in rows])
    return frame


def render_validation_table(rows: list[ComparisonRow]) -> str:
    names = ["run", "strategy", "engine", "N", "rank", "quantity", "predicted MiB", "measured MiB", "measured/predicted"]
    cells = [
        [
            r.run_id, r.strategy, r.engine, str(r.world_size),
            str(r.rank) if r.pipeline_rank is None else f"{r.rank} (pp {r.pipeline_rank})", r.quantity,
            f"{r.predicted_bytes / 2**20:.3f}", f"{r.measured_bytes / 2**20:.3f}",
            "-" if r.ratio is None else f"{r.ratio:.4f}",
        ]
        for r in rows
    ]
    widths = [max(len(names[i]), *(len(c[i]) for c in cells)) if cells else len(names[i]) for i in range(len(names))]

    def line(values: list[str]) -> str:
        left = [v.ljust(w) for v, w in zip(values[:6], widths[:6])]
        right = [v.rjust(w) for v, w in zip(values[6:], widths[6:])]
        return "  ".join(left + right)

    return "\n".join([line(names), line(["-" * w for w in widths]), *(line(c) for c in cells)])


def _plot_title(rows: list[ComparisonRow]) -> str:
    runs = sorted({r.run_id for r in rows})
    strategies = sorted({r.strategy for r in rows})
    named = ", ".join(runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
    return f"zeroplan validate: {named} ({', '.join(strategies)}), per rank"


def save_validation_plot(rows: list[ComparisonRow], path: Path) -> Path:
    """Left: log-log scatter of measured against predicted bytes; right: measured / predicted
    per quantity on a linear scale with the 5 % band, where agreement within a few percent is
    visible. Each quantity keeps one marker and colour in every plot (quantity_style)."""
    from zeroplan.report.plots import plt

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    figure, (axes, ratio_axes) = plt.subplots(1, 2, figsize=(13, 6.5), layout="constrained",
                                              gridspec_kw={"width_ratios": [1.1, 1]})
    frame = comparison_frame(rows)
    frame = frame[(frame.predicted_bytes > 0) & (frame.measured_bytes > 0)]
    # Points of different quantities often coincide (the same bytes predicted and measured):
    # hollow markers, drawn larger first, so that every one shows.
    groups = sorted(frame.groupby("quantity"), key=lambda item: quantity_style(item[0]))
    for rank, (quantity, group) in enumerate(groups):
        marker, colour = quantity_style(quantity)
        size = 30 + 18 * (len(groups) - rank)
        axes.scatter(group.predicted_bytes / 2**20, group.measured_bytes / 2**20, label=quantity, s=size,
                     marker=marker, facecolors="none", edgecolors=colour, linewidths=1.2)
        ratio_axes.scatter(group.measured_bytes / group.predicted_bytes, [rank] * len(group), s=50, marker=marker,
                           facecolors="none", edgecolors=colour, linewidths=1.2)
    if not frame.empty:
        low = min(frame.predicted_bytes.min(), frame.measured_bytes.min()) / 2**20 / 1.5
        high = max(frame.predicted_bytes.max(), frame.measured_bytes.max()) / 2**20 * 1.5
        axes.plot([low, high], [low, high], color="black", linewidth=0.8, label="measured = predicted")
    axes.set_xscale("log")
    axes.set_yscale("log")
    # Labels at 1, 2 and 5 of each decade, so a value can be read off between powers of ten.
    for axis in (axes.xaxis, axes.yaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.6g}"))
        axis.set_minor_formatter(NullFormatter())
    axes.grid(True, which="major", linewidth=0.3)
    axes.set_xlabel("predicted (MiB)")
    axes.set_ylabel("measured (MiB)")
    axes.legend(fontsize=7, loc="upper left")
    ratio_axes.axvspan(0.95, 1.05, color="0.92", zorder=0)
    ratio_axes.text(1.0, 1.0, "±5 %", transform=ratio_axes.get_xaxis_transform(), ha="center", va="bottom", fontsize=7)
    ratio_axes.axvline(1.0, color="black", linewidth=0.8)
    ratio_axes.set_yticks(range(len(groups)), [quantity for quantity, _ in groups], fontsize=7)
    ratio_axes.invert_yaxis()
    ratio_axes.set_xlabel("measured / predicted")
    ratio_axes.grid(True, axis="x", linewidth=0.3)
    figure.suptitle(_plot_title(rows), fontsize=10)
    # Atomic, and never over a device or other special file (zeroplan.atomic).
    try:
        writable_directory(path.parent, "plot")
        write_atomic(path, lambda tmp: figure.savefig(tmp, dpi=120, format=path.suffix.lstrip(".").lower() or "png"), "plot")
    finally:
        plt.close(figure)
    return path
