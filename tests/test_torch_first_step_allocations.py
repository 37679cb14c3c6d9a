"""benchmarks/torch_first_step_allocations.py: torch makes each .grad in a step's first backward
and AdamW's states at the first optimizer.step(), none before the first forward."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script


# Imports torch and trains two steps (seconds): slow.
@pytest.mark.slow
def test_gradients_in_first_backward_states_at_first_step(capsys) -> None:
    script = load_script(Path(__file__).parents[1] / "benchmarks" / "torch_first_step_allocations.py")
    assert script.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "before the first forward: gradients 0 states 0"
    marks = {line[:22].strip(): line[23:] for line in lines[1:-1]}
    parameters = 2 * 2 * 3  # three blocks of two linears, weight and bias each
    for step in (0, 1):
        assert marks[f"step {step} backward 0"].count("G") == parameters
        assert "G" not in marks[f"step {step} backward 1"]
        assert not set(marks[f"step {step} forward 0"] + marks[f"step {step} forward 1"]) - {"."}
        # The gradients come between the backward's other tensors, not after them.
        backward = marks[f"step {step} backward 0"]
        assert backward.index("G") < backward.rindex(".")
    assert marks["step 0 optimizer"] == "S" * 2 * parameters + "T" * parameters
    assert marks["step 1 optimizer"] == "T" * parameters
