"""ZeRO-Offload++'s Twin-Flow (DeepSpeed offload_optimizer.ratio below 1.0): the first
int((1 - ratio) x n) of a rank's n optimizer sub-groups keep their fp32 master, gradient and
states on the GPU and step there (deepspeed 0.19.8 runtime/zero/stage3.py:1100-1108); the others
are offloaded as under zero3-offload. Read from a --deepspeed-config file, written by --emit,
refused in one line where DeepSpeed would not run it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.emit import planned_from_fit_flags
from zeroplan.cli.main import main
from zeroplan.core import deepspeed_partial_offload as partial
from zeroplan.core.buffers import optimizer_step_temporary_bytes
from zeroplan.core.communication import Phase
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.nvme import sub_group_partition_elements
from zeroplan.core.timing import cpu_optimizer_time_s, gpu_optimizer_time_s, host_transfer_bytes
from zeroplan.emit.formats import deepspeed_config
from zeroplan.errors import ZeroplanError
from zeroplan.specs.strategy import StrategyKind, StrategySpec

GPT2 = ("gpt2", "--gpus", "4", "--gpu", "h100-80gb", "--flat-reserve")
SMALL_SUB_GROUPS = 3_000_000
"""gpt2's partition on 4 ranks (31.1M elements) in 8 sub-groups of at least 3M elements."""


