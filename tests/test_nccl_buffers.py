"""The NCCL communicators a rank opens and the device bytes each holds
(zeroplan.core.nccl_buffers, zeroplan.core.communicators): NCCL v2.28.3-1's buffer sizes and
the process groups torch, torchtitan, Megatron and DeepSpeed call NCCL on."""

from __future__ import annotations

from zeroplan.core.communicators import communicators, members_on_node
from zeroplan.core.feasibility import nccl_buffer_bytes, usable_memory_bytes
from zeroplan.core.nccl_buffers import (
    LL128_BUFFER_BYTES,
    LL_BUFFER_BYTES,
    SIMPLE_BUFFER_BYTES,
    connection_bytes,
    nvls_bytes,
    ring_bytes,
    send_recv_bytes,
    tree_chain_bytes,
    tree_network_bytes,
)
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, ClusterSpec, Framework, PlanRequest, StrategyKind, StrategySpec, TrainingSpec,
)
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.units import MiB


def _request(framework=Framework.torchtitan, kind=StrategyKind.fsdp_full_shard, gpu="h100", gpus=8, tp=1, pp=1,
             pipeline_rank=0, accum=1) -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-3.1-8b"), training=TrainingSpec(framework=framework),
        batch=BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum_steps=accum),
        cluster=ClusterSpec(gpu=get_gpu(gpu), num_nodes=max(1, gpus // 8), gpus_per_node=min(gpus, 8)),
        strategy=StrategySpec(kind=kind), parallel=ParallelSpec(tp=tp, pp=pp, pipeline_rank=pipeline_rank),
    )


def test_protocol_buffers_are_nccls_defaults() -> None:
    # init.cc DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE, DEFAULT_BUFFSIZE.
    assert (LL_BUFFER_BYTES, LL128_BUFFER_BYTES, SIMPLE_BUFFER_BYTES) == (524288, 4915200, 4194304)
    assert connection_bytes() == 9633792


def test_a_ring_crossing_nodes_stages_its_sends_on_the_gpu() -> None:
    inside = ring_bytes(8, 8, 16)
    assert inside == 16 * connection_bytes()
    # One rank per node: every connection crosses the network, each send staging LL128 + Simple.
    assert ring_bytes(8, 1, 16) == 16 * (connection_bytes() + LL128_BUFFER_BYTES + SIMPLE_BUFFER_BYTES)
    assert inside < ring_bytes(64, 8, 16) < ring_bytes(8, 1, 16)
    assert ring_bytes(1, 1, 16) == 0
    # Remote peers share one send and one receive buffer of 16 x 128 KiB per p2p channel.
    assert send_recv_bytes(0, 3, 2, 16) == send_recv_bytes(0, 1, 2, 16) == 2 * 16 * 16 * 128 * 1024
    assert nvls_bytes(8) == 256 * MiB


def test_members_on_node_follow_the_mesh_order() -> None:
    # (pp, data, tp) = (4, 8, 8) on 8-GPU nodes: tp fills a node, dp and pp have one rank per node.
    assert members_on_node((4, 8, 8), (2,), 8) == 8
    assert members_on_node((4, 8, 8), (1,), 8) == 1
    assert members_on_node((1, 4, 2), (1,), 8) == 4
    assert members_on_node((4, 8, 8), (0, 1, 2), 8) == 8


def test_fsdp_on_one_node_opens_the_default_group_only() -> None:
    request = _request()
    (only,) = communicators(request)
    # H100 nodes meet at NVSwitches: the data-parallel ring plus NVLS's buffers.
    assert only.group_size == 8 and only.bytes == ring_bytes(8, 8, 16) + nvls_bytes(8)
    a100 = _request(gpu="a100-80gb")
    assert nccl_buffer_bytes(a100) == ring_bytes(8, 8, 16)
    assert usable_memory_bytes(a100) == a100.cluster.usable_memory_bytes - ring_bytes(8, 8, 16)
    assert communicators(_request(framework=Framework.zeroplan)) == []
    assert communicators(_request(gpus=1)) == []


def test_a_3d_layout_sums_one_communicator_per_group() -> None:
    request = _request(gpus=256, tp=8, pp=4, accum=8)
    names = [c.name for c in communicators(request)]
    assert names == ["data parallel", "tensor parallel", "pipeline (send/recv, gradient norm)", "loss (dp x cp)",
                     "world (barriers)"]
    assert nccl_buffer_bytes(request) > 3 * nccl_buffer_bytes(_request())
    # Megatron-DeepSpeed's pipeline sends unbatched: a two-rank communicator per neighbour, two
    # for a middle stage; the tied embedding's group only on the first and last stages.
    middle = _request(Framework.megatron_deepspeed, StrategyKind.zero1, gpus=256, tp=8, pp=4, pipeline_rank=1, accum=8)
    first = middle.at_pipeline_rank(0)
    assert [c.name for c in communicators(middle)].count("pipeline neighbour (send/recv)") == 2
    assert [c.name for c in communicators(first)].count("pipeline neighbour (send/recv)") == 1
    tied = first.model.tied_embeddings
    assert any(c.name.startswith("embedding") for c in communicators(first)) is tied


def test_the_deepspeed_pipeline_engine_opens_its_grid_stage_and_slice_groups() -> None:
    # The loss broadcast over the grid's pipe group (pp ranks, one a node at tp 8 x dp 8) and the
    # partitioned stage outputs' all-gathers over its slice group (the tp ranks, inside the node):
    # communicators beside Megatron's tensor-parallel one, on every stage.
    request = _request(Framework.megatron_deepspeed, StrategyKind.zero1, gpus=256, tp=8, pp=4, pipeline_rank=1, accum=8)
    found = {c.name: c for c in communicators(request)}
    stages = found["pipeline engine stages (loss broadcast)"]
    slice_ = found["pipeline engine slice (partitioned stage outputs)"]
    assert (stages.group_size, stages.ranks_per_node, stages.bytes) == (4, 1, ring_bytes(4, 1, 16))
    assert (slice_.group_size, slice_.ranks_per_node, slice_.bytes) == (8, 8, ring_bytes(8, 8, 16))
    assert "tensor parallel" in found
    # Without a pipeline the engine runs neither; Megatron-LM's profile never does.
    assert not any(name.startswith("pipeline engine") for name in
                   (c.name for c in communicators(_request(Framework.megatron_deepspeed, StrategyKind.zero1, gpus=64, tp=8, accum=8))))
    megatron = _request(Framework.megatron, StrategyKind.zero1, gpus=256, tp=8, pp=4, pipeline_rank=1, accum=8)
    assert not any(c.name.startswith("pipeline engine") for c in communicators(megatron))



def test_the_header_gives_the_range_where_the_strategies_communicators_differ() -> None:
    from types import SimpleNamespace

    from zeroplan.report.table import usable_text
    from zeroplan.units import ByteUnit, GiB

    def report(*usable: float) -> SimpleNamespace:
        plans = [SimpleNamespace(usable_memory_bytes=int(u * GiB)) for u in usable]
        return SimpleNamespace(plans=plans, cluster=SimpleNamespace(usable_memory_bytes=int(79.2 * GiB)))

    assert usable_text(report(78.75, 78.75), ByteUnit.GiB) == "78.8 GiB usable per GPU"
    assert usable_text(report(78.99, 78.16), ByteUnit.GiB) == "78.2-79.0 GiB usable per GPU (by strategy)"
    assert usable_text(report(), ByteUnit.GiB) == "79.2 GiB usable per GPU"


def test_nvls_buffers_follow_the_nccl_release() -> None:
    # v2.17.1-1 to v2.20.5-1 (nvls.cc ncclNvlsSetup): heads x 2 x 16 channels x (NCCL_BUFFSIZE
    # 4 MiB + NVLS_MEM_ALIGN_SIZE 2 MiB); v2.21.5-1: 8 steps x 128 KiB + 2 MiB; v2.22.3-1 on: the
    # chunks alone. NCCL before 2.17 has no NVLS.
    assert nvls_bytes(8, (2, 19, 3)) == nvls_bytes(8, (2, 17, 1)) == 8 * 32 * 6 * MiB == 1536 * MiB
    assert nvls_bytes(8, (2, 21, 5)) == 768 * MiB
    assert nvls_bytes(8, (2, 22, 3)) == nvls_bytes(8) == 256 * MiB
    assert nvls_bytes(8, (2, 14, 3)) == 0
    assert nvls_bytes(4, (2, 19, 3)) == 768 * MiB


def test_torch_releases_load_the_nccl_their_wheels_pin() -> None:
    from zeroplan.core.nccl_release import NCCL_MODELLED, nccl_release

    def nccl(torch: str | None):
        return nccl_release(TrainingSpec(framework=Framework.hf, torch_release=torch))

    assert nccl(None) == NCCL_MODELLED == (2, 28, 3)
    assert [nccl(v) for v in ("1.13", "2.0.1", "2.1", "2.2.1", "2.3", "2.6", "2.7", "2.13")] == [
        (2, 14, 3), (2, 14, 3), (2, 18, 1), (2, 19, 3), (2, 20, 5), (2, 20, 5), NCCL_MODELLED, NCCL_MODELLED]


def _at_torch(request: PlanRequest, torch: str) -> PlanRequest:
    return request.model_copy(update={"training": request.training.model_copy(update={"torch_release": torch})})


def test_before_nccl_2_22_every_communicator_sets_up_nvls_at_initialisation() -> None:
    # torch 2.2 (NCCL 2.19.3) on 8 H100s: FSDP's one communicator holds 2.19's NVLS buffers (and
    # the tree connections made at initialisation, test below).
    tree = tree_chain_bytes(8, 16)
    (only,) = communicators(_at_torch(_request(), "2.2"))
    assert only.bytes == ring_bytes(8, 8, 16) + tree + 1536 * MiB
    # The world group runs barriers only (no NVLS call): NCCL 2.28 connects no NVLS for it, 2.19
    # sets it up at initialisation all the same.
    layout = _request(gpus=8, tp=2, accum=1)
    world = {c.name: c for c in communicators(layout)}["world (barriers)"]
    assert world.bytes == ring_bytes(8, 8, 16)
    world_2_19 = {c.name: c for c in communicators(_at_torch(layout, "2.2"))}["world (barriers)"]
    assert world_2_19.bytes == ring_bytes(8, 8, 16) + tree + 1536 * MiB
    # No multicast on A100 nodes; at most 2 GPUs of the communicator on the node: none either.
    assert nccl_buffer_bytes(_at_torch(_request(gpu="a100-80gb"), "2.2")) == ring_bytes(8, 8, 16) + tree
    tp2 = {c.name: c for c in communicators(_at_torch(layout, "2.2"))}["tensor parallel"]
    assert tp2.bytes == ring_bytes(2, 2, 16)
    # NCCL 2.20 (torch 2.3) leaves out a communicator that spans nodes; 2.19 does not.
    spans = _request(gpus=16)
    between = tree_network_bytes(16, 8, 16)
    assert nccl_buffer_bytes(_at_torch(spans, "2.3")) == ring_bytes(16, 8, 16) + tree + between
    assert nccl_buffer_bytes(_at_torch(spans, "2.2")) == ring_bytes(16, 8, 16) + tree + between + 1536 * MiB


def test_before_nccl_2_22_trees_add_the_chains_reverse_connections() -> None:
    # init.cc "Connect Trees": the chain inside a node links the ring's neighbours, so each rank
    # inside it gains the direction the ring lacks, one connection per channel.
    assert tree_chain_bytes(8, 16) == ring_bytes(8, 8, 16) == 16 * connection_bytes()
    assert tree_chain_bytes(4, 24) == 24 * connection_bytes()
    # Two ranks on the node: the ring of a one-node pair runs both ways already; across nodes the
    # pair's reverse link and the links between nodes are left out.
    assert tree_chain_bytes(2, 16) == tree_chain_bytes(1, 16) == 0
    a100 = _request(gpu="a100-80gb")
    assert nccl_buffer_bytes(a100) == ring_bytes(8, 8, 16)
    for torch, tree in (("2.0", tree_chain_bytes(8, 16)), ("2.6", tree_chain_bytes(8, 16)), ("2.7", 0)):
        assert nccl_buffer_bytes(_at_torch(a100, torch)) == ring_bytes(8, 8, 16) + tree, torch


def test_the_double_binary_tree_is_nccls() -> None:
    from zeroplan.core.nccl_buffers import btree_neighbours, dtree_neighbours

    # trees.cc's illustrations: the binary tree over 14 nodes (0-8, 8 over 4 and 12, 12 over 10
    # and 13), the mirrored second tree over 12 (11-3, 3 over 1 and 7) and the shifted one over 13
    # (1-9, 9 over 5 and 0, 0 over 11).
    assert [btree_neighbours(14, n) for n in (0, 8, 12, 13, 2)] == [(8,), (0, 4, 12), (8, 10, 13), (12,), (4, 1, 3)]
    assert dtree_neighbours(12, 3)[1] == (11, 7, 1) and dtree_neighbours(12, 11)[1] == (3,)
    assert dtree_neighbours(13, 9)[1] == (1, 5, 0) and dtree_neighbours(13, 0)[1] == (9, 11)
    # Every tree has nodes - 1 links.
    for nodes in (2, 3, 7, 10, 16, 48):
        for tree in (0, 1):
            assert sum(len(dtree_neighbours(nodes, n)[tree]) for n in range(nodes)) == 2 * (nodes - 1)


def test_trees_between_nodes_add_what_the_ring_lacks() -> None:
    link = connection_bytes() + LL128_BUFFER_BYTES + SIMPLE_BUFFER_BYTES  # a receive and a send staging
    # One node: no links between nodes. Two nodes, one rank each: the ring already links the pair
    # both ways.
    assert tree_network_bytes(8, 8, 16) == tree_network_bytes(2, 1, 16) == 0
    # 3 or more ranks a node: none of the trees' links is the ring's; a node has 2 (n - 1) / n links
    # a tree on average, each tree on half the channels, shared by the node's ranks.
    assert tree_network_bytes(80, 8, 16) == 16 * (2 * 2 * 9 * link) // (2 * 10 * 8)
    # One rank a node, 4 nodes (ring 0-1-2-3-0): the first tree 0-2, 2-1, 2-3 and the mirrored
    # 3-1, 1-2, 1-0; links to the ring's predecessor reuse its receive, to its successor its send.
    new = 0
    for node, trees in ((0, ((2,), (1,))), (1, ((2,), (3, 2, 0))), (2, ((0, 1, 3), (1,))), (3, ((2,), (1,)))):
        for tree in trees:
            for peer in tree:
                new += (peer != (node - 1) % 4) * connection_bytes()
                new += (peer != (node + 1) % 4) * (link - connection_bytes())
    assert tree_network_bytes(4, 1, 16) == 16 * new // (2 * 4)
    assert 0 < tree_network_bytes(4, 1, 16) < 16 * 3 * link


def test_deepspeed_of_february_2022_plans_an_nccl_of_its_date() -> None:
    from zeroplan.core.nccl_release import NCCL_BY_2022_02, connects_at_init, nccl_release

    def training(**kw):
        return TrainingSpec(framework=Framework.megatron_deepspeed, **kw)

    assert nccl_release(training(deepspeed_release="2022-bigscience")) == NCCL_BY_2022_02 == (2, 11, 4)
    assert connects_at_init(NCCL_BY_2022_02)
    assert nccl_release(training()) == (2, 28, 3)
    # tp 8 x pp 4 x dp 8 on 256 A100s, a middle stage: every communicator adds its trees' chain
    # where the node holds more than 2 of its ranks, and each pipeline pair (one rank a node)
    # its two-rank ring, connected at initialisation beside the send/recv buffers.
    request = _request(Framework.megatron_deepspeed, StrategyKind.zero1, gpu="a100-80gb", gpus=256, tp=8, pp=4,
                       pipeline_rank=1, accum=8)
    training = request.training.model_copy(update={"deepspeed_release": "2022-bigscience"})
    old = request.model_copy(update={"training": training})
    now = {c.name: c for c in communicators(request)}
    then = {c.name: c for c in communicators(old)}
    assert then["tensor parallel"].bytes == now["tensor parallel"].bytes + tree_chain_bytes(8, 16)
    assert now["data parallel"].bytes == ring_bytes(8, 1, 16)
    assert then["data parallel"].bytes == ring_bytes(8, 1, 16) + tree_network_bytes(8, 1, 16)
    pairs = [c for c in communicators(old) if c.name.startswith("pipeline neighbour")]
    assert len(pairs) == 2
    assert all(c.bytes == send_recv_bytes(0, 1, 2, 16) + ring_bytes(2, 1, 16) for c in pairs)
    assert nccl_buffer_bytes(old) > nccl_buffer_bytes(request)


def test_torchtitans_pipeline_ring_is_counted_once() -> None:
    # Its pipeline group runs the gradient norm's all-reduce (a ring) and the stages' send/recv;
    # an NCCL before 2.22 connects that ring at initialisation, the same ring.
    request = _request(gpus=32, pp=4, pipeline_rank=1, accum=8)
    for torch, trees in (("2.2", tree_network_bytes(4, 1, 16)), ("2.13", 0)):
        (pipe,) = [c for c in communicators(_at_torch(request, torch)) if c.name.startswith("pipeline")]
        assert pipe.bytes == send_recv_bytes(0, 2, 2, 16) + ring_bytes(4, 1, 16) + trees, torch
    # The four stages on one node (dp 2 between them): the ring never leaves the node, and before
    # 2.22 the trees' chain over the four is connected too.
    one_node = _request(gpus=8, pp=4, pipeline_rank=1, accum=8)
    local = send_recv_bytes(2, 0, 16, 16)
    for torch, tree in (("2.2", tree_chain_bytes(4, 16)), ("2.13", 0)):
        (pipe,) = [c for c in communicators(_at_torch(one_node, torch)) if c.name.startswith("pipeline")]
        assert pipe.bytes == local + ring_bytes(4, 4, 16) + tree, torch


def test_deepspeed_0_13_3_zero3_opens_the_default_group_beside_its_clone() -> None:
    request = _request(Framework.hf, StrategyKind.zero3)
    old = request.model_copy(update={"training": request.training.model_copy(update={"deepspeed_release": "0.13.3"})})
    assert [c.name for c in communicators(request)] == ["data parallel"]
    found = communicators(old)
    assert [c.name for c in found] == ["data parallel", "world (ZeRO-3 parameter all-gathers)"]
    # Both run NVLS-able collectives (reduce-scatter, all-gather) on the node's 8 H100s.
    assert all(c.bytes == ring_bytes(8, 8, 16) + nvls_bytes(8) for c in found)
    assert nccl_buffer_bytes(_at_torch(old, "2.2")) == 2 * (ring_bytes(8, 8, 16) + tree_chain_bytes(8, 16) + 1536 * MiB)
