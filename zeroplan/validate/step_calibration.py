"""How well a calibrated step time predicts published throughput (docs/validation.md, "Step
time"): per published source, the HFU ``zeroplan calibrate step`` solves on one row predicts the
source's other rows; and, leave-one-source-out, the flat HFU 0.4 (every FLOP at it) and HFUs fitted
per mechanism (GPU generation x training stack, and the planner's fitted default, GPU generation x
kernel class) on the other sources only. Calibrated and fitted figures time the planner's default
attention rate (DEFAULT_ATTENTION_RATE; under 'kernel' at the attention efficiencies fitted without
the scored source, held_out_fit); attention_rate_figures compares the modes.

Rules the figures keep: what is fitted is per mechanism, never per row; the row a calibration is
solved on is never among the rows it is scored on; every figure is out of sample."""

from __future__ import annotations

import functools
import statistics

from zeroplan.calibrate.step import planned_step, solve_hfu
from zeroplan.core.default_efficiency import (
    FLAT_HFU, DefaultEfficiencyTable, GenerationCompute, MechanismHfu, fit_mechanisms, generation_of, resolve,
)
from zeroplan.specs import AttentionKernel, PerformanceAssumptions
from zeroplan.specs.base import Frozen
from zeroplan.specs.request import ATTENTION_RATES  # noqa: F401  (compared on the rows: docs/validation.md, "Attention at its own rate")
from zeroplan.validate.step_time import PublishedThroughput, PublishedThroughputTable, load_published_throughput

MIN_SOURCE_ROWS = 3
"""A source is calibrated on one row and scored on the others when it has at least this many."""


def source_of(row: PublishedThroughput) -> str:
    """One publication's table: the source URL and its section."""
    return f"{row.source_url} ({row.source_section})"


def stack_of(row: PublishedThroughput) -> str:
    """The training stack that produced the row: its stack field, else the repository its source
    lives in (github.com/OWNER/REPO/...), lower-cased, e.g. torchtitan, llm-foundry, megatron-lm."""
    return row.stack or row.source_url.split("/")[4].lower()




def attention_class_of(row: PublishedThroughput) -> str:
    """The attention kernel the row ran: 'eager' (every score materialised), or its flash kernel."""
    if row.training_options.attention_kernel is AttentionKernel.eager:
        return AttentionKernel.eager.value
    return row.attention_implementation.value


# Kept per row (rows are frozen): each builds the row's whole request, and the fits ask it of
# every other row once per row they score.
@functools.lru_cache(maxsize=4096)
def compiled_untimed_of(row: PublishedThroughput) -> bool:
    """The row compiled and its timed request does not (zeroplan.core.default_efficiency.compiled_untimed):
    a compile the planner times (zeroplan.core.compiled_time) is a modelled mechanism, and the HFU
    solved on such a row is an eager step's, the same mechanism as its eager peers'."""
    return row.compile and not row.request().training.compile


@functools.lru_cache(maxsize=4096)
def float8_class_of(row: PublishedThroughput) -> str | None:
    """The float8 recipe the row trained its linears under (zeroplan.core.default_efficiency.float8_class), None: bf16."""
    from zeroplan.core.default_efficiency import float8_class

    return float8_class(row.request().training)


def kernel_class_of(row: PublishedThroughput) -> str:
    """The row's kernel class (zeroplan.core.stack_time.kernel_class): its attention kernel,
    whether it compiled with compile left out of its timed request (compiled_untimed_of), and its
    float8 recipe (float8_class_of; a float8 run is its own class)."""
    from zeroplan.core.stack_time import kernel_class

    return kernel_class(attention_class_of(row), compiled_untimed_of(row), float8_class_of(row))


def source_label(row: PublishedThroughput) -> str:
    """Short name of the row's source: its stack and its table's title."""
    section = row.source_section
    title = section[:section.index("' table") + len("' table")] if "' table" in section else section
    return f"{stack_of(row)} {title}"


def published_step_s(row: PublishedThroughput) -> float:
    return row.tokens_per_step_per_gpu / row.published_tokens_per_s_per_gpu


DEFAULT_ATTENTION_RATE = PerformanceAssumptions().attention_rate
"""The planner's attention-rate mode, which the calibrated and fitted-default figures time."""


def default_request(row: PublishedThroughput):  # type: ignore[no-untyped-def]
    """``row``'s request (no HFU set) under the planner's default attention rate."""
    return row.request(None, attention_rate=DEFAULT_ATTENTION_RATE)


