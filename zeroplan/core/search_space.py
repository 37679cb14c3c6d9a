"""The model-parallel layouts the plan search tries (zeroplan.core.search), apart so that the
command line reads them without loading numpy."""

from __future__ import annotations

from zeroplan.specs.base import Frozen
from zeroplan.specs.parallel import PipelineSchedule

LONG_SEQUENCE = 32768
"""From this --seq-len on the search also tries context parallelism (cp 2 and 4): below it a
sequence's activations are small enough that tp and pp are the cheaper splits."""
CONTEXT_PARALLEL_DEGREES = (2, 4)
"""Context-parallel degrees searched for a long sequence (a bound on the search's size, not a
rule of the stacks: --cp fixes any other degree the rules accept)."""
SEARCHED_SCHEDULES = (PipelineSchedule.one_f_one_b, PipelineSchedule.interleaved_1f1b)
"""Pipeline schedules the search tries: 1F1B and interleaved 1F1B with two stages per rank
(GPipe keeps every micro-batch in flight, so 1F1B dominates it on memory at the same time)."""
INTERLEAVED_VIRTUAL_STAGES = 2
"""Stages per rank of the interleaved schedule the search tries."""


class LayoutSpace(Frozen):
    """Which model-parallel layouts the search tries. None: search that degree."""

    tp: int | None = None
    """Fix the tensor-parallel degree (None: every divisor of the GPUs per node)."""
    pp: int | None = None
    """Fix the pipeline-parallel degree (None: every divisor of the GPUs leaving a block per stage)."""
    cp: int | None = None
    """Fix the context-parallel degree (None: 1, and 2 and 4 from LONG_SEQUENCE tokens on)."""
    max_tp: int | None = None
    """Largest tensor-parallel degree searched."""
    model_parallel: bool = True
    """False: data parallelism only (tp = pp = cp = 1), the search as it was before layouts."""
    pp_schedules: tuple[PipelineSchedule, ...] = SEARCHED_SCHEDULES
    """Pipeline schedules tried for pp > 1."""
