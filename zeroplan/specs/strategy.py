"""Data-parallel sharding strategies and the knobs of their implementations."""

# No postponed annotations: pydantic reads these fields' types as objects (zeroplan/specs/base.py).

from enum import Enum

from pydantic import Field, model_validator

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen
from zeroplan.specs.training import StateConvention


class StrategyKind(str, Enum):
    """Which model states are sharded across data-parallel ranks, and where they live."""

    ddp = "ddp"
    """PyTorch DistributedDataParallel: everything replicated, gradients all-reduced."""
    zero1 = "zero1"
    """ZeRO stage 1 (P_os): optimizer states sharded."""
    zero2 = "zero2"
    """ZeRO stage 2 (P_os+g): optimizer states and gradients sharded."""
    zero3 = "zero3"
    """ZeRO stage 3 (P_os+g+p): parameters sharded too, gathered per layer."""
    fsdp_full_shard = "fsdp-full-shard"
    """FSDP FULL_SHARD / FSDP2 reshard_after_forward=True (ZeRO-3-like)."""
    fsdp_shard_grad_op = "fsdp-shard-grad-op"
    """FSDP SHARD_GRAD_OP / FSDP2 reshard_after_forward=False: parameters stay gathered from
    forward to backward (ZeRO-2-like)."""
    hsdp = "hsdp"
    """FSDP HYBRID_SHARD: full shard inside a group (a node), replicate across groups."""
    zero2_offload = "zero2-offload"
    """ZeRO-Offload (Ren et al. 2021): stage 2, optimizer states, master weights and fp32
    gradients on the host, optimizer step on the CPU."""
    zero3_offload = "zero3-offload"
    """Stage 3 with the optimizer offloaded to the host."""
    zero3_param_offload = "zero3-param-offload"
    """ZeRO-Infinity (Rajbhandari et al. 2021) on CPU memory: stage 3 with both the optimizer
    and the parameter shards on the host."""
    zero3_hpz = "zero3-hpz"
    """ZeRO++'s hpZ (Wang et al. 2023, sec. 3.2; DeepSpeed zero_hpz_partition_size): stage 3
    that also keeps a secondary partition of the parameters over a group of
    StrategySpec.hpz_partition_size ranks (a node), so every gather after the first forward runs
    inside that group."""
    zero3_zeropp = "zero3-zeropp"
    """ZeRO++'s full recipe (Wang et al. 2023; DeepSpeed's ZeRO++ tutorial): zero3-hpz plus qwZ
    (zero_quantized_weights: every parameter all-gather carries int8 blockwise-quantized
    weights and their fp32 scales) and qgZ (zero_quantized_gradients: the gradient
    reduce-scatter becomes a hierarchical int4 all-to-all, inside the node, then across nodes);
    zeroplan.core.zeropp."""
    zero3_nvme = "zero3-nvme"
    """ZeRO-Infinity (Rajbhandari et al. 2021) on NVMe, optimizer only: zero3-offload with the
    optimizer's fp32 states swapped to NVMe (DeepSpeed offload_optimizer.device "nvme") through
    pinned host buffers; the CPU still runs the optimizer step."""
    zero3_param_nvme = "zero3-param-nvme"
    """ZeRO-Infinity on NVMe: zero3-param-offload with the optimizer states and the parameter
    partitions beyond offload_param.max_in_cpu on NVMe (offload_param.device "nvme")."""
    zero3_mics = "zero3-mics"
    """MiCS (Zhang et al. 2022; DeepSpeed mics_shard_size): stage 3 over a shard group of
    StrategySpec.mics_shard_size ranks, replicated across groups, the gradient partitions
    all-reduced across the replicas once per step (DeepSpeed's analogue of HSDP)."""

    # Each property below is a lookup in a table built once after the class (the planner asks
    # them thousands of times a fit: a tuple of members built per call cost about ten times more).
    @property
    def is_fsdp(self) -> bool:
        return self in _FSDP

    @property
    def zero_stage(self) -> int:
        """Which model states are sharded, as the ZeRO stage number (0 for DDP)."""
        return _ZERO_STAGE[self]

    @property
    def is_opt_in(self) -> bool:
        """Planned only when named (--strategies): variants of ZeRO-3 whose group sizes are
        choices of their own, left out of the default list so it stays the common strategies."""
        return self in OPT_IN_STRATEGIES

    @property
    def uses_hpz(self) -> bool:
        """Keeps ZeRO++'s secondary parameter partition (hpZ): zero3-hpz and zero3-zeropp."""
        return self in _USES_HPZ

    @property
    def quantizes_communication(self) -> bool:
        """ZeRO++'s qwZ and qgZ (zeroplan.core.zeropp): zero3-zeropp."""
        return self is StrategyKind.zero3_zeropp

    @property
    def offloads_optimizer(self) -> bool:
        return self in _OFFLOADS_OPTIMIZER

    @property
    def offloads_parameters(self) -> bool:
        return self in _OFFLOADS_PARAMETERS

    @property
    def optimizer_on_nvme(self) -> bool:
        """ZeRO-Infinity's NVMe offload: the optimizer's states live on NVMe (zeroplan.core.nvme)."""
        return self in _OPTIMIZER_ON_NVME

    @property
    def parameters_on_nvme(self) -> bool:
        return self is StrategyKind.zero3_param_nvme

    @property
    def default_convention(self) -> StateConvention:
        """PyTorch's engines (DDP under autocast, FSDP2) keep fp32 parameters and gradients;
        DeepSpeed's ZeRO keeps half-precision ones beside an fp32 master (the ZeRO paper's)."""
        return _DEFAULT_CONVENTION[self]


