"""``zeroplan plan``: the fastest configuration that fits a global batch."""

from __future__ import annotations

import argparse
import sys

from zeroplan.cli.finetune_args import add_finetune_arguments
from zeroplan.cli.parser import add_seq_len_arguments, bounded_int, choices_of, option_groups, positive_int
from zeroplan.core.search_space import LONG_SEQUENCE, SEARCHED_SCHEDULES
from zeroplan.specs import Framework, PlanRequest
from zeroplan.specs.recipe_defaults import (SETTING_WORDS, planned_recipe_settings, recipe_launch_settings,
                                             setting_words)
from zeroplan.specs.strategy import OPT_IN_STRATEGIES

_LAYOUT_FLAGS = ("tp", "pp", "cp", "max_tp", "pp_schedule", "no_model_parallel")
"""plan's own layout flags (fit's --tp and friends describe one layout; these bound a search)."""

MAX_TOP = 1000
"""Most rows the ranked table prints."""

SEARCH_HELD_OFF = {
    # The search varies gradient accumulation, which torchtune's optimizer_in_bwd refuses.
    "optimizer_in_backward": False,
    # CPUOffloadPolicy applies to FSDP only; the search ranks every strategy.
    "fsdp_cpu_offload": False,
    # bitsandbytes' paged optimizers step on the GPU; the search ranks host-stepping offload too.
    "paged_optimizer": False,
    "activation_offloading": False,
}
"""Training settings the search plans off whatever a framework's configuration sets (and plan
has no flag for): its rows, and the files --emit writes for the best, are planned without them."""


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from zeroplan.cli.fit import (
        add_attention_argument, add_cluster_arguments, add_collective_model_arguments, add_compile_arguments,
        add_efficiency_arguments, add_fused_loss_argument, add_precision_arguments,
    )

    parser.add_argument("model", help="preset name (see `zeroplan models`) or a path to a Hugging Face config.json")
    # The search judges millions of configurations on the flat reserve: no allocator flags.
    groups = option_groups(parser, leave_out=("allocator",))
    add_cluster_arguments(groups["cluster"])
    add_efficiency_arguments(groups["cluster"])
    add_collective_model_arguments(groups["cluster"])
    batch = groups["batch"]
    batch.add_argument("--global-batch", type=positive_int, required=True,
                       help="sequences per optimizer step over all GPUs (= micro-batch x accumulation x GPUs)")
    add_seq_len_arguments(batch)
    add_precision_arguments(groups["precision and optimizer"])
    add_layout_arguments(groups["parallelism"])
    add_finetune_arguments(groups["fine-tuning"])
    framework = groups["framework"]
    framework.add_argument("--framework", choices=choices_of(Framework), default=Framework.zeroplan.value,
                           help="search only this stack's strategies and checkpointing policies (default zeroplan: all)")
    add_fused_loss_argument(framework)
    add_compile_arguments(framework)
    add_attention_argument(framework)
    output = groups["output"]
    output.add_argument("--top", type=bounded_int(MAX_TOP), default=10, help=f"rows of the ranked table (default 10, at most {MAX_TOP})")
    output.add_argument("--format", choices=["table", "json", "csv"], default="table")
    output.add_argument("--detail", action="store_true",
                        help="the full tables: each row's parts of the step, and the Pareto front of memory vs step time")


def add_layout_arguments(group: argparse._ArgumentGroup) -> None:
    """The strategies and model-parallel layouts searched (docs/communication-time.md, 'Plan search')."""
    from zeroplan.cli.fit import add_zero3_group_arguments

    opt_in = ", ".join(kind.value for kind in OPT_IN_STRATEGIES)
    group.add_argument("--strategies", help="comma-separated subset of the strategies to search (default: all the framework "
                                            f"runs but {opt_in}, searched only when named)")
    add_zero3_group_arguments(group)
    group.add_argument("--tp", type=positive_int,
                       help="fix the tensor-parallel degree (default: search every divisor of the GPUs per node; "
                            "sequence parallel on when tp > 1)")
    group.add_argument("--pp", type=positive_int,
                       help="fix the pipeline-parallel degree (default: search every divisor of the GPUs that leaves "
                            "a block per stage)")
    group.add_argument("--cp", type=positive_int,
                       help=f"fix the context-parallel degree (default: 1, and 2 and 4 from --seq-len {LONG_SEQUENCE} on)")
    group.add_argument("--max-tp", type=positive_int, help="largest tensor-parallel degree searched")
    group.add_argument("--pp-schedule", choices=[s.value for s in SEARCHED_SCHEDULES],
                       help="search only this pipeline schedule (default: 1f1b and interleaved-1f1b with 2 stages per rank)")
    group.add_argument("--no-model-parallel", action="store_true",
                       help="data parallelism only (tp = pp = cp = 1), the search without layouts")


