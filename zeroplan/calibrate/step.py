"""Calibrate the compute efficiency from one measured step (``zeroplan calibrate step``), and
apply it elsewhere (``--efficiency FILE`` on fit, compare and plan).

The planner times a step as compute (executed matrix-product and attention FLOPs at HFU x peak
bf16 FLOP/s, the memory-bound kernels and the optimizer step at the GPU's copy bandwidth) plus what its
alpha-beta communication model says the compute does not hide, plus the pipeline bubble, the
model-parallel collectives and offload's CPU step (zeroplan.core.timing.step_time). One measured
step fixes one number: the HFU at which that step comes out at the measured seconds, with
communication, overlap and host time kept as the planner prices them. The efficiency applies to
compute only, so the file carries to other GPU counts, strategies, micro-batches and sequence
lengths of the same GPU and training stack, and is refused for another GPU or stack (the
mechanism fitted is per GPU x stack, never per configuration).

docs/validation.md, "Step time", measures how well one calibrated row predicts the other rows
of its source (zeroplan.calibrate.basis.CALIBRATED_BANDS, by the attention rate the HFU was solved under)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError

from zeroplan.errors import ZeroplanError, nested_too_deeply_error
from zeroplan.specs.base import Frozen, first_error
from zeroplan.specs.framework import Framework
from zeroplan.specs.request import PerformanceAssumptions, PlanRequest

EFFICIENCY_KIND = "zeroplan-step-efficiency"

HFU_TOLERANCE = 1e-9
"""The bisection stops when the HFU bracket is this narrow."""


class CalibrationSource(Frozen):
    """The measured configuration an efficiency file was solved on."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    model: str
    """The model the step ran (preset name or config path as given)."""
    num_gpus: int = Field(gt=0)
    gpus_per_node: int = Field(gt=0)
    strategy: str
    """Sharding strategy of the measured run."""
    micro_batch_size: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    grad_accum_steps: int = Field(gt=0)
    activation_checkpointing: str
    precision: str
    tp: int = Field(default=1, gt=0)
    cp: int = Field(default=1, gt=0)
    pp: int = Field(default=1, gt=0)
    compile: bool = False
    """The measured run compiled its blocks (TrainingSpec.compile): compile's saved memory traffic
    is modelled (zeroplan.core.compiled_time), so the HFU is an eager step's and the file applies
    compiled or not where compile is timed."""
    float8: str | None = None
    """Its float8 recipe: float8 is not timed, so the file applies only under the same."""
    overlap_grad_reduce: bool | None = None
    """Whether the planner timed its gradient reductions inside the backward (the stack's default
    or --overlap-grad-reduce as resolved, zeroplan.core.communication.overlaps_grad_reduce);
    None in a file written before it was recorded."""
    overlap_param_gather: bool = False
    """--overlap-param-gather of the calibration."""
    tp_comm_overlap: bool = False
    """--tp-comm-overlap of the calibration."""
    measured_step_s: float = Field(gt=0)
    """The measured optimizer step, seconds."""
    measured_tokens_per_s_per_gpu: float = Field(gt=0)
    """Tokens of the step per GPU (over the model-parallel ranks, as the planner counts) per second."""
    note: str = ""
    """Where the measurement comes from (--note)."""