def predicted_tokens_per_s(row: PublishedThroughput, hfu: float, attention_rate: str = DEFAULT_ATTENTION_RATE) -> float:
    """The planner's tokens/s/GPU for ``row`` with compute at ``hfu`` (attention at ``attention_rate``)."""
    return planned_step(row.request(hfu, attention_rate=attention_rate)).tokens_per_s_per_gpu


def flat_default_tokens_per_s(row: PublishedThroughput, attention_rate: str = "matmul") -> float:
    """The planner's tokens/s/GPU for ``row`` at the flat HFU 0.4 as it is applied: every kernel
    inside it (zeroplan.validate.step_time.as_flat_default); nothing fitted, so under 'kernel' the
    kernel's published rate itself (attention efficiency 1)."""
    from zeroplan.validate.step_time import as_flat_default

    return planned_step(as_flat_default(_with_attention_rate(row.request(FLAT_HFU), attention_rate))).tokens_per_s_per_gpu


def implied_hfu(row: PublishedThroughput) -> float:
    """The HFU ``zeroplan calibrate step`` solves on ``row`` (its published step) under the
    planner's default attention rate, at the shipped attention efficiency as calibrate step does
    (in sample under 'kernel': no accuracy figure uses it; they use held_out_fit); a step shorter
    than the planner's at HFU 1 is refused."""
    return solve_hfu(default_request(row), published_step_s(row))


class RowError(Frozen):
    """One published row predicted out of sample."""

    name: str
    source: str
    label: str
    """source_label of the row."""
    stack: str
    gpu: str
    strategy: str
    checkpointing: str
    published_tokens_per_s_per_gpu: float
    default_tokens_per_s_per_gpu: float
    """At the flat HFU 0.4, every FLOP and every kernel at it, as it is applied (nothing fitted)."""
    loso_hfu: float
    """HFU of the row's mechanism (GPU generation x stack), fitted on the other sources' rows."""
    loso_tokens_per_s_per_gpu: float
    kernel_class: str = ""
    """kernel_class_of the row."""
    kernel_hfu: float = 0.0
    """HFU of the row's kernel class on its GPU generation, fitted on the other sources' rows
    (kernel_mechanism_hfu)."""
    kernel_tokens_per_s_per_gpu: float = 0.0
    calibrated_hfu: float | None = None
    """The HFU solved on the source's row of fewest GPUs (None: that row itself, or a source of
    fewer than MIN_SOURCE_ROWS rows)."""
    calibrated_tokens_per_s_per_gpu: float | None = None

    @property
    def default_error(self) -> float:
        return self.default_tokens_per_s_per_gpu / self.published_tokens_per_s_per_gpu - 1

    @property
    def loso_error(self) -> float:
        return self.loso_tokens_per_s_per_gpu / self.published_tokens_per_s_per_gpu - 1

    @property
    def kernel_error(self) -> float:
        return self.kernel_tokens_per_s_per_gpu / self.published_tokens_per_s_per_gpu - 1

    @property
    def calibrated_error(self) -> float | None:
        if self.calibrated_tokens_per_s_per_gpu is None:
            return None
        return self.calibrated_tokens_per_s_per_gpu / self.published_tokens_per_s_per_gpu - 1


class SourceCalibration(Frozen):
    """One source calibrated on its calibration_row among the rows calibrate step does not refuse."""

    source: str
    label: str
    stack: str
    gpu: str
    rows: int
    calibration_row: str
    calibration_gpus: int
    hfu: float


def published_row_efficiency(row: PublishedThroughput):  # type: ignore[no-untyped-def]
    """The efficiency file ``zeroplan calibrate step`` writes for ``row``'s published step (the
    docs' example, docs/examples/, is one)."""
    from zeroplan.calibrate.step import calibrate_step

    return calibrate_step(default_request(row), published_step_s(row), model=f"{row.model} ({stack_of(row)}'s architecture)",
                          note=f"published: {source_of(row)}, row {row.name!r}")


# Which row a source is calibrated on, as a user would pick the one step they measure: the
# run of fewest GPUs (issue 30: "calibrate on its smallest-GPU-count row"); where several
# share that count, the cheapest of them to run, the smallest model (fewest parameters, a learned
# position table left out: llm-foundry sizes MPT's to each row's sequence), at the sequence
# length the source mostly runs (nearest its rows' median length, in log2; the shorter on a
# tie), then the first listed. Nothing in it reads a published throughput or an error.
def calibration_row(rows: list[PublishedThroughput]) -> PublishedThroughput:
    """The row ``zeroplan calibrate step`` is solved on among a source's ``rows``."""
    import math

    median_log2 = statistics.median(math.log2(row.seq_len) for row in rows)
    fewest = min(row.num_gpus for row in rows)
    tied = [row for row in rows if row.num_gpus == fewest]
    # min keeps the first of equal keys.
    return min(tied, key=lambda row: (_model_size(row), abs(math.log2(row.seq_len) - median_log2), row.seq_len))


