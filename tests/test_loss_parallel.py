"""torch's loss_parallel() cross-entropy under torchtitan 9dec370's tensor parallelism: the
planner's loss moment (zeroplan.core.framework_loss.loss_parallel_logits_tensors) against torch's
own handlers measured on a fake process group (zeroplan.frameworks.loss_parallel)."""

from __future__ import annotations

import pytest

from zeroplan.cli.fit import check_options_apply, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.framework_loss import (
    fsdp_head_gathered_parts,
    loss_parallel_applies,
    loss_parallel_logits_tensors,
)
from zeroplan.core.parallel.activations import chunk_request, rank_logits_pieces
from zeroplan.core.plan import checked_peak_terms
from zeroplan.specs.strategy import StrategyKind

FP32 = 4


def _request(seq_len: int, *release: str):
    args = build_parser().parse_args([
        "fit", "llama-3.1-70b", "--gpus", "256", "--gpu", "h100-80gb", "--micro-batch", "1", "--seq-len", str(seq_len),
        "--activation-checkpointing", "full", "--framework", "torchtitan", "--tp", "8", "--unchunked-loss", *release])
    check_options_apply(args)
    return request_from_args(args, StrategyKind.fsdp_full_shard)


def test_under_9dec370s_tensor_parallelism_the_loss_holds_four_fp32_logit_shards() -> None:
    request = _request(8192, "--torchtitan-release", "9dec370")
    assert loss_parallel_applies(request)
    shard = FP32 * 8192 * (128256 // 8)
    chunk = chunk_request(request, 1, split_heads=True)
    (moment,) = loss_parallel_logits_tensors(chunk)
    assert moment[:4] == (shard,) * 4
    assert rank_logits_pieces(request, None) == (4 * shard + sum(fsdp_head_gathered_parts(chunk)),)
    assert checked_peak_terms(request)[1].logits == 4 * shard + sum(fsdp_head_gathered_parts(chunk))
    # torchtitan 0.3.0 has its own vocab-parallel loss (components/loss.py): not this moment.
    assert not loss_parallel_applies(_request(8192))


@pytest.mark.slow
def test_torchs_loss_parallel_peaks_at_four_fp32_logit_shards_in_backward() -> None:
    from zeroplan.frameworks.loss_parallel import measure_loss_parallel

    tokens = 512
    measured = measure_loss_parallel(tokens=tokens, vocab_size=128256, tp=8)
    (moment,) = loss_parallel_logits_tensors(chunk_request(_request(tokens, "--torchtitan-release", "9dec370"), 1,
                                                           split_heads=True))
    planned = sum(moment[:4])
    assert measured.local_logit_fp32_bytes == moment[0]
    # The measured moment also holds the labels and the per-token vectors (max, sum of exp).
    assert planned <= measured.backward_peak_bytes <= 1.01 * planned
    # The forward (bf16 logits, the fp32 upcast, `shifted`, exp(shifted)) stays below it.
    assert measured.forward_peak_bytes < measured.backward_peak_bytes
