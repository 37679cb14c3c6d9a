"""Run a framework's own model forward on fake tensors and record what each block keeps.

What one block keeps for backward is the difference of the bytes still live (torch's
MemTracker, which follows every storage made, fake ones included) once the forwards of
``layers`` and ``layers + 1`` blocks have returned in training mode (``layers + k`` under
selective-layer checkpointing, one period of k blocks, exactly one of them checkpointed;
with activation offloading, less the host copies the framework made): whatever the block's
autograd graph saves, and whatever a checkpoint wrapper keeps to recompute from, stays alive
until backward; temporaries it frees are not counted. The growth across each block during the
deeper forward is recorded beside it. Nothing here knows the planner's formulas: the test and
benchmarks/framework_accuracy.py put the two side by side.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref

import torch

from zeroplan.frameworks.autocast_query import autocast_query_on_device
from zeroplan.frameworks.build import build
from zeroplan.frameworks.record import FrameworkRecord
from zeroplan.simulate import _torch_private as private
from zeroplan.specs.finetune import Quantization
from zeroplan.specs.framework import Framework
from zeroplan.specs import ActivationCheckpointing, BatchSpec, ModelSpec, Precision, StrategyKind, TrainingSpec
from zeroplan.specs.training import measured_on

DEFAULT_PRECISION = {
    # transformers trainer.py TrainingArguments(bf16=True): bf16 compute, fp32 master weights.
    Framework.hf: Precision.bf16_mixed,
    # torchtune 0.6.1 recipes/configs/llama3_1/*full*.yaml: `dtype: bf16` (parameters, gradients
    # and optimizer states in bf16).
    Framework.torchtune: Precision.bf16_pure,
    # torchtitan 0.3.0 config/configs.py: mixed_precision_param "bfloat16", mixed_precision_reduce
    # "float32" (fp32 parameters, bf16 compute under FSDP2's MixedPrecisionPolicy).
    Framework.torchtitan: Precision.bf16_mixed,
}
"""The numerics each framework's own configs train in, when the user names none."""

DEFAULT_LAYERS = 4
"""Blocks built: the first block's growth also holds what the forward made before it, so the
last of the rest is the steady state."""


# transformers trainer.py: with DeepSpeed the engine casts the module to bf16; with DDP the
# Trainer keeps fp32 parameters under torch.autocast; with FSDP, accelerate's FSDP2
# MixedPrecisionPolicy gathers the fp32 shards in bf16 for the forward (build._hf_fsdp2).
# torchtune's recipes load in `dtype: bf16`.
# torchtitan 0.3.0 distributed/fsdp.py apply_fsdp_to_decoder: FSDP2's MixedPrecisionPolicy
# (param_dtype bf16) gathers bf16 parameters, so the module computes in bf16 without autocast.
def module_dtype(training: TrainingSpec, strategy: StrategyKind) -> torch.dtype:
    """The dtype the framework's blocks compute with (what the per-block forward is built in)."""
    if training.precision is Precision.fp32:
        return torch.float32
    if training.framework is Framework.torchtitan:
        return torch.bfloat16
    if training.precision is Precision.bf16_pure or strategy is not StrategyKind.ddp:
        return torch.bfloat16
    if training.finetune.loads_base_in_bf16:
        # A LoRA base loaded with torch_dtype=torch.bfloat16 (FineTuneSpec.base_dtype); the
        # Trainer still runs the forward under its bf16 autocast (_autocast).
        return torch.bfloat16
    return torch.float32