def _model_size(row: PublishedThroughput) -> int:
    """The row's parameters less a learned position table (which grows with the row's sequence)."""
    from zeroplan.core.params import total_parameters
    from zeroplan.specs.model import PositionKind

    spec = row.model_spec
    table = (spec.max_positions + spec.position_offset) * spec.hidden_size if spec.position is PositionKind.learned else 0
    return total_parameters(spec) - table


def first_listed_calibration_row(rows: list[PublishedThroughput]) -> PublishedThroughput:
    """The tie-break calibration_row replaced: the row of fewest GPUs listed first in the source
    (llm-foundry lists its largest model and longest sequence first); printed beside it."""
    return min(rows, key=lambda row: row.num_gpus)  # min keeps the first of equal keys


class TieBreakFigures(Frozen):
    """The one-row calibration under another anchor rule: per source (label, anchor, rows scored,
    median |error|, max |error|), and every scored row's |error|."""

    per_source: tuple[tuple[str, str, int, float, float], ...]
    errors: tuple[float, ...]


def tie_break_figures(table: PublishedThroughputTable) -> TieBreakFigures:
    """The calibrated figures (the planner's default attention rate) with each source anchored by
    first_listed_calibration_row."""
    by_source: dict[str, list[PublishedThroughput]] = {}
    for row in table.rows:
        by_source.setdefault(source_of(row), []).append(row)
    per_source, every = [], []
    for source, members in by_source.items():
        efficiencies, implied = held_out_fit(DEFAULT_ATTENTION_RATE, table, source)
        usable = [row for row in members if row.name in implied]
        if len(members) < MIN_SOURCE_ROWS or not usable:
            continue
        anchor = first_listed_calibration_row(usable)
        errors = [abs(held_out_tokens_per_s(row, carried_calibration_hfu(implied[anchor.name], anchor, row, source, implied,
                                                                          table.rows),
                                            DEFAULT_ATTENTION_RATE, efficiencies)
                      / row.published_tokens_per_s_per_gpu - 1)
                  for row in usable if row.name != anchor.name]
        per_source.append((source_label(anchor), anchor.name, len(errors), statistics.median(errors), max(errors)))
        every += errors
    return TieBreakFigures(per_source=tuple(per_source), errors=tuple(every))


def mechanism_hfu(held_out: str, implied: dict[str, float], rows: tuple[PublishedThroughput, ...],
                  generation: str, stack: str, float8: str | None = None) -> float:
    """The HFU of (generation, stack, float8 recipe or bf16) fitted leave-one-source-out: the
    median implied HFU of the rows of that mechanism in every source but ``held_out``; a float8
    mechanism without such rows takes bf16's (as the fitted default does); the default where there
    are none."""
    for key_float8 in ((float8, None) if float8 is not None else (None,)):
        peers = [implied[row.name] for row in rows if source_of(row) != held_out and generation_of(row.gpu) == generation
                 and stack_of(row) == stack and float8_class_of(row) == key_float8 and row.name in implied]
        if peers:
            return statistics.median(peers)
    return FLAT_HFU


# One efficiency per kernel class per GPU generation (zeroplan.core.default_efficiency): the
# median HFU calibrate step solves on that mechanism's rows; a float8 row's class is its own
# (fitted from float8 rows only; bf16's where none is fitted). Where no row ran that class on that
# generation, the next coarser mechanism is used: the attention kernel alone (compiled or not),
# then the generation alone; a generation without rows takes a fitted one of the same compute
# die, else the flat HFU; nothing is keyed by a row. The shipped default is this fit on every
# row; each accuracy figure is this fit on the other sources only.
def fit_default_efficiency(implied: dict[str, float], rows: tuple[PublishedThroughput, ...],
                           held_out: str | None = None) -> tuple[MechanismHfu, ...]:
    """The mechanisms fitted on ``rows`` but ``held_out``'s (None: every row) and those calibrate
    step refuses (not in ``implied``)."""
    return fit_mechanisms((generation_of(row.gpu), attention_class_of(row), compiled_untimed_of(row), implied[row.name],
                           source_of(row), float8_class_of(row))
                          for row in rows if source_of(row) != held_out and row.name in implied)


