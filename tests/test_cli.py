"""The command line: output formats, and one-line errors with exit status 2."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pandas as pd
import pytest

from zeroplan.cli.main import main
from zeroplan.specs import StrategyKind


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_fit_table_lists_every_strategy_and_a_verdict(capsys) -> None:
    code, out, err = run(capsys, "fit", "llama-2-70b", "--gpus", "8", "--gpu", "a100-80gb")
    assert code == 0, err
    for kind in StrategyKind:
        assert f"\n{kind.value} " in out
    assert "68,976,648,192 parameters" in out
    assert "Verdict: " in out


def test_fit_json_is_a_fit_report(capsys) -> None:
    code, out, _ = run(capsys, "fit", "gpt2", "--gpus", "2", "--format", "json", "--strategies", "ddp,zero3")
    assert code == 0
    report = json.loads(out)
    assert [p["strategy"] for p in report["plans"]] == ["ddp", "zero3"]
    assert report["num_parameters"] == 124_439_808
    assert isinstance(report["plans"][0]["memory"]["peak_bytes"], int)


def test_fit_csv_parses_with_pandas(capsys) -> None:
    code, out, _ = run(capsys, "fit", "llama-3-8b", "--gpus", "16", "--gpus-per-node", "8", "--format", "csv")
    assert code == 0
    frame = pd.read_csv(io.StringIO(out), index_col="strategy")
    assert frame.loc["hsdp", "shard_group_size"] == 8
    assert frame.loc["zero3", "shard_group_size"] == 16


def test_fit_gb_unit_changes_the_table(capsys) -> None:
    _, gib, _ = run(capsys, "fit", "gpt2", "--gpus", "1", "--strategies", "ddp")
    _, gb, _ = run(capsys, "fit", "gpt2", "--gpus", "1", "--strategies", "ddp", "--unit", "GB")
    assert "in GiB" in gib and "in GB" in gb


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["fit", "llama-2-7"], "model: unknown 'llama-2-7'; did you mean 'llama-2-7b'"),
        (["fit", "gpt2", "--gpu", "a100-80g"], "gpu: unknown 'a100-80g'"),
        (["fit", "gpt2", "--gpus", "0"], "argument --gpus: must be a positive integer, got 0"),
        (["fit", "gpt2", "--micro-batch", "-2"], "argument --micro-batch: must be a positive integer"),
        (["fit", "gpt2", "--seq-len", "abc"], "argument --seq-len: expected a positive integer"),
        (["fit", "gpt2", "--gpus", "12", "--nodes", "5"], "nodes: 12 GPUs do not divide into 5 nodes"),
        (["fit", "gpt2", "--gpus", "12", "--gpus-per-node", "8"], "gpus_per_node: 12 GPUs do not divide into nodes of 8"),
        (["fit", "gpt2", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        (["fit", "gpt2", "--strategies", "zero4"], "strategies: unknown 'zero4'"),
        (["fit", "gpt2", "--gpus", "16", "--hsdp-group", "3"], "hsdp-group: 3 does not divide the 16 GPUs"),
        (["fit", "/no/such/config.json"], "model: cannot read"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, needle) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and needle in err, err
    assert "Traceback" not in err


def test_heads_not_dividing_hidden_in_config(capsys, tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 100, "hidden_size": 100, "intermediate_size": 200,
        "num_hidden_layers": 2, "num_attention_heads": 3,
    }))
    code, _, err = run(capsys, "fit", str(path))
    assert code == 2 and "model.num_heads: 3 heads do not divide hidden_size 100" in err


def test_models_and_gpus_listings(capsys) -> None:
    code, out, _ = run(capsys, "models")
    assert code == 0 and "llama-2-70b" in out and "68,976,648,192" in out
    code, out, _ = run(capsys, "gpus")
    assert code == 0 and "a100-80gb" in out and "h100-80gb" in out


def test_console_script_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "zeroplan", "fit", "mistral-7b", "--gpus", "8", "--strategies", "zero2"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "mistral-7b: 7,241,732,096 parameters" in result.stdout
