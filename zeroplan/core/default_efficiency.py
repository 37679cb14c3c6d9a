"""The default compute efficiency: one HFU per mechanism, GPU generation x kernel class, fitted
on the project's published throughput rows (docs/communication-time.md, "Compute"; issue rules:
per mechanism never per row, every figure leave-one-source-out).

The efficiency a run reaches is a property of the kernels it runs on its GPU: the attention
kernel (zeroplan.core.stack_time.kernel_class: flash-attn-2, the Triton flash kernel, eager),
whether the step is compiled where the planner does not time compile, whether its linears train
in float8 and under which recipe (TransformerEngine's delayed scaling or torchao's tensorwise or
rowwise: other matmul and cast kernels than bf16's), and the GPU generation.
Each mechanism's HFU is the median of the HFUs ``zeroplan calibrate step`` solves on the
published rows that ran it, where they come from at least two published sources
(zeroplan.validate.step_calibration.fit_default_efficiency, written to data/default_efficiency.json
by ``python benchmarks/step_time_accuracy.py --write-default-efficiency`` with the rows' file hash
and sources). A request without --hfu or --efficiency is timed at its
mechanism's HFU, the coarser mechanism where no row ran it (its attention kernel alone, then its
generation). A float8 request takes its float8 recipe's mechanisms, fitted on float8 rows only;
where none is fitted (no float8 rows of that recipe from two sources) it falls back, explicitly,
to the bf16 chain above. A GPU generation without rows takes the fit of a generation of the same compute
die (architecture and peak bf16 FLOP/s, e.g. H200 from H100), else the flat HFU 0.4 (a round
figure, not fitted). How far this default lands from published rows the fit never saw is
measured leave-one-source-out (benchmarks/step_time_accuracy.py; zeroplan.calibrate.basis.DEFAULT_BAND).

Nothing here imports torch; the table is data.
"""

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import Field

from zeroplan.specs.base import Frozen
from zeroplan.specs.hardware import GpuArchitecture, GpuSpec
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import AttentionImplementation, AttentionKernel, TrainingSpec

DEFAULT_EFFICIENCY_FILE = Path(__file__).resolve().parent / "data" / "default_efficiency.json"

FLAT_HFU = 0.4
"""The HFU of a GPU no published row's generation or compute die covers: a round figure, not
fitted (docs/communication-time.md, "Compute")."""

MIN_MECHANISM_SOURCES = 2
"""A mechanism is fitted only on rows of at least this many published sources (a fit on one
publication's rows would be that publication's constant, not the mechanism's); below it the
next coarser mechanism applies."""

TABLE_KIND = "zeroplan-default-efficiency"

Level = Literal["kernel class", "attention kernel", "generation", "flat"]


class MechanismHfu(Frozen):
    """One mechanism's fitted HFU: the median HFU calibrate step solves on its published rows."""

    generation: str
    """GPU generation (generation_of): a100 covers a100-40gb and a100-80gb."""
    attention: str | None
    """Attention kernel class (attention_class); None: every kernel of the generation."""
    compiled: bool | None
    """Compiled where the planner does not time compile (compiled_untimed); None: either."""
    hfu: float = Field(gt=0, le=1)
    rows: int = Field(gt=0)
    """Published rows the median is over."""
    sources: int = Field(gt=0)
    """Published sources (one publication's table each) those rows come from."""
    float8: str | None = None
    """The float8 recipe (Float8Recipe value) the rows trained their linears under, fitted on those
    rows only; None: bf16 rows only (a float8 row never enters a bf16 mechanism)."""


class GenerationCompute(Frozen):
    """The compute die of a fitted generation: a generation without rows whose GPU has the same
    architecture and peak bf16 FLOP/s takes its fit."""

    generation: str
    architecture: str
    peak_bf16_flops_per_s: float = Field(gt=0)


