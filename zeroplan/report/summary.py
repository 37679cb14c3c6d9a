"""The first screen of fit, compare and plan: the verdict, one compact table and short numbered
footnotes, within a width (100 columns unless the terminal says otherwise). The full term tables
(table.py, compare_table.py, search_table.py) stay the --detail view; this module reads the same
typed results and leaves out only what --detail and the JSON/CSV formats still carry."""

from __future__ import annotations

from zeroplan.errors import ZeroplanError

import textwrap
from collections.abc import Callable, Sequence

from zeroplan.answers import FitReport, PlanSearchResult
from zeroplan.core.margin import SPLIT_SEGMENT_NOTE, PeakErrorBand, borderline_words, error_band, margin_words
from zeroplan.core.plan import recommendation_key
from zeroplan.core.record import frozen
from zeroplan.core.suggest import MAX_GPU_DOUBLINGS, offers_nf4_base
from zeroplan.core.timing import nccl_algorithms
from zeroplan.report.fits_cell import fits_cell, fits_cell_notes
from zeroplan.report.table import (
    checkpointing_words,
    finetune_lines,
    framework_layout_caution,
    fsdp_version_lines,
    left_out_lines,
    moe_lines,
    parallel_lines,
    usable_text,
)
from zeroplan.results import PlanCandidate, StrategyPlan
from zeroplan.specs.strategy import StrategyKind
from zeroplan.units import ByteUnit, GiB, to_unit

DEFAULT_WIDTH = 100
"""Columns of the first screen when standard output is not a terminal (a file, a pipe, a doc)."""

NARROWEST_WIDTH = 40
"""Below this a terminal's width is not followed: wrapping words into a few letters helps no one."""

FOOTNOTE_LINES = 2
"""A footnote is cut to this many lines at the width; --detail prints the whole sentence."""


@frozen
class Column:
    """A column of the compact table: ``drop_order`` 0 is never dropped, higher ones go first
    when the terminal is too narrow for every column."""

    name: str
    cell: Callable[[object], str]
    left: bool = False
    drop_order: int = 0


def wrap(text: str, width: int, indent: str = "") -> list[str]:
    """``text`` wrapped at ``width``, continuation lines under the first word after ``indent``."""
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=" " * len(indent),
                         break_on_hyphens=False) or [""]


def footnotes(notes: Sequence[str], width: int) -> list[str]:
    """Numbered footnotes, each cut to FOOTNOTE_LINES lines at ``width`` (the cut says where the
    rest is)."""
    lines: list[str] = []
    for number, note in enumerate(notes, start=1):
        lines += textwrap.wrap(note, width=width, initial_indent=f"{number}. ", subsequent_indent="   ",
                               break_on_hyphens=False, max_lines=FOOTNOTE_LINES, placeholder=" ... (--detail)")
    return lines


def table(rows: Sequence[object], columns: Sequence[Column], width: int) -> list[str]:
    """The rows as an aligned table, dropping the highest ``drop_order`` columns until it fits
    ``width`` (or only the columns that are never dropped are left)."""
    kept = list(columns)
    while True:
        lines = _aligned(rows, kept)
        droppable = [c for c in kept if c.drop_order]
        if max(map(len, lines)) <= width or not droppable:
            return lines
        kept.remove(max(droppable, key=lambda c: c.drop_order))


