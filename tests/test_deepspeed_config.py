"""fit/compare --deepspeed-config: a DeepSpeed config file read as the planner's inputs. Its
defaults are DeepSpeed's own (read back by DeepSpeed's config parser where it is importable), a
file --emit wrote plans exactly what was planned, the knobs it sets change the plan as they
change the run, and every key it cannot plan is refused in one line naming the key."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from zeroplan.cli.emit import planned_from_fit_flags
from zeroplan.cli.main import main
from zeroplan.core import deepspeed_coordinator as coordinator
from zeroplan.emit.formats import deepspeed_config
from zeroplan.errors import ZeroplanError
from zeroplan.specs.deepspeed_config import DEEPSPEED_ZERO_DEFAULTS, deepspeed_config_of
from zeroplan.specs.strategy import StrategyKind

BASE = ("llama-3.1-8b", "--gpus", "16", "--gpu", "h100-80gb", "--micro-batch", "2", "--grad-accum", "4",
        "--flat-reserve")


def planned(*flags: str):
    return planned_from_fit_flags(list(flags), "zeroplan fit")


def written(tmp_path: Path, config: dict, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


HF_STRATEGIES = ("zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "zero3-param-offload")
ZEROPLAN_ONLY = ("zero3-nvme", "zero3-param-nvme", "zero3-hpz", "zero3-zeropp")


@pytest.mark.parametrize("framework, strategy", [("zeroplan", s) for s in HF_STRATEGIES + ZEROPLAN_ONLY]
                         + [("hf", s) for s in HF_STRATEGIES])
def test_an_emitted_file_plans_what_was_planned(tmp_path: Path, strategy: str, framework: str) -> None:
    """Plan, write the DeepSpeed config --emit writes, plan again from that file: the same
    strategy, the same knobs, the same bytes."""
    flags = (*BASE, "--framework", framework)
    run, plan = planned(*flags, "--strategies", strategy)
    path = written(tmp_path, deepspeed_config(run.request))
    again, plan_again = planned(*flags, "--deepspeed-config", path)
    assert again.request.strategy.kind is StrategyKind(strategy)
    for knob in (coordinator.prefetch_bucket_elements, coordinator.max_live_parameters,
                 coordinator.max_reuse_distance, coordinator.persistence_threshold):
        assert knob(again.request) == knob(run.request), knob.__name__
    assert plan_again.memory == plan.memory
    assert plan_again.time == plan.time


def test_keys_left_out_take_deepspeeds_defaults_not_emits(tmp_path: Path) -> None:
    """A stage-3 file with nothing else is DeepSpeed's engine at its defaults: parameters kept
    gathered up to max_live_parameters 1e9 and reused within 1e9 elements, which the planner's
    emitted bounds would not keep."""
    run, plan = planned(*BASE, "--strategies", "zero3")
    bare, bare_plan = planned(*BASE, "--deepspeed-config", written(tmp_path, {"zero_optimization": {"stage": 3}}))
    request = bare.request
    assert (coordinator.prefetch_bucket_elements(request), coordinator.persistence_threshold(request),
            coordinator.max_live_parameters(request), coordinator.max_reuse_distance(request)) == (
        5 * 10**7, 10**5, 10**9, 10**9)
    assert request.strategy.zero_bucket_elements == 5 * 10**8
    assert bare_plan.memory.allocated_peak_bytes > plan.memory.allocated_peak_bytes


def test_the_defaults_are_deepspeeds_own(tmp_path: Path) -> None:
    """DeepSpeed's own config parser reads the same defaults from a file that leaves them out."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    zero = DeepSpeedConfig(written(tmp_path, config)).zero_config
    theirs = {"reduce_bucket_size": zero.reduce_bucket_size, "sub_group_size": zero.sub_group_size,
              "stage3_prefetch_bucket_size": zero.prefetch_bucket_size,
              "stage3_param_persistence_threshold": zero.param_persistence_threshold,
              "stage3_max_live_parameters": zero.max_live_parameters,
              "stage3_max_reuse_distance": zero.max_reuse_distance}
    assert theirs == DEEPSPEED_ZERO_DEFAULTS
    ours = deepspeed_config_of(config, hf_auto=False)
    assert (ours.contiguous_gradients, ours.overlap_comm) == (zero.contiguous_gradients, None)
    assert zero.overlap_comm is True  # None resolves to stage 3's true, as zeroplan.core.deepspeed_accumulation does


