"""ZeRO++'s qwZ and qgZ (zeroplan.core.zeropp, strategy zero3-zeropp): each term's arithmetic from
DeepSpeed 0.19.8's constants (CUDAQuantizer's 8,000-element target group, int8 weights, int4
gradients, fp32 scales), the kernels' time, the refusals, and compare taking it only when named."""

from __future__ import annotations

import math

import pytest

from zeroplan.cli.main import main
from zeroplan.core.algorithms import collective_cost
from zeroplan.core.buffers import transient_buffer_bytes
from zeroplan.core.collective import CollectiveOp, Phase
from zeroplan.core.communication import collectives
from zeroplan.core.model_states import padded_unit_elements_of
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.core.roofline.ceilings import CEILINGS
from zeroplan.core.zeropp import qgz_buffer_bytes, qwz_buffer_bytes, qwz_groups, qwz_kernel_bytes
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs import BatchSpec, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus

MODEL = get_model("llama-2-7b")
GPU = get_gpu("a100-80gb")


def _request(kind, gpus=16, accum=1, training=None, **strategy) -> PlanRequest:
    return PlanRequest(model=MODEL, batch=BatchSpec(grad_accum_steps=accum), training=training or TrainingSpec(),
                       cluster=cluster_from_gpus(GPU, gpus, gpus_per_node=min(8, gpus)),
                       strategy=StrategySpec(kind=kind, **strategy))


def _deepspeed_groups(numel: int) -> int:
    """deepspeed 0.19.8 partition_parameters.py CUDAQuantizer.quantize's loop, verbatim."""
    groups = math.ceil(numel / 8000)
    while groups < numel:
        if numel % (8 * groups) == 0:
            break
        groups += 1
    while True:
        if numel % (8 * groups * 2) == 0 and numel / groups > 8000:
            groups *= 2
        else:
            break
    return groups


