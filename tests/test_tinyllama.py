"""TinyLlama's fork of lit-gpt as its pretraining ran (zeroplan.core.tinyllama): the tensors each
block and the loss keep, the published run's verdict, and the one-line refusals."""

from __future__ import annotations

import pytest

from zeroplan.core.plan import step_fits, under_allocator_model
from zeroplan.core.tinyllama import activation_bytes, block_bytes, logits_tensors
from zeroplan.errors import ZeroplanError
from zeroplan.specs import StrategyKind
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import ActivationCheckpointing
from zeroplan.validate.step_time import as_flat_default, load_published_throughput

ROW = next(r for r in load_published_throughput().rows if r.name == "tinyllama 1.1b a100-40gb x16 fsdp no AC b8 accum8")
REQUEST = as_flat_default(ROW.request())
T = 8 * 2048  # tokens of one micro-batch


def test_a_block_keeps_the_fused_kernels_tensors() -> None:
    # tiny_LLaMA_1b: h 2048, 32 heads and 4 query groups of 64, SwiGLU 5632. Each tensor a block
    # keeps, by the op that saves it (bytes):
    saved = {
        "two FusedRMSNorm inputs, fp32, with mu and rsigma": 2 * (4 * T * 2048 + 2 * 4 * T),
        "qkv linear's bf16 input cast": 2 * T * 2048,
        "the qkv output, alive through the k and v views": 2 * T * (32 + 2 * 4) * 64,
        "q's reshaped copy": 2 * T * 2048,
        "flash-attn's output (the projection's input)": 2 * T * 2048,
        "flash-attn's fp32 log-sum-exp": 4 * T * 32,
        "the packed SwiGLU's bf16 input cast": 2 * T * 2048,
        "its two up projections x1, x2": 2 * 2 * T * 5632,
        "bf16 casts of every linear weight": 2 * (2048 * 2560 + 2048 * 2048 + 3 * 2048 * 5632),
    }
    assert block_bytes(REQUEST) == sum(saved.values())
    outside = 4 * T * 2048 + 2 * 4 * T + 2 * T * 2048 + 2 * 32000 * 2048
    assert activation_bytes(REQUEST) == 22 * sum(saved.values()) + outside


def test_the_loss_moments() -> None:
    logits = T * 32000
    model_end, loss, backward = logits_tensors(REQUEST, ())
    # bf16 logits, Lightning's fp32 copy and the previous micro-batch's fp32 logits.
    assert model_end == (2 * logits, 4 * logits, 4 * logits)
    assert sum(backward) < sum(model_end) and sum(loss) < sum(model_end)


def test_the_published_run_fits() -> None:
    assert step_fits(under_allocator_model(REQUEST))


@pytest.mark.parametrize("update, field", [
    ({"framework": Framework.hf}, "litgpt_fork"),
    ({"litgpt_fork": "openllama"}, "litgpt_fork"),
    ({"activation_checkpointing": ActivationCheckpointing.full}, "litgpt_fork"),
])
def test_refusals_name_the_field(update: dict, field: str) -> None:
    request = REQUEST.model_copy(update={"training": REQUEST.training.model_copy(update=update)})
    with pytest.raises(ZeroplanError) as error:
        block_bytes(request)
    assert error.value.field == field


def test_another_strategy_is_refused() -> None:
    request = REQUEST.with_strategy(REQUEST.strategy.model_copy(update={"kind": StrategyKind.ddp}))
    with pytest.raises(ZeroplanError, match="fsdp-full-shard"):
        block_bytes(request)


def test_q_is_copied_and_k_v_stay_views_of_the_qkv_output() -> None:
    # lit_gpt/model.py lines 212-229, measured with torch on the CPU at tiny_LLaMA_1b's grouping
    # (4 query groups of 8 queries, 1 key and 1 value, head size 64; a short sequence): q's
    # reshape copies, k and v are views of the qkv output with unit last stride, which
    # flash-attn's maybe_contiguous passes through, so saving them keeps that output alive.
    torch = pytest.importorskip("torch")
    qkv = torch.zeros(1, 4, 4 * 10 * 64)
    q, k, v = qkv.view(1, 4, 4, 10, 64).split((8, 1, 1), dim=-2)
    q, k, v = (t.reshape(1, 4, -1, 64) for t in (q, k, v))
    storage = qkv.untyped_storage().data_ptr()
    assert q.untyped_storage().data_ptr() != storage
    assert all(t.untyped_storage().data_ptr() == storage and t.stride(-1) == 1 for t in (k, v))


def test_no_sync_carries_fp32_unsharded_gradients() -> None:
    # pretrain/tinyllama.py runs 7 of every 8 micro-batches under fabric.no_backward_sync, FSDP1's
    # no_sync(); Lightning 2.1.2's bf16-mixed keeps param_dtype fp32, so the whole model's
    # unsharded gradients are carried in fp32 (the row's request sets what the CLI sets for litgpt).
    from zeroplan.core.buffers import backward_held_buffer_bytes
    from zeroplan.core.params import total_parameters

    assert REQUEST.strategy.keep_unsharded_grads_on_accum
    assert backward_held_buffer_bytes(REQUEST) == 4 * total_parameters(REQUEST.model)


def test_the_command_line_asks_for_the_published_run() -> None:
    # The preset and --litgpt-fork give the request the published row makes (its architecture
    # is the preset's; every field the row sets is what the flags set).
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser

    args = build_parser().parse_args([
        "fit", "tinyllama-1.1b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "a100-40gb",
        "--framework", "litgpt", "--litgpt-fork", "tinyllama", "--micro-batch", "8", "--seq-len", "2048",
        "--grad-accum", "8", "--precision", "bf16-mixed", "--strategies", "fsdp-full-shard"])
    request = request_from_args(args)
    published = ROW.request()
    assert request.model == published.model
    assert request.training.litgpt_fork == "tinyllama"
    # fit plans each of --strategies from the request's strategy settings.
    strategy = request.strategy.model_copy(update={"kind": published.strategy.kind})
    assert (request.batch, request.training, strategy) == (published.batch, published.training, published.strategy)