# Kept per table of rows: every leave-one-source-out fit of every row asks for it.
@functools.lru_cache(maxsize=8)
def generation_computes(rows: tuple[PublishedThroughput, ...]) -> tuple[GenerationCompute, ...]:
    """The compute die of each generation the rows ran on."""
    dies = {}
    for row in rows:
        gpu = row.gpu_spec
        dies[generation_of(gpu.name)] = GenerationCompute(
            generation=generation_of(gpu.name), architecture=gpu.architecture.value if gpu.architecture else "",
            peak_bf16_flops_per_s=gpu.peak_bf16_flops_per_s)
    return tuple(dies[generation] for generation in sorted(dies))


def kernel_mechanism_hfu(held_out: str, implied: dict[str, float], rows: tuple[PublishedThroughput, ...],
                         row: PublishedThroughput) -> float:
    """The HFU of ``row``'s kernel class on its GPU generation, fitted leave-one-source-out."""
    return _loso_fit(held_out, tuple(sorted(implied.items())), rows, row)


# zeroplan.calibrate.step.carry_hfu: the anchor's HFU carried to a row of another kernel class
# by the ratio of the two classes' HFUs, each fitted without the scored source (as calibrate
# step's file is carried by the shipped default's): a row of the anchor's class gets its HFU.
def carried_calibration_hfu(anchor_hfu: float, anchor: PublishedThroughput, row: PublishedThroughput, held_out: str,
                            implied: dict[str, float], rows: tuple[PublishedThroughput, ...]) -> float:
    """The HFU a source's calibration on ``anchor`` (solved at ``anchor_hfu``) predicts ``row`` at."""
    from zeroplan.calibrate.step import carry_hfu

    if kernel_class_of(anchor) == kernel_class_of(row):
        return anchor_hfu
    return carry_hfu(anchor_hfu, kernel_mechanism_hfu(held_out, implied, rows, anchor),
                     kernel_mechanism_hfu(held_out, implied, rows, row))


@functools.lru_cache(maxsize=4096)
def _loso_fit(held_out: str, implied: tuple[tuple[str, float], ...], rows: tuple[PublishedThroughput, ...],
              row: PublishedThroughput) -> float:
    mechanisms = _held_out_fit(held_out, implied, rows)
    return resolve(mechanisms, generation_computes(rows), row.gpu_spec, attention_class_of(row),
                   compiled_untimed_of(row), float8_class_of(row)).hfu


@functools.lru_cache(maxsize=64)
def _held_out_fit(held_out: str, implied: tuple[tuple[str, float], ...],
                  rows: tuple[PublishedThroughput, ...]) -> tuple[MechanismHfu, ...]:
    return fit_default_efficiency(dict(implied), rows, held_out)


def calibration_study(table: PublishedThroughputTable | None = None) -> tuple[tuple[SourceCalibration, ...], tuple[RowError, ...]]:
    """Every source's one-row calibration, and every row's out-of-sample predictions."""
    return _study(table or load_published_throughput())


@functools.lru_cache(maxsize=2)
def _study(table: PublishedThroughputTable) -> tuple[tuple[SourceCalibration, ...], tuple[RowError, ...]]:
    rows = table.rows
    assert len({row.name for row in rows}) == len(rows), "row names must be unique"
    # Rows calibrate step refuses under the default attention rate (a published step shorter
    # than the planner's at HFU 1) are no anchor, no peer and not scored calibrated; the
    # uncalibrated figures still score them.
    # Under 'kernel' every figure of a source is at the attention efficiencies fitted without it
    # (held_out_fit), as attention_rate_figures scores it: no figure rests on its own rows.
    mode = DEFAULT_ATTENTION_RATE
    by_source: dict[str, list[PublishedThroughput]] = {}
    for row in rows:
        by_source.setdefault(source_of(row), []).append(row)
    fits = {source: held_out_fit(mode, table, source) for source in by_source}
    calibrations: dict[str, tuple[PublishedThroughput, float]] = {}
    for source, members in by_source.items():
        implied = fits[source][1]
        usable = [row for row in members if row.name in implied]
        if len(members) >= MIN_SOURCE_ROWS and usable:
            anchor = calibration_row(usable)
            calibrations[source] = (anchor, implied[anchor.name])
    errors = []
    for row in rows:
        source = source_of(row)
        efficiencies, implied = fits[source]
        loso = mechanism_hfu(source, implied, rows, generation_of(row.gpu), stack_of(row), float8_class_of(row))
        kernel_hfu = kernel_mechanism_hfu(source, implied, rows, row)
        calibrated = calibrated_tokens = None
        if source in calibrations and calibrations[source][0].name != row.name and row.name in implied:
            anchor, anchor_hfu = calibrations[source]
            calibrated = carried_calibration_hfu(anchor_hfu, anchor, row, source, implied, rows)
            calibrated_tokens = held_out_tokens_per_s(row, calibrated, mode, efficiencies)
        errors.append(RowError(
            name=row.name, source=source, label=source_label(row), stack=stack_of(row), gpu=row.gpu, strategy=row.strategy.value,
            checkpointing=row.activation_checkpointing.value,
            published_tokens_per_s_per_gpu=row.published_tokens_per_s_per_gpu,
            default_tokens_per_s_per_gpu=flat_default_tokens_per_s(row),
            loso_hfu=loso, loso_tokens_per_s_per_gpu=held_out_tokens_per_s(row, loso, mode, efficiencies),
            kernel_class=kernel_class_of(row), kernel_hfu=kernel_hfu,
            kernel_tokens_per_s_per_gpu=held_out_tokens_per_s(row, kernel_hfu, mode, efficiencies),
            calibrated_hfu=calibrated, calibrated_tokens_per_s_per_gpu=calibrated_tokens,
        ))
    sources = tuple(
        SourceCalibration(source=source, label=source_label(anchor), stack=stack_of(anchor), gpu=anchor.gpu,
                          rows=len(by_source[source]), calibration_row=anchor.name,
                          calibration_gpus=anchor.num_gpus, hfu=hfu)
        for source, (anchor, hfu) in calibrations.items()
    )
    return sources, tuple(errors)




