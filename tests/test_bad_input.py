"""Every command line entry point answers bad input in one line: exit status 2, exactly one line on
stderr naming the field, nothing on stdout, no traceback, and no file written.

Two tables drive it. ENTRY_POINTS lists each entry point with a valid minimal command line; every
flag of its parser that takes a number or a choice is then tried with each value of BAD_NUMBERS or
an unknown choice (the cases are derived from the parsers, so a new flag is covered without a new
row). CASES lists the hand-made inputs (files, records, combinations). A new sub-command of
``zeroplan`` must get a row in ENTRY_POINTS: test_every_subcommand_has_a_row fails until it does.
No case launches torchrun: measure's refusals all happen before it starts a rank.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from refusals import run_refused

from zeroplan.cli.parser import MAX_BUCKET_ELEMENTS, MAX_COUNT, MAX_FLOAT, MAX_SEQ_LEN


def _zeroplan(argv: list[str]) -> int:
    from zeroplan.cli.main import main

    return main(argv)


def _harness_rank(argv: list[str]) -> int:
    from zeroplan.harness.__main__ import main

    return main(argv)


def _zeroplan_parser(command: str) -> Callable[[], argparse.ArgumentParser]:
    def build() -> argparse.ArgumentParser:
        from zeroplan.cli.main import build_parser

        parser = build_parser()
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return subparsers.choices[command]

    return build


def _delegated_parser(module: str) -> Callable[[], argparse.ArgumentParser]:
    def build() -> argparse.ArgumentParser:
        import importlib

        return importlib.import_module(module).build_parser()

    return build


NCCL_TESTS_LOG = Path(__file__).resolve().parent / "fixtures" / "nccl_tests" / "all_reduce_8gpu_1node.txt"

# name -> (run, valid minimal argv, parser of the flags after that argv). Commands without flags
# (models, gpus) take no options at all: an unknown option is their bad input.
ENTRY_POINTS: dict[str, tuple[Callable[[list[str]], int], list[str], Callable[[], argparse.ArgumentParser]]] = {
    "fit": (_zeroplan, ["fit", "gpt2"], _zeroplan_parser("fit")),
    "compare": (_zeroplan, ["compare", "gpt2"], _zeroplan_parser("compare")),
    "validate": (_zeroplan, ["validate", "records"], _zeroplan_parser("validate")),
    "calibrate": (_zeroplan, ["calibrate", str(NCCL_TESTS_LOG), "--gpu", "h100", "--out", "gpu.json"],
                  _zeroplan_parser("calibrate")),
    "plan": (_zeroplan, ["plan", "gpt2", "--global-batch", "8"], _zeroplan_parser("plan")),
    "models": (_zeroplan, ["models"], _zeroplan_parser("models")),
    "gpus": (_zeroplan, ["gpus"], _zeroplan_parser("gpus")),
    "simulate": (_zeroplan, ["simulate", "gpt2", "--strategy", "ddp", "--world-size", "2"],
                 _delegated_parser("zeroplan.simulate.cli")),
    "measure": (_zeroplan, ["measure", "tiny-llama", "--strategy", "zero2", "--out", "out"],
                _delegated_parser("zeroplan.harness.cli")),
    "python -m zeroplan.harness": (_harness_rank, ["tiny-llama", "--strategy", "zero2", "--out", "out"],
                                   _delegated_parser("zeroplan.harness.__main__")),
}

# Values no numeric flag accepts: not numbers, not positive, not finite, or beyond the documented
# bounds (docs/input-bounds.md).
BAD_NUMBERS = ["0", "-1", "abc", "", "inf", "-inf", "nan", "1e999", "0x10", str(2**64)]


def _just_too_big(flag: str, action: argparse.Action) -> str:
    if action.type.__name__ == "positive_float":
        return str(MAX_FLOAT * 2)
    if flag == "--reduce-bucket-size":
        return str(MAX_BUCKET_ELEMENTS + 1)
    return str(MAX_SEQ_LEN + 1 if flag == "--seq-len" else MAX_COUNT + 1)


def _numeric_and_choice_flags(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    flags = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if action.choices is not None or getattr(action.type, "__name__", "") in ("positive integer", "positive_float"):
            flags.append((action.option_strings[-1], action))
    return flags


def _flag_cases() -> list[tuple[str, list[str], str]]:
    cases = []
    for name, (_, base, build) in ENTRY_POINTS.items():
        for flag, action in _numeric_and_choice_flags(build()):
            if action.choices is not None:
                cases.append((name, [*base, flag, "no-such-choice"], flag))
                continue
            for value in [*BAD_NUMBERS, _just_too_big(flag, action)]:
                cases.append((name, [*base, f"{flag}={value}"], flag))
        cases.append((name, [*base, "--no-such-flag"], "--no-such-flag"))
    return cases


SAMPLE_RECORD = (Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed-records"
                 / "tiny-llama-zero1-deepspeed-fp32-n2" / "rank00000.json")


def _write_fixtures(root: Path) -> None:
    """Inputs the hand-made cases read: bad config files and records."""
    (root / "latin1.json").write_bytes(b'{"model_type": "llama", "name": "caf\xe9"}')
    llama = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 2,
             "num_attention_heads": 32, "intermediate_size": 11008, "max_position_embeddings": 4096}
    (root / "string.json").write_text(json.dumps({**llama, "hidden_size": "4096"}))
    (root / "boolean.json").write_text(json.dumps({**llama, "num_hidden_layers": True}))
    # A typo of 10^30 made the planner's integer arithmetic run for minutes at 16 GiB of memory.
    (root / "huge.json").write_text(json.dumps({**llama, "hidden_size": 10**30}))
    (root / "list.json").write_text("[1, 2]")
    (root / "moe-llama.json").write_text(json.dumps({**llama, "num_local_experts": 8}))
    (root / "dbrx-moe.json").write_text(json.dumps({**llama, "model_type": "dbrx"}))
    (root / "biased-gemma.json").write_text(json.dumps({**llama, "model_type": "gemma", "attention_bias": True}))
    (root / "a-directory").mkdir()
    (root / "a-file").write_text("")
    (root / "records").mkdir()
    record = json.loads(SAMPLE_RECORD.read_text(encoding="utf-8"))
    (root / "records" / "rank00000.json").write_text(json.dumps({**record, "steps": []}))
    (root / "negative.json").write_text(json.dumps({**record, "rank": -1}))
    (root / "notjson.json").write_text("{")
    # Nested past the JSON decoder's recursion: a RecursionError escaped the DeepSpeed-config and
    # efficiency readers.
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    # Qwen's mlp_only_layers as a number, not a list: a TypeError from tuple().
    moe = json.loads((Path(__file__).resolve().parent / "fixtures" / "hf" / "qwen3-30b-a3b.json").read_text())
    (root / "mlp-only-int.json").write_text(json.dumps({**moe, "mlp_only_layers": 3}))
    (root / "mlp-only-huge.json").write_text(json.dumps({**moe, "mlp_only_layers": [10**30]}))
    bert = json.loads((Path(__file__).resolve().parent / "fixtures" / "hf" / "bert-base-uncased.json").read_text())
    (root / "bert-architectures-int.json").write_text(json.dumps({**bert, "architectures": -1}))
    (root / "bert-architectures-ints.json").write_text(json.dumps({**bert, "architectures": [1]}))


# (entry point, argv, the field the one line must name)
CASES: list[tuple[str, list[str], str]] = [
    ("fit", ["fit", "gpt2", "--gpu-memory-gib", "inf"], "--gpu-memory-gib"),
    ("fit", ["fit", "gpt2", "--gpus", "1000000000000"], "--gpus"),
    ("fit", ["fit", "gpt2", "--micro-batch", str(10**15)], "--micro-batch"),
    ("fit", ["fit", "gpt2", "--seq-len", "1000000000"], "--seq-len"),
    # Longer than the model's max_positions (docs/input-bounds.md): GPT-2's learned table has
    # 1,024 rows, so not even --allow-longer-seq applies; RoPE models need that flag.
    ("fit", ["fit", "gpt2", "--seq-len", "4096"], "--seq-len"),
    ("fit", ["fit", "gpt2", "--seq-len", "1025", "--allow-longer-seq"], "--seq-len"),
    ("fit", ["fit", "llama-2-7b", "--seq-len", "4097"], "--allow-longer-seq"),
    ("compare", ["compare", "llama-3-8b", "--seq-len", "16384"], "--seq-len"),
    ("fit", ["fit", "gpt2", "--strategies", "zero1,zero1"], "strategies"),
    ("fit", ["fit", "gpt2", "--strategies", ""], "strategies"),
    ("fit", ["fit", "gpt2", "--strategies", "zero1,,zero2"], "strategies"),
    ("compare", ["compare", "gpt2", "--strategies", "zero4"], "strategies"),
    # With model-parallel layouts a dp of 1 takes any batch: the data-parallel search alone, or a
    # fixed layout, refuses one its ranks do not divide.
    ("plan", ["plan", "gpt2", "--global-batch", "12", "--no-model-parallel"], "global-batch"),
    ("plan", ["plan", "gpt2", "--global-batch", "4", "--no-model-parallel"], "global-batch"),
    ("plan", ["plan", "gpt2", "--global-batch", "6", "--tp", "2", "--pp", "1"], "global-batch"),
    ("plan", ["plan", "gpt2", "--global-batch", "8", "--tp", "3"], "--tp"),
    ("plan", ["plan", "gpt2"], "--global-batch"),
    ("plan", ["plan", "llama-2-7b", "--global-batch", "8", "--framework", "torchtune", "--strategies", "zero2"], "strategies"),
    ("plan", ["plan", "gpt2", "--global-batch", "8", "--strategies", "zero1,zero1"], "strategies"),
    ("plan", ["plan", "no-such-model", "--global-batch", "8"], "model"),
    ("fit", ["fit", "latin1.json"], "model"),
    ("fit", ["fit", "string.json"], "config.hidden_size"),
    ("fit", ["fit", "boolean.json"], "config.num_hidden_layers"),
    ("fit", ["fit", "huge.json"], "config.hidden_size"),
    ("fit", ["fit", "list.json"], "config"),
    ("fit", ["fit", "mlp-only-int.json"], "config.mlp_only_layers"),
    ("fit", ["fit", "bert-architectures-int.json", "--framework", "hf"], "config.architectures"),
    ("fit", ["fit", "bert-architectures-ints.json", "--framework", "hf"], "config.architectures"),
    ("plan", ["plan", "mlp-only-huge.json", "--global-batch", "8"], "dense_layers"),
    ("fit", ["fit", "moe-llama.json"], "config.num_local_experts"),
    ("fit", ["fit", "dbrx-moe.json"], "config.model_type"),
    ("fit", ["fit", "biased-gemma.json"], "config.attention_bias"),
    ("fit", ["fit", "a-directory"], "model"),
    ("fit", ["fit", "no-such-model"], "model"),
    ("fit", ["fit", "gpt2", "--gpu", "missing.json"], "gpu"),
    ("fit", ["fit", "gpt2", "--hfu", "1.5"], "hfu"),
    ("fit", ["fit", "gpt2", "--deepspeed-config", "deep.json"], "--deepspeed-config"),
    # Within the flag's generic bound, beyond GpuSpec's (2^44 bytes): an OverflowError in the plan
    # search's int64 arrays, and a fit answered for a device no GpuSpec can describe.
    ("plan", ["plan", "gpt2", "--global-batch", "8", "--gpu-memory-gib", str(2**40)], "--gpu-memory-gib"),
    ("fit", ["fit", "gpt2", "--gpu-memory-gib", "16385"], "--gpu-memory-gib"),
    ("fit", ["fit", "gpt2", "--efficiency", "deep.json"], "--efficiency"),
    # A strategy outside the default set that --strategies does not name: a KeyError.
    ("fit", ["fit", "gpt2", "--explain", "zero3-nvme"], "--explain"),
    ("compare", ["compare", "gpt2", "--explain", "zero3-hpz"], "--explain"),
    # '--flag=--': argparse 3.11 strips the '--' and stores [] untyped and unchecked, which was
    # a traceback (--host, --gpu, --strategies) or a silent default (--precision, --emit).
    ("fit", ["fit", "gpt2", "--host=--"], "--host"),
    ("fit", ["fit", "gpt2", "--gpu=--"], "--gpu"),
    ("fit", ["fit", "gpt2", "--precision=--"], "--precision"),
    ("plan", ["plan", "gpt2", "--global-batch", "8", "--emit=--"], "--emit"),
    ("validate", ["validate", "negative.json", "--plot=--"], "--plot"),
    ("fit", ["fit", "gpt2", "--mfu", "0.5"], "mfu"),
    ("validate", ["validate", "records"], "steps"),
    ("validate", ["validate", "negative.json"], "rank"),
    ("validate", ["validate", "notjson.json"], "records"),
    ("validate", ["validate", "a-directory"], "records"),
    ("validate", ["validate", "nowhere"], "records"),
    ("validate", ["validate", "negative.json", "--plot", "x.txt"], "plot"),
    ("validate", ["validate", "negative.json", "--plot", "a-directory"], "plot"),
    ("calibrate", ["calibrate", str(NCCL_TESTS_LOG.with_name("malformed.txt")), "--gpu", "h100", "--out", "x.json"],
     "malformed.txt:17"),
    ("calibrate", ["calibrate", "nowhere.txt", "--gpu", "h100", "--out", "x.json"], "nowhere.txt"),
    ("calibrate", ["calibrate", "a-file", "--gpu", "h100", "--out", "x.json"], "no data rows"),
    ("calibrate", ["calibrate", str(NCCL_TESTS_LOG), "--gpu", "h1000", "--out", "x.json"], "gpu"),
    ("calibrate", ["calibrate", str(NCCL_TESTS_LOG), "--gpu", "h100", "--out", "a-directory/no/x.json"], "out"),
    ("measure", ["measure", "tiny-llama", "--strategy", "zero2", "--out", "a-file"], "out"),
    ("measure", ["measure", "tiny-llama", "--strategy", "ddp", "--out", "out"], "engine"),
    ("measure", ["measure", "no-such-model", "--strategy", "zero2", "--out", "out"], "model"),
    ("measure", ["measure", "llama-2-70b", "--strategy", "zero3", "--backend", "gloo", "--out", "out"], "model"),
    ("measure", ["measure", "tiny-llama", "--strategy", "zero2", "--seq-len", str(MAX_SEQ_LEN + 1), "--out", "out"],
     "--seq-len"),
    # tiny-gpt2 has 512 learned positions: this was an IndexError inside every rank.
    ("measure", ["measure", "tiny-gpt2", "--strategy", "zero2", "--seq-len", "1024", "--out", "out"], "--seq-len"),
    ("measure", ["measure", "tiny-gpt2", "--strategy", "zero2", "--seq-len", "1024", "--allow-longer-seq",
                 "--out", "out"], "--seq-len"),
    ("measure", ["measure", "tiny-llama", "--strategy", "zero2", "--seq-len", "1024", "--out", "out"],
     "--allow-longer-seq"),
    ("measure", ["measure", "tiny-llama", "--strategy", "zero2", "--nnodes", "2", "--node-rank", "2",
                 "--rdzv-endpoint", "node01:29500", "--out", "out"], "--node-rank"),
    ("measure", ["measure", "tiny-llama", "--strategy", "zero2", "--node-rank", "-1", "--out", "out"], "--node-rank"),
    ("measure", ["measure", "tiny-llama", "--strategy", "zero2", "--nnodes", "2", "--out", "out"], "--rdzv-endpoint"),
    ("measure", ["measure", "tiny-llama", "--strategy", "zero2", "--nnodes", "2", "--rdzv-endpoint", "node01",
                 "--out", "out"], "--rdzv-endpoint"),
    ("simulate", ["simulate", "a-directory", "--strategy", "ddp", "--world-size", "2"], "model"),
    ("simulate", ["simulate", "gpt2", "--strategy", "ddp", "--world-size", "2", "--seq-len", "2048",
                  "--allow-longer-seq"], "--seq-len"),
    ("simulate", ["simulate", "llama-2-7b", "--strategy", "ddp", "--world-size", "2", "--seq-len", "8192"],
     "--seq-len"),
    ("simulate", ["simulate", "gpt2", "--strategy", "zero1", "--world-size", "2"], "--strategy"),
    ("python -m zeroplan.harness", ["no-such-model", "--strategy", "zero2", "--out", "out"], "model"),
    ("python -m zeroplan.harness", ["micro-gpt2", "--strategy", "zero2", "--seq-len", "65", "--out", "out"],
     "--seq-len"),
]


def _listing(root: Path) -> dict[str, int]:
    return {str(path.relative_to(root)): path.stat().st_size for path in sorted(root.rglob("*"))}


def _check_one_line(capsys, monkeypatch, tmp_path: Path, entry: str, argv: list[str], field: str) -> None:
    _write_fixtures(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _listing(tmp_path)
    err = run_refused(ENTRY_POINTS[entry][0], argv, capsys)
    assert "error: " in err and field in err, (argv, field, err)
    assert _listing(tmp_path) == before, f"{argv} wrote files"


@pytest.mark.parametrize("entry,argv,field", _flag_cases(), ids=lambda value: repr(value)[:60])
def test_every_numeric_or_choice_flag_refuses_bad_values(capsys, monkeypatch, tmp_path, entry, argv, field) -> None:
    _check_one_line(capsys, monkeypatch, tmp_path, entry, argv, field)


@pytest.mark.parametrize("entry,argv,field", CASES, ids=lambda value: repr(value)[:60])
def test_hand_made_bad_input(capsys, monkeypatch, tmp_path, entry, argv, field) -> None:
    _check_one_line(capsys, monkeypatch, tmp_path, entry, argv, field)


def test_every_subcommand_has_a_row() -> None:
    from zeroplan.cli.main import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) <= set(ENTRY_POINTS), set(subparsers.choices) - set(ENTRY_POINTS)


def test_the_valid_base_lines_are_valid(capsys, monkeypatch, tmp_path) -> None:
    """The fuzz cases change one thing in a valid line: the planning bases must succeed as they are."""
    monkeypatch.chdir(tmp_path)
    for name in ("fit", "compare", "models", "gpus"):
        run, argv, _ = ENTRY_POINTS[name]
        assert run(argv) == 0, name
    capsys.readouterr()


def test_validate_plot_without_matplotlib(tmp_path) -> None:
    program = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from zeroplan.cli.main import main\n"
        f"raise SystemExit(main(['validate', {str(tmp_path)!r}, '--plot', {str(tmp_path / 'p.png')!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "plot: needs matplotlib" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "module,argv,field",
    [
        ("zeroplan", ["fit", "gpt2", "--gpus", str(2**40)], "--gpus"),
        ("zeroplan.simulate", ["gpt2", "--strategy", "ddp", "--world-size", "0"], "--world-size"),
        ("zeroplan.harness", ["tiny-llama", "--strategy", "zero2", "--steps", "nan", "--out", "out"], "--steps"),
    ],
)
def test_python_dash_m_entry_points(tmp_path, module, argv, field) -> None:
    result = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and field in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_run_past_its_time_limit_is_one_line(capsys, monkeypatch, tmp_path) -> None:
    """The launcher's 124 (time limit) becomes one line naming --timeout-s, exit status 2; no
    torchrun is started: launch is replaced by one that reports the limit."""
    from zeroplan.harness import launch as launch_module
    from zeroplan.harness.cli import main

    def timed_out(nproc, argv, out_dir, timeout_s, nodes=None, steps=None):
        return launch_module.LaunchResult(124, [], list(range(nproc)), [], [])

    monkeypatch.setattr(launch_module, "launch", timed_out)
    code = main(["tiny-llama", "--strategy", "zero2", "--backend", "gloo", "--timeout-s", "5", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "timeout-s" in err and "5 s limit" in err, err
