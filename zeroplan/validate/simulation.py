"""Predicted-vs-simulated rows for fake-scale runs (``zeroplan simulate``)."""

from __future__ import annotations

from collections import defaultdict

from zeroplan.core.plan import memory_breakdown
from zeroplan.simulate.record import Phase, SimulationRecord
from zeroplan.validate.rows import COLLECTIVE_OPS, ComparisonRow, collective_rows, model_state_rows, planner_request


def compare_simulation(record: SimulationRecord) -> list[ComparisonRow]:
    """Model states and per-step collective bytes of one simulated rank against the planner."""
    request = planner_request(record.model, record.training, record.batch, record.strategy, record.world_size)
    breakdown, _ = memory_breakdown(request)
    states = record.model_states
    base = dict(
        run_id=f"simulate:{record.model.name}:{record.strategy.value}:N{record.world_size}",
        strategy=record.strategy.value, engine="torch (fake tensors)", world_size=record.world_size, rank=record.rank,
        model=record.model.name,
    )
    rows = model_state_rows(base, breakdown, (states.parameter_bytes, states.gradient_bytes, states.optimizer_state_bytes))
    measured: dict[str, int] = defaultdict(int)
    for call in record.collectives:
        if call.phase is not Phase.setup and call.kind.value in COLLECTIVE_OPS:
            measured[call.kind.value] += call.buffer_bytes
    return rows + collective_rows(base, request, measured)
