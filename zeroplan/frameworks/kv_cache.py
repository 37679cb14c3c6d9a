"""Measure what transformers' KV cache keeps alive in a training forward of its own Llama, on
fake tensors (torch and transformers needed; the record is zeroplan.frameworks.kv_cache_record).

transformers 4.56.2 LlamaConfig defaults use_cache=True (models/llama/configuration_llama.py:173),
and LlamaModel.forward then builds a DynamicCache (models/llama/modeling_llama.py:370-371) whose
DynamicLayer.update keeps each layer's K and V, concatenated onto an empty tensor: a copy
(cache_utils.py:116-118). Only transformers' own gradient checkpointing turns it off
(utils/generic.py:981-985 check_model_inputs, modeling_layers.py:66-68): checkpointing applied
from outside (torch's checkpoint_wrapper, as llama-recipes' FSDP runs apply it) leaves the
cache on, and every layer's K and V stay alive while the model's output object is held.
"""

from __future__ import annotations

import functools
import gc
import time

import torch

from zeroplan.frameworks.build import hf_llama_config
from zeroplan.frameworks.kv_cache_record import KvCacheRecord, KvCacheRun
from zeroplan.frameworks.transformers_release import release_forward
from zeroplan.simulate import _torch_private as private
from zeroplan.specs import BatchSpec, ModelSpec

CHECKPOINTINGS = ("none", "checkpoint_wrapper")


def measure_kv_cache(model: ModelSpec, batch: BatchSpec, layers: int = 2, release: str | None = None,
                     checkpointings: tuple[str, ...] = CHECKPOINTINGS) -> KvCacheRecord:
    """Every (use_cache, checkpointing) pair at ``layers`` and ``layers + 1`` blocks, bf16 module;
    ``release``: an older transformers' head and loss run on the installed model
    (zeroplan.frameworks.transformers_release)."""
    import transformers

    start = time.perf_counter()
    runs = []
    for checkpointing in checkpointings:
        for use_cache in (False, True):
            with release_forward(release):
                shallow = _forward(model, batch, layers, use_cache, checkpointing, backward=False)
                deep = _forward(model, batch, layers + 1, use_cache, checkpointing, backward=True)
            runs.append(KvCacheRun(
                use_cache=use_cache, checkpointing=checkpointing,
                retained_bytes=[shallow[0], deep[0]], loss_only_bytes=[shallow[1], deep[1]],
                forward_peak_bytes=[shallow[2], deep[2]], backward=deep[3],
            ))
    return KvCacheRecord(
        framework_version=f"transformers {transformers.__version__}", torch_version=torch.__version__, model=model,
        batch=batch, built_layers=layers, module_dtype=str(torch.bfloat16), runs=runs, replayed_release=release,
        wall_time_s=time.perf_counter() - start,
        notes=["forward with labels (the loss formed inside LlamaForCausalLM.forward), attn_implementation sdpa, "
               "train mode; live bytes from MemTracker on fake tensors"],
    )


def _forward(model: ModelSpec, batch: BatchSpec, layers: int, use_cache: bool, checkpointing: str,
             backward: bool) -> tuple[int, int, int, str]:
    """(retained with the outputs held, retained with the loss alone, the forward's peak growth,
    what the backward did)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    gc.collect()
    config = hf_llama_config(model, layers)
    config.use_cache = use_cache
    with torch.device("meta"):
        module = LlamaForCausalLM(config).to(torch.bfloat16)
    module.train()
    if checkpointing == "checkpoint_wrapper":
        # llama-recipes policies/activation_checkpointing_functions.py apply_fsdp_checkpointing:
        # checkpoint_wrapper(CheckpointImpl.NO_REENTRANT) on every LlamaDecoderLayer.
        wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        apply_activation_checkpointing(module, checkpoint_wrapper_fn=wrapper,
                                       check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    with private.fake_tensor_mode():
        module.to_empty(device="cpu")
        tokens = torch.randint(0, model.vocab_size, (batch.micro_batch_size, batch.seq_len))
        tracker = private.live_bytes_tracker()
        private.track_existing(tracker, module)

        def live() -> int:
            gc.collect()
            return private.tracker_live_bytes(tracker)

        with tracker:
            before = live()
            outputs = module(input_ids=tokens, labels=tokens)
            retained = live() - before
            peak = private.tracker_forward_peak_growth(tracker, module)
            loss = outputs.loss
            del outputs
            loss_only = live() - before
            done = "not run"
            if backward:
                try:
                    loss.backward()
                    done = "ok"
                except Exception as error:  # the checkpoint's own refusal is what is recorded
                    done = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
            del loss
    return retained, loss_only, peak, done
