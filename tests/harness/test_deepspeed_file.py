"""From plan to running job: ``zeroplan fit --emit`` writes a deepspeed.json, ``zeroplan measure
--engine deepspeed --deepspeed-config`` runs DeepSpeed with it (torchrun, gloo, CPU), and
``zeroplan validate`` compares the records with the planner. The refusals of a file the run
cannot take are checked without launching anything."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from zeroplan.cli.main import main as zeroplan_main
from zeroplan.harness.deepspeed_file import check_deepspeed_file, merge_deepspeed_file
from zeroplan.harness.presets import HARNESS_PRESETS, llama_config_json
from zeroplan.harness.record import read_record
from zeroplan.validate.compare import compare_record

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation 'deepspeed==0.19.8')",
)

MODEL = "micro-llama"
MICRO_BATCH, SEQ_LEN = 2, 16


def hf_config(tmp_path: Path) -> Path:
    """micro-llama as a Hugging Face config.json (the planner takes one; the harness presets are
    the measure command's names): the same ModelSpec, name included (the file's stem)."""
    spec = HARNESS_PRESETS[MODEL]
    path = tmp_path / f"{MODEL}.json"
    path.write_text(json.dumps(llama_config_json(spec)), encoding="utf-8")
    return path


def test_the_config_file_is_the_harness_preset(tmp_path) -> None:
    from zeroplan.presets.models import get_model

    assert get_model(str(hf_config(tmp_path))) == HARNESS_PRESETS[MODEL]


def _emitted(tmp_path: Path, strategy: str, file_name: str, *flags: str) -> Path:
    """fit --strategies STRATEGY --emit, on the preset's config.json: the emitted ``file_name``."""
    folder = tmp_path / f"emitted-{strategy}"
    code = zeroplan_main(["fit", str(hf_config(tmp_path)), "--gpus", "2", "--gpu", "a100-80gb", "--strategies",
                          strategy, "--micro-batch", str(MICRO_BATCH), "--seq-len", str(SEQ_LEN), *flags,
                          "--emit", str(folder)])
    assert code == 0
    return folder / file_name


def _measure_with(engine: str, config_flag: str, strategy: str, config: Path, out: Path, *flags: str) -> list[str]:
    """zeroplan measure's arguments for a run that takes an emitted file through ``config_flag``."""
    return ["measure", MODEL, "--strategy", strategy, "--engine", engine, "--nproc", "2", "--backend", "gloo",
            "--steps", "2", "--micro-batch", str(MICRO_BATCH), "--seq-len", str(SEQ_LEN),
            config_flag, str(config), "--out", str(out), *flags]


def emit(tmp_path: Path, strategy: str, *flags: str) -> Path:
    return _emitted(tmp_path, strategy, "deepspeed.json", *flags)


def measure_argv(strategy: str, config: Path, out: Path, *flags: str) -> list[str]:
    return _measure_with("deepspeed", "--deepspeed-config", strategy, config, out, *flags)


@pytest.mark.slow  # launches torchrun
@needs_deepspeed
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_emitted_deepspeed_config_runs_and_validates(tmp_path, strategy, capsys) -> None:
    """The emitted file's run agrees with the planner as the harness's own DeepSpeed runs do
    (tests/harness/test_deepspeed.py): parameters to the byte; gradients to the byte at stage 2
    (stage 3 also keeps its reduce bucket and gradient partition buffer, which the planner counts
    as buffers); optimizer states up to the step counters (DeepSpeed: one for its flat
    partition; the planner: one per unit)."""
    config = emit(tmp_path, strategy, "--precision", "fp32")
    capsys.readouterr()
    out = tmp_path / "out"
    assert zeroplan_main(measure_argv(strategy, config, out, "--precision", "fp32")) == 0, capsys.readouterr().err
    assert zeroplan_main(["validate", str(out)]) == 0
    units = 2 + HARNESS_PRESETS[MODEL].num_layers
    from zeroplan.harness.model import build_model

    numels = [p.numel() for p in build_model(HARNESS_PRESETS[MODEL]).parameters()]
    psi, partition = sum(numels), sum(numels) // 2
    for path in sorted(out.glob("rank*.json")):
        record = read_record(path)
        notes = " ".join(record.description.notes)
        assert "from the DeepSpeed config file:" in notes and "zero_optimization.stage" in notes
        assert "kept the harness's" in notes and "torch_adam" in notes
        rows = {row.quantity: row for row in compare_record(record)}
        assert rows["parameters"].measured_bytes == rows["parameters"].predicted_bytes
        if strategy == "zero2":
            assert rows["gradients"].measured_bytes == rows["gradients"].predicted_bytes
        else:
            assert "zero_optimization.stage3_prefetch_bucket_size" in notes
            # The reduce bucket and gradient partition buffer are buffers on both sides.
            assert rows["gradients"].measured_bytes == rows["gradients"].predicted_bytes == 4 * partition
            assert rows["buffers (kept)"].measured_bytes == rows["buffers (kept)"].predicted_bytes == 4 * (psi + partition)
            # DeepSpeed's prefetch keeps the forward's last modules gathered for their backward,
            # as many as stage3_max_live_parameters holds (zeroplan.core.deepspeed_coordinator): the
            # record carries the file's settings and the planner's gathers equal the run's.
            live = json.loads(config.read_text())["zero_optimization"]["stage3_max_live_parameters"]
            assert record.description.deepspeed_stage3.max_live_parameters == live
            gathered = rows["all_gather bytes/step"]
            assert gathered.measured_bytes == gathered.predicted_bytes
            assert 0 < 2 * 4 * psi - gathered.measured_bytes <= 4 * live
        assert rows["optimizer states"].predicted_bytes - rows["optimizer states"].measured_bytes == 4 * (units - 1)


