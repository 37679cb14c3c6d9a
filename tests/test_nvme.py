"""ZeRO-Infinity on NVMe (zeroplan.core.nvme): host pinned buffers, NVMe bytes and the step's NVMe
time from DeepSpeed 0.19.8's defaults, the GPU unchanged against the CPU offload strategies, the
flags and their refusals, and fit taking the strategies only when named."""

from __future__ import annotations

import pytest

from zeroplan.cli.main import main
from zeroplan.core import nvme
from zeroplan.core.collective import Phase
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.params import total_parameters
from zeroplan.core.plan import fit, plan
from zeroplan.core.timing import nvme_time_by_phase
from zeroplan.errors import ZeroplanError
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.nvme import NVME_PRESETS, parse_nvme_bandwidth

MODEL = get_model("llama-2-7b")


def _request(gpu, kind, gpus=1, accum=1) -> PlanRequest:
    return PlanRequest(model=MODEL, batch=BatchSpec(grad_accum_steps=accum), training=TrainingSpec(),
                       cluster=cluster_from_gpus(gpu, gpus, gpus_per_node=min(8, gpus)), strategy=StrategySpec(kind=kind))


def test_sub_groups_close_at_one_billion_partition_elements(gpu_80gib) -> None:
    groups = nvme.sub_group_partition_elements(_request(gpu_80gib, StrategyKind.zero3_nvme))
    assert sum(groups) == total_parameters(MODEL)
    # deepspeed zero/config.py sub_group_size = 1e9: every group but the last reaches it.
    assert all(g >= 10**9 for g in groups[:-1]) and groups[-1] < 10**9 + max(groups)


def test_gpu_memory_is_the_cpu_offload_strategies(gpu_80gib) -> None:
    for cpu, disk in ((StrategyKind.zero3_offload, StrategyKind.zero3_nvme),
                      (StrategyKind.zero3_param_offload, StrategyKind.zero3_param_nvme)):
        a, b = plan(_request(gpu_80gib, cpu, gpus=8)), plan(_request(gpu_80gib, disk, gpus=8))
        assert a.memory.peak_bytes == b.memory.peak_bytes
        # One rank's 6.7e9-element partition: four ~1e9-element fp32 buffers, not 16 B per element.
        # (Over 8 ranks the sub-group is the whole partition and the buffers need as much as CPU offload.)
        one_cpu, one_disk = model_state_bytes(_request(gpu_80gib, cpu)), model_state_bytes(_request(gpu_80gib, disk))
        assert one_disk.host_bytes < one_cpu.host_bytes // 4


