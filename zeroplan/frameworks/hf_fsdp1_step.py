"""One whole training step of Hugging Face's Llama under accelerate's FSDP1 path (fsdp_version 1,
accelerate's default), on one simulated rank of N, at full size on fake tensors.

The model is transformers' own (zeroplan.frameworks.build.hf_llama_config), wrapped by torch's
FullyShardedDataParallel with the arguments accelerate 1.10.1's Accelerator.prepare_model hands
it for the Trainer's ``fsdp="full_shard auto_wrap"`` (or ``shard_grad_op``) with ``bf16=True``,
its forward wrapped as prepare_model wraps it (autocast, outputs converted to fp32), and driven
as transformers 4.56.2's Trainer drives it: ``model(**inputs)`` with labels, ``.loss``,
backward, the fused AdamW built after the wrapping over ``model.parameters()``, then
``model.zero_grad()``.

FSDP2's FSDPMemTracker follows fully_shard only, and torch's MemTracker cannot hook FSDP1's
unsharded parameter views (non-leaf tensors during the forward), so what the rank holds is
counted from every storage made and freed (zeroplan.simulate.alloc_trace.StorageTrace, which
also follows FSDP1's ``UntypedStorage.resize_`` frees and re-allocations of its gathered flat
parameters), from the sharded model on, without cuBLAS workspaces. The peak of the second
step is the record. Nothing here knows the planner's formulas.

A QLoRA is PEFT's over bitsandbytes' own Linear4bit, quantized on the fake device through its
registered fake kernels (zeroplan.frameworks.lora.hf_sharded_qlora_llama). Under CPU offload
the run still has one device, so what FSDP1 keeps on the host is named and left out of the count
(_host_storage_ids), and where FSDP1 tells the host from the device by comparing the two, the
comparison is made to answer as on a GPU (_offloaded_gradients_on_one_device).
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

from zeroplan.allocator.trace import AllocEvent
from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.autocast_query import autocast_query_on_device
from zeroplan.frameworks.build import build
from zeroplan.frameworks.step import ADAMW_LR, check_step
from zeroplan.frameworks.step_record import FrameworkStepRecord, StepPhase
from zeroplan.simulate import _torch_private as private
from zeroplan.simulate.alloc_trace import recording_storages
from zeroplan.simulate.fake_world import DEVICE, fake_process_group, storage_bytes
from zeroplan.specs import BatchSpec, ModelSpec, StrategyKind, TrainingSpec, check_seq_len
from zeroplan.specs.finetune import Quantization
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import measured_on

FSDP1_STRATEGIES = {
    # accelerate 1.10.1 utils/constants.py FSDP_SHARDING_STRATEGY: FULL_SHARD, SHARD_GRAD_OP, ...;
    # transformers 4.56.2 training_args.py maps fsdp="full_shard" / "shard_grad_op" onto them.
    StrategyKind.fsdp_full_shard: "FULL_SHARD",
    StrategyKind.fsdp_shard_grad_op: "SHARD_GRAD_OP",
}
"""Strategies the FSDP1 step runs -> torch's ShardingStrategy name."""

FSDP1_PARAM_DTYPE = torch.bfloat16
"""accelerate 1.10.1 utils/dataclasses.py FullyShardedDataParallelPlugin.set_mixed_precision("bf16")
under fsdp_version 1: MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)
(buffer_autocast False)."""

STORAGE_TRACE_NOTE = (
    "peak counted from every storage made and freed (StorageTrace, FSDP1's storage resizes "
    "included), not by FSDPMemTracker, which follows fully_shard only: no categories at the peak"
)

SYNC_MODULE_STATES_NOTE = (
    "sync_module_states=False: torch's FSDP1 accepts True only on a GPU; it broadcasts rank 0's "
    "values into the flat parameters in place at construction (_init_utils.py "
    "_sync_module_params_and_buffers) and leaves nothing behind"
)


