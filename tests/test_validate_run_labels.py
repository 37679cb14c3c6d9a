"""`zeroplan validate` of several runs names each row's run distinctly: runs measured without
--run-id all carry measure's default id 'local', so those are told apart by their directory."""

from __future__ import annotations

from pathlib import Path

from zeroplan.validate.load import MergedRun, run_labels

RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "records"


def _copy_run(source: str, target: Path, run_id: str = "local") -> Path:
    target.mkdir(parents=True)
    for rank in sorted((RECORDS / source).glob("rank*.json")):
        text = rank.read_text().replace(f'"run_id": "{source}"', f'"run_id": "{run_id}"', 1)
        assert f'"run_id": "{run_id}"' in text
        (target / rank.name).write_text(text)
    return target


def test_runs_sharing_an_id_are_labelled_by_their_directory(zeroplan_cli, tmp_path: Path) -> None:
    first = _copy_run("tiny-llama-zero1-torch-fp32-n2", tmp_path / "zero1")
    second = _copy_run("tiny-llama-zero2-zeroplan-fp32-n2", tmp_path / "zero2")
    code, out, _ = zeroplan_cli("validate", str(first), str(second))
    assert code == 0
    runs = {line.split("  ")[0] for line in out.splitlines()[2:] if line.strip()}
    assert runs == {"local (zero1)", "local (zero2)"}


def test_same_directory_names_fall_back_to_the_path(zeroplan_cli, tmp_path: Path) -> None:
    first = _copy_run("tiny-llama-zero1-torch-fp32-n2", tmp_path / "a" / "run")
    second = _copy_run("tiny-llama-zero2-zeroplan-fp32-n2", tmp_path / "b" / "run")
    code, out, _ = zeroplan_cli("validate", "--format", "csv", str(first), str(second))
    assert code == 0
    assert f"local ({first})," in out and f"local ({second})," in out


def test_distinct_run_ids_are_kept(zeroplan_cli) -> None:
    code, out, _ = zeroplan_cli("validate", str(RECORDS / "tiny-llama-zero1-torch-fp32-n2"),
                                str(RECORDS / "tiny-llama-zero2-zeroplan-fp32-n2"))
    assert code == 0
    assert {line.split("  ")[0] for line in out.splitlines()[2:] if line.strip()} == {
        "tiny-llama-zero1-torch-fp32-n2", "tiny-llama-zero2-zeroplan-fp32-n2"}


def test_labels_use_the_launch_then_a_count_where_the_directory_is_shared() -> None:
    folder = Path("runs") / "x"
    runs = [MergedRun("local", "aaaaaaaa1", [], [folder / "rank00000.json"]),
            MergedRun("local", "bbbbbbbb2", [], [folder / "rank00000.json"]),
            MergedRun("local", None, [], [folder / "rank00000.json"]),
            MergedRun("local", None, [], [folder / "rank00000.json"]),
            MergedRun("other", None, [], [folder / "rank00000.json"])]
    assert run_labels(runs) == [
        f"local ({folder}, launch aaaaaaaa)", f"local ({folder}, launch bbbbbbbb)",
        f"local ({folder}) #1", f"local ({folder}) #2", "other",
    ]
