"""The fitted default efficiency (zeroplan.core.default_efficiency): the shipped table is the fit
of the current published rows, a request without --hfu is timed at its mechanism's HFU, and a
GPU without rows falls back to a fitted generation of the same compute die, else the flat HFU."""

from __future__ import annotations

import pytest

from zeroplan.core.default_efficiency import (
    FLAT_HFU, SDPA_MEMORY_EFFICIENT, GenerationCompute, attention_class, default_hfu, default_table, effective_hfu,
    fit_mechanisms, generation_of, resolve,
)
from zeroplan.core.plan import plan
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, PerformanceAssumptions, PlanRequest, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus,
)
from zeroplan.specs.training import AttentionKernel
from zeroplan.validate.rows import FLAT_RESERVE

DIES = (GenerationCompute(generation="a100", architecture="ampere", peak_bf16_flops_per_s=312e12),
        GenerationCompute(generation="h100", architecture="hopper", peak_bf16_flops_per_s=989e12))


def _samples() -> list[tuple[str, str, bool, float, str, str | None]]:
    return [("h100", "flash-attn-2", False, 0.40, "s1", None), ("h100", "flash-attn-2", False, 0.50, "s2", None),
            ("h100", "flash-attn-triton", False, 0.30, "s3", None), ("a100", "eager", False, 0.60, "s4", None)]


def test_a_mechanism_of_one_source_is_not_fitted_and_the_next_coarser_applies() -> None:
    mechanisms = fit_mechanisms(_samples())
    keys = {(m.generation, m.attention, m.compiled): m for m in mechanisms}
    assert keys[("h100", "flash-attn-2", False)].hfu == pytest.approx(0.45)
    assert ("h100", "flash-attn-triton", False) not in keys  # one source: that source's constant
    assert ("a100", None, None) not in keys
    triton = resolve(mechanisms, DIES, get_gpu("h100-80gb"), "flash-attn-triton", False)
    assert (triton.level, triton.hfu, triton.rows) == ("generation", pytest.approx(0.40), 3)


def test_float8_rows_are_their_own_mechanism_and_a_float8_request_without_one_takes_bf16s() -> None:
    # Two float8 te-delayed sources at 0.30 and 0.34: fitted apart, never in bf16's mechanisms.
    float8 = [("h100", "flash-attn-2", False, 0.30, "f1", "te-delayed"), ("h100", "flash-attn-2", False, 0.34, "f2", "te-delayed")]
    mechanisms = fit_mechanisms(_samples() + float8)
    assert {(m.generation, m.attention, m.compiled, m.float8): m.hfu for m in mechanisms} == {
        **{(m.generation, m.attention, m.compiled, m.float8): m.hfu for m in fit_mechanisms(_samples())},
        ("h100", "flash-attn-2", False, "te-delayed"): pytest.approx(0.32),
        ("h100", "flash-attn-2", None, "te-delayed"): pytest.approx(0.32), ("h100", None, None, "te-delayed"): pytest.approx(0.32)}
    h100 = get_gpu("h100-80gb")
    own = resolve(mechanisms, DIES, h100, "flash-attn-2", False, "te-delayed")
    assert (own.hfu, own.level, own.float8_fallback, own.mechanism) == (
        pytest.approx(0.32), "kernel class", None, "h100, flash-attn-2, not compiled, float8 te-delayed")
    assert resolve(mechanisms, DIES, h100, "flash-attn-2", False).hfu == pytest.approx(0.45)  # bf16 unmoved
    # A recipe with no float8 rows of two sources (one source here, or its only source held out)
    # falls back to bf16's chain, and says so.
    for fit in (fit_mechanisms(_samples() + float8[:1]), mechanisms):
        fallback = resolve(fit, DIES, h100, "flash-attn-2", False, "tensorwise" if fit is mechanisms else "te-delayed")
        assert (fallback.hfu, fallback.level, fallback.mechanism) == (pytest.approx(0.45), "kernel class",
                                                                      "h100, flash-attn-2, not compiled")
        assert fallback.float8_fallback in ("tensorwise", "te-delayed") and "bf16's fit" in fallback.describe()


def test_a_float8_request_without_an_hfu_is_timed_at_the_shipped_float8_or_bf16_fit() -> None:
    from zeroplan.specs.training import Float8Recipe

    request = _request("h100-80gb")
    float8 = request.model_copy(update={"training": request.training.model_copy(update={"float8": Float8Recipe.te_delayed})})
    shipped = default_hfu(float8)
    # One published source runs each float8 recipe (llm-foundry's FP8 table, torchtitan's H200
    # table): no float8 mechanism is fitted, and a float8 request takes bf16's, saying so.
    assert not [m for mechanisms in default_table().mechanisms.values() for m in mechanisms if m.float8 is not None]
    assert shipped.float8_fallback == "te-delayed" and shipped.hfu == default_hfu(request).hfu
    assert shipped.describe().endswith("no float8 te-delayed rows of 2 sources or more: bf16's fit)")