# ---------------------------------------------------------------------------- refusals, no launch

def refusal(capsys, argv: list[str]) -> str:
    assert zeroplan_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@needs_deepspeed
def test_emitted_bf16_file_is_refused_under_fp32(tmp_path, capsys) -> None:
    config = emit(tmp_path, "zero2")  # fit's default precision: bf16-mixed
    capsys.readouterr()
    err = refusal(capsys, measure_argv("zero2", config, tmp_path / "out", "--precision", "fp32"))
    assert "--deepspeed-config: bf16.enabled: true contradicts --precision fp32" in err
    assert not (tmp_path / "out").exists()


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


BASE = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2}}


@needs_deepspeed
@pytest.mark.parametrize("change,flags,key", [
    ({"zero_optimization": {"stage": 3}}, (), "zero_optimization.stage: 3 contradicts --strategy's ZeRO stage 2"),
    ({"train_micro_batch_size_per_gpu": 4}, (), "train_micro_batch_size_per_gpu: 4 contradicts --micro-batch 2"),
    ({"gradient_accumulation_steps": 2}, (), "gradient_accumulation_steps: 2 contradicts --grad-accum 1"),
    ({"train_batch_size": 3}, (), "train_batch_size: 3 is not"),
    ({"bf16": {"enabled": False}}, ("--precision", "bf16-mixed"), "bf16.enabled: false contradicts --precision bf16-mixed"),
    ({"fp16": {"enabled": True}}, (), "fp16.enabled: true"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": True}}, (), "zero_optimization.overlap_comm: true"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, (),
     "zero_optimization.offload_optimizer.device: 'nvme'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}, (),
     "zero_optimization.offload_optimizer.pin_memory"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, (),
     "zero_optimization.offload_optimizer: offloads the optimizer but --strategy does not"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, (), "zero_optimization.offload_param"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, (), "zero_optimization.zero_quantized_weights"),
    ({"scheduler": {"type": "WarmupLR"}}, (), "scheduler: the harness does not take this key"),
    ({"optimizer": {"type": "Lamb"}}, (), "optimizer.type: 'Lamb' contradicts --optimizer adamw"),
])
def test_contradicting_or_unrunnable_settings_are_refused_naming_the_key(tmp_path, capsys, change, flags, key) -> None:
    path = _write(tmp_path, {**BASE, **change})
    err = refusal(capsys, measure_argv("zero2", path, tmp_path / "out", *flags))
    assert f"--deepspeed-config: {key}" in err
    assert not (tmp_path / "out").exists()


def test_a_file_for_another_engine_is_refused(tmp_path, capsys) -> None:
    path = _write(tmp_path, BASE)
    err = refusal(capsys, ["measure", MODEL, "--strategy", "zero2", "--engine", "zeroplan", "--deepspeed-config",
                           str(path), "--out", str(tmp_path / "out")])
    assert "--deepspeed-config: configures DeepSpeed, not --engine zeroplan" in err


