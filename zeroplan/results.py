"""Typed results of the planner. Every size is an integer number of bytes."""

# No postponed annotations: pydantic reads these fields' types as objects (zeroplan/specs/base.py).

from enum import Enum

from pydantic import ConfigDict, Field, model_serializer

from zeroplan.core.communication import Collective
from zeroplan.core.margin import PeakErrorBand, borderline_by_band
from zeroplan.core.timing import StepTime
from zeroplan.specs.base import Frozen
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import ActivationCheckpointing, StateConvention


class PeakMoment(str, Enum):
    """The moment of a step whose live bytes set the peak (docs/memory-model.md, "Peak")."""

    loss_backward = "loss-backward"
    """Backward of the loss: every activation, the logits and the loss's fp32 copies."""
    block_backward = "block-backward"
    """The first block's backward: activations, the unit gathered or reduced, the workspace."""
    first_layer_backward = "first-layer-backward"
    """The first layer's backward, the last block's to run, under FSDP full sharding without
    accumulation: one block's activations left, every later unit's gradient shard made."""
    backward_end = "backward-end"
    """End of backward: every gradient and the last unit's buffers."""
    optimizer_step = "optimizer-step"
    """The optimizer step: gradients and the step's temporaries, activations freed."""
    checkpoint_save = "save"
    """A checkpoint save after the step (zeroplan.core.checkpoint_save): the model states the step
    leaves, the units the save gathers and the chunks it keeps on the device."""