def _aligned(rows: Sequence[object], columns: Sequence[Column]) -> list[str]:
    cells = [[column.cell(row) for column in columns] for row in rows]
    widths = [max(len(column.name), *(len(r[i]) for r in cells)) for i, column in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = (v.ljust(w) if c.left else v.rjust(w) for v, w, c in zip(values, widths, columns))
        return "  ".join(parts).rstrip()

    return [line([c.name for c in columns]), line(["-" * w for w in widths]), *(line(r) for r in cells)]


# Why the recommended strategy wins: for each other strategy that fits, the first rule of
# core.plan.recommendation_key on which it beats that one (docs/memory-model.md, "Recommendation").
_RULE_WORDS = ("least offload", "least offload", "least sent per step", "nothing to shard on one rank",
               "lowest peak", "simplest")


def _band(report: FitReport) -> PeakErrorBand:
    """The published runs' error band for runs like the report's (varying-length batches or not)."""
    return error_band(report.batch.varying_lengths is not None)


def recommendation_reason(report: FitReport) -> str:
    """A few words on why the recommended strategy was chosen over the others that fit."""
    fitting = sorted((p for p in report.plans if p.fits and p.host_fits is not False), key=recommendation_key)
    share = f"{len(fitting)} of {len(report.plans)} fit"
    if len(report.plans) == 1:
        return "the one strategy planned"
    if len(fitting) == 1:
        return f"the only one that fits of {len(report.plans)}"
    best = recommendation_key(fitting[0])
    # Every rule that decides against some other fitting strategy, in the ranking's order: the
    # runner-up alone can name a rule (lowest peak) another loser beats it on (zero3's peak
    # below zero2's, where zero2 wins on bytes sent).
    rules = sorted({next((i for i, (a, b) in enumerate(zip(best, recommendation_key(p))) if a != b), len(_RULE_WORDS) - 1)
                    for p in fitting[1:]})
    words = list(dict.fromkeys(_RULE_WORDS[rule] for rule in rules))
    return f"{', then '.join(words)}; {share}"


def fit_verdict(report: FitReport, unit: ByteUnit) -> list[str]:
    """Fits or not and the recommendation and why; else what fails and what would make it fit."""
    u = unit.value
    if report.recommended is not None:
        chosen = report.plan_for(report.recommended)
        plain = ""
        if report.recommended is StrategyKind.ddp and chosen.parallel.device_map is not None:
            plain = f" = one process, device_map '{chosen.parallel.device_map.value}'"
        elif report.recommended is StrategyKind.ddp and report.cluster.world_size == 1:
            plain = " = plain training"
        said = [f"Fits. Recommended: {report.recommended.value}{plain} ({recommendation_reason(report)})."]
        if chosen.borderline:
            safe = [p.strategy.value for p in report.plans if p.fits and p.host_fits is not False and not p.borderline]
            room = f"; {', '.join(safe)} fit{'s' if len(safe) == 1 else ''} with room" if safe else ""
            words = margin_words(chosen.memory.peak_bytes, chosen.usable_memory_bytes, _band(report),
                                 chosen.borderline_capacity_bytes, chosen.fits, chosen.memory.lazy_state_segment_bytes,
                                 chosen.memory.allocated_peak_bytes)
            said.append(f"But {words}{room}." if chosen.borderline_by_split_segment else f"But {words}: it may not{room}.")
        return said
    short_of_host = [p for p in report.plans if p.fits and p.host_fits is False]
    out_at_load = [p for p in report.plans if p.runs_out_at_load and p.memory.peak_bytes <= p.usable_memory_bytes]
    if out_at_load:
        least = min(out_at_load, key=lambda p: p.memory.peak_bytes)
        said = (f"Does not fit at load: {least.strategy.value}'s step fits on the GPU, but DeepSpeed's engine first "
                f"moves the whole model, {to_unit(least.load_gpu_bytes, unit):.1f} {u}, onto each GPU of "
                f"{to_unit(least.usable_memory_bytes, unit):.1f} {u} usable.")
        return [said, "To fit: build TrainingArguments before from_pretrained, so the model loads sharded inside "
                      "zero.Init (--model-load sharded)."]
    if short_of_host:
        least = min(short_of_host, key=lambda p: p.host_bytes_per_node)
        said = (f"Does not fit in host RAM: {least.strategy.value} fits on the GPU but needs "
                f"{to_unit(least.host_bytes_per_node, unit):.0f} {u} of host RAM per node"
                f"{' at load (each rank the whole model)' if least.load_sets_host_peak else ''}.")
    else:
        closest = min(report.plans, key=lambda p: p.memory.peak_bytes)
        memory = closest.memory
        # The allocator model replays nothing where the allocated peak alone is too large: the
        # peak is then what the step needs at the least (as the detail view's verdict says).
        least = "at least " if memory.peak_is_least else ""
        said = (f"Does not fit. Smallest footprint: {closest.strategy.value}, {least}"
                f"{to_unit(memory.peak_bytes, unit):.1f} {u} per GPU of {to_unit(closest.usable_memory_bytes, unit):.1f} {u} usable"
                + (f" ({borderline_words(memory.peak_bytes, closest.usable_memory_bytes, _band(report), closest.borderline_capacity_bytes, closest.fits)}"
                   ": it may)"
                   if closest.borderline else "")
                + ".")
    if report.suggested_change:
        recommended = report.suggested_recommendation.value if report.suggested_recommendation else "a strategy"
        return [said, f"To fit: {report.suggested_change}; then {recommended} is recommended."]
    if short_of_host:
        return [said, "To fit: more host RAM per node (--host-memory-gib), or a strategy that offloads less."]
    nf4 = ", an nf4 base for LoRA" if offers_nf4_base(report.training.finetune) else ""
    return [said, f"No change tried fits (full recomputation{nf4}, up to {2**MAX_GPU_DOUBLINGS} x the GPUs)."]


def fit_context(report: FitReport, unit: ByteUnit) -> str:
    """The request in one sentence: model, GPUs, usable memory and batch."""
    c, t, b = report.cluster, report.training, report.batch
    return (f"{report.model.name} ({report.num_parameters / 1e9:.1f} B parameters) on {c.world_size} x "
            f"{c.gpu.display_name}, {usable_text(report, unit)}; "
            f"micro-batch {b.micro_batch_size} x seq {b.seq_len}, grad-accum {b.grad_accum_steps}, {t.precision.value}, "
            f"{t.optimizer.value}, {checkpointing_words(report)}.")


def _fit_columns(unit: ByteUnit) -> list[Column]:
    u = unit.value
    return [
        Column("strategy", lambda p: p.strategy.value, left=True),
        Column("fits", fits_cell),
        Column(f"peak {u}", lambda p: f"{to_unit(p.memory.peak_bytes, unit):.1f}"),
        Column(f"headroom {u}", lambda p: f"{to_unit(p.headroom_bytes, unit):.1f}", drop_order=2),
        Column("max-mb", lambda p: str(p.max_micro_batch_size), drop_order=3),
        # "-": an encoder-decoder's step is not timed (StrategyPlan.time None).
        Column("tok/s/GPU", lambda p: f"{p.time.tokens_per_s_per_gpu:,.0f}" if p.time else "-", drop_order=4),
        Column("sent GB", lambda p: f"{p.sent_bytes_per_step / 1e9:.1f}", drop_order=1),
    ]


def fit_notes(report: FitReport, unit: ByteUnit) -> list[str]:
    """The cautions of the detail view, each in a sentence or two."""
    notes = [*finetune_lines(report), *moe_lines(report), *parallel_lines(report)]
    if report.allocator_conf:
        notes.append(f"Judged under PYTORCH_CUDA_ALLOC_CONF={report.allocator_conf}"
                     + (f" ({report.training.framework.value}'s launch default)." if report.allocator_conf_is_launch_default else "."))
    elif report.allocator_conf is not None and report.allocator_conf_is_launch_default:
        notes.append(f"Judged under PyTorch's default allocator ({report.training.framework.value}'s multi-node launch "
                     "default: its multi-node launcher sets no PYTORCH_CUDA_ALLOC_CONF).")
    if any(p.memory.allocator_modelled for p in report.plans):
        notes.append("peak = what the step reserves (max_memory_reserved) in a replay of PyTorch's caching allocator on the "
                     "usable memory, or with no limit where it runs out (docs/memory-model.md, section 7); its schedule is "
                     "checked within a few % (docs/validation.md).")
    else:
        notes.append("peak = allocated peak plus a flat 5 % allocator reserve (--flat-reserve; docs/memory-model.md, section 5).")
    if report.training.paged_optimizer:
        largest = max((p.memory.paged_optimizer_bytes for p in report.plans), default=0)
        notes.append(f"Paged optimizer: {to_unit(largest, unit):.1f} {unit.value} of states per GPU in CUDA managed "
                     "memory, outside the peak; the driver pages them to host RAM when the GPU is full.")
    notes += fits_cell_notes(report)
    band = _band(report)
    if any(p.borderline_by_band(band) for p in report.plans):
        retries = any(p.borderline_capacity_bytes is not None for p in report.plans)
        notes.append(f"* = borderline: published runs peaked at {100 * band.low:.0f}-{100 * band.high:.0f} % of the "
                     "prediction (middle half), so the measured error alone could turn the verdict (docs/validation.md)."
                     + (" The caching allocator frees its cache when a cudaMalloc is refused and retries, so a step's "
                        "outcome need not move one way with the memory (docs/memory-model.md)." if retries else ""))
    if any(p.borderline_by_split_segment for p in report.plans):
        notes.append(f"* = borderline: {SPLIT_SEGMENT_NOTE}.")
    if report.allocator_caution:
        notes.append(report.allocator_caution.strip())
    if not report.model.parameter_count_exact:
        notes.append(f"The parameter count may not be exact ({report.model.parameter_count_caveat}).")
    notes += framework_layout_caution(report)
    notes += fsdp_version_lines(report)
    notes += left_out_lines(report)
    return notes


def render_fit_summary(report: FitReport, unit: ByteUnit = ByteUnit.GiB, width: int = DEFAULT_WIDTH) -> str:
    """zeroplan fit's first screen."""
    width = max(width, NARROWEST_WIDTH)
    lines = [line for sentence in fit_verdict(report, unit) for line in wrap(sentence, width)]
    lines += [*wrap(fit_context(report, unit), width), ""]
    lines += table(report.plans, _fit_columns(unit), width)
    lines += ["", *footnotes(fit_notes(report, unit), width)]
    lines += wrap("--detail: every memory term; --explain STRATEGY: each term's formula and source.", width)
    return "\n".join(lines)


def _compare_columns() -> list[Column]:
    return [
        Column("strategy", lambda p: p.strategy.value, left=True),
        Column("fits", fits_cell),
        # The memory side of a trade-off (ZeRO++ and hpZ send less for a larger peak; NVMe
        # offload the reverse): kept until only the step's own columns are left.
        Column("peak GiB", lambda p: f"{to_unit(p.memory.peak_bytes, ByteUnit.GiB):.1f}", drop_order=1),
        Column("sent GB", lambda p: f"{p.sent_bytes_per_step / 1e9:.1f}"),
        Column("comm s", lambda p: f"{p.time.communication_s:.3f}", drop_order=3),
        Column("exposed s", lambda p: f"{p.time.exposed_communication_s:.3f}", drop_order=2),
        Column("step s", lambda p: f"{p.time.step_with_overlap_s:.3f}"),
        Column("tok/s/GPU", lambda p: f"{p.time.tokens_per_s_per_gpu:,.0f}", drop_order=4),
        Column("MFU", lambda p: f"{p.time.model_flops_utilization:.2f}", drop_order=5),
        Column("nccl", nccl_algorithms_of, left=True, drop_order=6),
    ]


def nccl_algorithms_of(plan: StrategyPlan) -> str:
    return nccl_algorithms(plan.time)


def compare_verdict(report: FitReport) -> str:
    """The fastest strategy that fits (or of all, when none does) and the one that sends least."""
    fitting = [p for p in report.plans if p.fits and p.host_fits is not False]
    pool = fitting or list(report.plans)
    fastest = min(pool, key=lambda p: p.time.step_with_overlap_s)
    quietest = min(pool, key=lambda p: p.sent_bytes_per_step)
    which = "Fastest that fits" if fitting else "Nothing fits (zeroplan fit says what would); fastest"
    return (f"{which}: {fastest.strategy.value}, {fastest.time.step_with_overlap_s:.3f} s per step "
            f"({fastest.time.tokens_per_s_per_gpu:,.0f} tokens/s/GPU); least sent: {quietest.strategy.value}, "
            f"{quietest.sent_bytes_per_step / 1e9:.1f} GB per GPU per step.")


def compare_notes(report: FitReport) -> list[str]:
    notes = ["step = compute + exposed communication and host copies + optimizer step (GPU or CPU), with overlap "
             "(docs/communication-time.md); sent = GB each GPU sends per step (ring)."]
    if report.plans and report.plans[0].parallel.pp > 1:
        # core.plan.pipeline_step_time: every rank waits for the slowest, while the memory (and
        # the collectives listed with it) is the rank nearest to running out.
        notes.append("With a pipeline, peak and sent are the pipeline rank's nearest to running out; comm, exposed, "
                     "step and tok/s/GPU the slowest rank's, which every rank waits for.")
    if report.compute_model == "roofline":
        notes.append("compute: kernel by kernel at the GPU's measured ceilings (--compute-model roofline), a lower bound.")
    else:
        notes.append("compute: executed matrix-product and attention FLOPs (recomputation included) at the HFU the "
                     "step-time line names of peak, memory-bound kernels at the GPU's copy bandwidth; "
                     "MFU = model FLOPs / (step x peak).")
    notes.append("nccl = the algorithm NCCL's tuning model picks per collective (AR all-reduce, AG all-gather, "
                 "RS reduce-scatter); * = at a published nccl-tests bandwidth (docs/gpus.md).")
    if not report.model.parameter_count_exact:
        notes.append(f"The parameter count may not be exact ({report.model.parameter_count_caveat}).")
    notes += fsdp_version_lines(report)
    notes += left_out_lines(report)
    return notes


def render_compare_summary(report: FitReport, width: int = DEFAULT_WIDTH) -> str:
    """zeroplan compare's first screen."""
    if report.model.is_encoder_decoder:
        # compare ranks by step time, which zeroplan.core.timing.step_time refuses for two stacks.
        raise ZeroplanError("model", f"{report.model.name} is an encoder-decoder, whose step time is not modelled "
                                     "(allowed: zeroplan fit for its memory)")
    width = max(width, NARROWEST_WIDTH)
    c, b = report.cluster, report.batch
    context = (f"{report.model.name} on {c.world_size} x {c.gpu.display_name} ({c.num_nodes} node(s) x "
               f"{c.gpus_per_node}); micro-batch {b.micro_batch_size} x seq {b.seq_len} x grad-accum "
               f"{b.grad_accum_steps} per GPU.")
    lines = [*wrap(compare_verdict(report), width), *wrap(context, width), ""]
    lines += table(report.plans, _compare_columns(), width)
    lines += ["", *footnotes(compare_notes(report), width)]
    lines += wrap("--detail: links, volumes and every part of the step; --explain STRATEGY: one strategy's terms.", width)
    return "\n".join(lines)


def _layout(c: PlanCandidate) -> str:
    """'dp 16', 'tp 2 x dp 8', 'tp 2 x pp 4i2 x dp 2' (i: interleaved, its stages per rank)."""
    parts = [f"tp {c.tp}"] if c.tp > 1 else []
    if c.cp > 1:
        parts.append(f"cp {c.cp}")
    if c.pp > 1:
        parts.append(f"pp {c.pp}" + (f"i{c.virtual_stages}" if c.pp_schedule.interleaved else ""))
    return " x ".join([*parts, f"dp {c.dp}"])


def _search_columns() -> list[Column]:
    return [
        Column("#", lambda rc: str(rc[0]), left=True),
        Column("strategy", lambda rc: rc[1].strategy.value, left=True),
        Column("AC", lambda rc: rc[1].activation_checkpointing.value, left=True),
        Column("layout", lambda rc: _layout(rc[1]), left=True, drop_order=2),
        Column("micro x accum", lambda rc: f"{rc[1].micro_batch_size} x {rc[1].grad_accum_steps}"),
        Column("peak GiB", lambda rc: f"{rc[1].peak_bytes / GiB:.1f}"),
        Column("alloc", lambda rc: _allocator_cell(rc[1])),
        Column("step s", lambda rc: f"{rc[1].step_time_s:.3f}"),
        Column("tok/s/GPU", lambda rc: f"{rc[1].tokens_per_s_per_gpu:,.0f}", drop_order=3),
        Column("MFU", lambda rc: f"{rc[1].model_flops_utilization:.2f}", drop_order=4),
    ]


def _allocator_cell(candidate: PlanCandidate) -> str:
    """'yes' / 'NO': whether the caching-allocator model lets the configuration's step complete."""
    if candidate.allocator_fits is None:
        return "-"
    return "yes" if candidate.allocator_fits else "NO"


ALLOCATOR_COLUMN_NOTE = ("peak = allocated + a flat 5 % reserve, what the search ranks on; alloc = whether the step "
                         "completes in a replay of PyTorch's caching allocator (as fit judges), asked of each configuration shown.")


def render_search_summary(result: PlanSearchResult, width: int = DEFAULT_WIDTH) -> str:
    """zeroplan plan's first screen: the best configuration, then the fastest that fit."""
    # Imported here: the plan search's table module, which fit's and compare's screens never use.
    from zeroplan.report.search_table import configurations_counted

    width = max(width, NARROWEST_WIDTH)
    verdict = result.explanation.replace(result.allocator_caution, "") if result.allocator_caution else result.explanation
    context = (f"Global batch {result.global_batch_size} x seq {result.seq_len} on {result.num_gpus} GPUs: "
               f"{configurations_counted(result, 'configurations searched')}.")
    lines = [*wrap(verdict, width), *wrap(context, width)]
    notes = [] if not result.allocator_caution else [result.allocator_caution.strip()]
    if result.ranked:
        lines += ["", "Fastest that fit:", *table(list(enumerate(result.ranked, start=1)), _search_columns(), width)]
        notes.insert(0, "step s with overlap (docs/communication-time.md, 'Plan search'); AC = activation "
                        "checkpointing; layout: tp/cp/pp x dp, 4i2 = interleaved 1F1B, 2 stages per rank.")
        notes.insert(1, ALLOCATOR_COLUMN_NOTE)
        notes.append(f"--detail: each row's parts of the step and the Pareto front of memory vs step time "
                     f"({len(result.pareto)} configurations).")
    if notes:
        lines += ["", *footnotes(notes, width)]
    return "\n".join(lines)
