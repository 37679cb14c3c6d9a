"""The megatron profile (zeroplan.core.megatron, docs/frameworks.md "Megatron-LM"): its model
states against what megatron-core's own DistributedDataParallel and DistributedOptimizer
allocate (benchmarks/megatron-state-records, measured once with megatron-core 0.16.1 on the meta
device by benchmarks/megatron_state_records.py), its activation and loss terms against the
reference model's, and one-line refusals of what it does not plan."""

from __future__ import annotations

import json
from math import lcm
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.buffers import optimizer_step_temporary_bytes
from zeroplan.core.activations import layer_bytes, logits_bytes
from zeroplan.core.framework_loss import framework_logits_pieces
from zeroplan.core.frameworks import framework_layer_bytes
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.plan import memory_breakdown
from zeroplan.core.profiles import check_framework_strategies
from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import Framework
from zeroplan.specs.strategy import StrategyKind

RECORDS = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "megatron-state-records" / "records.json").read_text())["records"]


def _request(*flags: str, strategy: StrategyKind = StrategyKind.zero1, pipeline_rank: int = 0):
    args = build_parser().parse_args(["fit", *flags])
    request = request_from_args(args, strategy)
    if pipeline_rank:
        request = request.model_copy(update={"parallel": request.parallel.model_copy(update={"pipeline_rank": pipeline_rank})})
    return request


def _record_request(record: dict):
    per_node = "8" if record["world"] % 8 == 0 else "4"
    flags = [record["preset"], "--gpus", str(record["world"]), "--gpus-per-node", per_node, "--framework", "megatron",
             "--tp", str(record["tp"]), "--pp", str(record["pp"]), "--precision", record["precision"], "--optimizer", "adam"]
    if record["pp"] > 1:
        flags += ["--grad-accum", str(record["pp"])]
    strategy = StrategyKind.zero1 if record["distributed_optimizer"] else StrategyKind.ddp
    return _request(*flags, strategy=strategy, pipeline_rank=record["pipeline_rank"])


@pytest.mark.parametrize("record", RECORDS, ids=[r["name"] for r in RECORDS])
def test_model_states_are_megatron_cores_own(record: dict) -> None:
    request = _record_request(record)
    states = model_state_bytes(request)
    assert request.model.vocab_size == record["padded_vocab"]
    assert states.parameter_elements == record["buffer_elements"]
    assert states.parameter_bytes == record["parameter_bytes"]
    assert states.gradient_bytes == record["gradient_bytes"]
    measured_optimizer = record["main_parameter_bytes"] + record["optimizer_state_bytes"]
    if "padded-shard" in record["name"]:
        # A shard holding the bucket's end padding has fewer fp32 main elements than the
        # ceil(buffer / dp) planned (the largest of the stage's shards): at most one
        # lcm(dp, 128) of them, 12 bytes each.
        padding = states.optimizer_state_bytes - measured_optimizer
        assert 0 < padding <= 12 * lcm(record["data_parallel_size"], 128)
    else:
        assert states.optimizer_state_bytes == measured_optimizer


def test_bytes_per_parameter_are_megatrons_table() -> None:
    # docs/user-guide/features/dist_optimizer.md: bf16 with fp32 gradients 18 | 6 + 12/d;
    # fp16 20 | 4 + 16/d; fp32 16 | 8 + 8/d (Llama-2-7B at tp 8, d = 4: buffer padding < 0.01 %).
    flags = ("llama-2-7b", "--gpus", "32", "--framework", "megatron", "--tp", "8", "--optimizer", "adam")
    # fp16's fp32 main gradients exist at the step only (megatron_step_temporary_bytes).
    for precision, whole, fixed, sharded in (("bf16-mixed", 18, 6, 12), ("fp16-mixed", 20, 4, 16), ("fp32", 16, 8, 8)):
        at_step = []
        for strategy in (StrategyKind.ddp, StrategyKind.zero1):
            request = _request(*flags, "--precision", precision, strategy=strategy)
            states = model_state_bytes(request)
            at_step.append((states, states.gpu_bytes + optimizer_step_temporary_bytes(request, states.optimizer_elements)))
        (ddp, ddp_step), (zero1, zero1_step) = at_step
        assert ddp_step == whole * ddp.parameter_elements
        assert zero1_step == fixed * zero1.parameter_elements + sharded * zero1.optimizer_elements


def test_vocabulary_is_padded_as_megatron_lm_pads_it() -> None:
    assert _request("gpt2-medium", "--framework", "megatron", "--gpus", "8").model.vocab_size == 50304
    assert _request("gpt2-medium", "--framework", "megatron", "--gpus", "8", "--tp", "2").model.vocab_size == 50432
    assert _request("gpt2-medium", "--gpus", "8", "--tp", "2").model.vocab_size == 50257