_FSDP = frozenset({StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op, StrategyKind.hsdp})
_ZERO_STAGE = {
    StrategyKind.ddp: 0,
    StrategyKind.zero1: 1,
    StrategyKind.zero2: 2,
    StrategyKind.zero3: 3,
    StrategyKind.fsdp_full_shard: 3,
    StrategyKind.fsdp_shard_grad_op: 3,
    StrategyKind.hsdp: 3,
    StrategyKind.zero2_offload: 2,
    StrategyKind.zero3_offload: 3,
    StrategyKind.zero3_param_offload: 3,
    StrategyKind.zero3_hpz: 3,
    StrategyKind.zero3_zeropp: 3,
    StrategyKind.zero3_mics: 3,
    StrategyKind.zero3_nvme: 3,
    StrategyKind.zero3_param_nvme: 3,
}
_USES_HPZ = frozenset({StrategyKind.zero3_hpz, StrategyKind.zero3_zeropp})
_OFFLOADS_OPTIMIZER = frozenset({StrategyKind.zero2_offload, StrategyKind.zero3_offload, StrategyKind.zero3_param_offload,
                                 StrategyKind.zero3_nvme, StrategyKind.zero3_param_nvme})
# deepspeed 0.19.8 runtime/zero/config.py:396-400 offload_ratio_check asserts stage 3 for a
# ratio below 1; stage3.py:1100-1108 splits the sub-groups only under offload_optimizer, and the
# NVMe swapper (_swappable_optimizer_subgroup, :1114) takes the offloaded ones otherwise: the CPU
# offloads of stage 3 are planned.
PARTIAL_OFFLOAD_KINDS = (StrategyKind.zero3_offload, StrategyKind.zero3_param_offload)
"""The strategies offload_optimizer_ratio (ZeRO-Offload++'s Twin-Flow) applies to."""
_OFFLOADS_PARAMETERS = frozenset({StrategyKind.zero3_param_offload, StrategyKind.zero3_param_nvme})
_OPTIMIZER_ON_NVME = frozenset({StrategyKind.zero3_nvme, StrategyKind.zero3_param_nvme})
_DEFAULT_CONVENTION = {kind: StateConvention.fsdp2 if kind in _FSDP or kind is StrategyKind.ddp else StateConvention.zero
                       for kind in StrategyKind}


OPT_IN_STRATEGIES = (StrategyKind.zero3_hpz, StrategyKind.zero3_mics, StrategyKind.zero3_nvme,
                     StrategyKind.zero3_param_nvme, StrategyKind.zero3_zeropp)
"""Strategies fit, compare and plan take only when --strategies names them."""


# deepspeed 0.19.8 runtime/zero/config.py DeepSpeedZeroConfig: reduce_bucket_size 5e8 (line 113),
# contiguous_gradients True (102), sub_group_size 1e9 (182), stage3_prefetch_bucket_size 5e7 (222),
# stage3_param_persistence_threshold 1e5 (228), stage3_max_live_parameters 1e9 (245),
# stage3_max_reuse_distance 1e9 (251). The four stage-3 values are the first ZeRO-3's too (0.3.13
# runtime/zero/constants.py lines 86-99), whose sub_group_size default was 1e12 (line 83).
DEEPSPEED_ZERO_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000, "sub_group_size": 1_000_000_000,
    "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
}


