"""One request: the single object that feeds both the planner and the measurement harness."""

# No postponed annotations: pydantic reads these fields' types as objects (zeroplan/specs/base.py).

from pydantic import Field, model_validator

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen, _instance
from zeroplan.specs.finetune import (GPTQ_CUDA_KERNEL_TOKENS, Quantization, check_adapter_variant_training,
                                     check_finetune, check_saved_module_training)
from zeroplan.specs.framework import BUILDS_NO_DROPOUT, UNTIES_EMBEDDINGS, Framework, launch_allocator_conf
from zeroplan.specs.recipe_defaults import (
    planned_recipe_config, planned_recipe_settings, recipe_launch_settings, setting_words, training_recipe_checkpointing,
)
from zeroplan.specs.hardware import FLOAT8_ARCHITECTURES, ClusterSpec, GpuSpec
from zeroplan.specs.model import ModelSpec, PositionKind
from zeroplan.specs.device_map import check_device_map
from zeroplan.specs.parallel import ParallelSpec, check_parallel, check_ulysses_training
from zeroplan.specs.strategy import StrategyKind, StrategySpec
from zeroplan.specs.training import (
    ActivationCheckpointing, AttentionKernel, BatchSpec, Float8Recipe, Objective, Optimizer, Precision, StateConvention,
    TrainingSpec, precision_without_bf16,
)


def check_seq_len(model: ModelSpec, batch: BatchSpec) -> None:
    """Refuse a sequence longer than the model's max_positions (docs/input-bounds.md). A learned
    position table (GPT-2) has max_positions rows, so a longer sequence cannot run at all; RoPE
    computes its angles for any position, so a longer one runs (outside what the model was
    trained on) when batch.allow_longer_seq says so."""
    if batch.seq_len <= model.max_positions:
        return
    given = f"{batch.seq_len:,} exceeds {model.name}'s maximum of {model.max_positions:,} positions"
    if model.position is PositionKind.learned:
        raise ZeroplanError(
            "batch.seq_len", f"{given}; its learned position table has no row past that, so "
            f"allow_longer_seq (--allow-longer-seq) cannot apply (allowed: 1 to {model.max_positions:,})",
        )
    if not batch.allow_longer_seq:
        raise ZeroplanError(
            "batch.seq_len", f"{given} (allowed: 1 to {model.max_positions:,}; allow_longer_seq (--allow-longer-seq) runs "
            f"its RoPE or ALiBi positions past that)",
        )


PAGED_OPTIMIZERS = (Optimizer.adamw, Optimizer.adam, Optimizer.adam_8bit, Optimizer.lion)
"""The optimizers bitsandbytes 0.50.2 has a paged form of (optim/adamw.py PagedAdamW and
PagedAdamW8bit, adam.py PagedAdam and PagedAdam8bit, lion.py PagedLion)."""


# torchtune 0.6.1 recipes/full_finetune_distributed.py __init__: optimizer_in_bwd raises a
# RuntimeError with gradient_accumulation_steps > 1 (the hook steps on each micro-batch's gradient).
def check_optimizer_in_backward(training: TrainingSpec, grad_accum_steps: int) -> None:
    """Refuse, in one line, optimizer-in-backward with gradient accumulation."""
    if training.optimizer_in_backward and grad_accum_steps > 1:
        raise ZeroplanError(
            "optimizer_in_backward",
            f"{training.framework.value} steps in backward only without gradient accumulation "
            f"(allowed: grad_accum_steps 1, got {grad_accum_steps})",
        )


# torchtitan 0.3.0 components/quantization/float8.py:85-97 Float8LinearConverter.__init__ raises a
# ValueError unless the device has SM89 (or gfx942) float8 matmuls or the converter emulates.
def check_float8_gpu(training: TrainingSpec, gpu: GpuSpec | None) -> None:
    """Refuse, in one line, float8 training on a GPU without float8 matmuls (FLOAT8_ARCHITECTURES)."""
    if training.float8 is not None and gpu is not None and gpu.architecture not in (None, *FLOAT8_ARCHITECTURES):
        allowed = ", ".join(a.value for a in FLOAT8_ARCHITECTURES)
        raise ZeroplanError("float8", f"needs float8 matmuls, which {gpu.display_name} ({gpu.architecture.value}) lacks "
                            f"(allowed architectures: {allowed})")


def check_float8_compiled(training: TrainingSpec) -> None:
    """Refuse, in one line, torchtitan's float8 converter without compile."""
    if training.float8 not in (None, Float8Recipe.te_delayed) and not training.compile:
        # torchtitan 0.3.0 components/quantization/float8.py: the converter's speed comes from
        # compile fusing the casts; only the compiled block was measured.
        raise ZeroplanError("float8", "is modelled compiled only, as torchtitan runs it (add compile, --compile)")


# torchtune 0.6.1 recipes/full_finetune_single_device.py and full_finetune_distributed.py
# __init__ raise a RuntimeError when enable_activation_offloading is set without
# enable_activation_checkpointing, and with ac_mode set as well _setup_model applies no
# checkpointing at all: offloading goes with full recomputation.
def check_activation_offloading(training: TrainingSpec) -> None:
    """Refuse, in one line, activation offloading without full activation checkpointing."""
    if training.activation_offloading and training.activation_checkpointing is not ActivationCheckpointing.full:
        raise ZeroplanError(
            "activation_offloading",
            f"{training.framework.value} offloads only with activation_checkpointing 'full' "
            f"(got {training.activation_checkpointing.value!r})",
        )


def check_paged_optimizer(training: TrainingSpec, kind: StrategyKind) -> None:
    """A paged optimizer is bitsandbytes' own and steps on the GPU."""
    if not training.paged_optimizer:
        return
    if training.optimizer not in PAGED_OPTIMIZERS:
        raise ZeroplanError("training.paged_optimizer", f"bitsandbytes has no paged {training.optimizer.value} "
                            f"(allowed with: {', '.join(o.value for o in PAGED_OPTIMIZERS)})")
    if kind.offloads_optimizer or training.fsdp_cpu_offload:
        raise ZeroplanError("training.paged_optimizer", f"pages states the GPU steps; {kind.value if kind.offloads_optimizer else 'FSDP CPU offload'} "
                            "steps them on the host already (allowed: a strategy that keeps the optimizer on the GPU)")


# DeepSpeed's optimizer offload steps a CPU optimizer of its own: deepspeed 0.19.8
# runtime/engine.py _configure_optimizer (lines 2341-2346) raises ZeRORuntimeException for a client
# optimizer that is not DeepSpeedCPUAdam or DeepSpeedCPULion under offload_optimizer (unless the
# config sets zero_force_ds_cpu_optimizer false), and a config's optimizer block names DeepSpeed's
# or torch.optim's (_configure_basic_optimizer), never bitsandbytes' 8-bit Adam. hf's Trainer
# prepares DeepSpeed through accelerate 1.10.1, whose accelerator.py (lines 2270-2280) replaces the
# client optimizer under offload_optimizer by map_pytorch_optim_to_deepspeed (utils/deepspeed.py
# lines 29-96): DeepSpeedCPUAdam for every optimizer but Adagrad and bitsandbytes' 32-bit Lion, so
# SGD, Adafactor or 8-bit Adam run as Adam with two fp32 states a parameter on the host.
OFFLOAD_STEPPED_AS_CPU_ADAM = (Optimizer.sgd, Optimizer.sgd_momentum, Optimizer.adafactor, Optimizer.adam_8bit)
"""Optimizers accelerate replaces by DeepSpeedCPUAdam under DeepSpeed's optimizer offload (hf)."""


def check_offloaded_optimizer(training: TrainingSpec, kind: StrategyKind) -> None:
    """An optimizer DeepSpeed's optimizer offload does not step as asked is refused: bitsandbytes'
    8-bit Adam everywhere (DeepSpeed's engine refuses it), and under hf every optimizer accelerate
    replaces by DeepSpeed's CPU Adam (its states are Adam's, not the ones asked for)."""
    if not kind.offloads_optimizer:
        return
    optimizer = training.optimizer
    if training.framework is Framework.hf and optimizer in OFFLOAD_STEPPED_AS_CPU_ADAM:
        raise ZeroplanError("training.optimizer", f"{optimizer.value} under {kind.value}: accelerate steps DeepSpeed's "
                                                  "CPU Adam in its place, with Adam's states (allowed: adamw, adam, lion; "
                                                  "or a strategy that keeps the optimizer on the GPU)")
    if optimizer is Optimizer.adam_8bit:
        raise ZeroplanError("training.optimizer", f"adam-8bit under {kind.value}: DeepSpeed's optimizer offload steps "
                                                  "its own CPU optimizer and refuses bitsandbytes' (allowed: adamw, adam, "
                                                  "lion, sgd, sgd-momentum, adafactor; or a strategy that keeps the "
                                                  "optimizer on the GPU)")


def check_partial_offload(request: "PlanRequest") -> None:
    """ZeRO-Offload++'s ratio steps a GPU AdamW beside a CPU Adam: deepspeed 0.19.8
    runtime/zero/stage3.py:313-316 asserts DeepSpeedCPUAdam ("Hybrid Optimizer Only Supports
    DeepSpeedCPUAdam"), which steps Adam or AdamW."""
    if request.strategy.offload_optimizer_ratio is None:
        return
    if request.training.optimizer not in (Optimizer.adam, Optimizer.adamw):
        raise ZeroplanError("strategy.offload_optimizer_ratio", f"needs DeepSpeedCPUAdam, not "
                                                                f"{request.training.optimizer.value} (allowed: adam, adamw)")


