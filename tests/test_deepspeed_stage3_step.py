"""DeepSpeed ZeRO-3's optimizer step sub-group by sub-group (zeroplan.core.deepspeed_stage3_step):
each sub-group's flat 16-bit gradient copy and its fp32 cast, made and freed in turn, at the step's
peak in place of the whole fp32 gradient partition; and --reduce-bucket-size, a config's
reduce_bucket_size, setting the ipg bucket."""

from __future__ import annotations

import pytest

from zeroplan.allocator.schedule import step_trace
from zeroplan.allocator.trace import AllocEvent
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core import deepspeed_stage3_step, nvme
from zeroplan.core.peak import PeakMoment
from zeroplan.core.plan import memory_breakdown, peak_terms
from zeroplan.specs import StrategyKind
from zeroplan.units import FP32_BYTES

# A 6.86B model over 4 ranks: a 1.71e9-element partition, two sub-groups of DeepSpeed's 1e9.
CONFIG = '{"model_type": "gpt2", "vocab_size": 50000, "n_embd": 4096, "n_layer": 32, "n_head": 32, ' \
         '"n_inner": 16384, "n_positions": 512, "tie_word_embeddings": false}'


def _request(tmp_path, *flags: str, kind: StrategyKind = StrategyKind.zero3):
    path = tmp_path / "config.json"
    path.write_text(CONFIG)
    argv = ["fit", str(path), "--gpus", "4", "--gpu", "a100-80gb", "--micro-batch", "1", "--seq-len", "512",
            "--precision", "bf16-mixed", "--activation-checkpointing", "full", "--state-convention", "deepspeed", *flags]
    return request_from_args(build_parser().parse_args(argv), kind)


def test_the_step_holds_the_largest_sub_groups_flat_copy_and_fp32_gradient(tmp_path) -> None:
    request = _request(tmp_path)
    groups = nvme.sub_group_tensor_elements(request)
    assert len(groups) == 2 and sum(map(sum, groups)) > 10**9
    largest = max(map(sum, groups))
    # stage3.py: flatten (a copy in bf16, 2 bytes) then .to(fp32) (4 bytes), both alive.
    assert deepspeed_stage3_step.step_gradient_bytes(request) == largest * (2 + FP32_BYTES)
    states, terms = peak_terms(request)
    assert terms.step_gradients == largest * (2 + FP32_BYTES) < sum(map(sum, groups)) * (2 + FP32_BYTES)


def test_one_sub_group_of_one_tensor_is_flattened_without_a_copy() -> None:
    assert sum(deepspeed_stage3_step.sub_group_step_parts([10], 2)) == 10 * FP32_BYTES
    assert sum(deepspeed_stage3_step.sub_group_step_parts([10, 20], 2)) == 30 * (2 + FP32_BYTES)
    # An fp32 model's cast is no copy (Tensor.to of its own dtype): the flat copy alone.
    assert sum(deepspeed_stage3_step.sub_group_step_parts([10, 20], FP32_BYTES)) == 30 * FP32_BYTES


def test_the_step_moment_and_the_replay_count_the_sub_group_not_the_partition(tmp_path) -> None:
    request = _request(tmp_path)
    breakdown, states = memory_breakdown(request)
    assert breakdown.peak_moment is PeakMoment.optimizer_step
    step = deepspeed_stage3_step.step_gradient_bytes(request)
    assert breakdown.peak_gradient_bytes == step
    # The replay makes each sub-group's two tensors and frees them before the next.
    states, terms = peak_terms(request)
    sizes = [e.size_bytes for e in step_trace(request, states, terms).events if isinstance(e, AllocEvent)]
    for group in nvme.sub_group_tensor_elements(request):
        assert sum(group) * 2 in sizes and sum(group) * FP32_BYTES in sizes
    assert states.gradient_bytes not in sizes


@pytest.mark.parametrize("kind", [StrategyKind.zero2, StrategyKind.zero3_offload])
def test_other_steps_keep_the_gradient_partition(tmp_path, kind: StrategyKind) -> None:
    assert deepspeed_stage3_step.step_gradient_bytes(_request(tmp_path, kind=kind)) is None


def test_reduce_bucket_size_sets_the_ipg_bucket(tmp_path) -> None:
    default, given = _request(tmp_path), _request(tmp_path, "--reduce-bucket-size", "50000000")
    assert default.strategy.zero_bucket_elements == 500_000_000
    assert given.strategy.zero_bucket_elements == 50_000_000
    # The bucket is resident in the model dtype: 4.5e8 bf16 elements fewer.
    assert peak_terms(default)[1].resident_buffers - peak_terms(given)[1].resident_buffers == 450_000_000 * 2
