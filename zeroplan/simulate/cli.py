"""``python -m zeroplan.simulate MODEL --strategy ... --world-size N``: one simulated step,
printed as a table of per-rank bytes and collectives, and written as JSON with ``--out``."""

from __future__ import annotations

from pathlib import Path

from zeroplan.atomic import writable_directory, write_text_atomic
from zeroplan.cli.parser import (
    MAX_SIMULATED_WORLD_SIZE, OneLineParser, add_seq_len_arguments, bounded_int, positive_int, run_reporting_user_errors,
    seq_len_of,
)
from zeroplan.errors import ZeroplanError
from zeroplan.specs import ActivationCheckpointing, BatchSpec, Precision, StrategyKind, TrainingSpec
from zeroplan.specs.framework import Framework
from zeroplan.units import ByteUnit, format_bytes

RECORD_FILE = "simulation.json"


def build_parser() -> OneLineParser:
    # Choices are the strings; run.simulate checks them again with one-line errors.
    parser = OneLineParser(
        prog="zeroplan simulate",
        description="Run one real FSDP2/DDP training step with fake tensors and a fake process group.",
    )
    parser.add_argument("model", help="model preset name or a Hugging Face config.json path")
    parser.add_argument("--strategy", required=True, choices=[kind.value for kind in StrategyKind],
                        help="fsdp-full-shard, fsdp-shard-grad-op or ddp; with --framework any strategy "
                             "(it decides the module dtype the framework trains in)")
    parser.add_argument("--world-size", type=bounded_int(MAX_SIMULATED_WORLD_SIZE, "fake sharding into N "
                        "pieces grows with N; the planner answers larger worlds"),
                        help="N: ranks simulated (at most 4,096); required except per block with --framework, "
                             "where one process measures one block")
    parser.add_argument("--rank", type=int, default=0, help="the rank to play (default 0)")
    parser.add_argument("--micro-batch", type=positive_int, default=BatchSpec().micro_batch_size)
    add_seq_len_arguments(parser)
    parser.add_argument("--precision", choices=[p.value for p in Precision], default=None,
                        help="default: bf16-mixed, or the framework's own default with --framework")
    parser.add_argument("--activation-checkpointing", choices=["none", "full", "selective-layer", "selective-op"], default="none",
                        help="selective-layer: with --framework torchtune (its ac_mode selective); "
                             "selective-op: torchtitan's per-op selective checkpointing (--framework torchtitan)")
    parser.add_argument("--selective-layer-interval", type=positive_int, default=2, metavar="K",
                        help="with selective-layer: checkpoint every K-th block (torchtune's ac_option; default 2)")
    parser.add_argument("--activation-offloading", action="store_true",
                        help="with --framework torchtune and full checkpointing: its enable_activation_offloading")
    parser.add_argument("--optimizer-in-backward", action="store_true",
                        help="with --framework torchtune --whole-step: its optimizer_in_bwd (each parameter steps in backward)")
    parser.add_argument("--framework", choices=[f.value for f in Framework if f is not Framework.litgpt], default=Framework.zeroplan.value,
                        help="hf, torchtune or torchtitan: build that framework's own model (full width, "
                             "--layers blocks) and record what each block keeps for backward (docs/frameworks.md)")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="with --framework: decoder blocks built for the per-block measurement (at least 3; default 4)")
    parser.add_argument("--whole-step", action="store_true",
                        help="with --framework hf|torchtune|torchtitan: instead of what one block keeps, run a whole "
                             "training step (full depth, the framework's own FSDP2 wrapping, its loss, fused AdamW) "
                             "and record FSDPMemTracker's peak (docs/simulate.md, 'Frameworks')")
    parser.add_argument("--allocator-conf", metavar="CONF", default=None,
                        help="with --whole-step: replay every storage the step allocates through the CUDA "
                             "caching-allocator model under this PYTORCH_CUDA_ALLOC_CONF (\"\" for the defaults) "
                             "and print its reserved peak and OOM capacity")
    parser.add_argument("--no-mem-tracker", action="store_true", help="skip FSDPMemTracker (about 2x faster)")
    parser.add_argument("--cuda-norm-formula", action="store_true",
                        help="make F.rms_norm save what torch's fused CUDA kernel saves (input and rstd); "
                             "the record states kernels: cuda (docs/simulate.md)")
    parser.add_argument("--out", type=Path, help=f"directory to write {RECORD_FILE} into")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_user_errors("zeroplan", _run, args)


