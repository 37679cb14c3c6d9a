"""A model's own compute-dtype loss (ModelSpec.own_loss_in_compute_dtype, zeroplan.core.own_loss):
Qwen-1's presets carry it, HF's Trainer runs it in the source's order, and an epoch of
varying-length batches keeps two segments a record for it, not the reference loss's three."""

from __future__ import annotations

import functools

import pytest

from zeroplan.allocator.varying_lengths import record_tensor_bytes
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.framework_loss import framework_logits_tensors
from zeroplan.core.own_loss import own_loss_tensors, runs_own_loss
from zeroplan.core.plan import peak_terms
from zeroplan.presets.models import get_model
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import Precision

V = 151_936


@functools.lru_cache(maxsize=None)
def _request(model: str, *extra: str, strategy: StrategyKind = StrategyKind.ddp):
    args = build_parser().parse_args(["fit", model, "--gpus", "1", "--gpu", "a100-80gb", "--seq-len", "2048",
                                      "--precision", "bf16-pure", "--activation-checkpointing", "full", *extra])
    return request_from_args(args, strategy)


def test_qwen1_presets_carry_their_own_loss_and_others_do_not() -> None:
    for name in ("qwen-1.8b", "qwen-7b", "qwen-14b", "qwen-72b", "Qwen-1_8B"):
        assert get_model(name).own_loss_in_compute_dtype, name
    for name in ("qwen2.5-1.5b", "qwen2-7b", "qwen3-8b", "yi-6b", "llama-2-7b"):
        assert not get_model(name).own_loss_in_compute_dtype, name
    # Serialised only where set, so every other model's spec reads as before.
    assert "own_loss_in_compute_dtype" not in get_model("qwen2.5-1.5b").model_dump()


def test_the_hf_trainer_runs_qwen1s_loss_in_the_source_order() -> None:
    request = _request("qwen-1.8b", "--framework", "hf", "--transformers-version", "4.36")
    assert runs_own_loss(request.model, request.training)
    rows, shifted = 2048 * V, 2047 * V
    assert framework_logits_tensors(request) == (
        (2 * rows, 2 * shifted, 2 * shifted, 4 * shifted),   # forward: bf16 logits, copy, log-probs; nll's fp32 input
        (2 * rows, 2 * shifted, 4 * shifted, 4 * rows),      # accelerate's fp32 outputs beside them
        (2 * shifted, 4 * shifted, 4 * shifted),             # backward: nll_loss's fp32 gradient
    )
    # Another framework runs its own model code: the flag is not read.
    other = _request("qwen-1.8b", "--framework", "torchtune")
    assert not runs_own_loss(other.model, other.training)


@pytest.mark.parametrize("strategy", [StrategyKind.zero2, StrategyKind.zero3])
def test_under_deepspeeds_engine_the_loss_stays_in_the_modules_dtype(strategy: StrategyKind) -> None:
    # accelerate sets no native_amp under DeepSpeed: no autocast, no fp32 copy, no fp32 outputs.
    request = _request("qwen-1.8b", "--framework", "hf", "--transformers-version", "4.36", strategy=strategy)
    assert runs_own_loss(request.model, request.training)
    rows, shifted = 2048 * V, 2047 * V
    assert framework_logits_tensors(request) == (
        (2 * rows, 2 * shifted, 2 * shifted),     # forward: bf16 logits, their shifted copy, log-probs
        (2 * shifted, 2 * shifted, 2 * shifted),  # backward: nll_loss's and log-softmax's bf16 gradients
    )


def test_an_fp32_module_casts_nothing() -> None:
    request = _request("qwen-1.8b", "--framework", "hf")
    fp32 = request.training.model_copy(update={"precision": Precision.fp32})
    forward, backward = own_loss_tensors(request.model, fp32, 2048, 1)
    assert forward == (4 * 2048 * V, 4 * 2047 * V, 4 * 2047 * V) and backward == (4 * 2047 * V,) * 3


def test_a_record_keeps_two_fp32_segments_not_three() -> None:
    lengths = ("--varying-lengths", "3234.4,2547.5,91,4959")
    own = _request("qwen-1.8b", "--framework", "hf", "--transformers-version", "4.36", *lengths)
    tensors = record_tensor_bytes(own, peak_terms(own)[1])
    assert sorted(tensors) == [4 * 2047 * V, 4 * 2048 * V]
    # The same shapes with transformers' upcast loss (the flag cleared): three.
    spec = own.model.model_copy(update={"own_loss_in_compute_dtype": False})
    reference = own.model_copy(update={"model": spec})
    assert len(record_tensor_bytes(reference, peak_terms(reference)[1])) == 3


def test_cuda_autocast_has_no_cross_entropy_kernel_of_its_own() -> None:
    # The mechanism's premise in the installed torch: cross_entropy_loss reaches log_softmax (on
    # autocast's fp32_set_opt_dtype list, which keeps the explicit dtype cross_entropy_loss passes)
    # and nll_loss (on its fp32 list) through its composite; torch 2.1's autocast_mode.cpp lists
    # the same.
    torch = pytest.importorskip("torch")
    assert "AutocastCUDA" not in torch._C._dispatch_dump("aten::cross_entropy_loss")
    assert "AutocastCUDA" in torch._C._dispatch_dump("aten::log_softmax.int")
    assert "AutocastCUDA" in torch._C._dispatch_dump("aten::nll_loss")