def check_hf_fsdp1_step(strategy: StrategyKind, training: TrainingSpec, world_size: int, rank: int) -> None:
    """Refuse, in one line naming the field, what the FSDP1 step does not run."""
    if training.framework is not Framework.hf:
        raise ZeroplanError("--framework", f"{training.framework.value!r}: accelerate's FSDP1 step is hf's (allowed: hf)")
    if strategy not in FSDP1_STRATEGIES:
        allowed = ", ".join(k.value for k in FSDP1_STRATEGIES)
        raise ZeroplanError("--strategy", f"{strategy.value!r} is not a sharding strategy the FSDP1 step runs (allowed: {allowed})")
    finetune = training.finetune
    if not finetune.trains_everything and not finetune.is_lora:
        raise ZeroplanError("finetune", "accelerate's FSDP1 step runs full fine-tuning or PEFT LoRA (allowed: no frozen blocks)")
    if finetune.dora or finetune.quantize not in (Quantization.none, Quantization.nf4):
        raise ZeroplanError("finetune", "accelerate's FSDP1 step runs PEFT LoRA over a bf16 or nf4 base, without DoRA "
                                        "(allowed: quantize none or nf4, dora false)")
    if finetune.quantize.is_quantized and finetune.kbit_fp32_cast:
        # FSDP1 flattens a unit's parameters into one FlatParameter of one dtype
        # (_flat_param.py _validate_tensors_to_flatten); trl's SFTTrainer skips the cast for it.
        raise ZeroplanError("finetune.kbit_fp32_cast", "FSDP1 flattens one dtype a unit: a sharded QLoRA keeps its "
                                                       "norms bf16 (allowed: false)")
    check_step(Framework.hf, strategy, training, world_size, rank)


def hf_fsdp1_wrap(module: torch.nn.Module, strategy: StrategyKind, peft: bool = False, offload: bool = False,
                  use_orig_params: bool = True) -> tuple[torch.nn.Module, str]:
    """accelerate 1.10.1 accelerator.py Accelerator.prepare_model for a model under
    DistributedType.FSDP with fsdp_version 1, as the calls it makes (accelerate itself needs an
    Accelerator and a launched process group); returns the FSDP root and a one-line description.

    Lines 1744-1755: with native amp (bf16) the model's forward becomes
    convert_outputs_to_fp32(autocast(forward)); the context is
    utils/modeling.py get_mixed_precision_context_manager's torch.autocast(device_type, bf16).
    Lines 1863-1889: FSDP(model, sharding_strategy, cpu_offload, auto_wrap_policy,
    mixed_precision, sync_module_states, backward_prefetch, forward_prefetch, use_orig_params,
    param_init_fn, ignored_modules, limit_all_gathers, device_id) with the plugin the Trainer
    set up: transformers 4.56.2 training_args.py (lines 2003-2035) sets FSDP_SHARDING_STRATEGY
    from ``fsdp``, the transformer-based auto wrap (``auto_wrap``; utils/dataclasses.py
    set_auto_wrap_policy: the classes in ``model._no_split_modules``), BACKWARD_PREFETCH
    "NO_PREFETCH" (None), FORWARD_PREFETCH false, SYNC_MODULE_STATES true, USE_ORIG_PARAMS true;
    limit_all_gathers is the plugin's default True (trainer.py line 5505 keeps it unless
    fsdp_config names it); no CPU offload. Lines 1916-1956: with mixed precision on, a flat
    parameter that is not fp32 and requires a gradient is upcast to fp32 (a full fine-tune is
    built in fp32 already; a LoRA's frozen base keeps the dtype it was loaded in).

    ``peft``: transformers 4.56.2 trainer.py _fsdp_qlora_plugin_updates (called before
    accelerator.prepare for a PeftModel) sets the plugin's auto_wrap_policy to peft 0.17.1
    utils/other.py fsdp_auto_wrap_policy(model): _or_policy of a lambda policy (every leaf module
    whose weight requires grad: each lora_A and lora_B nn.Linear its own unit) and the transformer
    policy over _no_split_modules; accelerate's set_auto_wrap_policy leaves a policy that is not
    transformer_auto_wrap_policy itself as it is.

    ``offload``: fsdp_offload_params true (the Trainer's fsdp "offload"): accelerate 1.10.1
    utils/dataclasses.py set_cpu_offload makes it CPUOffload(offload_params=True).
    ``use_orig_params``: the plugin's fsdp_use_orig_params; the Trainer's default is true, PEFT's
    and the notebooks' QLoRA configs (fsdp_config_qlora.yaml) set false. For a QLoRA,
    _fsdp_qlora_plugin_updates also sets the mixed precision to bnb_4bit_quant_storage (bf16: the
    same policy)."""
    from accelerate.utils.operations import convert_outputs_to_fp32
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    dtype = FSDP1_PARAM_DTYPE
    autocast = torch.autocast(device_type=torch.device(DEVICE).type, dtype=dtype)
    module.forward = convert_outputs_to_fp32(autocast(module.forward))
    wrap = {type(m) for m in module.modules() if type(m).__name__ in module._no_split_modules}
    if peft:
        from peft.utils.other import fsdp_auto_wrap_policy

        policy, policy_name = fsdp_auto_wrap_policy(module), "peft fsdp_auto_wrap_policy(lora leaves, "
    else:
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=wrap)
        policy_name = "transformer_auto_wrap_policy("
    sharding = FSDP1_STRATEGIES[strategy]
    root = FullyShardedDataParallel(
        module, sharding_strategy=ShardingStrategy[sharding], cpu_offload=CPUOffload(offload_params=True) if offload else None,
        auto_wrap_policy=policy,
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype),
        sync_module_states=False, backward_prefetch=None, forward_prefetch=False, use_orig_params=use_orig_params,
        limit_all_gathers=True, device_id=torch.device(DEVICE),
    )
    upcast = _upcast_trainable_flat_parameters(root)
    return root, (f"accelerate prepare_model (fsdp_version 1): FullyShardedDataParallel({sharding}, "
                  f"{policy_name}{', '.join(sorted(module._no_split_modules))}), "
                  f"MixedPrecision(param_dtype={dtype}, reduce_dtype={dtype}, buffer_dtype={dtype}), "
                  f"use_orig_params={use_orig_params}, limit_all_gathers=True, no backward prefetch"
                  f"{', CPUOffload(offload_params=True)' if offload else ''}), forward under "
                  f"autocast(bf16) with outputs converted to fp32, {upcast}")


