"""FSDP2's unsharded parameters under torchao's float8 all-gather in the memory model
(zeroplan.core.model_states._float8_unsharded; measured by benchmarks/float8_all_gather_memory.py):
the Float8Linear weights gathered at one byte an element, everything else as before."""

from __future__ import annotations

from zeroplan.core.buffers import backward_held_buffer_bytes
from zeroplan.core.float8_time import float8_weight_elements
from zeroplan.core.largest_unit import largest_unit_elements
from zeroplan.core.model_states import unit_gather_bytes
from zeroplan.core.parallel.units import rank_parameter_units
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PerformanceAssumptions, PlanRequest, StrategyKind, StrategySpec, cluster_from_gpus
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import Float8Recipe, TrainingSpec
from zeroplan.validate.rows import FLAT_RESERVE


def _request(kind: StrategyKind, all_gather: bool) -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-3.1-8b"), batch=BatchSpec(micro_batch_size=1, seq_len=4096),
        training=TrainingSpec(framework=Framework.torchtitan, compile=True, float8=Float8Recipe.tensorwise,
                              float8_all_gather=all_gather),
        cluster=cluster_from_gpus(get_gpu("h200"), 32), strategy=StrategySpec(kind=kind),
        performance=PerformanceAssumptions(hardware_flops_utilization=0.4), assumptions=FLAT_RESERVE,
    )


def test_shard_grad_op_holds_every_float8_weight_gathered_at_one_byte() -> None:
    # reshard_after_forward=False keeps every unit gathered: the difference is one byte per
    # Float8Linear weight element (Llama-3.1-8B's dimensions divide by 32: no padding).
    cast, bf16 = (_request(StrategyKind.fsdp_shard_grad_op, flag) for flag in (True, False))
    assert backward_held_buffer_bytes(bf16) - backward_held_buffer_bytes(cast) == float8_weight_elements(cast)


def test_full_shard_gathers_a_block_and_the_head_at_one_byte_a_weight_element_its_gradient_still_bf16() -> None:
    cast, bf16 = (_request(StrategyKind.fsdp_full_shard, flag) for flag in (True, False))
    names = [unit.name for unit in rank_parameter_units(cast)]
    saved = {name: b - c for name, b, c in zip(names, unit_gather_bytes(bf16, 32, 2), unit_gather_bytes(cast, 32, 2),
                                               strict=True)}
    # One block's seven linears (4096^2 x 2 for wq, wo; 4096 x 1024 x 2 for wk, wv; 4096 x 14336 x 3);
    # the output projection is a Float8Linear too, the embedding is not.
    assert saved["block.0"] == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert saved["head"] == 128256 * 4096 and saved["embedding"] == 0
    # The unsharded gradient is the compute dtype's either way (Float8TrainingTensor's orig dtype).
    assert largest_unit_elements(cast) == largest_unit_elements(bf16)


def test_without_fsdp_the_flag_changes_no_buffer() -> None:
    assert (backward_held_buffer_bytes(_request(StrategyKind.ddp, True))
            == backward_held_buffer_bytes(_request(StrategyKind.ddp, False)))
