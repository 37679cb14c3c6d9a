"""The step schedule's gradients and foreach temporaries tensor by tensor under plain DDP and one
GPU (zeroplan.allocator.schedule.per_parameter_tensors): torch makes each parameter's gradient,
and each output of a foreach op, as an allocation of its own. Both measured here on the CPU
with the installed torch's own code under the live-storage tracker."""

from __future__ import annotations

from dataclasses import replace

from tests.live_storages import live_storage_tracker
from zeroplan.allocator.planner import _config
from zeroplan.allocator.replay import replay
from zeroplan.allocator.schedule import per_parameter_tensors, record_step, step_inputs
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.parallel.units import rank_trainable_units
from zeroplan.core.plan import checked_peak_terms
from zeroplan.specs import StrategyKind

# peft's MetaMathQA full fine-tune of Llama-3.2-3B on an L40S (benchmarks/published_memory/rows.csv,
# peft-mmqa-llama3.2-3b-full).
MMQA = ("fit benchmarks/published_memory/configs/llama-3.2-3b.json --gpus 1 --gpu l40s --micro-batch 4 --seq-len 768 "
        "--activation-checkpointing none --precision bf16-pure --framework hf --optimizer adamw --optimizer-loop foreach "
        "--keep-outputs --padded-batches yes")


def _request(argv: str, kind: StrategyKind = StrategyKind.ddp):
    return request_from_args(build_parser().parse_args(argv.split()), kind)


def test_each_parameter_s_gradient_and_each_foreach_output_is_its_own_storage() -> None:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    params = list(model.parameters())
    tracker = live_storage_tracker({p.untyped_storage().data_ptr() for p in params})
    with tracker:
        model(torch.randn(8, 64)).square().sum().backward()
        sqrt = torch._foreach_sqrt([p.grad.abs() for p in params])
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in params}
    assert len(grads) == len(params)
    assert sorted(grads.values()) == sorted(p.numel() * p.element_size() for p in params)
    assert all(key in tracker.live for key in grads)
    outputs = {t.untyped_storage().data_ptr() for t in sqrt}
    assert len(outputs) == len(params) and not outputs & set(grads)


def test_the_schedule_makes_them_tensor_by_tensor_under_ddp() -> None:
    request = _request(MMQA)
    assert per_parameter_tensors(request)
    states, terms = checked_peak_terms(request)
    x = step_inputs(request, states, terms)
    tensors = [t.numel for unit in rank_trainable_units(request) for t in unit.tensors if t.trainable]
    assert len(x.gradient_parts) == len(tensors) and sum(x.gradient_parts) == states.gradient_bytes
    assert len(x.step_temporary_parts) == len(tensors) and sum(x.step_temporary_parts) == terms.step_temporary
    # torch 2.0's foreach AdamW: the square roots, then the eps-shifted copies.
    old = _request(MMQA + " --torch-release 2.0")
    old_states, old_terms = checked_peak_terms(old)
    parts = step_inputs(old, old_states, old_terms).step_temporary_parts
    assert len(parts) == 2 * len(tensors) and parts[:len(tensors)] == parts[len(tensors):]
    # DeepSpeed's flat partitions and FSDP's shards keep their own schedules.
    eight = MMQA.replace("--gpus 1", "--gpus 8")
    assert not per_parameter_tensors(_request(eight, StrategyKind.zero2))
    assert not per_parameter_tensors(_request(eight, StrategyKind.fsdp_full_shard))


def test_a_layer_s_gradient_as_one_allocation_took_segments_its_tensors_do_not() -> None:
    # One 0.206 GiB gradient per layer fits none of the backward's cached activation blocks
    # (the largest 0.197 GiB) and takes a segment each; the layer's nine tensors (at most 48 MiB)
    # fit them. Same requested bytes, 7.7 GiB less reserved.
    request = _request(MMQA)
    states, terms = checked_peak_terms(request)
    x = step_inputs(request, states, terms)
    whole = replace(x, gradient_parts=(), step_temporary_parts=())
    config = _config("")
    per_tensor, per_unit = replay(record_step(x).ops, config), replay(record_step(whole).ops, config)
    assert per_tensor.requested_peak_bytes == per_unit.requested_peak_bytes
    assert per_unit.reserved_peak_bytes - per_tensor.reserved_peak_bytes > 7 * 2**30
