"""Every private or internal PyTorch API the simulator uses, in one place.

The simulator runs real FSDP2 / DDP code with fake tensors under a fake process group. Those
pieces live in private modules (``torch._subclasses``, ``torch.testing._internal``,
``torch.distributed._tools``) that PyTorch may move or change without notice. Nothing else in
``zeroplan.simulate`` imports them: when one moves, this module is the only thing to fix, and
``tests/test_simulate.py::test_private_torch_apis_are_where_we_expect`` fails and names it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

# FakeTensorMode: tensors with shapes, dtypes and devices but no data.
from torch._subclasses.fake_tensor import FakeTensorMode

# The operator type a dispatch mode receives, and the mode's base class.
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Importing fake_pg registers the "fake" backend (and gives the store it needs).
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed._tools.common_utils import get_untyped_storages

FAKE_BACKEND = "fake"
"""The c10d backend name that fake_pg registers."""

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
"""Operator namespaces of c10d's collectives as a TorchDispatchMode sees them."""


def op_schema(func: OpOverload) -> torch._C.FunctionSchema:
    """The operator's schema (argument names and types)."""
    return func._schema


def group_size_by_name(group_name: str) -> int:
    """Ranks in the process group that a functional collective names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def process_group_size(group: object) -> int | None:
    """Ranks in the process group a c10d operator received, or None if ``group`` is none.

    A c10d operator (``c10d._allgather_base_`` ...) receives its group as a TorchScript object
    (``torch.ScriptObject`` of class c10d.ProcessGroup), which has no Python ``size``;
    ``ProcessGroup.unbox`` turns it back into the Python object. Without it a sub-group (one
    axis of a 2-D mesh) would read as the whole world."""
    if isinstance(group, torch.ScriptObject):
        import torch.distributed as dist

        group = dist.ProcessGroup.unbox(group)
    return int(group.size()) if hasattr(group, "size") else None


def fake_tensor_mode(data_dependent_shapes: bool = False) -> FakeTensorMode:
    """A fresh fake-tensor mode; every tensor made under it has metadata only.

    Non-fake inputs are allowed so that ``module.to_empty`` can turn a meta-device model
    (built and sharded outside the mode, where FSDP2's chunking is cheap) into fake tensors.
    ``data_dependent_shapes`` attaches a ShapeEnv, so that operators whose output size
    depends on values (``nonzero`` in MoE routing) return tensors of unknown (unbacked
    symbolic) size instead of raising.
    """
    if data_dependent_shapes:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_store() -> FakeStore:
    return FakeStore()


def storage_key(tensor: torch.Tensor) -> int:
    """An identity for the storage under ``tensor`` (fake storages have no data pointer), valid
    while that storage lives: ``_cdata`` is the StorageImpl's address, which a storage made
    after this one is freed may be given. Storages that may be freed between two calls need
    ``StorageIdentities``."""
    return tensor.untyped_storage()._cdata


class StorageIdentities:
    """Identities of storages seen over time, none given twice: the storage under a tensor gets
    the same number for as long as it lives, and a storage that takes a freed one's address
    (``_cdata``) gets a new number. A weak reference, not a strong one, tells a live storage
    from its successor: a strong one would keep the storage, and the live bytes a MemTracker
    counts (by the weak references it holds on storages, torch/distributed/_tools/mem_tracker.py
    _WeakRefInfo), alive."""

    def __init__(self) -> None:
        self._by_address: dict[int, tuple[int, weakref.ref]] = {}
        self._given = 0

    def __call__(self, tensor: torch.Tensor) -> int:
        # An UntypedStorage's Python object lives as long as its StorageImpl (PyObject
        # preservation: c10/core/StorageImpl.h pyobj_slot_): the weak reference dies with the storage.
        storage = tensor.untyped_storage()
        return self._identity(storage, storage._cdata)

    def of_object(self, tensor: torch.Tensor) -> int:
        """The same for ``tensor`` itself: a wrapper subclass without a storage of its own
        (torchao's NF4Tensor) is its own identity."""
        return self._identity(tensor, id(tensor))

    def _identity(self, thing: object, address: int) -> int:
        entry = self._by_address.get(address)
        if entry is not None and entry[1]() is thing:
            return entry[0]
        identity, self._given = self._given, self._given + 1
        self._by_address[address] = (identity, weakref.ref(thing))
        return identity


@contextlib.contextmanager
def ddp_without_shape_check() -> Iterator[None]:
    """DDP's constructor checks parameter shapes across ranks by reading tensor data in C++,
    which a fake tensor has none of. With one simulated rank the check has nothing to compare,
    so it is skipped while the constructor runs."""
    from torch.nn.parallel import distributed as ddp_module

    original = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = original


def fsdp_mem_tracker_class() -> type:
    """torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker (private)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    return FSDPMemTracker


def mem_tracker_peak_bytes(tracker: object) -> dict[str, int]:
    """The tracker's per-category bytes at the peak, summed over devices, keyed by the
    category's lower-case name ('sharded_param', 'act', ..., 'total')."""
    snapshot = tracker.get_tracker_snapshot("peak")
    totals: dict[str, int] = {}
    for per_category in snapshot.values():
        for category, nbytes in per_category.items():
            name = getattr(category, "name", str(category)).lower()
            totals[name] = totals.get(name, 0) + int(nbytes)
    return totals


def live_bytes_tracker() -> object:
    """torch.distributed._tools.mem_tracker.MemTracker (private): counts the live storages of
    every tensor made while it is entered, fake ones included."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return passing_higher_order_ops(MemTracker())


def passing_higher_order_ops(tracker: object) -> object:
    """``tracker`` (a MemTracker or FSDPMemTracker) with higher-order operators let through.

    A dispatch mode refuses higher-order operators (FlexAttention's flex_attention op) unless
    its ``supports_higher_order_operators`` says so; MemTracker's __torch_dispatch__ calls the op
    and tracks the tensors it returns, which is what it does for any other operator."""
    tracker.supports_higher_order_operators = True
    return tracker


def fsdp_tracker_forgets_each_call(tracker: object, module: object) -> object:
    """Before each forward of the FSDP2 module ``module``, drop the per-module stats the
    FSDPMemTracker ``tracker`` keeps for it (its private ``memory_tracking`` dict), so that it
    takes a repeated call outside the root's forward (ChunkedLossWrapper's per-chunk lm_head)
    as a first call instead of refusing it. The per-module stats are not what is read back:
    the tracker's live and peak bytes are. Returns the hook's handle (its ``remove()``)."""
    def forget(*_):
        tracker.memory_tracking.pop(module, None)
    # Prepended after the tracker's own prepended pre-forward hook: it runs first.
    return module.register_forward_pre_hook(forget, prepend=True)


@contextlib.contextmanager
def tracker_module_stats_set_aside(tracker: object) -> Iterator[None]:
    """While the block runs a second forward of modules the tracker (MemTracker) has seen, its
    private per-module ``memory_tracking`` stats are set aside (it refuses a module's second
    forward otherwise) and restored after, for the first forward's backward hooks to read. The
    tracker's live and peak bytes, what is read back, are untouched."""
    saved = [(module, tracker.memory_tracking[module]) for module in list(tracker.memory_tracking.keys())]
    tracker.memory_tracking.clear()
    try:
        yield
    finally:
        tracker.memory_tracking.clear()
        for module, stats in saved:
            tracker.memory_tracking[module] = stats


def track_existing(tracker: object, module: object) -> None:
    """Count ``module``'s parameters and buffers as live from now on (they exist before the
    forward; untracked, they would be counted when first used)."""
    tracker.track_external(module)


def tracker_forward_peak_growth(tracker: object, module: object) -> int:
    """How far the tracker's live bytes rose, during ``module``'s last forward, above what was
    live when that forward began (MemTracker's private per-module ``memory_tracking`` stats: the
    ``local_peak`` it keeps from the pre-forward hook on, less its PRE_FW snapshot's total)."""
    from torch.distributed._tools.mem_tracker import _ModState

    stats = tracker.memory_tracking[module]
    start = stats.snapshots[_ModState.PRE_FW][-1]
    return sum(int(peak) for peak in stats.local_peak.values()) - sum(int(per_category["Total"]) for per_category in start.values())


def tracker_live_bytes(tracker: object) -> int:
    """Bytes the tracker counts as live now, summed over devices (its 'Total' entry)."""
    snapshot = tracker.get_tracker_snapshot("current")
    return sum(int(per_category["Total"]) for per_category in snapshot.values())


@contextlib.contextmanager
def aten_kernels(kernels: dict[tuple[str, str], object]) -> Iterator[None]:
    """Register Python kernels for aten operators, keyed by (operator, dispatch key), while
    the block runs; torch.library.Library._destroy (private) removes them on exit."""
    library = torch.library.Library("aten", "IMPL")
    try:
        for (name, key), kernel in kernels.items():
            library.impl(name, kernel, key)
        yield
    finally:
        library._destroy()


def flex_attention_without_dynamo() -> None:
    """Let eager FlexAttention run on fake CPU tensors under a dispatch mode. Idempotent.

    torch.nn.attention.flex_attention (private names): eager ``flex_attention`` wraps its
    higher-order op in ``torch.compile(backend="eager", fullgraph=True)``, which refuses to trace
    while a non-infra dispatch mode (MemTracker, selective checkpointing) is active;
    ``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` makes it call the same op directly (its warning
    about backward concerns the numerics of score_mod/mask_mod left untraced; a fake tensor has
    none). ``_validate_device`` refuses CPU inputs that need gradients, as the CPU kernels have
    no backward; a fake tensor runs no kernel, so for fake tensors, and while dynamo traces, the
    check is skipped (real tensors run eagerly still get it).
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.nn.attention import flex_attention as flex_module

    flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    original = flex_module._validate_device
    if getattr(original, "_zeroplan_skips_fake", False):
        return

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        # Under torch.compile (zeroplan.frameworks.compiled) dynamo traces this function with
        # its own fake tensors: the graph is partitioned, never run by a CPU kernel.
        if not isinstance(query, FakeTensor) and not torch.compiler.is_compiling():
            original(query, key, value)

    validate_device._zeroplan_skips_fake = True
    flex_module._validate_device = validate_device


def dtensor_local_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds a DTensor's local shard (``DTensor._local_tensor``, private), itself
    for a plain tensor: an optimizer built over these updates the same bytes FSDP2 stores,
    without DTensor dispatch."""
    return getattr(tensor, "_local_tensor", tensor)


# torch.distributed.pipelining.schedules (torch 2.13): the schedule IR's action tuple. Its
# fields (stage_index, computation_type, microbatch_index, sub_actions) are what a schedule's
# ``pipeline_order`` holds per rank.
def pipeline_action_class() -> type:
    """torch.distributed.pipelining.schedules._Action (private)."""
    from torch.distributed.pipelining.schedules import _Action

    return _Action


@contextlib.contextmanager
def pipeline_stages_static() -> Iterator[None]:
    """Let pipeline schedules start on a fake process group, with real or fake tensors.

    torch 2.13 distributed/pipelining/schedules.py ``_PipelineSchedule._warmup_p2p`` (private)
    runs before the first step: every stage votes (stage.py ``_warmup_forward_vote``,
    ``_warmup_backward_result``) on whether the input and output shapes the user gave suffice
    (InferenceMode.STATIC) or must be exchanged over P2P (DYNAMIC); its only product is each
    stage's ``_inference_mode``. On a fake process group the vote cannot conclude: ``dist.recv``
    fills no buffer, so a stage reads the 0 it initialised, concludes DYNAMIC and then waits for
    shapes through ``recv_object_list``, whose size tensor is never filled either (it asks for
    an uninitialised size, tens of terabytes); under FakeTensorMode, reading the vote
    (``result.item()``) is itself refused as data-dependent. Here the vote is replaced by its
    outcome with every stage built with ``input_args`` and ``output_args``, as the caller's
    are: STATIC for every stage.
    """
    from torch.distributed.pipelining import schedules

    original = getattr(schedules._PipelineSchedule, "_warmup_p2p", None)
    if original is None:
        # torch before the vote (2.6): nothing to replace.
        yield
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def every_stage_static(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = every_stage_static
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original


class ScalarReads(TorchDispatchMode):
    """Answer a fake tensor's value reads (``aten._local_scalar_dense``: ``.item()``,
    ``.tolist()``) with given numbers, in order; any read beyond them raises as the fake mode
    does. Entered inside the fake-tensor mode, it sees each read first.

    A fake tensor has no values, so an operator whose Python caller needs them (torchtitan
    0.3.0 models/common/token_dispatcher.py ``_sync_token_count_exchange``: the all-to-all
    split sizes, ``.tolist()``) cannot run under FakeTensorMode; the caller supplies what the
    real tensors would hold and every answer is kept in ``answered``."""

    # Higher-order operators (FlexAttention's) pass through like any other operator.
    supports_higher_order_operators = True

    def __init__(self, answers: list[int]) -> None:
        super().__init__()
        self.answers = list(answers)
        self.answered: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            if not self.answers:
                raise RuntimeError("a value read no answer was given for (aten._local_scalar_dense)")
            value = self.answers.pop(0)
            self.answered.append(value)
            return value
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cpu_autocast_float32() -> Iterator[None]:
    """``torch.autocast("cpu", dtype=torch.float32)`` enabled, as ``torch.autocast("cuda",
    dtype=torch.float32)`` is.

    torch 2.13 amp/autocast_mode.py ``autocast.__init__`` disables CPU autocast for any dtype
    but bf16/fp16 (a warning, ``_enabled = False``); for CUDA it accepts float32, and the C++
    autocast for the CPU key accepts it too (``torch.set_autocast_dtype("cpu", float32)``:
    linear is in both devices' lower-precision list and casts to fp32). torchtitan 0.3.0
    models/common/moe.py TokenChoiceTopKRouter.forward computes its gate under
    ``torch.autocast(device_type=x.device.type, dtype=torch.float32)``: on a GPU, fp32 scores
    from bf16 inputs; on the CPU, unpatched, bf16 scores. While the block runs, ``torch.autocast``
    is a subclass that keeps a CPU float32 autocast enabled (private attributes ``fast_dtype``,
    ``_enabled``)."""
    original = torch.autocast

    class Float32Autocast(original):
        def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            cpu_float32 = device_type == "cpu" and dtype is torch.float32 and enabled
            super().__init__(device_type, dtype=torch.bfloat16 if cpu_float32 else dtype, enabled=enabled,
                             cache_enabled=cache_enabled)
            if cpu_float32:
                self.fast_dtype = torch.float32
                self._enabled = True

    torch.autocast = Float32Autocast
    try:
        yield
    finally:
        torch.autocast = original


def context_parallel_block_mask_without_compile() -> None:
    """Let context parallelism shard a FlexAttention block mask on fake tensors. Idempotent.

    torch.distributed.tensor.experimental._context_parallel._attention (private)
    ``_create_cp_block_mask`` builds each rank's block mask with a module-level
    ``_compiled_create_block_mask = torch.compile(create_block_mask)``, made on first use. Inductor
    compiles it into a C++ kernel that, run on fake tensors (no data), crashes the process
    (segmentation fault in the generated code). Setting the cached callable to the same
    ``create_block_mask`` uncompiled builds the same mask eagerly.
    """
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention.flex_attention import create_block_mask

    _attention._compiled_create_block_mask = create_block_mask


@contextlib.contextmanager
def recording_inductor_partitions() -> Iterator[list[tuple[object, object, int]]]:
    """Record what inductor's partitioner returns while the block runs: a list that receives
    (forward graph, backward graph, number of forward outputs that are the user's) per call.

    torch 2.13 _inductor/compile_fx.py ``compile_fx`` passes the module-level ``partition_fn``
    (private) to aot_autograd; that runs inductor's joint-graph passes and then
    ``min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor",
    num_fwd_outputs=..., static_lifetime_input_indices=...)``. The wrapper calls the original
    and keeps its result; the forward graph's outputs after the first ``num_fwd_outputs`` are
    what it saves for backward."""
    from torch._inductor import compile_fx

    original = compile_fx.partition_fn
    partitions: list[tuple[object, object, int]] = []

    def recording(gm, joint_inputs, **kwargs):
        forward, backward = original(gm, joint_inputs, **kwargs)
        partitions.append((forward, backward, int(kwargs["num_fwd_outputs"])))
        return forward, backward

    compile_fx.partition_fn = recording
    try:
        yield partitions
    finally:
        compile_fx.partition_fn = original


def inductor_without_codegen(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """A dynamo backend that is inductor's (torch 2.13 _dynamo/backends/inductor.py calls
    ``torch._inductor.compile_fx.compile_fx(gm, example_inputs)``) up to code generation:
    pre-grad passes, inductor's decompositions (select_decomp_table), AOTAutograd's joint graph,
    inductor's ``partition_fn`` and post-grad passes all run; ``inner_compile``, the step that
    turns each partitioned graph into Triton/C++ code (``compile_fx_inner``), is replaced by
    running the FX graph's aten ops as they are (functorch's ``make_boxed_func``, what the
    ``aot_eager`` backend's compilers return), so it runs on fake tensors."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    def fx_graph_as_is(graph: torch.fx.GraphModule, inputs: list, **kwargs: object) -> object:
        return make_boxed_func(graph.forward)

    return compile_fx(gm, example_inputs, inner_compile=fx_graph_as_is)


def dynamo_graph_inputs(gm: torch.fx.GraphModule) -> list[tuple[str, object]]:
    """(source, the value passed) for each input of a dynamo graph, in order: the source it was
    lifted from (``L['x']``, ``L['self']._modules['wo']._parameters['weight']``) and the
    caller's object, from dynamo's private ``grapharg`` node metadata (``GraphArg.example``).
    AOTAutograd's ``primals_i`` is the i-th of them."""
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta["grapharg"]
        inputs.append((arg.source.name, arg.example))
    return inputs


class _NoHook:
    def remove(self) -> None:
        pass


def frozen_parameters_unhooked(tracker: object, module: object) -> None:
    """Keep MemTracker/FSDPMemTracker (private) from registering its gradient hooks on the
    frozen parameters of ``module`` (torch.distributed._tools.mem_tracker
    _track_module_params_and_buffers calls ``param.register_hook`` on every parameter, which
    raises for one without requires_grad, as LoRA's frozen base is): each frozen parameter is
    entered in the tracker's ``_param_to_grad_hook_handles`` with handles that remove nothing,
    so the tracker takes it as hooked already. A frozen parameter never has a gradient to track."""
    for param in module.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))


def inner_tensors(tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The tensors a wrapper tensor subclass holds (torch.utils._python_dispatch
    is_traceable_wrapper_subclass and its ``__tensor_flatten__``: e.g. torchao's NF4Tensor),
    by attribute name; None for a plain tensor."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return None
    return {name: getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]}


def in_backward() -> bool:
    """Whether autograd's engine is running a backward node on this thread now."""
    return torch._C._current_autograd_node() is not None


@contextlib.contextmanager
def fsdp1_on_fake_tensors() -> Iterator[None]:
    """Let torch's FSDP1 (FullyShardedDataParallel) tell a gathered flat parameter from a freed
    one on fake tensors.

    torch 2.13 distributed/fsdp/_flat_param.py ``_writeback_orig_params`` (SHARD_GRAD_OP with
    use_orig_params, which skips the sharded views after the forward) asserts that the gathered
    flat parameter is allocated through its storage's data pointer (the private
    ``_data_ptr_allocated``); a fake tensor's storage has none (0). While entered, that check reads
    the storage's size instead, as FSDP1 itself does for the same question elsewhere
    (``_storage_size_allocated``, private). Its post-backward catch-all reshard asks the same
    question through data pointers too: _catch_all_reshard_on_fake_tensors."""
    from torch.distributed.fsdp import _flat_param, _runtime_utils

    original = _flat_param._data_ptr_allocated, _runtime_utils._catch_all_reshard
    _flat_param._data_ptr_allocated = _flat_param._storage_size_allocated
    _runtime_utils._catch_all_reshard = _catch_all_reshard_on_fake_tensors
    try:
        yield
    finally:
        _flat_param._data_ptr_allocated, _runtime_utils._catch_all_reshard = original


def _catch_all_reshard_on_fake_tensors(state: object) -> None:
    """torch 2.13 distributed/fsdp/_runtime_utils.py ``_catch_all_reshard`` (private), run from
    the root's post-backward final callback: it reshards a unit its post-backward hook did not
    (a frozen flat parameter whose module's inputs need no gradient: no AccumulateGrad, no
    reshard-only hook), unless ``flat_param.data_ptr() == flat_param._local_shard.data_ptr()``
    says it is resharded already. Every fake tensor's data pointer is 0, so that test always
    holds; here the flat parameter is resharded when it holds its shard's elements (a gathered
    one holds the unsharded elements: more, from two ranks on), the rest as torch's."""
    from torch.distributed.fsdp import _runtime_utils

    handle = state._handle
    if not handle:
        return
    flat_param = handle.flat_param
    if flat_param.numel() == flat_param._local_shard.numel() and not handle._skipped_use_sharded_views:
        return
    _runtime_utils._reshard(state, handle, _runtime_utils._should_free_in_backward(state, handle))
