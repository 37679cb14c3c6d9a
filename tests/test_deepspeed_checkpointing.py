"""DeepSpeed's activation checkpointing options (zeroplan.core.deepspeed_checkpointing): each
checkpointed block input partitioned over the tensor-parallel ranks or kept on the host, the
recomputing block's input whole again, and what cannot be planned refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.main import main
from zeroplan.core.parallel.activations import micro_batch_bytes, rank_activation_bytes
from zeroplan.core.plan import framework_activations, plan, reference_activations
from zeroplan.emit.formats import deepspeed_config
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import ActivationCheckpointing, Precision

SEQ, MICRO = 1024, 2


def request(framework: Framework = Framework.megatron_deepspeed, tp: int = 1, gpus: int = 8, kind: str = "zero1",
            micro: int = MICRO, accumulation: int = 1, **training: object) -> PlanRequest:
    return PlanRequest(
        model=get_model("gpt2-large"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), gpus),
        strategy=StrategySpec(kind=kind), parallel=ParallelSpec(tp=tp, sequence_parallel=False),
        batch=BatchSpec(seq_len=SEQ, micro_batch_size=micro, grad_accum_steps=accumulation),
        training=TrainingSpec(framework=framework, precision=Precision.bf16_mixed,
                              activation_checkpointing=ActivationCheckpointing.full, **training))


def block_input_bytes(req: PlanRequest) -> int:
    return 2 * SEQ * MICRO * req.model.hidden_size


def test_partitioning_keeps_one_tp_th_of_each_block_input_and_gathers_it_whole_for_the_recompute() -> None:
    plain, split = request(tp=4), request(tp=4, partition_activations=True)
    whole, parted = (micro_batch_bytes(r, framework_activations) for r in (plain, split))
    quarter = block_input_bytes(plain) // 4
    assert whole.per_block - parted.per_block == block_input_bytes(plain) - quarter
    assert parted.recompute - whole.recompute == block_input_bytes(plain) - quarter
    assert parted.outside == whole.outside


def test_host_checkpoints_leave_nothing_of_a_block_input_on_the_device() -> None:
    plain, on_host = request(tp=2), request(tp=2, partition_activations=True, cpu_checkpointing=True)
    whole, moved = (micro_batch_bytes(r, framework_activations) for r in (plain, on_host))
    assert whole.per_block - moved.per_block == block_input_bytes(plain)
    assert moved.recompute - whole.recompute == block_input_bytes(plain)


def test_the_offload_engine_keeps_the_newest_input_on_the_device() -> None:
    # cpu_checkpointing alone on a GPU: DeepSpeed's offload engine keeps the newest input
    # (keep_last_count 1) and the one before in its forward stash, which the last two blocks'
    # backwards take back instead of host copies.
    plain, on_host = request(gpus=1, kind="ddp"), request(gpus=1, kind="ddp", cpu_checkpointing=True)
    (kept, recompute), (kept_host, recompute_host) = (rank_activation_bytes(r, framework_activations) for r in (plain, on_host))
    layers = plain.model.num_layers
    assert kept - kept_host == (layers - 2) * block_input_bytes(plain)
    assert recompute_host == recompute


def test_partitioning_over_one_rank_changes_nothing() -> None:
    # get_partition_size: numel / mp_size, the whole input with one model-parallel rank.
    plain, split = request(Framework.zeroplan), request(Framework.zeroplan, partition_activations=True)
    assert rank_activation_bytes(plain, reference_activations) == rank_activation_bytes(split, reference_activations)
    assert plan(plain).memory.peak_bytes == plan(split).memory.peak_bytes


def test_the_peak_falls_by_the_kept_inputs() -> None:
    # At 64 sequences a micro-batch the block inputs (36 x 320 MiB) outweigh the step's temporaries.
    plain, on_host = (request(gpus=1, kind="ddp", micro=64, **extra) for extra in ({}, {"cpu_checkpointing": True}))
    inputs = plain.model.num_layers * 2 * SEQ * 64 * plain.model.hidden_size
    saved = plan(plain).memory.allocated_peak_bytes - plan(on_host).memory.allocated_peak_bytes
    assert 0 < saved <= inputs


@pytest.mark.parametrize("framework, training, parallel, field, words", [
    (Framework.megatron_deepspeed, {"partition_activations": True, "activation_checkpointing": ActivationCheckpointing.none},
     {}, "partition_activations", "allowed with activation_checkpointing 'full'"),
    (Framework.hf, {"cpu_checkpointing": True}, {}, "cpu_checkpointing", "allowed only with framework"),
    (Framework.megatron_deepspeed, {"partition_activations": True}, {"tp": 2, "sequence_parallel": True},
     "partition_activations", "without sequence parallelism"),
])
def test_what_is_not_planned_is_refused(framework, training, parallel, field, words) -> None:
    with pytest.raises(ZeroplanError) as error:
        plan(PlanRequest(model=get_model("gpt2-large"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8),
                         strategy=StrategySpec(kind="zero1"), parallel=ParallelSpec(**parallel),
                         training=TrainingSpec(framework=framework, **{"activation_checkpointing": ActivationCheckpointing.full,
                                                                       **training})))
    assert field in str(error.value) and words in str(error.value)


def test_the_flags_and_a_config_file_plan_the_same(tmp_path: Path, capsys) -> None:
    base = ["fit", "gpt2-large", "--gpus", "8", "--gpu", "a100-80gb", "--framework", "megatron-deepspeed", "--tp", "2",
            "--no-sequence-parallel", "--strategies", "zero1", "--micro-batch", "2", "--seq-len", "1024",
            "--activation-checkpointing", "full", "--precision", "bf16-mixed", "--detail"]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                                "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}))
    outputs = []
    for extra in (["--partition-activations", "--checkpoint-in-cpu"], ["--deepspeed-config", str(path)], []):
        assert main(base + extra) == 0
        outputs.append(capsys.readouterr().out.splitlines())
    flagged, filed, plain = outputs
    # The table's row is the same from the flags as from the file, and not the row without either.
    row = next(i for i, line in enumerate(plain) if line.startswith("zero1"))
    assert flagged[row] == filed[row] != plain[row]


def test_the_emitted_config_carries_the_block() -> None:
    config = deepspeed_config(request(gpus=1, kind="zero2", cpu_checkpointing=True))
    assert config["activation_checkpointing"] == {"partition_activations": False, "cpu_checkpointing": True}
    assert "activation_checkpointing" not in deepspeed_config(request(gpus=1, kind="zero2"))


def test_host_checkpoint_copies_are_exposed_in_the_step() -> None:
    # partition.cpu() and the backward's .to(device) block the compute stream: 2 L x/t a micro-batch.
    from zeroplan.core.timing import checkpoint_copy_seconds, host_link_share_bytes_per_s

    parted = request(tp=2, accumulation=3, partition_activations=True, cpu_checkpointing=True)
    crossing = 2 * 3 * parted.model.num_layers * block_input_bytes(parted) // 2
    assert checkpoint_copy_seconds(parted) == crossing / host_link_share_bytes_per_s(parted)
    engine = request(tp=2, cpu_checkpointing=True)
    restored = (engine.model.num_layers - 2) * block_input_bytes(engine)
    assert checkpoint_copy_seconds(engine) == restored / host_link_share_bytes_per_s(engine)
    assert checkpoint_copy_seconds(request(tp=2, partition_activations=True)) == 0
    slower, plain = (plan(r).time.step_with_overlap_s for r in (parted, request(tp=2, accumulation=3)))
    assert slower > plain


def test_every_pipeline_rank_holds_the_engines_two_inputs_once() -> None:
    # One offload engine a process: two inputs on each rank's device, not one set a micro-batch.
    def kept(**extra: object) -> list[int]:
        return [rank_activation_bytes(request(gpus=4, kind="zero1", accumulation=4, cpu_checkpointing=True,
                                              **extra).model_copy(update={"parallel": ParallelSpec(pp=2, pipeline_rank=rank)}),
                                      framework_activations)[0] for rank in (0, 1)]

    inputs = 2 * block_input_bytes(request())
    with_engine, partitioned = kept(), kept(partition_activations=True)
    assert [a - b for a, b in zip(with_engine, partitioned)] == [inputs, inputs]


def test_host_kept_checkpoints_count_in_host_memory() -> None:
    # The partitions (x/t each) or the engine's host copies (every input but the newest) are in
    # the rank's host memory beside any offloaded states.
    plain = plan(request(tp=2))
    parted = plan(request(tp=2, partition_activations=True, cpu_checkpointing=True))
    engine = plan(request(tp=2, cpu_checkpointing=True))
    x, layers = block_input_bytes(request()), request().model.num_layers
    assert parted.host_bytes_per_rank - plain.host_bytes_per_rank == layers * x // 2
    assert engine.host_bytes_per_rank - plain.host_bytes_per_rank == (layers - 1) * x
    assert parted.host_bytes_per_node == parted.host_bytes_per_rank * 8
