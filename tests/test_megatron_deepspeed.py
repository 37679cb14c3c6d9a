"""The megatron-deepspeed profile (zeroplan.core.megatron_deepspeed, docs/frameworks.md
"Megatron-DeepSpeed"): BF16_Optimizer's bytes against what DeepSpeed 0.19.8's own class
allocated on gloo (benchmarks/megatron-deepspeed-records, written by
benchmarks/megatron_deepspeed_records.py), the planner's terms under the profile against
megatron-core's, and one-line refusals of what it does not plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.buffers import resident_buffer_bytes, transient_buffer_bytes
from zeroplan.core.framework_loss import framework_logits_pieces
from zeroplan.core.frameworks import framework_layer_bytes
from zeroplan.core.megatron_deepspeed import (
    allreduce_copy_bytes,
    bf16_optimizer_bytes,
    bf16_optimizer_states,
    param_group_elements,
)
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.plan import memory_breakdown
from zeroplan.errors import ZeroplanError
from zeroplan.specs.strategy import StrategyKind

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "benchmarks" / "megatron-deepspeed-records" / "records.json").read_text())


def _request(*flags: str, strategy: StrategyKind = StrategyKind.zero1):
    args = build_parser().parse_args(["fit", *flags])
    return request_from_args(args, strategy)


def _check_measured(record: dict) -> None:
    """Every BF16_Optimizer figure of a measured run equals bf16_optimizer_bytes' for its groups."""
    for rank in record["ranks"]:
        dp = rank["world_size"]
        planned = bf16_optimizer_bytes(tuple(rank["group_numels"]), dp, 8)
        assert rank["parameters_in_flat_groups"]
        assert rank["bf16_flat_group_elements"] == list(planned.group_elements)
        assert rank["bf16_flat_group_bytes"] == planned.parameter_bytes
        assert rank["fp32_gradient_buffer_bytes"] == planned.gradient_buffer_bytes
        assert rank["fp32_master_partition_bytes"] + rank["optimizer_state_bytes"] == planned.optimizer_state_bytes
        assert rank["immediate_grad_update"] is False
        for step in rank["steps"]:
            at_step = step["parameter_grads_at_step"]
            assert at_step["bytes"] == planned.gradient_bytes
            assert at_step["dtypes"] == ["torch.bfloat16"] and at_step["own_storage"]
            assert step["parameter_grads_after_step"]["bytes"] == 0
            # One bucket of both groups: flattened (a copy) and cast to bf16 for the all-reduce.
            assert [f["copy"] for f in step["flattens"]] == [True]
            copies = sum(4 * f["elements"] for f in step["flattens"] if f["copy"])
            copies += sum(2 * r["elements"] for r in step["all_reduces"] if not r["is_flat_gradient_buffer"])
            assert copies == allreduce_copy_bytes(planned.group_elements)


def test_bf16_optimizer_is_deepspeeds_own() -> None:
    assert RECORD["deepspeed"] == "0.19.8"
    _check_measured(RECORD)


@pytest.mark.slow
def test_bf16_optimizer_measured_again(tmp_path: Path) -> None:
    import subprocess
    import sys

    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "megatron_deepspeed_records.py"), "--out", str(tmp_path)],
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    _check_measured(json.loads((tmp_path / "records.json").read_text()))


FLAGS = ("llama-2-7b", "--gpus", "64", "--gpu", "a100-80gb", "--tp", "8", "--pp", "2", "--micro-batch", "1",
         "--seq-len", "4096", "--grad-accum", "8")


