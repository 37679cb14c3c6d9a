"""The answers to a user's two questions, as typed results: FitReport ("will it fit, and with
which strategy?", zeroplan.core.plan.fit) and PlanSearchResult ("which configuration is
fastest?", zeroplan.core.search). Each holds the lower results (zeroplan.results) and turns
itself into a pandas DataFrame through zeroplan.frames, which sits below it."""

# No postponed annotations: pydantic reads these fields' types as objects (zeroplan/specs/base.py).

from pydantic import ConfigDict, Field

from zeroplan.results import PlanCandidate, StrategyPlan
from zeroplan.specs.base import Frozen
from zeroplan.specs.hardware import ClusterSpec
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import BatchSpec, TrainingSpec


class FitReport(Frozen):
    """The answer to "will it fit?" for a set of strategies."""

    # The planner builds it unvalidated (Frozen.trusted), so its validator is built on first use
    # (a caller's validation, a JSON dump), not at each command's start.
    model_config = ConfigDict(defer_build=True)

    model: ModelSpec
    """Model asked about."""
    num_parameters: int
    """Psi, exact."""
    training: TrainingSpec
    """Numerics."""
    batch: BatchSpec
    """Batch shape."""
    cluster: ClusterSpec
    """Cluster."""
    plans: tuple[StrategyPlan, ...]
    """One per strategy, in the order asked."""
    recommended: StrategyKind | None
    """Fitting strategy with the least communication (offload only if nothing else fits)."""
    verdict: str
    """One line for a person."""
    # Excluded from JSON: the verdict already says both in words, and --format json keeps the
    # fields it always had; the compact view (zeroplan.report.summary) reads them typed.
    suggested_change: str = Field("", exclude=True)
    """When nothing fits: the flags of the smallest change that makes something fit
    (zeroplan.core.suggest); '' otherwise or when no change tried does."""
    suggested_recommendation: StrategyKind | None = Field(None, exclude=True)
    """The strategy recommended under ``suggested_change``."""
    allocator_caution: str = ""
    """Part of the verdict: where the caching-allocator model finds the recommendation's step
    running out of memory under the flat reserve, what it would reserve (core.plan.allocator_caution);
    '' otherwise."""
    compute_model: str = "hfu"
    """How the plans' compute was timed (PerformanceAssumptions.compute_model)."""
    fsdp_version: int = Field(2, exclude=True)
    """The torch FSDP the FSDP strategies were planned under: 2 (fully_shard) unless the request
    asked for FSDP1 (StrategySpec.fsdp1_root_stays_gathered, --fsdp-version 1). Excluded from
    JSON, which keeps the fields it always had; the text views name it under hf, whose
    accelerate runs either."""
    left_out: tuple[str, ...] = ()
    """Strategies of the default list that cannot apply to this request, each with the reason
    (a strategy the user named is refused instead)."""
    allocator_conf: str | None = ""
    """The PYTORCH_CUDA_ALLOC_CONF the verdict was judged under (MemoryAssumptions.allocator_conf;
    None: the flat reserve)."""
    allocator_conf_is_launch_default: bool = False
    """Whether that is the framework launcher's own setting (specs.framework.launch_allocator_conf)
    rather than one the request named."""
    step_time_basis: str = ""
    """What the step times rest on: the fitted default HFU of the request's mechanism, the flat
    HFU, --hfu as given or a calibrated efficiency file, and the error band measured for it
    (zeroplan.calibrate.basis.time_basis_line; the line the text view prints under its table).
    Filled by the command line; '' from the Python API, where time_basis_line gives it."""

    def plan_for(self, strategy: StrategyKind | str) -> StrategyPlan:
        kind = StrategyKind(strategy)
        for plan in self.plans:
            if plan.strategy is kind:
                return plan
        raise KeyError(kind.value)

    def to_dataframe(self):
        """One row per strategy, sizes in bytes (pandas is imported here, not at start-up)."""
        from zeroplan.frames import fit_report_frame

        return fit_report_frame(self)


class PlanSearchResult(Frozen):
    """The ranked configurations that fit, and the Pareto front of memory vs step time."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    global_batch_size: int
    """Sequences per optimizer step over all GPUs."""
    seq_len: int
    """Tokens per sequence."""
    num_gpus: int
    """GPUs in all (tp x cp x pp x dp)."""
    layouts_searched: int = 1
    """Model-parallel layouts (tp, cp, pp, schedule) searched."""
    groups_searched: int = 0
    """(layout, strategy, checkpointing, shard group) groups searched."""
    configurations_evaluated: int
    """Configurations searched: every (layout, strategy, checkpointing, shard group,
    micro-batch, accumulation) the search considered."""
    configurations_fitting: int
    """Of those, the ones found to fit on the GPU (and in host memory when it is given); the
    configurations_bounded_out are not among them, fitting or not."""
    configurations_bounded_out: int = 0
    """Of those, the ones left unevaluated because their group's lower bounds on peak and step
    time show none can enter the ranking or the Pareto front (zeroplan.core.search, branch and
    bound); 0 from the exhaustive search."""
    ranked: tuple[PlanCandidate, ...]
    """The fastest fitting configurations, fastest first."""
    pareto: tuple[PlanCandidate, ...]
    """Fitting configurations no other beats on both peak memory and step time, by memory."""
    best: PlanCandidate | None
    """The fastest fitting configuration (checked with the scalar planner); None if none fits."""
    explanation: str
    """One line for a person."""
    allocator_caution: str = ""
    """Part of the explanation: where the caching-allocator model finds the best
    configuration's step running out of memory under the flat reserve, what it would reserve and
    which of the others shown completes (zeroplan.core.search.allocator_caution, from each
    candidate's allocator_fits); '' otherwise."""
    step_time_basis: str = ""
    """What the step times rest on: the fitted default HFU of the request's mechanism, the flat
    HFU, --hfu as given or a calibrated efficiency file, and the error band measured for it
    (zeroplan.calibrate.basis.time_basis_line; the line the text view prints under its table).
    Filled by the command line; '' from the Python API, where time_basis_line gives it."""
    configuration_note: str = ""
    """The framework configuration whose settings the rows plan and those the search plans off
    (the note line under the text view's table, zeroplan.cli.plan.configuration_note); filled by
    the command line, '' where the configuration sets none or from the Python API."""

    def to_dataframe(self):
        from zeroplan.frames import search_frame

        return search_frame(self)
