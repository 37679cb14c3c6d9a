"""The device-memory traffic of one decoder block's memory-bound kernels, eagerly and under
torch.compile, measured on fake tensors at full width (docs/communication-time.md, "Compile in
the step time").

torch.compile does not change a block's matrix products or its attention kernel (inductor calls
the same extern mm and SDPA kernels); it fuses the elementwise, normalisation and rotary
operations between them into fewer kernels, each reading its inputs and writing its outputs
once. What it saves is device-memory traffic, so it is measured as bytes:

* eager: the block's forward and backward run under a dispatch mode that adds up, per aten
  operator, the distinct bytes of its tensor inputs and outputs (a broadcast input counts its
  stored elements once; views, metadata and allocation move nothing; matrix products and
  attention are left out). torch's fused CUDA RMSNorm is registered for the CPU
  (zeroplan.simulate.fused_rms_norm), so an RMSNorm that reaches it on a GPU is one kernel here too.
* compiled: the block compiled as zeroplan.frameworks.compiled compiles it
  (``block.compile(fullgraph=True)`` through inductor's ``compile_fx``); each partitioned graph
  (forward, backward) goes through inductor's own ``compile_fx_inner`` up to its scheduler, whose
  fusion decides the kernels, and each generated kernel's bytes are inductor's own count
  (``BaseSchedulerNode.get_read_write_buffers_sizes``: every buffer a kernel reads or writes,
  once). Extern kernels (mm, SDPA) are left out, as on the eager side. Code generation is skipped:
  the graphs then run as they are on the fake tensors.

Inductor's scheduler here is its CPU (C++) backend's: it fuses the same pointwise and reduction
chains the Triton backend does (both use ``Scheduler.can_fuse``); what differs between them
(tiling, split reductions, persistent reductions) changes how a kernel runs, not which buffers
it reads and writes.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch

from zeroplan.specs import ActivationCheckpointing, BatchSpec, ModelSpec
from zeroplan.specs.framework import Framework

NO_TRAFFIC = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "slice", "select", "split",
    "split_with_sizes", "unsqueeze", "squeeze", "detach", "alias", "as_strided", "empty", "empty_like",
    "empty_strided", "unbind", "chunk", "_reshape_alias", "lift_fresh", "new_empty", "new_empty_strided",
    "view_as_real", "view_as_complex", "_local_scalar_dense", "sym_size", "is_same_size", "device",
})
"""Operators that move no tensor data (views, metadata, uninitialised allocation)."""
COMPUTE = ("mm", "addmm", "bmm", "baddbmm", "scaled_dot_product", "flash_attention", "efficient_attention")
"""Operator-name markers of the matrix products and attention kernels, which compile does not change."""

TRAFFIC_FRAMEWORKS = (Framework.zeroplan, Framework.hf, Framework.torchtune)
"""Frameworks whose blocks are measured here: the reference transformer (zeroplan.harness) and
the frameworks' own blocks (zeroplan.frameworks.build). torchtitan 0.3.0's block runs
FlexAttention, which inductor does not lower on the CPU."""


@dataclass(frozen=True)
class BlockTraffic:
    """Bytes one block's memory-bound kernels read and write, per token."""

    framework: Framework
    model: ModelSpec
    tokens: int
    eager_forward_bytes_per_token: float
    eager_backward_bytes_per_token: float
    compiled_forward_bytes_per_token: float
    compiled_backward_bytes_per_token: float
    eager_forward_kernels: int
    eager_backward_kernels: int
    compiled_forward_kernels: int
    compiled_backward_kernels: int
    torch_version: str
    wall_time_s: float


