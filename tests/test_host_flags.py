"""--host, --host-cores and --host-memory-bandwidth-gbs: the node that runs offload's CPU step."""

from __future__ import annotations

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.timing import cpu_optimizer_time_s, offloaded_optimizer_elements
from zeroplan.presets.hosts import HOST_PRESETS
from zeroplan.specs import HostSpec, StrategyKind


def _request(*flags: str):
    args = build_parser().parse_args(["fit", "llama-3.1-8b", "--gpus", "8", *flags])
    request = request_from_args(args)
    return request.model_copy(update={"strategy": request.strategy.model_copy(update={"kind": StrategyKind.zero3_offload})})


def test_the_default_host_is_a_dgx_h100() -> None:
    assert _request().cluster.host == HostSpec() == HOST_PRESETS["dgx-h100"]


def test_a_dgx_a100_has_more_cores_less_bandwidth_and_shared_host_links() -> None:
    host = _request("--host", "dgx-a100").cluster.host
    assert (host.cores_per_node, host.memory_bandwidth_bytes_per_s, host.gpus_per_host_link) == (128, 409.6e9, 2)


def test_fewer_cores_and_less_bandwidth_slow_the_cpu_step() -> None:
    dgx = cpu_optimizer_time_s(_request())
    small = _request("--host-cores", "8", "--host-memory-bandwidth-gbs", "50")
    assert small.cluster.host.cores_per_node == 8 and small.cluster.host.memory_bandwidth_bytes_per_s == 50e9
    # The compute bound, 112/8 = 14 times fewer cores, governs the Adam kernel on the small
    # host; DeepSpeed's unscale and cast passes (14 B per element) stream its memory.
    elements = offloaded_optimizer_elements(small)
    dgx_passes = elements * 14 / (614.4e9 / 8)
    assert cpu_optimizer_time_s(small) == pytest.approx(14 * (dgx - dgx_passes) + elements * 14 / (50e9 / 8), rel=1e-9)


@pytest.mark.parametrize("flags, message", [
    (("--host", "dgx-b200"), "host: unknown 'dgx-b200'"),
    (("--host-cores", "0"), "--host-cores"),
    (("--host-memory-bandwidth-gbs", "-5"), "--host-memory-bandwidth-gbs"),
])
def test_bad_host_input_is_one_line(zeroplan_cli, flags, message) -> None:
    code, out, err = zeroplan_cli("fit", "llama-3.1-8b", *flags)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err


def test_cuda_context_mib_sets_the_memory_outside_the_allocator() -> None:
    from zeroplan.core.feasibility import usable_memory_bytes

    default, stated = _request(), _request("--cuda-context-mib", "1573")
    assert default.cluster.cuda_context_bytes == 512 * 2**20
    assert stated.cluster.cuda_context_bytes == 1573 * 2**20
    # The usable memory shrinks by exactly the difference (NCCL's buffers are the same).
    assert usable_memory_bytes(default) - usable_memory_bytes(stated) == (1573 - 512) * 2**20


@pytest.mark.parametrize("value, message", [
    ("0", "--cuda-context-mib"),
    ("81920", "--cuda-context-mib: must be smaller than the GPU memory"),
])
def test_bad_cuda_context_is_one_line(zeroplan_cli, value, message) -> None:
    code, out, err = zeroplan_cli("fit", "llama-3.1-8b", "--cuda-context-mib", value)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err
