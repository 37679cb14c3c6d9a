"""Attention at its own rate (zeroplan/core/attention_rate.py; docs/communication-time.md,
"Attention at its own rate"): the table's rows carry their source, r is the published TFLOP/s over
the matmul rate, compute splits as documented, and the benchmark's figures are what the docs quote."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.core.attention_rate import RATES, SEQUENCE_POINTS, attention_rate_row, relative_attention_rate
from zeroplan.core.flops import step_flops
from zeroplan.core.timing import compute_time_s, executed_flops_per_s, memory_bound_time_s
from zeroplan.specs import AttentionImplementation, AttentionKernel
from zeroplan.specs.hardware import GpuArchitecture
from zeroplan.validate.step_time import load_published_throughput

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
ROWS = load_published_throughput().rows


def _with(request, mode):  # type: ignore[no-untyped-def]
    return request.model_copy(update={"performance": request.performance.model_copy(update={"attention_rate": mode})})


def test_every_row_names_its_source_and_covers_the_published_sequences() -> None:
    assert len({(row.architecture, row.kernel) for row in RATES}) == len(RATES)
    for row in RATES:
        assert row.source and len(row.tflops) == len(SEQUENCE_POINTS)
        assert all(0 < t < row.matmul_tflops for t in row.tflops)
    assert attention_rate_row(GpuArchitecture.hopper, "flash-attn-triton").assumed  # not published on H100


def test_r_is_the_published_rate_over_the_matmul_rate_interpolated_in_log_s() -> None:
    fa2 = attention_rate_row(GpuArchitecture.ampere, "flash-attn-2")
    assert fa2.relative(2048) == pytest.approx(155 / 267.9)
    assert fa2.relative(2896) == pytest.approx((155 + 0.5 * (173 - 155)) / 267.9, rel=1e-3)
    assert fa2.relative(65536) == fa2.relative(16384) and fa2.relative(128) == fa2.relative(512)
    assert relative_attention_rate(GpuArchitecture.blackwell, AttentionKernel.flash,
                                   AttentionImplementation.flash_attn_2, 8192) == 1.0


def test_published_mode_prices_the_attention_core_at_r_times_the_matmul_rate() -> None:
    row = next(r for r in ROWS if r.name == "mpt-1b h100 x8 s32768 b1x4 no AC")
    request = _with(row.request(), "published")
    flops = step_flops(request)
    rate = executed_flops_per_s(request)
    r = attention_rate_row(GpuArchitecture.hopper, "flash-attn-triton").relative(32768)
    forward, backward = compute_time_s(flops, request)
    # The memory-bound kernels at the copy bandwidth, whatever the attention rate.
    memory_forward, memory_backward = memory_bound_time_s(request)
    assert 0 < flops.attention_forward_flops < flops.forward_flops
    assert forward == pytest.approx((flops.forward_flops - flops.attention_forward_flops) / rate
                                    + flops.attention_forward_flops / (r * rate) + memory_forward)
    assert backward == pytest.approx((flops.backward_flops - flops.attention_backward_flops) / rate
                                     + flops.attention_backward_flops / (r * rate) + memory_backward)
    # Under 'matmul', one HFU for every FLOP.
    assert compute_time_s(flops, row.request()) == pytest.approx(
        (flops.forward_flops / rate + memory_forward, flops.backward_flops / rate + memory_backward))


def test_a_padded_head_dimension_runs_at_d_over_the_padded_width() -> None:
    from zeroplan.core.attention_rate import padded_head_dim

    # Triton: the next power of two (at least 16); FlashAttention-2: a multiple of 32; eager: none.
    assert [padded_head_dim("flash-attn-triton", d) for d in (8, 64, 80, 112, 128)] == [16, 64, 128, 128, 128]
    assert [padded_head_dim("flash-attn-2", d) for d in (64, 80, 112, 128, 200)] == [64, 96, 128, 128, 224]
    assert padded_head_dim("eager", 112) == 112
    # Every MPT row runs 128-wide heads: the benchmark yamls set n_heads so that d_head == 128
    # (scripts/train/yamls/pretrain/mpt-*.yaml; MPT-30B: 7,168 / 56), so none pays the padding.
    assert {r.model_spec.head_size for r in ROWS if r.model.startswith("mpt-")} == {128}
    assert relative_attention_rate(GpuArchitecture.hopper, AttentionKernel.flash, AttentionImplementation.flash_attn_triton,
                                   8192, 112) == pytest.approx(
        0.875 * attention_rate_row(GpuArchitecture.hopper, "flash-attn-triton").relative(8192))


def test_recomputed_attention_is_counted_with_the_attention_core() -> None:
    full = next(r for r in ROWS if r.activation_checkpointing.value == "full" and r.architecture is not None)
    flops = step_flops(full.request())
    # Full checkpointing runs the forward's attention again: backward = 2.5x + 1x the forward's.
    assert flops.attention_backward_flops == pytest.approx(3.5 * flops.attention_forward_flops)


def test_docs_quote_the_attention_rate_figures_as_printed() -> None:
    printed = load_script(ROOT / "benchmarks" / "step_time_accuracy.py").attention_rate_report(load_published_throughput())
    docs = (ROOT / "docs" / "validation.md").read_text()
    section = docs[docs.index("### Attention at its own rate"):]
    lines = [line for line in printed if line.startswith("| ") or line.startswith("attention rate ")]
    assert len(lines) >= 8
    for line in lines:
        assert line in section, line


def test_the_published_eager_rate_covers_its_softmax_so_the_softmax_is_not_timed_again() -> None:
    # flash-attention's benchmark times eager attention whole (both products, the mask's add, the
    # softmax and the dropout), so where attention runs at that rate the softmax's memory passes
    # leave the memory-bound time; under 'matmul' they stay, and a flash kernel has none.
    from zeroplan.core.roofline.step import eager_softmax_seconds

    eager = next(r for r in ROWS if r.name == "megatron 2021 gpt-1.7b a100 x32 tp1 pp1 b512").request()
    softmax = eager_softmax_seconds(eager)
    assert softmax[0] > 0 and softmax[1] > softmax[0]
    matmul = memory_bound_time_s(_with(eager, "matmul"))
    for mode in ("published", "kernel"):
        assert memory_bound_time_s(_with(eager, mode)) == pytest.approx(
            (matmul[0] - softmax[0], matmul[1] - softmax[1]), rel=1e-12)
    flash = next(r for r in ROWS if r.name == "mpt-1b h100 x8 s32768 b1x4 no AC").request()
    assert eager_softmax_seconds(flash) == (0, 0)
    assert memory_bound_time_s(_with(flash, "published")) == memory_bound_time_s(_with(flash, "matmul"))


def test_eager_attention_moves_its_scores_per_head_so_wider_heads_run_faster() -> None:
    from zeroplan.core.attention_rate import eager_relative_at_head_dim

    for architecture, plotted_64 in ((GpuArchitecture.ampere, (15, 16, 17, 18, 18)),
                                     (GpuArchitecture.hopper, (26, 29, 31, 32, 32))):
        eager = attention_rate_row(architecture, "eager")
        # At the published head dimension, the published rate.
        assert eager.relative_at(2048, 128) == pytest.approx(eager.relative(2048))
        # The same plots' head-dimension-64 panels (causal, x2 executed), from the 128 ones: 1k-8k.
        for s, plotted in zip(SEQUENCE_POINTS[1:], plotted_64[1:], strict=False):
            assert eager.relative_at(s, 64) * eager.matmul_tflops == pytest.approx(2 * plotted, rel=0.09)
        rates = [eager.relative_at(2048, d) for d in (64, 96, 128, 160, 224)]
        assert rates == sorted(rates) and rates[-1] < 1
    # The score passes' time per FLOP goes as 1/d, the products' stays at the matmul rate.
    r = 0.25
    assert 1 / eager_relative_at_head_dim(r, 64) - 1 == pytest.approx(2 * (1 / r - 1))
    # The published and kernel modes both read it; a flash kernel keeps d over its padded width.
    assert relative_attention_rate(GpuArchitecture.ampere, AttentionKernel.eager, AttentionImplementation.flash_attn_2,
                                   2048, 96) == pytest.approx(attention_rate_row(GpuArchitecture.ampere, "eager").relative_at(2048, 96))
    fa2 = attention_rate_row(GpuArchitecture.ampere, "flash-attn-2")
    assert fa2.relative_at(2048, 80) == pytest.approx(fa2.relative(2048) * 80 / 96)


def test_eager_attention_with_unequal_query_and_value_heads_runs_at_their_mean_width() -> None:
    # MLA's scores take 2 d_qk FLOPs and its values 2 d_v: 2 (d_qk + d_v) a score, the mean width's.
    eager = attention_rate_row(GpuArchitecture.hopper, "eager")
    assert eager.relative_at(4096, 192, 128) == pytest.approx(eager.relative_at(4096, 160))
    flash = attention_rate_row(GpuArchitecture.hopper, "flash-attn-2")
    assert flash.relative_at(4096, 192, 128) == flash.relative_at(4096, 192)


def test_a_rows_rates_time_only_gpus_of_its_compute_die() -> None:
    # The rows are the A100 SXM's and H100 SXM's own rates: the same die (H200, A100 PCIe, A800,
    # H800) takes them, a GA102 card or a PCIe H100 of the same architecture has no row.
    from zeroplan.core.attention_rate import rate_architecture
    from zeroplan.presets.gpus import get_gpu

    for name in ("a100-80gb", "a100-pcie-40gb", "a800-80gb", "h100-80gb", "h200-141gb", "h800-80gb"):
        assert rate_architecture(get_gpu(name)) is get_gpu(name).architecture
    for name in ("a10g", "a10", "rtx-3090", "rtx-a6000", "h100-pcie", "h100-nvl", "l40s", "v100-32gb"):
        assert rate_architecture(get_gpu(name)) is None


def test_a_gpu_without_its_dies_row_times_attention_at_the_matmul_rate() -> None:
    # Under 'kernel' the A100's own 189 TFLOP/s would run attention on a 71 TFLOP/s RTX 3090 faster
    # than its peak; without a row of its die every mode times it at the matmul rate.
    from zeroplan.core.plan import plan
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.presets.models import get_model
    from zeroplan.specs import (
        BatchSpec, PerformanceAssumptions, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus,
    )

    def seconds(gpu: str, mode: str) -> float:
        request = PlanRequest(model=get_model("llama-2-7b"), training=TrainingSpec(),
                              batch=BatchSpec(micro_batch_size=1, seq_len=4096),
                              cluster=cluster_from_gpus(get_gpu(gpu), 2), strategy=StrategySpec(kind=StrategyKind.fsdp_full_shard),
                              performance=PerformanceAssumptions(attention_rate=mode))
        return plan(request).time.compute_s

    for gpu in ("rtx-3090", "a10g", "h100-pcie"):
        matmul = seconds(gpu, "matmul")
        assert seconds(gpu, "kernel") == pytest.approx(matmul, rel=1e-12) == seconds(gpu, "published")
    assert seconds("a100-pcie-40gb", "kernel") != pytest.approx(seconds("a100-pcie-40gb", "matmul"), rel=1e-3)  # the A100's row applies