MUON_FRAMEWORKS = (Framework.zeroplan, Framework.hf)
"""The stacks whose Muon zeroplan models: torch.optim.Muon beside AdamW under DDP, DeepSpeed's engine
(MuonWithAuxAdam) under ZeRO-1/2; the others build their own optimizers."""


def check_muon(request: "PlanRequest") -> None:
    """Muon is modelled (zeroplan.core.muon) where it was measured (benchmarks/muon_records.py):
    torch.optim.Muon with AdamW on unsharded states (DDP), DeepSpeed 0.19.8's MuonWithAuxAdam under
    its ZeRO stages 1 and 2 with the optimizer on the GPU. Not modelled: DeepSpeed's ZeRO-3 path
    (stage3.py _muon_update_sub_group gathers whole gradients through its own buffers), its CPU
    offload (stage_1_and_2.py _apply_muon_updates_cpu_offload and _muon_allgather_buffers), its
    stage 0 (BF16_Optimizer's Muon exchange), Muon on FSDP's or the reference engine's shards,
    tensor or pipeline parallel matrices, MoE's batched experts, paged or 8-bit forms."""
    training = request.training
    if training.optimizer is not Optimizer.muon:
        return
    kind = request.strategy.kind
    deepspeed = request.convention is StateConvention.deepspeed
    if training.framework not in MUON_FRAMEWORKS:
        raise ZeroplanError("training.optimizer", f"muon is modelled for the stacks {', '.join(f.value for f in MUON_FRAMEWORKS)}, "
                                                  f"not {training.framework.value} (allowed optimizers there: any but muon)")
    allowed = (kind is StrategyKind.ddp and not deepspeed) or (kind in (StrategyKind.zero1, StrategyKind.zero2) and deepspeed)
    if not allowed:
        raise ZeroplanError("training.optimizer", f"muon is not modelled under {kind.value} with the {request.convention.value} "
                                                  "state convention (allowed: ddp, or zero1/zero2 under DeepSpeed's convention)")
    if deepspeed and training.deepspeed_release not in (None, "0.19.8"):
        # 0.13.3 has no Muon (runtime/config.py MUON_OPTIMIZER came later).
        raise ZeroplanError("training.deepspeed_release", f"{training.deepspeed_release}: muon is modelled from "
                                                          "DeepSpeed 0.19.8's engine (allowed: 0.19.8)")
    if training.optimizer_in_backward or training.fsdp_cpu_offload:
        raise ZeroplanError("training.optimizer", "muon steps on the GPU after the backward here (allowed: "
                                                  "optimizer_in_backward and fsdp_cpu_offload off)")
    if request.strategy.offload_optimizer_ratio is not None:
        raise ZeroplanError("strategy.offload_optimizer_ratio", "muon's CPU offload is not modelled (allowed: leave it out)")
    if request.parallel.tp > 1 or request.parallel.pp > 1 or request.parallel.ep > 1:
        raise ZeroplanError("parallel", "muon orthogonalises whole matrices; sharded by tensor, pipeline or expert "
                                        "parallelism it is not modelled (allowed: tp = pp = ep = 1)")
    if request.model.is_moe:
        raise ZeroplanError("training.optimizer", "muon on MoE's batched expert weights is not modelled (allowed: a dense model)")


def default_attention_kernel(model: ModelSpec, framework: Framework | None = None) -> AttentionKernel:
    """The attention a request takes when none is given: eager for ALiBi models, whose
    transformers attention has no fused path (BloomAttention: baddbmm, then an fp32 softmax),
    and under fairseq (torch 1.8's multi_head_attention_forward materialises the scores); the
    fused kernel otherwise."""
    eager = model.position is PositionKind.alibi or framework is Framework.fairseq
    return AttentionKernel.eager if eager else AttentionKernel.flash


def check_attention_kernel(model: ModelSpec, training: TrainingSpec) -> None:
    if training.framework is Framework.fairseq and training.attention_kernel is AttentionKernel.flash:
        raise ZeroplanError("training.attention_kernel", "'flash' under fairseq: its MultiheadAttention runs torch 1.8's "
                            "multi_head_attention_forward, which has no fused kernel (allowed: eager, --attention eager)")
    if model.position is PositionKind.alibi and training.attention_kernel is AttentionKernel.flash:
        raise ZeroplanError("training.attention_kernel", f"'flash' for {model.name!r}: its ALiBi attention runs eager in "
                            "transformers (BloomAttention has no fused path; allowed: eager, --attention eager)")
    if training.attention_kernel is AttentionKernel.sdpa_masked:
        # Only torch 2.1's backend choice and mask handling were read (the 2.1.1 wheel's
        # libtorch_cuda.so and libtorch_cpu.so; docs/memory-model.md, "torch 2.1's SDPA with a
        # mask"), and only the hf profile runs a model's own attention code with such a mask.
        release = training.torch_release
        if training.framework is not Framework.hf or release is None or release.strip().split(".")[:2] != ["2", "1"]:
            raise ZeroplanError("training.attention_kernel", "'sdpa-masked' is torch 2.1's SDPA with a materialised mask under "
                                "the hf profile (allowed: --framework hf with --torch-release 2.1)")


DEFAULT_SEQ_LEN = BatchSpec.model_fields["seq_len"].default
"""The sequence length a request takes when none is given (capped at the model's positions)."""

INT8_STRATEGIES = (StrategyKind.ddp,)
"""Where an LLM.int8 base is measured: bitsandbytes' Int8Params keeps its row scales (SCB) as a
plain attribute that FSDP and ZeRO-3 would not shard, DeepSpeed casts the module it wraps, and
PEFT's FSDP/DeepSpeed guides cover 4-bit bases only (bnb_4bit_quant_storage); DDP, one GPU
included, is what runs it."""

GPTQ_STRATEGIES = (StrategyKind.zero1, StrategyKind.zero2)
"""Where a gptq-int4 base is modelled: DeepSpeed's ZeRO-1/2 engine under hf, as Qwen's Q-LoRA
scripts run it (finetune_qlora_single_gpu.sh and finetune_qlora_ds.sh at e8e1596: ZeRO-2; its
finetune.py warns that FSDP and ZeRO-3 do not work with Q-LoRA). auto-gptq's QuantLinear keeps
its weights as buffers, which FSDP and ZeRO-3 do not shard; DDP's autocast path is not read."""


class MemoryAssumptions(Frozen):
    """Named assumptions about the runtime that no formula derives. Defaults are documented in
    docs/memory-model.md; measurements (``zeroplan validate``) say how well they hold."""

    allocator_reserve_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """With allocator_conf None: memory the PyTorch caching allocator reserves beyond what
    tensors occupy (block rounding and fragmentation), as a fraction of the peak allocated bytes."""
    allocator_conf: str | None = ""
    """A PYTORCH_CUDA_ALLOC_CONF string ("" or "backend:native": PyTorch's defaults) under
    which the caching-allocator model (zeroplan.allocator) replays the step on the usable
    memory: the verdict is whether the replay completes, the peak what it reserves
    (zeroplan.allocator.planner). None: the allocated peak plus allocator_reserve_fraction
    (what the plan search judges on)."""
    exact_capacity: bool = False
    """Under the caching-allocator model, also bisect the OOM capacity (the least memory the
    step completes on) over whole replays: a dozen replays more per plan; the verdict and the
    peak stay the replay's on the usable memory."""
    exact_allocator: bool = False
    """Under the caching-allocator model, replay every verdict's whole trace afresh (the
    oracle) instead of answering from replays of the same trace already made and the least
    memory any replay of it needs (zeroplan.allocator.planner: the same verdicts and peaks)."""
    nccl_channels: int = Field(default=16, gt=0, le=64)
    """Channels each NCCL communicator runs (framework profiles only): NCCL's topology search
    picks them per system and doubles them (NCCL v2.28.3-1 src/graph/connect.cc:452; at most 64),
    so zeroplan cannot know them; 16 is an assumption, not calibrated on a GPU. Every ring
    channel holds one connection's LL, LL128 and Simple buffers (zeroplan.core.nccl_buffers)."""


    @model_validator(mode="after")
    def _check_allocator_conf(self) -> "MemoryAssumptions":
        # "" (the default: PyTorch's own settings) has nothing to check, and checking it would
        # import the allocator's config while PlanRequest's default is built, which imports
        # the specs' base: a cycle when the allocator is imported first.
        if self.allocator_conf:
            # Imported here: the allocator's config module imports the specs' base.
            from zeroplan.allocator.config import parse_alloc_conf

            parse_alloc_conf(self.allocator_conf)
        return self


ATTENTION_RATES = ("matmul", "published", "kernel")
"""PerformanceAssumptions.attention_rate's modes (--attention-rate)."""

# 'kernel' is the default because it predicts the published throughput rows best on sources left
# out of its fit (docs/communication-time.md, "Compute"; docs/validation.md, "Attention at its own rate").
DEFAULT_ATTENTION_RATE = "kernel"
"""PerformanceAssumptions.attention_rate when none is given (--attention-rate's default)."""