def _upcast_trainable_flat_parameters(root: torch.nn.Module) -> str:
    """accelerate 1.10.1 accelerator.py lines 1916-1956 (mixed precision on): every FSDP unit's
    flat parameter that is not fp32, not on meta and requires grad becomes fp32 (``param.data =
    param.data.to(torch.float32)``, ``_handle._orig_param_dtype = torch.float32``); a frozen one
    (use_orig_params: a FlatParameter requires grad only if one of its parameters does) keeps its
    dtype. Returns the flat parameters' dtypes, trainable and frozen."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for unit in FullyShardedDataParallel.fsdp_modules(root):
        if not unit._has_params:
            continue
        param = unit._flat_param
        if param.dtype != torch.float32 and param.device != torch.device("meta") and param.requires_grad:
            param.data = param.data.to(torch.float32)
            unit._handle._orig_param_dtype = torch.float32
    dtypes = {grad: sorted({str(h.flat_param.dtype) for h in _handles(root) if h.flat_param.requires_grad is grad})
              for grad in (True, False)}
    frozen = f", frozen {'/'.join(dtypes[False])}" if dtypes[False] else ""
    return f"trainable flat parameters {'/'.join(dtypes[True])}{frozen}"


def run_hf_fsdp1_step(model: ModelSpec, strategy: StrategyKind, training: TrainingSpec, batch: BatchSpec,
                      world_size: int, rank: int = 0, use_orig_params: bool = True) -> FrameworkStepRecord:
    """Forward (with the loss), backward and AdamW step of hf's Llama (or PEFT's LoRA or QLoRA
    over it) under accelerate's FSDP1 on ``rank``: the second step of training (the first,
    counted only for its end state, creates AdamW's states), each step of
    ``batch.grad_accum_steps`` micro-batches, all but the last under FSDP1's no_sync as the
    Trainer runs them. With ``training.fsdp_cpu_offload`` the storages FSDP1 keeps on the host
    are left out of the device's count (_host_storage_ids)."""
    strategy = StrategyKind(strategy)
    check_hf_fsdp1_step(strategy, training, world_size, rank)
    check_seq_len(model, batch)
    start_s = time.perf_counter()
    finetune = training.finetune
    # A full fine-tune is built in fp32 (accelerate upcasts every trainable flat parameter to it
    # anyway); a LoRA's base is loaded in its base_dtype (from_pretrained(dtype=...)), PEFT's
    # adapters made fp32 (zeroplan.frameworks.lora.hf_peft_llama); a QLoRA's as PEFT's FSDP
    # guide loads it (zeroplan.frameworks.lora.hf_sharded_qlora_llama).
    dtype = torch.bfloat16 if finetune.loads_base_in_bf16 else torch.float32
    if finetune.quantize.is_quantized:
        from zeroplan.frameworks.build import _hf_llama
        from zeroplan.frameworks.lora import hf_sharded_qlora_llama

        built = hf_sharded_qlora_llama(model, model.num_layers, training.activation_checkpointing, finetune, _hf_llama)
    else:
        built = build(Framework.hf, model, model.num_layers, training.activation_checkpointing, dtype, batch.seq_len,
                      finetune=finetune)
    offload = training.fsdp_cpu_offload
    marks: dict[str, int] = {}
    with (fake_process_group(world_size, rank), private.fsdp1_on_fake_tensors(), private.fake_tensor_mode(),
          _bnb_quant_state_on_views(), _offload_on_one_device(offload),
          autocast_query_on_device(torch.device(DEVICE).type), recording_storages() as recorder,
          _offloaded_gradients_on_one_device(offload, recorder) as host_made):
        built.to_empty(DEVICE)
        root, sharding = hf_fsdp1_wrap(built.module, strategy, peft=finetune.is_lora, offload=offload,
                                       use_orig_params=use_orig_params)
        # transformers 4.56.2 trainer.py _inner_training_loop: under FSDP the optimizer is
        # created after the model is wrapped (delay_optimizer_creation), over model.parameters():
        # with use_orig_params the original parameters, views into this rank's flat shards
        # (without it, the flat parameters); create_optimizer keeps those that require grad (its
        # two weight-decay groups). training_args.py default optim adamw_torch_fused:
        # torch.optim.AdamW(fused=True).
        params = [p for p in root.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=ADAMW_LR, fused=True)
        tokens = torch.randint(0, model.vocab_size, (batch.micro_batch_size, batch.seq_len))
        # A first step: AdamW creates its states lazily in it, and a run that fits must fit
        # from the second step on, with the states alive throughout.
        _trainer_step(root, optimizer, tokens, batch.grad_accum_steps, recorder, marks, "first")
        _trainer_step(root, optimizer, tokens, batch.grad_accum_steps, recorder, marks, "")
        flat = [handle.flat_param for handle in _handles(root)]
        parameter_bytes = storage_bytes(flat)
        states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        optimizer_state_bytes = storage_bytes(states)
        host = _host_storage_ids(root, states, recorder) | host_made if offload else frozenset()
    running = _running_peaks(recorder.events, marks, host)
    peak = max(running.values())
    phase = next(p for p, nbytes in running.items() if nbytes == peak)
    notes = [STORAGE_TRACE_NOTE, SYNC_MODULE_STATES_NOTE]
    if finetune.quantize.is_quantized:
        notes.append(QUANT_STATE_NOTE)
    if offload:
        notes.append(OFFLOAD_NOTE)
    return FrameworkStepRecord(
        framework_version=built.version, torch_version=torch.__version__, model=model, strategy=strategy,
        world_size=world_size, rank=rank, training=measured_on(training, DEVICE), batch=batch, sharding=sharding,
        fsdp_version=1, optimizer="torch.optim.AdamW(fused=True), torch.float32 parameters", peak_bytes=peak,
        peak_by_category={}, peak_phase=phase, running_peak_bytes=running,
        parameter_bytes=0 if offload else parameter_bytes,
        gradient_bytes=0 if offload else marks["gradient_bytes"],
        optimizer_state_bytes=0 if offload else optimizer_state_bytes,
        wall_time_s=time.perf_counter() - start_s, notes=notes,
    )


