"""pandas views of planner results (bytes stay integers; convert at display time). The answers'
``to_dataframe`` methods (zeroplan.answers) load this module lazily (pandas costs start-up
time). It sits between the results it reads (zeroplan.results) and the answers that hold them:
an answer is taken by what it holds (the protocols below), so this module never imports one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import pandas as pd

from zeroplan.core.timing import nccl_algorithms
from zeroplan.results import PlanCandidate, StrategyPlan


class HoldsPlans(Protocol):
    """A FitReport, as fit_report_frame reads it."""

    @property
    def plans(self) -> Sequence[StrategyPlan]: ...


class HoldsCandidates(Protocol):
    """A PlanSearchResult, as search_frame reads it."""

    @property
    def ranked(self) -> Sequence[PlanCandidate]: ...

    @property
    def pareto(self) -> Sequence[PlanCandidate]: ...

MEMORY_COLUMNS = (
    "parameter_bytes",
    "gradient_bytes",
    "optimizer_state_bytes",
    "activation_bytes",
    "logits_bytes",
    "temporary_bytes",
    "step_temporary_bytes",
    "peak_buffer_bytes",
    "allocator_reserve_bytes",
    "peak_bytes",
    "allocated_peak_bytes",
    "reserved_peak_bytes",
    "oom_capacity_bytes",
)
NULLABLE_BYTE_COLUMNS = ("reserved_peak_bytes", "oom_capacity_bytes")
"""The caching-allocator model's figures: absent under the flat reserve, and the OOM capacity
where the allocated peak alone passes the usable memory (kept integers, with missing values)."""


def plan_row(plan: StrategyPlan) -> dict[str, object]:
    row: dict[str, object] = {"strategy": plan.strategy.value}
    row.update({name: getattr(plan.memory, name) for name in MEMORY_COLUMNS})
    row.update(
        peak_moment=plan.memory.peak_moment.value,
        gradients_at_peak=plan.memory.gradients_at_peak,
        usable_memory_bytes=plan.usable_memory_bytes,
        fits=plan.fits,
        headroom_bytes=plan.headroom_bytes,
        micro_batch_size=plan.micro_batch_size,
        max_micro_batch_size=plan.max_micro_batch_size,
        host_bytes_per_node=plan.host_bytes_per_node,
        sent_bytes_per_step=plan.sent_bytes_per_step,
        communication_volume_elements=plan.communication_volume_elements,
    )
    row.update(_time_columns(plan), state_convention=plan.state_convention.value, shard_group_size=plan.shard_group_size,
               nccl_algorithms=None if plan.time is None else nccl_algorithms(plan.time))
    return row


TIME_COLUMNS = (
    "compute_s", "communication_s", "host_transfer_s", "cpu_optimizer_s", "optimizer_step_s",
    "model_parallel_communication_s", "pipeline_bubble_s", "exposed_communication_s",
    "step_with_overlap_s", "step_without_overlap_s", "executed_flops", "model_flops",
    "tokens_per_s_per_gpu", "model_flops_utilization",
)


def _time_columns(plan: StrategyPlan) -> dict[str, object]:
    """The step time's columns; missing values where no step time is modelled (an
    encoder-decoder: zeroplan.calibrate.basis says why), so its memory rows still frame."""
    if plan.time is None:
        return dict.fromkeys(TIME_COLUMNS, float("nan"))
    return {name: getattr(plan.time, name) for name in TIME_COLUMNS}


def fit_report_frame(report: HoldsPlans) -> pd.DataFrame:
    """One row per strategy, indexed by strategy name."""
    frame = pd.DataFrame([plan_row(p) for p in report.plans]).set_index("strategy")
    return frame.astype({name: "Int64" for name in NULLABLE_BYTE_COLUMNS})


def search_frame(result: HoldsCandidates) -> pd.DataFrame:
    """The ranked configurations, fastest first, with their layout (tp, pp, cp, dp and the
    schedule) and a column marking the Pareto rows."""

    def key(c) -> tuple:
        return (c.tp, c.sequence_parallel, c.cp, c.pp, c.pp_schedule, c.virtual_stages, c.strategy,
                c.activation_checkpointing, c.shard_group_size, c.micro_batch_size)

    pareto = {key(c) for c in result.pareto}
    rows = []
    for rank, c in enumerate(result.ranked, start=1):
        row: dict[str, object] = {"rank": rank}
        row.update(c.model_dump(mode="json"))
        row["pareto"] = key(c) in pareto
        rows.append(row)
    return pd.DataFrame(rows).set_index("rank") if rows else pd.DataFrame(columns=["rank"]).set_index("rank")