class PerformanceAssumptions(Frozen):
    """Named assumptions of the step-time model (docs/communication-time.md)."""

    hardware_flops_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    """Fraction of the GPU's peak bf16 throughput at which the matrix products' and attention's
    executed FLOPs run (zeroplan.core.flops: recomputation and causal attention as the kernels
    run them): HFU in PaLM's terms (Chowdhery et al. 2022, Appendix B), of those kernels only.
    Compute time = executed FLOPs / (peak x this) + the memory-bound kernels' bytes at the GPU's
    copy bandwidth (zeroplan.core.timing.memory_bound_time_s; on a GPU without a measured
    bandwidth this covers every kernel). A published MFU converts to it with
    zeroplan.core.timing.hfu_from_mfu. None (the default): the
    fitted default of the request's mechanism, GPU generation x kernel class
    (zeroplan.core.default_efficiency, fitted on the published throughput rows; the flat 0.4,
    a round figure, where no published row ran that generation or its compute die;
    docs/communication-time.md, "Compute")."""
    memory_bound: str = Field(default="copy-bandwidth", pattern="^(copy-bandwidth|in-hfu)$")
    """Under the 'hfu' compute model, how the memory-bound kernels are timed: 'copy-bandwidth',
    apart from the HFU at the GPU's copy bandwidth where the GPU has a measured one
    (zeroplan.core.timing.memory_bound_time_s); 'in-hfu', inside the HFU with every other
    kernel, as on a GPU without a measured bandwidth (the flat HFU 0.4 applies only to such
    GPUs, so benchmarks/step_time_accuracy.py scores it this way)."""
    compute_model: str = Field(default="hfu", pattern="^(hfu|roofline)$")
    """How compute is timed: 'hfu', every executed FLOP at hardware_flops_utilization x peak and
    the memory-bound kernels at the copy bandwidth (memory_bound);
    'roofline', kernel by kernel against the GPU's measured ceilings (zeroplan.core.roofline:
    matrix products at the achievable matmul rate, attention with its softmax exponentials,
    memory-bound kernels and the optimizer step at the achievable memory bandwidth)."""
    attention_rate: str = Field(default=DEFAULT_ATTENTION_RATE, pattern="^(matmul|published|kernel)$")
    """Under the 'hfu' compute model, the rate of attention's own FLOPs (QK^T and AV, forward,
    backward and recomputed; zeroplan.core.attention_rate, docs/communication-time.md,
    "Compute"): 'matmul', the matrix products' rate (one HFU for every executed FLOP);
    'published', that rate times the kernel's published rate relative to the GPU's achievable
    matmul rate; 'kernel' (the default), the kernel's published TFLOP/s itself times its fitted
    efficiency (attention_efficiency), whatever the HFU (both: the matmul rate on a GPU generation
    or kernel without a published rate). On the 250 published throughput rows, with the fitted
    default HFU on sources left out of the fit, 'kernel' is off by a median 6.1 % (max 30.5 %),
    'published' 8.9 % (46.0 %), 'matmul' 11.0 % (121.0 %); calibrated from one row 7.5 %, 7.6 % and
    14.1 % (docs/validation.md, "Attention at its own rate")."""
    attention_efficiency: float | None = Field(default=None, gt=0, le=4)
    """Under --attention-rate kernel, attention's achieved rate over its kernel's published rate
    (zeroplan.core.attention_efficiency); None: the fitted default of the request's attention
    kernel (1 where no published source spans enough sequence lengths to fit it). An efficiency
    file solved under 'kernel' carries the one it was solved at."""
    overlap_grad_reduce: bool | None = None
    """True: data-parallel gradient reductions run during the backward, hidden behind its compute
    as far as it lasts (FSDP's hooks, DeepSpeed ZeRO-3's overlap_comm, Megatron-LM's
    --overlap-grad-reduce). False: they run after the backward, exposed (Megatron-LM's default,
    overlap_grad_reduce False in megatron/core/distributed/distributed_data_parallel_config.py;
    DeepSpeed ZeRO-1/2's overlap_comm default False). None: the framework's stack decides
    (zeroplan.core.communication.overlaps_grad_reduce: DeepSpeed's ZeRO-1/2, under the reference
    transformer and the hf stack, only with StrategySpec.deepspeed_overlap_comm; --framework
    megatron not, megatron-core's default; every other stack and strategy the planner runs does)."""
    overlap_param_gather: bool = False
    """The all-gather of updated parameters after a ZeRO-1/2 or distributed-optimizer step runs
    during the next forward (Megatron-LM --overlap-param-gather) instead of in the step,
    exposed (the default, DeepSpeed's and Megatron-LM's)."""
    tp_comm_overlap: bool = False
    """Each block's tensor-parallel all-gathers and reduce-scatters overlap its matrix products
    (Megatron-LM --tp-comm-overlap, TransformerEngine's userbuffers; torchtitan's async TP), so
    they hide behind the phase's compute instead of blocking it (the default)."""
    fp32_grad_accumulation: bool | None = None
    """DeepSpeed BF16_Optimizer's fp32 gradient accumulation, its per-micro-batch copies timed as
    memory-bound passes (zeroplan.core.bf16_accumulation_time). None: where the
    megatron-deepspeed profile runs BF16_Optimizer; True: a run that used it where the profile does
    not plan it (bf16-mixed, zero1): under the reference transformer, or megatron-deepspeed's
    deepspeed_release 2022-bigscience, whose BF16_Optimizer (BLOOM's Megatron-DeepSpeed rows) drops
    the bf16 gradients before each backward instead of zeroing them."""
    cpu_adam_copies_parameters: bool = False
    """DeepSpeed before 0.9.0 under ZeRO-2 offload (stage2.py at v0.3.0: self.optimizer.step(
    fp16_param_groups=...)): DeepSpeedCPUAdam writes each updated tile in half precision straight
    to the GPU as it goes, so the parameters' up-copy overlaps the CPU step and no separate cast
    pass runs (zeroplan.core.deepspeed_offload_time). False: DeepSpeed since 0.9.0 (#3097
    disabled that path), the cast and the up-copy after the CPU step."""
    algorithm: str = Field(default="auto", pattern="^(auto|ring|tree|nvls|nvls_tree|collnet)$")
    """NCCL algorithm of each collective call: 'auto' = the one NCCL's tuning model predicts
    fastest (zeroplan/core/algorithms.py); a name forces it wherever NCCL offers it for that
    collective and cluster, and ring elsewhere (NCCL's own fallback)."""
    bandwidth: str = Field(default="achievable", pattern="^(achievable|nominal)$")
    """'achievable': an algorithm that a published (or calibrated) nccl-tests result of the GPU
    measured runs at that result's efficiency (GpuSpec.achievable); 'nominal': datasheet link
    rates only."""


# deepspeed 0.19.8 utils/groups.py _create_zero_param_parallel_group: hpZ's groups are runs of
# zero_hpz_partition_size consecutive ranks of the whole world (_ensure_divisibility); MiCS
# (deepspeed/runtime/zero/mics_utils.py _generate_mics_config, before its removal) reshapes the
# world into rows of mics_shard_size ranks and asserts they divide it. Neither is built over a
# tensor-, context- or pipeline-parallel mesh here, so both are planned under data parallelism.
ZERO3_GROUP_FIELDS = {"zero3-hpz": "hpz_partition_size", "zero3-mics": "mics_shard_size",
                      "zero3-zeropp": "hpz_partition_size"}
"""The StrategySpec field of each ZeRO-3 variant's group (the command line names its flag)."""


def check_zero3_groups(request: "PlanRequest") -> None:
    """Refuse a zero3-hpz or zero3-mics group that does not divide the ranks, or a layout with
    model parallelism (docs/memory-model.md, "ZeRO++ hpZ and MiCS")."""
    kind = request.strategy.kind
    if kind.value not in ZERO3_GROUP_FIELDS:
        return
    field = ZERO3_GROUP_FIELDS[kind.value]
    parallel = request.parallel
    if parallel.model_parallel_size > 1 or parallel.ep > 1:
        raise ZeroplanError("strategy", f"{kind.value!r} is planned under data parallelism only (allowed: tp, cp, pp "
                                        f"and ep 1 with {kind.value})")
    if kind.quantizes_communication and not request.training.finetune.trains_everything:
        # qwZ quantizes the gathered weights as one flat int8 buffer per unit: planned for units
        # whose tensors all train (one dtype), i.e. full training.
        raise ZeroplanError("strategy", f"{kind.value!r} is planned for full training only (allowed: no --lora-rank, "
                                        f"--frozen-blocks or frozen embeddings with {kind.value})")
    group = request.hpz_group_size if kind.uses_hpz else request.shard_group_size
    ranks = request.state_group_size
    if ranks % group:
        given = "" if getattr(request.strategy, field) else " (the default: a node's GPUs)"
        raise ZeroplanError(f"strategy.{field}", f"{kind.value}'s group of {group}{given} does not divide the {ranks} data-parallel ranks "
                                   f"(allowed: a divisor of {ranks})")


MEGATRON_VOCAB_MULTIPLE = 128
"""Megatron-LM's --make-vocab-size-divisible-by default (megatron/training/arguments.py)."""