QUANT_STATE_NOTE = (
    "each Linear4bit's QuantState (absmax, its double-quantized scales) lives beside the FSDP unit "
    "as an attribute of the module, on the device, whole on every rank; on fake tensors "
    "fix_4bit_weight_quant_state_from_module attaches it to FSDP1's view of the weight instead of "
    "re-wrapping the view in a Params4bit, which allocates nothing on a GPU either"
)

OFFLOAD_NOTE = (
    "CPUOffload(offload_params=True): the fake run has one device, so the storages FSDP1 puts on the "
    "host (each flat parameter's _local_shard, its pinned _cpu_grad, and AdamW's states over them) are "
    "left out of the count; the host shard's device copy before each all-gather (pre_unshard) is not "
    "made when both are one device, and is not counted"
)


def _host_storage_ids(root: torch.nn.Module, states: list[torch.Tensor], recorder: object) -> frozenset[int]:
    """Trace ids of the storages CPUOffload(offload_params=True) keeps on the host: torch's FSDP1
    _init_utils.py / _flat_param.py put each sharded flat parameter (_local_shard) on the CPU and
    make its gradient's host copy _cpu_grad there (_flat_param.py _init_param_attributes; the
    post-backward _offload_grad copies the reduced shard into it); the optimizer is built over
    those host flat parameters, so its states are on the host too."""
    tensors = list(states)
    for handle in _handles(root):
        param = handle.flat_param
        tensors.append(param._local_shard)
        if getattr(param, "_cpu_grad", None) is not None:
            tensors.append(param._cpu_grad)
    return frozenset(recorder.trace_id(t.untyped_storage()) for t in tensors)