class StepEfficiency(Frozen):
    """An efficiency file: the compute efficiency one measured step implies."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    kind: Literal["zeroplan-step-efficiency"] = EFFICIENCY_KIND
    """Marks the file's kind (a GPU file or a record is refused by it)."""
    hardware_flops_utilization: float = Field(gt=0, le=1)
    """The HFU at which the planner's step equals the measured one."""
    gpu: str = Field(min_length=1)
    """GpuSpec.name of the GPU the step ran on."""
    gpu_display_name: str = Field(min_length=1)
    framework: Framework
    """The training stack (the planner's framework profile) the step ran."""
    source: CalibrationSource
    """The measured configuration."""
    attention_rate: Literal["matmul", "published", "kernel"] = "matmul"
    """PerformanceAssumptions.attention_rate the HFU was solved under (the HFU is the matrix
    products' under 'published' and 'kernel'); --efficiency applies it only under the same. A
    file without it was written when 'matmul' was the only rate."""
    attention_efficiency: float | None = Field(default=None, gt=0)
    """Under attention_rate 'kernel', attention's achieved rate over its kernel's published rate
    the HFU was solved at (zeroplan.core.attention_efficiency); --efficiency applies it with the
    HFU. None: another attention rate, or a file written before it was recorded."""
    attention_class: str | None = None
    """The attention kernel class of the calibrated step (zeroplan.core.default_efficiency.attention_class),
    with compiled_untimed and source.float8 its mechanism: applied to a request of another
    mechanism the HFU is carried by the fitted default's ratio between the two (carried_hfu).
    None: a file written before it was recorded, applied as solved."""
    compiled_untimed: bool | None = None
    """The calibrated step compiled where the planner does not time compile
    (zeroplan.core.default_efficiency.compiled_untimed). None: as attention_class."""
    compute_basis: Literal["all-kernels", "matmul-attention"] = "all-kernels"
    """What the HFU covers (zeroplan.core.timing.COMPUTE_BASIS): 'matmul-attention', the matrix
    products' and attention's FLOPs, the memory-bound kernels and the optimizer step timed apart
    at the GPU's copy bandwidth; 'all-kernels' (a file without the field), every kernel: such a
    file is refused, its HFU would count the memory-bound time twice."""
    predicted_compute_s: float = Field(ge=0)
    """Compute of the source configuration at the fitted HFU, seconds."""
    predicted_communication_s: float = Field(ge=0)
    """All its collectives back to back under the planner's model, seconds."""
    predicted_exposed_communication_s: float = Field(ge=0)
    """Of those (and host copies), what the planner says the compute does not hide, seconds."""


def _at_hfu(request: PlanRequest, hfu: float | None) -> PlanRequest:
    return request.model_copy(update={"performance": request.performance.model_copy(
        update={"hardware_flops_utilization": hfu})})


def timed_request(request: PlanRequest) -> PlanRequest:
    """The request whose memory plan() reports: under pipeline parallelism its peak-memory rank,
    from which plan() times every rank and takes the slowest (zeroplan.core.plan.pipeline_step_time)."""
    if request.parallel.pp == 1:
        return request
    return request.at_pipeline_rank(_peak_memory_pipeline_rank(_memory_request(request)))


def _memory_request(request: PlanRequest) -> PlanRequest:
    """``request`` with the assumptions only its step time reads set to their defaults: the HFU
    (zeroplan.core.default_efficiency.effective_hfu), the attention rate and efficiency
    (zeroplan.core.timing, zeroplan.core.attention_efficiency) and how the memory-bound kernels
    are timed (zeroplan.core.roofline.ceilings.times_memory_bound)."""
    performance = request.performance
    update = {name: PerformanceAssumptions.model_fields[name].default for name in _TIME_ONLY_ASSUMPTIONS
              if getattr(performance, name) != PerformanceAssumptions.model_fields[name].default}
    return request.model_copy(update={"performance": performance.model_copy(update=update)}) if update else request


_TIME_ONLY_ASSUMPTIONS = ("hardware_flops_utilization", "attention_rate", "attention_efficiency", "memory_bound")
"""The PerformanceAssumptions fields no memory term reads (_memory_request)."""


# Kept per request without the assumptions only time reads (_memory_request): the fits and the
# solver ask for the same pipeline at many HFUs and under each attention rate, each a breakdown
# of every rank.
@functools.lru_cache(maxsize=1024)
def _peak_memory_pipeline_rank(request: PlanRequest) -> int:
    """The rank plan() reports: the one nearest to running out (zeroplan.core.plan.nearest_rank)."""
    from zeroplan.core.plan import nearest_rank_memory, rank_memories

    return nearest_rank_memory(rank_memories(request)).request.parallel.pipeline_rank


