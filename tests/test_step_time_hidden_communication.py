"""benchmarks/step_time_hidden_communication.py: a fraction of the communication the planner
hides, added to the step (docs/validation.md, "Mechanisms tried"). Its rule at the published
contention is Lee et al.'s compute slowdown, its fits find the f they are asked for, and with
f = 0 its own scoring loop gives the planner's figures (so its columns differ from the planner's
by the variant alone)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from tests.scripts import load_script

SCRIPT = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "step_time_hidden_communication.py")
SLOWDOWN = 0.189


def test_at_the_published_contention_a_phase_is_compute_slowed_while_the_collectives_run() -> None:
    compute, collective = 1.0, 0.5
    # compute outlasts the collectives: k / (1 + s) of it runs beside them, the rest after
    slowed = collective + (compute - collective / (1 + SLOWDOWN))
    assert SCRIPT.added_s(((compute, collective, collective),), SCRIPT.CONTENTION) == pytest.approx(slowed - compute)
    # collectives outlast the compute even slowed: the phase is theirs, nothing added
    assert SCRIPT.added_s(((0.5, 1.0, 1.0),), SCRIPT.CONTENTION) == 0
    # slowed, the compute passes the collectives: the phase ends when it does
    assert SCRIPT.added_s(((0.9, 1.0, 1.0),), SCRIPT.CONTENTION) == pytest.approx(0.9 + SCRIPT.CONTENTION - 1.0)
    # a host link busier than both: the phase is the link's
    assert SCRIPT.added_s(((1.0, 0.5, 2.0),), SCRIPT.CONTENTION) == 0
    assert SCRIPT.added_s(((1.0, 0.5, 0.5), (2.0, 1.0, 1.0)), 0.0) == 0


def test_spread_is_within_groups_of_two_or_more() -> None:
    assert SCRIPT.within_spread([[0.5, 0.5], [0.7]]) == 0
    assert SCRIPT.within_spread([[1.0, math.exp(0.2)], [0.3]]) == pytest.approx(0.1)
    assert SCRIPT.within_spread([[0.5], [0.6]]) is None


def test_the_fit_finds_the_least_spread() -> None:
    assert SCRIPT.argmin_f(lambda f: (f - 0.37) ** 2 + 0.01) == pytest.approx(0.37, abs=1e-4)
    assert SCRIPT.argmin_f(lambda f: abs(f + 0.21)) == pytest.approx(-0.21, abs=1e-4)
    assert SCRIPT.argmin_f(lambda f: 0.05) is None  # a source whose rows do not move with f tells none


@pytest.mark.slow  # every published row solved under each held-out fit: ~10 s
def test_with_f_zero_it_scores_as_the_planner_does() -> None:
    from zeroplan.validate.step_calibration import calibration_study

    _, errors = calibration_study()
    planner = SCRIPT.figures("planner")
    calibrated = [e for source in planner["calibrated"].values() for e in source]
    default = [e for source in planner["default"].values() for e in source]
    assert sorted(calibrated) == pytest.approx(sorted(abs(e.calibrated_error) for e in errors if e.calibrated_error is not None))
    assert sorted(default) == pytest.approx(sorted(abs(e.kernel_error) for e in errors))
    assert statistics.median(default) == pytest.approx(statistics.median(abs(e.kernel_error) for e in errors))