def measure(model: ModelSpec, strategy: StrategyKind, training: TrainingSpec, batch: BatchSpec,
            layers: int = DEFAULT_LAYERS) -> FrameworkRecord:
    """Run ``training.framework``'s forward with ``layers`` and ``layers + 1`` blocks.

    What one block keeps for backward is the difference of the bytes still live once the two
    forwards return (autocast's cache of bf16 weight copies is gone by then, unless autograd
    saved a copy); the growth across each block during the deeper forward is kept too.
    """
    start_s = time.perf_counter()
    dtype = module_dtype(training, strategy)
    notes = []
    if _autocast(training, dtype):
        notes.append(f"forward under torch.autocast(bfloat16) with {str(dtype).removeprefix('torch.')} base parameters")
    if training.activation_offloading:
        notes.append("device bytes: live bytes less the host copies torchtune's OffloadActivations made (its tracker)")
    added = training.selective_layer_interval if training.activation_checkpointing is ActivationCheckpointing.selective_layer else 1
    if training.framework is Framework.torchtitan:
        # zeroplan/frameworks/build.py _eager_flex_attention.
        notes.append("FlexAttention run eagerly: each block also keeps its fp32 max_scores "
                     "(4 bytes x heads x tokens), which a compiled run does not")
    shallow = _forward(model, training, batch, layers, dtype)
    deep = _forward(model, training, batch, layers + added, dtype)
    notes += deep.notes
    return FrameworkRecord(
        framework_version=deep.version, torch_version=torch.__version__, model=model, built_layers=layers, added_layers=added,
        strategy=strategy, training=measured_on(training, "cpu"), batch=batch, module_dtype=str(dtype),
        retained_bytes=[shallow.retained, deep.retained], block_growth_bytes=deep.growth,
        block_saved_tensors=deep.saved, block_forward_peak_bytes=deep.peak,
        wall_time_s=time.perf_counter() - start_s, notes=notes,
    )


def _autocast(training: TrainingSpec, dtype: torch.dtype) -> bool:
    # transformers trainer.py: bf16=True under DDP wraps the forward in autocast whatever the
    # module's dtype; a bf16 LoRA base is the one bf16 module measured on that path.
    if training.precision is not Precision.bf16_mixed:
        return False
    return dtype is torch.float32 or (training.framework is Framework.hf and training.finetune.loads_base_in_bf16)


class _Run:
    """What one forward measured."""

    def __init__(self, version: str, retained: int, growth: list[int], saved: list[str], peak: int, notes: list[str]):
        self.version, self.retained, self.growth, self.saved, self.peak, self.notes = version, retained, growth, saved, peak, notes


def _forward(model: ModelSpec, training: TrainingSpec, batch: BatchSpec, layers: int, dtype: torch.dtype) -> _Run:
    """The framework's version, live device bytes once the forward has returned (parameters
    excluded), each block's growth, and, for the last block, what autograd saved and how far live
    bytes rose inside its forward. On fake tensors, or on real CPU tensors for a model built on
    them (BuiltModel.real: bitsandbytes' QLoRA, which quantizes only on a real device)."""
    # A model of an earlier run that only reference cycles hold (the tracker's hooks) is freed
    # first: with real tensors (hf QLoRA, several GB each) two of them do not fit in memory.
    gc.collect()
    # Everything alive now (imported modules, classes, earlier results) is set aside from the
    # collector until the run ends: the many collections below then scan only what this run
    # makes, which is all they are for (a full scan of torch and the frameworks takes 0.25 s).
    gc.freeze()
    try:
        return _forward_unfrozen(model, training, batch, layers, dtype)
    finally:
        gc.unfreeze()


def _forward_unfrozen(model: ModelSpec, training: TrainingSpec, batch: BatchSpec, layers: int, dtype: torch.dtype) -> _Run:
    built = build(training.framework, model, layers, training.activation_checkpointing, dtype, batch.seq_len,
                  selective_layer_interval=training.selective_layer_interval,
                  activation_offloading=training.activation_offloading, finetune=training.finetune)
    built.materialize()
    marks: list[int] = []
    notes: list[str] = []
    with contextlib.nullcontext() if built.real else private.fake_tensor_mode():
        if built.real:
            notes.append("real CPU tensors (random weights): the model is built as from_pretrained builds it, "
                         "bitsandbytes quantizing each Linear4bit (Linear8bitLt) weight on CPU; live bytes from MemTracker")
            if training.finetune.quantize is Quantization.int8:
                notes.append("Linear8bitLt's forward through MatMul8bitLt, the autograd function bitsandbytes.matmul "
                             "picks on a GPU (on a CPU it picks MatMul8bitFp): zeroplan.frameworks.lora.int8_matmul_as_on_cuda")
        else:
            built.to_empty("cpu")
        tokens = torch.randint(0, model.vocab_size, (batch.micro_batch_size, batch.seq_len))
        tracker = private.live_bytes_tracker()

        def device_bytes() -> int:
            gc.collect()  # what only reference cycles hold (see _collecting) is not live
            return private.tracker_live_bytes(tracker) - built.host_bytes()

        for block in built.blocks:
            block.register_forward_hook(lambda *_: marks.append(device_bytes()))
        private.track_existing(tracker, built.module)
        # Tensors that live beside the parameters (bitsandbytes' QuantState: absmax, code, ...):
        # counted as existing, so that a view of one made in the forward is not taken as new.
        from zeroplan.frameworks.lora import quantization_tensors

        side = [t for p in built.module.parameters() for t in (quantization_tensors(p) or {}).values()]
        if side:
            tracker.track_external(*side)
        private.frozen_parameters_unhooked(tracker, built.module)
        last = built.blocks[-1]
        saved, hooks, settle = _saved_by_last_block(built, side)
        with tracker, hooks, _collecting(built.module):
            before = device_bytes()
            # peft's bitsandbytes adapters ask CUDA's autocast on a GPU, the CPU's here.
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_autocast(training, dtype)), \
                    autocast_query_on_device("cpu"):
                output = built.forward(tokens)
            retained = device_bytes() - before
            settle()
            del output
        peak = private.tracker_forward_peak_growth(tracker, last)
    # The growth of block k counts from the end of block k-1 (its output is not counted twice).
    return _Run(built.version, retained, [marks[k] - marks[k - 1] for k in range(1, len(marks))], saved, peak, notes)


