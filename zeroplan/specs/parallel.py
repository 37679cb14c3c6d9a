"""Model-parallel dimensions composed with data parallelism: tensor (and sequence), context and
pipeline parallelism, laid out as torchtitan's ParallelDims and Megatron-LM lay them out.

The world is pp x dp x cp x tp ranks (torchtitan 0.3.0 distributed/parallel_dims.py builds its
mesh as ["pp", "dp_replicate", "dp_shard", "cp", "tp"], tp innermost; Megatron-LM
core/parallel_state.py orders tp-cp-dp-pp the same way, tp fastest). The data-parallel
strategy (DDP, ZeRO, FSDP) runs over the dp ranks; FSDP shards over dp x cp, since context
parallel ranks hold the same parameters (torchtitan's "fsdp" mesh is dp_shard x cp).
"""

# No postponed annotations: pydantic reads these fields' types as objects (zeroplan/specs/base.py).

from enum import Enum

from pydantic import Field, model_serializer, model_validator

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen


class PipelineSchedule(str, Enum):
    """How the micro-batches of one step flow through the pipeline stages."""

    gpipe = "gpipe"
    """All forwards, then all backwards (Huang et al. 2019, GPipe; torch.distributed.pipelining
    ScheduleGPipe): every stage keeps all m micro-batches' activations."""
    one_f_one_b = "1f1b"
    """One forward, one backward after a warm-up (Narayanan et al. 2021, PipeDream-Flush;
    Schedule1F1B): rank r keeps at most min(pp - r, m) micro-batches."""
    interleaved_1f1b = "interleaved-1f1b"
    """1F1B over v model chunks per rank (Narayanan et al. 2021, sec. 2.2;
    ScheduleInterleaved1F1B): the bubble shrinks v-fold, rank 0 keeps more chunks."""
    looped_bfs = "looped-bfs"
    """Breadth-first over v looped stages per rank (Lamy-Poirier 2023; ScheduleLoopedBFS):
    every micro-batch through a rank's first stage before its next."""
    zero_bubble = "zero-bubble"
    """Backward split into input- and weight-gradient passes that fill the bubble (Qi et al.
    2024; torch's ScheduleInterleavedZeroBubble, looped stages)."""
    zbv = "zbv"
    """Zero bubble over two stages per rank placed in a V (Qi et al. 2024, "Pipeline
    Parallelism with Controllable Memory"; ScheduleZBVZeroBubble): rank r runs stages r and
    2p - 1 - r, so rank 0 holds both the embedding and the head."""

    @property
    def interleaved(self) -> bool:
        """Whether each rank runs several model chunks (virtual stages)."""
        return self not in (PipelineSchedule.gpipe, PipelineSchedule.one_f_one_b)

    @property
    def v_shape(self) -> bool:
        """Whether rank r's stages are r and 2p - 1 - r (else r, r + p, r + 2p, ...)."""
        return self is PipelineSchedule.zbv

    @property
    def torch_name(self) -> str:
        """The name torch 2.13's get_schedule_class (and torchtitan's
        pipeline_parallel_schedule) takes."""
        return {
            PipelineSchedule.gpipe: "GPipe", PipelineSchedule.one_f_one_b: "1F1B",
            PipelineSchedule.interleaved_1f1b: "Interleaved1F1B", PipelineSchedule.looped_bfs: "LoopedBFS",
            PipelineSchedule.zero_bubble: "InterleavedZeroBubble", PipelineSchedule.zbv: "ZBVZeroBubble",
        }[self]


class DeviceMap(str, Enum):
    """transformers' ``from_pretrained(device_map=...)`` over the process's GPUs (one process, one
    micro-batch at a time through them in turn: zeroplan.core.parallel.device_map)."""

    balanced = "balanced"
    """accelerate's get_balanced_memory caps: the layers spread about evenly ("auto" is this)."""
    sequential = "sequential"
    """Each GPU filled to its free memory before the next."""


