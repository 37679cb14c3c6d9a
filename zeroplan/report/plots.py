"""matplotlib figures of planner results (imported only by notebooks, benchmarks and
`zeroplan validate`, never by the planner itself)."""

from __future__ import annotations

# No backend is forced: headless processes fall back to Agg, notebooks show figures inline.
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from zeroplan.answers import FitReport
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


def memory_stack_figure(report: FitReport, unit: ByteUnit = ByteUnit.GiB) -> Figure:
    """Stacked horizontal bars of each strategy's per-GPU memory at its peak moment (so a bar ends
    at its peak, marked by a tick) and the usable memory as a line. Horizontal, so strategy names
    read level; the legend sits right of the axes, never over a bar. Segments too thin to see are
    named with their size beside the bar's end, so no term vanishes."""
    names = [p.strategy.value for p in report.plans]
    figure, axes = plt.subplots(figsize=(11, 0.45 * len(names) + 1.8), layout="constrained")
    positions = list(range(len(names)))
    lefts = [0.0] * len(names)
    peaks = [to_unit(p.memory.peak_bytes, unit) for p in report.plans]
    usable = to_unit(report.cluster.usable_memory_bytes, unit)
    span = max([usable, *peaks]) or 1.0
    thin: list[list[str]] = [[] for _ in names]
    for label, field in _STACK:
        widths = [to_unit(p.memory.peak_terms().get(field, 0), unit) for p in report.plans]
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
    axes.axvline(usable, color="red", linestyle="--", label=f"usable ({usable:.1f} {unit.value})")
    axes.set_yticks(positions, names)
    axes.invert_yaxis()
    axes.set_xlabel(f"per-GPU memory ({unit.value})")
    axes.set_title(f"{report.model.name} on {report.cluster.world_size} x {report.cluster.gpu.display_name}\n"
                   f"{_run_line(report)}", fontsize=10)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return figure


def _run_line(report: FitReport) -> str:
    """Micro-batch, sequence, accumulation, checkpointing and precision: what sets the bars."""
    t, b = report.training, report.batch
    return (f"micro-batch {b.micro_batch_size} x seq {b.seq_len}, grad-accum {b.grad_accum_steps}, "
            f"checkpointing {t.activation_checkpointing.value}, {t.precision.value}, {t.framework.value}")


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
    figure.suptitle(f"{report.model.name} on {report.cluster.world_size} x {report.cluster.gpu.display_name}: "
                    f"{_run_line(report)}", fontsize=10)
    return figure


STEP_PARTS = (
    ("compute", "compute s", "forward + backward compute", "tab:blue"),
    ("model_parallel_communication_s", "model-parallel s", "tensor/context/pipeline collectives", "tab:purple"),
    ("pipeline_bubble_s", "bubble s", "pipeline bubble", "tab:gray"),
    ("exposed_communication_s", "exposed s", "exposed communication and host copies", "tab:orange"),
    ("cpu_optimizer_s", "cpu-step s", "CPU optimizer step (offload)", "tab:brown"),
    ("optimizer_step_s", "opt-step s", "GPU optimizer step (roofline)", "tab:olive"),
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
    compute = "roofline kernels" if report.compute_model == "roofline" else "executed FLOPs at the HFU"
    axes.set_xlabel(f"seconds per optimizer step (compute: {compute})")
    axes.legend(fontsize=8, ncol=2, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
    figure.suptitle(f"{report.model.name} on {report.cluster.world_size} x {report.cluster.gpu.display_name}: "
                    f"{_run_line(report)}", fontsize=10)
    return figure