class DefaultEfficiencyTable(Frozen):
    """data/default_efficiency.json: the fitted mechanisms and where they come from."""

    kind: Literal["zeroplan-default-efficiency"] = TABLE_KIND
    compute_basis: Literal["matmul-attention"]
    """What each HFU covers (zeroplan.core.timing.COMPUTE_BASIS): the matrix products' and
    attention's FLOPs, the memory-bound kernels timed apart at the copy bandwidth."""
    description: str
    regenerate: str
    """The command that writes this file from the published rows."""
    published_rows: str
    """The rows' file, relative to the repository."""
    published_rows_sha256: str
    """Hash of that file as fitted."""
    sources: tuple[str, ...]
    """The published sources the rows come from, with their row counts."""
    generations: tuple[GenerationCompute, ...]
    mechanisms: dict[str, tuple[MechanismHfu, ...]]
    """By PerformanceAssumptions.attention_rate (the HFU is the matrix products' under
    'published' and 'kernel')."""
    attention_efficiency: dict[str, float] = {}
    """Under --attention-rate kernel, each attention kernel's achieved rate over its published one
    (zeroplan.core.attention_efficiency), fitted on the sources whose rows span enough sequence
    lengths; a kernel not in it keeps its published rate. The 'kernel' HFUs above are fitted at these."""


class DefaultHfu(Frozen):
    """The HFU a request is timed at without --hfu or --efficiency, and what it rests on."""

    hfu: float
    level: Level
    """The mechanism it was found at: the kernel class, the attention kernel alone, the
    generation alone, or the flat HFU (no rows)."""
    mechanism: str
    """e.g. 'h100, flash-attn-2, not compiled'."""
    rows: int = 0
    sources: int = 0
    borrowed_from: str | None = None
    """The fitted generation of the same compute die a generation without rows takes."""
    float8_fallback: str | None = None
    """The float8 recipe of a request no float8 mechanism of which is fitted: it is timed at the
    bf16 mechanism's HFU (found at ``level`` of the bf16 chain)."""

    def describe(self) -> str:
        """What the time basis line says of it."""
        if self.level == "flat":
            return f"flat HFU {self.hfu:g} ({self.mechanism}: no published rows of its generation or compute die)"
        borrowed = f", {self.borrowed_from}'s fit (same compute die)" if self.borrowed_from else ""
        coarser = ("" if self.level == "kernel class" else
                   f"; its kernel class has no rows of {MIN_MECHANISM_SOURCES} sources or more: fitted per {self.level}")
        float8 = ("" if self.float8_fallback is None else
                  f"; no float8 {self.float8_fallback} rows of {MIN_MECHANISM_SOURCES} sources or more: bf16's fit")
        return (f"fitted default HFU {self.hfu:.3f} ({self.mechanism}{borrowed}: median of {self.rows} published rows, "
                f"{self.sources} sources{coarser}{float8})")


# The catalog's names end in the memory size where one die ships with several (a100-40gb,
# a100-80gb), and carry the board otherwise (a100-pcie-40gb, h100-pcie, h100-nvl, rtx-3090): a
# published row's fit covers its own board only, so a board without rows takes a fit of its
# compute die only through the borrowed level, which says so (DefaultHfu.describe).
def generation_of(gpu_name: str) -> str:
    """The GPU generation of a catalog name, its name without the memory size: a100-40gb and
    a100-80gb are both a100; a100-pcie-40gb is a100-pcie, rtx-3090 and rtx-4090 are themselves."""
    parts = gpu_name.split("-")
    if len(parts) > 1 and parts[-1].endswith("gb") and parts[-1][:-2].isdigit():
        parts = parts[:-1]
    return "-".join(parts)


SDPA_MEMORY_EFFICIENT = "sdpa-memory-efficient"
"""The kernel class of a flash request on a GPU FlashAttention-2 does not run on: PyTorch SDPA's
memory-efficient kernel (no published row ran it, so its HFU is its generation's)."""

