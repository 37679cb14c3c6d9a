"""The NCCL communicators a training rank opens, and the device memory each holds
(zeroplan.core.nccl_buffers). docs/memory-model.md, "Memory outside the allocator". Nothing here
imports torch.

torch's ProcessGroupNCCL creates one communicator per process group the rank calls a collective
on, lazily at the first call (eagerly only for a group bound to a device with device_id), and
one two-rank communicator per peer for an unbatched send/recv (its pointToPoint keys those by
"low:high" rank). So a communicator is counted for each group the stack's training step calls
NCCL on, not for each group it creates."""

from functools import lru_cache

from pydantic import ConfigDict, Field

from zeroplan.core.algorithms import Algorithm, Layout, available_algorithms, multicast_capable
from zeroplan.core.collective import CollectiveOp
from zeroplan.core.nccl_release import connects_at_init, nccl_release
from zeroplan.core.nccl_buffers import (
    nvls_bytes,
    p2p_channels,
    p2p_channels_per_peer,
    ring_bytes,
    send_recv_bytes,
    tree_chain_bytes,
    tree_network_bytes,
)
from zeroplan.specs.base import Frozen
from zeroplan.specs.framework import EARLIER_HF_DEEPSPEED_RELEASES, Framework
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import StateConvention

MEGATRON_PROFILES = (Framework.megatron, Framework.megatron_deepspeed)


class Communicator(Frozen):
    """One NCCL communicator of a rank and the device bytes its buffers take."""

    # Its validator is built on first use: `zeroplan fit` never builds one (pydantic's schema
    # build at class creation is most of an import's cost).
    model_config = ConfigDict(defer_build=True)

    name: str
    """Which process group, e.g. 'tensor parallel' or 'pipeline next stage'."""
    group_size: int = Field(gt=0)
    """Ranks in it."""
    ranks_per_node: int = Field(gt=0)
    """Its members on the rank's node."""
    bytes: int = Field(ge=0)
    """Device bytes its buffers take on the rank (outside the caching allocator)."""


# The mesh zeroplan lays ranks out on, innermost last: torchtitan 0.3.0 parallel_dims.py
# (["pp", "dp_replicate", "dp_shard", "cp", "tp"]) and megatron-core parallel_state.py's default
# order "tp-cp-ep-dp-pp" both put tp innermost and pp outermost, the data-parallel ranks between.
@lru_cache(maxsize=4096)
def members_on_node(sizes: tuple[int, ...], group_dims: tuple[int, ...], gpus_per_node: int) -> int:
    """Members of rank 0's group (the mesh dimensions ``group_dims`` of a mesh of ``sizes``,
    outermost first) on rank 0's node; every node a regular mesh touches holds as many."""
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    ranks = [0]
    for d in group_dims:
        ranks = [r + k * strides[d] for r in ranks for k in range(sizes[d]) if r + k * strides[d] < gpus_per_node]
    return max(1, len(ranks))


def _ring(request: PlanRequest, name: str, sizes: tuple[int, ...], dims: tuple[int, ...],
          nvls_op: CollectiveOp | None = None) -> Communicator | None:
    size = 1
    for d in dims:
        size *= sizes[d]
    if size < 2:
        return None
    per_node = members_on_node(sizes, dims, request.cluster.gpus_per_node)
    channels = request.assumptions.nccl_channels
    held = ring_bytes(size, per_node, channels)
    nccl = nccl_release(request.training)
    if connects_at_init(nccl):
        held += tree_chain_bytes(per_node, channels) + tree_network_bytes(size, per_node, channels)
        if _nvls_at_init(request, nccl, size, per_node):
            held += nvls_bytes(per_node, nccl)
    elif nvls_op is not None and _runs_nvls(request, nvls_op, size, per_node):
        held += nvls_bytes(per_node, nccl)
    return Communicator(name=name, group_size=size, ranks_per_node=per_node, bytes=held)


