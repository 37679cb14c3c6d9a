"""plan/fit --emit: every emitted file is read back by its own library's parser and each planned
setting comes back as planned (DeepSpeed's DeepSpeedConfig, accelerate's ClusterConfig,
torchtitan's ConfigManager over its own config sections, torchtune's recipe argument parser and
YAML merge). A library that is not importable skips its test with the reason."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeroplan.cli.emit import planned_from_fit_flags
from zeroplan.cli.main import main
from zeroplan.emit import emit, render
from zeroplan.emit.formats import NotApplicable, accelerate_config, torchtitan_overrides, torchtune_overrides

ROOT = Path(__file__).resolve().parents[1]


def planned(*flags: str):
    return planned_from_fit_flags(list(flags), "zeroplan fit " + " ".join(flags))[0]


def needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not importable")


# ------------------------------------------------------------------ DeepSpeed

def deepspeed_parsed(path: Path):
    needs("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    # Without a process group DeepSpeed takes world size 1 (config.py: the RuntimeError of
    # dist.get_rank is caught); train_batch_size is not written, so nothing depends on it.
    return DeepSpeedConfig(str(path))


@pytest.mark.parametrize("strategy, precision", [
    ("zero1", "bf16-mixed"), ("zero2", "fp16-mixed"), ("zero3", "bf16-mixed"), ("zero2-offload", "bf16-mixed"),
    ("zero3-param-offload", "fp32"),
])
def test_deepspeed_json_round_trips(tmp_path: Path, strategy: str, precision: str) -> None:
    run = planned("llama-3.1-8b", "--gpus", "16", "--gpu", "h100-80gb", "--framework", "hf", "--strategies", strategy,
                  "--micro-batch", "2", "--grad-accum", "4", "--precision", precision, "--flat-reserve")
    emit(run, tmp_path)
    written = json.loads((tmp_path / "deepspeed.json").read_text())
    config = deepspeed_parsed(tmp_path / "deepspeed.json")
    zero = config.zero_config
    kind = run.request.strategy.kind
    assert int(zero.stage) == kind.zero_stage
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (2, 4)
    assert config.bfloat16_config.enabled is (precision == "bf16-mixed")
    assert config.float16_config.enabled is (precision == "fp16-mixed")
    assert zero.overlap_comm is False and zero.contiguous_gradients and zero.reduce_scatter
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == written["zero_optimization"]["reduce_bucket_size"]
    assert zero.reduce_bucket_size == run.request.strategy.zero_bucket_elements  # 5e8 < an 8B model's elements
    assert (zero.offload_optimizer is not None) is kind.offloads_optimizer
    assert (zero.offload_param is not None) is kind.offloads_parameters
    if kind.offloads_optimizer:
        assert zero.offload_optimizer.device == "cpu"
    if kind.zero_stage == 3:
        # --framework hf plans DeepSpeed's own stage-3 defaults (accelerate writes none), and the
        # file says so: DeepSpeed's parser reads back the values planned.
        assert (zero.prefetch_bucket_size, zero.param_persistence_threshold, zero.max_live_parameters,
                zero.max_reuse_distance) == (5 * 10**7, 10**5, 10**9, 10**9)


def test_deepspeed_json_carries_the_emit_bounds_under_zeroplan(tmp_path: Path) -> None:
    """--framework zeroplan plans (and writes) the stage-3 bounds the buffer model counts."""
    from zeroplan.core.largest_unit import largest_unit_elements

    run = planned("llama-3.1-8b", "--gpus", "16", "--gpu", "h100-80gb", "--strategies", "zero3", "--flat-reserve")
    emit(run, tmp_path)
    zero = deepspeed_parsed(tmp_path / "deepspeed.json").zero_config
    assert zero.prefetch_bucket_size == largest_unit_elements(run.request)
    assert zero.param_persistence_threshold == 0 and zero.max_reuse_distance == 0
    # resident: the unit in use and the prefetched ones, as core/buffers.py gathered_unit_bytes counts
    assert zero.max_live_parameters == (1 + run.request.strategy.prefetch_units) * largest_unit_elements(run.request)


@pytest.mark.parametrize("strategy, hpz", [("zero3-hpz", None), ("zero3-hpz", "4"), ("zero3-zeropp", None)])
def test_deepspeed_json_carries_zeropp_as_planned(tmp_path: Path, strategy: str, hpz: str | None) -> None:
    """ZeRO++: DeepSpeed reads back the secondary partition's group the plan sized (a node of 8
    unless --hpz-partition-size says otherwise) and, for the full recipe, qwZ and qgZ on."""
    flags = ["llama-3.1-8b", "--gpus", "16", "--gpu", "h100-80gb", "--framework", "hf", "--strategies", strategy,
             "--flat-reserve"] + (["--hpz-partition-size", hpz] if hpz else [])
    run = planned(*flags)
    emit(run, tmp_path)
    zero = deepspeed_parsed(tmp_path / "deepspeed.json").zero_config
    assert int(zero.stage) == 3
    assert zero.zero_hpz_partition_size == run.request.hpz_group_size == (int(hpz) if hpz else 8)
    quantized = strategy == "zero3-zeropp"
    assert (zero.zero_quantized_weights, zero.zero_quantized_gradients) == (quantized, quantized)
    assert zero.zero_quantized_nontrainable_weights is False


@pytest.mark.parametrize("strategy, pipeline", [("zero3-nvme", None), ("zero3-param-nvme", "both"),
                                                ("zero3-param-nvme", "read")])
def test_deepspeed_json_carries_nvme_offload_as_planned(tmp_path: Path, strategy: str, pipeline: str | None) -> None:
    """ZeRO-Infinity: DeepSpeed reads back device nvme, the swap path, the aio block and every
    buffer count and size zeroplan.core.nvme planned the pinned host memory with."""
    from zeroplan.core import nvme
    from zeroplan.emit.formats import AIO_CONFIG, NVME_PATH

    flags = ["llama-2-70b", "--gpus", "1", "--gpu", "a100-80gb", "--framework", "hf", "--strategies", strategy,
             "--activation-checkpointing", "full", "--flat-reserve"] + (["--nvme-pipeline", pipeline] if pipeline else [])
    run = planned(*flags)
    emit(run, tmp_path)
    config = deepspeed_parsed(tmp_path / "deepspeed.json")
    zero, request = config.zero_config, run.request
    optimizer = zero.offload_optimizer
    assert optimizer.device == "nvme" and str(optimizer.nvme_path) == NVME_PATH and optimizer.pin_memory
    assert optimizer.buffer_count == nvme.optimizer_swap_buffer_count(request) == (12 if pipeline == "both" else
                                                                                  8 if pipeline else 4)
    assert (optimizer.pipeline_read, optimizer.pipeline_write) == (pipeline in ("read", "both"), pipeline == "both")
    assert zero.sub_group_size == request.strategy.deepspeed_sub_group_elements == 10**9
    assert config.aio_config == AIO_CONFIG
    if strategy == "zero3-param-nvme":
        param = zero.offload_param
        assert param.device == "nvme" and str(param.nvme_path) == NVME_PATH
        # The 32000 x 8192 embedding on one rank: more than DeepSpeed's 1e8-element default holds.
        assert param.buffer_size == nvme.parameter_buffer_elements(request) == 32000 * 8192
        assert (param.buffer_count, param.max_in_cpu) == (nvme.PARAM_BUFFER_COUNT, nvme.PARAM_MAX_IN_CPU)
    else:
        assert zero.offload_param is None
    readme_text = (tmp_path / "README.md").read_text()
    assert f"nvme_path {NVME_PATH}" in readme_text and f"{nvme.nvme_bytes(request) / 1e9:.0f} GB free per node" in readme_text


def test_deepspeed_json_matches_the_measured_harness_config() -> None:
    """The settings the planner's buffer model was measured under (zeroplan/harness/deepspeed_engine.py)
    are the ones emitted, the bucket capped at a small model's elements as the harness caps it."""
    needs("torch")
    import torch

    from zeroplan.harness.deepspeed_engine import deepspeed_config as harness_config

    run = planned("gpt2", "--gpus", "2", "--strategies", "zero3", "--seq-len", "64", "--flat-reserve")
    ours = json.loads(render(run)[0]["deepspeed.json"])
    from zeroplan.core.parallel.units import rank_trainable_elements

    elements = rank_trainable_elements(run.request)
    theirs = harness_config(3, torch.bfloat16, 1, min(500_000_000, elements + elements % 2))
    for key in ("stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
                "reduce_scatter", "use_multi_rank_bucket_allreduce", "stage3_param_persistence_threshold",
                "stage3_max_reuse_distance"):
        assert ours["zero_optimization"][key] == theirs["zero_optimization"][key], key
    assert ours["bf16"] == theirs["bf16"]