def _with_attention_rate(request, mode: str, efficiencies: tuple[tuple[str, float], ...] = ()):  # type: ignore[no-untyped-def]
    """``request`` under attention-rate ``mode``; under 'kernel', at the attention efficiency
    ``efficiencies`` gives its kernel (zeroplan.core.attention_efficiency; 1 where it gives none),
    never the shipped default, which every row was fitted into."""
    update: dict[str, object] = {"attention_rate": mode}
    if mode == "kernel":
        update["attention_efficiency"] = dict(efficiencies).get(attention_kernel_name(request), 1.0)
    return request.model_copy(update={"performance": request.performance.model_copy(update=update)})


def attention_kernel_name(request) -> str:  # type: ignore[no-untyped-def]
    """The request's attention kernel as zeroplan.core.attention_rate names it."""
    from zeroplan.core.attention_rate import kernel_name

    return kernel_name(request.training.attention_kernel, request.training.attention_implementation)


# zeroplan.core.attention_efficiency: per source whose rows span MIN_SEQUENCE_LENGTHS sequence
# lengths of one attention kernel, the two-unknown least squares of source_attention_efficiency on
# the planner's own terms (its step at e = 1 and HFU FIT_HFU, where exposed communication is what
# it is at a typical HFU); per kernel, the median over those sources. held_out's rows never enter.
FIT_HFU = 0.6
"""The HFU the planner's non-compute terms are read at while e is fitted (they barely move with it)."""


# Kept per row: each leave-one-source-out fit asks it of every row but the held-out source's.
@functools.lru_cache(maxsize=4096)
def _efficiency_columns(row: PublishedThroughput) -> tuple[float, float, float]:
    from zeroplan.core.compiled_time import compile_saved_seconds
    from zeroplan.core.timing import attention_flops_per_s, executed_flops_per_s, memory_bound_time_s, rank_flops

    request = timed_request_of(_with_attention_rate(row.request(FIT_HFU), "kernel"))
    step = planned_step(request)
    flops = rank_flops(request)
    attention = flops.attention_forward_flops + flops.attention_backward_flops
    peak = request.cluster.gpu.peak_bf16_flops_per_s
    rest_s = (step.step_with_overlap_s - step.compute_s + sum(memory_bound_time_s(request))
              - sum(compile_saved_seconds(request)))
    attention_s = attention / attention_flops_per_s(request, executed_flops_per_s(request))
    return (flops.executed_flops - attention) / peak, attention_s, published_step_s(row) - rest_s


def timed_request_of(request):  # type: ignore[no-untyped-def]
    from zeroplan.calibrate.step import timed_request

    return timed_request(request)