def test_fused_swiglu_and_vocab_parallel_loss() -> None:
    megatron = _request("llama-2-7b", "--framework", "megatron", "--gpus", "8", "--seq-len", "4096")
    reference = _request("llama-2-7b", "--gpus", "8", "--seq-len", "4096")
    s, b, e = 4096, 1, 2
    # Fused bias-SwiGLU keeps 3 f per token where the reference keeps 4 f.
    ffn = megatron.model.ffn_hidden_size
    assert layer_bytes(megatron.model, megatron.training, s, b) - framework_layer_bytes(megatron) == e * s * b * ffn
    # Vocabulary-parallel cross-entropy: one fp32 copy beside the 16-bit logits, against
    # F.cross_entropy's three fp32 tensors.
    assert framework_logits_pieces(megatron) == ((4 + e) * s * b * megatron.model.vocab_size,)
    assert logits_bytes(reference.model, reference.training, s, b) == 12 * s * b * reference.model.vocab_size


def test_eager_attention_expands_grouped_kv() -> None:
    flash = _request("llama-3.1-8b", "--framework", "megatron", "--gpus", "8", "--seq-len", "2048")
    eager = _request("llama-3.1-8b", "--framework", "megatron", "--gpus", "8", "--seq-len", "2048", "--attention", "eager")
    model = eager.model
    softmax_terms = layer_bytes(model, eager.training, 2048, 1) - layer_bytes(model, flash.training, 2048, 1)
    extra = framework_layer_bytes(eager) - framework_layer_bytes(flash) - softmax_terms
    assert extra == 2 * 2 * 2048 * (model.q_size - model.kv_size)


def test_the_gradient_buffer_is_alive_through_backward() -> None:
    # One micro-batch: PyTorch's engines have no gradients before the end of backward, megatron's
    # buffer is there from the start; the allocated peak holds it at the loss's backward.
    flags = ("llama-2-7b", "--gpus", "8", "--tp", "2", "--flat-reserve")
    megatron, _ = memory_breakdown(_request(*flags, "--framework", "megatron"))
    reference, _ = memory_breakdown(_request(*flags))
    assert megatron.peak_moment.value == "loss-backward" and megatron.gradients_at_peak
    assert not reference.gradients_at_peak


def test_selective_recomputation_drops_the_attention_core() -> None:
    from zeroplan.core.frameworks import framework_activation_bytes, framework_recompute_bytes

    flags = ("gpt2-medium", "--framework", "megatron", "--gpus", "8", "--attention", "eager")
    none = _request(*flags)
    selective = _request(*flags, "--activation-checkpointing", "selective")
    model, s, b = none.model, none.batch.seq_len, none.batch.micro_batch_size
    core = (2 + 1 + 2) * model.num_heads * s * s * b  # softmax output, dropout mask and output (Korthikanti sec. 4.1)
    assert framework_recompute_bytes(selective) == core
    assert framework_activation_bytes(none) - framework_activation_bytes(selective) == (model.num_layers - 1) * core


def test_no_framework_buffers_beside_the_gradient_buffer() -> None:
    breakdown, _ = memory_breakdown(_request("llama-2-7b", "--framework", "megatron", "--gpus", "8", "--tp", "4",
                                             "--flat-reserve"))
    assert breakdown.peak_buffer_bytes == 0


@pytest.mark.parametrize(("flags", "field"), [
    (("--cp", "2"), "parallel.cp"),
    (("--pp", "2", "--pp-schedule", "gpipe", "--grad-accum", "4"), "parallel.pp_schedule"),
    (("--pp", "3", "--grad-accum", "3"), "parallel.pp"),
    (("--pp", "2", "--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2", "--grad-accum", "3"), "batch.grad_accum_steps"),
    (("--optimizer", "adafactor"), "optimizer"),
    (("--precision", "bf16-pure"), "precision"),
    (("--activation-checkpointing", "selective-op"), "activation_checkpointing"),
    (("--lora-rank", "8"), "finetune"),
    (("--fused-cross-entropy",), "fused_cross_entropy"),
])
def test_refusals(flags: tuple[str, ...], field: str) -> None:
    with pytest.raises(ZeroplanError) as caught:
        memory_breakdown(_request("llama-2-7b", "--framework", "megatron", "--gpus", "8", *flags))
    assert caught.value.field == field


def test_refuses_strategies_and_models_it_does_not_run() -> None:
    with pytest.raises(ZeroplanError) as caught:
        check_framework_strategies(Framework.megatron, (StrategyKind.zero3,))
    assert caught.value.field == "strategies"
    with pytest.raises(ZeroplanError) as caught:
        memory_breakdown(_request("tiny-mixtral", "--framework", "megatron", "--gpus", "8"))
    assert caught.value.field == "model"


