"""``--efficiency FILE`` on fit, compare and plan: compute timed at the HFU an efficiency file
(``zeroplan calibrate step``, zeroplan.calibrate.step) holds, and the line compare and plan print
under their table saying whether the step time is calibrated or the default, and its error band."""

from __future__ import annotations

import argparse

DEFAULT_HFU = None
"""--hfu left out (zeroplan.cli.fit.DEFAULT_HFU)."""


def add_efficiency_file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--efficiency", metavar="FILE",
        help="time compute at the HFU of an efficiency file (zeroplan calibrate step) instead of --hfu; the file's "
             "GPU and framework must be the request's",
    )


def efficiency_hfu(args: argparse.Namespace, gpu_name: str, framework) -> float:  # type: ignore[no-untyped-def]
    """The HFU of --efficiency's file, refused in one line for another GPU or framework, beside
    --hfu, or under the roofline compute model."""
    from zeroplan.calibrate.step import check_applies, load_efficiency
    from zeroplan.errors import ZeroplanError

    if args.hfu != DEFAULT_HFU:
        raise ZeroplanError("--efficiency", "sets the HFU; drop --hfu or --efficiency")
    if args.compute_model != "hfu":
        raise ZeroplanError("--efficiency", "calibrates the flat-HFU compute model; drop --compute-model roofline "
                                            "or --efficiency")
    efficiency = load_efficiency(args.efficiency)
    check_applies(efficiency, args.efficiency, gpu_name, framework)
    from zeroplan.specs.request import DEFAULT_ATTENTION_RATE

    rate = getattr(args, "attention_rate", DEFAULT_ATTENTION_RATE)
    if efficiency.attention_rate != rate:
        raise ZeroplanError("--efficiency", f"{str(args.efficiency)!r} was solved under --attention-rate "
                                            f"{efficiency.attention_rate}, not {rate} (allowed: --attention-rate "
                                            f"{efficiency.attention_rate} with this file)")
    return efficiency.hardware_flops_utilization


def efficiency_attention(args: argparse.Namespace) -> float | None:
    """The attention efficiency --efficiency's file was solved at (--attention-rate kernel,
    zeroplan.core.attention_efficiency), applied with its HFU; None for a file without one (it
    was solved at the shipped default, which then applies)."""
    from zeroplan.calibrate.step import load_efficiency

    return load_efficiency(args.efficiency).attention_efficiency


def time_basis_text(args: argparse.Namespace, request) -> str:  # type: ignore[no-untyped-def]
    """The time-basis line, whole (FitReport.step_time_basis, PlanSearchResult.step_time_basis)."""
    from zeroplan.calibrate.basis import time_basis_line

    path = getattr(args, "efficiency", None)
    efficiency = None
    if path:
        from zeroplan.calibrate.step import load_efficiency

        efficiency = load_efficiency(path)
    return time_basis_line(request, path, efficiency, hfu_given=args.hfu != DEFAULT_HFU)


def time_basis(args: argparse.Namespace, request) -> str:  # type: ignore[no-untyped-def]
    """The line compare and plan print under their table: calibrated or default, and its band;
    wrapped to the screen's width in the first screen (the detail view keeps it whole)."""
    import textwrap

    from zeroplan.cli.parser import screen_width

    line = time_basis_text(args, request)
    return line if getattr(args, "detail", False) else "\n".join(textwrap.wrap(line, screen_width()))