@functools.lru_cache(maxsize=128)
def attention_efficiency_fit(table: PublishedThroughputTable, held_out: str | None = None) -> tuple[tuple[str, float], ...]:
    """(kernel, e) fitted on ``table``'s sources but ``held_out`` (None: every source), sorted."""
    from zeroplan.core.attention_efficiency import MIN_SEQUENCE_LENGTHS, source_attention_efficiency

    by_source: dict[str, list[PublishedThroughput]] = {}
    for row in table.rows:
        if source_of(row) != held_out:
            by_source.setdefault(source_of(row), []).append(row)
    fitted: dict[str, list[float]] = {}
    for members in by_source.values():
        kernels = {attention_kernel_name(row.request()) for row in members}
        if len(kernels) != 1 or len({row.seq_len for row in members}) < MIN_SEQUENCE_LENGTHS:
            continue
        e = source_attention_efficiency([_efficiency_columns(row) for row in members])
        if e is not None:
            fitted.setdefault(kernels.pop(), []).append(e)
    return tuple(sorted((kernel, statistics.median(values)) for kernel, values in fitted.items()))


def source_attention_efficiencies(table: PublishedThroughputTable) -> tuple[tuple[str, str, float], ...]:
    """(source, kernel, e) of every source the fit can use, each on its own rows (what the
    benchmark prints beside the leave-one-source-out values)."""
    from zeroplan.core.attention_efficiency import MIN_SEQUENCE_LENGTHS, source_attention_efficiency

    by_source: dict[str, list[PublishedThroughput]] = {}
    for row in table.rows:
        by_source.setdefault(source_of(row), []).append(row)
    found = []
    for source, members in by_source.items():
        kernels = {attention_kernel_name(row.request()) for row in members}
        if len(kernels) != 1 or len({row.seq_len for row in members}) < MIN_SEQUENCE_LENGTHS:
            continue
        e = source_attention_efficiency([_efficiency_columns(row) for row in members])
        if e is not None:
            found.append((source, kernels.pop(), e))
    return tuple(found)


class AttentionRateFigures(Frozen):
    """One attention-rate mode on the published rows: each source calibrated on its row of
    fewest GPUs and scored on its others, and the default HFU over every row."""

    mode: str
    per_source: tuple[tuple[str, int, float, float], ...]
    """(source label, rows scored, median |error|, max |error|), sources of MIN_SOURCE_ROWS or more."""
    calibrated: tuple[float, ...]
    """|error| of every calibrated prediction."""
    default: tuple[float, ...]
    """|error| of every row at the default HFU."""
    refused: tuple[str, ...]
    """Rows calibrate step refuses (their published step is shorter than the planner's at HFU 1):
    neither an anchor nor scored."""
    kernel_class: tuple[float, ...] = ()
    """|error| of every row at the HFU of its GPU generation x kernel class fitted on the other
    sources under this mode (kernel_mechanism_hfu; refused rows are no peers but are scored)."""


@functools.lru_cache(maxsize=16)
def mode_implied_hfus(mode: str, table: PublishedThroughputTable,
                      efficiencies: tuple[tuple[str, float], ...] | None = None) -> dict[str, float]:
    """The HFU calibrate step solves on each row under attention-rate ``mode`` (under 'kernel', at
    the attention efficiencies ``efficiencies``; None: those fitted on every row); the rows it
    refuses (a published step shorter than the planner's at HFU 1) are left out."""
    from zeroplan.errors import ZeroplanError

    if efficiencies is None:
        efficiencies = attention_efficiency_fit(table) if mode == "kernel" else ()
    implied: dict[str, float] = {}
    for row in table.rows:
        efficiency = dict(efficiencies).get(attention_kernel_name(row.request()), 1.0) if mode == "kernel" else None
        try:
            implied[row.name] = _row_implied_hfu(row, mode, efficiency)
        except ZeroplanError:
            pass
    return implied


def held_out_fit(mode: str, table: PublishedThroughputTable,
                 source: str) -> tuple[tuple[tuple[str, float], ...], dict[str, float]]:
    """What ``source``'s rows are scored at under attention-rate ``mode``: under 'kernel', the
    attention efficiencies fitted without its rows (attention_efficiency_fit) and every row's HFU
    solved at them; under the others nothing but the HFU is fitted: ((), every row's HFU)."""
    if mode != "kernel":
        return (), mode_implied_hfus(mode, table)
    efficiencies = attention_efficiency_fit(table, source)
    return efficiencies, mode_implied_hfus(mode, table, efficiencies)


def held_out_tokens_per_s(row: PublishedThroughput, hfu: float, mode: str,
                          efficiencies: tuple[tuple[str, float], ...]) -> float:
    """The planner's tokens/s/GPU for ``row`` at ``hfu`` under ``mode``; under 'kernel' at the
    attention efficiencies ``efficiencies`` (held_out_fit's), never the shipped default, which
    every row was fitted into."""
    if mode != "kernel":
        return predicted_tokens_per_s(row, hfu, mode)
    return planned_step(_with_attention_rate(row.request(hfu), mode, efficiencies)).tokens_per_s_per_gpu