def distinct_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the elements a kernel touches: a broadcast (stride-0) dimension counts once."""
    elements = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        if stride != 0:
            elements *= size
    return elements * tensor.element_size()


def _built(framework: Framework, model: ModelSpec, batch: BatchSpec, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """The framework's one-block model on the meta device (None for the reference transformer),
    built outside the fake mode as zeroplan.frameworks.compiled builds it."""
    if framework is Framework.zeroplan:
        return None
    from zeroplan.frameworks.build import build

    built = build(framework, model, 1, ActivationCheckpointing.none, dtype, batch.seq_len)
    built.materialize()
    return built


def _block_and_inputs(framework: Framework, built, model: ModelSpec, batch: BatchSpec, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """(block, hidden, other positional inputs, keyword inputs) on fake tensors (a fake mode active)."""
    if built is None:
        from zeroplan.harness.model import Block

        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            block = Block(model)
        finally:
            torch.set_default_dtype(default)
        hidden = torch.empty(batch.micro_batch_size, batch.seq_len, model.hidden_size, dtype=dtype, requires_grad=True)
        return block, hidden, (), {}
    from zeroplan.frameworks.compiled import _block_inputs

    built.to_empty("cpu")
    hidden, rest, kwargs = _block_inputs(built, model, batch)
    return built.blocks[0], hidden, rest, kwargs


def _run(block, hidden, rest, kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
    x = hidden * 1  # a non-leaf, as a block's input is
    output = block(x, *rest, **kwargs)
    return output[0] if isinstance(output, tuple) else output


def eager_traffic(block, hidden, rest, kwargs) -> tuple[collections.Counter, collections.Counter]:  # type: ignore[no-untyped-def]
    """(bytes, kernels) per pass of the block run eagerly."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    moved: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    phase = ["forward"]

    class Traffic(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in NO_TRAFFIC and not any(marker in name for marker in COMPUTE):
                tensors = [x for x in tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
                moved[phase[0]] += sum(distinct_bytes(x) for x in tensors)
                kernels[phase[0]] += 1
            return out

    x = hidden * 1
    with Traffic():
        output = block(x, *rest, **kwargs)
        output = output[0] if isinstance(output, tuple) else output
    seed = torch.ones_like(output)  # the gradient the next block hands back, made outside the count
    with Traffic():
        phase[0] = "backward"
        output.backward(seed)
    return moved, kernels


class _SchedulerReached(Exception):
    """Stops inductor once its scheduler has fused the graph's kernels."""


def compiled_traffic(block, hidden, rest, kwargs) -> tuple[collections.Counter, collections.Counter]:  # type: ignore[no-untyped-def]
    """(bytes, kernels) per pass of the block's inductor-generated kernels."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import (
        ExternKernelSchedulerNode,
        NopKernelSchedulerNode,
    )

    moved: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()

    def inner(graph: torch.fx.GraphModule, inputs: list, **kwargs: object) -> object:
        phase = "backward" if kwargs.get("is_backward") else "forward"
        original = GraphLowering._update_scheduler

        # torch 2.13 _inductor/graph.py: codegen() first builds the Scheduler (fusion), then
        # writes the kernels; the scheduler's nodes are counted and code generation is skipped.
        def counted(self: GraphLowering) -> None:
            original(self)
            for node in self.scheduler.nodes:
                if isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode)):
                    continue
                moved[phase] += node.get_read_write_buffers_sizes()
                kernels[phase] += 1
            raise _SchedulerReached

        GraphLowering._update_scheduler = counted
        try:
            compile_fx_inner(graph, inputs, **kwargs)
        except Exception as error:  # inductor may wrap the stop in its own error type
            if not _reached(error):
                raise
        finally:
            GraphLowering._update_scheduler = original
        return make_boxed_func(graph.forward)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        return compile_fx(gm, example_inputs, inner_compile=inner)

    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False):
        block.compile(backend=backend, fullgraph=True)
        output = _run(block, hidden, rest, kwargs)
        output.backward(torch.ones_like(output))
    return moved, kernels


def _reached(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, _SchedulerReached):
            return True
        error = error.__cause__ or error.__context__
    return False


def measure_block_traffic(framework: Framework, model: ModelSpec, batch: BatchSpec,
                          dtype: torch.dtype = torch.bfloat16) -> BlockTraffic:
    """One block of ``framework``'s ``model``, eager and compiled, on fake tensors."""
    from zeroplan.errors import ZeroplanError
    from zeroplan.simulate import _torch_private as private
    from zeroplan.simulate.fused_rms_norm import cuda_rms_norm_formula

    if framework not in TRAFFIC_FRAMEWORKS:
        allowed = ", ".join(f.value for f in TRAFFIC_FRAMEWORKS)
        raise ZeroplanError("--framework", f"{framework.value!r} has no block-traffic measurement (allowed: {allowed})")
    start_s = time.perf_counter()
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        built = _built(framework, model, batch, dtype)
        with cuda_rms_norm_formula(), private.fake_tensor_mode():
            block, hidden, rest, kwargs = _block_and_inputs(framework, built, model, batch, dtype)
            results.append((compiled_traffic if compiled else eager_traffic)(block, hidden, rest, kwargs))
    (eager, eager_kernels), (compiled, compiled_kernels) = results
    tokens = batch.micro_batch_size * batch.seq_len
    return BlockTraffic(
        framework=framework, model=model, tokens=tokens,
        eager_forward_bytes_per_token=eager["forward"] / tokens, eager_backward_bytes_per_token=eager["backward"] / tokens,
        compiled_forward_bytes_per_token=compiled["forward"] / tokens,
        compiled_backward_bytes_per_token=compiled["backward"] / tokens,
        eager_forward_kernels=eager_kernels["forward"], eager_backward_kernels=eager_kernels["backward"],
        compiled_forward_kernels=compiled_kernels["forward"], compiled_backward_kernels=compiled_kernels["backward"],
        torch_version=torch.__version__, wall_time_s=time.perf_counter() - start_s,
    )
