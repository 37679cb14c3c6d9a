"""transformers' KV cache in training and the output object a loop holds (zeroplan.core.kv_cache):
the planner's terms against the committed measurement of transformers' own Llama
(benchmarks/kv-cache-records), the loss's forward moment, the allocator schedule and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.allocator.schedule import step_trace
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.framework_loss import framework_logits_tensors, fsdp_head_gathered_parts
from zeroplan.core.kv_cache import kept_outputs_bytes, kv_cache_tensors, loss_forward_tensors
from zeroplan.core.plan import memory_breakdown, peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.kv_cache_record import KvCacheRecord
from zeroplan.frameworks.record import load_records
from zeroplan.specs import StrategyKind

RECORDS = Path(__file__).resolve().parent.parent / "benchmarks" / "kv-cache-records"
# llama-recipes' FSDP runs (its PR 165): Llama-2-7B, 8 GPUs, pure bf16, micro-batch 4 x 2048.
COOKBOOK = ("llama-2-7b --framework hf --gpus 8 --gpu a100-80gb --micro-batch 4 --seq-len 2048 "
            "--precision bf16-pure --activation-checkpointing full")


def _request(flags: str, kind: StrategyKind = StrategyKind.fsdp_full_shard):
    base = request_from_args(build_parser().parse_args(["fit", *flags.split()]))
    return base.model_copy(update={"strategy": base.strategy.model_copy(update={"kind": kind})})


def _record() -> KvCacheRecord:
    (record,) = load_records(RECORDS, KvCacheRecord, "kv-cache record")
    return record


def test_the_cache_per_layer_is_the_measured_k_and_v() -> None:
    record = _record()
    request = _request(COOKBOOK + " --use-cache")
    assert (record.model.name, record.batch) == (request.model.name, request.batch)
    layers = request.model.num_layers
    assert sum(kv_cache_tensors(request)) // layers == record.cache_block_bytes("checkpoint_wrapper") == 134_217_728
    # Without checkpointing the attention saves the cache's own K and V: no term, and the
    # measurement shows nothing more (less: without a cache 4.56.2 saves an explicit mask).
    assert kv_cache_tensors(_request(COOKBOOK.replace("full", "none") + " --use-cache")) == ()
    assert record.cache_block_bytes("none") <= 0
    assert kv_cache_tensors(_request(COOKBOOK)) == ()


def test_the_loss_forward_and_the_held_logits_are_the_measured_ones() -> None:
    record = _record()
    request = _request(COOKBOOK + " --use-cache")
    logits, fp32_copy, log_softmax = loss_forward_tensors(request)
    # loss/loss_utils.py ForCausalLMLoss pads the int64 labels by one position before shifting them.
    padded_labels = 8 * record.batch.micro_batch_size * (record.batch.seq_len + 1)
    for use_cache in (False, True):
        run = record.run(use_cache, "checkpoint_wrapper")
        # The forward's peak is what it returns with the output object held, plus the fp32 copy.
        assert run.forward_peak_bytes[1] - run.retained_bytes[1] == fp32_copy + padded_labels
        # Dropping the output object frees its logits.
        assert run.retained_bytes[1] - run.loss_only_bytes[1] == logits
    assert kept_outputs_bytes(_request(COOKBOOK + " --keep-outputs")) == logits
    assert kept_outputs_bytes(_request(COOKBOOK + " --use-cache --keep-outputs")) == logits + sum(kv_cache_tensors(request))


def test_transformers_4_56_refuses_the_cache_under_outside_checkpointing() -> None:
    record = _record()
    assert record.run(True, "checkpoint_wrapper").backward.startswith("CheckpointError")
    assert all(r.backward == "ok" for r in record.runs if not (r.use_cache and r.checkpointing == "checkpoint_wrapper"))


def test_the_cache_is_alive_at_the_loss_forward_only_unless_the_outputs_are_held() -> None:
    plain, cached = _request(COOKBOOK), _request(COOKBOOK + " --use-cache")
    held = _request(COOKBOOK + " --use-cache --keep-outputs")
    forward, backward = framework_logits_tensors(cached)
    assert backward == framework_logits_tensors(plain)[0]
    cache = kv_cache_tensors(cached)
    # Every layer's K and V, the loss's forward tensors and the root unit (embedding, head) FSDP2
    # holds gathered through the forward.
    assert forward == (*cache, *loss_forward_tensors(cached), *fsdp_head_gathered_parts(cached, prefetched=False))
    assert len(fsdp_head_gathered_parts(cached, prefetched=False)) == 2
    plain_terms, cached_terms, held_terms = (peak_terms(r)[1] for r in (plain, cached, held))
    assert cached_terms.activations == plain_terms.activations
    assert held_terms.activations == plain_terms.activations + kept_outputs_bytes(held)
    before, after = memory_breakdown(plain)[0], memory_breakdown(cached)[0]
    assert after.allocated_peak_bytes - before.allocated_peak_bytes == sum(forward) - sum(backward)


@pytest.mark.parametrize("kind", [StrategyKind.fsdp_full_shard, StrategyKind.zero3])
def test_the_schedule_makes_the_cache_in_the_forward_and_peaks_at_the_planners_peak(kind: StrategyKind) -> None:
    # Under DeepSpeed, HF's bf16-mixed is a bf16 module (the engine casts it).
    flags = COOKBOOK + " --use-cache"
    request = _request(flags.replace("bf16-pure", "bf16-mixed") if kind is StrategyKind.zero3 else flags, kind)
    trace = step_trace(request, *peak_terms(request))
    allocated = memory_breakdown(request)[0].allocated_peak_bytes
    assert 0.9 * allocated <= trace.requested_peak_bytes() <= allocated


def test_the_options_are_refused_outside_hf() -> None:
    with pytest.raises(ZeroplanError, match="^use_cache: not offered by torchtune"):
        _request("llama-3.1-8b --framework torchtune --gpus 8 --use-cache")
    with pytest.raises(ZeroplanError, match="^keep_outputs: not offered by torchtitan"):
        _request("llama-3.1-8b --framework torchtitan --gpus 8 --keep-outputs")


@pytest.mark.slow
def test_a_fresh_measurement_keeps_the_planners_cache_per_layer() -> None:
    pytest.importorskip("transformers")
    from zeroplan.frameworks.kv_cache import measure_kv_cache

    request = _request(COOKBOOK.replace("--micro-batch 4 --seq-len 2048", "--micro-batch 1 --seq-len 256") + " --use-cache")
    # Two narrow blocks of Llama-2-7B's kind: the cache is a per-layer quantity of the block's
    # shape (the committed record has all 32 of the full width).
    narrow = request.model.model_copy(update={"num_layers": 2, "hidden_size": 1024, "num_heads": 8, "num_kv_heads": 8,
                                               "ffn_hidden_size": 2752, "vocab_size": 4096})
    request = request.model_copy(update={"model": narrow})
    # Only the checkpointed runs are read below: the others are not measured.
    record = measure_kv_cache(request.model, request.batch, checkpointings=("checkpoint_wrapper",))
    assert record.cache_block_bytes("checkpoint_wrapper") == sum(kv_cache_tensors(request)) // request.model.num_layers
    assert record.run(True, "checkpoint_wrapper").backward.startswith("CheckpointError")


# torchtune's single-device LoRA recipe at ff594c2 (docs/source/tutorials/lora_finetune.rst's table):
# Llama-2-7B, batch 2, alpaca padded to at most 512.
TORCHTUNE_2024 = ("llama-2-7b --framework torchtune --gpus 1 --gpu a100-80gb --micro-batch 2 --seq-len 512 "
                  "--precision bf16-pure --activation-checkpointing full --lora-rank 8 --lora-targets q,v --unchunked-loss")


def test_torchtune_loop_holds_the_shifted_fp32_logits_through_backward() -> None:
    plain, held = _request(TORCHTUNE_2024, StrategyKind.ddp), _request(TORCHTUNE_2024 + " --keep-outputs", StrategyKind.ddp)
    # logits[..., :-1, :].contiguous() of the upcast b x s x V logits: b x (s - 1) rows in fp32.
    assert kept_outputs_bytes(held) == 4 * 2 * 511 * 32_000
    assert kept_outputs_bytes(plain) == 0
    # Held beside the loss's own fp32 tensors at its backward (the planner counts it with the activations).
    assert peak_terms(held)[1].activations - peak_terms(plain)[1].activations == kept_outputs_bytes(held)
    assert memory_breakdown(held)[0].allocated_peak_bytes - memory_breakdown(plain)[0].allocated_peak_bytes == kept_outputs_bytes(held)


def test_torchtune_keep_outputs_needs_the_plain_loss() -> None:
    with pytest.raises(ZeroplanError, match="^keep_outputs: torchtune's loop held its logits only with a plain"):
        _request(TORCHTUNE_2024.replace(" --unchunked-loss", "") + " --keep-outputs", StrategyKind.ddp)