def solve_hfu(request: PlanRequest, measured_step_s: float) -> float:
    """The HFU in (0, 1] at which the planner's step for ``request`` (flat-HFU compute model)
    lasts ``measured_step_s``. The step does not grow with the HFU (compute shrinks, and exposed
    communication grows by at most what compute loses), so bisection finds it; where the step
    is flat (communication-bound) the smallest HFU that reaches the measured step is returned.
    A step shorter than the planner's at HFU 1 is refused in one line."""
    from zeroplan.core.communication import collectives
    from zeroplan.core.plan import pipeline_rank_requests, pipeline_step_time
    from zeroplan.core.timing import step_time

    if request.performance.compute_model != "hfu":
        raise ZeroplanError("--compute-model", "calibration solves the flat-HFU compute model (allowed: hfu)")
    at = timed_request(request)
    step_collectives = tuple(collectives(at))
    # The step plan() reports: the slowest pipeline rank's (pipeline_step_time), each rank's
    # collectives listed once (they do not depend on the HFU).
    ranks = [(rank, step_collectives if rank == at else tuple(collectives(rank))) for rank in pipeline_rank_requests(at)]

    def step_s(hfu: float) -> float:
        return max(step_time(_at_hfu(rank, hfu), listed).step_with_overlap_s for rank, listed in ranks)

    fastest = pipeline_step_time(_at_hfu(at, 1.0), step_collectives)
    if measured_step_s < fastest.step_with_overlap_s * (1 - 1e-12):
        raise ZeroplanError(
            "measured step", f"{measured_step_s:.4g} s is shorter than the planner's step at HFU 1 "
            f"({fastest.step_with_overlap_s:.4g} s, of which {fastest.compute_s:.4g} s compute and "
            f"{fastest.step_with_overlap_s - fastest.compute_s:.4g} s communication, bubble and host time): "
            "check the configuration (allowed: a step at least that long)")
    return bisect_hfu(step_s, measured_step_s, fastest.step_with_overlap_s)


NARROWING_ROUNDS = 8
"""Rounds bisect_hfu spends narrowing the bracket before it replays the bisection."""


# The answer is the bisection's, halving [0, 1] until the bracket is HFU_TOLERANCE narrow; the
# step does not grow with the HFU, so every midpoint at or below an HFU already found too slow
# is too slow and every one at or above an HFU found fast enough is fast enough: only midpoints
# strictly between the two are timed. The narrowing before it: compute is linear in 1/HFU and
# the rest of the step is either independent of it or the larger of two such lines (exposed
# communication), so the step is piecewise linear and convex in 1/HFU. The line through two
# too-slow steps then meets the measured step at an HFU that is too slow or the solution
# (convexity), the solution once both lie on its piece; a probe a quarter tolerance either side
# of it leaves a midpoint or two to time. A round that does not halve the bracket is followed
# by a bisection of it, so a step that is not convex only costs rounds, never the answer.
def bisect_hfu(step_s, measured_step_s: float, step_at_one_s: float) -> float:  # type: ignore[no-untyped-def]
    """The bisection's HFU for a step ``step_s(hfu)`` that does not grow with the HFU and whose
    value at HFU 1, ``step_at_one_s``, is at most ``measured_step_s``: the smallest HFU of the
    final HFU_TOLERANCE bracket at which the step is at most the measured one."""
    slow, fast = 0.0, 1.0  # the largest HFU timed too slow (0: none), the smallest fast enough
    timed: list[tuple[float, float]] = [(1.0, step_at_one_s)]  # (HFU, step) in the order timed
    too_slow: list[tuple[float, float]] = []
    steps = {1.0: step_at_one_s}

    def time(hfu: float) -> float:
        nonlocal slow, fast
        seconds = step_s(hfu)
        timed.append((hfu, seconds))
        steps[hfu] = seconds
        if seconds > measured_step_s:
            too_slow.append((hfu, seconds))
            slow = max(slow, hfu)
        else:
            fast = min(fast, hfu)
        return seconds

    def line_guess() -> float | None:
        # Through the last two steps too slow at least a tolerance apart; else the bracket's ends;
        # else (nothing too slow yet) the last two timed.
        pair = too_slow[-1:] + [point for point in too_slow[-2::-1] if too_slow[-1][0] - point[0] > HFU_TOLERANCE][:1]
        if len(pair) < 2 and too_slow:
            pair = [(slow, steps[slow]), (fast, steps[fast])]
        (hfu_a, seconds_a), (hfu_b, seconds_b) = pair if len(pair) == 2 else timed[-2:]
        if seconds_a == seconds_b:
            return None
        inverse = 1 / hfu_b + (measured_step_s - seconds_b) * (1 / hfu_a - 1 / hfu_b) / (seconds_a - seconds_b)
        return 1 / inverse if inverse > 0 and slow < 1 / inverse < fast else None

    time(0.5)  # the bisection's first midpoint
    width = 1.0
    for _ in range(NARROWING_ROUNDS):
        if fast - slow <= HFU_TOLERANCE:
            break
        guess = line_guess() if fast - slow <= width / 2 else None
        width = fast - slow
        if guess is None:
            time((slow + fast) / 2)
            continue
        for probe in (guess - HFU_TOLERANCE / 4, guess + HFU_TOLERANCE / 4):
            if slow < probe < fast:
                time(probe)
    low, high = 0.0, 1.0  # step_s(low) > measured >= step_s(high)
    while high - low > HFU_TOLERANCE:
        middle = (low + high) / 2
        if middle <= slow or (middle < fast and time(middle) > measured_step_s):
            low = middle
        else:
            high = middle
    return high


