"""Muon's Newton-Schulz FLOPs (zeroplan.core.muon_time) against the functions that run them,
counted by torch's FlopCounterMode on small CPU matrices, and the per-rank work by stack."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, _zeropower_via_newtonschulz  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

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
    from zeroplan.core.roofline.ceilings import gpu_ceilings
    from zeroplan.core.roofline.step import optimizer_operation

    request = _request(FLAGS, StrategyKind.ddp)
    traffic_s = sum(op.moved_bytes for op in optimizer_operation(request)) / gpu_ceilings(request.cluster.gpu).memory_bytes_per_s
    products_s = newton_schulz_seconds(request)
    assert planned_step(request).optimizer_step_s == pytest.approx(traffic_s + products_s, rel=1e-9)
    assert products_s > traffic_s > 0


_VIEWS = ("permute", "transpose", ".t.", "view", "alias", "detach", "profiler")
_PRODUCTS = ("aten.mm.", "aten.addmm.")


class _ElementwiseBytes(TorchDispatchMode):
    """Bytes every kernel but the products and views reads (its tensor arguments) and writes (its
    outputs), as torch dispatches them."""

    def __init__(self) -> None:
        super().__init__()
        self.moved_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if not any(v in name for v in _VIEWS + _PRODUCTS):
            leaves = tree_leaves((args, kwargs or {}, out))
            self.moved_bytes += sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(64, 96), (96, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_muon_elementwise_traffic_matches_torch_optim_muon(shape: tuple[int, int], dtype) -> None:
    from zeroplan.core.roofline.optimizer import torch_muon_bytes_per_element

    param = torch.nn.Parameter(torch.randn(*shape, dtype=dtype))
    optimizer = torch.optim.Muon([param], lr=0.01, weight_decay=0.1)
    param.grad = torch.randn(*shape, dtype=dtype)
    optimizer.step()  # the momentum made
    param.grad = torch.randn(*shape, dtype=dtype)
    counter = _ElementwiseBytes()
    with counter:
        optimizer.step()
    size = torch.finfo(dtype).bits // 8
    expected = param.numel() * torch_muon_bytes_per_element(size, size)
    # Beyond the per-element passes: the norm's 0-dim result and its clamp (a few bytes).
    assert 0 <= counter.moved_bytes - expected <= 16