@contextlib.contextmanager
def _collecting(module: torch.nn.Module):
    """Run Python's cycle collector after the forward of every adapter-wrapped layer of
    ``module`` (a peft LoraLayer's lora_A, a torchtune LoRALinear/DoRALinear's lora_a) while
    entered.

    The tracker's ModTracker registers a multi-grad hook on each module's outputs
    (torch/distributed/_tools/mod_tracker.py _fw_post_hook, register_multi_grad_hook), which
    puts the output in a reference cycle through long-lived objects: an output the framework
    drops at once (DoRA's ``lora_b(lora_a(x_eye))``, whose graph holds the in x in identity)
    then lives until a full collection, where without the tracker it is freed when its last
    reference goes. Collecting after each adapter layer's forward frees it there, so that a
    block's forward peak does not count the garbage of the layers before; the kept bytes are read
    after a full collection anyway (device_bytes). A full collection takes most of a second, too
    slow after every module."""
    def collect(*_) -> None:  # a forward hook that returns something replaces the output
        gc.collect()

    handles = [m.register_forward_hook(collect) for m in module.modules() if hasattr(m, "lora_A") or hasattr(m, "lora_a")]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _saved_by_last_block(built, side: list[torch.Tensor]):
    """A list that fills, during the forward, with what autograd saves (torch.autograd.graph.
    saved_tensors_hooks) between the end of the second-to-last block's forward and the end of
    the last one's: 'shape dtype storage-bytes' each, marked '(parameter)' when the storage is a
    parameter's or a quantization state's, '(again)' when an earlier entry holds the same
    storage, '(freed)' when it is gone once the forward has returned (a graph the forward
    dropped); the hooks context; and what marks the freed ones (call it after the forward). Tensors a custom autograd.Function keeps as ctx attributes
    instead of save_for_backward (bitsandbytes' MatMul4Bit ctx.tensors) are not seen."""
    blocks = built.blocks
    # Identities never given twice: a storage saved into a graph branch the forward drops is
    # freed, and its address may pass to a storage saved after it, which is not the same one.
    identities = private.StorageIdentities()
    owned = {_storage(identities, t) for t in [*built.module.parameters(), *built.module.buffers(), *side]}
    done = [0]
    seen: set[int] = set()
    saved: list[str] = []
    alive: list[weakref.ref] = []
    for block in blocks:
        block.register_forward_hook(lambda *_: done.__setitem__(0, done[0] + 1))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if done[0] == len(blocks) - 1:
            key = _storage(identities, tensor)
            mark = " (parameter)" if key in owned else (" (again)" if key in seen else "")
            seen.add(key)
            saved.append(f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} {_storage_bytes(tensor)}{mark}")
            alive.append(weakref.ref(tensor))
        return tensor

    def settle() -> None:
        gc.collect()
        for k, ref in enumerate(alive):
            if ref() is None:
                saved[k] += " (freed)"

    return saved, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), settle


def _storage(identities: private.StorageIdentities, tensor: torch.Tensor) -> int:
    """The storage's identity; a wrapper subclass without storage (torchao's NF4Tensor) is its own."""
    try:
        return identities(tensor)
    except (RuntimeError, NotImplementedError, TypeError):
        return identities.of_object(tensor)


def _storage_bytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return tensor.numel() * tensor.element_size()
