"""What one chunk of a framework's cross-entropy saves for backward when the framework compiles
its loss, and eagerly, on fake tensors.

torchtune 0.6.1 (``compile: True`` in a recipe) calls ``training.compile_loss``, which compiles
``CEWithChunkedOutputLoss.compute_cross_entropy`` (the upcast and the cross-entropy of one
chunk) with the backend named by ``TORCH_COMPILE_BACKEND``; torchtitan 0.3.0 compiles the loss
whenever ``CompileConfig.components`` holds "loss" (its default) through
``BaseLoss._maybe_compile``: ``torch.compile(cross_entropy_loss, backend=CompileConfig.backend)``,
which its ChunkedLossWrapper calls once per chunk, and its unchunked loss (``chunks`` 1,
llama3_debugmodel_ce_loss; 2c8b594's build_cross_entropy_loss, components/loss.py:25-30, compiles
the same F.cross_entropy over ``pred.flatten(0, 1).float()``) once over the whole logits. Both calls run here as the frameworks make
them; the backend they are handed, by name, is inductor's own compile_fx up to code generation
(zeroplan.simulate._torch_private.inductor_without_codegen), whose partition is recorded, as for
the compiled blocks (zeroplan.frameworks.compiled).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from unittest import mock

import torch

from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.compiled import runtime_saved_bytes, partition_saved_values
from zeroplan.frameworks.compiled_record import CompiledLossRecord, SavedValue
from zeroplan.simulate import _torch_private as private
from zeroplan.specs import BatchSpec, ModelSpec
from zeroplan.specs.framework import Framework

LOSS_CHUNKS = {Framework.torchtune: 8, Framework.torchtitan: 8}
"""torchtune 0.6.1 CEWithChunkedOutputLoss(num_output_chunks=8), its configs' loss; torchtitan
0.3.0 ChunkedLossWrapper.Config.num_chunks = 8."""

BACKEND_NAME = "zeroplan_inductor_partition"
"""The dynamo backend name the frameworks are handed (TORCH_COMPILE_BACKEND, CompileConfig.backend)."""

_graph_inputs: list[list[tuple[str, object]]] = []


def _backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    _graph_inputs.append(private.dynamo_graph_inputs(gm))
    return private.inductor_without_codegen(gm, example_inputs)


def _registered_backend() -> str:
    from torch._dynamo.backends.registry import list_backends, register_backend

    if BACKEND_NAME not in list_backends(exclude_tags=()):
        register_backend(_backend, name=BACKEND_NAME)
    return BACKEND_NAME


def _torchtune_loss(compiled: bool) -> tuple[Callable, str]:
    """torchtune's per-chunk cross-entropy, compiled by its own compile_loss, and its version."""
    from importlib.metadata import version

    from torchtune import training
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    loss = CEWithChunkedOutputLoss(num_output_chunks=LOSS_CHUNKS[Framework.torchtune])
    if compiled:
        # compile_loss reads the backend's name from the environment; patch.dict restores it.
        with mock.patch.dict(os.environ, {"TORCH_COMPILE_BACKEND": _registered_backend()}):
            training.compile_loss(loss, verbose=False)
    return loss.compute_cross_entropy, f"torchtune {version('torchtune')}"


def _torchtitan_loss(compiled: bool) -> tuple[Callable, str]:
    """torchtitan's CrossEntropyLoss as ChunkedLossWrapper builds it for each chunk."""
    from importlib.metadata import version

    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig

    config = CompileConfig(enable=compiled, components=["model", "loss"], backend=_registered_backend())
    loss = CrossEntropyLoss(CrossEntropyLoss.Config(), compile_config=config)
    return (lambda pred, labels: loss(pred, labels)[0]), f"torchtitan {version('torchtitan')}"