class ParallelSpec(Frozen):
    """Degrees of tensor, context and pipeline parallelism (1 = not used) and the pipeline
    schedule; the data-parallel degree is what is left of the world."""

    tp: int = Field(default=1, gt=0)
    """Tensor-parallel degree t: each block's matrices split t ways (Shoeybi et al. 2019,
    Megatron-LM sec. 3), the embedding and output projection split over the vocabulary."""
    sequence_parallel: bool = False
    """Shard the norms' and residual stream's sequence dimension over the tensor-parallel ranks
    (Korthikanti et al. 2022, sec. 4.2.2); requires tp > 1."""
    async_tp: bool = False
    """torchtitan's asynchronous tensor parallelism (``enable_async_tensor_parallel``): inductor's
    micro-pipeline pass fuses each sequence-parallel all-gather with the matmuls that read it and
    each matmul with its reduce-scatter (zeroplan.core.parallel.sequence_parallel); requires
    sequence parallelism and a compiled block."""
    cp: int = Field(default=1, gt=0)
    """Context-parallel degree: the sequence split cp ways, attention exchanging K and V around
    a ring (Liu et al. 2023, Ring Attention; torchtitan's context_parallel)."""
    pp: int = Field(default=1, gt=0)
    """Pipeline-parallel degree: the blocks split into pp x virtual_stages stages."""
    pp_schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    """The pipeline schedule (read only with pp > 1)."""
    virtual_stages: int = Field(default=1, gt=0)
    """Stages (model chunks) per pipeline rank: 1 for gpipe and 1f1b, 2 or more for the
    interleaved schedules."""
    ep: int = Field(default=1, gt=0)
    """Expert-parallel degree: each MoE block's routed experts split ep ways, tokens sent to
    their experts' rank by all-to-all. As torchtitan 0.3.0 lays it out, ep borrows ranks from
    the data-parallel ones (efsdp = dp_shard x cp x tp / ep): it does not shrink dp."""
    pipeline_rank: int = Field(default=0, ge=0)
    """Which pipeline rank this request describes (0 = the first stage). ``fit`` plans every
    rank and reports the one that peaks."""
    device_map: DeviceMap | None = None
    """Hugging Face's naive model parallelism: the model's modules split over every GPU of the
    request by accelerate's rule (pp is the GPU count, each GPU one pipeline rank), one
    micro-batch in flight. None: not used."""

    # A layout without a device map dumps as it did before the field existed (the answers' JSON,
    # and every digest of it, stay as they were).
    @model_serializer(mode="wrap")
    def _without_unset_device_map(self, handler):
        dumped = handler(self)
        if self.device_map is None and isinstance(dumped, dict):
            dumped.pop("device_map", None)
        return dumped

    @model_validator(mode="after")
    def _check(self) -> "ParallelSpec":
        if self.sequence_parallel and self.tp == 1:
            raise ZeroplanError("parallel.sequence_parallel", "needs tensor parallelism (allowed: with tp > 1)")
        if self.async_tp and not self.sequence_parallel:
            raise ZeroplanError("parallel.async_tp", "needs sequence parallelism (allowed: with tp > 1 and sequence parallelism)")
        if self.pp == 1 and (self.virtual_stages != 1 or self.pipeline_rank != 0):
            raise ZeroplanError("parallel.virtual_stages", "needs pipeline parallelism (allowed: 1 with pp 1)")
        if self.pp > 1 and self.pp_schedule.interleaved and self.virtual_stages < 2:
            raise ZeroplanError(
                "parallel.virtual_stages",
                f"{self.pp_schedule.value!r} runs several stages per rank (allowed: 2 or more, got {self.virtual_stages})",
            )
        if self.pp > 1 and self.pp_schedule.v_shape and self.virtual_stages != 2:
            raise ZeroplanError(
                "parallel.virtual_stages", f"'zbv' runs two stages per rank in a V (allowed: 2, got {self.virtual_stages})",
            )
        if self.pp > 1 and not self.pp_schedule.interleaved and self.virtual_stages != 1:
            raise ZeroplanError(
                "parallel.virtual_stages",
                f"{self.pp_schedule.value!r} runs one stage per rank (allowed: 1; interleaved-1f1b, looped-bfs, zero-bubble or zbv for more)",
            )
        if self.pipeline_rank >= self.pp:
            raise ZeroplanError("parallel.pipeline_rank", f"{self.pipeline_rank} (allowed: 0 to {self.pp - 1})")
        if self.device_map is not None:
            others = [name for name, value in (("tp", self.tp), ("cp", self.cp), ("ep", self.ep),
                                               ("virtual_stages", self.virtual_stages)) if value != 1]
            if others or self.sequence_parallel or self.pp_schedule is not PipelineSchedule.one_f_one_b:
                named = others[0] if others else ("sequence_parallel" if self.sequence_parallel else "pp_schedule")
                raise ZeroplanError("parallel.device_map", f"accelerate's device map runs one micro-batch through the "
                                    f"GPUs in turn and combines with no {named} (allowed: tp, cp, ep 1, no sequence "
                                    "parallelism, the default schedule)")
        return self

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one copy of the model and see the same batch: tp x cp x pp."""
        return self.tp * self.cp * self.pp

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp x virtual_stages."""
        return self.pp * self.virtual_stages

    def microbatch_rule(self, microbatches: int) -> str | None:
        """Why torch 2.13's schedule (pipelining/schedules.py) refuses ``microbatches``
        micro-batches per step under this layout, None where it runs them. Schedule1F1B raises
        for fewer micro-batches than stages; ScheduleInterleaved1F1B and
        ScheduleInterleavedZeroBubble run them in max(1, m // pp) rounds and raise unless the
        rounds divide m. GPipe, LoopedBFS and ZBVZeroBubble take any count."""
        pp, m = self.pp, microbatches
        if pp == 1:
            return None
        if self.pp_schedule is PipelineSchedule.one_f_one_b and m < pp:
            return (f"{m} micro-batch(es) for 1f1b over {pp} stages: torch's Schedule1F1B needs at least one per stage "
                    f"(allowed: {pp} or more)")
        if self.pp_schedule in (PipelineSchedule.interleaved_1f1b, PipelineSchedule.zero_bubble):
            rounds = max(1, m // pp)
            if m % rounds:
                below = next(n for n in range(m - 1, 0, -1) if n % max(1, n // pp) == 0)
                above = next(n for n in range(m + 1, 2 * m + 2) if n % max(1, n // pp) == 0)
                return (f"{m} micro-batches for {self.pp_schedule.value} over {pp} ranks: torch's "
                        f"Schedule{self.pp_schedule.torch_name} runs them in max(1, m // pp) = {rounds} rounds and "
                        f"needs a multiple of that (allowed: 1 to {2 * pp - 1}, or m with m // pp dividing m, "
                        f"e.g. {below} or {above})")
        return None

    @property
    def is_trivial(self) -> bool:
        """Plain data parallelism: no tensor, context or pipeline split."""
        return self.model_parallel_size == 1


# DeepSpeed 0.19.8 runtime/pipe/engine.py (PipelineEngine.__init__): "ZeRO-2 and ZeRO-3 are
# incompatible with pipeline parallelism"; its offloads are stage 2 and 3. torchtitan 0.3.0 runs
# FSDP2 (and HSDP, DDP) under its pipeline (models/llama3/parallelize.py, apply_fsdp_to_decoder
# with pp_enabled).
PIPELINE_STRATEGIES = ("ddp", "zero1", "fsdp-full-shard", "fsdp-shard-grad-op", "hsdp")
"""Data-parallel strategies that run under a pipeline."""

MODEL_PARALLEL_FRAMEWORKS = ("zeroplan", "torchtitan", "megatron", "megatron-deepspeed")
"""Profiles whose tensor, context, pipeline and expert parallelism are modelled: the reference
model (Megatron-LM's layout, Korthikanti et al. 2022), torchtitan 0.3.0's own, megatron-core's
(tensor, sequence and pipeline parallelism only: check_megatron_parallel) and the
Megatron-DeepSpeed fork's (the same, under DeepSpeed's pipeline engine, and its cp as
DeepSpeed-Ulysses: check_ulysses)."""

MEGATRON_SCHEDULES = (PipelineSchedule.one_f_one_b, PipelineSchedule.interleaved_1f1b)
"""megatron-core 0.16.1 pipeline_parallel/schedules.py get_forward_backward_func: without a
pipeline forward_backward_no_pipelining; with one forward_backward_pipelining_without_interleaving
(1F1B) or, with a virtual pipeline size, forward_backward_pipelining_with_interleaving."""

# torchtitan 0.3.0 runs expert parallelism under FSDP2 only: ep borrows from dp_shard (its
# distributed/fsdp.py shards the experts over efsdp = dp_shard x cp x tp / ep); DDP and HSDP's
# replicate dimension are outside the ep region, and ZeRO-1/2 are not its strategies.
EXPERT_PARALLEL_STRATEGIES = ("fsdp-full-shard", "fsdp-shard-grad-op")
"""Data-parallel strategies that run under expert parallelism."""


def check_parallel(parallel: ParallelSpec, model, cluster, batch, strategy_kind, framework) -> None:
    """Refuse, in one line naming the field, a layout the stacks cannot build: degrees that do
    not divide the world, the heads, the blocks or the sequence; tensor parallelism across
    nodes; a strategy or framework that does not run under it."""
    if parallel.ep > 1:
        check_expert_parallel(parallel, model, cluster, strategy_kind, framework)
    if model.is_mla and parallel.tp > 1:
        # torchtitan 0.3.0 shards MLA's up-projections (wq/wq_b, wkv_b) by heads and keeps the
        # latent down-projections whole; the planner has no split rules for those tensors yet.
        raise ZeroplanError("parallel.tp", "tensor parallelism of multi-head latent attention is not modelled (allowed: tp 1)")
    if parallel.tp > 1 and (model.moe_ffn_hidden_size is not None or model.shared_expert_ffn_hidden_size or model.first_dense_layers):
        raise ZeroplanError("parallel.tp", "tensor parallelism of expert widths, shared experts or dense first blocks is "
                            "not modelled (allowed: tp 1; use --ep for the experts)")
    if parallel.is_trivial or parallel.device_map is not None:
        # A device map's own rules: zeroplan.specs.device_map.check_device_map.
        return
    if framework.value == "megatron":
        check_megatron_parallel(parallel, model, batch)
    if framework.value == "megatron-deepspeed":
        check_megatron_deepspeed_parallel(parallel, model, batch)
    if framework.value not in MODEL_PARALLEL_FRAMEWORKS:
        raise ZeroplanError(
            "parallel", f"tensor, context and pipeline parallelism are not modelled for {framework.value} "
            f"(allowed: framework {' or '.join(MODEL_PARALLEL_FRAMEWORKS)})",
        )
    world = cluster.world_size
    if world % parallel.model_parallel_size:
        raise ZeroplanError(
            "parallel", f"tp x cp x pp = {parallel.model_parallel_size} does not divide the {world} GPUs "
            f"(allowed: a product that divides {world})",
        )
    tp = parallel.tp
    if tp > 1:
        # Megatron-LM sec. 3 splits attention by heads and the MLP by its inner width;
        # torchtitan 0.3.0 models/common/decoder_sharding.py shards wq/wkv by heads the same way.
        for field, value in (("model.num_heads", model.num_heads), ("model.num_kv_heads", model.kv_heads),
                             ("model.ffn_hidden_size", model.ffn_hidden_size)):
            if value % tp:
                raise ZeroplanError("parallel.tp", f"{tp} does not divide {field} {value} (allowed: a divisor of {value})")
        # Tensor parallelism's per-block collectives need NVLink: every stack keeps a tp group
        # inside a node (Megatron-LM sec. 5.1; torchtitan's mesh puts tp innermost).
        if tp > cluster.gpus_per_node or cluster.gpus_per_node % tp:
            raise ZeroplanError(
                "parallel.tp", f"{tp} does not fit inside a node of {cluster.gpus_per_node} GPUs "
                f"(allowed: a divisor of {cluster.gpus_per_node})",
            )
    if parallel.sequence_parallel and batch.seq_len % tp:
        raise ZeroplanError("parallel.sequence_parallel", f"--seq-len {batch.seq_len} is not a multiple of tp {tp}")
    if parallel.cp > 1 and not is_ulysses(parallel, framework) and batch.seq_len % (2 * parallel.cp):
        # torch 2.13 distributed/tensor/experimental/_context_parallel/_load_balancer.py
        # (_HeadTailLoadBalancer): the sequence is cut into 2 x cp chunks, two per rank.
        raise ZeroplanError(
            "parallel.cp", f"--seq-len {batch.seq_len} is not a multiple of 2 x cp = {2 * parallel.cp} "
            "(allowed: cp with 2 x cp dividing the sequence)",
        )
    if parallel.pp > 1:
        refused = pipeline_microbatch_rule(parallel, framework.value, batch.grad_accum_steps)
        if refused:
            # The pipeline's micro-batches are the step's accumulation steps.
            raise ZeroplanError("batch.grad_accum_steps", refused)
        if model.num_layers < parallel.stages:
            raise ZeroplanError(
                "parallel.pp", f"{parallel.stages} stages (pp x virtual stages) for {model.num_layers} blocks "
                f"(allowed: at most {model.num_layers} stages)",
            )
        if strategy_kind.value not in PIPELINE_STRATEGIES:
            raise ZeroplanError(
                "strategy", f"{strategy_kind.value!r} does not run under pipeline parallelism "
                f"(allowed: {', '.join(PIPELINE_STRATEGIES)})",
            )


def check_megatron_parallel(parallel: ParallelSpec, model, batch) -> None:
    """The layouts megatron-core 0.16.1 builds that the megatron profile plans, the rest refused
    in one line naming the field."""
    if parallel.cp > 1:
        # Megatron's context parallelism runs Transformer Engine's attention (its ring exchange
        # and load balancing), whose saved tensors zeroplan has not read.
        raise ZeroplanError("parallel.cp", "context parallelism is not modelled for megatron (allowed: cp 1)")
    if parallel.pp == 1:
        return
    if parallel.pp_schedule not in MEGATRON_SCHEDULES:
        allowed = ", ".join(s.value for s in MEGATRON_SCHEDULES)
        raise ZeroplanError("parallel.pp_schedule", f"{parallel.pp_schedule.value!r} is not a megatron-core schedule (allowed: {allowed})")
    if model.num_layers % parallel.stages:
        # transformer/transformer_block.py get_num_layers_to_build: num_layers // (pp x vp),
        # with an assertion in training/arguments.py that pp (x vp) divides the layers
        # unless uneven first/last stages are configured (not modelled).
        raise ZeroplanError("parallel.pp", f"pp x virtual stages = {parallel.stages} does not divide {model.name}'s "
                            f"{model.num_layers} blocks (allowed: a divisor of {model.num_layers})")
    refused = pipeline_microbatch_rule(parallel, "megatron", batch.grad_accum_steps)
    if refused:
        raise ZeroplanError("batch.grad_accum_steps", refused)


def pipeline_microbatch_rule(parallel: ParallelSpec, framework: str, microbatches: int) -> str | None:
    """Why the framework's pipeline schedule refuses ``microbatches`` micro-batches per step
    under this layout, None where it runs them: torch's schedules (ParallelSpec.microbatch_rule)
    but under megatron-core's and DeepSpeed's own. The request's check and the plan search both
    ask this, so the search ranks no accumulation count fit refuses."""
    if parallel.pp == 1:
        return None
    if framework == "megatron":
        # megatron-core 0.16.1 pipeline_parallel/schedules.py: 1F1B takes any count (its
        # warm-up is capped at it); forward_backward_pipelining_with_interleaving raises unless
        # microbatch_group_size_per_vp_stage (pp by default, model_parallel_config.py) is at
        # most m and the last group, m mod pp, is empty or at least pp: m a multiple of pp.
        if parallel.pp_schedule is PipelineSchedule.interleaved_1f1b and microbatches % parallel.pp:
            return (f"{microbatches} micro-batches for megatron's interleaved schedule over pp {parallel.pp} "
                    f"(allowed: a multiple of {parallel.pp})")
        return None
    if framework == "megatron-deepspeed":
        # DeepSpeed's TrainSchedule (runtime/pipe/schedule.py) takes any count.
        return None
    return parallel.microbatch_rule(microbatches)


# Megatron-DeepSpeed (microsoft f4157be) megatron/model/gpt_model.py GPTModelPipe is a DeepSpeed
# PipelineModule (partition_method 'type:transformer': the blocks spread over the stages), run by
# deepspeed 0.19.8 runtime/pipe/engine.py PipelineEngine under runtime/pipe/schedule.py
# TrainSchedule, a 1F1B schedule without interleaving; the fork's context parallelism is
# DeepSpeed-Ulysses' sequence parallelism (--ds-sequence-parallel-size, planned as cp:
# zeroplan.core.parallel.ulysses).
def check_megatron_deepspeed_parallel(parallel: ParallelSpec, model, batch) -> None:
    """The layouts the megatron-deepspeed profile plans, the rest refused in one line."""
    if parallel.cp > 1:
        check_ulysses(parallel, model, batch)
    if parallel.pp > 1 and (parallel.pp_schedule is not PipelineSchedule.one_f_one_b or parallel.virtual_stages > 1):
        raise ZeroplanError("parallel.pp_schedule", f"{parallel.pp_schedule.value!r} is not DeepSpeed's pipeline schedule "
                            "(allowed: 1f1b, TrainSchedule, without virtual stages)")


# Megatron-DeepSpeed f4157be under DeepSpeed-Ulysses (--ds-sequence-parallel-size P, cp here):
# megatron/core/parallel_state.py:145-147 asserts tp 1 and pp 1; megatron/model/transformer.py:618
# that P divides the attention heads and :729 that the key-value projection is the query's (no
# grouped K and V); pretrain_gpt.py:138 that P divides the sequence.
def check_ulysses(parallel: ParallelSpec, model, batch) -> None:
    """The fork's asserts on DeepSpeed-Ulysses, each refused in one line."""
    cp = parallel.cp
    if parallel.tp > 1 or parallel.pp > 1:
        raise ZeroplanError("parallel.cp", f"DeepSpeed-Ulysses (cp {cp}) runs without tensor or pipeline parallelism in "
                            "Megatron-DeepSpeed (allowed: tp 1 and pp 1 with cp > 1)")
    if model.kv_heads != model.num_heads:
        raise ZeroplanError("parallel.cp", f"DeepSpeed-Ulysses (cp {cp}) needs multi-head attention in Megatron-DeepSpeed; "
                            f"{model.name} has {model.kv_heads} key/value heads for {model.num_heads} (allowed: cp 1)")
    if model.num_heads % cp:
        raise ZeroplanError("parallel.cp", f"{cp} does not divide the {model.num_heads} attention heads "
                            f"(allowed: a divisor of {model.num_heads})")
    if batch.seq_len % cp:
        raise ZeroplanError("parallel.cp", f"--seq-len {batch.seq_len} is not a multiple of cp {cp} "
                            "(allowed: cp dividing the sequence)")
    if model.is_moe:
        raise ZeroplanError("parallel.cp", "DeepSpeed-Ulysses with mixture-of-experts blocks is not modelled (allowed: cp 1)")


# Megatron-DeepSpeed f4157be megatron/model/transformer.py:614-622 wraps the core attention in
# DeepSpeed's DistributedAttention when the sequence-parallel world is above 1; the fork has no
# other context parallelism.
def is_ulysses(parallel: ParallelSpec, framework) -> bool:
    """Whether the layout's cp is DeepSpeed-Ulysses: Megatron-DeepSpeed with cp > 1."""
    return parallel.cp > 1 and framework.value == "megatron-deepspeed"


# Megatron-DeepSpeed f4157be megatron/model/transformer.py:616-628 sets the selective
# recomputation of the core attention (checkpoint_core_attention) only without Ulysses, and the
# Ulysses forward (:835-848) never reads it.
def ulysses_runs_checkpointing(parallel: ParallelSpec, framework, policy) -> bool:
    """Whether the checkpointing ``policy`` runs as planned under the layout: every policy but
    selective recomputation under Megatron-DeepSpeed's Ulysses (the plan search asks this too)."""
    return not is_ulysses(parallel, framework) or policy.value != "selective"


# Megatron-DeepSpeed f4157be megatron/model/transformer.py:846-848 calls DistributedAttention
# without flash attention as dist_attn(q, k, v, attention_mask): the mask lands on batch_dim_idx
# and CoreAttention runs without one, which deepspeed 0.19.8's layer.py cannot run. DeepSpeed's
# sequence/layer.py is not in the 2022 release (megatron/arguments.py:98-99 asks for 0.10.2 or
# later).
def check_ulysses_training(parallel: ParallelSpec, framework, training) -> None:
    """The fork's Ulysses path's attention, recomputation and DeepSpeed release, the rest refused."""
    if not is_ulysses(parallel, framework):
        return
    if training.attention_kernel.value != "flash":
        raise ZeroplanError("training.attention_kernel", "DeepSpeed-Ulysses runs in Megatron-DeepSpeed with flash attention "
                            f"only, not {training.attention_kernel.value} (allowed: flash with cp > 1)")
    if training.attention_implementation.value != "flash-attn-2":
        # transformer.py:839-843: --use-flash-attn-triton keeps q, k, v seq-first (batch_dim_idx 1),
        # a layout whose all-to-alls were not measured (benchmarks/ulysses_attention_records.py).
        raise ZeroplanError("training.attention_implementation", "DeepSpeed-Ulysses is planned on the fork's "
                            "--use-flash-attn-v2 path, not flash-attn-triton's seq-first one (allowed: flash-attn-2 "
                            "with cp > 1)")
    if not ulysses_runs_checkpointing(parallel, framework, training.activation_checkpointing):
        raise ZeroplanError("training.activation_checkpointing", "Megatron-DeepSpeed's selective recomputation does not "
                            "reach DistributedAttention (allowed: none or full with cp > 1)")
    if training.deepspeed_release == "2022-bigscience":
        raise ZeroplanError("parallel.cp", "DeepSpeed-Ulysses is not in deepspeed 2022-bigscience (allowed: cp 1, or "
                            "deepspeed_release 0.19.8)")


def check_expert_parallel(parallel: ParallelSpec, model, cluster, strategy_kind, framework) -> None:
    """The rules torchtitan 0.3.0 sets on expert parallelism, each refused in one line."""
    if not model.is_moe:
        raise ZeroplanError("parallel.ep", f"{parallel.ep} needs a mixture-of-experts model (allowed: 1 for {model.name})")
    if framework.value not in MODEL_PARALLEL_FRAMEWORKS:
        raise ZeroplanError(
            "parallel.ep", f"expert parallelism is not modelled for {framework.value} "
            f"(allowed: framework {' or '.join(MODEL_PARALLEL_FRAMEWORKS)})",
        )
    # torchtitan's dispatcher runs num_experts // ep local experts per rank
    # (models/common/token_dispatcher.py; distributed/minimal_async_ep/api.py refuses the rest).
    if model.num_experts % parallel.ep:
        raise ZeroplanError("parallel.ep", f"{parallel.ep} does not divide the {model.num_experts} experts "
                            f"(allowed: a divisor of {model.num_experts})")
    if parallel.tp > 1:
        raise ZeroplanError("parallel.ep", "expert parallelism with tensor parallelism is not modelled (allowed: tp 1 with ep > 1)")
    if strategy_kind.value not in EXPERT_PARALLEL_STRATEGIES:
        raise ZeroplanError("strategy", f"{strategy_kind.value!r} does not run under expert parallelism "
                            f"(allowed: {', '.join(EXPERT_PARALLEL_STRATEGIES)})")
    # config/configs.py: dp_shard x cp x tp == efsdp x ep (parallel_dims.py _validate_meshes).
    region = cluster.world_size // (parallel.tp * parallel.cp * parallel.pp) * parallel.cp * parallel.tp
    if region % parallel.ep:
        raise ZeroplanError("parallel.ep", f"{parallel.ep} does not divide dp_shard x cp x tp = {region} "
                            f"(allowed: a divisor of {region})")