def _run(args) -> int:
    from zeroplan.presets.models import get_model

    # The package imports torch only here, after the command line was checked, so a refused
    # command line is answered at once and a missing torch in one line.
    try:
        from zeroplan.simulate.run import SUPPORTED_STRATEGIES, simulate
    except ImportError as error:
        raise ZeroplanError("simulate", f"needs torch (pip install 'zeroplan[harness]'): {error}") from None

    if args.out is not None:
        writable_directory(args.out, "--out", create=False)  # refused before the run, not after it
    framework = Framework(args.framework)
    model = get_model(args.model)
    batch = BatchSpec(
        micro_batch_size=args.micro_batch, seq_len=seq_len_of(args, model.max_positions),
        allow_longer_seq=args.allow_longer_seq,
    )
    if args.allocator_conf is not None:
        if not args.whole_step:
            raise ZeroplanError("--allocator-conf", "only with --whole-step (the whole step's allocations are what it replays)")
        from zeroplan.allocator.config import parse_alloc_conf

        parse_alloc_conf(args.allocator_conf)  # a bad key or value, before the run
    if args.whole_step and framework is Framework.zeroplan:
        raise ZeroplanError("--whole-step", "needs --framework hf, torchtune or torchtitan (without --framework every run is a whole step)")
    per_block = framework is not Framework.zeroplan and not args.whole_step
    if per_block and args.world_size is not None:
        raise ZeroplanError("--world-size", "has no effect per block (one process measures one block); drop it, "
                            "or add --whole-step to shard the whole step over N ranks")
    if not per_block and args.world_size is None:
        raise ZeroplanError("--world-size", f"is required here (allowed: 1 to {MAX_SIMULATED_WORLD_SIZE:,})")
    if framework is not Framework.zeroplan:
        return _run_framework_step(args, framework, model, batch) if args.whole_step else _run_framework(args, framework, model, batch)
    if args.layers is not None:
        raise ZeroplanError("--layers", "only with --framework (the reference model is simulated at full depth)")
    if StrategyKind(args.strategy) not in SUPPORTED_STRATEGIES:
        allowed = ", ".join(k.value for k in SUPPORTED_STRATEGIES)
        raise ZeroplanError("--strategy", f"{args.strategy!r} cannot be simulated without --framework (allowed: {allowed})")
    training = TrainingSpec(
        precision=Precision(args.precision or Precision.bf16_mixed.value),
        activation_checkpointing=ActivationCheckpointing(args.activation_checkpointing),
    )
    record = simulate(
        model, args.strategy, args.world_size, training=training, batch=batch,
        rank=args.rank, mem_tracker=not args.no_mem_tracker, cuda_norm_formula=args.cuda_norm_formula,
        show_progress=True,
    )
    print(summary(record))
    _write_record(args.out, RECORD_FILE, record)
    return 0


def _run_framework(args, framework: Framework, model, batch: BatchSpec) -> int:
    from zeroplan.specs import check_seq_len

    check_seq_len(model, batch)
    layers = 4 if args.layers is None else args.layers
    if layers < 3:
        raise ZeroplanError("--layers", f"must be at least 3 (the first block is not steady state), got {layers}")
    if layers > max(model.num_layers, 4):
        raise ZeroplanError("--layers", f"{layers} is more blocks than {model.name} has (allowed: 3 to {max(model.num_layers, 4)})")
    try:
        from zeroplan.frameworks.measure import DEFAULT_PRECISION, measure
    except ImportError as error:
        raise ZeroplanError("--framework", _not_installed(framework, error)) from None
    precision = Precision(args.precision) if args.precision else DEFAULT_PRECISION.get(framework, Precision.bf16_mixed)
    training = TrainingSpec(framework=framework, precision=precision,
                            activation_checkpointing=ActivationCheckpointing(args.activation_checkpointing),
                            selective_layer_interval=args.selective_layer_interval,
                            activation_offloading=args.activation_offloading)
    try:
        # The framework itself is imported only when its model is built.
        record = measure(model, StrategyKind(args.strategy), training, batch, layers=layers)
    except ImportError as error:
        raise ZeroplanError("--framework", _not_installed(framework, error)) from None
    print(f"{record.name}  ({record.framework_version}, torch {record.torch_version}, {record.wall_time_s:.1f} s)")
    print(f"  module dtype {record.module_dtype}; {record.built_layers} blocks built")
    nbytes, added = record.block_kept_bytes, record.added_layers
    blocks = "one block keeps" if added == 1 else f"{added} blocks keep"
    print(f"  {blocks} {format_bytes(nbytes, ByteUnit.MiB)} for backward ({nbytes:,} bytes)")
    growth = ", ".join(format_bytes(g, ByteUnit.MiB) for g in record.block_growth_bytes)
    print(f"  growth across blocks 2..{record.built_layers + added} during forward: {growth}")
    for note in record.notes:
        print(f"note: {note}")
    _write_record(args.out, record.file_name, record)
    return 0


