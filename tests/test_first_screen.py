"""The first screen of fit, compare and plan: verdict first, one table within the width, short
footnotes; --detail is today's full table, --explain one strategy's terms; --help in groups."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zeroplan.cli.parser import OPTION_GROUPS
from zeroplan.core.plan import fit
from zeroplan.report.summary import DEFAULT_WIDTH, FOOTNOTE_LINES, render_fit_summary
from zeroplan.report.table import render_table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from refresh_docs import console_blocks, run_console  # noqa: E402

FIRST_SCREENS = ("fit", "compare", "plan")


def _readme_first_screens():
    """README's fit, compare and plan commands that print the first screen (not --detail, JSON or CSV)."""
    return [block for block in console_blocks(ROOT / "README.md")
            if block.argv[1] in FIRST_SCREENS and "--detail" not in block.argv and "--format" not in block.argv]


def test_the_readme_shows_each_first_screen_and_one_detail_table() -> None:
    shown = {block.argv[1] for block in _readme_first_screens()}
    assert shown == set(FIRST_SCREENS)
    assert any("--detail" in block.argv for block in console_blocks(ROOT / "README.md"))


@pytest.mark.parametrize("block", _readme_first_screens(), ids=lambda b: b.name)
def test_readme_first_screens_are_at_most_100_columns(block) -> None:
    output = run_console(block.argv)
    assert max(len(line) for line in output.splitlines()) <= DEFAULT_WIDTH, output


def test_the_verdict_comes_first_and_says_what_would_make_it_fit(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "llama-2-70b", "--gpus", "8", "--gpu", "a100-80gb")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("Does not fit.")
    assert any(line.startswith("To fit: --activation-checkpointing full; then zero3-offload") for line in lines[:4])


def test_a_fitting_answer_names_the_recommendation_and_why(zeroplan_cli) -> None:
    code, out, _ = zeroplan_cli("fit", "llama-2-70b", "--gpus", "8", "--gpu", "a100-80gb", "--activation-checkpointing", "full")
    assert code == 0
    assert out.splitlines()[0] == "Fits. Recommended: zero3-offload (least offload; 2 of 10 fit)."


def test_one_strategy_planned_is_recommended_as_such(zeroplan_cli) -> None:
    """Megatron-DeepSpeed runs ZeRO-1 only: no 'the only one that fits of 1'."""
    code, out, _ = zeroplan_cli("fit", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--framework", "megatron-deepspeed")
    assert code == 0
    assert out.splitlines()[0] == "Fits. Recommended: zero1 (the one strategy planned)."


def test_the_detail_view_is_the_full_table(zeroplan_cli) -> None:
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser

    argv = ["fit", "gpt2", "--gpus", "2", "--strategies", "ddp,zero3"]
    from zeroplan.cli.fit import parse_strategies

    code, out, _ = zeroplan_cli(*argv, "--detail")
    assert code == 0
    args = build_parser().parse_args(argv)
    report = fit(request_from_args(args), parse_strategies(args.strategies))
    from zeroplan.cli.efficiency import time_basis

    # The full table, then the line naming the step time's basis (whole in the detail view).
    detail = build_parser().parse_args([*argv, "--detail"])
    assert out == render_table(report) + "\n" + time_basis(detail, request_from_args(detail)) + "\n"
    assert out.splitlines()[-1].startswith("step time: fitted default HFU")


def _report():
    from zeroplan.cli.fit import parse_strategies, request_from_args
    from zeroplan.cli.main import build_parser

    args = build_parser().parse_args(["fit", "llama-2-70b", "--gpus", "8", "--activation-checkpointing", "full"])
    return fit(request_from_args(args), parse_strategies(args.strategies))


@pytest.mark.parametrize("width", [60, 80, 100, 160])
def test_the_table_and_footnotes_follow_the_width(width: int) -> None:
    text = render_fit_summary(_report(), width=width)
    assert max(len(line) for line in text.splitlines()) <= width
    # Narrower terminals lose the columns of least use first; the verdict's columns stay.
    header = next(line for line in text.splitlines() if line.startswith("strategy"))
    assert "fits" in header and "peak GiB" in header
    assert ("tok/s/GPU" in header) == (width >= 80)


def test_each_footnote_is_at_most_two_lines() -> None:
    text = render_fit_summary(_report())
    notes = [line for line in text.splitlines() if line[:1].isdigit() or line.startswith("   ")]
    numbered = [i for i, line in enumerate(notes) if line[:1].isdigit()] + [len(notes)]
    assert numbered and all(b - a <= FOOTNOTE_LINES for a, b in zip(numbered, numbered[1:]))


def test_explain_gives_each_term_its_value_origin_and_section(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "llama-2-70b", "--gpus", "8", "--activation-checkpointing", "full",
                                  "--explain", "zero3")
    assert code == 0, err
    for term, section in (("params", "'2. Model states'"), ("activ", "'3. Activations'"),
                          ("buffers", "'4. Temporary and communication buffers'"), ("peak", "'5. Peak'"),
                          ("reserve", "'7. The caching allocator'"), ("sent", "'6. Communication'")):
        line = next(line for line in out.splitlines() if line.startswith(term + " "))
        assert "GiB" in line or "GB" in line
        assert section in " ".join(out.split())  # sections wrap across lines
    assert "2.00 B x Psi (68,976,648,192) / 8 ranks" in out  # ZeRO-3's bf16 parameters, sharded 8 ways
    assert max(len(line) for line in out.splitlines()) <= DEFAULT_WIDTH
    heading = (ROOT / "docs" / "memory-model.md").read_text()
    assert "## 7. The caching allocator" in heading and "## 4. Temporary and communication buffers" in heading


def test_explain_refuses_a_strategy_not_planned(zeroplan_cli) -> None:
    code, _, err = zeroplan_cli("fit", "gpt2", "--strategies", "ddp", "--explain", "zero3")
    assert code == 2 and err.count("\n") == 1 and "--explain" in err


@pytest.mark.parametrize("command", FIRST_SCREENS)
def test_help_groups_the_options_each_with_a_line(zeroplan_cli, command: str) -> None:
    code, out, _ = zeroplan_cli(command, "--help")
    assert code == 0
    for title, description in OPTION_GROUPS:
        if command == "plan" and title == "allocator":
            continue
        assert f" {title}: {description} " in " ".join(out.split())  # argparse wraps the line


@pytest.mark.parametrize("gpus", [8, 1048576])
def test_the_reason_names_the_rule_that_decides_against_each_strategy_that_fits(gpus: int) -> None:
    """On 2^20 GPUs zero2 wins over zero3 on bytes sent and over zero1 on peak: naming the
    runner-up's rule alone said "lowest peak" where zero3's peak is lower than zero2's."""
    from zeroplan.core.plan import recommendation_key
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.presets.models import get_model
    from zeroplan.report.summary import _RULE_WORDS, recommendation_reason
    from zeroplan.specs import PlanRequest, StrategySpec, cluster_from_gpus

    request = PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), gpus),
                          strategy=StrategySpec(kind="zero3"))
    report = fit(request, largest_micro_batch=False, timed=False)
    fitting = sorted((p for p in report.plans if p.fits and p.host_fits is not False), key=recommendation_key)
    assert len(fitting) > 2
    best = recommendation_key(fitting[0])
    deciding = {_RULE_WORDS[next(i for i, (a, b) in enumerate(zip(best, recommendation_key(p))) if a != b)]
                for p in fitting[1:]}
    words = recommendation_reason(report).split("; ")[0].split(", then ")
    assert set(words) == deciding and len(words) == len(deciding)
    assert words == sorted(words, key=_RULE_WORDS.index)
