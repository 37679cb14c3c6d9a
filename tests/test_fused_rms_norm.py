"""The opt-in CUDA RMSNorm formula on the CPU (zeroplan/simulate/fused_rms_norm.py): it saves
what torch's fused kernel's autograd formula saves, its gradients are the norm's, it leaves the
dispatcher as it was, and the saved bytes it changes are the planner's cuda-minus-cpu difference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from zeroplan.core.activations import activation_bytes  # noqa: E402
from zeroplan.simulate import simulate  # noqa: E402
from zeroplan.simulate.fused_rms_norm import cuda_rms_norm_formula  # noqa: E402
from zeroplan.specs import BatchSpec, Kernels, ModelSpec, Precision, TrainingSpec  # noqa: E402
from zeroplan.validate.rows import planner_request  # noqa: E402

TINY = ModelSpec(name="tiny", vocab_size=103, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=96)
BATCH = BatchSpec(micro_batch_size=2, seq_len=32)


def _saved(fn):
    tensors = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: tensors.append(t) or t, lambda t: t):
        out = fn()
    return out, tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_formula_saves_the_input_and_an_fp32_rstd_per_row_and_is_removed_on_exit(dtype) -> None:
    x = torch.randn(2, 8, 64, dtype=dtype, requires_grad=True)
    weight = torch.nn.Parameter(torch.ones(64, dtype=dtype))
    with cuda_rms_norm_formula():
        out, saved = _saved(lambda: F.rms_norm(x, (64,), weight, 1e-5))
    assert out.grad_fn.name() == "FusedRmsNormBackward0"
    activations = sorted(((tuple(t.shape), t.dtype) for t in saved if not isinstance(t, torch.nn.Parameter)), key=str)
    assert activations == sorted([((2, 8, 64), dtype), ((2, 8, 1), torch.float32)], key=str)
    assert F.rms_norm(x, (64,), weight, 1e-5).grad_fn.name() != "FusedRmsNormBackward0"


def test_its_gradients_are_the_composite_norms() -> None:
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, requires_grad=True)
    composite = torch.autograd.grad(F.rms_norm(x, (16,), weight, 1e-5).pow(2).sum(), (x, weight))
    with cuda_rms_norm_formula():
        out = F.rms_norm(x, (16,), weight, 1e-5)
        assert out.grad_fn.name() == "FusedRmsNormBackward0"
        fused = torch.autograd.grad(out.pow(2).sum(), (x, weight))
    for a, b in zip(fused, composite):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("strategy", ["fsdp-full-shard", "ddp"])
@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16_mixed])
def test_the_simulated_saving_is_the_planners_cuda_minus_cpu_difference(strategy, precision) -> None:
    training = TrainingSpec(precision=precision)
    runs = {
        formula: simulate(TINY, strategy, 4, training=training, batch=BATCH, mem_tracker=False, cuda_norm_formula=formula)
        for formula in (False, True)
    }
    assert runs[False].training.kernels is Kernels.cpu and runs[True].training.kernels is Kernels.cuda

    def predicted(record) -> int:
        request = planner_request(record.model, record.training, record.batch, record.strategy, 4)
        return activation_bytes(TINY, record.training, BATCH.seq_len, BATCH.micro_batch_size, autocast=request.runs_under_autocast)

    # The composite also saves its per-token rsqrt, which the planner's cpu rule leaves out (as
    # Korthikanti et al. leave out norm statistics): 4 bytes per token for each of the 2L + 1 norms.
    ignored_rsqrt = (2 * TINY.num_layers + 1) * 4 * BATCH.seq_len * BATCH.micro_batch_size
    measured = runs[False].saved_activation_bytes - runs[True].saved_activation_bytes
    assert measured == predicted(runs[False]) + ignored_rsqrt - predicted(runs[True])