def test_data_parallel_collectives_move_the_buffer() -> None:
    from zeroplan.core.communication import data_parallel_collectives
    from zeroplan.core.megatron import grad_buffer_elements

    request = _request("llama-2-7b", "--framework", "megatron", "--gpus", "16", "--tp", "2")
    buffer = grad_buffer_elements(request)
    reduce, gather = data_parallel_collectives(request)
    # bf16: the fp32 gradient buffer reduce-scattered, the bf16 parameter buffer all-gathered.
    assert (reduce.op.value, reduce.buffer_bytes, gather.op.value, gather.buffer_bytes) == (
        "reduce_scatter", 4 * buffer, "all_gather", 2 * buffer)
    (all_reduce,) = data_parallel_collectives(_request("llama-2-7b", "--framework", "megatron", "--gpus", "16", "--tp", "2",
                                                       strategy=StrategyKind.ddp))
    assert (all_reduce.op.value, all_reduce.buffer_bytes) == ("all_reduce", 4 * grad_buffer_elements(request.model_copy(
        update={"strategy": request.strategy.model_copy(update={"kind": StrategyKind.ddp})})))


def test_interleaving_keeps_more_on_the_first_stage() -> None:
    # Korthikanti et al. 2022 sec. 4.2.3: with p dividing m, the first stage of the interleaved
    # schedule keeps L (1 + (p - 1)/(p v)) blocks' activations, 1F1B's keeps L.
    from zeroplan.core.parallel.activations import rank_activation_bytes
    from zeroplan.core.plan import framework_activations

    flags = ("llama-2-7b", "--framework", "megatron", "--gpus", "8", "--pp", "4", "--grad-accum", "8")
    one_f_one_b, _ = rank_activation_bytes(_request(*flags), framework_activations)
    interleaved, _ = rank_activation_bytes(_request(*flags, "--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2"),
                                           framework_activations)
    p, v = 4, 2
    assert interleaved * p * v == one_f_one_b * (p * v + p - 1)


MASK_RECORDS = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "megatron-embedding-mask-records"
                           / "records.json").read_text())["records"]


@pytest.mark.parametrize("record", MASK_RECORDS, ids=lambda r: r["name"])
def test_first_stage_embedding_masks_are_megatron_cores_own(record: dict) -> None:
    """Pipeline rank 0 under megatron-core's own 1F1B and interleaved schedules
    (benchmarks/megatron_embedding_masks.py) keeps as many embedding dropout masks, of
    s x b x h bytes (/t under sequence parallelism), as zeroplan.core.megatron counts."""
    from zeroplan.core.megatron import embedding_mask_bytes, first_stage_embedding_masks

    count = first_stage_embedding_masks(record["pp"], record["virtual_stages"], record["microbatches"])
    assert count == record["most_masks_alive"]
    flags = ["gpt2-124m", "--framework", "megatron", "--gpus", str(record["tp"] * record["pp"]), "--tp", str(record["tp"]),
             "--pp", str(record["pp"]), "--grad-accum", str(record["microbatches"]), "--seq-len", str(record["seq_len"]),
             "--micro-batch", str(record["micro_batch_size"])]
    request = _request(*flags, *(["--sequence-parallel"] if record["sequence_parallel"] else []))
    request = request.model_copy(update={"model": request.model.model_copy(update={"hidden_size": record["hidden_size"]})})
    assert count * embedding_mask_bytes(request) == record["most_mask_bytes_alive"]


def test_embedding_masks_move_to_the_first_stage() -> None:
    """With pp > 1 the first stage keeps min(p, m) embedding masks and the head's stage, which
    runs no embedding, none; hidden_dropout 0 keeps none anywhere."""
    from zeroplan.core.megatron import embedding_mask_bytes
    from zeroplan.core.parallel.activations import megatron_pipeline_embedding_mask_bytes

    flags = ("gpt2-medium", "--framework", "megatron", "--gpus", "4", "--pp", "4", "--grad-accum", "8",
             "--micro-batch", "2", "--seq-len", "1024")
    first, middle, last = (_request(*flags, pipeline_rank=r) for r in (0, 1, 3))
    mask = embedding_mask_bytes(first)
    assert first.model.hidden_dropout > 0 and mask == 1024 * 2 * first.model.hidden_size
    assert [megatron_pipeline_embedding_mask_bytes(r) for r in (first, middle, last)] == [4 * mask, 0, -mask]
    dropless = first.model_copy(update={"model": first.model.model_copy(update={"hidden_dropout": 0.0})})
    assert embedding_mask_bytes(dropless) == 0 == megatron_pipeline_embedding_mask_bytes(dropless)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