def test_host_pinned_buffers_from_deepspeed_defaults(gpu_80gib) -> None:
    request = _request(gpu_80gib, StrategyKind.zero3_param_nvme)
    largest = max(nvme.sub_group_partition_elements(request))
    # Optimizer swapper: buffer_count 4 x largest sub-group (fp32, aligned to 1024 B = 256 elements).
    opt = 4 * (-(-largest // 256) * 256) * 4
    assert nvme.optimizer_swap_buffer_bytes(request) == opt
    # Parameter swapper: 5 bf16 buffers of the largest parameter partition, the 32000 x 4096
    # embedding on one rank (131,072,000 elements, a multiple of 1024 B = 512 elements), since
    # DeepSpeed's 1e8 default cannot hold it (partition_parameters.py get_buffer asserts); the
    # pinned max_in_cpu = 1e9 elements, and the reuse buffer of the largest sub-group (aligned to
    # 512 bf16 elements).
    assert nvme.parameter_buffer_elements(request) == 32000 * 4096
    param = 5 * 131_072_000 * 2 + 10**9 * 2 + (-(-largest // 512) * 512) * 2
    assert nvme.parameter_swap_host_bytes(request) == param
    assert model_state_bytes(request).host_bytes == opt + param
    zero3_nvme = _request(gpu_80gib, StrategyKind.zero3_nvme)
    assert model_state_bytes(zero3_nvme).host_bytes == nvme.optimizer_swap_buffer_bytes(zero3_nvme) == opt


def test_nvme_bytes_are_adam_states_and_the_parameters_beyond_the_host(gpu_80gib) -> None:
    n = total_parameters(MODEL)
    # fp32 master 4 + fp32 gradient 4 + exp_avg 4 + exp_avg_sq 4 per element.
    assert nvme.nvme_bytes(_request(gpu_80gib, StrategyKind.zero3_nvme)) == 16 * n
    request = _request(gpu_80gib, StrategyKind.zero3_param_nvme)
    kept = nvme.parameters_kept_on_host(request)
    assert kept <= 10**9 and nvme.parameters_on_nvme(request) == n - kept
    assert nvme.nvme_bytes(request) == 16 * n + 2 * (n - kept)
    assert nvme.nvme_bytes(_request(gpu_80gib, StrategyKind.zero3_param_offload)) == 0


def test_step_traffic_and_time(gpu_80gib) -> None:
    request = _request(gpu_80gib, StrategyKind.zero3_param_nvme, accum=2)
    n, params = total_parameters(MODEL), 2 * nvme.parameters_on_nvme(request)
    t = nvme.nvme_traffic(request)
    assert (t.forward_read, t.backward_read, t.backward_write) == (2 * params, 2 * params, 4 * n)
    assert (t.step_read, t.step_write) == (16 * n, 12 * n + params)
    seconds = nvme_time_by_phase(request)
    read, write = 6.5e9, 3.5e9  # the pm9a3 default, one rank on the node
    assert seconds[Phase.forward] == pytest.approx(2 * params / read)
    assert seconds[Phase.step] == pytest.approx(16 * n / read + (12 * n + params) / write)
    time = plan(request).time
    assert time.nvme_transfer_s == pytest.approx(sum(seconds.values()))
    # The optimizer swapper is synchronous: the step phase's NVMe time is exposed in full.
    assert time.exposed_communication_s >= seconds[Phase.step]
    assert plan(_request(gpu_80gib, StrategyKind.zero3_param_offload)).time.nvme_transfer_s == 0.0


def test_bandwidth_flag_parses_presets_and_figures() -> None:
    assert parse_nvme_bandwidth("pm1743") == NVME_PRESETS["pm1743"] == (13e9, 6.6e9)
    assert parse_nvme_bandwidth("5") == (5e9, 5e9)
    assert parse_nvme_bandwidth("7,3.5") == (7e9, 3.5e9)
    for bad in ("fast", "0", "1,2,3", "-1"):
        with pytest.raises(ZeroplanError, match="--nvme-bandwidth") as error:
            parse_nvme_bandwidth(bad)
        assert "\n" not in str(error.value) and "pm9a3" in str(error.value)


def test_opt_in_and_capacity_check(gpu_80gib, capsys) -> None:
    kinds = {p.strategy for p in fit(_request(gpu_80gib, StrategyKind.ddp, gpus=8)).plans}
    assert StrategyKind.zero3_nvme not in kinds and StrategyKind.zero3_param_nvme not in kinds
    assert main(["fit", "llama-2-7b", "--gpus", "1", "--strategies", "zero3-nvme", "--nvme-capacity-gb", "100"]) == 0
    assert "zero3-nvme  host" in capsys.readouterr().out  # 16 B x 6.74e9 parameters = 108 GB > 100 GB
    assert main(["fit", "llama-2-7b", "--gpus", "1", "--strategies", "zero3-nvme", "--detail"]) == 0
    assert "NVMe 108 GB" in capsys.readouterr().out


@pytest.mark.parametrize("read, write, expected", [
    # r 2, c 1, w 3 per sub-group, 3 sub-groups (pipelined_optimizer_swapper.py's order):
    (False, False, 3 * (2 + 1 + 3)),      # each read, step, write waited for in turn
    (True, False, 2 + 1 + 3 + 2 * 4),     # the next read hides behind step + write (4 > 2)
    (False, True, 2 + 1 + 3 + 2 * 3),     # the write hides behind the next read + step (3 = 3)
    (True, True, 2 + 1 + 3 + 2 * 3),      # three stages: the slowest, the write, sets the pace
])
def test_pipelined_swapper_overlaps_as_its_step_loop_orders(read, write, expected) -> None:
    assert nvme.pipelined_step_s([2.0] * 3, [1.0] * 3, [3.0] * 3, read, write) == pytest.approx(expected)
    # One sub-group: nothing runs ahead (no next swappable group), whatever the flags.
    assert nvme.pipelined_step_s([2.0], [1.0], [3.0], read, write) == pytest.approx(6.0)


def _pipelined(gpu, kind, pipeline, gpus=1):
    request = _request(gpu, kind, gpus=gpus)
    return request.with_strategy(request.strategy.model_copy(update={"nvme_pipeline_read": pipeline in ("read", "both"),
                                                                     "nvme_pipeline_write": pipeline in ("write", "both")}))


def test_pipelining_holds_more_swap_buffers_and_hides_the_step_reads(gpu_80gib) -> None:
    off = _request(gpu_80gib, StrategyKind.zero3_nvme)
    both = _pipelined(gpu_80gib, StrategyKind.zero3_nvme, "both")
    assert len(nvme.sub_group_partition_elements(off)) == 7  # 6.74e9 elements in 1e9-element sub-groups
    # Adam: master, exp_avg, exp_avg_sq and the gradient per sub-group; three sub-groups at once.
    assert nvme.optimizer_swap_buffer_count(off) == 4 and nvme.optimizer_swap_buffer_count(both) == 12
    assert nvme.optimizer_swap_buffer_bytes(both) == 3 * nvme.optimizer_swap_buffer_bytes(off)
    assert nvme.optimizer_swap_buffer_count(_pipelined(gpu_80gib, StrategyKind.zero3_nvme, "read")) == 8
    # Over 8 ranks a rank's partition is one sub-group: nothing to pipeline, the default pool.
    assert nvme.optimizer_swap_buffer_count(_pipelined(gpu_80gib, StrategyKind.zero3_nvme, "both", gpus=8)) == 4
    slow, fast = plan(off).time, plan(both).time
    assert fast.nvme_transfer_s == pytest.approx(slow.nvme_transfer_s)  # the same bytes
    assert fast.step_with_overlap_s < slow.step_with_overlap_s
    # Never below the drive: all the step's writes at the write bandwidth.
    t = nvme.nvme_traffic(both)
    assert fast.step_with_overlap_s >= t.step_write / 3.5e9 + fast.forward_compute_s


def test_parameter_buffers_take_deepspeeds_default_when_it_holds_every_partition(gpu_80gib) -> None:
    # Over 8 ranks the embedding's partition is 16.4M elements: the 1e8 default holds it.
    assert nvme.parameter_buffer_elements(_request(gpu_80gib, StrategyKind.zero3_param_nvme, gpus=8)) == 10**8


def test_nvme_pipeline_flag(capsys) -> None:
    argv = ["fit", "llama-2-70b", "--gpus", "1", "--strategies", "zero3-nvme", "--activation-checkpointing", "full",
            "--format", "json"]
    import json

    steps = []
    for extra in ([], ["--nvme-pipeline", "both"]):
        assert main(argv + extra) == 0
        steps.append(json.loads(capsys.readouterr().out)["plans"][0])
    assert steps[1]["time"]["step_with_overlap_s"] < steps[0]["time"]["step_with_overlap_s"]
    assert steps[1]["host_bytes_per_rank"] == 3 * steps[0]["host_bytes_per_rank"]
    with pytest.raises(SystemExit):
        main(argv + ["--nvme-pipeline", "sideways"])
    assert "--nvme-pipeline: invalid choice: 'sideways'" in capsys.readouterr().err