class MemoryBreakdown(Frozen):
    """Device memory of one GPU. ``peak_bytes`` is not the plain sum: see docs/memory-model.md
    ("Peak"): gradients fill while activations free, and the optimizer step runs after both."""

    # The planner builds it unvalidated (Frozen.trusted), so its validator is built on first use
    # (a caller's validation, a JSON dump), not at each command's start.
    model_config = ConfigDict(defer_build=True)

    parameter_bytes: int
    """Parameters resident between steps (sharded at ZeRO-3/FSDP)."""
    gradient_bytes: int
    """Gradients kept after backward (sharded from ZeRO-2 on; fp32 copies included)."""
    optimizer_state_bytes: int
    """Optimizer states and fp32 master weights (sharded from ZeRO-1 on)."""
    paged_optimizer_bytes: int = 0
    """Optimizer states a paged optimizer keeps in CUDA managed memory (TrainingSpec.paged_optimizer):
    not in optimizer_state_bytes nor in the peak, which count the caching allocator's bytes."""
    activation_bytes: int
    """Activations saved for backward by one micro-batch."""
    logits_bytes: int
    """Logits and the loss's fp32 copies and gradient."""
    temporary_bytes: int
    """Communication buffers (DDP buckets, ZeRO reduce bucket, gathered ZeRO-3/FSDP units and
    prefetch) and backward workspace."""
    step_temporary_bytes: int
    """Temporaries of the optimizer step (after activations are freed)."""
    peak_moment: PeakMoment
    """The moment whose live bytes are the allocated peak (the first of the four on a tie)."""
    gradients_at_peak: bool
    """Whether ``gradient_bytes`` are alive at ``peak_moment``: always at the end of backward and
    the step, in backward only when earlier micro-batches' gradients are accumulating."""
    peak_buffer_bytes: int
    """Buffers and backward workspace alive at ``peak_moment`` (a part of ``temporary_bytes``)."""
    peak_gradient_bytes: int | None = None
    """Gradients alive at ``peak_moment`` where that is neither ``gradient_bytes`` nor nothing:
    the shards reduced by the first layer's backward, what earlier micro-batches leave under
    DeepSpeed's convention, the gradients a framework keeps unreduced at a block's backward.
    None: ``gradient_bytes`` where ``gradients_at_peak``, else 0."""
    peak_activation_bytes: int | None = None
    """Activations alive at ``peak_moment`` where that is neither ``activation_bytes`` nor
    nothing: at the first layer's backward, the blocks' shares left. None: ``activation_bytes``
    at the loss's and a block's backward, else 0."""
    allocated_peak_bytes: int
    """Peak bytes held by tensors."""
    allocator_reserve_bytes: int
    """What the caching allocator reserves beyond that (MemoryAssumptions)."""
    peak_bytes: int
    """Peak device memory: allocated peak plus allocator reserve."""
    allocator_modelled: bool = False
    """The caching-allocator model answered (MemoryAssumptions.allocator_conf): the reserve is
    what its replay reserves beyond the allocated peak; False under the flat reserve."""
    reserved_peak_bytes: int | None = None
    """With the caching-allocator model, what the step reserves at its peak
    (torch.cuda.max_memory_reserved): on the usable memory where it completes there, at most
    that memory even where the allocator had to free its cache; without a device limit where it
    runs out. ``peak_bytes`` is then this. None under the flat reserve, and where the allocated
    peak alone passes the usable memory (nothing replayed: ``peak_bytes`` is then the least the
    step needs)."""
    oom_capacity_bytes: int | None = None
    """With the caching-allocator model and MemoryAssumptions.exact_capacity: the least memory,
    on the verdict's side of the usable memory, on which the step completes under the
    allocator's retry rules (bisected over replays). None otherwise."""
    varying_length_reserve_bytes: int = 0
    """Of ``allocator_reserve_bytes``: what an epoch of micro-batches of varying length
    (BatchSpec.varying_lengths) leaves cached beyond the one step at seq_len, in expectation
    (zeroplan.allocator.varying_lengths); 0 where every micro-batch is seq_len tokens."""
    lazy_state_segment_bytes: int = 0
    """Where the step fits: the segment of its largest request that a run may need beyond it, in
    the orders of an epoch's lengths where the gradients or optimizer states the loop makes inside
    the epoch take (split or fill) one, and that the usable memory cannot hold (zeroplan.allocator.lazy_states): the
    verdict is then borderline. 0 where that cannot happen (not part of ``peak_bytes``)."""

    # A breakdown without varying lengths dumps as it did before the field existed.
    @model_serializer(mode="wrap")
    def _without_unset_varying(self, handler):
        dumped = handler(self)
        if isinstance(dumped, dict):
            for name in ("varying_length_reserve_bytes", "lazy_state_segment_bytes"):
                if not getattr(self, name):
                    dumped.pop(name, None)
            # Where the plain fields say what is alive at the peak, it dumps as it did before these existed.
            for name in ("peak_gradient_bytes", "peak_activation_bytes"):
                if getattr(self, name) is None:
                    dumped.pop(name, None)
        return dumped

    @property
    def peak_is_least(self) -> bool:
        """The peak is the allocated peak alone, what the step needs at the least: the
        allocator model replays nothing where that passes the usable memory."""
        return self.allocator_modelled and self.reserved_peak_bytes is None

    def peak_terms(self) -> dict[str, int]:
        """The byte fields alive at ``peak_moment`` (buffers as ``peak_buffer_bytes``) and the
        reserve: their values add up to ``peak_bytes`` exactly."""
        moment = self.peak_moment
        terms = {"parameter_bytes": self.parameter_bytes, "optimizer_state_bytes": self.optimizer_state_bytes}
        if self.peak_gradient_bytes is not None:
            terms["gradient_bytes"] = self.peak_gradient_bytes
        elif self.gradients_at_peak:
            terms["gradient_bytes"] = self.gradient_bytes
        if self.peak_activation_bytes is not None:
            terms["activation_bytes"] = self.peak_activation_bytes
        elif moment in (PeakMoment.loss_backward, PeakMoment.block_backward):
            terms["activation_bytes"] = self.activation_bytes
        if moment is PeakMoment.loss_backward:
            terms["logits_bytes"] = self.logits_bytes
        if moment is PeakMoment.optimizer_step:
            terms["step_temporary_bytes"] = self.step_temporary_bytes
        terms["peak_buffer_bytes"] = self.peak_buffer_bytes
        terms["allocator_reserve_bytes"] = self.allocator_reserve_bytes
        return terms


