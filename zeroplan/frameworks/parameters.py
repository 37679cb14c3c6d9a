"""Count the parameters a framework's own builder makes (zeroplan.frameworks.build, on the meta
device; hf QLoRA on real CPU tensors): bytes per decoder block and for the embedding, final norm
and LM head, trainable and frozen, by dtype. A torchao NF4Tensor counts every tensor it holds, a
bitsandbytes Params4bit its packed data and every tensor of its QuantState. Nothing runs forward."""

from __future__ import annotations

import time

import torch
from torch import nn

from zeroplan.frameworks.build import build
from zeroplan.frameworks.lora import quantization_tensors
from zeroplan.frameworks.measure import module_dtype
from zeroplan.frameworks.parameter_record import FrameworkParameterRecord, ParameterBytes
from zeroplan.simulate import _torch_private as private
from zeroplan.specs import ModelSpec, StrategyKind, TrainingSpec
from zeroplan.specs.training import measured_on

DEFAULT_LAYERS = 2
"""Blocks built: two, to show that the blocks are alike."""


def measure_parameters(model: ModelSpec, strategy: StrategyKind, training: TrainingSpec, layers: int = DEFAULT_LAYERS,
                       dtype: torch.dtype | None = None) -> FrameworkParameterRecord:
    """``dtype``: the module dtype to build in (default: the per-block measurement's,
    zeroplan.frameworks.measure.module_dtype)."""
    start_s = time.perf_counter()
    dtype = dtype or module_dtype(training, strategy)
    built = build(training.framework, model, layers, training.activation_checkpointing, dtype, finetune=training.finetune)
    in_block = {id(p) for block in built.blocks for p in block.parameters()}
    embeddings = {id(p) for m in built.module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    outside = {"embedding": ParameterBytes(), "final_norm": ParameterBytes(), "head": ParameterBytes()}
    groups = {"embedding": [], "final_norm": [], "head": []}
    seen: set[int] = set()
    for param in built.module.parameters():  # parameters() yields a tied weight once
        if id(param) in in_block or id(param) in seen:
            continue
        seen.add(id(param))
        group = "embedding" if id(param) in embeddings else ("final_norm" if param.dim() == 1 else "head")
        groups[group].append(param)
    outside = {name: _bytes(params) for name, params in groups.items()}
    storage, layout = _quantized(built.blocks[0])
    return FrameworkParameterRecord(
        framework_version=built.version, torch_version=torch.__version__, model=model, built_layers=layers,
        strategy=strategy, training=measured_on(training, "cpu"), module_dtype=str(dtype),
        blocks=[_bytes(block.parameters()) for block in built.blocks], **outside,
        quantized_storage=storage, quantized_layout=layout, wall_time_s=time.perf_counter() - start_s,
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _bytes(params) -> ParameterBytes:
    trainable: dict[str, int] = {}
    frozen: dict[str, int] = {}
    for param in params:
        inner = private.inner_tensors(param)
        beside = quantization_tensors(param)
        if beside is not None:
            # bitsandbytes Params4bit: NF4, whatever dtype its packed bytes are stored in;
            # Int8Params: int8 codes and their row scales.
            key = "int8" if type(param).__name__ == "Int8Params" else "nf4"
            nbytes = _nbytes(param) + sum(_nbytes(t) for t in beside.values())
        elif inner is None:
            key, nbytes = str(param.dtype).removeprefix("torch."), _nbytes(param)
        else:
            key, nbytes = type(param).__name__.removesuffix("Tensor").lower(), sum(_nbytes(t) for t in inner.values())
        into = trainable if param.requires_grad else frozen
        into[key] = into.get(key, 0) + nbytes
    return ParameterBytes(trainable=trainable, frozen=frozen)


def _quantized(block: nn.Module) -> tuple[dict[str, int], dict[str, str]]:
    storage: dict[str, int] = {}
    layout: dict[str, str] = {}
    for name, param in block.named_parameters():
        beside = quantization_tensors(param)
        if beside is not None:
            inner = {"data": param.data, **beside}
            for attr, tensor in inner.items():
                storage[attr] = storage.get(attr, 0) + _nbytes(tensor)
            shapes = ", ".join(f"{attr} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for attr, t in inner.items())
            if type(param).__name__ == "Int8Params":
                layout[name] = f"Int8Params {{'has_fp16_weights': {param.has_fp16_weights}}}: {shapes}"
                continue
            state = param.quant_state
            sizes = {"blocksize": state.blocksize, "quant_type": state.quant_type,
                     "quant_storage": str(param.quant_storage).removeprefix("torch."), "shape": list(state.shape),
                     "nested_blocksize": state.state2.blocksize if state.nested else None}
            layout[name] = f"Params4bit {sizes}: {shapes}"
            continue
        inner = private.inner_tensors(param)
        if inner is None:
            continue
        for attr, tensor in inner.items():
            storage[attr] = storage.get(attr, 0) + _nbytes(tensor)
        shapes = ", ".join(f"{attr} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for attr, t in inner.items())
        sizes = {k: getattr(param, k) for k in ("block_size", "scaler_block_size", "n_blocks") if hasattr(param, k)}
        layout[name] = f"{type(param).__name__}{list(param.shape)} {sizes}: {shapes}"
    return storage, layout
