"""The frameworks' own model code, measured live on fake tensors (needs scripts/install-frameworks,
which scripts/setup runs): the measurement reproduces the committed records and agrees with the
planner; unmeasurable requests are one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.presets.models import get_model
from zeroplan.specs import ActivationCheckpointing, BatchSpec, MlpKind, Precision, StrategyKind, TrainingSpec
from zeroplan.specs.framework import Framework

RECORDS = Path(__file__).resolve().parent.parent / "benchmarks" / "framework-records"
pytest.importorskip("torch")


def _measure(framework, strategy, precision, policy, seq_len=4096, micro_batch=1, model="llama-3.1-8b", **options):
    from zeroplan.frameworks.measure import measure

    training = TrainingSpec(framework=framework, precision=precision, activation_checkpointing=policy, **options)
    return measure(get_model(model), StrategyKind(strategy), training, BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch))


@pytest.mark.slow
@pytest.mark.parametrize("framework, strategy, precision, policy, module", [
    ("hf", "zero3", "bf16-mixed", "none", "transformers"),
    ("hf", "ddp", "bf16-mixed", "none", "transformers"),
    ("torchtune", "fsdp-full-shard", "bf16-pure", "full", "torchtune"),
    ("torchtitan", "fsdp-full-shard", "bf16-mixed", "none", "torchtitan"),
    ("torchtitan", "fsdp-full-shard", "bf16-mixed", "selective-op", "torchtitan"),
])
def test_a_live_measurement_reproduces_its_committed_record(framework, strategy, precision, policy, module) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed (scripts/install-frameworks installs it)")

    record = _measure(framework, strategy, precision, policy)
    _assert_reproduces(record)


@pytest.mark.slow
@pytest.mark.parametrize("policy, options", [
    ("selective-layer", {"selective_layer_interval": 3}),
    ("full", {"activation_offloading": True}),
])
def test_torchtunes_other_options_reproduce_their_committed_records(policy, options) -> None:
    # torchtune's own apply_selective_activation_checkpointing and OffloadActivations (its
    # CUDA stream calls stood in for by zeroplan/frameworks/_cuda_streams.py).
    pytest.importorskip("torchtune")
    record = _measure("torchtune", "fsdp-full-shard", "bf16-pure", policy, **options)
    _assert_reproduces(record)


def _assert_reproduces(record) -> None:
    from zeroplan.frameworks.record import FrameworkRecord

    committed = FrameworkRecord.model_validate_json((RECORDS / record.file_name).read_text())
    # Another release is other code: say so before comparing bytes (scripts/install-frameworks pins it).
    assert record.framework_version == committed.framework_version
    assert record.retained_bytes == committed.retained_bytes
    assert record.block_growth_bytes == committed.block_growth_bytes


def test_a_framework_that_cannot_be_measured_is_named() -> None:
    from zeroplan.frameworks.build import check_measurable

    with pytest.raises(ZeroplanError, match="--framework.*zeroplan.*allowed: hf, torchtune, torchtitan"):
        check_measurable(Framework.zeroplan, ActivationCheckpointing.full, get_model("llama-3.1-8b"))
    with pytest.raises(ZeroplanError, match="--activation-checkpointing"):
        check_measurable(Framework.hf, ActivationCheckpointing.selective_op, get_model("llama-3.1-8b"))
    with pytest.raises(ZeroplanError, match="--activation-checkpointing.*allowed: none, full, selective-op"):
        check_measurable(Framework.torchtitan, ActivationCheckpointing.selective_layer, get_model("llama-3.1-8b"))
    with pytest.raises(ZeroplanError, match="model"):
        check_measurable(Framework.hf, ActivationCheckpointing.none, get_model("gpt2"))
    llama = get_model("llama-3.1-8b")
    for changed in ({"post_norms": True}, {"mlp": MlpKind.geglu}):
        with pytest.raises(ZeroplanError, match="Llama-layout"):
            check_measurable(Framework.hf, ActivationCheckpointing.none, llama.model_copy(update=changed))
    for framework in (Framework.torchtune, Framework.torchtitan):
        with pytest.raises(ZeroplanError, match="head_dim"):
            check_measurable(framework, ActivationCheckpointing.none, llama.model_copy(update={"head_dim": 256}))
    for framework, policy in ((Framework.hf, ActivationCheckpointing.full), (Framework.torchtune, ActivationCheckpointing.none)):
        with pytest.raises(ZeroplanError, match="--activation-offloading"):
            check_measurable(framework, policy, llama, activation_offloading=True)


def test_selective_layer_counts_blocks_from_one_in_every_model_built() -> None:
    # torchtune's checkpoint_wrapper keeps its block count for the whole process; each build
    # starts it afresh, as the recipe's one build does.
    pytest.importorskip("torchtune")
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from zeroplan.frameworks.build import build

    tiny = get_model("llama-3.1-8b").model_copy(update={"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
                                                        "ffn_hidden_size": 128, "vocab_size": 256})
    for _ in range(2):
        built = build(Framework.torchtune, tiny, 5, ActivationCheckpointing.selective_layer, torch.bfloat16,
                      selective_layer_interval=2)
        assert [isinstance(block, CheckpointWrapper) for block in built.blocks] == [False, True, False, True, False]


def test_simulate_framework_is_one_line_when_the_framework_is_not_installed(capsys, monkeypatch) -> None:
    import sys

    from zeroplan.cli.main import main

    # What an absent package looks like to import (its submodules too, if an earlier test loaded them).
    for name in ["torchtitan", *(m for m in sys.modules if m.startswith("torchtitan."))]:
        monkeypatch.setitem(sys.modules, name, None)
    code = main(["simulate", "llama-3.1-8b", "--framework", "torchtitan", "--strategy", "fsdp-full-shard"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--framework" in err and "not installed" in err, err


def test_module_dtype_follows_the_engine() -> None:
    import torch

    from zeroplan.frameworks.measure import module_dtype

    hf = TrainingSpec(framework=Framework.hf)
    assert module_dtype(hf, StrategyKind.zero3) is torch.bfloat16
    assert module_dtype(hf, StrategyKind.ddp) is torch.float32
    assert module_dtype(TrainingSpec(framework=Framework.torchtune, precision=Precision.bf16_pure), StrategyKind.fsdp_full_shard) is torch.bfloat16
    # torchtitan: fp32 parameters, FSDP2 gathers them in bf16 (MixedPrecisionPolicy param_dtype).
    assert module_dtype(TrainingSpec(framework=Framework.torchtitan), StrategyKind.fsdp_full_shard) is torch.bfloat16
    assert module_dtype(TrainingSpec(framework=Framework.torchtitan, precision=Precision.fp32), StrategyKind.ddp) is torch.float32


def test_torchtitan_shards_with_its_own_fsdp2_wrapping() -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/install-frameworks installs it)")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from zeroplan.frameworks.build import build
    from zeroplan.simulate import _torch_private as private

    built = build(Framework.torchtitan, get_model("llama-3.1-8b"), 3, ActivationCheckpointing.selective_op, torch.float32)
    assert built.shard is not None
    dist.init_process_group(private.FAKE_BACKEND, store=private.fake_store(), rank=0, world_size=8)
    try:
        description = built.shard(init_device_mesh("cpu", (8,)), True)
    finally:
        dist.destroy_process_group()
    assert "apply_fsdp_to_decoder" in description and "'default'" in description
    # Every block, and the final norm with the output projection, is its own FSDP2 unit.
    assert all(isinstance(block, FSDPModule) for block in built.blocks)
    assert isinstance(built.module.lm_head, FSDPModule)


@pytest.mark.parametrize("argv, field", [
    (["--framework", "hf", "--activation-checkpointing", "selective-op"], "--activation-checkpointing"),
    (["--activation-checkpointing", "selective-op"], "activation_checkpointing"),
])
def test_simulate_selective_op_outside_torchtitan_is_one_line(capsys, argv, field) -> None:
    from zeroplan.cli.main import main

    # Per block (--framework) one process measures one block and takes no --world-size.
    world = () if "--framework" in argv else ("--world-size", "8")
    code = main(["simulate", "llama-3.1-8b", "--strategy", "fsdp-full-shard", *world, *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and field in err and "selective-op" in err, err