class StrategyPlan(Frozen):
    """The answer for one strategy."""

    # The planner builds it unvalidated (Frozen.trusted), so its validator is built on first use
    # (a caller's validation, a JSON dump), not at each command's start.
    model_config = ConfigDict(defer_build=True)

    strategy: StrategyKind
    """Strategy planned."""
    state_convention: StateConvention
    """Byte layout of model states used."""
    shard_group_size: int
    """Ranks a sharded state is split over (N_d)."""
    micro_batch_size: int
    """Micro-batch the memory is given for."""
    memory: MemoryBreakdown
    """Per-GPU memory."""
    usable_memory_bytes: int
    """GPU memory left for the allocator (memory minus CUDA context)."""
    fits: bool
    """Whether peak_bytes <= usable_memory_bytes (and load_gpu_bytes, where planned)."""
    headroom_bytes: int
    """usable_memory_bytes - peak_bytes (negative when it does not fit)."""
    max_micro_batch_size: int | None
    """Largest micro-batch that fits (0: not even 1); None where it was not searched (the fits
    fit's suggestions try, whose tables are not shown)."""
    host_bytes_per_rank: int
    """Model states offloaded to host memory, per GPU, and the checkpointed block inputs
    DeepSpeed's cpu_checkpointing keeps there; or, where more, what the rank holds at load
    (load_host_bytes_per_node)."""
    host_bytes_per_node: int
    """Host memory the offloaded states (and host-kept checkpoints) need on each node, or the
    load's where more."""
    host_fits: bool | None
    """Whether that fits the node's host memory (and, under the NVMe strategies, the swap files
    the node's NVMe capacity); None when neither is given."""
    # The two load fields are left out of the JSON where the load is not planned, so the answers
    # of every request that does not name a whole-model load dump as before they existed.
    load_gpu_bytes: int | None = Field(default=None, exclude_if=lambda value: value is None)
    """The whole module DeepSpeed's engine moves onto each GPU at load before ZeRO-3 partitions
    it (TrainingSpec.model_load full-per-rank; zeroplan.core.model_load); ``fits`` requires it
    within usable_memory_bytes as well. None where the load holds nothing whole."""
    load_host_bytes_per_node: int | None = Field(default=None, exclude_if=lambda value: value is None)
    """What a node's ranks hold in host memory at load, each the whole model from_pretrained
    built; host_bytes_per_node is the larger of it and the step's. None as load_gpu_bytes."""
    nvme_bytes_per_rank: int = 0
    """zero3-nvme / zero3-param-nvme: the states one GPU's rank keeps on NVMe (zeroplan.core.nvme)."""
    collectives: tuple[Collective, ...]
    """Collectives of one optimizer step."""
    sent_bytes_per_step: int
    """Bytes one GPU sends per optimizer step under ring collectives."""
    communication_volume_elements: int
    """Per-step volume in elements of what the engine sends, counted as the ZeRO paper does
    (sec. 7.2.1: an all-reduce twice its buffer): 2*Psi for DDP, 3*Psi for ZeRO-3 and for
    DeepSpeed's ZeRO-1/2 (all-reduce plus all-gather), per micro-batch where it repeats."""
    time: StepTime | None
    """Compute, communication and step time of one optimizer step, under a pipeline the slowest
    rank's (core.plan.pipeline_step_time: every rank waits for it), which need not be the rank
    the memory figures are for; None only where the plan was made untimed (plan(timed=False):
    the verdicts fit() forms for a suggestion, not shown)."""
    parallel: ParallelSpec = ParallelSpec()
    """The tensor, context and pipeline layout; its pipeline_rank is the rank planned above,
    the one nearest to running out, each on its own usable memory (core.plan.nearest_rank)."""
    pipeline_rank_peak_bytes: tuple[int, ...] = ()
    """Each pipeline rank's peak_bytes, rank 0 first (empty without pipeline parallelism)."""
    borderline: bool = False
    """The usable memory lies within the published runs' error band around the peak
    (zeroplan.core.margin): the measured error alone could turn ``fits`` either way; or, under
    the caching-allocator model, the step goes the other way on a memory within that band's
    reach of the usable one (borderline_capacity_bytes); or a fit whose run may need one more
    segment than its step (MemoryBreakdown.lazy_state_segment_bytes)."""
    borderline_capacity_bytes: int | None = None
    """Where the caching-allocator model finds the step going the other way than on the usable
    memory (completing where it runs out there, running out where it completes) on a memory the
    measured error alone could make it meet (the usable memory over the band's high to over its
    low): the least such memory. A refused cudaMalloc frees the cache and the request is retried,
    and when in the step that comes decides how the rest packs, so completion is not monotone in
    the memory (docs/memory-model.md, "The caching allocator"). None otherwise."""
    peak_rank_reason: str = ""
    """Why the planned rank peaks: its stages, blocks and micro-batches in flight (empty
    without pipeline parallelism)."""

    @property
    def runs_out_at_load(self) -> bool:
        """The whole module DeepSpeed's engine moves onto the GPU at load does not fit it
        (load_gpu_bytes), whatever the step needs."""
        return self.load_gpu_bytes is not None and self.load_gpu_bytes > self.usable_memory_bytes

    @property
    def load_sets_host_peak(self) -> bool:
        """The node's host-memory peak is the load's (load_host_bytes_per_node), not the step's."""
        return self.load_host_bytes_per_node is not None and self.load_host_bytes_per_node == self.host_bytes_per_node

    @property
    def borderline_by_split_segment(self) -> bool:
        """A fit borderline because its run may need one more segment than its step
        (MemoryBreakdown.lazy_state_segment_bytes), whatever the error band says."""
        return self.borderline and self.fits and self.memory.lazy_state_segment_bytes > 0

    def borderline_by_band(self, band: PeakErrorBand) -> bool:
        """Borderline by ``band``, the published runs' error band (or the caching allocator's
        turn within its reach), whether or not by the segment above too."""
        return self.borderline and borderline_by_band(self.memory.peak_bytes, self.usable_memory_bytes, band,
                                                      self.borderline_capacity_bytes, self.memory.allocated_peak_bytes)