# FlashAttention-2 runs on sm80 and later only: PyTorch aten/src/ATen/native/transformers/cuda/
# sdp_utils.cpp check_flash_attention_hardware_support (flash: [sm80, ...]) against
# check_mem_efficient_hardware_support ([sm50, ...]), so on a V100 (sm70) SDPA dispatches a flash
# request to its memory-efficient kernel (the flash-attn package refuses the GPU); the same on a
# T4 (sm75, Turing).
PRE_FLASH_ATTENTION_2 = frozenset({GpuArchitecture.volta, GpuArchitecture.turing})
"""GPU architectures FlashAttention-2's kernels do not run on."""


def attention_class(training: TrainingSpec, gpu: GpuSpec | None = None) -> str:
    """The attention kernel a request runs: 'eager' (every score materialised), its flash kernel,
    or SDPA's memory-efficient kernel where ``gpu`` predates FlashAttention-2."""
    if training.attention_kernel is AttentionKernel.eager:
        return AttentionKernel.eager.value
    if (gpu is not None and gpu.architecture in PRE_FLASH_ATTENTION_2
            and training.attention_implementation is AttentionImplementation.flash_attn_2):
        return SDPA_MEMORY_EFFICIENT
    return training.attention_implementation.value


def float8_class(training: TrainingSpec) -> str | None:
    """The float8 recipe a request trains its linears under (its own mechanism), None: bf16."""
    return None if training.float8 is None else training.float8.value


def compiled_untimed(request: PlanRequest) -> bool:
    """The request compiles and the planner cannot time compile's savings
    (zeroplan.core.compiled_time.compile_time_note): its efficiency is a compiled step's."""
    if not request.training.compile:
        return False
    from zeroplan.core.compiled_time import compile_time_note

    return bool(compile_time_note(request))


def _architecture(gpu: GpuSpec) -> str:
    return gpu.architecture.value if gpu.architecture else ""


def _mechanism(generation: str, attention: str | None, compiled: bool | None, float8: str | None = None) -> str:
    parts = [generation]
    if attention is not None:
        parts.append(attention)
    if compiled is not None:
        parts.append("compiled" if compiled else "not compiled")
    if float8 is not None:
        parts.append(f"float8 {float8}")
    return ", ".join(parts)


# The fit: at each of the three levels (kernel class, attention kernel, generation) the median
# of the HFUs solved on the rows of that mechanism, where they come from MIN_MECHANISM_SOURCES
# sources or more; float8 rows form their own mechanisms per recipe at the same three levels and
# never enter bf16's. The same function fits the shipped table on every row and,
# leave-one-source-out, the tables the accuracy figures are scored with.
def fit_mechanisms(samples: Iterable[tuple[str, str, bool, float, str, str | None]]) -> tuple[MechanismHfu, ...]:
    """Mechanisms of (generation, attention class, compiled untimed, solved HFU, source, float8
    recipe or None) samples."""
    import statistics  # the fit runs in validation and benchmarks, never in a command that plans

    groups: dict[tuple[str, str | None, bool | None, str | None], list[tuple[float, str]]] = {}
    for generation, attention, compiled, hfu, source, float8 in samples:
        for key in ((generation, attention, compiled, float8), (generation, attention, None, float8),
                    (generation, None, None, float8)):
            groups.setdefault(key, []).append((hfu, source))
    return tuple(
        MechanismHfu(generation=generation, attention=attention, compiled=compiled, float8=float8,
                     hfu=statistics.median(hfu for hfu, _ in members), rows=len(members),
                     sources=len({source for _, source in members}))
        for (generation, attention, compiled, float8), members in sorted(
            groups.items(), key=lambda item: (item[0][3] or "", item[0][0], item[0][1] or "", str(item[0][2])))
        if len({source for _, source in members}) >= MIN_MECHANISM_SOURCES
    )