def planned_step(request: PlanRequest):  # type: ignore[no-untyped-def]
    """The planner's StepTime for ``request`` (as plan() times it), without its memory."""
    from zeroplan.core.communication import collectives
    from zeroplan.core.plan import pipeline_step_time

    at = timed_request(request)
    return pipeline_step_time(at, tuple(collectives(at)))


def calibrate_step(request: PlanRequest, measured_step_s: float, model: str, note: str = "") -> StepEfficiency:
    """The efficiency file of ``request`` measured at ``measured_step_s`` per optimizer step."""
    from zeroplan.core.communication import collectives, overlaps_grad_reduce
    from zeroplan.core.plan import pipeline_step_time
    from zeroplan.core.timing import COMPUTE_BASIS

    hfu = solve_hfu(request, measured_step_s)
    at = _at_hfu(timed_request(request), hfu)
    time = pipeline_step_time(at, tuple(collectives(at)))
    batch, parallel, training = request.batch, request.parallel, request.training
    return StepEfficiency(
        hardware_flops_utilization=hfu, attention_rate=request.performance.attention_rate,
        attention_efficiency=solved_attention_efficiency(request),
        attention_class=mechanism_of(request)[0], compiled_untimed=mechanism_of(request)[1],
        gpu=request.cluster.gpu.name,
        gpu_display_name=request.cluster.gpu.display_name,
        framework=training.framework,
        source=CalibrationSource(
            model=model, num_gpus=request.cluster.world_size, gpus_per_node=request.cluster.gpus_per_node,
            strategy=request.strategy.kind.value, micro_batch_size=batch.micro_batch_size, seq_len=batch.seq_len,
            grad_accum_steps=batch.grad_accum_steps, activation_checkpointing=training.activation_checkpointing.value,
            precision=training.precision.value, tp=parallel.tp, cp=parallel.cp, pp=parallel.pp,
            compile=training.compile, float8=training.float8.value if training.float8 else None,
            overlap_grad_reduce=overlaps_grad_reduce(at), overlap_param_gather=request.performance.overlap_param_gather,
            tp_comm_overlap=request.performance.tp_comm_overlap,
            measured_step_s=measured_step_s,
            measured_tokens_per_s_per_gpu=step_tokens_per_gpu(request) / measured_step_s, note=note,
        ),
        compute_basis=COMPUTE_BASIS,
        predicted_compute_s=time.compute_s,
        predicted_communication_s=time.communication_s,
        predicted_exposed_communication_s=time.exposed_communication_s,
    )


def mechanism_of(request: PlanRequest) -> tuple[str, bool, str | None]:
    """The mechanism the planner's compute efficiency is keyed by for ``request``
    (zeroplan.core.default_efficiency): its attention kernel class, whether it compiles where
    compile is not timed, and its float8 recipe (None: bf16)."""
    from zeroplan.core.default_efficiency import attention_class, compiled_untimed, float8_class

    return attention_class(request.training, request.cluster.gpu), compiled_untimed(request), float8_class(request.training)