# Before v2.22.3-1 (zeroplan.core.nccl_release) ncclNvlsSetup ran at every communicator's
# initialisation (v2.19.3-1 src/init.cc:1131), whatever collectives it would run, where
# ncclNvlsInit found multicast support: NVLS_ENABLE's default 2 asks the device
# (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: Hopper or newer behind NVSwitches) and the
# communicator's topology holds more than 2 GPUs (v2.19.3-1 src/transport/nvls.cc:251, 262);
# the 2.20 releases also left out communicators spanning nodes (v2.20.5-1 nvls.cc:240:
# comm->nNodes > 1), which v2.21.5-1 let in again (:241).
def _nvls_at_init(request: PlanRequest, nccl: tuple[int, int, int], size: int, per_node: int) -> bool:
    if not multicast_capable(request.cluster.gpu) or per_node <= 2:
        return False
    return not (nccl[:2] == (2, 20) and size > per_node)


# NCCL runs NVLS on Hopper (or newer) NVSwitch nodes where its tuning allows it
# (zeroplan.core.algorithms.available_algorithms, from NCCL's tuning.cc); for the large calls of
# the data- and tensor-parallel groups its bus bandwidth beats the ring's, so where NVLS can run
# it is counted as run. Scalar all-reduces (gradient norms, barriers) stay on the ring (NVLS's
# latency is higher), and are given no nvls_op.
def _runs_nvls(request: PlanRequest, op: CollectiveOp, size: int, per_node: int) -> bool:
    gpu = request.cluster.gpu
    layout = Layout(group_size=size, ranks_per_node=per_node, gpus_per_node=request.cluster.gpus_per_node,
                    spans_nodes=size > per_node)
    return bool({Algorithm.nvls, Algorithm.nvls_tree} & set(available_algorithms(gpu, op, layout)))


# A communicator made for send/recv alone connects its peers on first use (connIndex 1,
# zeroplan.core.nccl_buffers.send_recv_bytes); before
# v2.22.3-1 its initialisation also connected the ring and the trees of its ranks, used or not
# (v2.19.3-1 src/init.cc:1117-1127, v2.11.4-1 alike), which the send/recv connections then reuse
# where they coincide (a two-rank ring links the very pair, both ways).
def _send_recv(request: PlanRequest, name: str, size: int, local_peers: int, remote_peers: int,
               members_on_node: int | None = None) -> Communicator:
    """``members_on_node``: the communicator's ranks on the rank's node, for the ring connected
    at initialisation (its local peers and itself where not given)."""
    channels = request.assumptions.nccl_channels
    per_peer = p2p_channels_per_peer(channels, remote_peers > 0, _nvlink(request))
    held = send_recv_bytes(local_peers, remote_peers, per_peer, p2p_channels(channels))
    if connects_at_init(nccl_release(request.training)):
        on_node = local_peers + 1 if members_on_node is None else members_on_node
        held += (ring_bytes(size, on_node, channels) + tree_chain_bytes(on_node, channels)
                 + tree_network_bytes(size, on_node, channels))
    return Communicator(name=name, group_size=size, ranks_per_node=local_peers + 1, bytes=held)


def _nvlink(request: PlanRequest) -> bool:
    gpu = request.cluster.gpu
    return gpu.nvswitch or "nvlink" in gpu.intra_node_link.name.lower()


def communicators(request: PlanRequest) -> list[Communicator]:
    """The NCCL communicators ``request``'s rank opens during training (none for the reference
    harness, whose measured runs are the baseline of its verdicts, or for one GPU)."""
    if not opens_communicators(request):
        return []
    return _communicators(request)


def opens_communicators(request: PlanRequest) -> bool:
    """Whether the request's ranks open NCCL communicators at all (whichever pipeline rank):
    not the reference harness, one GPU or a device map."""
    # A device map is one process: its hooks copy activations between GPUs with .to(), without
    # a process group.
    return not (request.training.framework is Framework.zeroplan or request.cluster.world_size == 1
                or request.parallel.device_map is not None)


