"""``zeroplan calibrate step MODEL [fit flags] --strategy S (--tokens-per-s-per-gpu X | --step-s X)
--out FILE.json``: the compute efficiency one measured step implies (zeroplan.calibrate.step),
written as the file ``--efficiency FILE`` on fit, compare and plan applies (zeroplan.cli.efficiency).

``zeroplan calibrate LOG...`` (nccl-tests) keeps its own parser: ``calibrate`` hands a line whose
first word is ``step`` to this one (CalibrateParser), so both modes parse through
``build_parser`` and the docs' parse check sees them."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from zeroplan.cli.parser import OneLineParser, positive_float
from zeroplan.specs import StrategyKind

STEP_MODE = "step"


class CalibrateParser(OneLineParser):
    """``calibrate``'s parser: ``calibrate step ...`` goes to the step parser, anything else
    (nccl-tests logs) to calibrate's own arguments."""

    step_parser: OneLineParser

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):  # type: ignore[override]
        if args and args[0] == STEP_MODE:
            return self.step_parser.parse_known_args(list(args[1:]), namespace)
        return super().parse_known_args(args, namespace)


def add_step_mode(parser: OneLineParser) -> None:
    """Give ``calibrate``'s parser its ``step`` sub-mode."""
    parser.__class__ = CalibrateParser
    step = OneLineParser(prog=f"{parser.prog} {STEP_MODE}", description=(
        "Solve the hardware FLOPs utilisation (HFU) at which the planner's step for one measured configuration "
        "equals the measured step, communication and overlap kept as the planner models them; write it as an "
        "efficiency file for --efficiency on fit, compare and plan (same GPU and framework)."))
    add_calibrate_step_arguments(step)
    step.set_defaults(run=run_calibrate_step)
    parser.step_parser = step  # type: ignore[attr-defined]
    parser.epilog = (f"or: {parser.prog} {STEP_MODE} MODEL --strategy S (--tokens-per-s-per-gpu X | --step-s X) "
                     f"--out FILE.json [fit's flags]: the compute efficiency of one measured step "
                     f"({parser.prog} {STEP_MODE} --help)")


def add_calibrate_step_arguments(parser: argparse.ArgumentParser) -> None:
    from zeroplan.cli.fit import add_request_arguments
    from zeroplan.cli.parser import choices_of

    add_request_arguments(parser)
    parser.add_argument("--strategy", required=True, choices=choices_of(StrategyKind),
                        help="the sharding strategy of the measured run")
    measured = parser.add_mutually_exclusive_group(required=True)
    measured.add_argument("--tokens-per-s-per-gpu", type=positive_float, metavar="X",
                          help="measured tokens per second per GPU (micro-batch x accumulation x sequence over the "
                               "model-parallel ranks, per optimizer step, over its seconds)")
    measured.add_argument("--step-s", type=positive_float, metavar="X", help="measured seconds per optimizer step")
    parser.add_argument("--out", required=True, help="efficiency file (JSON) to write, for --efficiency")
    parser.add_argument("--note", default="", help="where the measurement comes from (kept in the file)")


def run_calibrate_step(args: argparse.Namespace) -> int:
    from zeroplan.atomic import writable_file, write_text_atomic
    from zeroplan.calibrate.step import calibrate_step, step_tokens_per_gpu
    from zeroplan.cli.fit import DEFAULT_HFU, check_options_apply, request_from_args
    from zeroplan.core.profiles import check_framework_strategies
    from zeroplan.errors import ZeroplanError

    if args.efficiency is not None:
        raise ZeroplanError("--efficiency", "is what calibrate step writes (--out), not an input")
    if args.hfu != DEFAULT_HFU:
        raise ZeroplanError("--hfu", "is what calibrate step solves for; drop it")
    writable_file(args.out, "out")  # refused before anything is computed
    check_options_apply(args)
    kind = StrategyKind(args.strategy)
    request = request_from_args(args, kind)
    if request.strategy.kind is not kind:
        raise ZeroplanError("--strategy", f"{kind.value} does not run with this layout (expert parallelism)")
    check_framework_strategies(request.training.framework, (kind,), request.cluster.world_size)
    tokens = step_tokens_per_gpu(request)
    measured_s = args.step_s if args.step_s is not None else tokens / args.tokens_per_s_per_gpu
    efficiency = calibrate_step(request, measured_s, args.model, args.note)
    write_text_atomic(args.out, efficiency.model_dump_json(indent=2) + "\n", "out")
    source = efficiency.source
    print(f"{args.model} on {source.num_gpus} x {efficiency.gpu_display_name}, {source.strategy}, framework "
          f"{efficiency.framework.value}: measured {measured_s:.4g} s per step ({source.measured_tokens_per_s_per_gpu:,.0f} "
          f"tokens/s/GPU)")
    attention = ("" if efficiency.attention_efficiency is None else
                 f" (attention at {efficiency.attention_efficiency:.3f} x its kernel's published rate)")
    print(f"HFU {efficiency.hardware_flops_utilization:.3f}{attention}: compute {efficiency.predicted_compute_s:.4g} s; "
          f"communication {efficiency.predicted_communication_s:.4g} s back to back, "
          f"{efficiency.predicted_exposed_communication_s:.4g} s of it (and host copies) exposed, as the planner models them")
    if efficiency.predicted_exposed_communication_s > 0:
        print("caution: the planner says part of this step's communication is exposed: the HFU solved leans on its "
              "communication model there; a measured configuration whose communication hides pins compute alone")
    print(f"wrote {args.out} (--efficiency on fit, compare and plan, on {efficiency.gpu} with --framework "
          f"{efficiency.framework.value})")
    return 0
