"""Predicted step time against published training throughput (docs/validation.md, "Step time").

Torch-free: the published rows are data (data/published_throughput.json), each with its source;
each row becomes a PlanRequest and the planner's step time is compared with the published
tokens/s/GPU, once under the planner's default hardware FLOPs utilisation (HFU) and once at the
HFU the row's published MFU implies for the FLOPs the planner executes."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from pydantic import Field, ValidationError

from zeroplan.core.default_efficiency import FLAT_HFU
from zeroplan.core.flops import step_flops
from zeroplan.core.timing import hfu_from_mfu
from zeroplan.core.plan import plan, step_fits, under_allocator_model
from zeroplan.core.profiles import accumulates_without_sync
from zeroplan.core.roofline.ceilings import CEILINGS
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.hosts import get_host
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    ActivationCheckpointing, AttentionImplementation, AttentionKernel, BatchSpec, PerformanceAssumptions, Optimizer, PlanRequest, Precision, StrategyKind,
    StrategySpec, TrainingSpec, cluster_from_gpus,
)
from zeroplan.specs.base import Frozen, first_error
from zeroplan.specs.framework import Framework
from zeroplan.specs.finetune import FineTuneSpec, LoraTarget, Quantization
from zeroplan.specs.hardware import ClusterSpec, GpuSpec, NodeNetworkSpec
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule
from zeroplan.specs.training import Float8Recipe
from zeroplan.validate.rows import FLAT_RESERVE

PUBLISHED_THROUGHPUT_FILE = Path(__file__).resolve().parent / "data" / "published_throughput.json"


class TrainingOptions(Frozen):
    """Training options a published row states beyond the common fields, as TrainingSpec and
    FineTuneSpec name them (torchtune's rows: its recipes' compile, optimizer in the backward,
    activation offloading, 8-bit AdamW, FSDP CPU offload, LoRA)."""

    compile: bool = False
    attention_kernel: AttentionKernel = AttentionKernel.flash
    optimizer: Optimizer = Optimizer.adamw
    optimizer_in_backward: bool = False
    activation_offloading: bool = False
    partition_activations: bool = False
    """TrainingSpec.partition_activations: the run's DeepSpeed activation_checkpointing block."""
    cpu_checkpointing: bool = False
    """TrainingSpec.cpu_checkpointing: the run's DeepSpeed activation_checkpointing block."""
    fsdp_cpu_offload: bool = False
    unchunked_loss: bool = False
    lora_rank: int = Field(default=0, ge=0)
    lora_targets: tuple[LoraTarget, ...] | None = None
    quantize: Quantization = Quantization.none
    checkpoint_early_stop: bool | None = None
    """TrainingSpec.checkpoint_early_stop: False where the run's torch (1.13) had no early stop."""
    litgpt_fork: str | None = None
    """TrainingSpec.litgpt_fork: the lit-gpt fork whose model code the run trained (TinyLlama's)."""
    float8: Float8Recipe | None = None
    """TrainingSpec.float8: the run's torchao float8 recipe (torchtitan's float8 converter)."""
    float8_all_gather: bool = False
    """TrainingSpec.float8_all_gather: enable_fsdp_float8_all_gather with the scale precomputed."""
    float8_skips_output: bool = False
    """TrainingSpec.float8_skips_output: the run's float8.filter_fqns named the output projection."""
    deepspeed_release: str | None = None
    """TrainingSpec.deepspeed_release: the DeepSpeed release the run's framework profile plans
    (BLOOM's Megatron-DeepSpeed rows: 2022-bigscience, whose fork builds ALiBi and the embedding norm)."""

    def training_fields(self) -> dict:  # type: ignore[type-arg]
        """The TrainingSpec keyword arguments these options set."""
        fields = self.model_dump(exclude={"lora_rank", "lora_targets", "quantize"})
        if self.lora_rank:
            fields["finetune"] = FineTuneSpec(lora_rank=self.lora_rank, lora_targets=self.lora_targets, quantize=self.quantize)
        return fields