def test_the_offload_ratio_is_read_at_stage_3() -> None:
    """offload_optimizer.ratio (ZeRO-Offload++'s Twin-Flow) becomes StrategySpec.offload_optimizer_ratio;
    1.0, DeepSpeed's default, is no ratio."""
    def read(ratio: float, param: str = "none"):
        zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}, "offload_param": {"device": param}}
        return deepspeed_config_of({"zero_optimization": zero}, hf_auto=False)

    assert read(0.25).offload_optimizer_ratio == 0.25
    assert read(0.25).strategy_updates()["offload_optimizer_ratio"] == 0.25
    assert read(0.5, "cpu").kind is StrategyKind.zero3_param_offload
    assert read(1.0).offload_optimizer_ratio is None and "offload_optimizer_ratio" not in read(1.0).strategy_updates()


def test_deepspeeds_parser_takes_the_ratio_at_stage_3_only(tmp_path: Path) -> None:
    """DeepSpeed's own config reads the ratio at stage 3 and asserts below stage 3
    (runtime/zero/config.py offload_ratio_check); the reader agrees on both."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    for stage in (3, 2):
        config = {"train_micro_batch_size_per_gpu": 1,
                  "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
        if stage == 3:
            assert DeepSpeedConfig(written(tmp_path, config)).zero_config.offload_optimizer.ratio == 0.5
            assert deepspeed_config_of(config, hf_auto=False).offload_optimizer_ratio == 0.5
            continue
        with pytest.raises(Exception, match="Partial offloading only supported for ZeRO Stage 3"):
            DeepSpeedConfig(written(tmp_path, config))
        with pytest.raises(ZeroplanError, match="offload_optimizer.ratio"):
            deepspeed_config_of(config, hf_auto=False)


def test_an_explicit_zero_is_kept_under_hf(tmp_path: Path) -> None:
    """Under hf the unset stage-3 knobs are DeepSpeed's defaults; a file's explicit 0 stays 0."""
    config = {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}}
    run, _ = planned(*BASE, "--framework", "hf", "--deepspeed-config", written(tmp_path, config))
    assert coordinator.max_reuse_distance(run.request) == 0 == coordinator.persistence_threshold(run.request)


def test_hf_auto_entries_are_filled_as_the_trainer_fills_them(tmp_path: Path) -> None:
    config = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}
    run, _ = planned(*BASE, "--framework", "hf", "--deepspeed-config", written(tmp_path, config))
    hidden = run.request.model.hidden_size
    strategy = run.request.strategy
    assert (strategy.zero_bucket_elements, strategy.deepspeed_prefetch_bucket_elements,
            strategy.deepspeed_param_persistence_threshold) == (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)


def test_a_larger_sub_group_steps_more_at_once(tmp_path: Path) -> None:
    """sub_group_size sets how much of the partition ZeRO-3's step turns into fp32 gradients at
    once: one sub-group of the whole 2 B-element partition holds more than 1e9-element ones."""
    flags = ("llama-2-13b", "--gpus", "4", "--gpu", "h100-80gb", "--seq-len", "256", "--flat-reserve",
             "--state-convention", "deepspeed",
             "--precision", "bf16-mixed")
    bf16 = {"bf16": {"enabled": True}}
    small, small_plan = planned(*flags, "--deepspeed-config", written(tmp_path, {"zero_optimization": {"stage": 3}, **bf16}))
    one, one_plan = planned(*flags, "--deepspeed-config",
                            written(tmp_path, {"zero_optimization": {"stage": 3, "sub_group_size": 10**12}, **bf16}, "one.json"))
    assert one.request.strategy.deepspeed_sub_group_elements == 10**12
    assert one_plan.memory.allocated_peak_bytes > small_plan.memory.allocated_peak_bytes


@pytest.mark.parametrize("config, flags, field, words", [
    ({"zero_optimization": {"stage": 4}}, (), "zero_optimization.stage", "allowed: 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, (),
     "zero_optimization.offload_optimizer", "stage 0 offloads nothing"),
    ({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}}, (),
     "optimizer.params.torch_adam", "FP16_Optimizer"),
    ({"zero_optimization": {"stage": 0}, "optimizer": {"type": "CPUAdam"}}, (), "optimizer.type", "offload_optimizer"),
    ({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, (),
     "data_types.grad_accum_dtype", "leave it out"),
    ({"zero_optimization": {"stage": 0}}, ("--state-convention", "zero"), "--state-convention",
     "give --state-convention deepspeed"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, (), "offload_param",
     "stage 3, optimizer cpu, parameters cpu"),
    ({"zero_optimization": {"stage": 2, "stage3_foo": 1}}, (), "zero_optimization.stage3_foo", "allowed: stage,"),
    ({"zero_optimization": {"stage": 2}, "pipeline": {}}, (), "pipeline", "not a key zeroplan plans"),
    ({"zero_optimization": {"stage": 2, "reduce_scatter": False}}, (), "reduce_scatter", "allowed: true"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, (), "reduce_bucket_size", "--framework hf"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}}, (), "reduce_bucket_size", "whole number"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e30}}, (), "reduce_bucket_size", "to 2^36"),
    ({"zero_optimization": {"stage": "3"}}, (), "zero_optimization.stage", "allowed: 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": "yes"}}, (), "overlap_comm", "true or false"),
    ({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}, ("--grad-accum", "2"), "--grad-accum",
     "give --grad-accum 4"),
    ({"zero_optimization": {"stage": 2}, "torch_autocast": {"enabled": True}}, (), "torch_autocast.enabled",
     "allowed: false"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, ("--precision", "bf16-mixed"), "--precision",
     "give --precision fp16-mixed"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb"}}, (), "optimizer.type", "allowed: Adam"),
    ({"zero_optimization": {"stage": 2}, "train_batch_size": 7, "train_micro_batch_size_per_gpu": 1,
      "gradient_accumulation_steps": 1}, (), "train_batch_size", "= 8"),
    ({"zero_optimization": {"stage": 2}, "train_batch_size": 12, "train_micro_batch_size_per_gpu": 1}, (),
     "train_batch_size", "not a multiple"),
    ({"zero_optimization": {"stage": 2}}, ("--strategies", "zero3"), "--strategies", "allowed: zero2"),
    ({"zero_optimization": {"stage": 2}}, ("--reduce-bucket-size", "1000"), "--reduce-bucket-size", "give one"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "buffer_count": 3}}}, (),
     "buffer_count", "allowed: 4"),
    ({"zero_optimization": {"stage": 3}, "aio": {"block_size": 7}}, (), "aio.block_size", "allowed: 1048576"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, (),
     "zero_optimization.offload_optimizer.ratio", "allowed: 1.0, or stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0}}}, (),
     "zero_optimization.offload_optimizer.ratio", "greater than 0, at most 1"),
    ({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, (),
     "fp16.fp16_master_weights_and_grads", "allowed: false"),
    ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True, "bf16_optimizer_states": True}}, (),
     "bf16.bf16_optimizer_states", "allowed: false"),
    ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True, "fast": 1}}, (), "bf16.fast", "allowed: enabled"),
    ({"zero_optimization": {"stage": 3}, "activation_checkpointing": {"contiguous_memory_optimization": True}}, (),
     "activation_checkpointing.contiguous_memory_optimization", "allowed: false, or with both"),
    ({"zero_optimization": {"stage": 3}, "activation_checkpointing": {"cpu_checkpointing": True}}, (),
     "cpu_checkpointing", "allowed with activation_checkpointing 'full'"),
])
def test_what_cannot_be_planned_is_refused_in_one_line(tmp_path: Path, capsys, config, flags, field, words) -> None:
    path = written(tmp_path, config)
    assert main(["fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--deepspeed-config", path, *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "Traceback" not in error
    assert field in error and words in error, error


def test_an_unreadable_file_is_one_line(tmp_path: Path, capsys) -> None:
    for content in (None, "{not json", "[1, 2]"):
        path = tmp_path / "ds.json"
        if content is not None:
            path.write_text(content)
        assert main(["fit", "gpt2", "--deepspeed-config", str(path)]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "--deepspeed-config" in error, error


def test_the_reader_refuses_qwz_without_hpz() -> None:
    with pytest.raises(ZeroplanError, match="zero_quantized_weights"):
        deepspeed_config_of({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, hf_auto=False)


def test_a_null_block_is_an_unset_one() -> None:
    """DeepSpeed reads "offload_optimizer": null as no offload; so does the reader."""
    config = deepspeed_config_of({"zero_optimization": {"stage": 3, "offload_optimizer": None, "offload_param": None}},
                                 hf_auto=False)
    assert config.kind is StrategyKind.zero3


@pytest.mark.parametrize("config, flags, planned_batch", [
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (), (4, 2)),
    # the script's loader sets the batch: an explicit --micro-batch is planned
    ({"train_micro_batch_size_per_gpu": 4}, ("--micro-batch", "1"), (1, 1)),
    # DeepSpeed derives the accumulation from the other two (8 data-parallel ranks)
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}, (), (2, 4)),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, (), (4, 2)),
    ({}, (), (1, 1)),
])
def test_the_batch_the_file_and_flags_plan(tmp_path: Path, config, flags, planned_batch) -> None:
    path = written(tmp_path, {**config, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    run, _ = planned("llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--flat-reserve", "--deepspeed-config", path,
                     *flags)
    assert (run.request.batch.micro_batch_size, run.request.batch.grad_accum_steps) == planned_batch


def test_a_pipe_is_read_once_and_the_settings_are_printed(tmp_path: Path, capsys) -> None:
    """A file given as a pipe (<(...), /dev/stdin) has its content once; fit prints the ZeRO
    settings planned under its answer, DeepSpeed's defaults for the keys the file leaves out."""
    read, write = os.pipe()
    os.write(write, json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}).encode())
    os.close(write)
    try:
        assert main(["fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--flat-reserve",
                     "--deepspeed-config", f"/dev/fd/{read}"]) == 0
    finally:
        os.close(read)
    out = " ".join(capsys.readouterr().out.split())
    assert "DeepSpeed config /dev/fd/" in out
    assert "zero3, reduce bucket 5e8, overlap_comm on, prefetch 5e7, live parameters 1e9, reuse distance 1e9" in out
    assert "persistence 1e5, sub-group 1e9" in out