# Compiled blocks were measured under torchtitan's own tensor (with and without sequence) and
# context parallelism (benchmarks/compiled-parallel-records); pipeline parallelism runs the same
# compiled blocks on each stage (torchtitan 0.3.0 distributed/pipeline_parallel.py pipeline_llm
# calls parallelize_llama, apply_compile included, on every stage's model part). Not measured:
# another framework's model parallelism compiled and expert parallelism (compile is modelled
# for dense models only).
# torchtitan 9dec370 parallelisms/parallelize_llama.py parallelize_llama: "Async TP requires
# --training.compile" (the fusion is an inductor pass, torch._inductor.config._micro_pipeline_tp).
def check_compiled_layout(training: TrainingSpec, parallel: ParallelSpec) -> None:
    """Refuse, in one line naming the field, a compiled layout no record covers, or DeepSpeed's
    checkpoint partitioning over a sequence-parallel shard."""
    if parallel.async_tp and (not training.compile or training.framework is not Framework.torchtitan):
        raise ZeroplanError("parallel.async_tp", "is torchtitan's inductor pass (allowed: with --compile under --framework torchtitan)")
    if training.float8 is Float8Recipe.te_delayed and (parallel.model_parallel_size > 1 or parallel.ep > 1):
        # llm-foundry's amp_fp8 rows ran FSDP alone; TransformerEngine's tensor-parallel float8
        # gathers (module/linear.py gather_along_first_dim of the float8 input) are not modelled.
        raise ZeroplanError("float8", "te-delayed is modelled under data parallelism alone (allowed: tp, cp, pp and ep 1)")
    if training.float8 is Float8Recipe.rowwise_with_gw_hp and parallel.tp > 1:
        # Its compiled block was measured without tensor parallelism (benchmarks/compiled-records);
        # the float8 tensor-parallel records are tensorwise's (benchmarks/compiled-parallel-records).
        raise ZeroplanError("float8", "rowwise_with_gw_hp is modelled without tensor parallelism (allowed: tp 1, or "
                                      "recipe rowwise or tensorwise)")
    if training.partition_activations and parallel.sequence_parallel:
        # Megatron's sequence parallelism already splits the kept block input over the tensor-
        # parallel ranks; DeepSpeed's partitioning of that shard again is not modelled.
        raise ZeroplanError("partition_activations", "is planned without sequence parallelism (allowed: "
                                                     "--no-sequence-parallel, or no partitioning)")
    if not training.compile:
        return
    if parallel.ep > 1:
        raise ZeroplanError("compile", "compiled blocks were measured without expert parallelism (allowed: ep 1)")
    if parallel.model_parallel_size > 1 and training.framework is not Framework.torchtitan:
        raise ZeroplanError("compile", f"compiled blocks under tp, cp or pp were measured for torchtitan, not "
                                       f"{training.framework.value} (allowed: tp, cp and pp 1)")
    if not compiled_policy_measured(training, training.activation_checkpointing, parallel):
        raise ZeroplanError("float8", f"under tensor parallelism was measured with activation checkpointing none and "
                                      f"full, not {training.activation_checkpointing.value!r} (allowed: none, full, or tp 1)")


# transformers 4.56.2's Trainer runs a bf16-mixed model under torch.autocast only on its DDP path
# (accelerate's prepare_model wraps the forward in autocast, then compiles it); under FSDP2
# (MixedPrecisionPolicy) and DeepSpeed (the engine's cast, no autocast) peft's adapters compute in
# another dtype without it. hf's LoRA block was measured compiled under that autocast only
# (benchmarks/compiled-finetune-records, zeroplan.core.compiled.compiled_finetune_measured).
def check_compiled_strategy(training: TrainingSpec, strategy: StrategyKind) -> None:
    """Refuse, in one line naming the field, hf's compiled LoRA under a strategy whose block was
    not measured compiled."""
    if (training.compile and training.framework is Framework.hf and training.finetune.is_lora
            and strategy is not StrategyKind.ddp):
        raise ZeroplanError("strategy", f"hf's compiled LoRA block was measured under the Trainer's DDP autocast, not "
                                        f"{strategy.value} (allowed: ddp, or without compile)")


# The frameworks the before-validators below look for, each as the enum member and its name (a
# dict's training may give either), built once: the validators run at every request fit() makes
# for a strategy, and an enum member's .value is a Python-level property read.
_FAIRSEQ = (Framework.fairseq, Framework.fairseq.value)
_HF = (Framework.hf, Framework.hf.value)
# The Megatron-DeepSpeed fork pads the vocabulary as Megatron-LM does (_megatron_vocab_padding).
_MEGATRONS = (Framework.megatron, Framework.megatron.value, Framework.megatron_deepspeed, Framework.megatron_deepspeed.value)
_UNTIES_EMBEDDINGS_NAMES = frozenset(f.value for f in UNTIES_EMBEDDINGS)
_BUILDS_NO_DROPOUT_NAMES = frozenset(f.value for f in BUILDS_NO_DROPOUT)


def _named_training_fields(training: object) -> set[str]:
    """The TrainingSpec fields a request's ``training`` names (a dict's keys, a spec's fields set)."""
    if isinstance(training, TrainingSpec):
        return training.model_fields_set
    return set(training) if isinstance(training, dict) else set()


def _recipe_inputs(data: dict) -> tuple[TrainingSpec, str, int] | None:
    """A request's training (as a spec), model name and GPU count as a before-validator meets
    them, where its framework is named; None where any is missing or invalid (the request's own
    validation answers)."""
    training, model, cluster = data.get("training"), data.get("model"), data.get("cluster")
    if isinstance(training, dict):
        if training.get("framework") is None:
            return None
        try:
            spec = TrainingSpec(**training)
        except (ZeroplanError, ValueError):
            return None
    elif isinstance(training, TrainingSpec):
        spec = training
    else:
        return None
    name = model.name if isinstance(model, ModelSpec) else model.get("name") if isinstance(model, dict) else None
    defaults = ClusterSpec.model_fields
    world = (cluster.world_size if isinstance(cluster, ClusterSpec)
             else cluster.get("num_nodes", defaults["num_nodes"].default)
             * cluster.get("gpus_per_node", defaults["gpus_per_node"].default) if isinstance(cluster, dict) else None)
    if not isinstance(name, str) or not isinstance(world, int):
        return None
    return spec, name, world


def _with_training_fields(data: dict, values: dict[str, object]) -> dict:
    """A before-validator's request data with ``values`` named in its training (a dict's entries
    replaced, or a spec rebuilt from the fields it names and these, so they count as named)."""
    training = data["training"]
    if isinstance(training, dict):
        return {**data, "training": {**training, **values}}
    fields = {field: getattr(training, field) for field in training.model_fields_set}
    return {**data, "training": TrainingSpec(**{**fields, **values})}


def _check_launch_settings(request: "PlanRequest") -> None:
    """The refusals of a launch setting that the planner makes past the request's own validation
    (zeroplan.core.compiled.check_compiled, zeroplan.core.plan's optimizer-in-backward check),
    asked of a request planned with a framework configuration's settings."""
    check_float8_gpu(request.training, request.cluster.gpu)
    check_float8_compiled(request.training)
    check_optimizer_in_backward(request.training, request.batch.grad_accum_steps)
    check_activation_offloading(request.training)


def _raw_framework(training: object) -> object:
    """The framework of a request's ``training`` as a before-validator meets it: a TrainingSpec's,
    a dict's entry (a Framework or its name), else None."""
    if isinstance(training, TrainingSpec):
        return training.framework
    return training.get("framework") if isinstance(training, dict) else None


# accelerate 1.10.1's FSDP1 path (Accelerator.prepare_model: FullyShardedDataParallel under
# fsdp_version 1) was measured at full size for transformers' Llama in bf16-mixed, full
# fine-tuning, one micro-batch, FULL_SHARD and SHARD_GRAD_OP, and under FULL_SHARD PEFT LoRA
# (bf16 base, no DoRA) and accumulation over 2 micro-batches (benchmarks/framework-fsdp1-step-records,
# zeroplan.frameworks.hf_fsdp1_step), and PEFT QLoRA over a bitsandbytes nf4 base stored in bf16
# with and without CPUOffload(offload_params=True) (benchmarks/framework-fsdp1-qlora-step-records);
# the rest of what an hf request can ask is refused under it
# rather than planned unmeasured (tp, cp and pp are refused for hf whatever its FSDP).
HF_FSDP1_STRATEGIES = (StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op)
"""The FSDP strategies hf's FSDP1 (StrategySpec.fsdp1_root_stays_gathered) was measured under."""


def check_hf_deepspeed_convention(request: "PlanRequest") -> None:
    """Under hf the deepspeed state convention names DeepSpeed's stage 0 (ddp); its ZeRO
    strategies run DeepSpeed's engine anyway, and FSDP is accelerate's torch FSDP."""
    kind = request.strategy.kind
    if (request.training.framework is Framework.hf and request.training.state_convention is StateConvention.deepspeed
            and kind.is_fsdp):
        raise ZeroplanError("state_convention", f"deepspeed under hf plans DeepSpeed's stage 0 (ddp), not "
                                                f"{kind.value} (allowed: ddp or a ZeRO strategy)")