def _run_framework_step(args, framework: Framework, model, batch: BatchSpec) -> int:
    if args.layers is not None:
        raise ZeroplanError("--layers", "not with --whole-step (the whole step builds the model's full depth)")
    if args.no_mem_tracker:
        raise ZeroplanError("--no-mem-tracker", "not with --whole-step (its peak is what the whole step records)")
    try:
        from zeroplan.frameworks.step import check_step, run_step, step_training
    except ImportError as error:
        raise ZeroplanError("--framework", _not_installed(framework, error)) from None
    training = step_training(framework, args.activation_checkpointing)
    training = training.model_copy(update={"optimizer_in_backward": args.optimizer_in_backward})
    if args.precision is not None:
        training = training.model_copy(update={"precision": Precision(args.precision)})
    check_step(framework, StrategyKind(args.strategy), training, args.world_size, args.rank)
    try:
        # The framework itself is imported only when its model is built.
        record = run_step(model, StrategyKind(args.strategy), training, batch, args.world_size, rank=args.rank,
                          allocator_conf=args.allocator_conf)
    except ImportError as error:
        raise ZeroplanError("--framework", _not_installed(framework, error)) from None
    print(step_summary(record))
    _write_record(args.out, record.file_name, record)
    return 0


def _not_installed(framework: Framework, error: ImportError) -> str:
    return f"{framework.value} is not installed ({error.name}); run scripts/install-frameworks"


def _write_record(out: Path | None, file_name: str, record) -> None:
    """Write ``record`` as JSON into ``out`` (atomically), if a directory was given."""
    if out is None:
        return
    path = writable_directory(out, "--out") / file_name
    write_text_atomic(path, record.model_dump_json(indent=2) + "\n", "--out")
    print(f"wrote {path}")


def step_summary(record) -> str:
    """A framework whole-step record in a few lines (GiB = 2**30 bytes)."""
    unit = ByteUnit.GiB
    lines = [
        f"{record.name}  ({record.framework_version}, torch {record.torch_version}, {record.wall_time_s:.1f} s)",
        f"  {record.sharding}",
        f"  {record.optimizer}",
        f"  model states per rank: parameters {format_bytes(record.parameter_bytes, unit)}, gradients "
        f"{format_bytes(record.gradient_bytes, unit)}, AdamW states {format_bytes(record.optimizer_state_bytes, unit)}",
        f"  allocated peak {format_bytes(record.peak_bytes, unit)} ({record.peak_bytes:,} bytes), reached in {record.peak_phase.value}",
        "FSDPMemTracker at peak:",
    ]
    lines += [f"  {name:16s} {format_bytes(nbytes, unit):>14}" for name, nbytes in record.peak_by_category.items() if nbytes]
    if record.allocator is not None:
        figures = record.allocator
        lines += [
            f"caching allocator ({figures.alloc_conf or 'defaults'}; {figures.events:,} allocations and frees of both steps):",
            f"  requested peak {format_bytes(figures.requested_peak_bytes, unit):>14}   (the storages alive at once, workspaces included)",
            f"  reserved peak  {format_bytes(figures.reserved_peak_bytes, unit):>14}   (max_memory_reserved on a device with room)",
            f"  OOM capacity   {format_bytes(figures.oom_capacity_bytes, unit):>14}   (least device memory on which both steps complete)",
        ]
    lines += [f"note: {note}" for note in record.notes]
    return "\n".join(lines)


def summary(record) -> str:
    """A short human-readable table of one record (GiB = 2**30 bytes)."""
    from zeroplan.simulate.record import CollectiveKind, Phase

    unit = ByteUnit.GiB
    states = record.model_states
    lines = [
        f"{record.model.name}  {record.strategy.value}  N={record.world_size}  rank {record.rank}  "
        f"({record.parameter_count:,} parameters, torch {record.torch_version}, {record.wall_time_s:.1f} s)",
        f"  {record.mixed_precision}",
        "model states per rank:",
        f"  parameters        {format_bytes(states.parameter_bytes, unit):>14}",
        f"  gradients         {format_bytes(states.gradient_bytes, unit):>14}",
        f"  AdamW exp_avg     {format_bytes(states.exp_avg_bytes, unit):>14}",
        f"  AdamW exp_avg_sq  {format_bytes(states.exp_avg_sq_bytes, unit):>14}",
        f"  AdamW step        {states.step_bytes:>10,} bytes",
        f"  total             {format_bytes(states.total_bytes, unit):>14}",
        "collectives (count, unsharded buffer bytes; setup runs once, the rest every step):",
    ]
    for phase in Phase:
        for kind in CollectiveKind:
            count = record.collective_count(kind, phase)
            if count:
                nbytes = format_bytes(record.collective_bytes(kind, phase), unit)
                lines.append(f"  {phase.value:9s} {kind.value:15s} {count:5d}  {nbytes:>14}")
    if record.mem_tracker_peak_bytes:
        lines.append("FSDPMemTracker at peak:")
        for name, nbytes in record.mem_tracker_peak_bytes.items():
            if nbytes:
                lines.append(f"  {name:16s} {format_bytes(nbytes, unit):>14}")
    lines += [f"note: {note}" for note in record.notes]
    return "\n".join(lines)
