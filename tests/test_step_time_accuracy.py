"""Step time against published throughput: the table computes, each row carries its source, and
the figures mean what the docs say they mean (docs/validation.md, "Step time")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zeroplan.core.compiled_time import compile_saved_seconds
from zeroplan.core.timing import gpu_optimizer_time_s, memory_bound_time_s
from zeroplan.core.flops import model_flops_per_token, step_flops
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.core.default_efficiency import FLAT_HFU
from zeroplan.core.float8_time import float8_gemm_saved_seconds
from zeroplan.specs import StrategyKind
from zeroplan.validate.step_time import PUBLISHED_THROUGHPUT_FILE, load_published_throughput, step_time_table

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
ROWS = load_published_throughput().rows


def _table():
    """Every row against the planner: computed at the first test that reads it, not at import
    (collecting the suite stays quick), and once (step_time_table keeps it per table)."""
    return step_time_table()


def test_at_least_five_rows_each_with_its_source() -> None:
    assert len(ROWS) >= 5
    for row in ROWS:
        assert row.source_url.startswith("https://") and row.source_section and row.setup_notes
    for comparison in _table():
        assert comparison.source.startswith("https://")


def test_published_mfu_is_the_published_throughput_under_the_source_flop_count() -> None:
    # WPS x (6N + 12 L H Q T) / peak gives back each row's MFU: the transcription, the per-GPU
    # reading of WPS and the FLOP count that the FLOPs/token column divides by all hold.
    # The tolerance is the sources' own rounding: whole tokens/s/GPU, and the MFU to 3 digits
    # (torchtitan) or 2 decimals of a percent (llm-foundry).
    for row in ROWS:
        if row.published_mfu is None:  # fms-fsdp's MFU counts FLOPs its own way: not transcribed
            continue
        peak = get_gpu(row.gpu).peak_bf16_flops_per_s
        mfu = row.published_tokens_per_s_per_gpu * model_flops_per_token(row.model_spec, row.seq_len) / peak
        rounding = row.published_mfu * 0.5 / row.published_tokens_per_s_per_gpu + 5e-4
        assert mfu == pytest.approx(row.published_mfu, abs=rounding), row.name


def test_a_sources_own_architecture_reproduces_its_parameter_count() -> None:
    """llm-foundry's MPT rows carry their architecture; its parameters are the table's NumParams
    (learned positions sized to each row's sequence), so the shapes were read right."""
    from zeroplan.core.params import total_parameters

    from zeroplan.specs.model import PositionKind

    own = [row for row in ROWS if row.architecture is not None and row.published_parameters is not None]
    assert len(own) >= 100  # the other sources name a rounded size only (fms-fsdp, Megatron-LM, torchtune, BLOOM)
    for row in own:
        assert total_parameters(row.model_spec) == row.published_parameters, row.name
    for row in ROWS:
        if row.architecture is not None and row.architecture.position is PositionKind.learned:
            assert row.architecture.max_positions == row.seq_len, row.name


def test_flat_hfu_prediction_is_executed_flops_at_that_hfu_when_communication_hides() -> None:
    hfu = FLAT_HFU
    for row, comparison in zip(ROWS, _table()):
        if (row.tp * row.pp > 1 or row.strategy is StrategyKind.zero1 or row.strategy.offloads_optimizer
                or row.overlap_grad_reduce is False or (row.strategy.zero_stage == 3 and not row.strategy.is_fsdp)):
            # Model-parallel collectives block compute, ZeRO-1's step-phase collectives are
            # exposed by design (Megatron's and BLOOM's rows), and so are offload's host copies
            # and CPU step, an all-reduce the run's flags put after the backward (Megatron-LM
            # 2021's local DDP), and DeepSpeed stage 3's gradient-norm and overflow all-reduces in
            # its step (zeroplan.core.communication.deepspeed_stage3_step_scalars: DeepSpeed on
            # Azure's ZeRO-3 rows); every other row hides.
            continue
        request = row.request()
        # torchao's float8 all-gather adds one all-reduce of the weights' amaxes after the
        # optimizer step (zeroplan.core.float8_time.float8_scale_all_reduce): exposed by design.
        assert (comparison.exposed_communication_s > 0) == request.training.float8_all_gather, row.name
        # The flat HFU covers every kernel, as on the GPUs it is the default of
        # (zeroplan.validate.step_time.as_flat_default); a compiled step is the eager one less
        # the bytes inductor's fusion saves, at the GPU's copy bandwidth (zeroplan.core.compiled_time).
        saved_s = sum(compile_saved_seconds(request))
        assert (saved_s > 0) == request.training.compile, row.name
        eager_step_s = step_flops(request).executed_flops / (hfu * get_gpu(row.gpu).peak_bf16_flops_per_s)
        # float8's products at the same HFU of the fp8 peak (zeroplan.core.float8_time).
        float8_saved_s = sum(float8_gemm_saved_seconds(request, hfu * get_gpu(row.gpu).peak_bf16_flops_per_s))
        assert (float8_saved_s > 0) == (request.training.float8 is not None), row.name
        expected = row.tokens_per_step_per_gpu / (eager_step_s - saved_s - float8_saved_s + comparison.exposed_communication_s)
        assert comparison.predicted_tokens_per_s_per_gpu == pytest.approx(expected, rel=1e-9), row.name


def test_at_the_implied_hfu_the_planner_gives_back_the_published_throughput() -> None:
    # Nothing is exposed, so at the HFU the MFU implies (zeroplan.core.timing.hfu_from_mfu: the
    # executed FLOPs take the published step less the memory-bound time) the predicted step is
    # the published one, to the rounding of the published MFU (3 digits): recomputation is
    # charged once, not on top of an MFU that already excludes it.
    for row, comparison in zip(ROWS, _table()):
        if comparison.published_mfu is None:
            continue
        request = row.request()
        memory_s = sum(memory_bound_time_s(request)) + gpu_optimizer_time_s(request)
        flops = step_flops(request)
        step_s = flops.model_flops / (comparison.published_mfu * get_gpu(row.gpu).peak_bf16_flops_per_s)
        assert comparison.published_hfu == pytest.approx(
            flops.executed_flops / (get_gpu(row.gpu).peak_bf16_flops_per_s * (step_s - memory_s)))
        assert comparison.published_hfu > comparison.published_mfu * comparison.flops_per_token_ratio
        rounding = 0.5 / comparison.published_tokens_per_s_per_gpu + 5e-4 / comparison.published_mfu
        assert comparison.with_published_mfu_error == pytest.approx(0.0, abs=rounding + 1e-4), comparison.name


def test_predicted_mfu_is_the_flat_hfu_over_the_flop_ratio() -> None:
    hfu = FLAT_HFU
    for row, comparison in zip(ROWS, _table()):
        if comparison.exposed_communication_s > 0 or row.tp * row.pp > 1:  # the step is longer than compute
            continue
        training = row.request().training
        if training.compile or training.float8 is not None:
            # shorter: compile's saved memory traffic, float8's products at the fp8 peak
            assert comparison.predicted_mfu > hfu / comparison.flops_per_token_ratio, row.name
            continue
        assert comparison.predicted_mfu == pytest.approx(hfu / comparison.flops_per_token_ratio, rel=1e-9)


def test_errors_are_predicted_over_published() -> None:
    for c in _table():
        assert c.tokens_per_s_error == pytest.approx(c.predicted_tokens_per_s_per_gpu / c.published_tokens_per_s_per_gpu - 1)
        assert c.published_step_s * c.published_tokens_per_s_per_gpu == pytest.approx(
            c.predicted_step_s * c.predicted_tokens_per_s_per_gpu)


def test_malformed_file_is_one_line_naming_the_field(tmp_path: Path) -> None:
    data = json.loads(PUBLISHED_THROUGHPUT_FILE.read_text())
    del data["rows"][0]["source_url"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ZeroplanError, match="source_url"):
        load_published_throughput(path)


def _benchmark():
    return load_script(ROOT / "benchmarks" / "step_time_accuracy.py")


def test_benchmark_prints_a_line_per_row() -> None:
    module = _benchmark()
    text = module.report()
    for row in ROWS:
        assert f"| {row.name} |" in text
    assert "median" in text and "sources:" in text


def test_docs_table_is_what_the_benchmark_prints() -> None:
    module = _benchmark()
    docs = (ROOT / "docs" / "validation.md").read_text()
    section = docs[docs.index("## Step time"):]
    for comparison in _table():
        assert module.format_row(comparison) in section, comparison.name


def test_docs_summary_by_gpu_is_what_the_benchmark_prints() -> None:
    # Each "| gpu | checkpointing | ..." line of the benchmark's summary, the verdict counts
    # included, stands in the docs as printed.
    docs = (ROOT / "docs" / "validation.md").read_text()
    section = docs[docs.index("## Step time"):]
    summary = _benchmark().report().split("By GPU and checkpointing", 1)[1].split("sources:", 1)[0]
    lines = [line for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| GPU")]
    assert len(lines) >= 5
    for line in lines:
        assert line in section, line


def test_every_published_run_fits() -> None:
    # Each row is a run that ran: the verdict a GPU would give (the caching-allocator model's,
    # the default) must say it fits. llm-foundry's rows fit once their loss is the fused
    # cross-entropy their model builds by default (docs/validation.md, "Step time").
    # DeepSpeed's ZeRO-Offload tutorial run fits with its activation checkpoints on the host, as
    # its config keeps them (activation_checkpointing.cpu_checkpointing; 0.65 GiB over on the GPU).
    # TinyLlama's run fits as its fork of lit-gpt ran (litgpt_fork "tinyllama", zeroplan.core.tinyllama:
    # 34.4 GiB; litgpt 0.4.13's own model code planned 40.9). DeepSpeed on Azure's 1T ZeRO-3 run (81.3 GiB, with
    # DeepSpeed's module-by-module gathers, zeroplan.core.deepspeed_coordinator): its 53.7 GB
    # of checkpoints stay on the GPU as the recipe sets them (no cpu_checkpointing), which the
    # blog's text says were kept in host memory.
    unmodelled = {"deepspeed azure gpt-1t a100 x1024 zero3-offload b8 s1024"}
    assert {c.name for c in _table() if not c.fits} == unmodelled


def test_readme_medians_are_what_the_benchmark_prints() -> None:
    # The README quotes the summary line's two medians (|error| at the flat HFU 0.4, and under
    # the roofline), as printed to one decimal; docs/validation.md quotes the whole line.
    summary = next(line for line in _benchmark().report().splitlines() if " rows; |error| " in line)
    default, roofline = (re.search(pattern, summary)[1] for pattern in (
        r"flat HFU 0.4: median (\d+\.\d)%", r"roofline compute model: median (\d+\.\d)%"))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"median error {default} % at the flat HFU 0.4, the roofline {roofline} % (too fast)" in readme
    docs = (ROOT / "docs" / "validation.md").read_text()
    assert summary.replace("%", " %") in docs