# One measured step fixes the HFU of its own mechanism (attention kernel class x compiled or not
# x float8 recipe on its GPU). A request of another mechanism on the same GPU and stack runs
# other kernels, whose efficiency relative to the calibrated one is what the fitted default
# efficiency measures across published sources (zeroplan.core.default_efficiency: one HFU per
# GPU generation x kernel class). So the calibration is carried as a ratio to its mechanism's
# fitted HFU, never as one absolute HFU over kernels that run at different rates; where both
# resolve to the same fitted mechanism the ratio is 1 and the HFU is the solved one.
def carry_hfu(hfu: float, calibrated_mechanism_hfu: float, target_mechanism_hfu: float) -> float:
    """The HFU a calibration solved at ``hfu`` gives a request whose mechanism's fitted HFU is
    ``target_mechanism_hfu``, the calibrated mechanism's being ``calibrated_mechanism_hfu``; at most 1."""
    return min(1.0, hfu * target_mechanism_hfu / calibrated_mechanism_hfu)


def carried_hfu(efficiency: StepEfficiency, request: PlanRequest) -> float:
    """The HFU ``efficiency`` gives ``request`` (carry_hfu under the shipped default efficiency's
    mechanisms); the solved HFU for a request of the calibrated mechanism, or a file that does
    not record its mechanism."""
    if efficiency.attention_class is None or efficiency.compiled_untimed is None:
        return efficiency.hardware_flops_utilization
    target = mechanism_of(request)
    calibrated = (efficiency.attention_class, efficiency.compiled_untimed, efficiency.source.float8)
    if target == calibrated:
        return efficiency.hardware_flops_utilization
    from zeroplan.core.default_efficiency import default_table, resolve

    table = default_table()
    mechanisms = table.mechanisms[efficiency.attention_rate]
    gpu = request.cluster.gpu
    return carry_hfu(efficiency.hardware_flops_utilization, resolve(mechanisms, table.generations, gpu, *calibrated).hfu,
                     resolve(mechanisms, table.generations, gpu, *target).hfu)


def with_carried_hfu(efficiency: StepEfficiency, request: PlanRequest) -> PlanRequest:
    """``request`` timed at the HFU ``efficiency`` carries to it (carried_hfu); the attention
    efficiency the file was solved at is its own kernel's, so a request of another attention
    kernel takes its kernel's shipped one (zeroplan.core.attention_efficiency)."""
    performance = request.performance
    update: dict[str, object] = {}
    hfu = carried_hfu(efficiency, request)
    if hfu != performance.hardware_flops_utilization:
        update["hardware_flops_utilization"] = hfu
    if (efficiency.attention_class is not None and efficiency.attention_class != mechanism_of(request)[0]
            and performance.attention_efficiency is not None):
        update["attention_efficiency"] = None
    return request.model_copy(update={"performance": performance.model_copy(update=update)}) if update else request


def solved_attention_efficiency(request: PlanRequest) -> float | None:
    """Under --attention-rate kernel, the attention efficiency the request's step is timed at
    (zeroplan.core.attention_efficiency); None under the other rates, where it does not apply."""
    if request.performance.attention_rate != "kernel":
        return None
    from zeroplan.core.attention_efficiency import attention_efficiency
    from zeroplan.core.attention_rate import kernel_name

    training = request.training
    return attention_efficiency(request, kernel_name(training.attention_kernel, training.attention_implementation))


def step_tokens_per_gpu(request: PlanRequest) -> float:
    """Tokens of one optimizer step per GPU as the planner counts them (StepTime.tokens_per_s_per_gpu):
    micro-batch x accumulation x sequence over the model-parallel ranks that share them."""
    batch = request.batch
    return batch.micro_batch_size * batch.grad_accum_steps * batch.seq_len / request.parallel.model_parallel_size


