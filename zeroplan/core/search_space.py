"""The model-parallel layouts the plan search tries (zeroplan.core.search), apart so that the
command line reads them without loading numpy."""

from __future__ import annotations

from pydantic import model_validator

from zeroplan.errors import ZeroplanError
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
    data_parallel_only_by: str = "--no-model-parallel"
    """With model_parallel False, what made the search data-parallel only (a refusal of a
    layout flag names it: the user may not have typed --no-model-parallel)."""

    @model_validator(mode="after")
    def _check(self) -> "LayoutSpace":
        # A bound or a schedule the search would not read is refused: the user expects it to act.
        if self.tp is not None and self.max_tp is not None and self.tp > self.max_tp:
            raise ZeroplanError("--max-tp", f"{self.max_tp} is below --tp {self.tp} (allowed: --tp alone, or --max-tp "
                                            f"{self.tp} or more)")
        searched = "pp_schedules" in self.model_fields_set
        if not self.model_parallel:
            for flag, given in (("--pp-schedule", searched), ("--max-tp", self.max_tp is not None)):
                if given:
                    raise ZeroplanError(flag, f"has no layout to act on with {self.data_parallel_only_by} "
                                              "(allowed: leave it out)")
        elif searched and self.pp == 1:
            raise ZeroplanError("--pp-schedule", "needs pipeline parallelism (allowed: with --pp 2 or more, or --pp left "
                                                 "out to search it)")
        return self
