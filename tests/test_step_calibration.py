"""Calibrated step time against the published rows (zeroplan/validate/step_calibration.py): one
row per source calibrates, the others score; the leave-one-source-out fit never sees the source
it predicts; and the figures the docs and the CLI's band quote are what the benchmark prints."""

from __future__ import annotations

import functools
import re
import statistics
from pathlib import Path

import pytest

from zeroplan.calibrate.basis import CALIBRATED_BAND, CALIBRATED_BANDS, DEFAULT_BAND, DEFAULT_BANDS, FLAT_BAND
from zeroplan.core.default_efficiency import FLAT_HFU, MIN_MECHANISM_SOURCES
from zeroplan.specs import PerformanceAssumptions
from zeroplan.validate.step_calibration import (
    DEFAULT_ATTENTION_RATE, MIN_SOURCE_ROWS, attention_efficiency_fit, calibration_row, attention_class_of, calibration_study,
    float8_class_of, generation_of, held_out_fit, held_out_tokens_per_s, implied_hfu, kernel_class_of, mode_implied_hfus,
    source_attention_efficiencies,
    source_of, stack_of,
)
from zeroplan.validate.step_time import load_published_throughput

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
TABLE = load_published_throughput()


def _study():
    """Every source's calibration and every row's predictions: computed at the first test that
    reads them, not at import (collecting the suite stays quick), and once (calibration_study
    keeps them per table)."""
    return calibration_study(TABLE)


def _benchmark():
    return load_script(ROOT / "benchmarks" / "step_time_accuracy.py")


@functools.lru_cache(maxsize=1)
def _printed() -> tuple[str, ...]:
    """The benchmark's calibrated report, once for the tests that read it."""
    return tuple(_benchmark().calibrated_report(TABLE))


def test_each_source_of_three_rows_is_calibrated_on_its_row_of_fewest_gpus_and_scored_on_the_others() -> None:
    by_source: dict[str, list] = {}
    for row in TABLE.rows:
        by_source.setdefault(source_of(row), []).append(row)
    sources, errors = _study()
    assert {s.source for s in sources} == {source for source, rows in by_source.items() if len(rows) >= MIN_SOURCE_ROWS}
    for calibration in sources:
        efficiencies, implied = _held_out(calibration.source)
        # Rows calibrate step refuses (a published step shorter than the planner's at HFU 1)
        # are neither the anchor nor scored.
        rows = [row for row in by_source[calibration.source] if row.name in implied]
        fewest = min(row.num_gpus for row in rows)
        anchor = next(row for row in rows if row.name == calibration.calibration_row)
        assert anchor.num_gpus == fewest and anchor == calibration_row(rows)
        scored = [e for e in errors if e.source == calibration.source and e.calibrated_error is not None]
        assert calibration.calibration_row not in {e.name for e in scored}
        assert len(scored) == len(rows) - 1
        anchor = next(row for row in rows if row.name == calibration.calibration_row)
        # Calibrated on its own row, the planner gives that row's published throughput back.
        assert held_out_tokens_per_s(anchor, calibration.hfu, DEFAULT_ATTENTION_RATE, efficiencies) == pytest.approx(
            anchor.published_tokens_per_s_per_gpu, rel=1e-6)


def test_the_anchors_hfu_is_carried_to_another_kernel_class_by_the_held_out_fits_ratio() -> None:
    # zeroplan.calibrate.step.carry_hfu: a row of the anchor's kernel class is predicted at the
    # anchor's HFU; a row of another class at that HFU times the ratio of the two classes' HFUs,
    # both fitted without the source (the kernel-class fit the uncalibrated figures use).
    sources, errors = _study()
    by_name = {e.name: e for e in errors}
    carried = 0
    for calibration in sources:
        anchor = by_name[calibration.calibration_row]
        for e in errors:
            if e.source != calibration.source or e.calibrated_hfu is None:
                continue
            if e.kernel_class == anchor.kernel_class:
                assert e.calibrated_hfu == calibration.hfu, e.name
            else:
                carried += 1
                assert e.calibrated_hfu == pytest.approx(min(1.0, calibration.hfu * e.kernel_hfu / anchor.kernel_hfu),
                                                         rel=1e-12), e.name
    assert carried > 0  # the large-scale table's Triton rows, torchtune's compiled LoRA rows


@functools.lru_cache(maxsize=64)
def _held_out(source: str) -> tuple[tuple[tuple[str, float], ...], dict[str, float]]:
    """The attention efficiencies ``source``'s rows are scored at under the planner's default
    attention rate (under 'kernel', fitted without its rows; none under the others) and the HFU
    calibrate step solves on each row it does not refuse at them (shared by the tests below)."""
    efficiencies = attention_efficiency_fit(TABLE, source) if DEFAULT_ATTENTION_RATE == "kernel" else ()
    found = held_out_fit(DEFAULT_ATTENTION_RATE, TABLE, source)
    assert found == (efficiencies, mode_implied_hfus(DEFAULT_ATTENTION_RATE, TABLE,
                                                     efficiencies if DEFAULT_ATTENTION_RATE == "kernel" else None))
    return found


