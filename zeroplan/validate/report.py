"""Validation tables (text, DataFrame) and the predicted-vs-measured plot."""

from __future__ import annotations

import os

from pathlib import Path

import pandas as pd

from zeroplan.validate.rows import ComparisonRow


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


def save_validation_plot(rows: list[ComparisonRow], path: Path) -> Path:
    """Log-log scatter of measured against predicted bytes, one colour per quantity."""
    from zeroplan.report.plots import plt

    from matplotlib.ticker import LogLocator, NullFormatter

    figure, axes = plt.subplots(figsize=(7.5, 6.5))
    frame = comparison_frame(rows)
    frame = frame[(frame.predicted_bytes > 0) & (frame.measured_bytes > 0)]
    # Points of different quantities often coincide (the same bytes predicted and measured):
    # each quantity gets its own marker, hollow, drawn larger first, so that every one shows.
    markers = "osD^vP*Xh<>p"
    groups = list(frame.groupby("quantity"))
    for index, (quantity, group) in enumerate(groups):
        size = 30 + 18 * (len(groups) - index)
        axes.scatter(group.predicted_bytes / 2**20, group.measured_bytes / 2**20, label=quantity, s=size,
                     marker=markers[index % len(markers)], facecolors="none", edgecolors=f"C{index % 10}",
                     linewidths=1.2)
    if not frame.empty:
        low = min(frame.predicted_bytes.min(), frame.measured_bytes.min()) / 2**20 / 1.5
        high = max(frame.predicted_bytes.max(), frame.measured_bytes.max()) / 2**20 * 1.5
        axes.plot([low, high], [low, high], color="black", linewidth=0.8, label="measured = predicted")
    axes.set_xscale("log")
    axes.set_yscale("log")
    # One label per power of ten, none on the minor ticks: labels never collide.
    for axis in (axes.xaxis, axes.yaxis):
        axis.set_major_locator(LogLocator(base=10))
        axis.set_minor_formatter(NullFormatter())
    axes.grid(True, which="major", linewidth=0.3)
    axes.set_xlabel("predicted (MiB)")
    axes.set_ylabel("measured (MiB)")
    axes.set_title("zeroplan: predicted vs measured, per rank")
    axes.legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic: a temp file beside the target, then os.replace; a failed save leaves nothing behind.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(tmp, dpi=120, format=path.suffix.lstrip(".").lower() or "png")
        os.replace(tmp, path)
    finally:
        plt.close(figure)
        tmp.unlink(missing_ok=True)
    return path
