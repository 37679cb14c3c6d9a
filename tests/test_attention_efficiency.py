"""--attention-rate kernel's attention efficiency (zeroplan.core.attention_efficiency): the fit
recovers a known efficiency, refuses what one sequence length cannot tell, and the planner and an
efficiency file carry it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core.attention_efficiency import attention_efficiency, source_attention_efficiency
from zeroplan.core.timing import attention_flops_per_s
from zeroplan.validate.step_time import load_published_throughput

ROOT = Path(__file__).resolve().parents[1]

ROW = next(row for row in load_published_throughput().rows if row.name == "mpt-7b a100 x8 s8192 b8x2 AC")


def _with(request, **performance):  # type: ignore[no-untyped-def]
    return request.model_copy(update={"performance": request.performance.model_copy(update=performance)})


def test_the_fit_recovers_the_efficiency_of_exact_rows() -> None:
    hfu, e = 0.7, 1.25
    columns = [(matmul, attention, matmul / hfu + attention / e)
               for matmul, attention in ((1.0, 0.1), (1.0, 0.4), (0.5, 0.9), (2.0, 0.05))]
    assert source_attention_efficiency(columns) == pytest.approx(e)


def test_rows_at_one_attention_share_tell_nothing() -> None:
    # Every row the same mix of matrix products and attention: HFU and e trade off exactly.
    columns = [(k * 1.0, k * 0.2, k * (1.0 / 0.7 + 0.2)) for k in (1.0, 2.0, 3.0)]
    assert source_attention_efficiency(columns) is None


def test_kernel_rate_scales_by_the_given_efficiency_and_no_other_mode_does() -> None:
    request = ROW.request(0.6)
    matmul_rate = 1e14
    kernel_1 = attention_flops_per_s(_with(request, attention_rate="kernel", attention_efficiency=1.0), matmul_rate)
    kernel_2 = attention_flops_per_s(_with(request, attention_rate="kernel", attention_efficiency=1.3), matmul_rate)
    assert kernel_2 == pytest.approx(1.3 * kernel_1)
    published = [attention_flops_per_s(_with(request, attention_rate="published", attention_efficiency=e), matmul_rate)
                 for e in (1.0, 1.3)]
    assert published[0] == published[1]


def test_without_a_given_efficiency_the_shipped_default_of_the_kernel_applies() -> None:
    from zeroplan.core.default_efficiency import default_table

    request = _with(ROW.request(0.6), attention_rate="kernel")
    assert attention_efficiency(request, "flash-attn-triton") == default_table().attention_efficiency.get("flash-attn-triton", 1.0)
    assert attention_efficiency(request, "no-such-kernel") == 1.0


def test_an_efficiency_file_solved_under_kernel_records_the_efficiency_it_was_solved_at() -> None:
    from zeroplan.calibrate.step import solved_attention_efficiency

    assert solved_attention_efficiency(_with(ROW.request(0.6), attention_rate="kernel", attention_efficiency=1.1)) == 1.1
    assert solved_attention_efficiency(_with(ROW.request(0.6), attention_rate="published")) is None


def test_an_efficiency_file_applies_only_under_the_attention_rate_it_was_solved_under(zeroplan_cli) -> None:
    # The docs' example file was solved under the default rate ('kernel'): applied under another
    # its HFU would time the matrix products against another attention time, so it is refused.
    from zeroplan.specs.request import DEFAULT_ATTENTION_RATE

    example = "docs/examples/h100-llm-foundry-efficiency.json"
    assert json.loads((ROOT / example).read_text())["attention_rate"] == DEFAULT_ATTENTION_RATE == "kernel"
    code, _, err = zeroplan_cli("compare", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--strategies", "ddp",
                                "--efficiency", str(ROOT / example), "--attention-rate", "published")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--efficiency" in err and "solved under --attention-rate kernel, not published" in err