@pytest.mark.parametrize("numel", [8, 16000, 8008, 8 * 10007, 4096 * 4096 // 16, 202_383_360 // 8])
def test_qwz_groups_follow_cudaquantizer(numel) -> None:
    assert qwz_groups(numel) == _deepspeed_groups(numel)
    assert numel // qwz_groups(numel) <= 8000


def test_qwz_refuses_a_partition_deepspeed_asserts_on() -> None:
    with pytest.raises(ZeroplanError, match="multiple of 8.*allowed: zero3-hpz or zero3"):
        qwz_groups(12)


def test_qwz_gathers_int8_and_fp32_scales() -> None:
    """Every parameter gather of zero3-hpz becomes an int8 gather of the same padded unit plus
    an fp32 gather of groups x group scales."""
    hpz, zpp = _request(StrategyKind.zero3_hpz, accum=2), _request(StrategyKind.zero3_zeropp, accum=2)
    units = padded_unit_elements_of(zpp, 16)
    plain = [c for c in collectives(hpz) if c.op is CollectiveOp.all_gather]
    gathers = [c for c in collectives(zpp) if c.op is CollectiveOp.all_gather]
    data = [c for c in gathers if "int8" in c.what]
    scales = [c for c in gathers if "scales" in c.what]
    assert len(data) == len(scales) == len(plain) == 3
    for p, d, s in zip(plain, data, scales, strict=True):
        assert (d.group_size, d.occurrences_per_step, d.phase) == (p.group_size, p.occurrences_per_step, p.phase)
        assert d.element_bytes == 1 and d.buffer_bytes * 2 == p.buffer_bytes
        g = d.group_size
        gathered = units if d.phase is Phase.forward else units[1:] if MODEL.tied_embeddings else units
        assert s.buffer_bytes == sum(_deepspeed_groups(n // g) * g * 4 for n in gathered)
        quantize = [3 * (n // g) + 4 * _deepspeed_groups(n // g) for n in gathered]
        dequantize = [3 * n + 4 * g * _deepspeed_groups(n // g) for n in gathered]
        assert d.kernel_bytes == sum(quantize) + sum(dequantize) == sum(qwz_kernel_bytes(n, g) for n in gathered)


def test_qgz_replaces_the_reduce_scatter_with_two_level_int4_all_to_alls() -> None:
    zpp = _request(StrategyKind.zero3_zeropp)
    tensors = [t for u in rank_trainable_units(zpp) for t in u.tensors]
    matrices = [t for t in tensors if len(t.shape) == 2]
    vectors = [t for t in tensors if len(t.shape) == 1]
    by_what = {c.what: c for c in collectives(zpp) if c.phase is Phase.backward and c.op is not CollectiveOp.all_gather}
    intra, inter = by_what["gradients int4 (qgZ, node)"], by_what["gradients int4 (qgZ, nodes)"]
    assert intra.op is CollectiveOp.all_to_all and (intra.group_size, intra.spans_nodes) == (8, False)
    assert (inter.group_size, inter.spans_nodes, inter.ranks_per_node) == (2, True, 1)
    assert intra.buffer_bytes == sum(t.numel // 2 for t in matrices)
    assert inter.buffer_bytes == sum(t.numel // 2 // 8 for t in matrices)
    groups = [max(t.shape[0], t.shape[1], 16) for t in matrices]
    assert by_what["gradient scales (qgZ, node)"].buffer_bytes == 4 * sum(groups)
    assert by_what["gradient scales (qgZ, nodes)"].buffer_bytes == 4 * sum(g // 8 for g in groups)
    # The norms' 1-D gradients are reduce-scattered alone, in bf16, over the 16 ranks.
    assert by_what["gradients (qgZ fallback)"].buffer_bytes == sum(16 * math.ceil(t.numel / 16) * 2 for t in vectors)
    assert intra.volume_elements_per_step == sum(t.numel for t in matrices)
    assert "gradients" not in by_what
    assert sum(c.sent_bytes_per_step for c in collectives(zpp)) < sum(
        c.sent_bytes_per_step for c in collectives(_request(StrategyKind.zero3_hpz))) / 2


def test_qgz_runs_only_across_nodes() -> None:
    """stage3.py __avg_scatter_grads: inside one node (num_nodes == 1) it reduce-scatters."""
    zpp = _request(StrategyKind.zero3_zeropp, gpus=8)
    whats = {c.what for c in collectives(zpp)}
    assert "gradients" in whats and not any("qgZ" in w for w in whats)
    assert qgz_buffer_bytes(zpp) == 0


def test_quantization_kernels_are_a_memory_bound_pass() -> None:
    zpp = _request(StrategyKind.zero3_zeropp)
    (data,) = [c for c in collectives(zpp) if c.what == "gradients int4 (qgZ, node)"]
    bare = data.model_copy(update={"kernel_bytes": 0})
    extra = collective_cost(zpp, data).seconds - collective_cost(zpp, bare).seconds
    assert extra == pytest.approx(data.kernel_bytes / CEILINGS["a100-80gb"].memory_bytes_per_s)


def test_zeropp_buffers_add_to_the_transient_ones() -> None:
    hpz, zpp = _request(StrategyKind.zero3_hpz), _request(StrategyKind.zero3_zeropp)
    units = padded_unit_elements_of(zpp, 16)
    largest = max(units)
    partition = largest // 16
    scales = 4 * _deepspeed_groups(partition)
    assert qwz_buffer_bytes(zpp, units) == partition + scales + largest + 16 * scales + 2 * largest
    assert transient_buffer_bytes(zpp) - transient_buffer_bytes(hpz) == qwz_buffer_bytes(zpp, units) + qgz_buffer_bytes(zpp)
    assert qgz_buffer_bytes(zpp) > 0


def test_zeropp_refusals() -> None:
    with pytest.raises(ZeroplanError, match="data parallelism only"):
        PlanRequest(model=MODEL, cluster=cluster_from_gpus(GPU, 16, gpus_per_node=8),
                    strategy=StrategySpec(kind=StrategyKind.zero3_zeropp), parallel=ParallelSpec(tp=2, sequence_parallel=True))
    with pytest.raises(ZeroplanError, match="does not divide"):
        _request(StrategyKind.zero3_zeropp, hpz_partition_size=3)
    with pytest.raises(ZeroplanError, match="full training only"):
        _request(StrategyKind.zero3_zeropp, training=TrainingSpec(finetune=FineTuneSpec(lora_rank=8)))


def test_compare_takes_zeropp_only_when_named(capsys) -> None:
    argv = ["compare", "llama-2-70b", "--gpus", "16", "--gpu", "a100-80gb"]
    assert main(argv) == 0
    assert "zero3-zeropp" not in capsys.readouterr().out
    assert main(argv + ["--strategies", "zero3,zero3-zeropp"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("strategy "))
    names = [n for n in header.replace("peak GiB", "peak").replace("sent GB", "sent").split()]
    rows = {line.split()[0]: dict(zip(names, line.split())) for line in out if line.startswith("zero3")}
    # The trade-off on the first screen: less than half the traffic, for a larger peak.
    assert float(rows["zero3-zeropp"]["sent"]) < float(rows["zero3"]["sent"]) / 2
    assert float(rows["zero3-zeropp"]["peak"]) > float(rows["zero3"]["peak"])
    code = main(argv + ["--strategies", "zero3-zeropp", "--hpz-partition-size", "3"])
    err = capsys.readouterr().err
    assert code != 0 and "--hpz-partition-size" in err and len(err.strip().splitlines()) == 1
