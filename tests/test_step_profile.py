"""The H200 step profiles (benchmarks/gpu-step-profile-records) as zeroplan.validate.step_profile
reads them: kernels sorted by name into the roofline's categories, annotations left out, the
optimizer's kernels found by its time window, and each profile turned into the request the
roofline prices."""

from __future__ import annotations

import gzip
import json

import pytest

from zeroplan.specs import ActivationCheckpointing, StrategyKind
from zeroplan.validate.step_profile import (
    STEP_PROFILE_DIR, compare_profile, kernel_category, load_step_profile, profile_request, step_profiles,
)

from tests.scripts import load_script


@pytest.mark.parametrize("name, category", [
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "matmul"),
    ("sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "attention"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", "memory"),
    ("Memcpy DtoD (Device -> Device)", "memory"),
    ("Optimizer.step#AdamW.step", None),
    ("FSDP::all_gather (blocks.3)", None),
    ("DistributedDataParallel.forward", None),
])
def test_kernel_categories(name, category) -> None:
    assert kernel_category(name) == category


def test_a_profile_is_every_kernel_once_by_category() -> None:
    path = STEP_PROFILE_DIR / "fsdp-full-shard-torch-2-4096-none.json.gz"
    profile = load_step_profile(path)
    with gzip.open(path, "rt") as handle:
        events = json.load(handle)["device_events"]
    kernels_s = sum(e["duration_us"] for e in events if kernel_category(e["name"]) is not None) / 1e6
    assert sum(profile.kernel_s.values()) == pytest.approx(kernels_s)
    (window,) = [e for e in events if e["name"].startswith("Optimizer.")]
    inside = sum(e["duration_us"] for e in events if kernel_category(e["name"]) is not None
                 and window["start_us"] <= e["start_us"] <= window["start_us"] + window["duration_us"]) / 1e6
    assert profile.kernel_s["optimizer"] == pytest.approx(inside) and inside > 0
    assert (profile.strategy, profile.micro_batch_size, profile.seq_len) == (StrategyKind.fsdp_full_shard, 2, 4096)
    assert profile.activation_checkpointing is ActivationCheckpointing.none and profile.device_name == "NVIDIA H200"


def test_every_record_becomes_a_roofline_request() -> None:
    profiles = step_profiles()
    assert len(profiles) == 4
    for profile in profiles:
        request = profile_request(profile)
        assert request.performance.compute_model == "roofline" and request.cluster.gpu.name == "h200-141gb"
        assert request.batch.micro_batch_size * request.batch.seq_len == 8192
        comparison = compare_profile(profile)
        assert set(comparison.predicted_s) == {"matmul", "attention", "memory", "optimizer", "forward_backward"}
        assert comparison.predicted_s["forward_backward"] > 0


def test_eager_block_traffic_counts_the_blocks_memory_bound_kernels(capsys) -> None:
    """benchmarks/eager_block_traffic.py on a short sequence: the block's fused norm and SiLU are
    counted once each way, views and products are not, and the total is not below the model's
    single-pass count (eager kernels never move less than one read and one write)."""
    from pathlib import Path

    module = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "eager_block_traffic.py")
    assert module.main(["--micro-batch", "1", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    for operator in ("| forward | _fused_rms_norm |", "| backward | _fused_rms_norm_backward |", "| forward | silu |"):
        assert operator in out
    assert "| forward | mm |" not in out and "| forward | view |" not in out
    ratios = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if ", ratio " in line]
    assert len(ratios) == 2 and all(ratio >= 1.0 for ratio in ratios)


def test_docs_step_table_is_what_the_benchmark_prints() -> None:
    # docs/validation.md's per-category table of the H200 step profiles is the benchmark's.
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    module = load_script(root / "benchmarks" / "step_profile_accuracy.py")
    docs = (root / "docs" / "validation.md").read_text()
    lines = [line for line in module.step_table() if line.startswith("| ") and "---" not in line]
    assert len(lines) >= 20
    for line in lines:
        assert line in docs, line


def _bandwidth_script():  # type: ignore[no-untyped-def]
    from pathlib import Path

    return load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "eager_kernel_bandwidth.py")


@pytest.mark.parametrize("name, shapes, expected", [
    ("aten::add", "[[2, 4096, 2048], [2, 4096, 2048], []]", ("pointwise", 3 * 2 * 4096 * 2048 * 2)),
    ("aten::silu", "[[2, 4096, 8192]]", ("pointwise", 2 * 2 * 4096 * 8192 * 2)),
    ("aten::_fused_rms_norm_backward", "[[2, 4096, 2048], [2, 4096, 2048], [], [2, 4096, 1], [2048], []]",
     ("norm backward", 3 * 2 * 4096 * 2048 * 2)),
    ("aten::mul", "[[2, 4096, 32, 32], [1, 4096, 1, 32]]", ("rotary (harness)", (2 * 2 * 4096 * 32 * 32 + 4096 * 32) * 2)),
    ("aten::mul_", "[[1024, 2048], []]", None),  # the optimizer's, not the block's
    ("aten::mm", "[[8192, 2048], [2048, 2048]]", None),
])
def test_eager_kernel_classes_count_the_rooflines_bytes(name, shapes, expected) -> None:
    module = _bandwidth_script()
    assert module.classify({"name": name, "input_shapes": shapes}, 8192) == expected


def test_the_profiled_pointwise_kernels_are_the_rooflines_pointwise_passes() -> None:
    """The pointwise class of a profiled step moves exactly the bytes the roofline counts for the
    blocks' residual adds, activation and gradient sums (so its fraction is the factor on them),
    and the norm classes the blocks' and the final norm's."""
    from zeroplan.core.roofline.operations import OpPass, block_memory_passes
    from zeroplan.core.roofline.operations import head_operations

    module = _bandwidth_script()
    profile = load_step_profile(STEP_PROFILE_DIR / "fsdp-full-shard-torch-2-4096-none.json.gz")
    model, tokens = profile.model, 8192
    passes = [op for op_pass in (OpPass.forward, OpPass.backward)
              for op in block_memory_passes(model, False, tokens, 2, op_pass, model.num_layers)]
    pointwise = sum(op.moved_bytes for op in passes if op.name in ("residual adds", "activation", "gradient sums"))
    found = module.step_classes("fsdp-full-shard-torch-2-4096-none")
    assert found["pointwise"][2] == pointwise
    final = [op for op in head_operations(model, tokens, 2, OpPass.forward, 1, memory_only=True) if op.name == "final norm"]
    norms = sum(op.moved_bytes for op in passes if op.name == "norms" and op.op_pass is OpPass.forward)
    assert found["norm forward"][2] == norms + final[0].moved_bytes


def test_docs_eager_bandwidth_table_is_what_the_benchmark_prints() -> None:
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "validation.md").read_text()
    lines = [line for line in _bandwidth_script().report() if line.startswith(("| fsdp", "pooled"))]
    assert len(lines) == 19
    for line in lines:
        assert line in docs, line