@pytest.mark.parametrize("accumulation", ["1", "2"])
def test_the_distributed_optimizer_holds_the_whole_grad_buffer_through_backward(precision: str, accumulation: str) -> None:
    # megatron-core's DistributedOptimizer shards the optimizer states alone: its grad_data buffer is
    # the DDP's, resident and whole on every rank (param_and_grad_buffer.py), with none of DeepSpeed's
    # ZeRO-1 buckets or early gradients beside it. So at the loss's backward zero1 holds what ddp
    # holds less the optimizer states it shards, at every accumulation.
    flags = ("qwen3-8b", "--framework", "megatron", "--gpu", "h100-80gb", "--gpus", "4", "--tp", "2", "--micro-batch", "1",
             "--seq-len", "1024", "--grad-accum", accumulation, "--precision", precision, "--flat-reserve")
    ddp, _ = memory_breakdown(_request(*flags, strategy=StrategyKind.ddp))
    zero1, _ = memory_breakdown(_request(*flags))
    assert zero1.gradient_bytes == ddp.gradient_bytes
    assert ddp.peak_moment == zero1.peak_moment == "loss-backward"
    assert ddp.allocated_peak_bytes - zero1.allocated_peak_bytes == ddp.optimizer_state_bytes - zero1.optimizer_state_bytes


def test_the_distributed_optimizers_step_copies_each_gradient_shard_apart() -> None:
    # megatron-core's distributed optimizer is not DeepSpeed's engine: under fp16 its step makes
    # one fp32 gradient per main parameter shard (distrib_optimizer.py _copy_model_grads_to_main_grads),
    # not DeepSpeed's one flat fp32 partition, so the replay makes the step's temporary in parts,
    # as it does for megatron's DDP; Hugging Face's ZeRO-1 (DeepSpeed's engine) keeps it whole.
    from zeroplan.allocator.replay import ALLOC_OP
    from zeroplan.allocator.schedule import step_ops
    from zeroplan.core.plan import checked_peak_terms, replayed

    def step_allocations(framework: str, precision: str) -> tuple[int, list[int]]:
        request = _request("llama-2-7b", "--framework", framework, "--gpus", "8", "--precision", precision)
        states, terms = replayed(*checked_peak_terms(request))
        return terms.step_temporary, [size for kind, _, size, _ in step_ops(request, states, terms) if kind == ALLOC_OP]

    temporary, sizes = step_allocations("megatron", "fp16-mixed")
    assert temporary > 0 and temporary not in sizes
    temporary, sizes = step_allocations("hf", "bf16-mixed")
    assert temporary > 0 and temporary in sizes


def test_ddp_steps_copy_each_parameters_gradient_on_its_own() -> None:
    # Megatron-LM 992da75 optimizer.py:605-611: main_param.grad = model_param.main_grad.float(),
    # one parameter at a time: the replay allocates each tensor's fp32 copy (q, k and v one
    # fused query_key_value), the word embedding's the largest, and sums to the step's temporary.
    from zeroplan.allocator.replay import ALLOC_OP
    from zeroplan.allocator.schedule import step_ops
    from zeroplan.core.megatron import megatron_step_temporary_parts
    from zeroplan.core.plan import checked_peak_terms, replayed

    request = _request("gpt2-medium", "--framework", "megatron", "--gpus", "4", "--seq-len", "1024", "--precision",
                       "fp16-mixed", "--optimizer", "adam", "--attention", "eager", strategy=StrategyKind.ddp)
    parts = megatron_step_temporary_parts(request)
    states, terms = replayed(*checked_peak_terms(request))
    assert sum(parts) == terms.step_temporary
    h = request.model.hidden_size
    assert max(parts) == 4 * request.model.vocab_size * h
    assert parts.count(4 * 3 * h * h) == request.model.num_layers and 4 * h * h in parts
    allocated = [size for kind, _, size, _ in step_ops(request, states, terms) if kind == ALLOC_OP]
    assert allocated[-len(parts):] == list(parts)
    # The distributed optimizer's copies are slices of the rank's shard: not these.
    assert megatron_step_temporary_parts(request.model_copy(update={"strategy": request.strategy.model_copy(
        update={"kind": StrategyKind.zero1})})) == ()
    # bf16 trains on fp32 gradients: no copies.
    bf16 = _request("gpt2-medium", "--framework", "megatron", "--gpus", "4", "--precision", "bf16-mixed",
                    strategy=StrategyKind.ddp)
    assert megatron_step_temporary_parts(bf16) == ()