class ZeroOptions(Frozen):
    """DeepSpeed zero_optimization values the source's config sets, as StrategySpec names them
    (None: StrategySpec's default, what ``--emit`` writes)."""

    zero_bucket_elements: int | None = Field(default=None, gt=0)
    """reduce_bucket_size (elements)."""
    deepspeed_prefetch_bucket_elements: int | None = Field(default=None, ge=0)
    """stage3_prefetch_bucket_size (elements)."""
    deepspeed_max_live_parameters: int | None = Field(default=None, gt=0)
    """stage3_max_live_parameters (elements)."""
    deepspeed_param_persistence_threshold: int | None = Field(default=None, ge=0)
    """stage3_param_persistence_threshold (elements)."""
    deepspeed_max_reuse_distance: int | None = Field(default=None, ge=0)
    """stage3_max_reuse_distance (elements)."""

    def strategy_fields(self) -> dict:  # type: ignore[type-arg]
        """The StrategySpec keyword arguments these options set."""
        return self.model_dump(exclude_none=True)


class PublishedThroughput(Frozen):
    """One published training run: its setup and the throughput it reports."""

    name: str = Field(min_length=1)
    """Short label of the row."""
    source_url: str = Field(pattern=r"^https://")
    """Where the figure is published (a commit-pinned URL where there is one)."""
    source_section: str = Field(min_length=1)
    """The section or table of the source the row comes from."""
    setup_notes: str = Field(min_length=1)
    """What the source does and does not state about the setup, and what was assumed."""
    model: str
    """zeroplan model preset, or the name of ``architecture``."""
    architecture: ModelSpec | None = None
    """The source's own architecture, where no preset is it (llm-foundry's MPT configurations)."""
    published_parameters: int | None = Field(default=None, gt=0)
    """The source's parameter count, which ``architecture`` must reproduce."""
    gpu: str
    """zeroplan GPU catalog name."""
    num_gpus: int = Field(gt=0)
    """GPUs of the run."""
    gpus_per_node: int = Field(gt=0)
    """GPUs per node (assumed where the source does not say)."""
    strategy: StrategyKind
    """Sharding strategy."""
    framework: Framework
    """The planner framework profile the run is requested with (its memory)."""
    stack: str | None = None
    """The training stack that produced the row (zeroplan.core.stack_time.PROFILES), where it is
    not the repository the source lives in (BLOOM's page lives in bigscience-workshop/bigscience,
    its stack is Megatron-DeepSpeed); None: that repository's name."""
    fused_cross_entropy: bool = False
    """The run's loss is flash-attn's fused cross-entropy (TrainingSpec.fused_cross_entropy)."""
    attention_implementation: AttentionImplementation = AttentionImplementation.flash_attn_2
    """The flash kernel the run's attention used (TrainingSpec.attention_implementation):
    llm-foundry's MPT rows ran ``attn_impl: triton``, torchtitan's SDPA (FlashAttention-2's
    kernels on an A100)."""
    precision: Precision
    """Numerics."""
    activation_checkpointing: ActivationCheckpointing
    """Activation checkpointing mode."""
    micro_batch_size: int = Field(gt=0)
    """Local (per-GPU) batch, in sequences."""
    seq_len: int = Field(gt=0)
    """Tokens per sequence."""
    grad_accum_steps: int = Field(gt=0)
    """Micro-batches per optimizer step."""
    published_tokens_per_s_per_gpu: float = Field(gt=0)
    """The source's throughput, tokens per second per GPU."""
    published_mfu: float | None = Field(default=None, gt=0, le=1)
    """The source's MFU, under the source's own FLOP count (None where not published)."""
    node_network_gbps: float | None = Field(default=None, gt=0)
    """The node's network, Gb/s per node in one direction, where the source states one the GPU
    catalog's node does not have (fms-fsdp: 400 Gb/s per A100 node, 800 per H100 node): the
    node's NICs are taken as one per GPU at an equal share (NodeNetworkSpec). None: the
    catalog's network."""
    tp: int = Field(default=1, gt=0)
    """Tensor-parallel degree (ParallelSpec.tp)."""
    pp: int = Field(default=1, gt=0)
    """Pipeline-parallel degree (ParallelSpec.pp)."""
    pp_schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    """The pipeline schedule (ParallelSpec.pp_schedule): 1F1B unless the source's settings imply another."""
    virtual_stages: int = Field(default=1, gt=0)
    """Model chunks per pipeline rank under an interleaved schedule (ParallelSpec.virtual_stages)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism with tensor parallelism (ParallelSpec.sequence_parallel)."""
    overlap_grad_reduce: bool | None = None
    """PerformanceAssumptions.overlap_grad_reduce as the run's flags had it (None: the stack's default)."""
    overlap_param_gather: bool = False
    """PerformanceAssumptions.overlap_param_gather (Megatron-LM --overlap-param-gather)."""
    tp_comm_overlap: bool = False
    """PerformanceAssumptions.tp_comm_overlap (Megatron-LM --tp-comm-overlap)."""
    fp32_grad_accumulation: bool = False
    """The run's optimizer was DeepSpeed's BF16_Optimizer accumulating gradients in fp32
    (PerformanceAssumptions.fp32_grad_accumulation; BLOOM's Megatron-DeepSpeed rows)."""
    cpu_adam_copies_parameters: bool = False
    """The run's DeepSpeed (before 0.9.0) copied the updated fp16 parameters to the GPU inside
    its CPU Adam kernel (PerformanceAssumptions.cpu_adam_copies_parameters)."""
    host: str | None = None
    """The node's host (zeroplan.presets.hosts), where the source names the machine: it runs
    offload's CPU step. None: HostSpec's default."""
    training_options: TrainingOptions = TrainingOptions()
    """Further training options the source states (torchtune's rows)."""
    zero_options: ZeroOptions = ZeroOptions()
    """The DeepSpeed ZeRO settings the source's config states (DeepSpeed on Azure's ZeRO-3 recipes)."""
    compile: bool = False
    """The run compiled its model with torch.compile (fms-fsdp's use_torch_compile), as the
    source states; the rows are split by it (zeroplan.core.stack_time). The planner times compile
    where the request compiles (TrainingOptions.compile, zeroplan.core.compiled_time); a row whose
    framework profile the memory model cannot compile (fms-fsdp's under the reference
    transformer, torchtune's LoRA with activation offloading) is timed eager."""

    def request(self, hardware_flops_utilization: float | None = None, compute_model: str = "hfu",
                attention_rate: str = "matmul") -> PlanRequest:
        """The planner request for this run; the flat HFU 0.4 unless one is given, or the
        roofline compute model; every executed FLOP at the HFU unless ``attention_rate`` says
        otherwise (zeroplan.validate.step_calibration times the planner's default mode). Its memory is judged on the flat reserve: the step time does
        not depend on it, and the allocator model's replays would be spent for nothing
        (compare_step_time asks the model for the verdict alone)."""
        return _row_request(self, hardware_flops_utilization, compute_model, attention_rate)

    def _built_request(self, hardware_flops_utilization: float | None, compute_model: str, attention_rate: str) -> PlanRequest:
        overlap = {"overlap_grad_reduce": self.overlap_grad_reduce, "overlap_param_gather": self.overlap_param_gather,
                   "tp_comm_overlap": self.tp_comm_overlap, "fp32_grad_accumulation": self.fp32_grad_accumulation or None,
                   "cpu_adam_copies_parameters": self.cpu_adam_copies_parameters}
        performance = PerformanceAssumptions(compute_model=compute_model, attention_rate=attention_rate, **overlap)
        if compute_model == "hfu":
            # The flat HFU unless one is given: the fitted default (zeroplan.core.default_efficiency)
            # was fitted on these rows, so no figure is reported at it in sample.
            performance = PerformanceAssumptions(hardware_flops_utilization=hardware_flops_utilization or FLAT_HFU,
                                                 attention_rate=attention_rate, **overlap)
        return PlanRequest(
            model=self.model_spec,
            training=TrainingSpec(
                precision=self.precision, activation_checkpointing=self.activation_checkpointing,
                framework=self.framework, fused_cross_entropy=self.fused_cross_entropy,
                attention_implementation=self.attention_implementation, **self.training_options.training_fields(),
            ),
            batch=BatchSpec(
                micro_batch_size=self.micro_batch_size, seq_len=self.seq_len, grad_accum_steps=self.grad_accum_steps,
            ),
            cluster=self.cluster,
            # A framework whose loop accumulates under no_sync keeps the unsharded gradients, as
            # the command line plans it (zeroplan.cli.fit: litgpt through Lightning).
            strategy=StrategySpec(kind=self.strategy, **self.zero_options.strategy_fields(),
                                  keep_unsharded_grads_on_accum=accumulates_without_sync(
                                      self.framework, self.num_gpus // (self.tp * self.pp))),
            parallel=ParallelSpec(tp=self.tp, pp=self.pp, sequence_parallel=self.sequence_parallel,
                                  pp_schedule=self.pp_schedule, virtual_stages=self.virtual_stages),
            performance=performance, assumptions=FLAT_RESERVE,
        )

    @property
    def cluster(self) -> ClusterSpec:
        """The run's nodes, with the source's host where it names one."""
        cluster = cluster_from_gpus(self.gpu_spec, self.num_gpus, gpus_per_node=self.gpus_per_node)
        return cluster if self.host is None else cluster.model_copy(update={"host": get_host(self.host)})

    @property
    def gpu_spec(self) -> GpuSpec:
        """The catalog GPU, with the node network the source states where it states one."""
        gpu = get_gpu(self.gpu)
        if self.node_network_gbps is None:
            return gpu
        network = NodeNetworkSpec(nics_per_node=self.gpus_per_node,
                                  nic_bandwidth_bytes_per_s=self.node_network_gbps * 1e9 / 8 / self.gpus_per_node,
                                  source=f"{self.source_url} ({self.node_network_gbps:g} Gb/s per node)")
        return gpu.model_copy(update={"node_network": network})

    @property
    def model_spec(self) -> ModelSpec:
        return self.architecture or get_model(self.model)

    @property
    def tokens_per_step_per_gpu(self) -> float:
        """Tokens of one step over the GPUs that share them: a data-parallel rank's micro-batches
        over its tensor- and pipeline-parallel ranks (as StepTime.tokens_per_s_per_gpu counts)."""
        return self.micro_batch_size * self.seq_len * self.grad_accum_steps / (self.tp * self.pp)


# Kept per (row, arguments): the request is immutable, and the fits and figures ask each row's
# request at the flat HFU, at its solved HFU and under each attention rate many times over
# (three in four of the published rows' requests were asked before).
@functools.lru_cache(maxsize=8192)
def _row_request(row: PublishedThroughput, hardware_flops_utilization: float | None, compute_model: str,
                 attention_rate: str) -> PlanRequest:
    return row._built_request(hardware_flops_utilization, compute_model, attention_rate)


class PublishedThroughputTable(Frozen):
    """The file of published rows."""

    description: str
    """What the rows are and how their figures are defined."""
    rows: tuple[PublishedThroughput, ...] = Field(min_length=1)
    """The published runs."""


class StepTimeComparison(Frozen):
    """One published run against the planner's step time. Errors are predicted/published - 1."""

    name: str
    """The row's label."""
    source: str
    """The row's source URL and section."""
    fits: bool
    """Whether the planner says the run fits in GPU memory (it ran, so it should)."""
    published_step_s: float
    """Tokens per step per GPU over the published tokens/s/GPU."""
    published_tokens_per_s_per_gpu: float
    """The source's throughput."""
    predicted_step_s: float
    """step_with_overlap_s under the flat HFU 0.4 (nothing fitted)."""
    predicted_tokens_per_s_per_gpu: float
    """Tokens per step per GPU over predicted_step_s."""
    predicted_mfu: float
    """The planner's MFU at the flat HFU 0.4 (StepTime.model_flops_utilization)."""
    published_mfu: float | None
    """The source's MFU."""
    published_hfu: float | None
    """The HFU the published MFU implies for the planner's executed FLOPs, its memory-bound
    kernels at the copy bandwidth (zeroplan.core.timing.hfu_from_mfu); None where they alone
    outlast the step."""
    with_published_mfu_step_s: float | None
    """step_with_overlap_s with the planner's HFU set to published_hfu."""
    with_published_mfu_tokens_per_s_per_gpu: float | None
    """Tokens per step per GPU over with_published_mfu_step_s."""
    communication_s: float
    """All collectives of the step back to back (the planner's alpha-beta model)."""
    exposed_communication_s: float
    """Communication the planner says the compute does not hide (flat HFU 0.4)."""
    flops_per_token_ratio: float
    """Planner's executed FLOPs per token over the model FLOPs per token the source's MFU counts."""
    roofline_tokens_per_s_per_gpu: float | None = None
    """Tokens/s/GPU under the roofline compute model (None for a GPU it has no ceilings for)."""

    @property
    def roofline_error(self) -> float | None:
        if self.roofline_tokens_per_s_per_gpu is None:
            return None
        return self.roofline_tokens_per_s_per_gpu / self.published_tokens_per_s_per_gpu - 1

    @property
    def tokens_per_s_error(self) -> float:
        return self.predicted_tokens_per_s_per_gpu / self.published_tokens_per_s_per_gpu - 1

    @property
    def with_published_mfu_error(self) -> float | None:
        if self.with_published_mfu_tokens_per_s_per_gpu is None:
            return None
        return self.with_published_mfu_tokens_per_s_per_gpu / self.published_tokens_per_s_per_gpu - 1


def load_published_throughput(path: Path = PUBLISHED_THROUGHPUT_FILE) -> PublishedThroughputTable:
    """The published rows of ``path``; a malformed file is one line naming the field."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ZeroplanError(str(path), f"cannot read published throughput: {error}") from None
    return _parsed_throughput(text, str(path))


# Kept per file content: the table is immutable, and the fits key their caches on it, so every
# reader of one file shares one object, whose rows the caches compare by identity (an equal table
# read again is compared row by row, field by field, at each lookup).
@functools.lru_cache(maxsize=4)
def _parsed_throughput(text: str, path: str) -> PublishedThroughputTable:
    try:
        return PublishedThroughputTable.model_validate(json.loads(text))
    except ValidationError as error:
        raise first_error(error, prefix=path) from None
    except json.JSONDecodeError as error:
        raise ZeroplanError(path, f"cannot read published throughput: {error}") from None


# The flat HFU 0.4 is the default of a GPU without published rows of its generation or compute
# die, none of which has a measured copy bandwidth (zeroplan.core.roofline.ceilings): there the
# HFU covers every kernel, so its figures time the rows that way (PerformanceAssumptions.memory_bound).
def as_flat_default(request: PlanRequest) -> PlanRequest:
    """``request`` timed as the flat HFU is applied: the memory-bound kernels inside the HFU."""
    return request.model_copy(update={"performance": request.performance.model_copy(update={"memory_bound": "in-hfu"})})


# The published MFU counts model FLOPs as PaLM's Appendix B does (6N + 12 L H Q T per token,
# zeroplan.core.flops.model_flops_per_token); torchtitan's get_num_flop_per_token has this form
# and, at the commit the rows come from, N is every parameter (embeddings included): with it,
# each row's WPS x FLOPs / 312 TFLOP/s gives back its published MFU (tests/test_step_time_accuracy.py).
def compare_step_time(row: PublishedThroughput) -> StepTimeComparison:
    """The planner's step time for ``row``'s setup beside the published throughput."""
    tokens = row.tokens_per_step_per_gpu
    request = as_flat_default(row.request())
    # Only the plans' step times are read: the largest micro-batch that fits is not searched.
    predicted = plan(request, largest_micro_batch=False)
    flops = step_flops(request)
    hfu = with_mfu_step_s = with_mfu_tokens = None
    if row.published_mfu is not None:
        hfu = hfu_from_mfu(row.request(), row.published_mfu)
        if hfu is not None:
            with_mfu_step_s = plan(row.request(hfu), largest_micro_batch=False).time.step_with_overlap_s
            with_mfu_tokens = tokens / with_mfu_step_s
    roofline_tokens = None
    # The roofline prices full training only (zeroplan.core.roofline.step.check_roofline_applies).
    if (row.gpu in CEILINGS or get_gpu(row.gpu).name in CEILINGS) and not row.training_options.lora_rank:
        roofline_tokens = plan(row.request(compute_model="roofline"), largest_micro_batch=False).time.tokens_per_s_per_gpu
    return StepTimeComparison(
        name=row.name,
        source=f"{row.source_url} ({row.source_section})",
        # A published run ran: the verdict a GPU would give (the allocator model's) should be yes.
        fits=step_fits(under_allocator_model(request)),
        published_step_s=tokens / row.published_tokens_per_s_per_gpu,
        published_tokens_per_s_per_gpu=row.published_tokens_per_s_per_gpu,
        predicted_step_s=predicted.time.step_with_overlap_s,
        predicted_tokens_per_s_per_gpu=predicted.time.tokens_per_s_per_gpu,
        predicted_mfu=predicted.time.model_flops_utilization,
        published_mfu=row.published_mfu,
        published_hfu=hfu,
        with_published_mfu_step_s=with_mfu_step_s,
        with_published_mfu_tokens_per_s_per_gpu=with_mfu_tokens,
        communication_s=predicted.time.communication_s,
        exposed_communication_s=predicted.time.exposed_communication_s,
        flops_per_token_ratio=flops.executed_flops / flops.model_flops,
        roofline_tokens_per_s_per_gpu=roofline_tokens,
    )


def step_time_table(table: PublishedThroughputTable | None = None) -> tuple[StepTimeComparison, ...]:
    """Every published row against the planner (the shipped file unless ``table`` is given)."""
    return _compared(table or load_published_throughput())


@functools.lru_cache(maxsize=4)
def _compared(table: PublishedThroughputTable) -> tuple[StepTimeComparison, ...]:
    # Kept per table (frozen, compared by value): each row's verdict replays its step through
    # the caching-allocator model, and the docs' table, the benchmark and the tests ask alike.
    return tuple(compare_step_time(row) for row in table.rows)