@functools.lru_cache(maxsize=4096)
def _row_implied_hfu(row: PublishedThroughput, mode: str, efficiency: float | None) -> float:
    # Kept per (row, mode, efficiency): the leave-one-source-out fits change the efficiency of
    # one kernel's rows only, so the other rows' solutions are reused.
    request = _with_attention_rate(row.request(), mode)
    if efficiency is not None:
        request = request.model_copy(update={"performance": request.performance.model_copy(
            update={"attention_efficiency": efficiency})})
    return solve_hfu(request, published_step_s(row))


@functools.lru_cache(maxsize=4)
def attention_rate_figures(mode: str, table: PublishedThroughputTable) -> AttentionRateFigures:
    """The calibrated and default figures of the rows under attention-rate ``mode``."""
    rows = table.rows
    implied = mode_implied_hfus(mode, table)
    refused = [row.name for row in rows if row.name not in implied]
    by_source: dict[str, list[PublishedThroughput]] = {}
    for row in rows:
        by_source.setdefault(source_of(row), []).append(row)

    # Under 'kernel' each source is scored at the attention efficiencies fitted without it, its
    # peers' HFUs solved at those too (held_out_fit): no figure rests on its own rows.
    def held_out(source: str) -> tuple[tuple[tuple[str, float], ...], dict[str, float]]:
        return held_out_fit(mode, table, source)

    per_source, calibrated = [], []
    for source, members in by_source.items():
        efficiencies, source_implied = held_out(source)
        usable = [row for row in members if row.name in source_implied]
        if len(members) < MIN_SOURCE_ROWS or not usable:
            continue
        anchor = calibration_row(usable)
        errors = [abs(planned_step(_with_attention_rate(row.request(carried_calibration_hfu(
                          source_implied[anchor.name], anchor, row, source, source_implied, rows)), mode, efficiencies)
                                   ).tokens_per_s_per_gpu / row.published_tokens_per_s_per_gpu - 1)
                  for row in usable if row.name != anchor.name]
        per_source.append((source_label(anchor), len(errors), statistics.median(errors), max(errors)))
        calibrated += errors
    default = [abs(flat_default_tokens_per_s(row, mode) / row.published_tokens_per_s_per_gpu - 1) for row in rows]
    kernel = []
    for row in rows:
        efficiencies, source_implied = held_out(source_of(row))
        hfu = kernel_mechanism_hfu(source_of(row), source_implied, rows, row)
        kernel.append(abs(planned_step(_with_attention_rate(row.request(hfu), mode, efficiencies)).tokens_per_s_per_gpu
                          / row.published_tokens_per_s_per_gpu - 1))
    return AttentionRateFigures(mode=mode, per_source=tuple(per_source), calibrated=tuple(calibrated),
                                default=tuple(default), refused=tuple(refused), kernel_class=tuple(kernel))


REGENERATE = "python benchmarks/step_time_accuracy.py --write-default-efficiency"
"""The command that writes zeroplan/core/data/default_efficiency.json from the published rows."""


def default_efficiency_table() -> DefaultEfficiencyTable:
    """The shipped default efficiency (zeroplan.core.default_efficiency): every mechanism fitted
    on every published row, under each attention-rate mode, with the rows' file hash and sources."""
    import hashlib

    from zeroplan.validate.step_time import PUBLISHED_THROUGHPUT_FILE

    table = load_published_throughput()
    counts: dict[str, int] = {}
    for row in table.rows:
        counts[source_of(row)] = counts.get(source_of(row), 0) + 1
    root = PUBLISHED_THROUGHPUT_FILE.parents[3]
    from zeroplan.core.timing import COMPUTE_BASIS

    return DefaultEfficiencyTable(
        compute_basis=COMPUTE_BASIS,
        description=("One HFU (of the matrix products' and attention's FLOPs; the memory-bound kernels and the "
                     "optimizer step are timed apart at the GPU's copy bandwidth) per GPU generation x kernel class (attention kernel; compiled where the planner does "
                     "not time compile), at each coarser level too (attention kernel alone, generation alone): the "
                     "median of the HFUs zeroplan calibrate step solves on the published rows of that mechanism, "
                     "rows it refuses left out, where they come from at least two sources (MIN_MECHANISM_SOURCES). The "
                     "planner's default when neither --hfu nor --efficiency is given "
                     "(zeroplan.core.default_efficiency); its accuracy is measured leave-one-source-out by "
                     "benchmarks/step_time_accuracy.py, never on this in-sample fit."),
        regenerate=REGENERATE,
        published_rows=str(PUBLISHED_THROUGHPUT_FILE.relative_to(root)),
        published_rows_sha256=hashlib.sha256(PUBLISHED_THROUGHPUT_FILE.read_bytes()).hexdigest(),
        sources=tuple(f"{source}: {count} rows" for source, count in sorted(counts.items())),
        generations=generation_computes(table.rows),
        mechanisms={mode: fit_default_efficiency(mode_implied_hfus(mode, table), table.rows) for mode in ATTENTION_RATES},
        attention_efficiency=dict(attention_efficiency_fit(table)),
    )