def test_the_held_out_attention_efficiency_never_sees_the_source_it_scores() -> None:
    # Fitted without a source, the efficiencies are those of the rows with that source taken out
    # (the sources the fit can use: the others' rows never enter it).
    for source, _, _ in source_attention_efficiencies(TABLE):
        others = TABLE.model_copy(update={"rows": tuple(row for row in TABLE.rows if source_of(row) != source)})
        assert attention_efficiency_fit(TABLE, source) == attention_efficiency_fit(others), source


def test_the_fitted_default_never_sees_the_source_it_predicts() -> None:
    for row, error in zip(TABLE.rows, _study()[1]):
        implied = _held_out(source_of(row))[1]
        mechanism = [other for other in TABLE.rows if source_of(other) != source_of(row)
                     and generation_of(other.gpu) == generation_of(row.gpu) and stack_of(other) == stack_of(row)
                     and other.name in implied]
        # float8 rows are peers of float8 rows of their recipe only; a float8 row without such
        # peers takes its bf16 peers'; a bf16 row never has a float8 peer.
        peers = ([implied[o.name] for o in mechanism if float8_class_of(o) == float8_class_of(row)]
                 or [implied[o.name] for o in mechanism if float8_class_of(o) is None])
        # A source with no other of its GPU generation and stack (fms-fsdp's H100 column) takes the default.
        expected = statistics.median(peers) if peers else FLAT_HFU
        assert error.loso_hfu == pytest.approx(expected), row.name


def test_the_kernel_class_fit_never_sees_the_source_it_predicts() -> None:
    # The fitted default: one HFU per GPU generation x kernel class (zeroplan.core.stack_time.kernel_class),
    # the median over the other sources' rows of that mechanism where they are of two sources or
    # more; coarser where they are not; a generation with no fitted rows takes those of another
    # generation on the same compute die (the H200 rows, the H100's).
    for row, error in zip(TABLE.rows, _study()[1]):
        implied = _held_out(source_of(row))[1]

        def fitted(rows: list) -> list[float]:
            return [implied[o.name] for o in rows] if len({source_of(o) for o in rows}) >= MIN_MECHANISM_SOURCES else []

        def generation_rows(generation: str) -> list:
            return [other for other in TABLE.rows if other.name in implied
                    and source_of(other) != source_of(row) and generation_of(other.gpu) == generation]

        def bf16_fitted(rows: list) -> list[float]:  # a generation is fitted on its bf16 rows
            return fitted([o for o in rows if float8_class_of(o) is None])

        others = generation_rows(generation_of(row.gpu))
        if not bf16_fitted(others):
            spec = row.gpu_spec
            dies = sorted({generation_of(o.gpu) for o in TABLE.rows if o.gpu_spec.architecture == spec.architecture
                           and o.gpu_spec.peak_bf16_flops_per_s == spec.peak_bf16_flops_per_s} - {generation_of(row.gpu)})
            others = next((generation_rows(g) for g in dies if bf16_fitted(generation_rows(g))), others)
        # A float8 row's own mechanisms (its recipe's rows only), then bf16's: a float8 row never
        # enters a bf16 mechanism.
        own = [o for o in others if float8_class_of(o) == float8_class_of(row)]
        bf16 = [o for o in others if float8_class_of(o) is None]
        chain = []  # a generation without fitted bf16 rows of its own or its die's: the flat HFU
        for pool in () if not bf16_fitted(others) else ((own, bf16) if float8_class_of(row) is not None else (bf16,)):
            chain += [fitted([o for o in pool if kernel_class_of(o).split(", float8")[0] == kernel_class_of(row).split(", float8")[0]]),
                      fitted([o for o in pool if attention_class_of(o) == attention_class_of(row)]), fitted(pool)]
        expected = statistics.median(next((found for found in chain if found), [FLAT_HFU]))
        assert error.kernel_class == kernel_class_of(row)
        assert error.kernel_hfu == pytest.approx(expected), row.name


def test_docs_quote_the_calibrated_figures_as_printed() -> None:
    docs = (ROOT / "docs" / "validation.md").read_text()
    section = docs[docs.index("### Calibrated from one measured step"):]
    lines = [line for line in _printed() if line.startswith("| ") or " rows" in line and "|error|" in line]
    assert len(lines) >= 20
    for line in lines:
        assert line in section, line


