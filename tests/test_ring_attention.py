"""The buffers of torch's ring attention under torchtitan 9dec370's context parallelism
(zeroplan.core.parallel.ring_attention): which requests carry them, and the planner's bytes
against torch's own _templated_ring_attention_backward on a fake process group
(benchmarks/cp_ring_attention_buffers.py)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

from zeroplan.cli.fit import check_options_apply, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.parallel.ring_attention import ring_attention_backward_extra_bytes
from zeroplan.specs.strategy import StrategyKind

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _request(cp: int, *flags: str, seq_len: int = 32768, tp: int = 1, gpus: int = 8):
    args = build_parser().parse_args([
        "fit", "llama-3.1-8b", "--gpus", str(gpus), "--gpu", "h100-80gb", "--micro-batch", "1", "--seq-len", str(seq_len),
        "--activation-checkpointing", "full", "--framework", "torchtitan", "--cp", str(cp), "--tp", str(tp),
        "--unchunked-loss", *flags])
    check_options_apply(args)
    return request_from_args(args, StrategyKind.fsdp_full_shard)


def test_only_9dec370s_sdpa_ring_carries_the_buffers() -> None:
    assert ring_attention_backward_extra_bytes(_request(2, "--torchtitan-release", "9dec370")) > 0
    # 0.3.0 all-gathers K and V under FlexAttention (gathered_kv_bytes), and cp 1 runs no ring.
    assert ring_attention_backward_extra_bytes(_request(2)) == 0
    assert ring_attention_backward_extra_bytes(_request(1, "--torchtitan-release", "9dec370")) == 0


def test_the_ring_grows_by_the_gathered_k_and_v_per_rank() -> None:
    # Llama-3.1-8B: 32 query heads of 128 (k and v repeated to them), the rank's s / cp tokens.
    local = 32768 // 8
    x = 2 * local * 32 * 128
    eight = ring_attention_backward_extra_bytes(_request(8, "--torchtitan-release", "9dec370", seq_len=32768))
    four = ring_attention_backward_extra_bytes(_request(4, "--torchtitan-release", "9dec370", seq_len=16384))
    assert eight - four == 2 * 4 * x
    # Tensor parallelism splits the heads.
    tp = ring_attention_backward_extra_bytes(_request(4, "--torchtitan-release", "9dec370", seq_len=16384, tp=2))
    assert 2 * tp == four


def _measure():
    spec = importlib.util.spec_from_file_location("cp_ring_attention_buffers",
                                                  ROOT / "benchmarks" / "cp_ring_attention_buffers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_planner_holds_torchs_ring_backward_peak_beyond_the_plain_kernel(cp: int) -> None:
    measure = _measure()
    seq_len, heads = 2048 * cp, 32
    _, _, plain = measure(1, 0, heads, seq_len // cp)
    ring = max(measure(cp, rank, heads, seq_len // cp)[2] for rank in range(cp))
    request = _request(cp, "--torchtitan-release", "9dec370", seq_len=seq_len)
    assert ring - plain == ring_attention_backward_extra_bytes(request)