# ------------------------------------------------------------------ accelerate

def accelerate_parsed(path: Path):
    needs("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig

    return ClusterConfig.from_yaml_file(str(path))


@pytest.mark.parametrize("strategy, checkpointing", [
    ("fsdp-full-shard", "full"), ("fsdp-shard-grad-op", "none"), ("hsdp", "full"), ("zero3", "none"), ("ddp", "none"),
])
def test_accelerate_yaml_round_trips(tmp_path: Path, strategy: str, checkpointing: str) -> None:
    run = planned("llama-3.1-8b", "--gpus", "16", "--gpu", "h100-80gb", "--framework", "hf", "--strategies", strategy,
                  "--activation-checkpointing", checkpointing, "--flat-reserve")
    emit(run, tmp_path)
    config = accelerate_parsed(tmp_path / "accelerate.yaml")
    assert (config.num_processes, config.num_machines) == (16, 2)
    distributed = getattr(config.distributed_type, "value", config.distributed_type)
    if strategy.startswith("fsdp") or strategy == "hsdp":
        assert distributed == "FSDP" and config.mixed_precision == "bf16"
        fsdp = config.fsdp_config
        assert fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_reshard_after_forward"] is (strategy != "fsdp-shard-grad-op")
        assert fsdp["fsdp_activation_checkpointing"] is (checkpointing == "full")
        assert fsdp["fsdp_offload_params"] is False and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        if strategy == "hsdp":
            shard = run.request.shard_group_size
            assert config.parallelism_config == {"parallelism_config_dp_replicate_size": 16 // shard,
                                                 "parallelism_config_dp_shard_size": shard}
    elif strategy == "zero3":
        assert distributed == "DEEPSPEED"
        assert config.deepspeed_config == {"deepspeed_config_file": "deepspeed.json", "zero3_init_flag": True}
    else:
        assert distributed == "MULTI_GPU"


HF_FSDP1 = ("llama-3.1-8b", "--gpus", "16", "--gpu", "h100-80gb", "--framework", "hf", "--fsdp-version", "1",
            "--flat-reserve")


@pytest.mark.parametrize("strategy, checkpointing", [("fsdp-full-shard", "full"), ("fsdp-shard-grad-op", "none")])
def test_accelerate_yaml_of_an_hf_fsdp1_plan_is_fsdp1(tmp_path: Path, strategy: str, checkpointing: str) -> None:
    """hf under accelerate's FSDP1 (--fsdp-version 1): the file accelerate's ClusterConfig reads
    says fsdp_version 1 with the planned sharding strategy, no prefetch, use_orig_params and the
    planned checkpointing."""
    run = planned(*HF_FSDP1, "--strategies", strategy, "--activation-checkpointing", checkpointing)
    emit(run, tmp_path)
    config = accelerate_parsed(tmp_path / "accelerate.yaml")
    assert getattr(config.distributed_type, "value", config.distributed_type) == "FSDP"
    assert config.mixed_precision == "bf16"
    sharding = {"fsdp-full-shard": "FULL_SHARD", "fsdp-shard-grad-op": "SHARD_GRAD_OP"}[strategy]
    fsdp = config.fsdp_config
    assert fsdp["fsdp_version"] == 1
    assert fsdp["fsdp_sharding_strategy"] == fsdp["fsdp_reshard_after_forward"] == sharding
    assert (fsdp["fsdp_backward_prefetch"], fsdp["fsdp_forward_prefetch"]) == ("NO_PREFETCH", False)
    assert fsdp["fsdp_use_orig_params"] is True and fsdp["fsdp_offload_params"] is False
    assert fsdp["fsdp_activation_checkpointing"] is (checkpointing == "full")
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp  # the model's _no_split_modules


def test_accelerate_yaml_refuses_an_fsdp1_plan_it_cannot_express() -> None:
    """Prefetching named in the API (accelerate's FSDP1 was planned with NO_PREFETCH) and the
    reference model's FSDP1 (the harness's engine) are skipped with the reason."""
    from zeroplan.specs import StrategySpec

    request = planned(*HF_FSDP1, "--strategies", "fsdp-full-shard").request
    prefetching = request.with_strategy(StrategySpec(kind="fsdp-full-shard", fsdp1_root_stays_gathered=True,
                                                     prefetch_units=1))
    with pytest.raises(NotApplicable, match="NO_PREFETCH"):
        accelerate_config(prefetching)
    reference = planned("llama-3.1-8b", "--gpus", "8", "--strategies", "fsdp-full-shard", "--fsdp-version", "1",
                        "--flat-reserve").request
    with pytest.raises(NotApplicable, match="--framework hf"):
        accelerate_config(reference)


def _launched_plugin(path: Path, monkeypatch):
    """The FullyShardedDataParallelPlugin a process of `accelerate launch --config_file PATH` builds:
    accelerate's own launch parser and merge of the file (_validate_launch_command), the variables
    it sets for the processes (prepare_multi_gpu_env), and the plugin reading them. Its
    sync_module_states path asks for the current accelerator; the CPU has none, so that one
    call answers device 0 (nothing is placed there: param_init_fn is only defined)."""
    needs("accelerate")
    needs("torch")
    import accelerate.utils.dataclasses as accelerate_dataclasses
    import torch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    for key in [k for k in os.environ if k.startswith("FSDP_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("FSDP_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(accelerate_dataclasses, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return accelerate_dataclasses.FullyShardedDataParallelPlugin()


@pytest.mark.slow
@pytest.mark.parametrize("strategy, checkpointing", [("fsdp-full-shard", "full"), ("fsdp-shard-grad-op", "none")])
def test_accelerate_launch_runs_the_fsdp1_plugin_the_plan_assumed(tmp_path: Path, monkeypatch, strategy: str,
                                                                  checkpointing: str) -> None:
    """The emitted hf FSDP1 file through accelerate 1.10.1's launch into its plugin gives what
    Accelerator.prepare_model hands FullyShardedDataParallel as the planner assumed it
    (zeroplan.frameworks.hf_fsdp1_step.hf_fsdp1_wrap, the measured step): the strategy, no
    backward or forward prefetch, use_orig_params, one unit per decoder layer of the model's own
    class; and without fsdp_sharding_strategy, launch's FULL_SHARD default would win over a
    SHARD_GRAD_OP fsdp_reshard_after_forward (why the file names it)."""
    needs("transformers")
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    emit(planned(*HF_FSDP1, "--strategies", strategy, "--activation-checkpointing", checkpointing), tmp_path)
    path = tmp_path / "accelerate.yaml"
    plugin = _launched_plugin(path, monkeypatch)
    sharding = {"fsdp-full-shard": ShardingStrategy.FULL_SHARD, "fsdp-shard-grad-op": ShardingStrategy.SHARD_GRAD_OP}
    assert plugin.fsdp_version == 1
    assert (plugin.sharding_strategy or plugin.reshard_after_forward) is sharding[strategy]  # accelerator.py line 1865
    assert plugin.backward_prefetch is None and plugin.forward_prefetch is False
    assert plugin.use_orig_params is True and plugin.cpu_offload.offload_params is False
    assert plugin.activation_checkpointing is (checkpointing == "full")
    assert plugin.cpu_ram_efficient_loading is True and plugin.sync_module_states is True
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"  # accelerate's default under FSDP1, the save planned
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2))
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    plugin.set_auto_wrap_policy(tiny)
    assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == {LlamaDecoderLayer}
    if strategy == "fsdp-shard-grad-op":
        text = "".join(line for line in path.read_text().splitlines(keepends=True) if "fsdp_sharding_strategy" not in line)
        path.write_text(text)
        plugin = _launched_plugin(path, monkeypatch)
        assert (plugin.sharding_strategy or plugin.reshard_after_forward) is ShardingStrategy.FULL_SHARD


@pytest.mark.parametrize("extra", [(), ("--use-cache",)])
def test_hf_fsdp_checkpointing_readme_says_what_the_plan_assumed_of_the_kv_cache(tmp_path: Path, extra) -> None:
    """accelerate's fsdp_activation_checkpointing leaves transformers' use_cache=True on: the README
    says to load the model without its cache when the plan has none, and that it was planned
    with the cache when --use-cache was given; runs without checkpointing get no such line."""
    base = ("llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--framework", "hf", "--strategies", "fsdp-full-shard",
            "--flat-reserve")
    emit(planned(*base, "--activation-checkpointing", "full", *extra), tmp_path / "ac")
    text = (tmp_path / "ac" / "README.md").read_text()
    if extra:
        assert "planned with --use-cache" in text and "use_cache=False" not in text
    else:
        assert "from_pretrained(..., use_cache=False)" in text
    emit(planned(*base, "--activation-checkpointing", "none"), tmp_path / "plain")
    assert "KV cache" not in (tmp_path / "plain" / "README.md").read_text()


def test_accelerate_refuses_what_it_cannot_express() -> None:
    run = planned("llama-3.1-8b", "--gpus", "8", "--framework", "torchtitan", "--strategies", "fsdp-full-shard",
                  "--flat-reserve")
    with pytest.raises(NotApplicable, match="accelerate"):
        accelerate_config(run.request)


# ------------------------------------------------------------------ torchtitan

@pytest.fixture(scope="module")
def torchtitan_parse():
    """torchtitan 0.3.0's ConfigManager over the config sections the overrides set (its
    Trainer.Config imports the data loader, tensorboard and torchao's kernels, which a CPU
    environment may lack; the sections and the parser are torchtitan's own)."""
    needs("torchtitan")
    import dataclasses
    from dataclasses import field

    try:
        from torchtitan.config import CompileConfig, ConfigManager, ParallelismConfig, TrainingConfig
        from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, SelectiveAC
    except ImportError as error:
        pytest.skip(f"torchtitan's config is not importable: {error}")

    # Built with make_dataclass: this module's postponed annotations would be strings tyro
    # cannot resolve in a local scope.
    Sections = dataclasses.make_dataclass("Sections", [
        ("training", TrainingConfig, field(default_factory=TrainingConfig)),
        ("parallelism", ParallelismConfig, field(default_factory=ParallelismConfig)),
        ("compile", CompileConfig, field(default_factory=CompileConfig)),
        ("activation_checkpoint", ActivationCheckpointingConfig, field(default_factory=SelectiveAC.Config)),
        ("hf_assets_path", str, field(default=".")),
    ], kw_only=True)

    def parse(lines: list[str]):
        manager = ConfigManager()
        # The registry's config function stands aside; the arguments go on as launch.sh passes
        # them ($(cat torchtitan-overrides.txt): split at white space).
        manager._load_config = lambda rest: (Sections(), [a for a in rest if a not in ("--module", "llama3", "--config", "llama3_8b")])
        return manager.parse_args(["--module", "llama3", "--config", "llama3_8b", *" ".join(lines).split()])

    return parse


@pytest.mark.parametrize("flags", [
    ("--strategies", "fsdp-full-shard", "--activation-checkpointing", "selective-op", "--compile"),
    ("--strategies", "fsdp-shard-grad-op", "--tp", "2", "--grad-accum", "2", "--activation-checkpointing", "full"),
    ("--strategies", "hsdp", "--hsdp-group", "4", "--micro-batch", "2"),
    ("--strategies", "ddp", "--precision", "bf16-pure", "--fsdp-cpu-offload") ,
    ("--strategies", "fsdp-full-shard", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--grad-accum", "4"),
    ("--strategies", "fsdp-full-shard", "--tp", "2", "--compile", "--async-tp", "--activation-checkpointing", "full"),
])
def test_torchtitan_overrides_round_trip(torchtitan_parse, flags: tuple[str, ...]) -> None:
    if "--fsdp-cpu-offload" in flags:
        flags = tuple(f for f in flags if f != "--fsdp-cpu-offload")  # torchtitan's DDP takes no CPU offload
    run = planned("llama-3.1-8b", "--gpus", "16", "--gpu", "h100-80gb", "--framework", "torchtitan", "--flat-reserve", *flags)
    config = torchtitan_parse(torchtitan_overrides(run.request))
    r = run.request
    par, tr = config.parallelism, config.training
    kind = r.strategy.kind.value
    dp_total = par.data_parallel_shard_degree * par.data_parallel_replicate_degree
    assert dp_total * par.tensor_parallel_degree * par.pipeline_parallel_degree * par.context_parallel_degree == 16
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree, par.context_parallel_degree) == (r.parallel.tp, r.parallel.pp, r.parallel.cp)
    if kind == "ddp":
        assert par.data_parallel_shard_degree == 1
    elif kind == "hsdp":
        assert par.data_parallel_shard_degree == r.shard_group_size
    else:
        assert par.data_parallel_replicate_degree == 1
    assert par.fsdp_reshard_after_forward == ("never" if kind == "fsdp-shard-grad-op" else "default")
    assert par.enable_sequence_parallel is (r.parallel.sequence_parallel or r.parallel.tp == 1)
    assert tr.seq_len == r.batch.seq_len
    if r.parallel.pp > 1:
        assert par.pipeline_parallel_schedule == "Interleaved1F1B"
        assert par.pipeline_parallel_microbatch_size == r.batch.micro_batch_size
        assert tr.local_batch_size == r.batch.micro_batch_size * r.batch.grad_accum_steps
        assert par.pipeline_parallel_layers_per_stage == r.model.num_layers // (r.parallel.pp * r.parallel.virtual_stages)
    else:
        assert tr.local_batch_size == r.batch.micro_batch_size
        # torchtitan accumulates global / (local x data-parallel ranks) micro-batches.
        assert tr.global_batch_size // (tr.local_batch_size * dp_total) == r.batch.grad_accum_steps
    assert tr.mixed_precision_param == ("float32" if r.training.precision.value == "fp32" else "bfloat16")
    assert tr.dtype == ("bfloat16" if r.training.precision.value == "bf16-pure" else "float32")
    assert config.compile.enable is r.training.compile
    assert config.compile.enable_async_tensor_parallel is r.parallel.async_tp
    expected = {"none": type(None), "full": "FullAC", "selective-op": "SelectiveAC"}[r.training.activation_checkpointing.value]
    ac = config.activation_checkpoint
    assert ac is None if expected is type(None) else type(ac).__qualname__.startswith(expected)


@pytest.mark.parametrize(("model", "flags", "config"), [
    # llama3_405b converts every linear but lm_head to rowwise float8: planned so, it runs.
    ("llama-3.1-405b", (), "llama3_405b"),
    # Planned without float8 (or tensorwise), the shipped function would still convert: the
    # user's own function, which the command line cannot replace (its converters are code).
    ("llama-3.1-405b", ("--float8", "none", "--no-compile"), "YOUR_CONFIG_FUNCTION"),
    ("llama-3.1-405b", ("--float8", "tensorwise"), "YOUR_CONFIG_FUNCTION"),
    ("llama-3.1-8b", (), "llama3_8b"),
    ("llama-3.1-8b", ("--compile", "--float8", "rowwise"), "YOUR_CONFIG_FUNCTION"),
])
def test_torchtitan_runs_the_shipped_config_only_where_it_converts_as_planned(model, flags, config) -> None:
    from zeroplan.emit.formats import torchtitan_config_name

    run = planned(model, "--gpus", "64", "--gpu", "h100-80gb", "--framework", "torchtitan", "--flat-reserve",
                  "--strategies", "fsdp-full-shard", *flags)
    assert torchtitan_config_name(run.request) == config


# ------------------------------------------------------------------ torchtune

def torchtune_parsed(recipe_config: str, overrides: list[str]):
    needs("torchtune")
    from torchtune.config._parse import TuneRecipeArgumentParser
    from torchtune.config._utils import _merge_yaml_and_cli_args

    configs = Path(importlib.util.find_spec("recipes").submodule_search_locations[0]) / "configs"
    path = configs / f"{recipe_config}.yaml"
    if not path.exists():
        pytest.skip(f"torchtune's {recipe_config}.yaml is not installed")
    yaml_args, cli_args = TuneRecipeArgumentParser(description="").parse_known_args(["--config", str(path), *overrides])
    return _merge_yaml_and_cli_args(yaml_args, cli_args)


@pytest.mark.parametrize("flags", [
    ("--strategies", "fsdp-full-shard", "--activation-checkpointing", "full", "--grad-accum", "4"),
    ("--strategies", "fsdp-shard-grad-op", "--activation-checkpointing", "selective-layer", "--selective-layer-interval",
     "3", "--fsdp-cpu-offload", "--micro-batch", "2"),
    ("--strategies", "fsdp-full-shard", "--lora-rank", "16", "--lora-alpha", "32", "--activation-offloading",
     "--activation-checkpointing", "full"),
])
def test_torchtune_overrides_round_trip(flags: tuple[str, ...]) -> None:
    needs("recipes")
    run = planned("llama-3.1-8b", "--gpus", "8", "--framework", "torchtune", "--flat-reserve", *flags)
    from zeroplan.emit.formats import torchtune_recipe

    recipe, config_name = torchtune_recipe(run.request)
    cfg = torchtune_parsed(config_name, torchtune_overrides(run.request))
    r = run.request
    assert (cfg.batch_size, cfg.gradient_accumulation_steps) == (r.batch.micro_batch_size, r.batch.grad_accum_steps)
    assert cfg.tokenizer.max_seq_len == r.batch.seq_len and cfg.dtype == "bf16"
    assert cfg.fsdp_reshard_after_forward is (r.strategy.kind.value == "fsdp-full-shard")
    assert cfg.fsdp_cpu_offload is r.training.fsdp_cpu_offload
    assert cfg.enable_activation_offloading is r.training.activation_offloading
    assert cfg.log_peak_memory_stats is True and cfg.compile is False and cfg.optimizer_in_bwd is False
    policy = r.training.activation_checkpointing.value
    if policy == "selective-layer":
        assert cfg.enable_activation_checkpointing is False and (cfg.ac_mode, cfg.ac_option) == ("selective", 3)
    else:
        assert cfg.enable_activation_checkpointing is (policy == "full")
    if r.training.finetune.is_lora:
        assert recipe == "lora_finetune_distributed" and config_name == "llama3_1/8B_lora"
        assert (cfg.model.lora_rank, cfg.model.lora_alpha) == (16, 32)
    else:
        assert recipe == "full_finetune_distributed" and config_name == "llama3_1/8B_full"


@pytest.mark.parametrize(("model", "gpus", "flags", "component", "fused"), [
    # The configuration's own optimizer, left unnamed: no override (7B_full_low_memory's PagedAdamW).
    ("llama-2-7b", "1", (), "bitsandbytes.optim.PagedAdamW", None),
    # 8B_full_single_device builds PagedAdamW8bit: a named torch AdamW replaces it, fused as planned.
    ("llama-3.1-8b", "1", ("--optimizer", "adamw", "--no-optimizer-in-backward"), "torch.optim.AdamW", True),
    # 8B_full builds torch's fused AdamW: a paged 8-bit one drops its fused key.
    ("llama-3.1-8b", "8", ("--optimizer", "adam-8bit", "--paged-optimizer"), "bitsandbytes.optim.PagedAdamW8bit", None),
    # ... and a foreach step says fused False.
    ("llama-3.1-8b", "8", ("--optimizer-loop", "foreach"), "torch.optim.AdamW", False),
])
def test_torchtune_overrides_build_the_planned_optimizer(model, gpus, flags, component, fused) -> None:
    needs("recipes")
    strategy = ("--strategies", "ddp") if gpus == "1" else ("--strategies", "fsdp-full-shard")
    run = planned(model, "--gpus", gpus, "--framework", "torchtune", "--flat-reserve", *strategy, *flags)
    from zeroplan.emit.formats import torchtune_recipe

    overrides = torchtune_overrides(run.request)
    cfg = torchtune_parsed(torchtune_recipe(run.request)[1], overrides)
    assert cfg.optimizer._component_ == component
    assert cfg.optimizer.get("fused") is fused
    assert cfg.optimizer_in_bwd is run.request.training.optimizer_in_backward
    assert cfg.enable_activation_offloading is run.request.training.activation_offloading
    if not flags:
        assert not any(o.startswith(("optimizer=", "~optimizer")) for o in overrides)


def test_torchtune_overrides_refuse_an_optimizer_its_configurations_do_not_build() -> None:
    run = planned("llama-3.1-8b", "--gpus", "8", "--framework", "torchtune", "--flat-reserve", "--strategies",
                  "fsdp-full-shard", "--optimizer", "sgd")
    with pytest.raises(NotApplicable, match="not sgd"):
        torchtune_overrides(run.request)


@pytest.mark.parametrize("framework, optimizer", [("hf", "lion"), ("zeroplan", "sgd"), ("zeroplan", "adafactor")])
def test_an_offload_config_never_names_another_optimizer_than_planned(framework, optimizer) -> None:
    """The offload_optimizer block named AdamW whatever the plan's optimizer: a run from it steps
    DeepSpeed's CPU AdamW, two fp32 states a parameter the plan of lion, sgd or adafactor did not
    count (and fit --deepspeed-config refuses that file beside the same --optimizer)."""
    from zeroplan.emit.formats import deepspeed_config

    run = planned("llama-2-7b", "--gpus", "8", "--framework", framework, "--optimizer", optimizer, "--strategies",
                  "zero3-offload")
    with pytest.raises(NotApplicable, match=f"not the planned {optimizer}"):
        deepspeed_config(run.request)
    # Nor does the launch script point at the file that was not written.
    from zeroplan.emit.formats import launch_script

    launch = launch_script(run.request, {})
    assert "deepspeed.json was not written" in launch and "exit 1" in launch and "torchrun" not in launch
    adamw = planned("llama-2-7b", "--gpus", "8", "--framework", framework, "--strategies", "zero3-offload")
    assert deepspeed_config(adamw.request)["optimizer"] == {"type": "AdamW", "params": {}}


# ------------------------------------------------------------------ the command line

def test_plan_emit_writes_the_files_of_its_best_row(tmp_path: Path, capsys) -> None:
    assert main(["plan", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--global-batch", "16",
                 "--framework", "torchtitan", "--no-model-parallel", "--emit", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    files = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert files == ["README.md", "job.sbatch", "launch.sh", "torchtitan-overrides.txt"]
    assert "skipped deepspeed.json (" in captured.err and "\n" not in captured.err.split("skipped", 1)[1].strip()
    readme = (tmp_path / "run" / "README.md").read_text()
    launch = (tmp_path / "run" / "launch.sh").read_text()
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in launch  # torchtitan's launcher's
    assert "-m torchtitan.train --module llama3 --config llama3_8b" in launch
    # The validate line of the README parses, and plans what the plan's best row is.
    line = next(l for l in readme.splitlines() if l.startswith("zeroplan validate --from-log"))
    flags = line.split()[4:]
    run = planned_from_fit_flags(flags, "")[0]
    best_line = next(l for l in captured.out.splitlines() if l.startswith("Best: "))
    assert best_line.startswith(f"Best: {run.request.strategy.kind.value}, ")
    assert f"micro-batch {run.request.batch.micro_batch_size} x {run.request.batch.grad_accum_steps} accumulation" in best_line


def test_plan_emit_runs_what_the_search_planned_of_a_torchtune_configuration(tmp_path: Path, capsys) -> None:
    """torchtune's llama3_1/8B_full_single_device steps a paged AdamW8bit in backward, which
    refuses the accumulation the search varies: the search plans both off, says so, and the
    emitted run names them off (before, --emit re-planned the configuration's in-backward step
    at the best row's accumulation and was refused after the table had printed)."""
    assert main(["plan", "llama-3.1-8b", "--gpus", "1", "--gpu", "a100-80gb", "--global-batch", "8",
                 "--framework", "torchtune", "--emit", str(tmp_path / "run")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("note: planned as torchtune's llama3_1/8B_full_single_device config, with its adam-8bit optimizer; its "
            "optimizer in backward, paged optimizer planned off") in out
    overrides = (tmp_path / "run" / "torchtune-overrides.txt").read_text().splitlines()
    assert "optimizer_in_bwd=False" in overrides and "optimizer=bitsandbytes.optim.AdamW8bit" in overrides
    readme = (tmp_path / "run" / "README.md").read_text()
    line = next(l for l in readme.splitlines() if l.startswith("zeroplan validate --from-log"))
    assert "--no-optimizer-in-backward" in line and "--no-paged-optimizer" in line


def test_plan_json_carries_the_configuration_note(capsys) -> None:
    assert main(["plan", "llama-3.1-8b", "--gpus", "1", "--gpu", "a100-80gb", "--global-batch", "8",
                 "--framework", "torchtune", "--format", "json"]) == 0
    note = json.loads(capsys.readouterr().out)["configuration_note"]
    assert note.startswith("note: planned as torchtune's llama3_1/8B_full_single_device config") and "\n" not in note
    assert main(["plan", "llama-3.1-8b", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "16",
                 "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["configuration_note"] == ""


def test_plan_searches_the_cpu_offload_of_a_torchtune_configuration(capsys) -> None:
    """torchtune's strategies are all FSDP, so its llama3_1/70B_full configuration's CPU offload
    applies to every row searched: planned on as fit plans it (held off, nothing fitted on 8 x
    80 GB where fit's recommendation fits)."""
    assert main(["plan", "llama-3.1-70b", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "16",
                 "--framework", "torchtune"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Best: fsdp-full-shard")
    assert "note: planned as torchtune's llama3_1/70B_full config, with its FSDP CPU offload" in " ".join(out.split())


def test_fit_emit_needs_one_strategy_and_refuses_special_files(tmp_path: Path, capsys) -> None:
    assert main(["fit", "llama-3.1-8b", "--strategies", "zero2,zero3", "--emit", str(tmp_path)]) == 2
    assert "--emit: writes the files of one strategy" in capsys.readouterr().err
    assert main(["fit", "llama-3.1-8b", "--strategies", "zero2", "--emit", os.devnull]) == 2
    assert "is a character device" in capsys.readouterr().err
    fifo = tmp_path / "deepspeed.json"
    os.mkfifo(fifo)
    assert main(["fit", "llama-3.1-8b", "--strategies", "zero2", "--flat-reserve", "--emit", str(tmp_path)]) == 2
    assert "is a FIFO" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deepspeed.json"]  # nothing written beside it


def test_the_emitter_imports_no_torch() -> None:
    code = ("import sys; from zeroplan.cli.main import main; "
            "main(['fit', 'gpt2', '--gpus', '2', '--strategies', 'zero3', '--seq-len', '64', '--flat-reserve', "
            f"'--emit', {str(Path('/tmp') / ('zeroplan-emit-' + str(os.getpid())))!r}]); "
            "bad = [m for m in ('torch', 'deepspeed', 'accelerate', 'torchtitan', 'torchtune') if m in sys.modules]; "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("optimizer", "allowed"), [("sgd", True), ("adafactor", True), ("adam-8bit", True),
                                                    ("adamw", None)])
def test_deepspeed_json_allows_the_planned_optimizer_zero_has_not_tested(optimizer: str, allowed, tmp_path: Path) -> None:
    """Under ZeRO without an optimizer block the script's optimizer runs, and DeepSpeed asserts
    on one outside its ZERO_SUPPORTED_OPTIMIZERS unless the file sets zero_allow_untested_optimizer."""
    run = planned("llama-3.1-8b", "--gpus", "8", "--strategies", "zero2", "--optimizer", optimizer, "--flat-reserve")
    from zeroplan.emit.formats import deepspeed_config

    config = deepspeed_config(run.request)
    assert config.get("zero_allow_untested_optimizer") is allowed
    path = tmp_path / "deepspeed.json"
    path.write_text(json.dumps(config))
    parsed = deepspeed_parsed(path)
    assert parsed.zero_allow_untested_optimizer is bool(allowed)