def test_the_bands_the_cli_quotes_are_the_printed_summaries() -> None:
    calibrated = next(line for line in _printed() if line.startswith("calibrated on one row:"))
    default = next(line for line in _printed() if line.startswith("uncalibrated,"))
    median, maximum = (float(x) / 100 for x in re.search(r"median (\d+\.\d)%, max (\d+\.\d)%", calibrated).groups())
    assert CALIBRATED_BAND == CALIBRATED_BANDS[DEFAULT_ATTENTION_RATE] == (pytest.approx(median), pytest.approx(maximum))
    median, maximum = (float(x) / 100 for x in re.search(r"flat HFU 0.4 \|error\| median (\d+\.\d)%, max (\d+\.\d)%", default).groups())
    assert FLAT_BAND == (pytest.approx(median), pytest.approx(maximum))
    fitted = next(line for line in _printed() if line.startswith("uncalibrated,") and "fitted default" in line)
    median, maximum = (float(x) / 100 for x in re.search(r"median (\d+\.\d)%, max (\d+\.\d)%", fitted).groups())
    assert DEFAULT_BAND == DEFAULT_BANDS[PerformanceAssumptions().attention_rate] == (pytest.approx(median), pytest.approx(maximum))


def test_the_fitted_default_bands_of_each_attention_rate_are_the_printed_ones() -> None:
    checked = set()
    for line in _benchmark().attention_rate_report(TABLE):
        found = re.match(r"attention rate (\w+), uncalibrated, .* median (\d+\.\d)%, max (\d+\.\d)%", line)
        if found:
            mode, median, maximum = found.group(1), float(found.group(2)) / 100, float(found.group(3)) / 100
            assert DEFAULT_BANDS[mode] == (pytest.approx(median), pytest.approx(maximum)), mode
            checked.add(("default", mode))
        found = re.match(r"attention rate (\w+): calibrated on one row, \d+ rows: \|error\| median (\d+\.\d)%, max (\d+\.\d)%", line)
        if found:
            mode, median, maximum = found.group(1), float(found.group(2)) / 100, float(found.group(3)) / 100
            assert CALIBRATED_BANDS[mode] == (pytest.approx(median), pytest.approx(maximum)), mode
            checked.add(("calibrated", mode))
    assert len(checked) == 2 * len(DEFAULT_BANDS) == 2 * len(CALIBRATED_BANDS)


def test_compare_quotes_the_band(zeroplan_cli) -> None:
    code, out, _ = zeroplan_cli("compare", "llama-3.1-70b", "--gpus", "64", "--gpu", "h100-80gb")
    assert code == 0
    basis = " ".join(out[out.rindex("step time:"):].split())  # wrapped to the screen's width
    assert basis.startswith("step time: fitted default HFU")
    assert f"median {DEFAULT_BAND[0]:.1%}, max {DEFAULT_BAND[1]:.1%}" in basis


def test_the_docs_example_file_is_calibrate_steps_answer_for_its_published_row() -> None:
    from zeroplan.calibrate.step import load_efficiency
    from zeroplan.validate.step_calibration import published_row_efficiency

    example = load_efficiency(ROOT / "docs" / "examples" / "h100-llm-foundry-efficiency.json")
    row = next(row for row in TABLE.rows if row.name == "mpt-30b h100 x8 s8192 b1x21 AC")
    assert example == published_row_efficiency(row)
    assert example.hardware_flops_utilization == pytest.approx(
        implied_hfu(row))


def test_the_anchor_is_the_smallest_model_of_fewest_gpus_at_the_sources_median_sequence() -> None:
    """Ties among the fewest-GPU rows go to the cheapest run to measure: the smallest model (its
    learned position table, sized to the row's sequence, left out), then the sequence length
    nearest the source's median; the published throughput never enters."""
    rows = [row for row in TABLE.rows if row.source_section == "'H100 80GB BF16' table"]
    assert calibration_row(rows).name == "mpt-760m h100 x8 s2048 b24x2 no AC"
    faster = [row.model_copy(update={"published_tokens_per_s_per_gpu": row.published_tokens_per_s_per_gpu * (1 + i % 3)})
              for i, row in enumerate(rows)]
    assert calibration_row(faster).name == calibration_row(rows).name
    # Without the 760M rows the next smallest model's row at the median length.
    assert calibration_row([row for row in rows if row.model != "mpt-760m"]).name == "mpt-1b h100 x8 s2048 b14x1 no AC"


def test_the_anchor_floor_holds_the_rules_anchor_among_every_anchor_tried() -> None:
    from zeroplan.validate.step_calibration import TARGET_MAX, TARGET_MEDIAN, anchor_floor

    # torchtitan's Llama 2 table: four rows, so twelve predictions.
    sources, errors = _study()
    calibration = next(s for s in sources if "Llama 2" in s.label)
    floor = anchor_floor(TABLE, calibration.source)
    scored = [abs(e.calibrated_error) for e in errors if e.source == calibration.source and e.calibrated_error is not None]
    assert (floor.rule_median, floor.rule_max) == pytest.approx((statistics.median(scored), max(scored)))
    assert floor.anchors == len(scored) + 1
    assert floor.best_median <= floor.rule_median and floor.best_max <= floor.rule_max
    assert floor.best_median <= floor.best_max_median and floor.best_max <= floor.best_median_max
    meets = floor.rule_median <= TARGET_MEDIAN and floor.rule_max <= TARGET_MAX
    assert floor.meeting_target >= int(meets)
