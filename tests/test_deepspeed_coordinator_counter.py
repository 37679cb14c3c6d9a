"""Where DeepSpeed ZeRO-3's coordinator counter (__n_available_params) starts a micro-batch
(zeroplan.core.deepspeed_coordinator.initial_counter), against DeepSpeed's own engine as
benchmarks/deepspeed_zero3_coordinator_counter.py ran it: a Llama 16 times narrower than
Llama-3-8B (vocabulary 8,016, width 256, 2 blocks), the stage-3 defaults over 256 (persistence
threshold 390), every block recomputed. DeepSpeed 0.14.2: step 2 starts at -2,053,376 untied and
tied, and with a frozen embedding whose output requires grad (enable_input_require_grads); at
-1,280 (the 5 norms alone) with a frozen embedding otherwise; at 8 blocks, tied, -2,056,448. DeepSpeed 0.19.8 releases the
embedding at the backward's end and zeroes the counter at every forward's start: 0. No torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.deepspeed_coordinator import (
    embedding_backward_fetched, initial_counter, persistent_elements, replay,
)
from zeroplan.specs.strategy import StrategyKind

# benchmarks/deepspeed_zero3_fp16_streams.py HIDDEN, FFN, HEADS, KV, VOCAB and STAGE3's threshold.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8016, "hidden_size": 256,
          "intermediate_size": 896, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu"}
PERSISTENCE = 10**5 // 256
EMBEDDING = 8016 * 256
NORMS = 5 * 256


def _request(tmp_path: Path, *flags: str, tied: bool = False, ac: str = "full"):
    path = tmp_path / f"llama-tied{int(tied)}.json"
    path.write_text(json.dumps({**CONFIG, "tie_word_embeddings": tied}))
    args = build_parser().parse_args(["fit", str(path), "--gpus", "2", "--gpu", "a100-80gb", "--micro-batch", "13",
                                      "--seq-len", "128", "--framework", "hf", "--precision", "fp16-mixed",
                                      "--activation-checkpointing", ac, *flags])
    request = request_from_args(args, StrategyKind.zero3)
    return request.with_strategy(request.strategy.model_copy(update={"deepspeed_param_persistence_threshold": PERSISTENCE}))


def _backward_gathers(request) -> list[str]:
    found = replay(request)
    return [name for step, name in found.gathers if step >= found.forward_steps]


@pytest.mark.parametrize("flags, tied", [((), False), ((), True), (("--lora-rank", "8"), False)])
def test_before_0_15_4_a_step_starts_below_zero_by_the_held_embedding(tmp_path: Path, flags: tuple, tied: bool) -> None:
    request = _request(tmp_path, "--deepspeed-release", "0.14.2", *flags, tied=tied)
    assert persistent_elements(request) == NORMS
    assert embedding_backward_fetched(request)
    assert initial_counter(request) == -2_053_376 == -(EMBEDDING + NORMS)


@pytest.mark.parametrize("flags, ac", [(("--freeze-embeddings",), "full"),
                                       (("--lora-rank", "8", "--no-checkpoint-reentrant"), "full"),
                                       (("--lora-rank", "8"), "none")])
def test_a_frozen_embedding_whose_output_takes_no_gradient_is_gathered_in_the_forward_alone(
        tmp_path: Path, flags: tuple, ac: str) -> None:
    request = _request(tmp_path, "--deepspeed-release", "0.14.2", *flags, ac=ac)
    assert not embedding_backward_fetched(request)
    assert initial_counter(request) == -NORMS
    # With no prefetch and no reuse distance to keep it, gathered once, in the forward: no fetch for
    # its backward. The trained embedding is gathered again there.
    bare = {"deepspeed_max_reuse_distance": 0, "deepspeed_prefetch_bucket_elements": 0}
    for case, fetched in ((request, False), (_request(tmp_path, "--deepspeed-release", "0.14.2", ac=ac), True)):
        found = replay(case.with_strategy(case.strategy.model_copy(update=bare)))
        in_forward = [step < found.forward_steps for step, name in found.gathers if name == "embedding.token.weight"]
        assert in_forward == ([True, False] if fetched else [True])


def test_a_tied_head_past_the_reuse_distance(tmp_path: Path) -> None:
    """8 blocks (6.8 M elements, past the scaled reuse distance of 3.9 M) with the stage-3 defaults
    over 256, tied: DeepSpeed 0.14.2's engine (--layers 8 --tied) gathers the embedding's weight
    three times a step, for the embedding, for the head (kept to the head's backward) and at the
    backward's end, where it stays; step 2 starts at -2,056,448 (17 norms)."""
    path = tmp_path / "llama-8.json"
    path.write_text(json.dumps({**CONFIG, "num_hidden_layers": 8, "tie_word_embeddings": True}))
    args = build_parser().parse_args(["fit", str(path), "--gpus", "2", "--gpu", "a100-80gb", "--micro-batch", "13",
                                      "--seq-len", "128", "--framework", "hf", "--precision", "fp16-mixed",
                                      "--activation-checkpointing", "full", "--deepspeed-release", "0.14.2"])
    request = request_from_args(args, StrategyKind.zero3)
    request = request.with_strategy(request.strategy.model_copy(update={
        "deepspeed_param_persistence_threshold": PERSISTENCE, "deepspeed_prefetch_bucket_elements": 5 * 10**7 // 256,
        "deepspeed_max_live_parameters": 10**9 // 256, "deepspeed_max_reuse_distance": 10**9 // 256}))
    assert initial_counter(request) == -2_056_448 == -(EMBEDDING + 17 * 256)
    found = replay(request)
    in_forward = [step < found.forward_steps for step, name in found.gathers if name == "embedding.token.weight"]
    assert in_forward == [True, True, False]


def test_from_0_15_4_the_counter_is_zeroed_at_each_forward(tmp_path: Path) -> None:
    assert initial_counter(_request(tmp_path)) == 0
    assert initial_counter(_request(tmp_path, "--deepspeed-release", "0.19.8", tied=True)) == 0
    # The backward's epilogue releases the embedding (0.19.3 on): nothing carries into the next
    # micro-batch under accumulation either.
    assert initial_counter(_request(tmp_path, "--grad-accum", "2")) == 0
    assert initial_counter(_request(tmp_path, "--grad-accum", "2", "--deepspeed-release", "0.14.2")) == -(EMBEDDING + NORMS)


def test_the_offset_widens_the_prefetch_of_the_published_8b_run() -> None:
    """gpjt-llama3-8b-zero3-ac-noenv-bs13-oom's request: the embedding's 525,336,576 elements are
    0.53 of stage3_max_live_parameters, and what the loss runs beside grows."""
    row = ("fit llama-3-8b --gpus 8 --gpu h100-80gb --micro-batch 13 --seq-len 2048 --framework hf "
           "--precision fp16-mixed --activation-checkpointing full --transformers-version 4.40.0 --torch-release 2.2 "
           "--deepspeed-release 0.14.2").split()
    request = request_from_args(build_parser().parse_args(row), StrategyKind.zero3)
    assert initial_counter(request) == -(persistent_elements(request) + 128_256 * 4096)
    assert replay(request).after_forward_bytes > replay(request, -persistent_elements(request)).after_forward_bytes