def resolve(mechanisms: tuple[MechanismHfu, ...], generations: tuple[GenerationCompute, ...], gpu: GpuSpec,
            attention: str, compiled: bool, float8: str | None = None) -> DefaultHfu:
    """The HFU of ``attention`` (compiled untimed or not, float8 recipe or bf16) on ``gpu`` under
    ``mechanisms`` (_resolve)."""
    return _resolve(mechanisms, generations, gpu.name, _architecture(gpu), gpu.peak_bf16_flops_per_s, attention, compiled,
                    float8)


def _resolve(mechanisms: tuple[MechanismHfu, ...], generations: tuple[GenerationCompute, ...], gpu_name: str,
             architecture: str, peak_bf16_flops_per_s: float, attention: str, compiled: bool,
             float8: str | None = None) -> DefaultHfu:
    """The HFU of ``attention`` (compiled untimed or not) on ``gpu``: its kernel class on its
    generation, else its attention kernel, else the generation; a generation without rows takes
    a fitted one of the same compute die; else the flat HFU. A float8 request first walks the
    same levels among its recipe's float8 mechanisms; where none is fitted it falls back to the
    bf16 chain (float8_fallback says so)."""
    generation = generation_of(gpu_name)
    fitted = {m.generation for m in mechanisms if m.attention is None and m.float8 is None}
    borrowed = None
    if generation not in fitted:
        same_die = sorted(g.generation for g in generations if architecture and g.generation in fitted
                          and g.architecture == architecture and g.peak_bf16_flops_per_s == peak_bf16_flops_per_s)
        if not same_die:
            return DefaultHfu(hfu=FLAT_HFU, level="flat", mechanism=_mechanism(generation, attention, compiled))
        borrowed = generation = same_die[0]
    by_key = {(m.generation, m.attention, m.compiled, m.float8): m for m in mechanisms}
    levels: tuple[tuple[Level, str | None, bool | None], ...] = (
        ("kernel class", attention, compiled), ("attention kernel", attention, None), ("generation", None, None))
    # float8's own mechanisms first, then (explicitly, float8_fallback) bf16's.
    for key_float8 in ((float8, None) if float8 is not None else (None,)):
        for level, key_attention, key_compiled in levels:
            found = by_key.get((generation, key_attention, key_compiled, key_float8))
            if found is not None:
                return DefaultHfu(hfu=found.hfu, level=level, rows=found.rows, sources=found.sources,
                                  borrowed_from=borrowed, float8_fallback=float8 if key_float8 != float8 else None,
                                  mechanism=_mechanism(generation_of(gpu_name), key_attention, key_compiled, key_float8))
    raise AssertionError("a fitted generation has its generation-level mechanism")  # the coarsest has the most sources


@functools.lru_cache(maxsize=1)
def default_table() -> DefaultEfficiencyTable:
    """The shipped table (data/default_efficiency.json)."""
    # Parsed by pydantic (the same table as json.loads then model_validate, in a third of the
    # time), so that a command that plans does not import the json module.
    return DefaultEfficiencyTable.model_validate_json(DEFAULT_EFFICIENCY_FILE.read_text())


@functools.lru_cache(maxsize=256)
def _default_hfu(gpu_name: str, architecture: str, peak_bf16_flops_per_s: float, attention: str, compiled: bool,
                 mode: str, float8: str | None) -> DefaultHfu:
    table = default_table()
    return _resolve(table.mechanisms[mode], table.generations, gpu_name, architecture, peak_bf16_flops_per_s,
                    attention, compiled, float8)


def default_hfu(request: PlanRequest) -> DefaultHfu:
    """The fitted default HFU of ``request``'s mechanism under its attention-rate mode."""
    gpu = request.cluster.gpu
    return _default_hfu(gpu.name, _architecture(gpu), gpu.peak_bf16_flops_per_s, attention_class(request.training, gpu),
                        compiled_untimed(request),
                        request.performance.attention_rate, float8_class(request.training))


def effective_hfu(request: PlanRequest) -> float:
    """The HFU compute is timed at: the one given (--hfu, --efficiency), else the fitted default."""
    given = request.performance.hardware_flops_utilization
    return given if given is not None else default_hfu(request).hfu