def _logits_shape(framework: Framework, model: ModelSpec, batch: BatchSpec, chunks: int) -> list[int]:
    """One chunk's logits as the loss receives them: torchtune reshapes each chunk to
    (-1, V) before compute_cross_entropy; torchtitan hands CrossEntropyLoss [b, s/n, V]."""
    if framework is Framework.torchtune and chunks != LOSS_CHUNKS[framework]:
        # A torchtune config without the chunked loss names torch's own nn.CrossEntropyLoss, not compiled.
        raise ZeroplanError("chunks", f"{chunks}: torchtune compiles only its chunked loss (allowed: {LOSS_CHUNKS[framework]})")
    if chunks < 1:
        raise ZeroplanError("chunks", f"{chunks}: a loss has at least one chunk (allowed: 1 or more)")
    if batch.seq_len % chunks:
        raise ZeroplanError("batch.seq_len", f"{batch.seq_len}: the chunked loss needs a multiple of {chunks}")
    if framework is Framework.torchtune:
        return [batch.micro_batch_size * batch.seq_len // chunks, model.vocab_size]
    return [batch.micro_batch_size, batch.seq_len // chunks, model.vocab_size]


def measure_compiled_loss(framework: Framework, model: ModelSpec, batch: BatchSpec,
                          dtype: torch.dtype = torch.bfloat16, chunks: int | None = None) -> CompiledLossRecord:
    """One chunk of ``framework``'s loss over ``model``'s vocabulary, compiled and eager
    (``chunks``: the framework's LOSS_CHUNKS, or torchtitan's unchunked loss with 1)."""
    chunks = LOSS_CHUNKS[framework] if chunks is None else chunks
    builders = {Framework.torchtune: _torchtune_loss, Framework.torchtitan: _torchtitan_loss}
    if framework not in builders:
        allowed = ", ".join(f.value for f in builders)
        raise ZeroplanError("--framework", f"{framework.value!r} has no compiled-loss measurement (allowed: {allowed})")
    start_s = time.perf_counter()
    shape = _logits_shape(framework, model, batch, chunks)
    torch._dynamo.reset()
    _graph_inputs.clear()
    compiled_fn, version = builders[framework](True)
    eager_fn, _ = builders[framework](False)
    with private.fake_tensor_mode():
        leaf = torch.empty(shape, dtype=dtype, requires_grad=True)
        labels = torch.zeros(shape[:-1], dtype=torch.int64)
        # A non-leaf, as the output projection's result is.
        logits = leaf * 1
        with private.recording_inductor_partitions() as partitions:
            output = compiled_fn(logits, labels)
        if len(partitions) != 1 or len(_graph_inputs) != 1:
            raise RuntimeError(f"expected one compiled graph for the loss, got {len(partitions)} partitions "
                               f"of {len(_graph_inputs)} dynamo graphs")
        forward, backward, user_outputs = partitions[0]
        saved = partition_saved_values(forward, user_outputs, _graph_inputs[0], logits)
        runtime = runtime_saved_bytes(output.grad_fn, [])
        gradient = backward.graph.find_nodes(op="output")[0].args[0][0].meta["val"]
        eager = _eager_saved(eager_fn, logits, labels)
    return CompiledLossRecord(
        framework_version=version, torch_version=torch.__version__, model=model, framework=framework, batch=batch,
        chunks=chunks, logits_shape=shape, logits_dtype=str(dtype), compiled_saved_values=saved,
        compiled_runtime_saved_bytes=runtime, compiled_gradient_dtype=str(gradient.dtype), eager_saved_values=eager,
        wall_time_s=time.perf_counter() - start_s,
        notes=["compiled: the framework's own compile call, its backend inductor's compile_fx and partition_fn "
               "without code generation (the partition decides what crosses to backward; buffers inside "
               "inductor's fused kernels are not materialised and not measured)"],
    )


def _eager_saved(fn: Callable, logits: torch.Tensor, labels: torch.Tensor) -> list[SavedValue]:
    """The distinct storages autograd's saved-tensor hooks see in the eager loss, classified as
    the compiled values are (the logits ``hidden``, the labels ``shared``)."""
    seen: dict[object, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen.setdefault(private.storage_key(tensor), tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(logits, labels)
    kinds = {private.storage_key(logits): "hidden", private.storage_key(labels): "shared"}
    return [SavedValue(name=f"saved_{i}", op="eager", shape=list(t.shape), dtype=str(t.dtype),
                       bytes=t.untyped_storage().nbytes(), kind=kinds.get(key, "intermediate"))
            for i, (key, t) in enumerate(seen.items())]