def written(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def offload_config(ratio: float | None, sub_group_size: int = SMALL_SUB_GROUPS, param: bool = False) -> dict:
    block: dict = {"device": "cpu"}
    if ratio is not None:
        block["ratio"] = ratio
    zero = {"stage": 3, "sub_group_size": sub_group_size, "offload_optimizer": block}
    if param:
        zero["offload_param"] = {"device": "cpu"}
    return {"zero_optimization": zero, "bf16": {"enabled": True}}


def planned(tmp_path: Path, config: dict, *flags: str):
    return planned_from_fit_flags([*GPT2, *flags, "--deepspeed-config", written(tmp_path, config)], "zeroplan fit")


def test_ratio_one_is_todays_zero3_offload(tmp_path: Path) -> None:
    """ratio 1.0 (DeepSpeed's default) reads as no ratio, and a spec that carries 1.0 plans the
    same bytes and seconds: int((1 - 1) x n) = 0 sub-groups on the GPU."""
    run, plan = planned(tmp_path, offload_config(1.0))
    assert run.request.strategy.offload_optimizer_ratio is None
    bare, bare_plan = planned(tmp_path, offload_config(None))
    assert plan.memory == bare_plan.memory and plan.time == bare_plan.time
    one = run.request.with_strategy(run.request.strategy.model_copy(update={"offload_optimizer_ratio": 1.0}))
    assert partial.device_sub_group_elements(one) == []
    assert model_state_bytes(one) == model_state_bytes(run.request)
    assert cpu_optimizer_time_s(one) == cpu_optimizer_time_s(run.request)
    assert gpu_optimizer_time_s(one) == gpu_optimizer_time_s(run.request) == 0


@pytest.mark.parametrize("ratio, on_gpu", [(0.5, 4), (0.3, 5), (0.9, 0), (0.8, 1)])
def test_the_first_sub_groups_move_from_host_to_gpu(tmp_path: Path, ratio: float, on_gpu: int) -> None:
    """Of 8 sub-groups, int((1 - ratio) x 8) stay on the GPU (0.5: 4; 0.3: int(5.6) = 5; 0.9:
    int(0.8) = 0; 0.8: int(1.6) = 1), the first ones: their fp32 master, gradient and Adam
    states (16 bytes an element) leave the host for the GPU, and nothing else moves."""
    run, _ = planned(tmp_path, offload_config(ratio))
    bare, _ = planned(tmp_path, offload_config(None))
    groups = sub_group_partition_elements(run.request)
    assert len(groups) == 8
    moved = sum(groups[:on_gpu])
    states, before = model_state_bytes(run.request), model_state_bytes(bare.request)
    assert states.optimizer_state_bytes == moved * 16
    assert before.host_bytes - states.host_bytes == moved * 16
    assert (states.parameter_bytes, states.gradient_bytes) == (before.parameter_bytes, before.gradient_bytes)
    # torch's foreach AdamW makes one fp32 square root of the sub-group it steps.
    assert optimizer_step_temporary_bytes(run.request, states.optimizer_elements) == max(groups[:on_gpu], default=0) * 4


def test_step_time_splits_between_the_cpu_adam_and_the_gpu(tmp_path: Path) -> None:
    """The CPU Adam and its host passes (linear in the elements) run over the host sub-groups
    only; the GPU runs an AdamW pass over the rest; the host link no longer carries the GPU
    sub-groups' fp32 gradient down (backward) or their parameters up (step)."""
    run, _ = planned(tmp_path, offload_config(0.5))
    bare, _ = planned(tmp_path, offload_config(None))
    groups = sub_group_partition_elements(run.request)
    on_gpu, total = sum(groups[:4]), model_state_bytes(bare.request).optimizer_elements
    assert cpu_optimizer_time_s(run.request) == pytest.approx(cpu_optimizer_time_s(bare.request) * (total - on_gpu) / total,
                                                               rel=1e-12)
    assert gpu_optimizer_time_s(run.request) > 0 == gpu_optimizer_time_s(bare.request)
    moved, before = host_transfer_bytes(run.request), host_transfer_bytes(bare.request)
    bf16 = 2
    assert before[Phase.backward] - moved[Phase.backward] == on_gpu * 4
    assert before[Phase.step] - moved[Phase.step] == on_gpu * bf16
    assert moved[Phase.forward] == before[Phase.forward]


def test_parameter_offload_sends_the_gpu_masters_down(tmp_path: Path) -> None:
    """Under offload_param the model-dtype partition lives on the host: a GPU sub-group's updated
    fp32 master goes down at the step (stage3.py:2857) instead of nothing."""
    run, _ = planned(tmp_path, offload_config(0.5, param=True))
    bare, _ = planned(tmp_path, offload_config(None, param=True))
    assert run.request.strategy.kind is StrategyKind.zero3_param_offload
    on_gpu = sum(sub_group_partition_elements(run.request)[:4])
    assert host_transfer_bytes(run.request)[Phase.step] - host_transfer_bytes(bare.request)[Phase.step] == on_gpu * 4


def test_one_sub_group_offloads_everything(tmp_path: Path) -> None:
    """With DeepSpeed's sub_group_size (1e9) gpt2's partition is one sub-group: int((1 - 0.3) x 1)
    = 0, so a ratio below 1 still offloads everything, as DeepSpeed does."""
    run, plan = planned(tmp_path, offload_config(0.3, sub_group_size=10**9))
    bare, bare_plan = planned(tmp_path, offload_config(None, sub_group_size=10**9))
    assert run.request.strategy.offload_optimizer_ratio == 0.3
    assert len(sub_group_partition_elements(run.request)) == 1
    assert partial.device_partition_elements(run.request) == 0
    assert plan.memory == bare_plan.memory and plan.time == bare_plan.time


def test_emit_writes_the_ratio_and_plans_it_again(tmp_path: Path) -> None:
    run, _ = planned(tmp_path, offload_config(0.5))
    emitted = deepspeed_config(run.request)
    assert emitted["zero_optimization"]["offload_optimizer"]["ratio"] == 0.5
    again, plan_again = planned(tmp_path, emitted)
    assert again.request.strategy.offload_optimizer_ratio == 0.5
    assert partial.device_sub_group_elements(again.request) == partial.device_sub_group_elements(run.request) != []
    # The emitted file, read and written again, plans the same (the first file left overlap_comm
    # at DeepSpeed's default; --emit writes what it planned).
    third, plan_third = planned(tmp_path, deepspeed_config(again.request))
    assert third.request.strategy == again.request.strategy
    assert plan_third.memory == plan_again.memory and plan_third.time == plan_again.time
    bare, _ = planned(tmp_path, offload_config(None))
    assert "ratio" not in deepspeed_config(bare.request)["zero_optimization"]["offload_optimizer"]


@pytest.mark.parametrize("config, flags, field, words", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, (),
     "offload_optimizer.ratio", "DeepSpeed asserts stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "ratio": 0.5}}}, (),
     "offload_optimizer.ratio", "offload_optimizer.device cpu"),
    (offload_config(0), (), "offload_optimizer.ratio", "greater than 0, at most 1"),
    (offload_config(1.5), (), "offload_optimizer.ratio", "greater than 0, at most 1"),
    (offload_config("0.5"), (), "offload_optimizer.ratio", "greater than 0, at most 1"),
    (offload_config(0.5), ("--optimizer", "lion"), "offload_optimizer_ratio", "allowed: adam, adamw"),
])
def test_refusals_are_one_line(tmp_path: Path, capsys, config, flags, field, words) -> None:
    code = main(["fit", *GPT2, *flags, "--deepspeed-config", written(tmp_path, config)])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1 and "Traceback" not in error, error
    assert field in error and words in error, error


@pytest.mark.parametrize("update, words", [
    ({"kind": StrategyKind.zero3, "offload_optimizer_ratio": 0.5}, "allowed: zero3-offload, zero3-param-offload"),
    ({"kind": StrategyKind.zero2_offload, "offload_optimizer_ratio": 0.5}, "allowed: zero3-offload"),
    ({"kind": StrategyKind.zero3_offload, "offload_optimizer_ratio": 0.0}, "greater than 0, at most 1"),
])
def test_the_spec_field_refuses_in_one_line(update: dict, words: str) -> None:
    with pytest.raises(ZeroplanError) as error:
        StrategySpec(**update)
    assert "strategy.offload_optimizer_ratio" in str(error.value) and words in str(error.value)
    assert "\n" not in str(error.value)


