"""The host-link bytes zeroplan.core.deepspeed_offload_time prices against the copies DeepSpeed
0.19.8's own optimizer offload makes (CPU, gloo, two ranks; tests/harness/offload_copies_worker.py
counts every aten.copy_ into or out of the optimizer's host buffers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from zeroplan.harness.extension_locks import check_no_stale_extension_lock

WORKER = Path(__file__).with_name("offload_copies_worker.py")


def _run(tmp_path: Path, settings: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], list[dict]]:
    from zeroplan.harness.launch import run_torchrun

    pytest.importorskip("deepspeed")
    check_no_stale_extension_lock()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(WORKER), str(tmp_path),
               *(f"{stage}:{accum}" for stage, accum in settings)]
    code, output = run_torchrun(command, timeout_s=300)
    assert code == 0, output[-2000:]
    return {(stage, accum): [json.loads((tmp_path / f"rank{rank}-stage{stage}-accum{accum}.json").read_text())
                             for rank in range(2)] for stage, accum in settings}


def _request(kind, accum: int):
    from zeroplan.harness.presets import HARNESS_PRESETS
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.specs import (
        BatchSpec, PlanRequest, Precision, StateConvention, StrategySpec, TrainingSpec, cluster_from_gpus,
    )

    return PlanRequest(
        model=HARNESS_PRESETS["micro-llama"], batch=BatchSpec(micro_batch_size=2, seq_len=16, grad_accum_steps=accum),
        training=TrainingSpec(precision=Precision.bf16_mixed, state_convention=StateConvention.deepspeed),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), 2, gpus_per_node=2), strategy=StrategySpec(kind=kind),
    )


@pytest.mark.slow  # launches torchrun
def test_offload_copies_match_deepspeed_to_the_parameter(tmp_path) -> None:
    from zeroplan.core.communication import Phase
    from zeroplan.core.deepspeed_offload_time import deepspeed_offload_transfer_bytes
    from zeroplan.core.timing import offloaded_optimizer_elements
    from zeroplan.specs import StrategyKind

    kinds = {2: StrategyKind.zero2_offload, 3: StrategyKind.zero3_offload}
    records = _run(tmp_path, ((2, 1), (2, 3), (3, 3)))
    for (stage, accum), ranks in records.items():
        request = _request(kinds[stage], accum)
        elements = offloaded_optimizer_elements(request)
        moved = deepspeed_offload_transfer_bytes(request, elements)
        for record in ranks:
            measured = record["bytes"]
            assert record["partition_elements"] == elements
            # The bf16 partition goes up once after the CPU step; stage 2 casts it on the host first
            # (bit16_partition_buffer.copy_, 2 B written per element).
            assert measured["step up"] == 2 * elements
            assert measured.get("step host", 0) == (2 * elements if stage == 2 else 0)
            if stage == 2:
                # No overlap_comm: the gradient copies are charged to the step phase; the model
                # prices the partition's elements, DeepSpeed's accumulation copies move whole
                # parameters that touch it (16 elements of one more here, each micro-batch).
                gradient = moved[Phase.step] - measured["step up"]
                extra = 2 * 16 * (2 * accum - 1) if accum > 1 else 0
                assert measured["backward down"] + measured.get("backward up", 0) == gradient + extra
                assert measured["backward down"] == 4 * elements + (accum * (2 * elements + 32) if accum > 1 else 0)
            else:
                assert moved[Phase.step] == measured["step up"]
                # Seen on the CPU accelerator: the first micro-batch's bf16 copy down and the fp32
                # copy at the boundary. The later micro-batches' round trips take stage3.py's
                # on_accelerator branch here (the host is the device) and add in place; on a GPU
                # they come up and go down again: 2 x 2 B per element each, in the model.
                assert measured["backward down"] == 2 * elements + 4 * elements
                assert moved[Phase.backward] == measured["backward down"] + 2 * elements + (accum - 1) * 2 * 2 * elements
