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


def test_fit_table_lists_every_strategy_and_a_verdict(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "--detail", "llama-2-70b", "--gpus", "8", "--gpu", "a100-80gb")
    assert code == 0, err
    for kind in StrategyKind:
        # The opt-in ZeRO-3 variants are planned only when --strategies names them.
        assert (f"\n{kind.value} " in out) is not kind.is_opt_in
    assert "68,976,648,192 parameters" in out
    assert "Verdict: " in out


def test_fit_json_is_a_fit_report(zeroplan_cli) -> None:
    code, out, _ = zeroplan_cli("fit", "gpt2", "--gpus", "2", "--format", "json", "--strategies", "ddp,zero3")
    assert code == 0
    report = json.loads(out)
    assert [p["strategy"] for p in report["plans"]] == ["ddp", "zero3"]
    assert report["num_parameters"] == 124_439_808
    assert isinstance(report["plans"][0]["memory"]["peak_bytes"], int)


def test_fit_csv_parses_with_pandas(zeroplan_cli) -> None:
    code, out, _ = zeroplan_cli("fit", "llama-3-8b", "--gpus", "16", "--gpus-per-node", "8", "--format", "csv")
    assert code == 0
    frame = pd.read_csv(io.StringIO(out), index_col="strategy")
    assert frame.loc["hsdp", "shard_group_size"] == 8
    assert frame.loc["zero3", "shard_group_size"] == 16


def test_fit_gb_unit_changes_the_table(zeroplan_cli) -> None:
    _, gib, _ = zeroplan_cli("fit", "--detail", "gpt2", "--gpus", "1", "--strategies", "ddp")
    _, gb, _ = zeroplan_cli("fit", "--detail", "gpt2", "--gpus", "1", "--strategies", "ddp", "--unit", "GB")
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
        (["fit", "gpt2", "--gpus", "12", "--gpus-per-node", "8"], "gpus_per_node: 12 GPUs do not divide into nodes of 8 "
                                                                  "(allowed: 1, 2, 3, 4, 6, 12)"),
        # Nodes of 8 are the default: the error names --gpus, which the user typed, and what lays it out.
        (["fit", "gpt2", "--gpus", "12"], "gpus: 12 GPUs do not fill nodes of 8, the default GPUs per node (allowed: "
                                          "a multiple of 8, or gpus_per_node or nodes of 1, 2, 3, 4, 6, 12)"),
        (["fit", "gpt2", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        (["fit", "gpt2", "--strategies", "zero4"], "strategies: unknown 'zero4'"),
        (["fit", "gpt2", "--gpus", "16", "--hsdp-group", "3"], "hsdp-group: 3 does not divide the 16 GPUs"),
        (["fit", "/no/such/config.json"], "model: cannot read"),
    ],
)
def test_bad_input_is_one_line_exit_2(zeroplan_cli, argv, needle) -> None:
    code, out, err = zeroplan_cli(*argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and needle in err, err
    assert "Traceback" not in err


def test_heads_not_dividing_hidden_in_config(zeroplan_cli, tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 100, "hidden_size": 100, "intermediate_size": 200,
        "num_hidden_layers": 2, "num_attention_heads": 3,
    }))
    code, _, err = zeroplan_cli("fit", str(path))
    assert code == 2 and "model.num_heads: 3 heads do not divide hidden_size 100" in err


def test_models_and_gpus_listings(zeroplan_cli) -> None:
    code, out, _ = zeroplan_cli("models")
    assert code == 0 and "llama-2-70b" in out and "68,976,648,192" in out
    code, out, _ = zeroplan_cli("gpus")
    assert code == 0 and "a100-80gb" in out and "h100-80gb" in out


def test_console_script_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "zeroplan", "fit", "--detail", "mistral-7b", "--gpus", "8", "--strategies", "zero2"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "mistral-7b: 7,241,732,096 parameters" in result.stdout


def test_compare_prints_volume_and_times(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("compare", "--detail", "llama-2-7b", "--gpus", "16", "--strategies", "ddp,zero3,hsdp", "--hfu", "0.5")
    assert code == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("ddp", "zero3", "hsdp")}
    assert rows["ddp"][1] == "2.0" and rows["zero3"][1] == "3.0"


def test_hfu_above_one_is_rejected(zeroplan_cli) -> None:
    code, _, err = zeroplan_cli("compare", "gpt2", "--hfu", "1.5")
    assert code == 2 and "hfu: must be in (0, 1]" in err


def test_mfu_is_refused_with_a_pointer_to_hfu(zeroplan_cli) -> None:
    # The old --mfu timed executed FLOPs (an HFU); it is refused rather than read either way.
    for command in ("compare", "plan"):
        extra = ["--global-batch", "16"] if command == "plan" else []
        code, _, err = zeroplan_cli(command, "gpt2", *extra, "--mfu", "0.5")
        assert code == 2 and "mfu:" in err and "--hfu" in err and len(err.strip().splitlines()) == 1


def test_seq_len_default_is_capped_at_the_models_positions(zeroplan_cli) -> None:
    # 4,096 by default, GPT-2's 1,024 learned positions when fewer (docs/input-bounds.md).
    code, out, err = zeroplan_cli("fit", "--detail", "gpt2", "--gpus", "1", "--strategies", "ddp")
    assert code == 0, err
    assert "x seq 1024," in out
    code, out, err = zeroplan_cli("fit", "--detail", "llama-2-7b", "--gpus", "1", "--strategies", "ddp")
    assert code == 0, err
    assert "x seq 4096," in out


