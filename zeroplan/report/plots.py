"""matplotlib figures of planner results (imported only by notebooks, benchmarks and
`zeroplan validate`, never by the planner itself)."""

from __future__ import annotations

# No backend is forced: headless processes fall back to Agg, notebooks show figures inline.
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from zeroplan.results import FitReport
from zeroplan.units import ByteUnit, to_unit

_STACK = (
    ("parameters", "parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer states", "optimizer_state_bytes"),
    ("activations", "activation_bytes"),
    ("logits", "logits_bytes"),
    ("buffers", "temporary_bytes"),
    ("allocator reserve", "allocator_reserve_bytes"),
)


def memory_stack_figure(report: FitReport, unit: ByteUnit = ByteUnit.GiB) -> Figure:
    """Stacked bars of each strategy's per-GPU memory, with the usable memory as a line."""
    figure, axes = plt.subplots(figsize=(10, 4.5))
    names = [p.strategy.value for p in report.plans]
    bottoms = [0.0] * len(names)
    for label, field in _STACK:
        heights = [to_unit(getattr(p.memory, field), unit) for p in report.plans]
        axes.bar(names, heights, bottom=bottoms, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    peaks = [to_unit(p.memory.peak_bytes, unit) for p in report.plans]
    axes.scatter(names, peaks, marker="_", s=400, color="black", label="peak", zorder=3)
    usable = to_unit(report.cluster.usable_memory_bytes, unit)
    axes.axhline(usable, color="red", linestyle="--", label=f"usable ({usable:.0f} {unit.value})")
    axes.set_ylabel(f"per-GPU memory ({unit.value})")
    axes.set_title(f"{report.model.name} on {report.cluster.world_size} x {report.cluster.gpu.display_name}")
    axes.tick_params(axis="x", rotation=35)
    axes.legend(fontsize=8, ncol=2)
    figure.tight_layout()
    return figure


def communication_figure(report: FitReport) -> Figure:
    """Bytes sent per GPU per step, and step time with and without overlap, per strategy.

    Horizontal bars, so that strategy names read level and never overlap; the legend sits above
    the bars, outside the axes."""
    names = [p.strategy.value for p in report.plans]
    figure, (sent_axes, time_axes) = plt.subplots(
        1, 2, figsize=(11, 0.45 * len(names) + 1.8), sharey=True, layout="constrained"
    )
    positions = list(range(len(names)))
    sent_axes.barh(positions, [p.sent_bytes_per_step / 1e9 for p in report.plans], color="tab:blue")
    sent_axes.set_yticks(positions, names)
    sent_axes.invert_yaxis()
    sent_axes.set_xlabel("GB sent per GPU per step (ring)")
    time_axes.barh([y - 0.2 for y in positions], [p.time.step_without_overlap_s for p in report.plans],
                   height=0.4, label="no overlap", color="tab:orange")
    time_axes.barh([y + 0.2 for y in positions], [p.time.step_with_overlap_s for p in report.plans],
                   height=0.4, label="with overlap", color="tab:green")
    time_axes.set_xlabel("step time (s)")
    time_axes.legend(fontsize=8, ncol=2, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
    return figure
