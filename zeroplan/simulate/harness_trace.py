"""The allocation trace of a measurement-harness run (zeroplan.harness engines), computed with
fake tensors on the CPU: the same program benchmarks/gpu_allocator.py runs on a GPU (build the
model and the engine, then forward, backward, optimizer step and zero_grad for each step), so
the allocator model's replay of this trace can be set against what the CUDA caching allocator
did (tests/test_fake_allocator_trace.py, docs/validation.md)."""

from __future__ import annotations

from unittest import mock

import torch

from zeroplan.allocator.trace import AllocationTrace
from zeroplan.errors import ZeroplanError
from zeroplan.harness.engines import EngineKind, build_engine
from zeroplan.harness.model import build_model
from zeroplan.simulate import _torch_private as private
from zeroplan.simulate.alloc_trace import HOPPER_CUBLAS_WORKSPACE_BYTES, recording_storages
from zeroplan.simulate.fake_world import device_mesh, fake_process_group
from zeroplan.simulate.fused_rms_norm import cuda_rms_norm_formula
from zeroplan.specs import ModelSpec, StrategyKind


def harness_allocation_trace(
    spec: ModelSpec, strategy: StrategyKind, engine: EngineKind, world_size: int, micro_batch: int, seq_len: int,
) -> AllocationTrace:
    """Rank 0 of ``world_size`` on a fake process group, bf16-mixed AdamW, two steps, as on a
    Hopper GPU: RMSNorm saves what torch's fused CUDA kernel saves (fused_rms_norm), and each
    cuBLAS handle has its workspace (HOPPER_CUBLAS_WORKSPACE_BYTES)."""
    if strategy is StrategyKind.ddp:
        # DDP's constructor and its bucket rebuild before the second step read tensor values.
        raise ZeroplanError("strategy", "ddp cannot run on fake tensors (allowed: zero1, zero2, zero3, fsdp-full-shard, "
                            "fsdp-shard-grad-op)")
    with fake_process_group(world_size, 0), cuda_rms_norm_formula():
        # A device mesh reads its rank tensor's values: built here, outside the fake-tensor
        # mode, and handed to the FSDP2 engine in place of the one it would build.
        mesh = device_mesh(world_size)
        with mock.patch("torch.distributed.device_mesh.init_device_mesh", lambda *_args, **_kwargs: mesh), \
                private.fake_tensor_mode(), recording_storages(HOPPER_CUBLAS_WORKSPACE_BYTES) as recorder:
            model = build_model(spec, 0)
            built = build_engine(model, strategy, engine, torch.bfloat16, micro_batch_size=micro_batch)
            _steps(built, spec, micro_batch, seq_len)
    return recorder.trace(f"fake tensors: {strategy.value}:{engine.value}, N {world_size}, b {micro_batch}, s {seq_len}")


def _steps(built, spec: ModelSpec, micro_batch: int, seq_len: int) -> None:  # type: ignore[no-untyped-def]
    """What benchmarks/gpu_allocator.py's _train does in each of two steps (the token values do
    not matter)."""
    for _ in range(2):
        tokens = torch.randint(0, spec.vocab_size, (micro_batch, seq_len))
        targets = torch.randint(0, spec.vocab_size, (micro_batch, seq_len))
        built.forward_backward(tokens, targets)
        built.step()
        built.zero_grad()
        del tokens, targets
