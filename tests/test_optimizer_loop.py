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
             optimizer: Optimizer = Optimizer.adamw, torch_release: str | None = None) -> PlanRequest:
    return PlanRequest(
        model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 8),
        strategy=StrategySpec(kind=kind), batch=BatchSpec(micro_batch_size=1, seq_len=4096),
        training=TrainingSpec(framework=framework, optimizer=optimizer, optimizer_loop=loop,
                              torch_release=torch_release),
    )


def _temporary(request: PlanRequest) -> int:
    return optimizer_step_temporary_bytes(request, model_state_bytes(request).optimizer_elements)


def test_foreach_materialises_one_state_sized_temporary() -> None:
    request = _request(StrategyKind.ddp, OptimizerLoop.foreach)
    assert _temporary(request) == 4 * model_state_bytes(request).optimizer_elements


def _measured_foreach_step_temporaries() -> float:
    """The installed torch's own foreach AdamW step (torch/optim/adam.py _multi_tensor_adam,
    decoupled weight decay) on CPU fp32 tensors: its largest live temporaries over the state size."""
    import torch
    from torch.optim.adam import _multi_tensor_adam

    from tests.live_storages import live_storage_tracker

    sizes = [1 << 16, 3 << 14, 1 << 15]
    params, grads = [torch.randn(n) for n in sizes], [torch.randn(n) for n in sizes]
    exp_avgs, exp_avg_sqs = [torch.zeros(n) for n in sizes], [torch.rand(n) for n in sizes]
    steps = [torch.tensor(0.0) for _ in sizes]
    tracker = live_storage_tracker({t.untyped_storage().data_ptr() for t in params + grads + exp_avgs + exp_avg_sqs + steps})
    peak = [0]
    tracker.probe = lambda: peak.__setitem__(0, max(peak[0], sum(tracker.live.values())))
    with tracker:
        _multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, None, None, amsgrad=False, has_complex=False,
                           beta1=0.9, beta2=0.95, lr=1e-4, weight_decay=0.1, eps=1e-8, maximize=False, capturable=False,
                           differentiable=False, decoupled_weight_decay=True)
    return peak[0] / (4 * sum(sizes))


def test_the_foreach_step_holds_one_temporary_from_torch_2_1_and_two_before() -> None:
    # torch 2.0.1's _multi_tensor_adamw (torch/optim/adamw.py:564-568) makes the square root and
    # an out-of-place eps-shifted copy (denom) and holds both through addcdiv_; from 2.1.0 the
    # shift is in place. Its own function, run on these tensors on the CPU under the live-storage
    # tracker (source from the 2.0.1 wheel, the 2.13 grouping helper passed in), peaked at 2.0 x
    # the state size, 2.1.0's at 1.0 x; the installed release's is measured here.
    assert _measured_foreach_step_temporaries() == 1.0
    elements = model_state_bytes(_request(StrategyKind.ddp, None)).optimizer_elements
    assert _temporary(_request(StrategyKind.ddp, None)) == 4 * elements
    assert _temporary(_request(StrategyKind.ddp, None, torch_release="2.1")) == 4 * elements
    assert _temporary(_request(StrategyKind.ddp, None, torch_release="2.0")) == 2 * 4 * elements
    # Lion is not torch's in 2.0: its one interpolation stays; fused has none.
    assert _temporary(_request(StrategyKind.ddp, None, optimizer=Optimizer.lion, torch_release="2.0")) == 4 * elements
    assert _temporary(_request(StrategyKind.ddp, OptimizerLoop.fused, torch_release="2.0")) == 0


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
        "zeroplan: error: --optimizer-loop: fused is offered by torch for adam, adamw, sgd, sgd-momentum, not lion "
        "(allowed: foreach, for-loop)"]


def test_the_flag_lowers_ddps_optimizer_step(zeroplan_cli) -> None:
    args = ("fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h200-141gb", "--strategies", "ddp", "--format", "json")
    foreach = json.loads(zeroplan_cli(*args)[1])["plans"][0]["memory"]
    fused = json.loads(zeroplan_cli(*args, "--optimizer-loop", "fused")[1])["plans"][0]["memory"]
    assert foreach["step_temporary_bytes"] > 0 == fused["step_temporary_bytes"]