class ZeroGradientReduce(str, Enum):
    """ZeRO-1/2: the buffer gradients are reduced through."""

    bucket = "bucket"
    """DeepSpeed: a reduce bucket of zero_bucket_elements (deepspeed/runtime/zero/
    stage_1_and_2.py, ipg_buffer), filled as gradients arrive and released after backward."""
    per_unit = "per-unit"
    """zeroplan's reference ZeRO (zeroplan/harness/zero.py): each unit's gradients are copied
    into a flat buffer of that unit's size, reduce-scattered, and the buffer freed."""
    ddp_buckets = "ddp-buckets"
    """PyTorch's ZeroRedundancyOptimizer under DDP (stage 1 only): DDP all-reduces the full
    gradients through its bucket copies, allocated once and kept."""


class StrategySpec(Frozen):
    """A strategy and its implementation knobs; defaults are the libraries' own defaults."""

    kind: StrategyKind
    """The sharding strategy."""
    shard_group_size: int | None = Field(default=None, gt=0)
    """HSDP only: ranks that share one shard; None means the GPUs of one node."""
    hpz_partition_size: int | None = Field(default=None, gt=0)
    """zero3-hpz and zero3-zeropp only: ranks over which the secondary parameter partition is split (DeepSpeed's
    zero_hpz_partition_size); None means the GPUs of one node."""
    mics_shard_size: int | None = Field(default=None, gt=0)
    """zero3-mics only: ranks that share one shard of every model state (DeepSpeed's
    mics_shard_size); None means the GPUs of one node."""
    nvme_pipeline_read: bool = False
    """zero3-nvme and zero3-param-nvme only: DeepSpeed's offload_optimizer.pipeline_read (default
    False): the optimizer step reads the next sub-group while this one steps
    (runtime/swap_tensor/pipelined_optimizer_swapper.py; zeroplan.core.nvme)."""
    nvme_pipeline_write: bool = False
    """zero3-nvme and zero3-param-nvme only: offload_optimizer.pipeline_write (default False): a
    sub-group's write back overlaps the next one's read and step."""
    ddp_bucket_cap_bytes: int = Field(default=25 * 2**20, gt=0)
    """DDP gradient bucket size (torch DistributedDataParallel bucket_cap_mb=25, in MiB)."""
    ddp_gradient_as_bucket_view: bool = False
    """DDP: if False (PyTorch's default) gradients are copied into separate bucket storage,
    which costs one more gradient-sized buffer."""
    zero_bucket_elements: int = Field(default=500_000_000, gt=0)
    """DeepSpeed reduce_bucket_size / allgather_bucket_size (elements, default 5e8)."""
    zero_gradient_reduce: ZeroGradientReduce = ZeroGradientReduce.bucket
    """ZeRO-1/2: how gradients reach the reduce-scatter (see ZeroGradientReduce)."""
    prefetch_units: int = Field(default=1, ge=0)
    """ZeRO-3/FSDP: units gathered ahead of the one computing (FSDP2 prefetches one)."""
    fsdp_reduce_in_fp32: bool = True
    """FSDP: reduce-scatter gradients in fp32 (MixedPrecisionPolicy(reduce_dtype=float32), as
    torchtitan's mixed_precision_reduce defaults); False reduces in the compute dtype."""
    fsdp1_root_stays_gathered: bool = False
    """FSDP full shard run by torch's FSDP1 (FullyShardedDataParallel) with a root unit: its
    post-forward does not reshard the root (torch 2.13 distributed/fsdp/_runtime_utils.py
    _post_forward_reshard), so the root's parameters stay gathered from the forward through the
    loss and the backward, and its backward gathers nothing. What ``--fsdp-version 1`` sets: for
    framework zeroplan the harness's torch-fsdp1 engine, for hf accelerate's fsdp_version 1
    (Accelerator.prepare_model's FullyShardedDataParallel; zeroplan.specs.request.check_hf_fsdp1
    names what it was measured under)."""
    keep_unsharded_grads_on_accum: bool = False
    """FSDP no_sync / ZeRO-1: accumulate unsharded gradients locally and reduce once per step
    instead of every micro-batch (costs a full gradient buffer)."""
    deepspeed_contiguous_gradients: bool = True
    """DeepSpeed zero_optimization.contiguous_gradients (default true): gradients are copied into
    the reduce ("ipg") bucket, which is then a tensor of zero_bucket_elements (the deepspeed state
    convention's buffer terms, zeroplan.core.deepspeed_accumulation)."""
    deepspeed_prefetch_bucket_elements: int | None = Field(default=None, ge=0)
    """DeepSpeed zero_optimization.stage3_prefetch_bucket_size (elements); None is what ``--emit``
    writes, prefetch_units largest units, or under hf or a named --deepspeed-release DeepSpeed's
    default (zeroplan.core.deepspeed_coordinator, as the three below). 0 turns the prefetch
    off, and with it the units kept gathered from the forward to the backward."""
    deepspeed_max_live_parameters: int | None = Field(default=None, gt=0)
    """DeepSpeed zero_optimization.stage3_max_live_parameters (elements); None is what ``--emit``
    writes, (1 + prefetch_units) largest units."""
    deepspeed_max_reuse_distance: int | None = Field(default=None, ge=0)
    """DeepSpeed zero_optimization.stage3_max_reuse_distance (elements): a module's parameters stay
    gathered after its use when the trace uses them again within this many elements. None is
    what ``--emit`` writes (0), or under hf or a named --deepspeed-release DeepSpeed's default
    (zeroplan.core.deepspeed_coordinator)."""
    deepspeed_param_persistence_threshold: int | None = Field(default=None, ge=0)
    """DeepSpeed zero_optimization.stage3_param_persistence_threshold (elements): parameters of at
    most this many elements stay gathered from the engine's start. None as the one above
    (``--emit`` writes 0)."""
    deepspeed_sub_group_elements: int = Field(default=1_000_000_000, gt=0)
    """DeepSpeed zero_optimization.sub_group_size (elements; its default 1e9, runtime/zero/config.py):
    ZeRO-3's optimizer steps, and the NVMe swapper swaps, one sub-group of this many partition
    elements at a time (zeroplan.core.nvme.sub_group_tensor_elements)."""
    offload_optimizer_ratio: float | None = None
    """DeepSpeed zero_optimization.offload_optimizer.ratio (ZeRO-Offload++'s Twin-Flow), from 0
    exclusive to 1: the share of ZeRO-3's optimizer sub-groups stepped on the host by CPU Adam,
    the rest kept on the GPU and stepped there by a torch AdamW (zeroplan.core.
    deepspeed_partial_offload). None is DeepSpeed's default 1.0, everything offloaded.
    zero3-offload and zero3-param-offload only (runtime/zero/config.py offload_ratio_check)."""
    deepspeed_grad_accum_fp32: bool = False
    """DeepSpeed data_types.grad_accum_dtype "fp32" (its default is the model's dtype): under bf16
    at ZeRO stage 1 DeepSpeed then runs its BF16_Optimizer instead of the ZeRO optimizer
    (runtime/engine.py _do_optimizer_sanity_check; zeroplan.core.megatron_deepspeed). Planned for
    the megatron-deepspeed profile."""
    deepspeed_overlap_comm: bool | None = None
    """DeepSpeed zero_optimization.overlap_comm; None is DeepSpeed's default (true at stage 3,
    false below: deepspeed/runtime/zero/config.py overlap_comm_valid). At stages 1-2 with
    contiguous gradients it doubles the reduce bucket (stage_1_and_2.py setup_buckets)."""

    @model_validator(mode="after")
    def _offload_ratio_fits_the_strategy(self) -> "StrategySpec":
        ratio = self.offload_optimizer_ratio
        if ratio is None:
            return self
        if not 0 < ratio <= 1:
            raise ZeroplanError("strategy.offload_optimizer_ratio", f"{ratio!r} (allowed: greater than 0, at most 1)")
        if self.kind not in PARTIAL_OFFLOAD_KINDS:
            raise ZeroplanError("strategy.offload_optimizer_ratio",
                                f"applies to ZeRO-3's optimizer offload to the CPU, not {self.kind.value!r} "
                                f"(allowed: {', '.join(k.value for k in PARTIAL_OFFLOAD_KINDS)})")
        return self

    @model_validator(mode="after")
    def _reduce_mode_fits_the_stage(self) -> "StrategySpec":
        allowed = {ZeroGradientReduce.per_unit: (1, 2), ZeroGradientReduce.ddp_buckets: (1,)}
        stages = allowed.get(self.zero_gradient_reduce)
        if stages is not None and self.kind.zero_stage not in stages:
            raise ZeroplanError(
                "strategy.zero_gradient_reduce",
                f"{self.zero_gradient_reduce.value!r} applies to ZeRO stage {' or '.join(map(str, stages))}, "
                f"not {self.kind.value!r} (allowed: bucket)",
            )
        return self