def run_plan(args: argparse.Namespace) -> int:
    from zeroplan.cli.fit import parse_strategies, request_from_args
    from zeroplan.core.search import LayoutSpace, search
    from zeroplan.specs.parallel import PipelineSchedule

    # The flags the search itself varies take their neutral values in the base request; the
    # layout flags become the search's LayoutSpace, not the base request's own layout.
    fixed = {key: value for key, value in vars(args).items() if key not in _LAYOUT_FLAGS}
    fixed.update(
        micro_batch=1, grad_accum=1, activation_checkpointing="none", hsdp_group=None,
        state_convention=None, selective_layer_interval=2, **SEARCH_HELD_OFF,
    )
    if _offload_applies_to_every_strategy(args):
        fixed["fsdp_cpu_offload"] = None  # left to the framework's configuration, as fit leaves it
    base = request_from_args(argparse.Namespace(**fixed))
    args.search_held_off = configuration_settings_held_off(base)  # for --emit (zeroplan.cli.emit)
    # Frozen parameters and LoRA are modelled under data parallelism only; a layout flag is
    # refused naming what the user typed that made it so. Compiled blocks are searched under
    # every layout the request accepts (zeroplan.specs.request.check_compiled_layout).
    finetune = base.training.finetune
    data_parallel_only_by = None
    if args.no_model_parallel:
        data_parallel_only_by = "--no-model-parallel"
    elif not finetune.trains_everything:
        flag = "--lora-rank" if finetune.is_lora else "--frozen-blocks/--freeze-embeddings"
        data_parallel_only_by = f"{flag} (frozen parameters and LoRA are modelled under data parallelism only)"
    layout = dict(tp=args.tp, pp=args.pp, cp=args.cp, max_tp=args.max_tp, model_parallel=data_parallel_only_by is None,
                  data_parallel_only_by=data_parallel_only_by or "--no-model-parallel")
    if args.pp_schedule:
        layout["pp_schedules"] = (PipelineSchedule(args.pp_schedule),)
    space = LayoutSpace(**layout)
    # The first screen shows the ranked rows alone: the Pareto front's own rows are asked of the
    # caching-allocator model (a replay of each pipeline rank's step) only where they are shown.
    shows_pareto = args.detail or args.format != "table"
    result = search(base, args.global_batch, parse_strategies(args.strategies),
                    top=args.top, space=space, show_progress=True, answer_pareto=shows_pareto)
    args.search_result = result  # for what runs after the command (--emit, zeroplan.cli.emit)
    if args.format == "json":
        from zeroplan.cli.efficiency import time_basis_text

        shown = result.model_copy(update={"step_time_basis": time_basis_text(args, base),
                                          "configuration_note": configuration_note(base, args.search_held_off, width=None)})
        sys.stdout.write(shown.model_dump_json(indent=2) + "\n")
    elif args.format == "csv":
        sys.stdout.write(result.to_dataframe().to_csv())
    else:
        from zeroplan.cli.efficiency import time_basis

        if args.detail:
            from zeroplan.report.search_table import render_search

            sys.stdout.write(render_search(result) + "\n")
        else:
            from zeroplan.cli.parser import screen_width
            from zeroplan.report.summary import render_search_summary

            sys.stdout.write(render_search_summary(result, screen_width()) + "\n")
        note = configuration_note(base, args.search_held_off)
        if note:
            sys.stdout.write(note + "\n")
        sys.stdout.write(time_basis(args, base) + "\n")
    return 0


def _offload_applies_to_every_strategy(args: argparse.Namespace) -> bool:
    """Whether FSDP's CPU offload applies to every strategy the search ranks (torchtune's and
    litgpt's are FSDP alone): then the search plans the framework configuration's offload (on
    for torchtune's 70B full fine-tunes) as fit does, instead of holding it off."""
    from zeroplan.cli.fit import parse_strategies
    from zeroplan.core.profiles import framework_strategies, fsdp_cpu_offload_strategies

    framework = Framework(args.framework) if args.framework is not None else Framework.zeroplan
    world = args.gpus
    kinds = parse_strategies(args.strategies) or framework_strategies(framework, world)
    return set(kinds) <= set(fsdp_cpu_offload_strategies(framework))


def configuration_settings_held_off(base: PlanRequest) -> tuple[str, ...]:
    """The SEARCH_HELD_OFF settings the framework's own configuration of ``base``'s model sets
    on (zeroplan.specs.recipe_defaults: torchtune's single-device full configurations step a
    paged optimizer in backward) and the search plans off (``base`` has them off)."""
    found = recipe_launch_settings(base.model.name, base.training, base.cluster.world_size)
    if found is None:
        return ()
    settings = found[0]
    return tuple(field for field, off in SEARCH_HELD_OFF.items()
                 if settings.get(field, off) != off and getattr(base.training, field) == off)


def configuration_note(base: PlanRequest, held_off: tuple[str, ...], width: int | None = 0) -> str:
    """One line naming the framework configuration whose settings the search planned (as fit's
    header does) and those it planned off, and why; '' where the configuration sets none.
    Wrapped to ``width`` (0: the screen's; None: one unwrapped line, as the JSON carries it)."""
    found = recipe_launch_settings(base.model.name, base.training, base.cluster.world_size)
    if found is None:
        return ""
    _, async_tp, config = found
    planned = planned_recipe_settings(base.model.name, base.training, None, base.cluster.world_size)[1]
    if async_tp and "async_tp" not in base.parallel.model_fields_set:
        # Every layout of tp > 1 the search builds takes the configuration's async TP (ParallelSpec.async_tp).
        planned += (SETTING_WORDS["async_tp"] + " where tp > 1",)
    if not planned and not held_off:
        return ""
    text = f"note: planned as {base.training.framework.value}'s {config} config"
    if planned:
        text += f", with its {', '.join(planned)}"
    if held_off:
        text += (f"; its {', '.join(setting_words(field, True) for field in held_off)} planned off, as the search "
                 f"varies gradient accumulation and strategy (--emit writes them off)")
    if width is None:
        return text + "."
    import textwrap

    from zeroplan.cli.parser import screen_width

    return textwrap.fill(text + ".", width or screen_width())