def test_bf16_states_per_rank() -> None:
    """bf16 at ZeRO-1: 2 bytes of parameters and of gradients per element, a 4-byte fp32 gradient
    buffer over the whole stage, and 12 bytes over dp of master and Adam states."""
    request = _request(*FLAGS, "--framework", "megatron-deepspeed", "--deepspeed-grad-accum-dtype", "fp32")
    dp = request.state_group_size
    assert dp == 4
    groups = param_group_elements(request)
    states = model_state_bytes(request)
    padded = sum(-(-n // (2 * dp)) * 2 * dp for n in groups)
    assert states.parameter_bytes == 2 * padded
    assert states.gradient_bytes == 2 * sum(groups)
    assert states.optimizer_state_bytes == 12 * padded // dp
    assert resident_buffer_bytes(request) == 4 * padded == bf16_optimizer_states(request).gradient_buffer_bytes
    assert not states.gradients_resident
    assert transient_buffer_bytes(request) == allreduce_copy_bytes(bf16_optimizer_states(request).group_elements) > 0


@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16-mixed"])
def test_default_is_deepspeeds_zero1_optimizer(precision: str) -> None:
    """Under fp16, and under bf16 with DeepSpeed's default gradient accumulation dtype, the fork
    runs DeepSpeed's ZeRO stage-1 optimizer (the deepspeed convention: 16-bit parameters, the fp32
    gradient partition, 12 bytes of master and Adam states per partition element), without
    BF16_Optimizer's unpartitioned fp32 gradient buffer."""
    mds = _request(*FLAGS, "--framework", "megatron-deepspeed", "--precision", precision)
    states = model_state_bytes(mds)
    n, dp = states.parameter_elements, mds.state_group_size
    assert states.parameter_bytes == 2 * n
    assert states.optimizer_elements == n // dp
    assert states.gradient_bytes == 4 * n // dp
    assert states.optimizer_state_bytes - states.step_counter_bytes == 12 * n // dp
    assert resident_buffer_bytes(mds) < 2**10


def test_block_repeats_kv_with_flash_attention() -> None:
    """The fork repeats grouped K and V before either kernel; megatron-core's flash path does not."""
    flags = ("llama-3-8b", "--gpus", "8", "--tp", "8", "--micro-batch", "1", "--seq-len", "2048")
    mds = _request(*flags, "--framework", "megatron-deepspeed")
    core = _request(*flags, "--framework", "megatron")
    model = mds.model
    kv_copies = 2 * 2 * 2048 * (model.q_size - model.kv_size)
    assert kv_copies > 0
    # megatron-core's fused bias-SwiGLU saves 2 x s x f bytes fewer than the fork's Python SwiGLU.
    swiglu = 2 * 2048 * model.ffn_hidden_size
    assert framework_layer_bytes(mds) - framework_layer_bytes(core) == kv_copies + swiglu


def test_loss_holds_the_fp32_stage_output() -> None:
    request = _request("gpt2-medium", "--framework", "megatron-deepspeed", "--micro-batch", "2", "--seq-len", "1024")
    logits = 2 * 1024 * request.model.vocab_size
    # The fp32 stage output, the fp32 softmax turned gradient and its bf16 cast, at once.
    assert framework_logits_pieces(request) == (4 * logits + 4 * logits + 2 * logits,)


@pytest.mark.parametrize(("flags", "field"), [
    (("--precision", "fp16-mixed", "--deepspeed-grad-accum-dtype", "fp32"), "strategy.deepspeed_grad_accum_fp32"),
    (("--cp", "2", "--tp", "2"), "parallel.cp"),
    (("--pp", "2", "--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2"), "parallel.pp_schedule"),
    (("--precision", "fp32"), "precision"),
    (("--lora-rank", "8"), "finetune"),
])
def test_refusals_name_the_field(flags: tuple[str, ...], field: str) -> None:
    with pytest.raises(ZeroplanError) as error:
        request = _request("gpt2-medium", "--gpus", "8", "--framework", "megatron-deepspeed", "--seq-len", "1024", *flags)
        memory_breakdown(request)
    assert error.value.field == field


def test_grad_accum_dtype_is_megatron_deepspeeds() -> None:
    with pytest.raises(ZeroplanError) as error:
        memory_breakdown(_request("gpt2-medium", "--gpus", "8", "--framework", "hf", "--deepspeed-grad-accum-dtype", "fp32"))
    assert error.value.field == "strategy.deepspeed_grad_accum_fp32"


def test_strategies_are_zero_stage_1() -> None:
    from zeroplan.core.profiles import check_framework_strategies
    from zeroplan.specs.framework import Framework

    with pytest.raises(ZeroplanError) as error:
        check_framework_strategies(Framework.megatron_deepspeed, (StrategyKind.zero2,))
    assert "zero1" in str(error.value)


def test_pipeline_engine_keeps_each_stage_output() -> None:
    """DeepSpeed's pipeline engine keeps each in-flight micro-batch's stage output (its 1/t part
    under tensor parallelism); megatron-core frees it after the send. A GELU model without
    grouped K/V has the same blocks in both profiles, and both keep each in-flight micro-batch's
    embedding dropout mask on the first stage, so that is the whole difference there."""
    from zeroplan.core.megatron import embedding_mask_bytes
    from zeroplan.core.megatron_deepspeed import pipe_embedding_mask_bytes, pipe_output_bytes
    from zeroplan.core.plan import micro_batch_terms

    flags = ("gpt2-medium", "--gpus", "8", "--tp", "2", "--pp", "4", "--micro-batch", "2", "--seq-len", "1024",
             "--grad-accum", "8", "--precision", "fp16-mixed")
    mds = _request(*flags, "--framework", "megatron-deepspeed")
    core = _request(*flags, "--framework", "megatron")
    assert pipe_output_bytes(mds) == 2 * 1024 * 2 * mds.model.hidden_size // 2
    in_flight = 4  # 1F1B on the first of 4 stages
    extra = micro_batch_terms(mds)["activations"] - micro_batch_terms(core)["activations"]
    assert pipe_embedding_mask_bytes(mds) == 1024 * 2 * mds.model.hidden_size == embedding_mask_bytes(core)
    assert extra == in_flight * pipe_output_bytes(mds)


def test_zero_optimizer_under_the_pipeline_engine() -> None:
    """bf16 at DeepSpeed's default grad_accum_dtype (benchmarks/megatron-deepspeed-records/
    records-zero1-bf16.json): at the end of the step's backward the ZeRO stage-1 optimizer under
    the pipeline engine holds every parameter's bf16 gradient and a reduce bucket of the whole
    reduce_bucket_size (not capped at the model), which the reduce gives back; the step sees
    the fp32 partition only, and nothing is left after it."""
    record = json.loads((ROOT / "benchmarks" / "megatron-deepspeed-records" / "records-zero1-bf16.json").read_text())
    assert record["deepspeed"] == "0.19.8"
    for rank in record["ranks"]:
        for step in rank["steps"]:
            assert step["before_reduce"]["param.grad"] == 2 * sum(rank["group_numels"])
            assert step["before_reduce"]["ipg_buckets"] == 2 * rank["reduce_bucket_size"]
            assert "param.grad" not in step["after_reduce"] and "ipg_buckets" not in step["after_reduce"]
            assert set(step["after_step"]) <= {"_global_grad_norm"}


def test_first_pipeline_stage_keeps_each_in_flight_embedding_dropout_mask():
    """DeepSpeed's PipelineModule checkpoints only transformer-layer chunks, so the first
    stage's embedding dropout keeps its one-byte mask of s x b x h per micro-batch in flight."""
    from zeroplan.cli.fit import request_from_args as _from_args
    from zeroplan.cli.main import build_parser as _parser
    from zeroplan.core.megatron_deepspeed import pipe_embedding_mask_bytes
    from zeroplan.core.parallel.activations import rank_activation_bytes
    from zeroplan.core.parallel.pipeline import in_flight_chunks
    from zeroplan.core.plan import framework_activations
    from zeroplan.specs.strategy import StrategyKind as _Kind

    args = _parser().parse_args(["fit", "gpt2-124m", "--gpus", "4", "--gpu", "a100-80gb", "--pp", "4",
                                 "--framework", "megatron-deepspeed", "--precision", "fp16-mixed",
                                 "--grad-accum", "8", "--micro-batch", "2", "--seq-len", "512",
                                 "--activation-checkpointing", "full"])
    request = _from_args(args, _Kind.zero1)
    assert request.model.hidden_dropout > 0
    assert pipe_embedding_mask_bytes(request) == 512 * 2 * 768
    first, second = (request.model_copy(update={"parallel": request.parallel.model_copy(update={"pipeline_rank": r})})
                     for r in (0, 1))
    chunks = in_flight_chunks(first.parallel, 0, 8)
    # Stage 1 holds the same blocks' share and no embedding: the difference in kept bytes is the
    # masks (both stages hold 3 blocks of gpt2's 12 over 4 stages and the same pipe outputs).
    kept_first = rank_activation_bytes(first, framework_activations)[0]
    kept_second = rank_activation_bytes(second, framework_activations)[0]
    assert kept_first - chunks * pipe_embedding_mask_bytes(request) == chunks * (kept_second // in_flight_chunks(second.parallel, 1, 8))


def _bloom_request(tmp_path: Path, *flags: str):
    config = tmp_path / "bloom.json"
    config.write_text(json.dumps({"model_type": "bloom", "n_layer": 4, "hidden_size": 256, "n_head": 4,
                                  "vocab_size": 1024, "hidden_dropout": 0.1, "attention_dropout": 0.1}))
    return _request(str(config), "--gpus", "2", "--gpu", "a100-80gb", "--pp", "2", "--framework", "megatron-deepspeed",
                    "--precision", "fp16-mixed", "--grad-accum", "4", "--micro-batch", "2", "--seq-len", "128",
                    "--activation-checkpointing", "full", "--attention", "eager", *flags)


def test_alibi_and_the_embedding_norm_are_the_bigscience_forks(tmp_path: Path) -> None:
    """microsoft/Megatron-DeepSpeed f4157be builds neither; the BigScience fork the 2022 release
    stands for builds both, so the refusal names that release."""
    from zeroplan.core.plan import peak_terms

    with pytest.raises(ZeroplanError, match=r"allowed: deepspeed_release 2022-bigscience"):
        peak_terms(_bloom_request(tmp_path))
    assert peak_terms(_bloom_request(tmp_path, "--deepspeed-release", "2022-bigscience"))[1].activations > 0


def test_first_stage_keeps_each_in_flight_embedding_norm_input(tmp_path: Path) -> None:
    """--embed-layernorm's LayerNorm runs outside any checkpoint: the first stage keeps its
    16-bit s x b x h input per micro-batch in flight; the head's stage, without the embedding,
    keeps none of it."""
    from zeroplan.core.megatron_deepspeed import pipe_embedding_norm_bytes
    from zeroplan.core.parallel.activations import rank_activation_bytes
    from zeroplan.core.plan import framework_activations

    request = _bloom_request(tmp_path, "--deepspeed-release", "2022-bigscience")
    assert pipe_embedding_norm_bytes(request) == 2 * 128 * 2 * 256
    plain = request.model_copy(update={"model": request.model.model_copy(update={"embedding_norm": False})})
    for rank, norms in ((0, 2), (1, 0)):  # 1F1B at pp 2: two micro-batches in flight on rank 0
        with_norm, without = (rank_activation_bytes(r.at_pipeline_rank(rank), framework_activations)[0]
                              for r in (request, plain))
        assert with_norm - without == norms * pipe_embedding_norm_bytes(request)


def test_embedding_norm_saves_its_16_bit_input_measured() -> None:
    """The fork's --embed-layernorm is a plain torch.nn.LayerNorm in the 16-bit module: measured
    with saved-tensor hooks on the CPU, the only activation-sized tensor it keeps is its input,
    2 bytes an element (the rest: its weight and bias, and per-token statistics)."""
    import torch

    s, b, h = 16, 2, 64
    norm = torch.nn.LayerNorm(h).half()
    saved: list[torch.Tensor] = []
    x = torch.randn(b, s, h, dtype=torch.half, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    activation_sized = [t for t in saved if t.numel() == s * b * h]
    assert sum(t.untyped_storage().nbytes() for t in activation_sized) == 2 * s * b * h
    assert all(t.numel() <= s * b or t.numel() == h for t in saved if t.numel() != s * b * h)
