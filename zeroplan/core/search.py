"""Search strategy x activation checkpointing x micro-batch x accumulation x offload x HSDP group
for the fastest configuration that fits (docs/communication-time.md, "Plan search").

Per group (strategy, checkpointing, shard group) the scalar planner is evaluated at a few
micro-batch and accumulation values to get exact coefficients: each peak moment is affine in
the micro-batch b (separately for accumulation 1 and > 1), each phase's communication and host
time is affine in the accumulation steps a, compute is proportional to b*a. The sweep then runs
over (b, a) with numpy. Every group checks its coefficients against the scalar planner at
points it did not fit them on, and falls back to the scalar planner if they disagree; the
winner and every Pareto row are planned again with the scalar planner before they are shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from zeroplan.core.communication import Phase, collectives
from zeroplan.core.flops import step_flops
from zeroplan.core.feasibility import usable_memory_bytes
from zeroplan.core.profiles import check_framework_strategies, profile
from zeroplan.core.plan import host_memory_fits, memory_breakdown, peak_moments, peak_terms
from zeroplan.core.timing import (
    collective_time_s,
    compute_time_s,
    cpu_optimizer_time_s,
    exposed_communication_s,
    host_link_share_bytes_per_s,
    host_transfer_bytes,
    model_flops_utilization,
    step_time,
)
from zeroplan.errors import ZeroplanError
from zeroplan.results import PeakMoment
from zeroplan.specs.base import Frozen
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import ActivationCheckpointing

TIME_TOLERANCE_S = 1e-9
"""Largest difference between a vectorised and a scalar step time taken as agreement."""
BYTE_TOLERANCE = 1
"""Largest difference between a vectorised and a scalar peak taken as agreement."""


class PlanCandidate(Frozen):
    """One configuration of the search and its predicted cost on one GPU."""

    strategy: StrategyKind
    """Sharding strategy (offload variants included)."""
    activation_checkpointing: ActivationCheckpointing
    """Recomputation policy."""
    shard_group_size: int
    """Ranks a sharded state is split over (N_d; the HSDP group for hsdp)."""
    micro_batch_size: int
    """Sequences per GPU per forward/backward pass."""
    grad_accum_steps: int
    """Micro-batches per optimizer step."""
    peak_bytes: int
    """Predicted peak device memory (allocated + allocator reserve)."""
    usable_memory_bytes: int
    """GPU memory the allocator may use."""
    step_time_s: float
    """Predicted optimizer-step time with overlap (StepTime.step_with_overlap_s)."""
    tokens_per_s_per_gpu: float
    """micro_batch_size * grad_accum_steps * seq_len / step_time_s."""
    model_flops_utilization: float
    """Model FLOPs of the step over (step_time_s x peak bf16 FLOP/s) (StepTime.model_flops_utilization)."""


class PlanSearchResult(Frozen):
    """The ranked configurations that fit, and the Pareto front of memory vs step time."""

    global_batch_size: int
    """Sequences per optimizer step over all GPUs."""
    seq_len: int
    """Tokens per sequence."""
    num_gpus: int
    """Data-parallel ranks."""
    configurations_evaluated: int
    """Configurations whose memory and step time were predicted."""
    configurations_fitting: int
    """Of those, the ones that fit on the GPU (and in host memory when it is given)."""
    ranked: tuple[PlanCandidate, ...]
    """The fastest fitting configurations, fastest first."""
    pareto: tuple[PlanCandidate, ...]
    """Fitting configurations no other beats on both peak memory and step time, by memory."""
    best: PlanCandidate | None
    """The fastest fitting configuration (checked with the scalar planner); None if none fits."""
    explanation: str
    """One line for a person."""

    def to_dataframe(self):
        from zeroplan.frames import search_frame

        return search_frame(self)


@dataclass
class _Group:
    """One (strategy, checkpointing, shard group) and its exact coefficients."""

    request: PlanRequest
    usable_bytes: int
    moment_intercepts: dict[bool, np.ndarray] = field(default_factory=dict)
    moment_slopes: dict[bool, np.ndarray] = field(default_factory=dict)
    host_fits: dict[bool, bool] = field(default_factory=dict)
    forward_s_per_micro: float = 0.0
    backward_s_per_micro: float = 0.0
    model_flops_per_micro: float = 0.0
    """Model FLOPs (PaLM's MFU count) of one micro-batch of one sequence."""
    cpu_optimizer_s: float = 0.0
    """Offload's CPU optimizer step (zeroplan.core.timing.cpu_optimizer_time_s), per step."""
    phase_intercepts_s: np.ndarray | None = None
    phase_slopes_s: np.ndarray | None = None
    scalar_only: bool = False
    cache: dict[tuple[int, int], tuple[int, bool, float]] = field(default_factory=dict)


def _at(request: PlanRequest, micro: int, accum: int) -> PlanRequest:
    batch = request.batch.model_copy(update={"micro_batch_size": micro, "grad_accum_steps": accum})
    return request.model_copy(update={"batch": batch})


def scalar_evaluate(request: PlanRequest) -> tuple[int, bool, float]:
    """(peak bytes, fits on GPU and host, step time with overlap) from the scalar planner."""
    breakdown, states = memory_breakdown(request)
    fits = breakdown.peak_bytes <= usable_memory_bytes(request) and host_memory_fits(request, states.host_bytes) is not False
    time = step_time(request, tuple(collectives(request)))
    return breakdown.peak_bytes, fits, time.step_with_overlap_s


def _moments(request: PlanRequest) -> tuple[np.ndarray, int]:
    """The four peak moments, and the host bytes each rank offloads."""
    states, terms = peak_terms(request)
    alive = peak_moments(states, terms, request.batch.grad_accum_steps)
    totals = [bytes_.total for moment, bytes_ in alive.items() if moment is not PeakMoment.loss_backward]
    # The loss's moment, once per piece of the loss (PeakTerms.logits_pieces): each is affine
    # in the micro-batch, their maximum is not.
    loss = alive[PeakMoment.loss_backward].total
    totals += [loss - terms.logits + piece for piece in terms.logits_pieces or (terms.logits,)]
    return np.array(totals, dtype=np.int64), states.host_bytes


_PHASES = tuple(Phase)


def _phase_seconds(request: PlanRequest) -> np.ndarray:
    """Per phase: collective seconds, then host-link seconds (2 x len(Phase) values)."""
    comm = {phase: 0.0 for phase in Phase}
    for collective in collectives(request):
        comm[collective.phase] += collective_time_s(request, collective)
    link = host_link_share_bytes_per_s(request)
    host = host_transfer_bytes(request)
    return np.array([comm[p] for p in _PHASES] + [host[p] / link for p in _PHASES], dtype=np.float64)


def _phase_coefficients(request: PlanRequest) -> tuple[np.ndarray, np.ndarray]:
    """(intercepts, slopes) of each phase's seconds in the accumulation steps."""
    p1, p2 = _phase_seconds(_at(request, 1, 1)), _phase_seconds(_at(request, 1, 2))
    return p1 - (p2 - p1), p2 - p1


def _build_group(request: PlanRequest, phases: tuple[np.ndarray, np.ndarray] | None = None) -> _Group:
    """``phases``: coefficients from a group of the same strategy and shard group (the
    collectives do not depend on checkpointing; the check below would catch it if they did)."""
    group = _Group(request=request, usable_bytes=usable_memory_bytes(request))
    for accumulating in (False, True):
        accum = 2 if accumulating else 1
        (one, host_bytes), (two, _) = _moments(_at(request, 1, accum)), _moments(_at(request, 2, accum))
        group.moment_slopes[accumulating] = two - one
        group.moment_intercepts[accumulating] = one - (two - one)
        group.host_fits[accumulating] = host_memory_fits(request, host_bytes) is not False
    one_pass = step_flops(_at(request, 1, 1))
    group.forward_s_per_micro, group.backward_s_per_micro = compute_time_s(one_pass, request)
    group.model_flops_per_micro = one_pass.model_flops
    # Offload's CPU optimizer step: one per optimizer step, whatever the micro-batch.
    group.cpu_optimizer_s = cpu_optimizer_time_s(request)
    group.phase_intercepts_s, group.phase_slopes_s = phases if phases is not None else _phase_coefficients(request)
    # liger's chunk is a power of two in b*s (frameworks.fused_linear_cross_entropy_chunk_rows),
    # so its loss moments are not affine in the micro-batch: the scalar planner only.
    if request.training.fused_linear_cross_entropy:
        group.scalar_only = True
        return group
    # Check the coefficients where they were not fitted; disagreement: scalar planner only.
    for micro, accum in ((5, 3),):
        peak, _, seconds = _vectorised(group, np.array([micro]), np.array([accum]))
        scalar_peak, _, scalar_s = scalar_evaluate(_at(request, micro, accum))
        if abs(int(peak[0]) - scalar_peak) > BYTE_TOLERANCE or abs(float(seconds[0]) - scalar_s) > TIME_TOLERANCE_S:
            group.scalar_only = True
            break
    return group


def _vectorised(group: _Group, micro: np.ndarray, accum: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(peak bytes, fits, step seconds) for arrays of micro-batch and accumulation steps."""
    accumulating = accum > 1
    micro64 = micro.astype(np.int64)
    allocated = np.zeros(micro.shape, dtype=np.int64)
    host_ok = np.ones(micro.shape, dtype=bool)
    for flag in (False, True):
        rows = accumulating == flag
        moments = group.moment_intercepts[flag][:, None] + group.moment_slopes[flag][:, None] * micro64[None, rows]
        allocated[rows] = moments.max(axis=0)
        host_ok[rows] = group.host_fits[flag]
    # int(allocated * fraction) truncates toward zero, as astype does.
    reserve = (allocated.astype(np.float64) * group.request.assumptions.allocator_reserve_fraction).astype(np.int64)
    peak = allocated + reserve
    fits = (peak <= group.usable_bytes) & host_ok
    passes = (micro * accum).astype(np.float64)
    forward_s = group.forward_s_per_micro * passes
    backward_s = group.backward_s_per_micro * passes
    phases = group.phase_intercepts_s[:, None] + group.phase_slopes_s[:, None] * accum.astype(np.float64)[None, :]
    n = len(_PHASES)
    comm = dict(zip(_PHASES, phases[:n]))
    host = dict(zip(_PHASES, phases[n:]))
    exposed = exposed_communication_s(forward_s, backward_s, comm, host, maximum=np.maximum)
    return peak, fits, forward_s + backward_s + exposed + group.cpu_optimizer_s


def evaluate(group: _Group, micro: np.ndarray, accum: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(peak bytes, fits, step seconds): vectorised, or the scalar planner where it must."""
    if not group.scalar_only:
        return _vectorised(group, micro, accum)
    peaks, fits, seconds = [], [], []
    for b, a in zip(micro.tolist(), accum.tolist()):
        if (b, a) not in group.cache:
            group.cache[(b, a)] = scalar_evaluate(_at(group.request, b, a))
        peak, fit, s = group.cache[(b, a)]
        peaks.append(peak), fits.append(fit), seconds.append(s)
    return np.array(peaks, dtype=np.int64), np.array(fits, dtype=bool), np.array(seconds, dtype=np.float64)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _shard_groups(kind: StrategyKind, world: int) -> list[int | None]:
    """HSDP: every group size that divides the GPUs, strictly between 1 and all of them."""
    if kind is not StrategyKind.hsdp:
        return [None]
    return [d for d in divisors(world) if 1 < d < world]


def groups(base: PlanRequest, strategies: tuple[StrategyKind, ...] | None = None) -> list[_Group]:
    """Every (strategy, checkpointing, shard group) the request's framework runs."""
    framework = base.training.framework
    prof = profile(framework)
    kinds = prof.strategies if strategies is None else strategies
    check_framework_strategies(framework, kinds)
    result = []
    for kind in kinds:
        for shard in _shard_groups(kind, base.cluster.world_size):
            strategy = base.strategy.model_copy(update={"kind": kind, "shard_group_size": shard})
            phases = None
            for policy in prof.checkpointing:
                if policy is ActivationCheckpointing.selective_layer and base.training.selective_layer_interval > base.model.num_layers:
                    continue  # it would checkpoint no block: the same as none
                training = base.training.model_copy(update={"activation_checkpointing": policy})
                request = base.model_copy(update={"training": training}).with_strategy(strategy)
                group = _build_group(request, phases)
                phases = group.phase_intercepts_s, group.phase_slopes_s
                result.append(group)
    return result


def batch_splits(global_batch_size: int, data_parallel_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (micro-batch, accumulation) with micro * accum * ranks == the global batch."""
    if global_batch_size % data_parallel_size:
        raise ZeroplanError(
            "global-batch",
            f"{global_batch_size} is not a multiple of the {data_parallel_size} data-parallel ranks "
            f"(allowed: multiples of {data_parallel_size})",
        )
    per_rank = global_batch_size // data_parallel_size
    micro = np.array(divisors(per_rank), dtype=np.int64)
    return micro, per_rank // micro


def _candidate(group: _Group, micro: int, accum: int, peak: int, seconds: float) -> PlanCandidate:
    r = group.request
    return PlanCandidate(
        strategy=r.strategy.kind, activation_checkpointing=r.training.activation_checkpointing,
        shard_group_size=r.shard_group_size, micro_batch_size=micro, grad_accum_steps=accum,
        peak_bytes=peak, usable_memory_bytes=group.usable_bytes, step_time_s=seconds,
        tokens_per_s_per_gpu=micro * accum * r.batch.seq_len / seconds,
        model_flops_utilization=model_flops_utilization(
            group.model_flops_per_micro * micro * accum, seconds, r.cluster.gpu.peak_bf16_flops_per_s,
        ),
    )


def _verified(group: _Group, micro: int, accum: int) -> PlanCandidate | None:
    """The scalar planner's answer for one configuration (None if it does not fit)."""
    peak, fits, seconds = scalar_evaluate(_at(group.request, micro, accum))
    return _candidate(group, micro, accum, peak, seconds) if fits else None


def pareto_indices(peak: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats on both peak and time, by increasing peak."""
    order = np.lexsort((seconds, peak))
    front, best = [], np.inf
    for i in order.tolist():
        if seconds[i] < best:
            front.append(i)
            best = seconds[i]
    return np.array(front, dtype=np.int64)


def search(
    base: PlanRequest, global_batch_size: int, strategies: tuple[StrategyKind, ...] | None = None, top: int = 10
) -> PlanSearchResult:
    """Rank every fitting configuration of ``base`` at ``global_batch_size`` by step time."""
    micro, accum = batch_splits(global_batch_size, base.data_parallel_size)
    all_groups = groups(base, strategies)
    index, micros, accums, peaks, fits, seconds = [], [], [], [], [], []
    for g, group in enumerate(all_groups):
        peak, fit, s = evaluate(group, micro, accum)
        index.append(np.full(micro.shape, g)), micros.append(micro), accums.append(accum)
        peaks.append(peak), fits.append(fit), seconds.append(s)
    index_a, micro_a, accum_a = np.concatenate(index), np.concatenate(micros), np.concatenate(accums)
    peak_a, fit_a, seconds_a = np.concatenate(peaks), np.concatenate(fits), np.concatenate(seconds)
    fitting = np.flatnonzero(fit_a)
    # Fastest first; among equal times the smaller peak.
    order = fitting[np.lexsort((peak_a[fitting], seconds_a[fitting]))]

    def verified(i: int) -> PlanCandidate | None:
        """The scalar planner's answer, or None when it disagrees with the sweep."""
        candidate = _verified(all_groups[int(index_a[i])], int(micro_a[i]), int(accum_a[i]))
        if candidate is None:
            return None
        if abs(candidate.peak_bytes - int(peak_a[i])) > BYTE_TOLERANCE or abs(candidate.step_time_s - float(seconds_a[i])) > TIME_TOLERANCE_S:
            return None
        return candidate

    front = fitting[pareto_indices(peak_a[fitting], seconds_a[fitting])] if len(fitting) else fitting
    ranked = tuple(verified(i) for i in order[:top].tolist())
    pareto = tuple(verified(i) for i in front.tolist())
    if any(c is None for c in ranked + pareto):
        # The vectorised sweep and the scalar planner disagree: rank with the scalar one.
        for group in all_groups:
            group.scalar_only = True
        return search_with_groups(base, global_batch_size, all_groups, micro, accum, top)
    best = ranked[0] if ranked else None
    return PlanSearchResult(
        global_batch_size=global_batch_size, seq_len=base.batch.seq_len, num_gpus=base.cluster.world_size,
        configurations_evaluated=len(index_a), configurations_fitting=len(fitting), ranked=ranked,
        pareto=pareto, best=best, explanation=explain(best, ranked, len(index_a), global_batch_size),
    )


def search_with_groups(
    base: PlanRequest, global_batch_size: int, all_groups: list[_Group], micro: np.ndarray, accum: np.ndarray, top: int
) -> PlanSearchResult:
    """The same ranking with every group on the scalar planner."""
    rows = []
    for group in all_groups:
        peak, fit, s = evaluate(group, micro, accum)
        rows += [(s[k], group, int(micro[k]), int(accum[k]), int(peak[k])) for k in range(len(micro)) if fit[k]]
    rows.sort(key=lambda r: (r[0], r[4]))
    candidates = [_candidate(g, b, a, p, s) for s, g, b, a, p in rows]
    ranked = tuple(candidates[:top])
    if candidates:
        front = pareto_indices(np.array([c.peak_bytes for c in candidates]), np.array([c.step_time_s for c in candidates]))
        pareto = tuple(candidates[i] for i in front.tolist())
    else:
        pareto = ()
    best = ranked[0] if ranked else None
    evaluated = len(all_groups) * len(micro)
    return PlanSearchResult(
        global_batch_size=global_batch_size, seq_len=base.batch.seq_len, num_gpus=base.cluster.world_size,
        configurations_evaluated=evaluated, configurations_fitting=len(candidates), ranked=ranked,
        pareto=pareto, best=best, explanation=explain(best, ranked, evaluated, global_batch_size),
    )


def explain(best: PlanCandidate | None, ranked: tuple[PlanCandidate, ...], evaluated: int, global_batch_size: int) -> str:
    if best is None:
        return (
            f"Nothing fits: none of the {evaluated} configurations at global batch {global_batch_size} "
            f"fits on the GPU (try more GPUs, a shorter --seq-len or a smaller model)."
        )
    runner = next((c for c in ranked[1:] if c.strategy is not best.strategy), None)
    than = ""
    if runner is not None:
        gain = runner.step_time_s / best.step_time_s - 1
        than = (
            f", {gain:.1%} faster than the best {runner.strategy.value}" if gain >= 0.0005
            else f", tied on time with {runner.strategy.value} ({runner.peak_bytes / 2**30:.1f} GiB)"
        )
    return (
        f"Best: {best.strategy.value}, activation checkpointing {best.activation_checkpointing.value}, "
        f"micro-batch {best.micro_batch_size} x {best.grad_accum_steps} accumulation: "
        f"{best.step_time_s:.3f} s per step, {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
        f"{best.peak_bytes / 2**30:.1f} GiB of {best.usable_memory_bytes / 2**30:.1f} GiB usable{than}."
    )
