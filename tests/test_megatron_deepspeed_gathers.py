"""DeepSpeed ZeRO-3's gathers under megatron-deepspeed, module by module
(zeroplan.core.deepspeed_coordinator), on the DeepSpeed-on-Azure 1T row's request."""

from __future__ import annotations

from zeroplan.core.buffers import transient_buffer_bytes
from zeroplan.core.layout import element_bytes, gradient_wire_bytes
from zeroplan.core.deepspeed_coordinator import peak_gathered_bytes, replays_gathers
from zeroplan.units import ceil_div
from zeroplan.validate.step_time import load_published_throughput

ROW = next(r for r in load_published_throughput().rows if r.name == "deepspeed azure gpt-1t a100 x1024 zero3-offload b8 s1024")
REQUEST = ROW.request()
H, F, N = 25_600, 102_400, 1024


def _with(**strategy) -> object:
    return REQUEST.with_strategy(REQUEST.strategy.model_copy(update=strategy))


def _padded(elements: int) -> int:
    return ceil_div(elements, N) * N * element_bytes(REQUEST.training.precision, REQUEST.convention).compute_parameter


def test_the_largest_moment_is_the_mlp_output_backward_with_the_next_linear_prefetched() -> None:
    # At dense_4h_to_h's backward its weight is gathered, its prefetch (wanted: min(3e9 - 2.6e9,
    # 5e7) elements, whole parameters) has brought dense_h_to_4h's weight, and its full gradient
    # is alive: two F x H weights gathered and one gradient, not a whole 15.7 GB block and more.
    assert replays_gathers(REQUEST)
    expected = 2 * _padded(F * H) + F * H * gradient_wire_bytes(REQUEST)
    assert peak_gathered_bytes(REQUEST) == expected
    assert transient_buffer_bytes(REQUEST) == expected


def test_without_room_to_prefetch_one_module_and_its_gradient() -> None:
    # stage3_max_live_parameters below what is available: nothing is prefetched, so the most held
    # is the largest module (dense_h_to_4h: its weight and its 102,400-element bias, above the
    # persistence threshold) with its gradients.
    request = _with(deepspeed_max_live_parameters=1)
    module = F * H + F
    assert peak_gathered_bytes(request) == _padded(F * H) + _padded(F) + module * gradient_wire_bytes(request)


def test_the_reference_convention_keeps_the_unit_model() -> None:
    # The harness's own ZeRO-3 engine (the zero state convention) gathers whole units: not replayed.
    from zeroplan.specs.framework import Framework
    from zeroplan.specs.training import StateConvention

    other = REQUEST.model_copy(update={"training": REQUEST.training.model_copy(
        update={"framework": Framework.zeroplan, "state_convention": StateConvention.zero})})
    assert other.convention is StateConvention.zero and not replays_gathers(other)
