"""Allocation traces from fake tensors (zeroplan.simulate.alloc_trace): what the recorder sees,
and, for the runs measured on a GPU, the allocator model's replay of the fake trace against the
CUDA caching allocator's own figures (benchmarks/gpu-allocator-records)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch

from zeroplan.allocator.capacity import oom_capacity
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.measured import load_measured_run
from zeroplan.allocator.trace import AllocEvent, FreeEvent
from zeroplan.errors import ZeroplanError
from zeroplan.harness.engines import EngineKind
from zeroplan.simulate import _torch_private as private
from zeroplan.simulate.alloc_trace import recording_storages
from zeroplan.simulate.harness_trace import harness_allocation_trace
from zeroplan.specs import StrategyKind

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "benchmarks" / "gpu-allocator-records"


def _kinds(events) -> list[tuple[str, int]]:
    return [(e.kind, e.size_bytes if isinstance(e, AllocEvent) else e.id) for e in events]


def test_storages_are_allocated_once_and_freed_when_the_last_reference_goes() -> None:
    with private.fake_tensor_mode(), recording_storages() as recorder:
        a = torch.empty(1000)
        view = a[:10]  # no new storage
        b = a * 2
        del a
        gc.collect()
        assert _kinds(recorder.events) == [("alloc", 4000), ("alloc", 4000)]  # the view keeps a's storage
        del view, b
        gc.collect()
    assert _kinds(recorder.events) == [("alloc", 4000), ("alloc", 4000), ("free", 0), ("free", 1)]


def test_a_storage_resize_frees_its_block_and_makes_a_new_one() -> None:
    with private.fake_tensor_mode(), recording_storages() as recorder:
        a = torch.empty(1000)
        a.untyped_storage().resize_(0)
        a.untyped_storage().resize_(800)
        del a
        gc.collect()
    # Each block the storage has gets its own id (the 0-byte one in between is no allocation).
    assert _kinds(recorder.events) == [("alloc", 4000), ("free", 0), ("alloc", 800), ("free", 2)]


def test_allocations_take_the_stream_current_when_they_are_made() -> None:
    side = torch.cpu.Stream()
    with private.fake_tensor_mode(), recording_storages() as recorder:
        a = torch.empty(10)
        with torch.cpu.stream(side):
            b = torch.empty(20)
        c = torch.empty(30)
    assert [e.stream for e in recorder.events if isinstance(e, AllocEvent)] == [0, 1, 0]
    del a, b, c


def test_cublas_workspaces_appear_at_the_first_matmul_of_forward_and_of_backward() -> None:
    with private.fake_tensor_mode(), recording_storages(cublas_workspace_bytes=1 << 20) as recorder:
        w = torch.empty(8, 8, requires_grad=True)
        x = torch.empty(2, 8)
        (x @ w).sum().backward()
        (x @ w).sum().backward()
    workspaces = [e for e in recorder.events if isinstance(e, AllocEvent) and e.size_bytes == 1 << 20]
    assert len(workspaces) == 2
    freed = {e.id for e in recorder.events if isinstance(e, FreeEvent)}
    assert not {e.id for e in workspaces} & freed


def test_ddp_is_refused_by_name() -> None:
    from zeroplan.harness.presets import HARNESS_PRESETS

    with pytest.raises(ZeroplanError, match="strategy: ddp cannot run on fake tensors"):
        harness_allocation_trace(HARNESS_PRESETS["micro-llama"], StrategyKind.ddp, EngineKind.torch, 8, 1, 16)


def _llama_1b():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_measure import llama_1b

    return llama_1b()


CASES = [("zero1:zeroplan", ""), ("zero2:zeroplan", ""), ("zero3:zeroplan", ""), ("zero3:zeroplan", "expandable_segments:True"),
         ("fsdp-full-shard:torch", ""), ("fsdp-full-shard:torch", "expandable_segments:True"), ("fsdp-shard-grad-op:torch", "")]
CAPACITIES = {(s["case"], s["conf"]): s["oom_capacity_bytes"] for s in json.loads((RECORDS / "capacity.json").read_text())["searches"]}


@pytest.mark.slow  # a 1.1 B model's two steps on fake tensors, 2-4 s each
@pytest.mark.parametrize(("case", "conf"), CASES, ids=[f"{c}-{f or 'default'}" for c, f in CASES])
def test_the_fake_tensor_trace_predicts_the_gpus_allocator(case: str, conf: str) -> None:
    # Measured (docs/validation.md): requested peaks within 256 bytes; reserved peaks equal but
    # ZeRO-1's (+30 MiB); OOM capacities 0 to +0.7 %.
    strategy, engine = case.split(":")
    trace = harness_allocation_trace(_llama_1b(), StrategyKind(strategy), EngineKind(engine), 8, 1, 2048)
    run = load_measured_run(RECORDS / "history" / f"{case.replace(':', '-')}-{'expandable' if conf else 'default'}.json.gz")
    verdict = oom_capacity(trace, parse_alloc_conf(conf), fraction_cap=True)
    assert abs(verdict.unlimited.requested_peak_bytes - run.requested_peak_bytes) < 2**20
    assert verdict.unlimited.reserved_peak_bytes == pytest.approx(run.reserved_peak_bytes, rel=0.01)
    if (case, conf) in CAPACITIES:
        assert verdict.oom_capacity_bytes == pytest.approx(CAPACITIES[(case, conf)], rel=0.01)