def test_calibrate_step_names_its_own_strategy_flag(tmp_path: Path, capsys) -> None:
    path = written(tmp_path, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    assert main(["calibrate", "step", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--strategy", "zero2",
                 "--tokens-per-s-per-gpu", "5000", "--out", str(tmp_path / "eff.json"), "--deepspeed-config", path]) == 2
    assert capsys.readouterr().err.strip().endswith("--strategy: zero2: the --deepspeed-config file runs zero3 (allowed: zero3)")
    assert not (tmp_path / "eff.json").exists()


def test_emit_writes_the_files_of_the_configs_strategy(tmp_path: Path, capsys) -> None:
    """fit --deepspeed-config FILE --emit DIR needs no --strategies: the file names the strategy,
    and the deepspeed.json written carries the stage-3 settings planned from it."""
    path = written(tmp_path, {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0}, "bf16": {"enabled": True}})
    out = tmp_path / "run"
    assert main(["fit", "llama-3.1-8b", "--gpus", "16", "--gpu", "h100-80gb", "--flat-reserve",
                 "--deepspeed-config", path, "--emit", str(out)]) == 0
    zero = json.loads((out / "deepspeed.json").read_text())["zero_optimization"]
    assert zero["stage"] == 3
    assert (zero["stage3_max_reuse_distance"], zero["stage3_max_live_parameters"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (0, 10**9, 5 * 10**7, 10**5)


@pytest.mark.parametrize("config", [{"zero_optimization": {"stage": 0}}, {}, {"zero_optimization": {}},
                                    {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True},
                                     "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}])
def test_stage_0_is_ddp_under_deepspeeds_convention(config) -> None:
    """Stage 0, or no zero_optimization block (DeepSpeed's default stage), is DeepSpeed's
    unpartitioned optimizer: the ddp strategy, no ZeRO knob set."""
    read = deepspeed_config_of(config, hf_auto=False)
    assert read.kind is StrategyKind.ddp and read.strategy_updates() == {}


@pytest.mark.parametrize("framework", ["zeroplan", "hf"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "fp32"])
def test_a_stage_0_file_plans_deepspeeds_stage_0_and_emits_it(tmp_path: Path, framework: str, precision: str) -> None:
    """A stage-0 file plans ddp under DeepSpeed's state convention (not torch's DDP), the file
    --emit writes from that plan is stage 0 again, and it plans the same bytes and time."""
    from zeroplan.core.deepspeed_stage0 import runs_deepspeed_stage0

    config = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": precision == "bf16-mixed"},
              "fp16": {"enabled": precision == "fp16-mixed"}}
    flags = (*BASE, "--framework", framework, "--precision", precision)
    run, plan = planned(*flags, "--deepspeed-config", written(tmp_path, config))
    assert run.request.strategy.kind is StrategyKind.ddp and runs_deepspeed_stage0(run.request)
    emitted = deepspeed_config(run.request)
    assert emitted["zero_optimization"] == {"stage": 0}
    again, plan_again = planned(*flags, "--deepspeed-config", written(tmp_path, emitted, "again.json"))
    assert (plan_again.memory, plan_again.time) == (plan.memory, plan.time)
    torch_ddp, torch_plan = planned(*flags, "--strategies", "ddp")
    assert not runs_deepspeed_stage0(torch_ddp.request)
    assert torch_plan.memory != plan.memory