def check_hf_fsdp1(request: "PlanRequest") -> None:
    """Refuse, in one line naming the field, an hf FSDP request under FSDP1 (fit --fsdp-version 1)
    that its measured step does not cover."""
    training, kind = request.training, request.strategy.kind
    if training.framework is not Framework.hf or not request.strategy.fsdp1_root_stays_gathered or not kind.is_fsdp:
        return
    allowed = ", ".join(k.value for k in HF_FSDP1_STRATEGIES)
    refusals = (
        ("strategy", kind not in HF_FSDP1_STRATEGIES, f"{kind.value!r} (allowed: {allowed})"),
        ("precision", training.precision is not Precision.bf16_mixed, f"{training.precision.value!r} (allowed: bf16-mixed)"),
        ("finetune", not training.finetune.trains_everything and not training.finetune.is_lora,
         "frozen blocks or embeddings (allowed: full fine-tuning, PEFT LoRA)"),
        ("finetune.kbit_fp32_cast", training.finetune.quantize.is_quantized and training.finetune.kbit_fp32_cast,
         "peft's fp32 cast of the norms (a FlatParameter holds one dtype, and trl skips the cast for a sharded "
         "QLoRA; allowed: --no-kbit-fp32-cast)"),
        ("finetune.dora", training.finetune.dora, "DoRA (allowed: false)"),
        ("strategy", kind is not StrategyKind.fsdp_full_shard and training.finetune.is_lora,
         f"LoRA under {kind.value!r} (allowed: fsdp-full-shard)"),
        ("batch.grad_accum_steps", kind is not StrategyKind.fsdp_full_shard and request.batch.grad_accum_steps > 1,
         f"{request.batch.grad_accum_steps} under {kind.value!r} (accelerate's no_sync accumulation; allowed: 1, "
         "or fsdp-full-shard)"),
        ("fsdp_cpu_offload", kind is not StrategyKind.fsdp_full_shard and training.fsdp_cpu_offload,
         f"CPUOffload under {kind.value!r} (allowed: fsdp-full-shard)"),
        ("finetune.base_dtype", training.finetune.is_lora and not training.finetune.loads_base_in_bf16,
         f"{training.finetune.base_dtype.value!r} (allowed: bf16)"),
        ("compile", training.compile, "torch.compile (allowed: without it)"),
        ("float8", training.float8 is not None, f"{training.float8} (allowed: none)"),
        ("fused_linear_cross_entropy", training.fused_linear_cross_entropy, "liger-kernel's loss (allowed: HF's own)"),
        ("model", not request.model.is_dense_llama_layout, f"{request.model.name!r} (allowed: a dense Llama-layout model)"),
    )
    for field, refused, detail in refusals:
        if refused:
            raise ZeroplanError(field, f"hf under FSDP1 (fsdp_version 1) was not measured with {detail}")


def compiled_policy_measured(training: TrainingSpec, policy: ActivationCheckpointing, parallel: ParallelSpec) -> bool:
    """Whether ``policy`` was measured for a compiled float8 block under the layout's tensor
    parallelism (none and full were; everything else is as without float8)."""
    return not (training.compile and training.float8 is not None and parallel.tp > 1
                and policy not in (ActivationCheckpointing.none, ActivationCheckpointing.full))


