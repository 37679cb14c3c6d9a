"""The line under fit's, compare's and plan's table saying what the step times rest on (a
calibrated efficiency file, the fitted default, --hfu, the roofline) and the error band measured
for it. Apart from zeroplan.calibrate.step, whose efficiency-file models a default fit never
builds: the line is printed by every fit, the file read only under --efficiency."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroplan.calibrate.step import StepEfficiency
    from zeroplan.specs.request import PlanRequest

CALIBRATED_BANDS: dict[str, tuple[float, float]] = {
    "matmul": (0.142, 0.627), "published": (0.071, 0.426), "kernel": (0.074, 0.263),
}
"""(median, max) |error| of tokens/s/GPU when each published source with at least three rows is
calibrated on its row of fewest GPUs and predicts its other rows, by the attention-rate mode the
HFU was solved under (benchmarks/step_time_accuracy.py, docs/validation.md "Calibrated from one
measured step"; tests/test_step_calibration.py ties them to the printed figures)."""

CALIBRATED_BAND: tuple[float, float] | None = CALIBRATED_BANDS["kernel"]
"""The calibrated band under the default attention rate (zeroplan.specs.request.DEFAULT_ATTENTION_RATE)."""

DEFAULT_BANDS: dict[str, tuple[float, float]] = {
    "matmul": (0.111, 1.211), "published": (0.093, 0.460), "kernel": (0.056, 0.305),
}
"""(median, max) |error| of tokens/s/GPU under the fitted default efficiency
(zeroplan.core.default_efficiency), by attention-rate mode, over every published row with the
efficiency fitted on the other sources only (leave-one-source-out; benchmarks/step_time_accuracy.py,
tests/test_step_calibration.py ties them to the printed figures)."""

DEFAULT_BAND: tuple[float, float] | None = DEFAULT_BANDS["kernel"]
"""The fitted default's band under the default attention rate (zeroplan.specs.request.DEFAULT_ATTENTION_RATE)."""

FLAT_BAND: tuple[float, float] | None = (0.236, 1.027)
"""(median, max) |error| of tokens/s/GPU at the flat HFU 0.4 (the default of a GPU without rows
of its generation or compute die) over every published row (nothing is fitted, so no row is in
its own fit)."""


def _kernel_class(attention: str | None, compiled_untimed: bool | None, float8: str | None) -> str:
    """A kernel class as the time-basis line names it: 'flash-attn-2, not compiled'."""
    return ", ".join([attention or "?", "compiled" if compiled_untimed else "not compiled"]
                     + ([f"float8 {float8}"] if float8 else []))


def _band(band: tuple[float, float] | None, what: str) -> str:
    if band is None:
        return "band not measured"
    return f"error band {what}: median {band[0]:.1%}, max {band[1]:.1%} |error| of tokens/s/GPU (docs/validation.md)"


def time_basis_line(request: PlanRequest, efficiency_path: str | None, efficiency: StepEfficiency | None,
                    hfu_given: bool) -> str:
    """One line saying what the step times rest on: a calibrated efficiency or the default, and
    the error band measured for it (and, for a compiled request compile cannot be timed for, why)."""
    from zeroplan.core.compiled_time import compile_time_note

    if request.model.is_encoder_decoder:
        # zeroplan.core.timing.step_time refuses an encoder-decoder: no step is timed.
        return f"step time: not modelled for an encoder-decoder ({request.model.name}: two stacks); its memory is planned"
    line = _time_basis(request, efficiency_path, efficiency, hfu_given)
    note = compile_time_note(request)
    return f"{line}; {note}" if note else line


def _time_basis(request: PlanRequest, efficiency_path: str | None, efficiency: StepEfficiency | None,
                hfu_given: bool) -> str:
    if efficiency is not None:
        from zeroplan.calibrate.step import calibrated_under, carried_hfu, mechanism_of

        source = efficiency.source
        carried = carried_hfu(efficiency, request)
        carried_text = ("" if carried == efficiency.hardware_flops_utilization else
                        f"carried to HFU {carried:.3f} for the request's kernel class ({_kernel_class(*mechanism_of(request))}; "
                        f"the file's {_kernel_class(efficiency.attention_class, efficiency.compiled_untimed, source.float8)}) "
                        "by the fitted default's ratio between the two; ")
        return (f"step time: calibrated, HFU {efficiency.hardware_flops_utilization:.3f} from {efficiency_path} "
                f"({source.model} on {source.num_gpus} x {efficiency.gpu}, {source.strategy}, micro-batch "
                f"{source.micro_batch_size} x seq {source.seq_len}: {source.measured_step_s:.4g} s measured); "
                + carried_text
                + (f"calibrated under other settings: {differs}; " if (differs := calibrated_under(efficiency, request)) else "")
                + _band(CALIBRATED_BANDS.get(efficiency.attention_rate),
                        "when one row of a published source predicts its others"))
    if request.performance.compute_model == "roofline":
        return "step time: roofline compute model, not calibrated; band not measured"
    if hfu_given:
        return (f"step time: HFU {request.performance.hardware_flops_utilization:g} as given (--hfu), not calibrated; "
                "band not measured")
    from zeroplan.core.default_efficiency import default_hfu

    default = default_hfu(request)
    if default.level == "flat":
        return (f"step time: {default.describe()}, not calibrated (zeroplan calibrate step fits one); "
                + _band(FLAT_BAND, "of the flat HFU on the published rows"))
    return (f"step time: {default.describe()}, not calibrated (zeroplan calibrate step fits one); "
            + _band(DEFAULT_BANDS.get(request.performance.attention_rate),
                    "on published rows of sources left out of the fit"))