@contextlib.contextmanager
def _offloaded_gradients_on_one_device(offload: bool, recorder: object):
    """Two places where FSDP1 under CPUOffload compares a gradient's device with the flat
    parameter's, which agree when the run has one device; yields the trace ids of the host
    storages made meanwhile.

    torch 2.13 _flat_param.py prepare_gradient_for_backward (each unit's pre-backward hook): a
    sharded gradient left from the last step is the host's _cpu_grad (grad_offloaded), so FSDP1
    drops it (``flat_param.grad = None``) and keeps no _saved_grad_shard; the post-backward
    _accumulate_sharded_grad then keeps the unit's new reduced fp32 shard itself as
    _saved_grad_shard on the device until the post-backward final callback's
    prepare_gradient_for_optim deletes it (_offload_grad has copied it into _cpu_grad). On one
    device the comparison finds no offload and would keep the old gradient on the device to
    accumulate into: here the offloaded branch is taken, as on a GPU.
    _writeback_orig_params (pre_unshard, before the all-gather, while the flat parameter is its
    host _local_shard): an original parameter whose .grad outlived the flat parameter's gets
    ``torch.zeros_like(flat_param)``, a host buffer; its trace id is collected."""
    made: set[int] = set()
    if not offload:
        yield made
        return
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    prepare, writeback = FlatParamHandle.prepare_gradient_for_backward, FlatParamHandle._writeback_orig_params

    def prepare_offloaded(self: FlatParamHandle) -> None:
        flat = self.flat_param
        if self._offload_params and flat.grad is not None and flat.grad.size() == flat._local_shard.size():
            flat.grad = None
            return
        prepare(self)

    def writeback_on_host(self: FlatParamHandle) -> bool:
        before = self.flat_param.grad
        wrote = writeback(self)
        grad = self.flat_param.grad
        if self._offload_params and grad is not None and grad is not before:
            made.add(recorder.trace_id(grad.untyped_storage()))
        return wrote

    FlatParamHandle.prepare_gradient_for_backward = prepare_offloaded  # type: ignore[method-assign]
    FlatParamHandle._writeback_orig_params = writeback_on_host  # type: ignore[method-assign]
    try:
        yield made
    finally:
        FlatParamHandle.prepare_gradient_for_backward = prepare  # type: ignore[method-assign]
        FlatParamHandle._writeback_orig_params = writeback  # type: ignore[method-assign]


@contextlib.contextmanager
def _offload_on_one_device(offload: bool):
    """Two calls FSDP1 makes only under offload, which the CPU-only fake run cannot take: torch's
    _flat_param.py _init_param_attributes pins each trainable flat parameter's host gradient
    (``torch.zeros_like(...).pin_memory()``; fake tensors have no pin_memory kernel, and the
    buffer is the host's, _host_storage_ids), so it stays unpinned; _runtime_utils.py
    _post_backward_final_callback waits for the gradients' device-to-host copies with
    ``current_stream().synchronize()``, which torch.cpu's Stream lacks: a no-op here (nothing
    is in flight)."""
    if not offload:
        yield
        return
    pin, stream = torch.Tensor.pin_memory, torch.cpu.Stream
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    had = hasattr(stream, "synchronize")
    if not had:
        stream.synchronize = lambda self: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.Tensor.pin_memory = pin  # type: ignore[method-assign]
        if not had:
            del stream.synchronize