def _communicators(request: PlanRequest) -> list[Communicator]:
    parallel, kind = request.parallel, request.strategy.kind
    data = request.state_group_size
    # Mesh (outermost first): pp, data replicas, data shards (cp among them), tp.
    shard = request.shard_group_size if kind in (StrategyKind.hsdp, StrategyKind.zero3_mics) else data
    sizes = (parallel.pp, data // shard, shard, parallel.tp)
    data_op = CollectiveOp.all_reduce if not kind.zero_stage else CollectiveOp.reduce_scatter
    found: list[Communicator | None] = []
    if kind in (StrategyKind.hsdp, StrategyKind.zero3_mics):
        # torch FSDP HYBRID_SHARD / FSDP2 on a 2-D mesh, DeepSpeed MiCS: a shard group and a
        # replica group, each its own process group.
        found.append(_ring(request, "data parallel (shard group)", sizes, (2,), data_op))
        found.append(_ring(request, "data parallel (replica group)", sizes, (1,), CollectiveOp.all_reduce))
    else:
        found.append(_ring(request, "data parallel", sizes, (1, 2), data_op))
    if kind.uses_hpz and request.hpz_group_size < data:
        # DeepSpeed zero_hpz_partition_size: the secondary partition's all-gathers run on their
        # own group of hpz_partition_size consecutive data-parallel ranks.
        hpz = (parallel.pp, data // request.hpz_group_size, request.hpz_group_size, parallel.tp)
        found.append(_ring(request, "hpZ secondary partition", hpz, (2,), CollectiveOp.all_gather))
    tp_op = CollectiveOp.all_gather if parallel.sequence_parallel else CollectiveOp.all_reduce
    found.append(_ring(request, "tensor parallel", sizes, (3,), tp_op))
    # cp is the innermost part of the data-parallel ranks (torchtitan's dp_shard x cp).
    cp_mesh = (parallel.pp, data // parallel.cp, parallel.cp, parallel.tp)
    if request.training.framework is Framework.megatron_deepspeed and parallel.cp > 1:
        # DeepSpeed-Ulysses' all-to-alls (deepspeed/sequence/layer.py all_to_all_single) over P
        # consecutive ranks (Megatron-DeepSpeed parallel_state.py:200-206): a send and a receive
        # to every other rank of the group, as expert parallelism's dispatch.
        local = min(parallel.cp, request.cluster.gpus_per_node)
        found.append(_send_recv(request, "sequence parallel (Ulysses all-to-all)", parallel.cp, local - 1, parallel.cp - local))
    else:
        found.append(_ring(request, "context parallel", cp_mesh, (2,), CollectiveOp.all_gather))
    found.extend(_expert_parallel(request))
    found.extend(_pipeline(request))
    if request.training.framework in MEGATRON_PROFILES:
        found.extend(_megatron(request, sizes))
    if request.training.framework is Framework.megatron_deepspeed:
        found.extend(_deepspeed_pipeline_grid(request, sizes))
    if request.training.framework is Framework.torchtitan:
        found.extend(_torchtitan(request, sizes))
    found.append(_world(request, sizes))
    return [c for c in found if c is not None]


# Expert parallelism's token dispatch is an all-to-all, which ProcessGroupNCCL issues as a send
# and a receive to every other rank of the expert group (ncclSend/ncclRecv in one group call).
# torchtitan 0.3.0 borrows the ep ranks from dp_shard x cp x tp, innermost first.
def _expert_parallel(request: PlanRequest) -> list[Communicator]:
    ep = request.parallel.ep
    if ep < 2:
        return []
    local = min(ep, request.cluster.gpus_per_node)
    return [_send_recv(request, "expert parallel (all-to-all)", ep, local - 1, ep - local)]


# Pipeline stages exchange activations and their gradients with each neighbour by send/recv.
# Batched (torch.distributed.batch_isend_irecv) they run on the pipeline group's communicator:
# torch's pipelining schedules batch a step's sends with its receives (distributed/pipelining/
# schedules.py _batch_p2p), as megatron-core does unless --overlap-p2p-communication
# (pipeline_parallel/p2p_communication.py _batched_p2p_ops; batch_p2p_comm). DeepSpeed's pipeline
# engine (Megatron-DeepSpeed) sends unbatched (runtime/pipe/p2p.py: dist.send, dist.recv), and
# ProcessGroupNCCL opens a two-rank communicator per neighbour for those. A first or last stage has
# one neighbour; interleaved and V schedules wrap the chunks round, giving every rank two.
def _pipeline(request: PlanRequest) -> list[Communicator]:
    parallel = request.parallel
    if parallel.pp < 2:
        return []
    stride = request.cluster.world_size // parallel.pp
    remote = stride >= request.cluster.gpus_per_node
    rank, last = parallel.pipeline_rank, parallel.pp - 1
    wraps = parallel.virtual_stages > 1
    neighbours = len({(rank - 1) % parallel.pp if (rank > 0 or wraps) else None,
                      (rank + 1) % parallel.pp if (rank < last or wraps) else None} - {None, rank})
    if request.training.framework is Framework.megatron_deepspeed:
        return [_send_recv(request, "pipeline neighbour (send/recv)", 2, 0 if remote else 1, 1 if remote else 0)
                for _ in range(neighbours)]
    per_node = 1 if remote else min(parallel.pp, request.cluster.gpus_per_node // stride)
    held = _send_recv(request, "pipeline (send/recv)", parallel.pp, 0 if remote else neighbours,
                      neighbours if remote else 0, per_node)
    if request.training.framework is Framework.torchtitan and not connects_at_init(nccl_release(request.training)):
        # torchtitan's gradient norm all-reduces over the same pipeline group (distributed/utils.py
        # clip_grad_norm_ with pp_mesh), connecting its ring too (which an NCCL before 2.22 has
        # connected at initialisation, _send_recv).
        ring = ring_bytes(parallel.pp, per_node, request.assumptions.nccl_channels)
        held = held.model_copy(update={"name": "pipeline (send/recv, gradient norm)", "bytes": held.bytes + ring})
    return [held]


# megatron-core parallel_state.py / Megatron-DeepSpeed mpu: the gradient-norm and inf checks
# all-reduce over the model-parallel group (tp x pp ranks; optimizer/clip_grads.py
# get_grad_norm_fp32, DeepSpeed's runtime/utils.py over mpu.get_model_parallel_group()), or under
# megatron-core's distributed optimizer over its instance (every rank: DistributedOptimizer
# get_grad_stats_parallel_group). With tied embeddings and pp > 1 the first and last stages
# all-reduce the word embedding's gradient over the embedding group (parallel_state's
# _EMBEDDING_GROUP; DeepSpeed PipelineModule's tied_comms).
def _megatron(request: PlanRequest, sizes: tuple[int, ...]) -> list[Communicator | None]:
    parallel = request.parallel
    found: list[Communicator | None] = []
    distributed_optimizer = request.training.framework is Framework.megatron and bool(request.strategy.kind.zero_stage)
    if distributed_optimizer:
        found.append(_ring(request, "distributed-optimizer instance (gradient norm)", sizes, (0, 1, 2, 3)))
    else:
        found.append(_ring(request, "model parallel (gradient norm)", sizes, (0, 3)))
    if parallel.pp > 1 and request.model.tied_embeddings and parallel.pipeline_rank in (0, parallel.pp - 1):
        stride = request.cluster.world_size // parallel.pp
        per_node = 1 if stride * (parallel.pp - 1) >= request.cluster.gpus_per_node else 2
        channels = request.assumptions.nccl_channels
        found.append(Communicator(name="embedding (tied word embedding)", group_size=2, ranks_per_node=per_node,
                                  bytes=ring_bytes(2, per_node, channels)))
    return found


# DeepSpeed 0.19.8's pipeline engine runs collectives on its own grid's groups, which
# runtime/pipe/topology.py PipelineParallelGrid makes with dist.new_group beside Megatron's mpu
# groups (other process groups over the same ranks, so other communicators): every train_batch
# broadcasts the loss from the last stage over the grid's pipe group (runtime/pipe/engine.py:619,
# 629, _aggregate_total_loss; topology.py:339), and under tensor parallelism (pipe_partitioned)
# the stage outputs and their gradients cross the pipeline as 1/t parts that PartitionedTensor.full
# all-gathers over the grid's slice group, the tp ranks (engine.py:713, 818, 833; topology.py:362):
# on the receiving stage in forward, on the sending stage in backward. The layers' own tp
# all-reduces stay on Megatron's tensor-parallel group. Both are ring collectives (a broadcast
# and an all-gather), so each connects its ring.
def _deepspeed_pipeline_grid(request: PlanRequest, sizes: tuple[int, ...]) -> list[Communicator | None]:
    if request.parallel.pp < 2:
        return []
    return [_ring(request, "pipeline engine stages (loss broadcast)", sizes, (0,)),
            _ring(request, "pipeline engine slice (partitioned stage outputs)", sizes, (3,))]


# torchtitan (trainer.py): the loss is all-reduced over the "loss" mesh (dp x cp). Built on torch's
# fake process group (ParallelDims.build_mesh, 16 ranks), "loss" is a process group of its own
# beside the FSDP mesh's whenever tp, pp or replication splits the world (same ranks, another
# group), and the world group itself when nothing does.
def _torchtitan(request: PlanRequest, sizes: tuple[int, ...]) -> list[Communicator | None]:
    return [_ring(request, "loss (dp x cp)", sizes, (1, 2))] if _splits_world(request) else []


# The default (world) group: launchers and trainers barrier on it (torch.distributed.barrier is
# a one-element all-reduce: Megatron's initialize, DeepSpeed's engine, accelerate's
# wait_for_everyone), opening its communicator. Where the data-parallel group is the whole world,
# DDP (process_group None) and a one-dimensional DeviceMesh use the default group itself, so it is
# the same communicator; Megatron's parallel_state makes every group with new_group, each its own.
def _world(request: PlanRequest, sizes: tuple[int, ...]) -> Communicator | None:
    if _deepspeed_gathers_on_world(request):
        return _ring(request, "world (ZeRO-3 parameter all-gathers)", sizes, (0, 1, 2, 3), CollectiveOp.all_gather)
    if not _splits_world(request) and request.training.framework not in MEGATRON_PROFILES:
        return None
    return _ring(request, "world (barriers)", sizes, (0, 1, 2, 3))


# DeepSpeed's ZeRO-3 without an mpu (hf: accelerate and transformers pass none) partitions the
# parameters on the default group: zero.Init with no data_parallel_group takes
# dist.get_world_group() (0.13.3 runtime/zero/partition_parameters.py:923-924, 0.19.8 :1094), as
# does the engine for parameters zero.Init did not see (parameter_offload.py
# _convert_to_zero_parameters: Init(data_parallel_group=None)), and each parameter's all-gather
# runs on its ds_process_group. The engine's own data-parallel group is a clone
# (utils/groups.py _get_data_parallel_group -> _clone_world_group: dist.new_group over every
# rank), another process group and so another communicator. 0.13.3 reduce-scatters the gradients
# and all-reduces their norm on that clone (runtime/zero/stage3.py:1343 __avg_scatter_grads, :1738
# and :1759 on self.dp_process_group), so a step opens both; 0.19.8 reduce-scatters on the
# parameters' own group (stage3.py:1916 _get_param_partition_group, the norms alike at :1991), so
# its step runs on the default group alone, the one data-parallel communicator counted.
# Measured on both releases' own engines (tests/harness/groups_worker.py, gloo). MiCS partitions
# on its shard groups instead.
def _deepspeed_gathers_on_world(request: PlanRequest) -> bool:
    """Whether the parameters' all-gathers open a communicator of their own (the default group)
    beside the data-parallel clone the gradients are reduced on: DeepSpeed 0.13.3's ZeRO-3 under hf."""
    kind = request.strategy.kind
    return (request.training.framework is Framework.hf
            and request.training.deepspeed_release in EARLIER_HF_DEEPSPEED_RELEASES
            and kind.zero_stage == 3 and not kind.is_fsdp and kind is not StrategyKind.zero3_mics
            and request.convention is StateConvention.deepspeed)


def _splits_world(request: PlanRequest) -> bool:
    """Whether the data-parallel ranks' groups are smaller than the world (model parallelism, or
    HSDP / MiCS with more than one replica)."""
    replicated = request.strategy.kind in (StrategyKind.hsdp, StrategyKind.zero3_mics)
    return request.parallel.model_parallel_size > 1 or (replicated and request.shard_group_size < request.state_group_size)