def test_allow_longer_seq_runs_rope_past_its_positions(zeroplan_cli) -> None:
    argv = ["fit", "llama-2-7b", "--gpus", "8", "--strategies", "zero3", "--format", "json"]
    code, _, err = zeroplan_cli(*argv, "--seq-len", "8192")
    assert code == 2 and "--seq-len: 8,192 exceeds llama-2-7b's maximum of 4,096" in err, err
    code, at_limit, err = zeroplan_cli(*argv, "--seq-len", "4096")
    assert code == 0, err
    code, longer, err = zeroplan_cli(*argv, "--seq-len", "8192", "--allow-longer-seq")
    assert code == 0, err
    at_limit, longer = json.loads(at_limit)["plans"][0]["memory"], json.loads(longer)["plans"][0]["memory"]
    assert longer["activation_bytes"] > at_limit["activation_bytes"]
    assert longer["parameter_bytes"] == at_limit["parameter_bytes"]


def test_issue_8_command_still_runs(zeroplan_cli) -> None:
    # Llama-3.1's config.json gives max_position_embeddings 131072: 8192 is within it.
    code, out, err = zeroplan_cli("fit", "--detail", "llama-3.1-8b", "--framework", "torchtitan", "--activation-checkpointing",
                         "selective-op", "--gpus", "8", "--gpu", "h100-80gb", "--micro-batch", "2", "--seq-len", "8192")
    assert code == 0, err
    assert "x seq 8192," in out and "Verdict: " in out


def test_measure_forwards_allow_longer_seq_and_refuses_before_launch(zeroplan_cli, monkeypatch, tmp_path) -> None:
    from zeroplan.harness import launch as launch_module

    launched = []

    def fake_launch(nproc, argv, out_dir, timeout_s, nodes=None, steps=None):
        launched.append(argv)
        return launch_module.LaunchResult(0, [], [], [], [])

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    base = ["measure", "tiny-llama", "--strategy", "zero2", "--backend", "gloo", "--seq-len", "1024", "--out", str(tmp_path / "o")]
    code, _, err = zeroplan_cli(*base, "--allow-longer-seq")
    assert code == 0, err
    assert launched and "--allow-longer-seq" in launched[0] and launched[0][launched[0].index("--seq-len") + 1] == "1024"
    launched.clear()
    code, _, err = zeroplan_cli("measure", "tiny-gpt2", *base[2:], "--allow-longer-seq")
    assert code == 2 and "tiny-gpt2's maximum of 512" in err and not launched, err


def test_models_lists_the_measurement_presets_the_readme_uses(capsys) -> None:
    from zeroplan.cli.main import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-8b" in out and "tiny-llama" in out and "micro-gpt2" in out


def test_fit_expresses_accumulation_without_resharding(capsys) -> None:
    # FSDP no_sync / set_requires_gradient_sync(False): the unsharded gradients are held, so the
    # peak grows and the gradients are reduced once per step (less sent).
    import json

    from zeroplan.cli.main import main

    argv = ["fit", "llama-3.1-8b", "--gpus", "8", "--grad-accum", "4", "--strategies", "fsdp-full-shard", "--format", "json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["plans"][0]
    assert main([*argv, "--keep-unsharded-grads-on-accum"]) == 0
    kept = json.loads(capsys.readouterr().out)["plans"][0]
    assert kept["memory"]["peak_bytes"] > plain["memory"]["peak_bytes"]
    assert kept["sent_bytes_per_step"] < plain["sent_bytes_per_step"]


@pytest.mark.parametrize("extra", [[], ["--tp", "2", "--pp", "2", "--grad-accum", "2"],
                                   ["--pp", "2", "--grad-accum", "2", "--compute-model", "roofline"]])
def test_compare_columns_add_up_to_the_step(capsys, extra) -> None:
    # Every part of the step has a column: compute (+ opt-step under the roofline), the
    # model-parallel collectives and the pipeline bubble where there are any, exposed and cpu-step.
    assert main(["compare", "--detail", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--strategies",
                 "fsdp-full-shard,fsdp-shard-grad-op", *extra]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("strategy "))
    names = out[header].split()
    assert ("mp-comm" in names) == bool(extra[:1] == ["--tp"] or "--pp" in extra)
    parts = [n for n in ("compute", "opt-step", "mp-comm", "bubble", "exposed", "cpu-step") if n in names]
    for row in out[header + 2:header + 4]:
        cells = dict(zip(names, row.split()))
        assert abs(sum(float(cells[n]) for n in parts) - float(cells["step"])) <= 0.002, row


def test_a_reader_that_closes_the_pipe_gets_no_traceback() -> None:
    """`zeroplan fit ... | head -1`: the reader may close the pipe before the table is written;
    the command stops quietly instead of printing BrokenPipeError's traceback."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "zeroplan", "fit", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb",
                                "--flat-reserve", "--detail"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # closed before the command has written anything
    _, err = process.communicate(timeout=120)
    assert err == b"" and process.returncode == 1, err.decode()
