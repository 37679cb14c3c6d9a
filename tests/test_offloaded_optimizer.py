"""DeepSpeed's optimizer offload steps a CPU optimizer of its own (zeroplan.specs.request
check_offloaded_optimizer): bitsandbytes' 8-bit Adam is refused by DeepSpeed's engine, and under
hf accelerate replaces SGD, Adafactor and 8-bit Adam by DeepSpeed's CPU Adam, so a plan of their
own states on the host answered a run that keeps Adam's (llama-2-7b under hf's zero3-offload on
8 GPUs: 10.1 GB of host states a rank planned for adam-8bit, where the CPU Adam keeps the 15.2 of
adamw's)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("framework, optimizer, strategy", [
    ("zeroplan", "adam-8bit", "zero3-offload"),
    ("zeroplan", "adam-8bit", "zero2-offload"),
    ("hf", "adam-8bit", "zero3-param-offload"),
    ("hf", "sgd", "zero2-offload"),
    ("hf", "sgd-momentum", "zero3-offload"),
    ("hf", "adafactor", "zero3-offload"),
])
def test_an_optimizer_the_offload_does_not_step_is_refused(zeroplan_cli, framework, optimizer, strategy) -> None:
    code, out, err = zeroplan_cli("fit", "llama-2-7b", "--gpus", "8", "--framework", framework, "--optimizer", optimizer,
                                  "--strategies", strategy)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "optimizer" in err and f"{optimizer} under {strategy}" in err and "allowed: adamw, adam" in err, err


@pytest.mark.parametrize("framework, optimizer", [("hf", "lion"), ("hf", "adamw"), ("zeroplan", "sgd"),
                                                  ("zeroplan", "lion"), ("zeroplan", "adafactor")])
def test_what_the_offload_steps_as_asked_is_planned(zeroplan_cli, framework, optimizer) -> None:
    code, _, err = zeroplan_cli("fit", "llama-2-7b", "--gpus", "8", "--framework", framework, "--optimizer", optimizer,
                                "--strategies", "zero3-offload")
    assert code == 0, err


def test_the_default_list_leaves_the_offload_strategies_out_with_the_reason(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "llama-2-7b", "--gpus", "8", "--optimizer", "adam-8bit", "--detail")
    assert code == 0, err
    assert "Left out: zero2-offload: adam-8bit under zero2-offload" in " ".join(out.split()), out
    assert "zero3 " in out