TARGET_MEDIAN = 0.05
TARGET_MAX = 0.15
"""Issue 30's target for a source calibrated on one row: median |error| at most 5 %, none over 15 %."""


class AnchorFloor(Frozen):
    """Where a source's calibration error comes from: the rule's anchor (calibration_row) beside
    every other row of the source tried as the anchor. A diagnostic of the model's spread within
    the source, never an accuracy figure: picking the anchor by its errors would fit it to the
    rows it is scored on. Where no anchor reaches the target, the planner's residuals themselves
    spread wider than the target within the source, whatever row is measured."""

    label: str
    anchors: int
    """Rows tried as the anchor (those calibrate step does not refuse)."""
    rule_median: float
    rule_max: float
    best_median: float
    """The lowest median |error| any one anchor gives (its max beside it: best_median_max)."""
    best_median_max: float
    best_max: float
    """The lowest max |error| any one anchor gives (its median beside it: best_max_median)."""
    best_max_median: float
    meeting_target: int
    """Anchors whose median and max both meet TARGET_MEDIAN and TARGET_MAX."""


def source_rows(table: PublishedThroughputTable) -> dict[str, list[PublishedThroughput]]:
    """The table's rows by source, in the order listed."""
    by_source: dict[str, list[PublishedThroughput]] = {}
    for row in table.rows:
        by_source.setdefault(source_of(row), []).append(row)
    return by_source


def anchor_floor(table: PublishedThroughputTable, source: str) -> AnchorFloor:
    """``source``'s calibrated errors with each of its rows as the anchor, at the attention
    efficiencies fitted without it (held_out_fit), as the calibrated figures score it."""
    efficiencies, implied = held_out_fit(DEFAULT_ATTENTION_RATE, table, source)
    usable = [row for row in source_rows(table)[source] if row.name in implied]
    rule = calibration_row(usable).name
    by_anchor: dict[str, tuple[float, float]] = {}
    for anchor in usable:
        errors = [abs(held_out_tokens_per_s(row, carried_calibration_hfu(implied[anchor.name], anchor, row, source, implied,
                                                                          table.rows),
                                            DEFAULT_ATTENTION_RATE, efficiencies)
                      / row.published_tokens_per_s_per_gpu - 1) for row in usable if row.name != anchor.name]
        by_anchor[anchor.name] = (statistics.median(errors), max(errors))
    best_median = min(by_anchor.values())
    best_max = min(by_anchor.values(), key=lambda figures: (figures[1], figures[0]))
    return AnchorFloor(
        label=source_label(usable[0]), anchors=len(usable), rule_median=by_anchor[rule][0], rule_max=by_anchor[rule][1],
        best_median=best_median[0], best_median_max=best_median[1], best_max=best_max[1], best_max_median=best_max[0],
        meeting_target=sum(median <= TARGET_MEDIAN and worst <= TARGET_MAX for median, worst in by_anchor.values()))


def row_features(row: PublishedThroughput) -> str:
    """What a published row ran, in the terms its calibrated error is read against: model and
    width, sequence, micro-batch x accumulation (and the tokens of one micro-batch), GPUs and
    model-parallel layout, checkpointing, attention kernel and compile."""
    spec = row.model_spec
    layout = f" tp{row.tp} pp{row.pp}" if row.tp * row.pp > 1 else ""
    compiled = " compiled" if row.compile else ""
    return (f"{row.model} h{spec.hidden_size} L{spec.num_layers} | s {row.seq_len} | b {row.micro_batch_size} x "
            f"{row.grad_accum_steps} ({row.micro_batch_size * row.seq_len} tokens/micro-batch) | {row.num_gpus} GPUs{layout} "
            f"{row.strategy.value} | AC {row.activation_checkpointing.value} | {attention_class_of(row)}{compiled}")