class PlanRequest(Frozen):
    """Model, numerics, batch, cluster and strategy: everything a prediction depends on."""

    model: ModelSpec
    """The architecture."""
    training: TrainingSpec = TrainingSpec()
    """Precision, optimizer, checkpointing."""
    batch: BatchSpec = BatchSpec()
    """Micro-batch, sequence length, accumulation."""
    cluster: ClusterSpec
    """GPUs and nodes."""
    strategy: StrategySpec
    """Data-parallel sharding strategy."""
    parallel: ParallelSpec = ParallelSpec()
    """Tensor, context and pipeline parallelism composed with the strategy (none by default)."""
    assumptions: MemoryAssumptions = MemoryAssumptions()
    """Runtime assumptions."""
    performance: PerformanceAssumptions = PerformanceAssumptions()
    """Step-time assumptions."""

    @model_validator(mode="before")
    @classmethod
    def _default_seq_len_fits_the_model(cls, data: object) -> object:
        """A batch whose seq_len was not given takes min(4096, the model's max_positions), as
        the command line's --seq-len does: GPT-2's 1024 positions, not a refusal."""
        if not isinstance(data, dict) or "model" not in data:
            return data
        model = data["model"]
        if isinstance(model, ModelSpec):
            positions = model.max_positions
        elif isinstance(model, dict):
            positions = model.get("max_positions", ModelSpec.model_fields["max_positions"].default)
        else:
            return data  # the model's own validation answers
        training = data.get("training")
        framework = _raw_framework(training)
        fairseq = framework in _FAIRSEQ
        if isinstance(model, ModelSpec) and (model.position is PositionKind.alibi or fairseq):
            data = _default_attention(data, default_attention_kernel(model, Framework.fairseq if fairseq else None))
        if not isinstance(positions, int) or positions < 1:
            return data
        batch = data.get("batch")
        if batch is None:
            return {**data, "batch": BatchSpec(seq_len=min(DEFAULT_SEQ_LEN, positions))}
        if isinstance(batch, BatchSpec) and "seq_len" not in batch.model_fields_set:
            return {**data, "batch": batch.model_copy(update={"seq_len": min(batch.seq_len, positions)})}
        if isinstance(batch, dict) and "seq_len" not in batch:
            return {**data, "batch": {**batch, "seq_len": min(DEFAULT_SEQ_LEN, positions)}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _precision_the_gpu_runs(cls, data: object) -> object:
        """A training that names no precision, on a GPU without bf16 tensor cores (a V100), is
        planned in what its framework runs there (precision_without_bf16), not the bf16 default
        torch would run emulated, as the command line's default does; a named one is kept."""
        if not isinstance(data, dict):
            return data
        cluster, training = data.get("cluster"), data.get("training")
        if not isinstance(cluster, ClusterSpec) or cluster.gpu.has_bf16_tensor_cores:
            return data
        if training is None:
            return {**data, "training": TrainingSpec(precision=precision_without_bf16(Framework.zeroplan))}
        if isinstance(training, TrainingSpec) and "precision" not in training.model_fields_set:
            return {**data, "training": training.model_copy(update={"precision": precision_without_bf16(training.framework)})}
        if isinstance(training, dict) and "precision" not in training:
            try:
                framework = Framework(training.get("framework", Framework.zeroplan))
            except ValueError:
                return data  # the training's own validation answers
            return {**data, "training": {**training, "precision": precision_without_bf16(framework).value}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _framework_unties_the_head(cls, data: object) -> object:
        """A framework whose model code always builds its own output projection
        (UNTIES_EMBEDDINGS: litgpt) is planned with the model untied, as it holds it."""
        if not isinstance(data, dict):
            return data
        training, model = data.get("training"), data.get("model")
        framework = _raw_framework(training)
        if framework is None or framework not in _UNTIES_EMBEDDINGS_NAMES:
            return data
        if isinstance(model, ModelSpec) and model.tied_embeddings:
            return {**data, "model": model.model_copy(update={"tied_embeddings": False})}
        if isinstance(model, dict) and model.get("tied_embeddings"):
            return {**data, "model": {**model, "tied_embeddings": False}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _framework_builds_no_dropout(cls, data: object) -> object:
        """A framework whose model code has no dropout (BUILDS_NO_DROPOUT: litgpt) is planned
        with the model's dropouts at zero."""
        if not isinstance(data, dict):
            return data
        training, model = data.get("training"), data.get("model")
        framework = _raw_framework(training)
        if framework is None or framework not in _BUILDS_NO_DROPOUT_NAMES:
            return data
        off = {"attention_dropout": 0.0, "hidden_dropout": 0.0}
        if isinstance(model, ModelSpec) and (model.attention_dropout or model.hidden_dropout):
            return {**data, "model": model.model_copy(update=off)}
        if isinstance(model, dict) and (model.get("attention_dropout") or model.get("hidden_dropout")):
            return {**data, "model": {**model, **off}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _megatron_vocab_padding(cls, data: object) -> object:
        """Megatron-LM pads the tokenizer's vocabulary to a multiple of 128 x tp before building
        the model (megatron/core/tokenizers/utils/build_tokenizer.py vocab_size_with_padding,
        Megatron-LM d98e8a6; --make-vocab-size-divisible-by 128 by default): a megatron request
        plans the padded embedding, head and logits, as Megatron-LM trains them."""
        if not isinstance(data, dict):
            return data
        training, model, parallel = data.get("training"), data.get("model"), data.get("parallel")
        framework = _raw_framework(training)
        # The Megatron-DeepSpeed fork pads alike (megatron/tokenizer/tokenizer.py
        # _vocab_size_with_padding, megatron/arguments.py --make-vocab-size-divisible-by 128).
        if framework not in _MEGATRONS or not isinstance(model, ModelSpec):
            return data
        tp = parallel.tp if isinstance(parallel, ParallelSpec) else (parallel or {}).get("tp", 1)
        multiple = MEGATRON_VOCAB_MULTIPLE * tp
        padded = -(-model.vocab_size // multiple) * multiple
        if padded == model.vocab_size:
            return data
        return {**data, "model": model.model_copy(update={"vocab_size": padded})}

    @model_validator(mode="before")
    @classmethod
    def _accelerate_fsdp1_settings(cls, data: object) -> object:
        """transformers 4.56.2 training_args.py (lines 2020-2022) sets FSDP_BACKWARD_PREFETCH to
        fsdp_config's backward_prefetch, default "NO_PREFETCH", and FSDP_FORWARD_PREFETCH false;
        accelerate 1.10.1 utils/dataclasses.py (lines 1832-1833) turns NO_PREFETCH into None and
        Accelerator.prepare_model passes both to FullyShardedDataParallel: under FSDP1 (hf with
        StrategySpec.fsdp1_root_stays_gathered) no unit is gathered ahead, unless the strategy
        names prefetch_units.

        With gradient accumulation the Trainer runs every micro-batch but the last under
        accelerator.no_sync (trainer.py lines 2665-2671), which enters FSDP1's own no_sync
        (accelerator.py no_sync: getattr(model, "no_sync")), whatever accelerate's
        GradientAccumulationPlugin says: the unsharded gradients are kept to the last
        micro-batch (StrategySpec.keep_unsharded_grads_on_accum set). It is set whatever the
        request's accumulation (the planner reads it only where a step accumulates), so a copy
        of the request at another accumulation (the plan search's, made without validation)
        keeps it."""
        if not isinstance(data, dict):
            return data
        training, strategy = data.get("training"), data.get("strategy")
        framework = _raw_framework(training)
        if framework not in _HF:
            return data
        if isinstance(strategy, StrategySpec) and strategy.fsdp1_root_stays_gathered:
            named = strategy.model_fields_set
        elif isinstance(strategy, dict) and strategy.get("fsdp1_root_stays_gathered"):
            named = set(strategy)
        else:
            return data
        update = {} if "prefetch_units" in named else {"prefetch_units": 0}
        if not (strategy.keep_unsharded_grads_on_accum if isinstance(strategy, StrategySpec)
                else strategy.get("keep_unsharded_grads_on_accum", False)):
            update["keep_unsharded_grads_on_accum"] = True
        if not update:
            return data
        if isinstance(strategy, StrategySpec):
            return {**data, "strategy": strategy.model_copy(update=update)}
        return {**data, "strategy": {**strategy, **update}}

    @model_validator(mode="before")
    @classmethod
    def _fairscale_gathers_no_unit_ahead(cls, data: object) -> object:
        """fairscale 05ce7971 fully_sharded_data_parallel.py: forward() and _pre_backward_hook
        gather the unit's own parameters only (_rebuild_full_params), no unit ahead: a fairseq
        request plans no prefetched unit unless its strategy names one."""
        if not isinstance(data, dict):
            return data
        training, strategy = data.get("training"), data.get("strategy")
        framework = _raw_framework(training)
        if framework not in _FAIRSEQ:
            return data
        if isinstance(strategy, StrategySpec) and "prefetch_units" not in strategy.model_fields_set:
            return {**data, "strategy": strategy.model_copy(update={"prefetch_units": 0})}
        if isinstance(strategy, dict) and "prefetch_units" not in strategy:
            return {**data, "strategy": {**strategy, "prefetch_units": 0}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _framework_launch_allocator(cls, data: object) -> object:
        """A request whose assumptions name no allocator_conf is judged under the one its
        framework's launcher sets for its node count (launch_allocator_conf: torchtitan's
        expandable segments on one node, PyTorch's defaults under its multi-node launcher), as
        a user of that framework runs it; one that names any (even "") keeps its own."""
        if not isinstance(data, dict):
            return data
        training = data.get("training")
        framework = _raw_framework(training)
        cluster = data.get("cluster")
        nodes = (cluster.num_nodes if isinstance(cluster, ClusterSpec)
                 else cluster.get("num_nodes", 1) if isinstance(cluster, dict) else 1)
        try:
            launch = launch_allocator_conf(Framework(framework), nodes) if framework is not None else None
        except ValueError:
            return data  # the training's own validation answers
        if launch is None:
            return data
        assumptions = data.get("assumptions")
        if assumptions is None:
            return {**data, "assumptions": MemoryAssumptions(allocator_conf=launch)}
        if isinstance(assumptions, MemoryAssumptions) and "allocator_conf" not in assumptions.model_fields_set:
            return {**data, "assumptions": MemoryAssumptions(**{**dict(assumptions), "allocator_conf": launch})}
        if isinstance(assumptions, dict) and "allocator_conf" not in assumptions:
            return {**data, "assumptions": {**assumptions, "allocator_conf": launch}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _framework_recipe_checkpointing(cls, data: object) -> object:
        """A request whose training names no activation_checkpointing is planned with the one
        the framework's own configuration of its model sets (recipe_checkpointing: torchtitan's
        llama3_8b selective per-op, llama3_70b full; torchtune's per method and device count),
        as a user who runs that configuration trains; one that names any (even none) keeps its own."""
        if not isinstance(data, dict):
            return data
        training = data.get("training")
        if "activation_checkpointing" in _named_training_fields(training):
            return data
        inputs = _recipe_inputs(data)
        if inputs is None:
            return data
        spec, name, world = inputs
        default = training_recipe_checkpointing(name, spec, world)
        if default is None:
            return data
        mode, config = default

        def with_mode(policy: ActivationCheckpointing) -> dict:
            return _with_training_fields(data, {"activation_checkpointing": policy})

        resolved = with_mode(mode)
        if mode is ActivationCheckpointing.none:
            return resolved
        try:
            cls(**resolved)
        except ZeroplanError as refused:
            # What the request asks beside the policy may be planned only under another one (a
            # float8 tensor-parallel block was measured without selective-op): where it is
            # planned without checkpointing, the default is what is refused, and the refusal
            # says whose default it was; otherwise the request's own refusal stands.
            cls(**with_mode(ActivationCheckpointing.none))
            raise ZeroplanError("activation_checkpointing",
                                f"not named, so {spec.framework.value}'s {config} config's {mode.value} was "
                                f"planned, and {refused.field} refuses it: {refused.detail}") from None
        return resolved

    @model_validator(mode="before")
    @classmethod
    def _framework_recipe_launch(cls, data: object) -> object:
        """A request whose training leaves unnamed a setting the framework's own configuration
        of its model sets beside its checkpointing (recipe_launch_settings: torchtitan 0.3.0's
        llama3_405b compiles, converts the linears but the output projection to rowwise float8
        and, where there is tensor parallelism, runs it asynchronously, ParallelSpec.async_tp;
        torchtune's 8B full single-device configurations step a paged 8-bit AdamW in backward,
        its 70B full ones offload to the host and step unfused) is planned with that setting, as
        a user who runs that configuration trains; each one the request names (even off) it keeps."""
        if not isinstance(data, dict):
            return data
        inputs = _recipe_inputs(data)
        if inputs is None:
            return data
        spec, name, world = inputs
        found = recipe_launch_settings(name, spec, world)
        if found is None:
            return data
        settings, async_tp, config = found
        training, parallel = data.get("training"), data.get("parallel")
        named = _named_training_fields(training)
        defaults = {field: value for field, value in settings.items() if field not in named}
        float8 = defaults.get("float8", spec.float8)
        if float8 in (None, Float8Recipe.te_delayed):
            # torchtitan's filter_fqns belongs to its float8 converter: without one it sets nothing.
            defaults.pop("float8_skips_output", None)
        if "optimizer" in named:
            # The optimizer a torchtune configuration builds is one component with its paging
            # (PagedAdamW8bit) and its step (AdamW's fused): one named in its place is the user's own.
            defaults.pop("paged_optimizer", None)
            defaults.pop("optimizer_loop", None)
        try:
            layout = parallel if isinstance(parallel, ParallelSpec) else ParallelSpec(**(parallel or {}))
        except (ZeroplanError, ValueError, TypeError):
            return data  # the layout's own validation answers
        default_async = (async_tp and layout.tp > 1
                         and "async_tp" not in layout.model_fields_set)
        if not defaults and not default_async:
            return data

        def with_settings(values: dict[str, object], async_value: bool | None) -> dict:
            out = _with_training_fields(data, values)
            if async_value is not None:
                layout_fields = {field: getattr(layout, field) for field in layout.model_fields_set}
                out["parallel"] = ParallelSpec(**{**layout_fields, "async_tp": async_value})
            return out

        try:
            resolved = with_settings(defaults, True if default_async else None)
            _check_launch_settings(cls(**resolved))
        except ZeroplanError as refused:
            # As _framework_recipe_checkpointing: where the request is planned with each setting
            # it did not name left off, what is refused is the configuration's setting, and the
            # refusal says whose it was; otherwise the request's own refusal stands.
            off = {field: TrainingSpec.model_fields[field].default for field in defaults}
            _check_launch_settings(cls(**with_settings(off, False if default_async else None)))
            asked = {**defaults, **({"async_tp": True} if default_async else {})}
            field = refused.field.removeprefix("parallel.").removeprefix("training.")
            blamed = [field] if field in asked else list(asked)
            words = ", ".join(setting_words(f, asked[f]) for f in blamed)
            raise ZeroplanError("parallel.async_tp" if blamed[0] == "async_tp" else blamed[0],
                                f"not named, so {spec.framework.value}'s {config} config's {words} was planned, and "
                                f"{refused.field} refuses it: {refused.detail}") from None
        return resolved

    @property
    def recipe_launch_words(self) -> tuple[str, tuple[str, ...]]:
        """The framework configuration whose launch settings this request plans, and the words
        for each planned at its value (planned_recipe_settings); ("", ()) where none is."""
        return planned_recipe_settings(self.model.name, self.training, self.parallel, self.cluster.world_size)

    @property
    def recipe_checkpointing_name(self) -> str | None:
        """The framework configuration whose activation checkpointing this request plans (its
        own default for the model: recipe_checkpointing), None where it is not that one's."""
        return planned_recipe_config(self.model.name, self.training, self.cluster.world_size)

    @property
    def allocator_conf_is_launch_default(self) -> bool:
        """Whether the allocator configuration judged under is the framework launcher's own."""
        launch = launch_allocator_conf(self.training.framework, self.cluster.num_nodes)
        return launch is not None and self.assumptions.allocator_conf == launch

    @model_validator(mode="after")
    def _check_groups(self) -> "PlanRequest":
        check_paged_optimizer(self.training, self.strategy.kind)
        check_offloaded_optimizer(self.training, self.strategy.kind)
        check_seq_len(self.model, self.batch)
        check_attention_kernel(self.model, self.training)
        if self.model.moe_capacity_factor is not None and self.training.framework is Framework.torchtitan:
            # torchtitan 0.3.0 routes dropless (its MoE sends every token to its top-k experts,
            # no capacity); a capacity factor would change an answer about a run that has none.
            raise ZeroplanError("model.moe_capacity_factor", "torchtitan's MoE routes dropless, without a capacity "
                                                             "(allowed: leave it out with framework torchtitan)")
        check_device_map(self.parallel, self.model, self.cluster, self.strategy.kind, self.training)
        check_parallel(self.parallel, self.model, self.cluster, self.batch, self.strategy.kind, self.training.framework)
        check_ulysses_training(self.parallel, self.training.framework, self.training)
        # A device map's pipeline ranks each hold their layers' adapters whole (no sharding).
        model_parallel = 1 if self.parallel.device_map is not None else self.parallel.model_parallel_size * self.parallel.ep
        check_finetune(self.training.finetune, self.model, self.training.framework, model_parallel,
                       checkpointing=self.training.activation_checkpointing is not ActivationCheckpointing.none)
        check_saved_module_training(
            self.training.finetune, strategy_is_plain_ddp=self.strategy.kind is StrategyKind.ddp,
            on_device_map=self.parallel.device_map is not None,
            optimizer_elementwise=self.training.optimizer in (Optimizer.adamw, Optimizer.adam, Optimizer.sgd,
                                                              Optimizer.sgd_momentum, Optimizer.lion),
            paged_optimizer=self.training.paged_optimizer, fp16_mixed=self.training.precision is Precision.fp16_mixed)
        check_adapter_variant_training(
            self.training.finetune, self.training.framework, strategy_is_plain_ddp=self.strategy.kind is StrategyKind.ddp,
            on_device_map=self.parallel.device_map is not None, autocast=self.training.precision.is_mixed,
            optimizer_is_adamw=self.training.optimizer is Optimizer.adamw,
            optimizer_loop=None if self.training.optimizer_loop is None else self.training.optimizer_loop.value,
            checkpointing=self.training.activation_checkpointing is not ActivationCheckpointing.none,
            compile=self.training.compile, objective_is_sft=self.training.objective is Objective.sft)
        if (self.training.framework is Framework.litgpt and self.training.finetune.quantize.is_quantized
                and self.cluster.world_size > 1):
            # litgpt 0.4.13.dev1 finetune/lora.py setup raises NotImplementedError("Quantization is
            # currently not supported for multi-GPU training").
            raise ZeroplanError("finetune.quantize", "litgpt quantizes a base on one GPU only (allowed: --gpus 1, "
                                                     "or --quantize none)")
        if self.training.finetune.quantize is Quantization.int8 and self.strategy.kind not in INT8_STRATEGIES:
            raise ZeroplanError("strategy", f"{self.strategy.kind.value!r} cannot hold an int8 base (bitsandbytes Int8Params; "
                                            f"allowed: {', '.join(k.value for k in INT8_STRATEGIES)})")
        if self.training.finetune.quantize is Quantization.gptq_int4:
            check_gptq_training(self)
        check_zero3_groups(self)
        check_partial_offload(self)
        check_muon(self)
        check_compiled_layout(self.training, self.parallel)
        check_compiled_strategy(self.training, self.strategy.kind)
        check_hf_fsdp1(self)
        check_hf_deepspeed_convention(self)
        if self.strategy.kind is StrategyKind.hsdp:
            group = self.shard_group_size
            if self.state_group_size % group:
                given = "" if self.strategy.shard_group_size else " (the default: a node's GPUs divided by tp)"
                raise ZeroplanError(
                    "strategy.shard_group_size",
                    f"shard group {group}{given} does not divide the {self.state_group_size} ranks that hold the same "
                    f"parameters (allowed: a divisor of {self.state_group_size})",
                )
        return self

    @property
    def convention(self) -> StateConvention:
        """The byte layout of model states in force for this request."""
        if self.training.framework.megatron_layout:
            # megatron-core casts the module to 16 bits (transformer/module.py Float16Module: no
            # autocast) beside fp32 main parameters and, under bf16, fp32 gradients: DeepSpeed's
            # layout, which the buffers and collectives read; its model states are
            # zeroplan.core.megatron's own. Megatron-DeepSpeed's are DeepSpeed's own: its ZeRO
            # stage-1 optimizer or BF16_Optimizer (zeroplan.core.megatron_deepspeed).
            return StateConvention.deepspeed
        kind = self.strategy.kind
        if self.training.framework is Framework.hf and kind.zero_stage and not kind.is_fsdp:
            # HF's ZeRO is DeepSpeed's own engine: transformers 4.56.2 integrations/deepspeed.py
            # deepspeed_init and accelerate 1.10.1 accelerator.py _prepare_deepspeed call
            # deepspeed.initialize, so its states and buffers are DeepSpeed's.
            return StateConvention.deepspeed
        return self.training.state_convention or kind.default_convention

    @property
    def runs_under_autocast(self) -> bool:
        """Whether the forward runs under torch.autocast with fp32 parameters: mixed precision
        with fp32 parameters held and no FSDP cast (DDP, as the harness's torch engines and
        torchtitan 0.3.0 distributed/utils.py maybe_enable_amp run it without FSDP). DeepSpeed
        and FSDP cast the module's parameters to 16 bits instead."""
        if type(self.strategy) is not StrategySpec:
            # A planner cache's view of the strategy (zeroplan.core.memo.batch_keyed's
            # strategy_view) that keys on this answer alone, and holds it.
            return self.strategy.runs_under_autocast
        # fairseq c6006678 trainer.py casts the model itself under --fp16 (self._model.half()).
        return (self.training.precision.is_mixed and self.convention is StateConvention.fsdp2
                and not self.strategy.kind.is_fsdp and not self.training.finetune.module_in_bf16(self.training.framework)
                and self.training.framework is not Framework.fairseq)

    @property
    def shard_group_size(self) -> int:
        """N_d in the ZeRO paper: ranks over which the sharded states are split."""
        kind = self.strategy.kind
        if kind is StrategyKind.ddp:
            return 1
        if kind is StrategyKind.hsdp:
            # Default: the ranks of one node that hold the same parameters (a node's GPUs
            # divided among its tensor-parallel groups).
            return self.strategy.shard_group_size or max(1, self.cluster.gpus_per_node // self.parallel.tp)
        if kind is StrategyKind.zero3_mics:
            return self.strategy.mics_shard_size or min(self.cluster.gpus_per_node, self.state_group_size)
        return self.state_group_size

    @property
    def hpz_group_size(self) -> int:
        """zero3-hpz: ranks the secondary parameter partition is split over (a node's GPUs
        unless StrategySpec.hpz_partition_size says, at most the data-parallel ranks); 1 for every
        other strategy."""
        if not self.strategy.kind.uses_hpz:
            return 1
        return self.strategy.hpz_partition_size or min(self.cluster.gpus_per_node, self.state_group_size)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each hold a different slice of the global batch: the world divided by the
        tensor, context and pipeline degrees."""
        return self.cluster.world_size // self.parallel.model_parallel_size

    @property
    def state_group_size(self) -> int:
        """Ranks that hold the same parameters: dp x cp (context-parallel ranks share every
        parameter; torchtitan 0.3.0 parallel_dims.py shards FSDP over its dp_shard x cp mesh).
        DDP all-reduces over them, ZeRO and FSDP shard over them."""
        return self.data_parallel_size * self.parallel.cp

    def with_parallel(self, parallel: ParallelSpec) -> "PlanRequest":
        """The same request under other parallel degrees (validated again)."""
        return revalidated(self, parallel=parallel)

    def at_pipeline_rank(self, rank: int) -> "PlanRequest":
        """The request as pipeline rank ``rank`` sees it (no revalidation: only the rank moves)."""
        return self.model_copy(update={"parallel": self.parallel.model_copy(update={"pipeline_rank": rank})})

    def with_strategy(self, strategy: StrategySpec) -> "PlanRequest":
        """The same request under another strategy (validated again: HSDP groups must divide)."""
        return revalidated(self, strategy=strategy)

    def with_micro_batch(self, micro_batch_size: int) -> "PlanRequest":
        batch = self.batch.model_copy(update={"micro_batch_size": micro_batch_size})
        return self.model_copy(update={"batch": batch})

    def with_exact_capacity(self) -> "PlanRequest":
        """The same request with the allocator model's OOM capacity bisected too
        (MemoryAssumptions.exact_capacity: the breakdown's oom_capacity_bytes)."""
        if self.assumptions.exact_capacity:
            return self
        return self.model_copy(update={"assumptions": self.assumptions.model_copy(update={"exact_capacity": True})})

    def with_allocator_conf(self, allocator_conf: str | None) -> "PlanRequest":
        """The same request judged under another MemoryAssumptions.allocator_conf (None: the
        flat reserve); the setting is checked, nothing else changes."""
        if self.assumptions.allocator_conf == allocator_conf:
            return self
        assumptions = MemoryAssumptions(**{**dict(self.assumptions), "allocator_conf": allocator_conf})
        return self.model_copy(update={"assumptions": assumptions})


def _default_attention(data: dict, kernel: AttentionKernel) -> dict:
    """``data`` with ``kernel`` as its training's attention where the training names none (an
    ALiBi model's request takes default_attention_kernel's eager, as the command line does)."""
    training = data.get("training")
    if training is None:
        return {**data, "training": TrainingSpec(attention_kernel=kernel)}
    if isinstance(training, TrainingSpec) and "attention_kernel" not in training.model_fields_set:
        return {**data, "training": training.model_copy(update={"attention_kernel": kernel})}
    if isinstance(training, dict) and "attention_kernel" not in training:
        return {**data, "training": {**training, "attention_kernel": kernel.value}}
    return data


# fit() asks a request under each of its strategies (a dozen, and a dozen more for each change a
# suggestion tries): validating each whole cost ~25-45 us, most of it the request's own specs'
# validators run again on the same objects (pydantic runs a nested spec's after-validators even
# on an instance it does not revalidate). Those validators (ModelSpec._check_shapes,
# ClusterSpec._check_context, ...) read nothing but the spec's own values and return the spec
# itself, so a spec equal to one that passed passes; the request's own validators run every time
# their outcome is not known already for what they read (_groups_view): a fit asks the same
# strategies of requests that differ in their micro-batch alone, which those validators do not read.
def revalidated(request: PlanRequest, **update: Frozen) -> PlanRequest:
    """``type(request)(**{**dict(request), **update})``: the request with spec fields replaced,
    validated again as PlanRequest's validation does, with the same result or the same refusal
    (tests/test_revalidated.py compares the two): its before-validators, each field's spec
    validators where an equal spec has not passed them already (_passed), then _check_groups;
    the before-validators and _check_groups once per view of what they read (_groups_view). Where
    a before-validator would change the data, or a field is no spec of its own type, it is the
    full validation itself."""
    data = {**request.__dict__, **update}
    if type(request) is not PlanRequest or len(data) != len(_FIELD_TYPES):
        return type(request)(**{**dict(request), **update})
    for name, field_type in _FIELD_TYPES.items():
        if type(data[name]) is not field_type:
            return type(request)(**{**dict(request), **update})
    view = _groups_view(data)
    known = view in _GROUPS_PASSED
    if not known:
        for before in _BEFORE:  # a loop, not any() over a generator: fit makes a dozen requests per strategy list
            if before(data) is not data:
                return type(request)(**{**dict(request), **update})
    for name, field_type in _FIELD_TYPES.items():
        value = data[name]
        # The same object as one that passed (most fields of most requests): no hash, no comparison.
        if _PASSED_OBJECTS.get(id(value)) is not value and not _passed(field_type, value):
            return type(request)(**{**dict(request), **update})
    built = _instance(PlanRequest, data, set(data))
    if known:
        return built
    try:
        checked = built._check_groups()
    except (ValueError, AssertionError):
        checked = None  # what pydantic wraps in its own error: the full validation raises it
    if checked is not built:
        return type(request)(**{**dict(request), **update})
    if len(_GROUPS_PASSED) >= 1024:
        _GROUPS_PASSED.clear()
    _GROUPS_PASSED.add(view)
    return built


def _groups_view(data: dict[str, Frozen]) -> tuple:
    """What PlanRequest's before-validators and _check_groups read of a request's fields (each a
    spec of its own type): every spec but the batch whole, with the fields it was given (the
    before-validators ask which were set); of the batch, seq_len, allow_longer_seq,
    grad_accum_steps, the fields it was given (_default_seq_len_fits_the_model), and whether its
    tokens a micro-batch reach GPTQ_CUDA_KERNEL_TOKENS (check_gptq_training's only read of
    micro_batch_size). Requests with the same view pass or fail those validators alike."""
    batch, model, training, cluster = data["batch"], data["model"], data["training"], data["cluster"]
    strategy, parallel, assumptions, performance = data["strategy"], data["parallel"], data["assumptions"], data["performance"]
    return (model, frozenset(model.__pydantic_fields_set__), training, frozenset(training.__pydantic_fields_set__),
            cluster, frozenset(cluster.__pydantic_fields_set__), strategy, frozenset(strategy.__pydantic_fields_set__),
            parallel, frozenset(parallel.__pydantic_fields_set__), assumptions,
            frozenset(assumptions.__pydantic_fields_set__), performance, frozenset(performance.__pydantic_fields_set__),
            batch.seq_len, batch.allow_longer_seq, batch.grad_accum_steps, frozenset(batch.__pydantic_fields_set__),
            batch.seq_len * batch.micro_batch_size >= GPTQ_CUDA_KERNEL_TOKENS)


def _passed(field_type: type[Frozen], value: Frozen) -> bool:
    """Whether ``value`` passes its type's validators as a field of a request (raising their
    ZeroplanError where it does not); False where a validator answers with another object or an
    error pydantic words (the full validation then decides)."""
    passed = _PASSED[field_type]
    if value not in passed:
        try:
            if field_type.__pydantic_validator__.validate_python(value) is not value:
                return False
        except (ValueError, AssertionError):
            return False  # pydantic's own error (ValidationError is a ValueError), worded by the full validation
        if len(passed) >= 1024:
            passed.clear()
        passed.add(value)
    if len(_PASSED_OBJECTS) >= 4096:
        _PASSED_OBJECTS.clear()
    _PASSED_OBJECTS[id(value)] = value
    return True


_FIELD_TYPES: dict[str, type[Frozen]] = {name: info.annotation for name, info in PlanRequest.model_fields.items()}
"""PlanRequest's fields, each a spec of its own (revalidated)."""
assert all(isinstance(t, type) and issubclass(t, Frozen) for t in _FIELD_TYPES.values())
assert set(_FIELD_TYPES) == {"model", "training", "batch", "cluster", "strategy", "parallel", "assumptions",
                             "performance"}, "_groups_view reads each of PlanRequest's fields by name"
_PASSED: dict[type[Frozen], set[Frozen]] = {field_type: set() for field_type in _FIELD_TYPES.values()}
"""Per field type, specs that passed their validators (revalidated)."""
_PASSED_OBJECTS: dict[int, Frozen] = {}
"""The specs of _PASSED by identity, each kept alive here (so its id names it alone)."""
_GROUPS_PASSED: set[tuple] = set()
"""Views (_groups_view) of requests that passed PlanRequest's before-validators unchanged and
_check_groups (revalidated)."""
_BEFORE = tuple(getattr(PlanRequest, name) for name, decorator in PlanRequest.__pydantic_decorators__.model_validators.items()
                if decorator.info.mode == "before")
"""PlanRequest's before-validators, each returning its data itself where it changes nothing."""


# auto-gptq 0.4.2 nn_modules/qlinear/qlinear_cuda_old.py QuantLinear.forward (lines 196-272) casts
# its input to fp16 and returns fp16 whatever the module's dtype; Qwen runs it under --fp16 with
# DeepSpeed's engine casting the module to fp16 (its README: "only fp16 is supported for Q-LoRA").
# Under kernel_switch_threshold (128 rows) it runs its CUDA kernel, whose output no autograd node
# records (lines 199-225), a path not modelled.
def check_gptq_training(request: PlanRequest) -> None:
    """Refuse, in one line, a gptq-int4 base under a strategy, precision or micro-batch not modelled."""
    kind = request.strategy.kind
    if kind not in GPTQ_STRATEGIES:
        raise ZeroplanError("strategy", f"{kind.value!r} cannot hold a gptq-int4 base as modelled (auto-gptq's "
                                        f"buffers under DeepSpeed's engine; allowed: "
                                        f"{', '.join(k.value for k in GPTQ_STRATEGIES)})")
    if request.training.precision is not Precision.fp16_mixed:
        raise ZeroplanError("precision", f"{request.training.precision.value!r} with a gptq-int4 base is not "
                                         "modelled (auto-gptq's QuantLinear computes in fp16; allowed: fp16-mixed)")
    tokens = request.batch.seq_len * request.batch.micro_batch_size
    if tokens < GPTQ_CUDA_KERNEL_TOKENS:
        raise ZeroplanError("batch.seq_len", f"{tokens} tokens a micro-batch run auto-gptq's CUDA kernel, not modelled "
                                             f"(allowed: seq_len x micro_batch_size of {GPTQ_CUDA_KERNEL_TOKENS} or more)")