def test_a_gpu_without_rows_takes_its_compute_dies_fit_else_the_flat_hfu() -> None:
    mechanisms = fit_mechanisms(_samples())
    h200 = resolve(mechanisms, DIES, get_gpu("h200-141gb"), "flash-attn-2", False)
    assert (h200.hfu, h200.borrowed_from) == (pytest.approx(0.45), "h100")
    assert "h100's fit (same compute die)" in h200.describe()
    for gpu in ("b200", "a100-80gb"):  # no rows of its die; a100 has rows of one source only here
        flat = resolve(mechanisms, DIES, get_gpu(gpu), "flash-attn-2", False)
        assert (flat.level, flat.hfu) == ("flat", FLAT_HFU)


def test_a_board_is_its_own_generation_and_borrows_its_dies_fit_only_by_saying_so() -> None:
    # The memory size alone is dropped: the SXM parts share a fit, other boards do not.
    assert generation_of("a100-40gb") == generation_of("a100-80gb") == "a100"
    assert generation_of("a100-pcie-40gb") == generation_of("a100-pcie-80gb") == "a100-pcie"
    assert generation_of("h100-pcie") != generation_of("h100-80gb") != generation_of("h100-nvl")
    assert generation_of("rtx-3090") != generation_of("rtx-4090") != generation_of("rtx-a6000")
    mechanisms = fit_mechanisms(_samples())
    # A800 / H800: the die's peak, so its fit, borrowed and named; PCIe H100 and NVL: another peak.
    h800 = resolve(mechanisms, DIES, get_gpu("h800-80gb"), "flash-attn-2", False)
    assert (h800.borrowed_from, h800.hfu) == ("h100", pytest.approx(0.45))
    assert "h800, flash-attn-2, not compiled, h100's fit (same compute die)" in h800.describe()
    for gpu in ("h100-pcie", "h100-nvl", "rtx-3090", "l4", "t4"):
        flat = resolve(mechanisms, DIES, get_gpu(gpu), "flash-attn-2", False)
        assert (flat.level, flat.hfu, flat.borrowed_from) == ("flat", FLAT_HFU, None)
        assert flat.describe().startswith(f"flat HFU 0.4 ({gpu}, ") and "no published rows" in flat.describe()
    # Shipped table: the A100 PCIe board takes the a100 fit as borrowed, never as its own rows.
    pcie = default_hfu(_request("a100-pcie-40gb"))
    assert pcie.borrowed_from == "a100" and "a100's fit (same compute die)" in pcie.describe()
    assert pcie.hfu == default_hfu(_request("a100-40gb")).hfu


def _request(gpu: str, hfu: float | None = None, attention_kernel: AttentionKernel = AttentionKernel.flash) -> PlanRequest:
    return PlanRequest(model=get_model("llama-3.1-8b"), training=TrainingSpec(attention_kernel=attention_kernel),
                       batch=BatchSpec(micro_batch_size=1, seq_len=4096), cluster=cluster_from_gpus(get_gpu(gpu), 8),
                       strategy=StrategySpec(kind=StrategyKind.fsdp_full_shard),
                       performance=PerformanceAssumptions(hardware_flops_utilization=hfu), assumptions=FLAT_RESERVE)


def test_a_request_without_an_hfu_is_timed_at_its_mechanisms_fitted_hfu() -> None:
    request = _request("a100-80gb")
    fitted = default_hfu(request)
    shipped = {(m.generation, m.attention, m.compiled): m.hfu for m in default_table().mechanisms[request.performance.attention_rate]}
    assert fitted.level == "kernel class" and fitted.hfu == shipped[("a100", "flash-attn-2", False)]
    assert effective_hfu(request) == fitted.hfu
    assert plan(request).time.compute_s == pytest.approx(plan(_request("a100-80gb", fitted.hfu)).time.compute_s, rel=1e-12)
    assert effective_hfu(_request("a100-80gb", 0.3)) == 0.3  # a given HFU is used as given
    assert default_hfu(_request("b200")).level == "flat"


