"""The optimizer step's temporary by how torch.optim walks the tensors (--optimizer-loop)."""

from __future__ import annotations

import json

from zeroplan.core.buffers import optimizer_loop, optimizer_step_temporary_bytes
from zeroplan.core.model_states import model_state_bytes
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, Framework, Optimizer, OptimizerLoop, PlanRequest, StrategyKind, StrategySpec, TrainingSpec,
    cluster_from_gpus,
)
from zeroplan.presets.gpus import get_gpu


def _request(kind: StrategyKind, loop: OptimizerLoop | None, framework: Framework = Framework.zeroplan,
             optimizer: Optimizer = Optimizer.adamw) -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 8),
        strategy=StrategySpec(kind=kind), batch=BatchSpec(micro_batch_size=1, seq_len=4096),
        training=TrainingSpec(framework=framework, optimizer=optimizer, optimizer_loop=loop),
    )


def _temporary(request: PlanRequest) -> int:
    return optimizer_step_temporary_bytes(request, model_state_bytes(request).optimizer_elements)


def test_foreach_materialises_one_state_sized_temporary() -> None:
    request = _request(StrategyKind.ddp, OptimizerLoop.foreach)
    assert _temporary(request) == 4 * model_state_bytes(request).optimizer_elements


def test_for_loop_holds_two_copies_of_the_largest_tensor() -> None:
    # Llama-3.1-8B's largest tensors are the 128256 x 4096 embedding and head; under DDP whole.
    assert _temporary(_request(StrategyKind.ddp, OptimizerLoop.for_loop)) == 2 * 4 * 128256 * 4096
    # FSDP2 steps each parameter's dim-0 shard: 1/8 of the rows.
    assert _temporary(_request(StrategyKind.fsdp_full_shard, OptimizerLoop.for_loop)) == 2 * 4 * 128256 // 8 * 4096


def test_for_loop_over_flat_zero_units_steps_a_whole_unit_shard() -> None:
    # zeroplan's reference ZeRO steps one flat fp32 master per unit (zeroplan/harness/zero.py
    # FlatUnit): Llama-3.1-8B's largest is the head's, the final norm and the output projection
    # together (128256 x 4096 + 4096 elements), whose shard is an eighth.
    head_unit = 128256 * 4096 + 4096
    assert _temporary(_request(StrategyKind.zero3, OptimizerLoop.for_loop)) == 2 * 4 * (head_unit // 8)


def test_fused_has_no_temporary_and_is_the_framework_default_where_recipes_fuse() -> None:
    assert _temporary(_request(StrategyKind.ddp, OptimizerLoop.fused)) == 0
    assert optimizer_loop(_request(StrategyKind.fsdp_full_shard, None, Framework.torchtitan)) is OptimizerLoop.fused
    assert optimizer_loop(_request(StrategyKind.ddp, None)) is OptimizerLoop.foreach


def test_fused_lion_is_refused_by_name(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--optimizer", "lion",
                                  "--optimizer-loop", "fused")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "zeroplan: error: optimizer_loop: fused is offered by torch for adam, adamw, sgd, sgd-momentum, not lion "
        "(allowed: foreach, for-loop)"]


def test_the_flag_lowers_ddps_optimizer_step(zeroplan_cli) -> None:
    args = ("fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h200-141gb", "--strategies", "ddp", "--format", "json")
    foreach = json.loads(zeroplan_cli(*args)[1])["plans"][0]["memory"]
    fused = json.loads(zeroplan_cli(*args, "--optimizer-loop", "fused")[1])["plans"][0]["memory"]
    assert foreach["step_temporary_bytes"] > 0 == fused["step_temporary_bytes"]