def test_a_missing_or_broken_file_is_one_line(tmp_path, capsys) -> None:
    err = refusal(capsys, measure_argv("zero2", tmp_path / "none.json", tmp_path / "out"))
    assert "--deepspeed-config: cannot read" in err
    broken = tmp_path / "broken.json"
    broken.write_text("{", encoding="utf-8")
    err = refusal(capsys, measure_argv("zero2", broken, tmp_path / "out"))
    assert "is not JSON" in err


def test_file_settings_replace_the_harness_and_the_rest_are_kept() -> None:
    harness = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "foreach": False}},
               "bf16": {"enabled": False},
               "zero_optimization": {"stage": 3, "reduce_bucket_size": 100, "stage3_prefetch_bucket_size": 0,
                                     "sub_group_size": 10**9}}
    file = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False},
            "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 50, "stage3_prefetch_bucket_size": 7}}
    check_deepspeed_file(file, 3, False, 2, 1, False, 2)
    merged, notes = merge_deepspeed_file(harness, file)
    assert merged["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 50, "stage3_prefetch_bucket_size": 7,
                                           "sub_group_size": 10**9}
    assert merged["optimizer"]["params"] == {"lr": 5e-4, "torch_adam": True, "foreach": False}
    assert "zero_optimization.reduce_bucket_size" in notes[0] and "optimizer.params.lr" in notes[0]
    assert "zero_optimization.sub_group_size 1000000000" in notes[1] and "gradient_clipping 0.0" in notes[1]
    assert harness["zero_optimization"]["reduce_bucket_size"] == 100  # not changed in place


# ---------------------------------------------------------------------------- accelerate FSDP2

def emit_accelerate(tmp_path: Path, strategy: str, *flags: str) -> Path:
    return _emitted(tmp_path, strategy, "accelerate.yaml", *flags)


def accelerate_argv(strategy: str, config: Path, out: Path, *flags: str) -> list[str]:
    return _measure_with("torch", "--accelerate-config", strategy, config, out, *flags)


def _assert_fsdp2_run_equals_the_plan(out: Path, noted) -> None:
    """Every rank's record validates, carries what its file set (``noted`` of its notes), and
    its model states and collective bytes equal the planner's, except the optimizer states of a
    rank that owns fewer rows than the padded shard (at most the planner's)."""
    assert zeroplan_main(["validate", str(out)]) == 0
    for path in sorted(out.glob("rank*.json")):
        record = read_record(path)
        assert noted(" ".join(record.description.notes)), path.name
        rows = [row for row in compare_record(record) if row.category == "communication"
                or row.quantity in ("parameters", "gradients", "optimizer states")]
        assert len(rows) >= 4
        for row in rows:
            if record.rank > 0 and row.quantity == "optimizer states":
                assert 0 < row.measured_bytes <= row.predicted_bytes
            else:
                assert row.measured_bytes == row.predicted_bytes, (path.name, row.quantity)


@pytest.mark.slow  # launches torchrun
def test_emitted_accelerate_config_runs_fsdp2_and_validates(tmp_path, capsys) -> None:
    """As tests/harness/test_accumulation.py expects of FSDP2: model states and collective bytes
    equal the planner's, except the optimizer states of a rank that owns fewer rows than the
    padded shard (FSDP2 allocates them like the unpadded local shard)."""
    config = emit_accelerate(tmp_path, "fsdp-full-shard", "--precision", "fp32")
    capsys.readouterr()
    out = tmp_path / "out"
    assert zeroplan_main(accelerate_argv("fsdp-full-shard", config, out, "--precision", "fp32")) == 0, \
        capsys.readouterr().err
    _assert_fsdp2_run_equals_the_plan(out, lambda notes: "fsdp_reshard_after_forward true" in notes and "use_cpu" in notes)


