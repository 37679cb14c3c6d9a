"""What one decoder block of a framework's own model saves for backward under torch.compile, and
eagerly, measured on fake tensors at full width.

The block is the framework's own (zeroplan.frameworks.build, one block deep, with the
framework's activation checkpointing); its inputs are the ones the framework's forward hands it
(a forward pre-hook on the block, in a real forward of the model). Two numbers per block:

* compiled: the block is compiled as torchtitan 0.3.0 ``distributed/compile.py apply_compile``
  compiles each TransformerBlock (``block.compile(backend="inductor", fullgraph=True)``, dynamo's
  ``capture_scalar_outputs`` and ``skip_fwd_side_effects_in_bwd_under_checkpoint`` set), with
  inductor's own ``compile_fx`` up to code generation (_torch_private.inductor_without_codegen):
  AOTAutograd traces forward + backward with inductor's decompositions and splits them with
  inductor's ``partition_fn`` (joint-graph passes, then functorch's
  ``min_cut_rematerialization_partition(compiler="inductor")`` under torch's default
  ``torch._functorch.config``: activation_memory_budget 1.0 unless a policy sets it). What the
  forward graph returns beyond the block's output is what the compiled block saves; each saved
  value's bytes come from its FakeTensor metadata.
* eager: the block run uncompiled (the project's eager FlexAttention for torchtitan).

Both are also measured as live bytes (torch's MemTracker): the bytes still live after the
block's forward, with only its autograd graph (``output.grad_fn``) kept and the output and input
references dropped, less those live before. That is what the block keeps for backward, its input
included when it saves it; for the compiled block it checks the partition's list at run time.

Parameters, buffers and inputs every block shares (positions, the block mask) are listed but not
counted as the block's bytes: they exist once per model or per step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeroplan.core.compiled import COMPILED_POLICIES
from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.build import BuiltModel, build
from zeroplan.frameworks.compiled_record import CompiledBlockRecord, SavedValue
from zeroplan.simulate import _torch_private as private
from zeroplan.specs import ActivationCheckpointing, BatchSpec, ModelSpec
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.framework import Framework

COMPILED_FRAMEWORKS = (Framework.torchtitan, Framework.torchtune, Framework.hf)
"""Frameworks whose blocks are measured compiled (torchtitan compiles per block itself; the
others' blocks are compiled the same way, as a ``torch.compile`` user would)."""


FRAMEWORK_NOTES = {
    Framework.torchtitan: [
        "eager FlexAttention (build._eager_flex_attention) also keeps fp32 max_scores; the compiled "
        "graph's flex_attention op saves only its output and log-sum-exp",
    ],
    Framework.torchtune: [
        "attention is torch SDPA: on fake CPU tensors it dispatches to "
        "_scaled_dot_product_flash_attention_for_cpu (a CUDA run picks flash/efficient attention, "
        "which also save output and fp32 log-sum-exp, plus small RNG tensors)",
    ],
    Framework.hf: [
        "attention is torch SDPA: on fake CPU tensors it dispatches to "
        "_scaled_dot_product_flash_attention_for_cpu (a CUDA run picks flash/efficient attention, "
        "which also save output and fp32 log-sum-exp, plus small RNG tensors)",
        "use_cache is the config's default (True): the layer also appends K and V to a DynamicCache, "
        "the same tensors it saves",
    ],
}
"""Caveats of each framework's block run here."""


@dataclass
class BlockSaves:
    """What one run of a block saved for backward."""

    bytes: int
    """Eager: live bytes after the forward with only the autograd graph kept, less before.
    Compiled: distinct storages the compiled autograd node saved, less parameters, buffers and
    shared inputs."""
    values: list[SavedValue]
    """Compiled: the tensors the partitioned forward graph saves. Eager: the tensors autograd's
    saved-tensor hooks saw (only without checkpointing: a checkpoint keeps its inputs itself)."""


def check_compiled(framework: Framework, policy: ActivationCheckpointing, memory_budget: float | None,
                   autocast: bool = False) -> None:
    """Refuse, in one line naming the field, a block measurement this module cannot make."""
    if autocast and framework is not Framework.hf:
        raise ZeroplanError("autocast", f"is transformers' Trainer's bf16 autocast, not {framework.value}'s (allowed only with hf)")
    if framework not in COMPILED_FRAMEWORKS:
        allowed = ", ".join(f.value for f in COMPILED_FRAMEWORKS)
        raise ZeroplanError("--framework", f"{framework.value!r} has no compiled-block measurement (allowed: {allowed})")
    allowed_policies = COMPILED_POLICIES[framework]
    if policy not in allowed_policies:
        allowed = ", ".join(p.value for p in allowed_policies)
        raise ZeroplanError("--activation-checkpointing", f"{policy.value!r} cannot be measured compiled for {framework.value} (allowed: {allowed})")
    if memory_budget is not None:
        if framework is not Framework.torchtitan or policy is not ActivationCheckpointing.none:
            raise ZeroplanError("memory_budget", "is torchtitan's MemoryBudgetAC, which wraps no block (allowed only with torchtitan and checkpointing none)")
        if not 0.0 <= memory_budget <= 1.0:
            raise ZeroplanError("memory_budget", f"must be in [0, 1], got {memory_budget}")


def measure_compiled_block(framework: Framework, model: ModelSpec, policy: ActivationCheckpointing, batch: BatchSpec,
                           dtype: torch.dtype = torch.bfloat16, memory_budget: float | None = None,
                           convert: Callable[[torch.nn.Module], str] | None = None,
                           float8_recipe: str | None = None, finetune: FineTuneSpec = FineTuneSpec(),
                           autocast: bool = False) -> CompiledBlockRecord:
    """One block of ``framework``'s ``model`` under ``policy``, compiled and eager, on fake tensors.

    ``memory_budget``: torchtitan's MemoryBudgetAC (``torch._functorch.config.
    activation_memory_budget``), compiled only. ``convert``: applied to the built model on the
    meta device before it moves to fake tensors (float8's module swap, ``float8_recipe``); it
    returns a note. ``finetune``: the framework's LoRA/QLoRA block (zeroplan.frameworks.lora),
    compiled the same way. ``autocast``: the model's forward (the block's inputs and the block)
    runs under ``torch.autocast(bfloat16)``, as transformers' Trainer runs it with bf16=True
    (accelerate wraps the model's forward in autocast before compiling it), both runs.
    """
    check_compiled(framework, policy, memory_budget, autocast)
    start_s = time.perf_counter()
    notes: list[str] = ["compiled: torch.compile(block, fullgraph=True) through inductor's compile_fx and "
                        "partition_fn (min_cut_rematerialization_partition) without code generation"]
    notes += FRAMEWORK_NOTES[framework]
    if autocast:
        notes.append("forward under torch.autocast('cpu', bfloat16): its cast lists put linear and mm in bf16 as "
                     "CUDA's do; hf's RMSNorm computes in fp32 itself")
    version, eager = _run_block(framework, model, policy, batch, dtype, compiled=False, convert=convert, notes=notes,
                                finetune=finetune, autocast=autocast)
    _, compiled = _run_block(framework, model, policy, batch, dtype, compiled=True, convert=convert,
                             memory_budget=memory_budget, notes=notes, finetune=finetune, autocast=autocast)
    return CompiledBlockRecord(
        framework_version=version, torch_version=torch.__version__, model=model, framework=framework,
        activation_checkpointing=policy, memory_budget=memory_budget, float8_recipe=float8_recipe, finetune=finetune, autocast=autocast,
        batch=batch, module_dtype=str(dtype), compiled_saved_values=compiled.values, compiled_runtime_saved_bytes=compiled.bytes,
        eager_live_bytes=eager.bytes, eager_saved_values=eager.values,
        wall_time_s=time.perf_counter() - start_s, notes=list(dict.fromkeys(notes)),
    )


def _run_block(framework: Framework, model: ModelSpec, policy: ActivationCheckpointing, batch: BatchSpec,
               dtype: torch.dtype, *, compiled: bool, notes: list[str], convert: Callable | None = None,
               memory_budget: float | None = None, finetune: FineTuneSpec = FineTuneSpec(),
               autocast: bool = False) -> tuple[str, BlockSaves]:
    # A fresh dynamo per run: every measurement compiles its own block (no cache, no recompile limit).
    torch._dynamo.reset()
    built = build(framework, model, 1, policy, dtype, batch.seq_len, finetune=finetune)
    if convert is not None:
        notes.append(convert(built.module))
    built.materialize()
    with private.fake_tensor_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        built.to_empty("cpu")
        block = built.blocks[0]
        hidden, rest, kwargs = _block_inputs(built, model, batch)
        saves = block_saves(block, hidden, rest, kwargs, compiled=compiled, memory_budget=memory_budget,
                            listed=policy is ActivationCheckpointing.none)
    return built.version, saves


def block_saves(block: torch.nn.Module, hidden: torch.Tensor, rest: tuple = (), kwargs: dict | None = None, *,
                compiled: bool, memory_budget: float | None = None, listed: bool = True) -> BlockSaves:
    """What ``block(hidden, *rest, **kwargs)`` saves for backward, compiled or eagerly; the
    block's tensors and the inputs fake (a fake-tensor mode active). ``listed``: list the eager
    block's saved tensors too (meaningless under checkpointing)."""
    kwargs = dict(kwargs or {})
    # Taken before the forward: HF's DynamicCache in the kwargs gains the block's K and V.
    shared = _tensors((rest, kwargs))
    if compiled:
        return _compiled(block, hidden, rest, kwargs, shared, memory_budget)
    return _eager(block, hidden, rest, kwargs, shared, listed)


def _compiled(block: torch.nn.Module, hidden: torch.Tensor, rest: tuple, kwargs: dict, shared: list[torch.Tensor],
              memory_budget: float | None) -> BlockSaves:
    # torchtitan 0.3.0 distributed/compile.py apply_compile: these dynamo settings, then
    # transformer_block.compile(backend=<CompileConfig.backend, "inductor">, fullgraph=True).
    dynamo = dict(capture_scalar_outputs=True, skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    # torchtitan 0.3.0 distributed/activation_checkpoint.py MemoryBudgetAC.apply:
    # torch._functorch.config.activation_memory_budget = config.memory_budget.
    functorch = {} if memory_budget is None else {"activation_memory_budget": memory_budget}
    inputs: list[list[tuple[str, object]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        inputs.append(private.dynamo_graph_inputs(gm))
        return private.inductor_without_codegen(gm, example_inputs)

    with torch._dynamo.config.patch(**dynamo), torch._functorch.config.patch(**functorch), \
            private.recording_inductor_partitions() as partitions:
        block.compile(backend=backend, fullgraph=True)
        # A non-leaf, as a block's input is (the previous block's output).
        x = hidden * 1
        output = block(x, *rest, **kwargs)
        output = output[0] if isinstance(output, tuple) else output
    if len(partitions) != 1 or len(inputs) != 1:
        raise RuntimeError(f"expected one compiled graph for the block, got {len(partitions)} partitions "
                           f"of {len(inputs)} dynamo graphs")
    forward, _, user_outputs = partitions[0]
    # Dynamo runs no compiled code under a dispatch mode (MemTracker is one): the tensors the
    # compiled autograd node saved are read from it instead.
    not_own = [*block.parameters(), *block.buffers(), *shared]
    # An NF4 base weight (torchao's NF4Tensor) is saved as its inner tensors, the parameter's own storage.
    not_own += [t for p in block.parameters() for t in (private.inner_tensors(p) or {}).values()]
    return BlockSaves(runtime_saved_bytes(output.grad_fn, not_own), partition_saved_values(forward, user_outputs, inputs[0], x))


def _eager(block: torch.nn.Module, hidden: torch.Tensor, rest: tuple, kwargs: dict, shared: list[torch.Tensor],
           listed: bool) -> BlockSaves:
    """Live bytes the block's forward leaves with only its autograd graph kept, less before;
    with ``listed``, the tensors autograd's saved-tensor hooks see."""
    tracker = private.live_bytes_tracker()
    # Parameters, buffers and the shared inputs exist before the forward: tracked from the start,
    # not counted when first used.
    private.track_existing(tracker, block)
    # A LoRA block's frozen base has no gradient for the tracker to hook.
    private.frozen_parameters_unhooked(tracker, block)
    for tensor in shared:
        private.track_existing(tracker, tensor)
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.setdefault(private.storage_key(tensor), tensor)
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor) if listed else contextlib.nullcontext()
    with tracker, hooks:
        before = private.tracker_live_bytes(tracker)
        # A non-leaf made under the tracker, as a block's input is (the previous block's
        # output): counted once the block saves it, freed if it does not (a leaf would be kept
        # by its AccumulateGrad node).
        x = hidden * 1
        output = block(x, *rest, **kwargs)
        output = output[0] if isinstance(output, tuple) else output
        graph = output.grad_fn
        kinds = {private.storage_key(t): kind for kind, tensors in
                 (("parameter", block.parameters()), ("buffer", block.buffers()), ("shared", shared), ("hidden", [x]))
                 for t in tensors}
        del output, x
        live = private.tracker_live_bytes(tracker) - before
        values = [SavedValue(name=f"saved_{i}", op=_producer(t), shape=list(t.shape), dtype=str(t.dtype),
                             bytes=t.untyped_storage().nbytes(), kind=kinds.get(key, "intermediate"))
                  for i, (key, t) in enumerate(saved.items())] if listed else []
        del graph, saved
    return BlockSaves(live, values)


def _producer(tensor: torch.Tensor) -> str:
    """The autograd node that made a saved tensor (``MmBackward0``), or ``leaf``."""
    return type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else "leaf"


def _block_inputs(built: BuiltModel, model: ModelSpec, batch: BatchSpec) -> tuple[torch.Tensor, tuple, dict]:
    """The arguments the framework's forward passes its first block (block_inputs_of)."""
    tokens = torch.randint(0, model.vocab_size, (batch.micro_batch_size, batch.seq_len))
    return block_inputs_of(built.blocks[0], lambda: built.forward(tokens))


def block_inputs_of(block: torch.nn.Module, forward) -> tuple[torch.Tensor, tuple, dict]:
    """What ``forward()`` passes ``block`` (a forward pre-hook on it, the forward stopped there):
    the hidden state, replaced by a fresh leaf that needs grad, the other positional arguments
    and the keyword arguments."""

    class Stop(Exception):
        pass

    seen: list[tuple[tuple, dict]] = []

    def keep(_module, args, kwargs):
        seen.append((args, kwargs))
        raise Stop

    handle = block.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        forward()
    except Stop:
        pass
    finally:
        handle.remove()
    args, kwargs = seen[0]
    return torch.empty_like(args[0]).requires_grad_(True), tuple(args[1:]), dict(kwargs)


def _tensors(tree: object) -> list[torch.Tensor]:
    """The tensors in a nest of dicts, tuples, lists and dataclass-like objects (a BlockMask)."""
    from torch.utils._pytree import tree_leaves

    found = []
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif callable(leaf) and getattr(leaf, "__closure__", None):
            # a BlockMask's mask_mod closes over the document-id tensors it reads
            found.extend(_tensors([cell.cell_contents for cell in leaf.__closure__]))
        elif hasattr(leaf, "__dict__") and not callable(leaf):
            found.extend(_tensors(list(vars(leaf).values())))
    return found


def runtime_saved_bytes(grad_fn: object, not_own: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages the compiled block's autograd node saved, less those of
    ``not_own`` (parameters, buffers, shared inputs). The output's node may be a view's; the
    compiled function's (``CompiledFunctionBackward``) is found among its next functions."""
    excluded = {private.storage_key(t) for t in not_own}
    pending, seen = [grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__.startswith("CompiledFunction"):
            storages = {private.storage_key(t): t.untyped_storage().nbytes() for t in node.saved_tensors}
            return sum(n for key, n in storages.items() if key not in excluded)
        pending.extend(next_node for next_node, _ in node.next_functions)
    raise RuntimeError("the compiled block's output has no CompiledFunction node")


def partition_saved_values(forward: torch.fx.GraphModule, user_outputs: int, inputs: list[tuple[str, object]],
                  hidden: torch.Tensor) -> list[SavedValue]:
    """The tensors the partitioned forward graph returns for backward, each classified."""
    output = forward.graph.find_nodes(op="output")[0]
    saved = [node for node in output.args[0][user_outputs:] if isinstance(node, torch.fx.Node)]
    placeholders = {node.name: i for i, node in enumerate(forward.graph.find_nodes(op="placeholder"))}
    inputs = _flattened(inputs)
    values = []
    for node in saved:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue  # a saved symbolic size
        source, example = inputs[placeholders[node.name]] if node.name in placeholders else (None, None)
        kind = _kind(source, example is hidden)
        base = _view_base(node)
        if source is None and base.name in placeholders and _kind(inputs[placeholders[base.name]][0], False) == "parameter":
            # A transposed adapter weight (permute of a LoRA parameter) has no storage of its own.
            kind = "parameter"
        values.append(SavedValue(
            name=node.name, op=f"input {source}" if source else _op_name(node), shape=list(value.shape),
            dtype=str(value.dtype), bytes=math.prod(value.shape) * value.element_size(), kind=kind,
        ))
    return values


def _view_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node a chain of aten view ops (permute, t, view...) starts from; ``node`` if none."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _flattened(inputs: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """The dynamo graph's inputs as AOTAutograd's placeholders see them: a traceable tensor
    subclass (torchao's NF4Tensor, a QLoRA base weight) is replaced by its inner tensors, in its
    ``__tensor_flatten__`` order (torch/_functorch/_aot_autograd/subclass_utils.py
    unwrap_tensor_subclasses), each named after the subclass's source."""
    flat = []
    for source, example in inputs:
        inner = private.inner_tensors(example) if isinstance(example, torch.Tensor) else None
        if inner is None:
            flat.append((source, example))
        else:
            flat.extend(_flattened([(f"{source}.{name}", tensor) for name, tensor in inner.items()]))
    return flat


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem":
        return f"{_op_name(node.args[0])}[{node.args[1]}]"
    target = node.target
    return str(target.name() if hasattr(target, "name") else getattr(target, "__name__", target))


def _kind(source: str | None, is_hidden: bool) -> str:
    """intermediate, or for a block input: hidden (the block's activation input, counted),
    parameter, buffer or shared (positions, masks, RoPE tables: once per step)."""
    if source is None:
        return "intermediate"
    if is_hidden:
        return "hidden"
    if "_parameters[" in source:
        return "parameter"
    if "_buffers[" in source:
        return "buffer"
    return "shared"
