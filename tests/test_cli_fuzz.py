"""benchmarks/cli_fuzz.py, random command lines of every planning sub-command answered in this
process: a fixed seed's cases all answer or refuse in one line, and the sweep's own
classification records what would break that."""

from __future__ import annotations

from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
fuzz = load_script(ROOT / "benchmarks" / "cli_fuzz.py")


def test_a_seeds_cases_answer_or_refuse_in_one_line() -> None:
    counts, bad, _ = fuzz.run(120, seed=7)
    assert not bad, "\n".join(line for lines in bad.values() for line in lines)
    outcomes = {outcome for _, outcome in counts}
    assert outcomes <= {"answered", "refused"} and outcomes == {"answered", "refused"}, counts
    assert sum(counts.values()) == 120
    # Every sub-command is drawn.
    assert {command for command, _ in counts} == {command for command, _ in fuzz.COMMANDS}


def test_the_classification_records_each_bad_outcome(monkeypatch) -> None:
    import zeroplan.cli.main as cli_main

    def answer(out: str, err: str, status):  # type: ignore[no-untyped-def]
        def main(argv):  # type: ignore[no-untyped-def]
            import sys

            sys.stdout.write(out)
            sys.stderr.write(err)
            return status
        return main

    cases = [(answer("table\n", "", 0), "answered"), (answer("", "zeroplan: error: --gpus: bad\n", 2), "refused"),
             (answer("", "", 0), "empty answer"), (answer("", "line one\nline two\n", 2), "refusal not one line"),
             (answer("half", "zeroplan: error: x\n", 2), "refusal not one line"), (answer("x", "", 1), "other status")]
    for main, outcome in cases:
        monkeypatch.setattr(cli_main, "main", main)
        assert fuzz.run_case(["fit", "gpt2"])[0] == outcome

    def raises(argv):  # type: ignore[no-untyped-def]
        raise KeyError("zero3-nvme")

    monkeypatch.setattr(cli_main, "main", raises)
    outcome, _, _, err, _ = fuzz.run_case(["fit", "gpt2"])
    assert outcome == "traceback" and "KeyError" in err