def test_emitted_accelerate_config_is_checked_against_the_flags(tmp_path, capsys) -> None:
    config = emit_accelerate(tmp_path, "fsdp-shard-grad-op")  # fit's default precision: bf16-mixed
    capsys.readouterr()
    err = refusal(capsys, accelerate_argv("fsdp-shard-grad-op", config, tmp_path / "out", "--precision", "fp32"))
    assert "--accelerate-config: mixed_precision: 'bf16' contradicts --precision fp32" in err
    err = refusal(capsys, accelerate_argv("fsdp-full-shard", config, tmp_path / "out", "--precision", "bf16-mixed"))
    assert "--accelerate-config: fsdp_config.fsdp_reshard_after_forward: false contradicts --strategy fsdp-full-shard" in err
    err = refusal(capsys, accelerate_argv("fsdp-shard-grad-op", config, tmp_path / "out", "--precision", "bf16-mixed",
                                          "--activation-checkpointing", "full"))
    assert "fsdp_config.fsdp_activation_checkpointing: false contradicts --activation-checkpointing full" in err
    text = config.read_text(encoding="utf-8")
    for old, new, key in (("fsdp_offload_params: false", "fsdp_offload_params: true", "fsdp_config.fsdp_offload_params"),
                          ("num_processes: 2", "num_processes: 4", "num_processes: 4 contradicts the run's 2 ranks"),
                          ('"TRANSFORMER_BASED_WRAP"', '"SIZE_BASED_WRAP"', "fsdp_config.fsdp_auto_wrap_policy"),
                          ("fsdp_version: 2", "fsdp_version: 1", "fsdp_config.fsdp_version")):
        changed = tmp_path / "changed.yaml"
        changed.write_text(text.replace(old, new), encoding="utf-8")
        err = refusal(capsys, accelerate_argv("fsdp-shard-grad-op", changed, tmp_path / "out", "--precision", "bf16-mixed"))
        assert f"--accelerate-config: {key}" in err
    err = refusal(capsys, accelerate_argv("fsdp-shard-grad-op", config, tmp_path / "out", "--engine", "torch-fsdp1"))
    assert "--accelerate-config: configures accelerate's FSDP2, not --engine torch-fsdp1" in err
    assert not (tmp_path / "out").exists()


def test_the_yaml_subset_reads_the_emitted_file_and_refuses_lists(tmp_path) -> None:
    from zeroplan.errors import ZeroplanError
    from zeroplan.harness.accelerate_file import parse_yaml_subset

    assert parse_yaml_subset('a: "x"\nb:\n  c: 1\n  d: true\ne: no  # comment\n') == \
        {"a": "x", "b": {"c": 1, "d": True}, "e": "no"}
    with pytest.raises(ZeroplanError, match="line 2"):
        parse_yaml_subset("a:\n  - 1\n")


# ---------------------------------------------------------------------------- torchtitan overrides

def emit_torchtitan(tmp_path: Path, strategy: str, *flags: str) -> Path:
    return _emitted(tmp_path, strategy, "torchtitan-overrides.txt", "--framework", "torchtitan", *flags)


def torchtitan_argv(strategy: str, config: Path, out: Path, *flags: str) -> list[str]:
    return _measure_with("torch", "--torchtitan-config", strategy, config, out, *flags)


@pytest.mark.slow  # launches torchrun
def test_emitted_torchtitan_overrides_run_fsdp2_and_validate(tmp_path, capsys) -> None:
    """torchtitan's data_parallel_shard_degree 2 is FSDP2 over both ranks (parallelize_llama:
    fully_shard per block, then the root), as the accelerate file's run: model states and
    collective bytes equal the planner's, except the optimizer states of a rank that owns fewer
    rows than the padded shard (tests/harness/test_accumulation.py)."""
    config = emit_torchtitan(tmp_path, "fsdp-full-shard", "--precision", "fp32")
    capsys.readouterr()
    out = tmp_path / "out"
    assert zeroplan_main(torchtitan_argv("fsdp-full-shard", config, out, "--precision", "fp32")) == 0, \
        capsys.readouterr().err
    _assert_fsdp2_run_equals_the_plan(out, lambda notes: "from the torchtitan overrides: data parallel replicate 1 x shard 2" in notes)


SHARD_GRAD_OP_OVERRIDES = """--parallelism.data_parallel_replicate_degree 1
--parallelism.data_parallel_shard_degree 2
--parallelism.fsdp_reshard_after_forward never
--parallelism.tensor_parallel_degree 1
--parallelism.context_parallel_degree 1
--parallelism.pipeline_parallel_degree 1
--training.local_batch_size 2
--training.global_batch_size 4
--training.seq_len 16
--training.dtype float32
--training.mixed_precision_param bfloat16
--training.no-enable_cpu_offload
--compile.no-enable
--compile.no-enable_async_tensor_parallel
activation_checkpoint:none
"""
"""What fit --emit writes for micro-llama, fsdp-shard-grad-op, 2 GPUs, micro-batch 2, sequence 16,
bf16-mixed (the slow test above emits its own)."""