def test_a_flash_request_on_a_v100_is_classed_sdpa_memory_efficient_not_flash_attn_2() -> None:
    # FlashAttention-2 needs sm80+; SDPA runs its memory-efficient kernel on a V100. No row ran
    # that kernel, so the request takes its generation's fit, fitted on V100 rows of two sources.
    assert attention_class(TrainingSpec(), get_gpu("v100-32gb")) == SDPA_MEMORY_EFFICIENT
    assert attention_class(TrainingSpec(), get_gpu("a100-80gb")) == "flash-attn-2"
    assert attention_class(TrainingSpec(attention_kernel=AttentionKernel.eager), get_gpu("v100-32gb")) == "eager"
    fitted = default_hfu(_request("v100-32gb"))
    assert (fitted.level, fitted.mechanism) == ("generation", "v100")
    assert "flash-attn-2" not in fitted.describe()
    eager = default_hfu(_request("v100-32gb", attention_kernel=AttentionKernel.eager))
    assert (eager.level, eager.mechanism) == ("kernel class", "v100, eager, not compiled")


def test_the_shipped_table_says_where_it_comes_from() -> None:
    table = default_table()
    assert table.regenerate == "python benchmarks/step_time_accuracy.py --write-default-efficiency"
    assert table.published_rows == "zeroplan/validate/data/published_throughput.json"
    assert set(table.mechanisms) == {"matmul", "published", "kernel"}
    assert all(m.sources >= 2 for mechanisms in table.mechanisms.values() for m in mechanisms)


@pytest.mark.slow
def test_the_shipped_table_is_the_fit_of_the_current_rows() -> None:
    # Solves every row under each attention-rate mode (seconds): rerun the command above after
    # a change to the rows or to the planner's step time.
    from zeroplan.validate.step_calibration import default_efficiency_table

    assert default_table() == default_efficiency_table()


def test_compare_labels_the_time_basis(zeroplan_cli) -> None:
    lines = {}
    for gpu, extra in (("a100-80gb", ()), ("b200", ()), ("a100-80gb", ("--hfu", "0.4"))):
        code, out, _ = zeroplan_cli("compare", "gpt2", "--gpus", "8", "--gpu", gpu, "--strategies", "ddp", "--detail",
                                    *extra)
        assert code == 0
        lines[(gpu, extra)] = out.splitlines()[-1]
    assert lines[("a100-80gb", ())].startswith("step time: fitted default HFU ")
    assert "(a100, flash-attn-2, not compiled: median of 18 published rows, 6 sources)" in lines[("a100-80gb", ())]
    assert "leave-one-source-out" not in lines[("b200", ())] and "flat HFU 0.4 (b200" in lines[("b200", ())]
    assert "HFU 0.4 as given (--hfu)" in lines[("a100-80gb", ("--hfu", "0.4"))]


def test_the_readme_quotes_the_fitted_default_and_calibrated_bands() -> None:
    from pathlib import Path

    from zeroplan.calibrate.basis import DEFAULT_BAND

    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert f"median error {DEFAULT_BAND[0]:.1%} (max {DEFAULT_BAND[1]:.1%})".replace("%", " %") in readme
    from zeroplan.calibrate.basis import CALIBRATED_BAND

    assert f"median error {CALIBRATED_BAND[0]:.1%} (max {CALIBRATED_BAND[1]:.1%})".replace("%", " %") in readme


def test_json_output_carries_the_time_basis(zeroplan_cli) -> None:
    import json

    code, out, _ = zeroplan_cli("compare", "gpt2", "--gpus", "8", "--gpu", "b200", "--strategies", "ddp", "--format", "json")
    assert code == 0 and json.loads(out)["step_time_basis"].startswith("step time: flat HFU 0.4 (b200")
    code, out, _ = zeroplan_cli("plan", "gpt2", "--gpus", "1", "--gpu", "a100-80gb", "--global-batch", "1",
                                "--strategies", "ddp", "--no-model-parallel", "--top", "1", "--format", "json")
    assert code == 0 and json.loads(out)["step_time_basis"].startswith("step time: fitted default HFU")


def test_the_shipped_table_names_its_compute_basis() -> None:
    # Its HFUs are the matrix products' and attention's, the memory-bound kernels timed apart
    # (zeroplan.core.timing.COMPUTE_BASIS); a table without the field does not load.
    import json

    import pytest
    from pydantic import ValidationError

    from zeroplan.core.default_efficiency import DEFAULT_EFFICIENCY_FILE, DefaultEfficiencyTable
    from zeroplan.core.timing import COMPUTE_BASIS

    assert default_table().compute_basis == COMPUTE_BASIS
    data = json.loads(DEFAULT_EFFICIENCY_FILE.read_text())
    del data["compute_basis"]
    with pytest.raises(ValidationError, match="compute_basis"):
        DefaultEfficiencyTable.model_validate(data)
