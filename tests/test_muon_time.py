"""Muon's Newton-Schulz FLOPs (zeroplan.core.muon_time) against the functions that run them,
counted by torch's FlopCounterMode on small CPU matrices, and the per-rank work by stack."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, _zeropower_via_newtonschulz  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from zeroplan.cli.fit import request_from_args  # noqa: E402
from zeroplan.cli.main import build_parser  # noqa: E402
from zeroplan.core import muon, muon_time  # noqa: E402
from zeroplan.core.timing import newton_schulz_seconds  # noqa: E402
from zeroplan.specs import StrategyKind  # noqa: E402

SHAPES = [(64, 64), (48, 160), (160, 48), (96, 33)]


def _counted(function, *args) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        function(*args)
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_flops_match_torch_zeropower(shape: tuple[int, int]) -> None:
    grad = torch.randn(*shape)
    counted = _counted(_zeropower_via_newtonschulz, grad, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, 1e-7)
    assert DEFAULT_NS_STEPS == muon_time.NS_STEPS
    assert muon_time.newton_schulz_flops(shape) == counted


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gram_flops_match_deepspeed(shape: tuple[int, int]) -> None:
    original = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon")
    # The undecorated function: the FLOPs of the products it writes, not of a compiled graph.
    function = getattr(original.zeropower_via_gram_newtonschulz, "__wrapped__", original.zeropower_via_gram_newtonschulz)
    counted = _counted(function, torch.randn(*shape), muon_time.NS_STEPS)
    assert muon_time.gram_newton_schulz_flops(shape) == counted


def _request(flags: str, kind: StrategyKind):
    return request_from_args(build_parser().parse_args(["fit", *flags.split()]), kind)


FLAGS = "llama-2-7b --gpus 8 --micro-batch 1 --seq-len 512 --precision bf16-mixed --optimizer muon"


def test_ddp_replicates_every_matrix_and_zero2_splits_them() -> None:
    ddp = _request(FLAGS, StrategyKind.ddp)
    matrices, _ = muon.split_tensors(ddp)
    assert muon_time.rank_newton_schulz_flops(ddp) == sum(muon_time.newton_schulz_flops(t.shape) for t in matrices)
    zero2 = _request(FLAGS + " --framework hf", StrategyKind.zero2)
    gram_total = sum(muon_time.gram_newton_schulz_flops(t.shape) for t in matrices)
    # The fullest rank: at least its share of the whole work, less than all of it.
    assert gram_total / 8 <= muon_time.rank_newton_schulz_flops(zero2) < gram_total / 2


def test_adamw_request_has_no_newton_schulz() -> None:
    assert newton_schulz_seconds(_request(FLAGS.replace("muon", "adamw"), StrategyKind.ddp)) == 0.0


def test_step_adds_the_products_to_the_optimizer_phase() -> None:
    from zeroplan.calibrate.step import planned_step

    with_muon = _request(FLAGS, StrategyKind.ddp)
    with_adamw = _request(FLAGS.replace("muon", "adamw"), StrategyKind.ddp)
    # Muon's element-wise passes are still charged as AdamW's: the step differs by the products.
    added = planned_step(with_muon).optimizer_step_s - planned_step(with_adamw).optimizer_step_s
    assert added == pytest.approx(newton_schulz_seconds(with_muon), rel=1e-9)
    assert added > 0.1 * planned_step(with_adamw).optimizer_step_s