def test_a_ratio_copied_to_another_strategy_is_not_read(tmp_path: Path) -> None:
    """A spec copied to another kind without its validation (model_copy, as the plan search copies
    a layout's knobs) that carries a ratio to zero3-nvme, zero2-offload or zero3 plans those as
    they are planned without it."""
    run, _ = planned(tmp_path, offload_config(0.5))
    for kind in (StrategyKind.zero3_nvme, StrategyKind.zero2_offload, StrategyKind.zero3):
        carried = run.request.model_copy(update={"strategy": run.request.strategy.model_copy(update={"kind": kind})})
        bare = run.request.with_strategy(run.request.strategy.model_copy(update={"kind": kind,
                                                                              "offload_optimizer_ratio": None}))
        assert partial.device_partition_elements(carried) == 0
        assert model_state_bytes(carried) == model_state_bytes(bare)
        assert cpu_optimizer_time_s(carried) == cpu_optimizer_time_s(bare)


def test_the_flag_plans_what_the_file_plans(tmp_path: Path) -> None:
    """--offload-ratio sets the same field as the file's key: Llama-3.1-70B on 8 GPUs holds 8.8B
    partition elements a rank, 9 sub-groups of DeepSpeed's 1e9, of which ratio 0.5 keeps int(4.5)
    = 4 on the GPU; the model states are the file's."""
    flags = ("llama-3.1-70b", "--gpus", "8", "--gpu", "h100-80gb", "--precision", "bf16-mixed", "--flat-reserve")
    by_flag, _ = planned_from_fit_flags([*flags, "--strategies", "zero3-offload", "--offload-ratio", "0.5"], "zeroplan fit")
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
              "bf16": {"enabled": True}}
    by_file, _ = planned_from_fit_flags([*flags, "--deepspeed-config", written(tmp_path, config)], "zeroplan fit")
    assert by_flag.request.strategy.offload_optimizer_ratio == 0.5
    assert len(sub_group_partition_elements(by_flag.request)) == 9
    assert len(partial.device_sub_group_elements(by_flag.request)) == 4
    assert model_state_bytes(by_flag.request) == model_state_bytes(by_file.request)
    assert emitted_ratio(by_flag.request) == 0.5


def emitted_ratio(request) -> float | None:
    return deepspeed_config(request)["zero_optimization"]["offload_optimizer"].get("ratio")


@pytest.mark.parametrize("flags, words", [
    (("--offload-ratio", "0.5"), "allowed: --strategies naming only those"),
    (("--strategies", "zero3-offload,zero3", "--offload-ratio", "0.5"), "applies to zero3-offload,zero3-param-offload"),
    (("--strategies", "zero3-offload", "--offload-ratio", "1.5"), "above 0, at most 1"),
])
def test_the_flag_refuses_in_one_line(capsys, flags, words) -> None:
    try:
        code = main(["fit", *GPT2, *flags])
    except SystemExit as exit_:  # argparse's own refusal of the value
        code = exit_.code
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--offload-ratio" in error and words in error, error


def test_the_flag_and_a_file_do_not_both_set_it(tmp_path: Path, capsys) -> None:
    assert main(["fit", *GPT2, "--strategies", "zero3-offload", "--offload-ratio", "0.5",
                 "--deepspeed-config", written(tmp_path, offload_config(0.5))]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "give one" in error, error


@pytest.mark.parametrize("optimizer", ["adafactor", "adam-8bit"])
def test_an_optimizer_without_fixed_bytes_an_element_plans_the_offloads(capsys, optimizer) -> None:
    """Without a ratio no element stays on the GPU, so the GPU sub-groups' AdamW bytes (the
    backup AdamW's, stage3.py:313-325, whatever the run's optimizer) are never asked of an
    optimizer with no fixed bytes an element: adafactor's factored moments and bitsandbytes'
    blockwise 8-bit states under zero3-offload raised a KeyError (a traceback for every
    `zeroplan fit --optimizer adafactor` that plans the offloads). bitsandbytes' 8-bit Adam is
    now refused in one line before that (DeepSpeed's engine refuses it under the offload:
    specs.request.check_offloaded_optimizer)."""
    code = main(["fit", *GPT2, "--optimizer", optimizer, "--strategies", "zero3-offload,zero3-param-offload"])
    captured = capsys.readouterr()
    if optimizer == "adam-8bit":
        assert code == 2 and captured.err.count("\n") == 1 and "adam-8bit under zero3-offload" in captured.err
        return
    assert code == 0
    assert "zero3-param-offload" in captured.out