def _check_overrides(text: str, **flags) -> list[str]:
    from zeroplan.harness.torchtitan_file import check_torchtitan_file, parse_overrides

    run = dict(strategy="fsdp-shard-grad-op", precision="bf16-mixed", activation_checkpointing="none", micro_batch=2,
               grad_accum=1, seq_len=16, tp=1, pp=1, sequence_parallel=False, world_size=2)
    return check_torchtitan_file(parse_overrides(text), **{**run, **flags})


@pytest.mark.parametrize("old, new, flags, words", [
    ("", "", {"precision": "fp32"}, "--training.mixed_precision_param: bfloat16 contradicts --precision fp32"),
    ("", "", {"strategy": "fsdp-full-shard"}, "--parallelism.data_parallel_shard_degree: replicate 1, shard 2, reshard "
                                              "never runs fsdp-shard-grad-op, not --strategy fsdp-full-shard"),
    ("", "", {"activation_checkpointing": "full"}, "activation_checkpoint:none: contradicts --activation-checkpointing full"),
    ("", "", {"world_size": 4}, "replicate 1 x shard 2 x tp 1 x pp 1 is not the run's 4 ranks"),
    ("--training.no-enable_cpu_offload", "--training.enable_cpu_offload", {}, "--training.enable_cpu_offload: offloads"),
    ("--compile.no-enable", "--compile.enable", {}, "--compile.enable: the harness measures the eager step"),
    ("--compile.no-enable_async_tensor_parallel", "--compile.enable_async_tensor_parallel", {},
     "--compile.enable_async_tensor_parallel: is a pass of the compiled step"),
    ("--training.local_batch_size 2", "--training.local_batch_size 4", {}, "--training.local_batch_size: 4 contradicts"),
    ("--training.global_batch_size 4", "--training.global_batch_size 8", {}, "--training.global_batch_size: 8 is not"),
    ("--training.seq_len 16", "--training.seq_len 32", {}, "--training.seq_len: 32 contradicts --seq-len 16"),
    ("--parallelism.context_parallel_degree 1", "--parallelism.context_parallel_degree 2", {},
     "--parallelism.context_parallel_degree: 2: the harness has no context"),
    ("--parallelism.tensor_parallel_degree 1", "--parallelism.tensor_parallel_degree 2", {},
     "--parallelism.tensor_parallel_degree: 2 contradicts --tp 1"),
    ("activation_checkpoint:none", "activation_checkpoint:selective", {}, "activation_checkpoint:selective: the harness"),
    ("--compile.no-enable", "--compile.no-enable --float8.enable_fsdp_float8_all_gather", {},
     "--float8.enable_fsdp_float8_all_gather: the harness does not take this option"),
])
def test_torchtitan_overrides_are_refused_naming_the_option(old, new, flags, words) -> None:
    from zeroplan.errors import ZeroplanError

    with pytest.raises(ZeroplanError, match=None) as caught:
        _check_overrides(SHARD_GRAD_OP_OVERRIDES.replace(old, new) if old else SHARD_GRAD_OP_OVERRIDES, **flags)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_torchtitan_overrides_that_agree_are_taken_and_noted() -> None:
    notes = _check_overrides(SHARD_GRAD_OP_OVERRIDES + "--module llama3 --config llama3_debugmodel\n")
    assert notes[0].startswith("from the torchtitan overrides: data parallel replicate 1 x shard 2 "
                               "(reshard_after_forward never): fsdp-shard-grad-op")
    assert notes[1].endswith("--module, --config")
    assert _check_overrides(SHARD_GRAD_OP_OVERRIDES.replace("shard_degree 2", "shard_degree -1"))


def test_a_torchtitan_file_for_another_engine_is_refused_in_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "overrides.txt"
    path.write_text(SHARD_GRAD_OP_OVERRIDES, encoding="utf-8")
    err = refusal(capsys, torchtitan_argv("fsdp-shard-grad-op", path, tmp_path / "out", "--engine", "torch-fsdp1"))
    assert "--torchtitan-config: runs torchtitan's FSDP2, DDP, TP and PP (the torch engine), not --engine torch-fsdp1" in err
    assert not (tmp_path / "out").exists()


def test_torchtitan_overrides_parse_as_tyro_takes_them() -> None:
    from zeroplan.harness.torchtitan_file import parse_overrides

    assert parse_overrides("--a.b 2 --a.no-c --d.e\nactivation_checkpoint:full --f.g=x") == \
        {"a.b": "2", "a.c": False, "d.e": True, "activation_checkpoint": "full", "f.g": "x"}