@contextlib.contextmanager
def _bnb_quant_state_on_views():
    """bitsandbytes 0.50.2 nn/modules.py fix_4bit_weight_quant_state_from_module, which
    Linear4bit.forward calls first: once FSDP1 has replaced the Params4bit by a plain view of its
    gathered flat parameter, it wraps the view in Params4bit (``_make_subclass``, sharing the
    view's storage) and attaches the module's QuantState. A fake tensor cannot be re-wrapped, so
    the state is attached to the view itself: the same tensors, nothing allocated either way."""
    from bitsandbytes.nn import modules

    original = modules.fix_4bit_weight_quant_state_from_module

    def attach(module: torch.nn.Module) -> None:
        if getattr(module.weight, "quant_state", None) is None:
            module.weight.quant_state = module.quant_state

    modules.fix_4bit_weight_quant_state_from_module = attach
    try:
        yield
    finally:
        modules.fix_4bit_weight_quant_state_from_module = original


def _handles(root: torch.nn.Module) -> list:
    """Every FSDP unit's FlatParamHandle (a unit without parameters has none)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [unit._handle for unit in FullyShardedDataParallel.fsdp_modules(root) if unit._handle is not None]


def _trainer_step(root: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, micro_batches: int,
                  recorder: object, marks: dict[str, int], prefix: str) -> None:
    """transformers 4.56.2 trainer.py training_step -> compute_loss: outputs = model(**inputs)
    with labels in the inputs (the loss is computed in the forward, ForCausalLMLoss), only
    outputs.loss leaves compute_loss; accelerator.backward(loss) (divided by the accumulation
    steps); then optimizer.step() and model.zero_grad() (set_to_none). Each of
    ``micro_batches`` but the last runs under accelerate's no_sync (trainer.py lines 2665-2671:
    functools.partial(accelerator.no_sync, model=model) unless it is the last; accelerator.py
    no_sync enters the model's own no_sync, FSDP1's FullyShardedDataParallel.no_sync).
    ``marks`` gets the trace's length at each phase's end, per micro-batch."""
    def events() -> int:
        return len(recorder.events)

    marks[f"{prefix}start"] = events()
    for index in range(micro_batches):
        last = index == micro_batches - 1
        with contextlib.nullcontext() if last else root.no_sync():
            loss = root(input_ids=tokens, labels=tokens).loss
            marks[f"{prefix}forward{index}"] = events()
            # accelerator.py backward: loss / gradient_accumulation_steps (a scalar; at one
            # micro-batch, the division by 1 the one-micro-batch records leave out: 4 bytes).
            (loss / micro_batches if micro_batches > 1 else loss).backward()
            del loss
            marks[f"{prefix}backward{index}"] = events()
    marks["micro_batches"] = micro_batches
    if not prefix:
        marks["gradient_bytes"] = storage_bytes(h.flat_param.grad for h in _handles(root) if h.flat_param.grad is not None)
    optimizer.step()
    root.zero_grad(set_to_none=True)
    marks[f"{prefix}optimizer"] = events()


def _running_peaks(events: list, marks: dict[str, int], host: frozenset[int] = frozenset()) -> dict[StepPhase, int]:
    """The most bytes live at once in the second step up to the end of each phase (the live bytes
    when it begins included), from the trace's allocations and frees; the storages in ``host``
    (trace ids) are not the device's."""
    last = marks["micro_batches"] - 1
    bounds = []
    begin = marks["start"]
    for index in range(marks["micro_batches"]):
        bounds += [(StepPhase.forward, begin, marks[f"forward{index}"]),
                   (StepPhase.backward, marks[f"forward{index}"], marks[f"backward{index}"])]
        begin = marks[f"backward{index}"]
    bounds.append((StepPhase.optimizer, marks[f"backward{last}"], marks["optimizer"]))
    sizes: dict[int, int] = {}
    live, peak, peaks = 0, 0, {}
    index = 0
    for phase, begin, end in bounds:
        while index < begin:
            live = _apply(events[index], sizes, live, host)
            index += 1
        peak = max(peak, live)
        while index < end:
            live = _apply(events[index], sizes, live, host)
            peak = max(peak, live)
            index += 1
        peaks[phase] = peak
    return peaks


def _apply(event: object, sizes: dict[int, int], live: int, host: frozenset[int]) -> int:
    if isinstance(event, AllocEvent):
        sizes[event.id] = 0 if event.id in host else event.size_bytes
        return live + sizes[event.id]
    return live - sizes.pop(event.id)
