"""NCCL's algorithm choice (zeroplan/core/algorithms.py, tuning.cc v2.28.3) and the catalog's
achievable bus bandwidths, checked against hand computation on the catalog's DGX figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zeroplan.calibrate.fit import calibrated_gpu, fit_log
from zeroplan.calibrate.parse import parse_nccl_tests
from zeroplan.cli.main import main
from zeroplan.core.algorithms import (
    Algorithm, Layout, fastest_algorithm, achievable_efficiencies, available_algorithms, bus_factor, call_pricing,
    call_time_s, call_timer, collective_cost, entry_efficiency, entry_layout,
)
from zeroplan.core.communication import CollectiveOp, collectives
from zeroplan.core.plan import plan
from zeroplan.presets.gpus import get_gpu, gpu_names
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, NodeNetworkSpec, PerformanceAssumptions, PlanRequest, StrategyKind, StrategySpec, cluster_from_gpus,
)
from zeroplan.units import GiB, MiB

FIXTURES = Path(__file__).parent / "fixtures" / "nccl_tests"
AR, AG = CollectiveOp.all_reduce, CollectiveOp.all_gather
A100, H100 = get_gpu("a100-80gb"), get_gpu("h100-80gb")
NVLINK_S, IB_S = 3.4e-6, 10e-6  # catalog per-step latencies


def _nodes(count: int, per_node: int = 8) -> Layout:
    return Layout(group_size=count * per_node, ranks_per_node=per_node, gpus_per_node=8, spans_nodes=count > 1)


def _choice(gpu, op, layout, size, efficiencies=None):
    return fastest_algorithm(gpu, op, layout, size, available_algorithms(gpu, op, layout), efficiencies or {})[0]


def test_nvls_only_on_nvswitch_hopper_and_newer() -> None:
    one_node = _nodes(1)
    for name in gpu_names():
        gpu = get_gpu(name)
        has_nvls = Algorithm.nvls in available_algorithms(gpu, AR, one_node)
        assert has_nvls == (gpu.architecture.value in ("hopper", "blackwell") and gpu.nvswitch), name
    assert Algorithm.nvls not in available_algorithms(A100, AR, one_node)  # NVSwitch, but sm_80
    no_switch = H100.model_copy(update={"nvswitch": False})
    assert available_algorithms(no_switch, AR, one_node) == (Algorithm.ring,)
    # NVLS needs two local ranks: HSDP's replica group (one rank per node) cannot use it.
    assert Algorithm.nvls_tree not in available_algorithms(H100, AR, _nodes(2, per_node=1))


def test_h100_one_node_all_reduce_is_nvls_by_hand() -> None:
    # NVLS (tuning.cc): busBw = 2 x .85 x (8-1)/8 x 450 GB/s, algbw = busBw x 8 / 14; 25 us latency.
    # Ring: 14 steps x 3.4 us + 2 x 7 x 2^27 B / 450 GB/s.
    size = GiB
    nvls_s = 25e-6 + size / (2 * 0.85 * 7 / 8 * 450e9 * 8 / 14)
    ring_s = 14 * NVLINK_S + 14 * (size // 8) / 450e9
    assert call_time_s(H100, Algorithm.nvls, AR, _nodes(1), size) == pytest.approx(nvls_s, rel=1e-12)
    assert call_time_s(H100, Algorithm.ring, AR, _nodes(1), size) == pytest.approx(ring_s, rel=1e-12)
    assert nvls_s < ring_s and _choice(H100, AR, _nodes(1), size) is Algorithm.nvls


def test_tree_for_small_messages_ring_for_large_on_four_a100_nodes() -> None:
    # 4 DGX A100 nodes, N = 32: ring latency 2 x 31 x 10 us; its bus bandwidth min(300, 8 x 25) GB/s.
    # Tree: 2 x (7 x 3.4 + log2(4) x 10) us; algbw = .92 x 200 GB/s / 2 x treeCorrectionFactor
    # (Simple row; index log2(S / 64): 14 for 1 MiB -> .5, past the table for 1 GiB -> 1).
    layout = _nodes(4)
    ring_latency, tree_latency = 62 * IB_S, 2 * (7 * NVLINK_S + 2 * IB_S)
    for size, correction, expected in ((MiB, 0.5, Algorithm.tree), (GiB, 1.0, Algorithm.ring)):
        ring_s = ring_latency + 62 * (size // 32) / 200e9
        tree_s = tree_latency + size / (0.92 * 200e9 / 2 * correction)
        assert call_time_s(A100, Algorithm.ring, AR, layout, size) == pytest.approx(ring_s, rel=1e-12)
        assert call_time_s(A100, Algorithm.tree, AR, layout, size) == pytest.approx(tree_s, rel=1e-12)
        assert _choice(A100, AR, layout, size) is expected
        assert (tree_s < ring_s) == (expected is Algorithm.tree)


def test_two_a100_nodes_keep_the_tree_at_1_gib() -> None:
    # On <= 2 nodes NCCL's tree runs at the intra-node bandwidth: .92 x 300 / 2 = 138 GB/s of algbw
    # (under the node's 200 GB/s of NICs), which beats the ring's 2 x 15/16 x 1 GiB at 200 GB/s.
    tree_s = 2 * (7 * NVLINK_S + 1 * IB_S) + GiB / 138e9
    ring_s = 30 * IB_S + 30 * (GiB // 16) / 200e9
    assert call_time_s(A100, Algorithm.tree, AR, _nodes(2), GiB) == pytest.approx(tree_s, rel=1e-12)
    assert tree_s < ring_s and _choice(A100, AR, _nodes(2), GiB) is Algorithm.tree


def test_multi_node_h100_all_reduce_is_nvls_tree_and_all_gather_ring() -> None:
    # NVLS tree on 2 nodes: busBw = min(2 x .85 x 7/8 x 450, 2 x 400, 8 channels x 57.7) GB/s.
    layout = _nodes(2)
    bus = min(2 * 0.85 * 7 / 8 * 450e9, 2 * 400e9, 8 * 57.7e9)
    expected = 25e-6 + 2 * 1 * IB_S + GiB / (bus * 16 / 30)
    assert call_time_s(H100, Algorithm.nvls_tree, AR, layout, GiB) == pytest.approx(expected, rel=1e-12)
    assert _choice(H100, AR, layout, GiB) is Algorithm.nvls_tree
    # All-gather across nodes: NVLS only with SHARP (collnet), so the ring.
    assert available_algorithms(H100, AG, layout) == (Algorithm.ring,)


def test_collnet_and_multi_node_nvls_only_when_sharp_is_declared() -> None:
    layout = _nodes(4)
    assert Algorithm.collnet not in available_algorithms(H100, AR, layout)
    sharp = H100.model_copy(update={"node_network": H100.node_network.model_copy(update={"sharp": True})})
    assert {Algorithm.collnet, Algorithm.nvls} <= set(available_algorithms(sharp, AR, layout))
    assert Algorithm.nvls in available_algorithms(sharp, AG, layout)
    # CollNet Direct (tuning.cc): 2 x (1 x 3.4 + 7 x .4) us + 10 us; busBw = 450 / 1 (8 GPUs, 8 NICs)
    # x .85 (sm_90), algbw = busBw / 2.
    expected = 2 * (NVLINK_S + 7 * 0.4e-6) + IB_S + GiB / (450e9 * 0.85 / 2)
    assert call_time_s(sharp, Algorithm.collnet, AR, layout, GiB) == pytest.approx(expected, rel=1e-12)


def test_every_achievable_entry_has_a_source_and_keeps_the_nominal_links() -> None:
    found = 0
    for name in gpu_names():
        gpu = get_gpu(name)
        for entry in gpu.achievable:
            found += 1
            assert entry.source.startswith("https://"), (name, entry)
            assert re.fullmatch(r"\d+\.\d+\.\d+", entry.nccl_version), (name, entry)
            assert entry.message_bytes >= 2**30 and entry.note
    assert found >= 4
    # The datasheet figures stay as they were; the published ones sit beside them.
    assert H100.intra_node_link.bandwidth_bytes_per_s == 450e9
    assert H100.achievable[0].bus_bandwidth_bytes_per_s == pytest.approx(478.87e9)


@pytest.mark.parametrize("name", [n for n in gpu_names() if get_gpu(n).achievable])
def test_achievable_mode_gives_each_published_run_its_measured_time(name: str) -> None:
    # The run's time is size x bus factor / busbw; the model at the fitted efficiency gives it back.
    gpu = get_gpu(name)
    for entry in gpu.achievable:
        op, layout = CollectiveOp(entry.collective), entry_layout(entry)
        algorithm, k = entry_efficiency(gpu, entry)
        measured_s = entry.message_bytes * bus_factor(op, layout.group_size) / entry.bus_bandwidth_bytes_per_s
        assert call_time_s(gpu, algorithm, op, layout, entry.message_bytes, k) == pytest.approx(measured_s, rel=1e-12)
        assert achievable_efficiencies(gpu, op, layout)[algorithm] == k


def _request(gpu, gpus: int, kind=StrategyKind.ddp, **performance) -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-2-7b"), batch=BatchSpec(micro_batch_size=1, seq_len=4096),
        cluster=cluster_from_gpus(gpu, gpus), strategy=StrategySpec(kind=kind),
        performance=PerformanceAssumptions(**performance),
    )


def test_plan_result_names_the_algorithm_and_the_basis() -> None:
    result = plan(_request(H100, 8))
    (cost,) = result.time.collective_times
    assert cost.algorithm is Algorithm.nvls and cost.bandwidth_basis == "achievable"
    nominal = plan(_request(H100, 8, bandwidth="nominal")).time.collective_times[0]
    assert nominal.algorithm is Algorithm.nvls and nominal.bandwidth_basis == "nominal"
    # Published NVLS reaches 71.6 % of the model's 669 GB/s, so the achievable step is slower.
    assert cost.seconds > nominal.seconds
    assert cost.bus_bandwidth_bytes_per_s < nominal.bus_bandwidth_bytes_per_s
    assert result.time.communication_s == pytest.approx(cost.seconds)


def test_forcing_an_algorithm_nccl_cannot_run_falls_back_to_ring() -> None:
    request = _request(H100, 16, StrategyKind.zero3, algorithm="tree")
    for collective in collectives(request):
        assert collective_cost(request, collective).algorithm is Algorithm.ring  # all-gather, reduce-scatter
    ddp = _request(H100, 16, algorithm="tree")
    assert all(c.algorithm is Algorithm.tree for c in plan(ddp).time.collective_times)


def test_collectives_of_one_layout_share_their_call_prices() -> None:
    # DDP's and ZeRO-1's gradient all-reduce on 16 H100s: the same GPU, op and layout, so one
    # pricing, whose cached price of each call size is the uncached model's.
    ddp, zero1 = _request(H100, 16), _request(H100, 16, StrategyKind.zero1)
    first = next(c for c in collectives(ddp) if c.op is AR)
    second = next(c for c in collectives(zero1) if c.op is AR)
    pricing = call_pricing(ddp, first)
    assert call_pricing(zero1, second) is pricing
    efficiencies = achievable_efficiencies(H100, AR, pricing.layout)
    assert pricing.efficiencies == efficiencies
    assert first.call_sizes
    for size, _ in first.call_sizes:
        expected = fastest_algorithm(H100, AR, pricing.layout, size, pricing.candidates, efficiencies)
        assert pricing.call_seconds(size) == expected == pricing.call_seconds(size)
    nominal = call_pricing(_request(H100, 16, bandwidth="nominal"), first)
    assert nominal is not pricing and nominal.efficiencies == {}


@pytest.mark.parametrize("gpu_name", ["a100-80gb", "h100-80gb"])
def test_call_timer_gives_call_time_s_to_the_bit(gpu_name: str) -> None:
    # CallPricing times each size with a timer that takes the size-free bandwidths once: every
    # algorithm, op and layout (one node, two, many; whole and part nodes), sizes across the
    # tree's correction table, with and without an efficiency, the same float as call_time_s.
    gpu = get_gpu(gpu_name)
    sizes = (0, 1, 64, 4095, 1 << 16, 123_457, 1 << 22, 3 * MiB + 5, GiB, 7 * GiB + 3)
    checked = 0
    for op in (AR, AG, CollectiveOp.reduce_scatter, CollectiveOp.broadcast):
        for layout in (_nodes(1), _nodes(2), _nodes(3), _nodes(64), _nodes(16, per_node=4),
                       Layout(group_size=4, ranks_per_node=4, gpus_per_node=8, spans_nodes=False)):
            for algorithm in {*available_algorithms(gpu, op, layout), Algorithm.ring}:
                for efficiency in (1.0, 0.83):
                    timer = call_timer(gpu, algorithm, op, layout, efficiency)
                    for size in sizes:
                        assert timer(size) == call_time_s(gpu, algorithm, op, layout, size, efficiency)
                        checked += 1
    assert checked > 500


def test_calibrated_file_overrides_the_catalog_figures(tmp_path: Path) -> None:
    log = parse_nccl_tests(FIXTURES / "all_reduce_8gpu_1node.txt")
    fit = fit_log(log)
    gpu = calibrated_gpu(H100, [fit])
    (entry,) = gpu.achievable
    assert entry.source == "all_reduce_8gpu_1node.txt" and entry.bus_bandwidth_bytes_per_s == fit.bus_bandwidth_bytes_per_s
    # The fitted busbw comes back at the log's largest size, not the published 478.87 GB/s.
    layout = _nodes(1)
    algorithm, k = entry_efficiency(gpu, entry)
    measured_s = entry.message_bytes * bus_factor(AR, 8) / fit.bus_bandwidth_bytes_per_s
    assert call_time_s(gpu, algorithm, AR, layout, entry.message_bytes, k) == pytest.approx(measured_s, rel=1e-12)
    assert k != pytest.approx(entry_efficiency(H100, H100.achievable[0])[1], rel=1e-3)


def test_compare_prints_the_algorithm_column(capsys) -> None:
    assert main(["compare", "llama-2-7b", "--gpus", "8", "--gpu", "h100", "--strategies", "ddp,zero3"]) == 0
    out = capsys.readouterr().out
    assert "nccl" in out and "AR nvls*" in out and "AG ring, RS ring" in out
    assert main(["compare", "llama-2-7b", "--gpus", "8", "--gpu", "h100", "--strategies", "ddp",
                 "--algorithm", "ring", "--bandwidth", "nominal", "--format", "json"]) == 0
    times = json.loads(capsys.readouterr().out)["plans"][0]["time"]["collective_times"]
    assert [(t["algorithm"], t["bandwidth_basis"]) for t in times] == [("ring", "nominal")]


def test_a_declared_node_network_without_sharp_loads_from_old_files() -> None:
    network = NodeNetworkSpec(nics_per_node=8, nic_bandwidth_bytes_per_s=50e9, source="t")
    assert network.sharp is False


@pytest.mark.parametrize("header,version", [
    ("NCCL version 2.21.5+cuda12.4", "2.21.5"),
    ("# nccl-tests version 2.17.1 nccl-headers=22105 nccl-library=22105", "2.21.5"),
])
def test_calibrate_reads_the_nccl_version_into_the_achievable_entry(tmp_path: Path, header: str, version: str) -> None:
    text = (FIXTURES / "all_reduce_8gpu_1node.txt").read_text()
    path = tmp_path / "run.txt"
    path.write_text(header + "\n" + text)
    log = parse_nccl_tests(path)
    assert log.nccl_version == version
    (entry,) = calibrated_gpu(H100, [fit_log(log)]).achievable
    assert entry.nccl_version == version and entry.scope == "intra_node" and entry.gpus_per_node == 8