def load_efficiency(path: str | Path) -> StepEfficiency:
    """The efficiency file at ``path``; a malformed one, or one of another compute basis, is one
    line naming the field."""
    import json  # only for --efficiency FILE: the time-basis line of a default fit never loads it

    from zeroplan.core.timing import COMPUTE_BASIS

    try:
        efficiency = StepEfficiency.model_validate(json.loads(Path(path).read_text(encoding="utf-8")))
    except ValidationError as error:
        raise first_error(error, prefix=f"--efficiency {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ZeroplanError("--efficiency", f"cannot read {str(path)!r}: {error}") from None
    except RecursionError:
        raise nested_too_deeply_error("--efficiency", path, "an efficiency file nests two") from None
    if efficiency.compute_basis != COMPUTE_BASIS:
        raise ZeroplanError("--efficiency", f"{str(path)!r} has compute_basis {efficiency.compute_basis} (its HFU "
                                            f"covers the memory-bound kernels too, which the planner now times apart): "
                                            f"rerun zeroplan calibrate step (allowed: compute_basis {COMPUTE_BASIS})")
    return efficiency


def check_applies(efficiency: StepEfficiency, path: str | Path, gpu_name: str, framework: Framework) -> None:
    """Refuse, in one line, a file calibrated on another GPU or another training stack."""
    if efficiency.gpu != gpu_name:
        raise ZeroplanError("--efficiency", f"{str(path)!r} was calibrated on {efficiency.gpu}, not {gpu_name} "
                                            f"(allowed: a file calibrated on {gpu_name})")
    if efficiency.framework is not framework:
        raise ZeroplanError("--efficiency", f"{str(path)!r} was calibrated on framework {efficiency.framework.value}, "
                                            f"not {framework.value} (allowed: a file of --framework {framework.value})")


# What the HFU was solved under, against what it is applied to. The collectives are priced by
# the planner under the request's own overlap flags (the HFU is compute's alone), compile's
# saved memory traffic is modelled, and so is float8 (zeroplan.core.float8_time: the converted
# products at the same HFU of the fp8 peak, the casts at the copy bandwidth), so those carry;
# float8 on a GPU the catalog has no fp8 peak for is not timed, and neither is compile where its
# traffic or the GPU's bandwidth was not measured: those must match.
def check_calibrated_under(efficiency: StepEfficiency, path: str | Path, request: PlanRequest) -> None:
    """Refuse, in one line naming the field, a file whose calibration differs from ``request`` in
    a mechanism the planner does not time."""
    from zeroplan.core.compiled_time import compile_time_note

    source, training = efficiency.source, request.training
    float8 = training.float8.value if training.float8 else None
    if source.float8 != float8 and request.cluster.gpu.peak_fp8_flops_per_s is None:
        raise ZeroplanError("--efficiency", f"{str(path)!r} was calibrated with float8 {source.float8 or 'off'}, not "
                                            f"{float8 or 'off'}, and float8 is not timed on {request.cluster.gpu.name}, which has no fp8 peak "
                                            f"in the catalog (allowed: a file calibrated "
                                            f"with float8 {float8 or 'off'})")
    if source.compile != training.compile:
        compiled = request if training.compile else request.model_copy(
            update={"training": training.model_copy(update={"compile": True})})
        note = compile_time_note(compiled)
        if note:
            raise ZeroplanError("--efficiency", f"{str(path)!r} was calibrated {'compiled' if source.compile else 'eager'}, "
                                                f"not {'compiled' if training.compile else 'eager'}, and {note} (allowed: a "
                                                f"file calibrated {'compiled' if training.compile else 'eager'})")


def calibrated_under(efficiency: StepEfficiency, request: PlanRequest) -> str:
    """'' where the request runs as the calibration did; else what differs, each modelled."""
    source, performance = efficiency.source, request.performance
    differs = []
    if source.compile != request.training.compile:
        differs.append(f"{'compiled' if source.compile else 'eager'} -> {'compiled' if request.training.compile else 'eager'}"
                       " (compile's saved memory traffic modelled)")
    float8 = request.training.float8.value if request.training.float8 else None
    if source.float8 != float8:
        differs.append(f"float8 {source.float8 or 'off'} -> {float8 or 'off'} (the float8 products at the fp8 peak, "
                       "their casts at the copy bandwidth, modelled)")
    # Left unset, each strategy's gradient reductions follow its stack's default (modelled).
    flags = (("overlap-grad-reduce", source.overlap_grad_reduce, performance.overlap_grad_reduce),
             ("overlap-param-gather", source.overlap_param_gather, performance.overlap_param_gather),
             ("tp-comm-overlap", source.tp_comm_overlap, performance.tp_comm_overlap))
    for flag, calibrated, applied in flags:
        if calibrated is not None and applied is not None and calibrated != applied:
            differs.append(f"{flag} {'on' if calibrated else 'off'} -> {'on' if applied else 'off'} (communication modelled)")
    return "; ".join(differs)
