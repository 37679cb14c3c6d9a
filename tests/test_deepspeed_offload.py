"""DeepSpeed's optimizer-offload staging buffers (zeroplan.core.deepspeed_offload) against the
committed records of its own engine on gloo, and the CPU run's one memory in validate's peak.
Reads JSON records only; no torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.core.deepspeed_offload import device_staging_bytes, host_staging_bytes
from zeroplan.core.plan import memory_breakdown
from zeroplan.harness.record import read_record
from zeroplan.validate.compare import compare_record, request_for

RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed-records"
PSI, LARGEST = 12_586_368, 8192 * 384  # tiny-llama's parameters and its largest tensor (embedding, head)


@pytest.mark.parametrize("strategy, device, host", [
    # stage 2: the device's largest-parameter gradient buffer; the host's partition copy and its own.
    ("zero2-offload", 4 * LARGEST, 4 * (PSI // 2 + LARGEST)),
    # stage 3: the ipg bucket (the whole model here) on the device; grad_partitions_flat_buffer on the host.
    ("zero3-offload", 4 * PSI, 4 * (PSI // 2)),
])
def test_staging_buffers_are_what_deepspeed_allocates(strategy: str, device: int, host: int) -> None:
    for path in sorted((RECORDS / f"tiny-llama-{strategy}-deepspeed-fp32-n2").glob("rank*.json")):
        record = read_record(path)
        request = request_for(record.description)
        assert (device_staging_bytes(request), host_staging_bytes(request)) == (device, host)
        rows = {row.quantity: row for row in compare_record(record)}
        assert rows["buffers (kept)"].measured_bytes == rows["buffers (kept)"].predicted_bytes == device
        # The host states agree but for DeepSpeed's one 4-byte step counter against the planner's
        # one per unit (6 units: 20 bytes).
        assert rows["host (offloaded)"].predicted_bytes - rows["host (offloaded)"].measured_bytes == 20
        # On the CPU the offloaded states are under the one allocator's peak: validate adds them.
        breakdown, states = memory_breakdown(request)
        assert rows["peak (CPU allocator)"].predicted_bytes == breakdown.allocated_peak_bytes + states.host_bytes


def test_the_parameter_offload_keeps_stage_3s_staging_buffers() -> None:
    """offload_param beside offload_optimizer (zero3-param-offload) moves the parameter partitions
    to the host, not the optimizer's buffers: the ipg bucket stays on the device (stage3.py:780-784)
    and grad_partitions_flat_buffer on the host (stage3.py:333), as under zero3-offload."""
    from zeroplan.core.buffers import resident_buffer_bytes
    from zeroplan.specs import StrategyKind

    record = read_record(RECORDS / "tiny-llama-zero3-offload-deepspeed-fp32-n2" / "rank00000.json")
    request = request_for(record.description)
    strategy = request.strategy.model_copy(update={"kind": StrategyKind.zero3_param_offload})
    both = request.model_copy(update={"strategy": strategy})
    assert device_staging_bytes(both) == resident_buffer_bytes(both) == 4 * PSI
    assert host_staging_bytes(both) == 4 * (PSI // 2)


def _gpjt_request(release: str):
    """Llama-3-8B under ZeRO-2 with the optimizer offloaded, HF Trainer, fp16, 8 GPUs."""
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser

    argv = ["fit", "llama-3-8b", "--gpus", "8", "--gpu", "a100-80gb", "--micro-batch", "1", "--seq-len", "2001",
            "--activation-checkpointing", "full", "--precision", "fp16-mixed", "--framework", "hf",
            "--transformers-version", "4.40.0", "--torch-release", "2.2", "--deepspeed-release", release]
    from zeroplan.specs import StrategyKind

    request = request_from_args(build_parser().parse_args(argv))
    return request.model_copy(update={"strategy": request.strategy.model_copy(
        update={"kind": StrategyKind.zero2_offload})})


def test_the_offload_gradient_path_of_earlier_releases_holds_the_largest_gradients_temporaries() -> None:
    """DeepSpeed before 0.18.0 (deepspeed_release 0.13.3) checks the largest gradient (Llama-3-8B's
    128256 x 4096 embedding) for overflow on the GPU at the backward's end, 11 bytes an element
    beside its fp16 self, with the bucket held from the backward's start; 0.19.8 is not this path."""
    from zeroplan.core.buffers import backward_end_buffer_bytes, backward_held_buffer_bytes
    from zeroplan.core.deepspeed_offload import gradient_path_bytes

    embedding = 128256 * 4096
    old = _gpjt_request("0.13.3")
    assert gradient_path_bytes(old) == backward_end_buffer_bytes(old) == embedding * (2 + 11)
    assert backward_held_buffer_bytes(old) == 500_000_000 * 2
    new = _gpjt_request("0.19.8")
    assert gradient_path_bytes(new) == 0 and backward_end_buffer_bytes(new) is None
    assert backward_held_buffer_bytes(new) == 0


def test_the_step_of_0_14_copies_the_fp32_partition_onto_the_gpu() -> None:
    """v0.14.1-v0.16.x (deepspeed_release 0.14.2) copy the rank's whole fp32 partition to the GPU
    before casting it (stage_1_and_2.py:1868-1871); 0.13.3's and 0.19.8's steps do not. 0.14.2 keeps
    0.13.3's bucket and gradient path."""
    from zeroplan.core.buffers import backward_held_buffer_bytes, optimizer_step_temporary_bytes
    from zeroplan.core.deepspeed_offload import gradient_path_bytes, step_upcopy_bytes
    from zeroplan.core.model_states import model_state_bytes

    psi = 8_030_261_248  # Llama-3-8B, divisible by 8 x 2 (the flat group's alignment)
    request = _gpjt_request("0.14.2")
    states = model_state_bytes(request)
    assert step_upcopy_bytes(request) == optimizer_step_temporary_bytes(request, states.optimizer_elements) == psi // 8 * 4
    assert gradient_path_bytes(request) == gradient_path_bytes(_gpjt_request("0.13.3"))
    assert backward_held_buffer_bytes(request) == 500_000_000 * 2
    assert step_upcopy_bytes(_gpjt_request("0.13.3")) == step_upcopy_bytes(_gpjt_request("0.19.8")) == 0