class PlanCandidate(Frozen):
    """One configuration of the search and its predicted cost on one GPU."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    strategy: StrategyKind
    """Sharding strategy (offload variants included)."""
    activation_checkpointing: ActivationCheckpointing
    """Recomputation policy."""
    shard_group_size: int
    """Ranks a sharded state is split over (N_d; the HSDP group for hsdp)."""
    micro_batch_size: int
    """Sequences per data-parallel rank per forward/backward pass."""
    grad_accum_steps: int
    """Micro-batches per optimizer step (under a pipeline: the micro-batches it flows)."""
    peak_bytes: int
    """Predicted peak device memory (allocated + allocator reserve; the pipeline rank nearest to
    running out, as plan reports it)."""
    usable_memory_bytes: int
    """GPU memory the allocator may use (on that pipeline rank)."""
    step_time_s: float
    """Predicted optimizer-step time with overlap (StepTime.step_with_overlap_s)."""
    tokens_per_s_per_gpu: float
    """micro_batch_size * grad_accum_steps * seq_len / (tp * cp * pp) / step_time_s."""
    model_flops_utilization: float
    """Model FLOPs of the step over (step_time_s x peak bf16 FLOP/s) (StepTime.model_flops_utilization)."""
    allocator_fits: bool | None = None
    """Whether the step completes in a replay of the caching-allocator model on the usable
    memory, every pipeline rank (the search ranks on the flat reserve, then asks the model about
    each configuration it reports); None where it was not asked."""
    allocator_peak_bytes: int | None = None
    """What that replay reserves at the peak (the pipeline rank that peaks; without a limit
    where the step runs out; the allocated peak where that alone passes the usable memory)."""
    compute_s: float | None = None
    """Of the step time: the GPU's compute (StepTime.compute_s; None where only the sweep's
    total is known)."""
    exposed_communication_s: float | None = None
    """Of the step time: collectives compute does not hide (StepTime.exposed_communication_s)."""
    host_transfer_s: float | None = None
    """Offload's host-link seconds (StepTime.host_transfer_s, partly hidden behind compute)."""
    cpu_optimizer_s: float | None = None
    """Offload's optimizer step on the host CPU (StepTime.cpu_optimizer_s)."""
    optimizer_step_s: float | None = None
    """The optimizer step on the GPU (StepTime.optimizer_step_s: a memory-bound pass at the copy
    bandwidth; 0 on a GPU without a measured bandwidth or with the optimizer on the host)."""
    model_parallel_communication_s: float | None = None
    """Of the step time: the tensor-, context- and pipeline-parallel collectives compute waits
    on (StepTime.model_parallel_communication_s)."""
    pipeline_bubble_s: float | None = None
    """Of the step time: the pipeline schedule's idle time (StepTime.pipeline_bubble_s)."""
    tp: int = 1
    """Tensor-parallel degree."""
    sequence_parallel: bool = False
    """Sequence parallelism over the tp ranks (on whenever tp > 1 in the search)."""
    cp: int = 1
    """Context-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    pp_schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    """Pipeline schedule (read only with pp > 1)."""
    virtual_stages: int = 1
    """Stages per pipeline rank."""
    dp: int
    """Data-parallel degree: GPUs / (tp x cp x pp)."""

    @property
    def parallel(self) -> ParallelSpec:
        return ParallelSpec(tp=self.tp, sequence_parallel=self.sequence_parallel, cp=self.cp, pp=self.pp,
                            pp_schedule=self.pp_schedule, virtual_stages=self.virtual_stages)
