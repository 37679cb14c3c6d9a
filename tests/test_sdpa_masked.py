"""torch 2.1's SDPA with an additive mask (--attention sdpa-masked, zeroplan.core.activations
sdpa_masked_terms): what the memory-efficient kernel's autograd node saves, measured with
saved-tensor hooks on meta tensors, and the refusals outside torch 2.1 under hf."""

from __future__ import annotations

from math import ceil

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.activations import attention_core_terms, layer_terms
from zeroplan.errors import ZeroplanError
from zeroplan.presets.models import get_model
from zeroplan.specs import AttentionKernel, TrainingSpec


def _request(flags: str):
    return request_from_args(build_parser().parse_args(["fit", "qwen-7b", "--gpus", "1", "--precision", "bf16-pure",
                                                        *flags.split()]))


def _saved_by_efficient_attention(b: int, a: int, s: int, d: int) -> dict[str, int]:
    """Storage bytes the op's autograd node saves, by role, for an expanded b x 1 x s x s mask
    built into a bias as torch 2.1.1's preprocess_mask builds it (expand to b x a x s x s, then
    pad_bias to a multiple of 16 columns where 16 does not divide s, else contiguous())."""
    torch = pytest.importorskip("torch")
    dtype = torch.bfloat16
    q, k, v = (torch.empty(b, a, s, d, device="meta", dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.empty(b, 1, s, s, device="meta", dtype=dtype).expand(b, a, s, s)
    bias = torch.nn.functional.pad(mask, (0, 16 - s % 16))[..., :s] if s % 16 else mask.contiguous()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)
    by_role = {"bias": 0, "logsumexp": 0, "other": 0}
    for tensor in saved:
        role = ("bias" if tensor.shape == bias.shape else "logsumexp" if tensor.dtype == torch.float32
                else "other")
        by_role[role] += tensor.untyped_storage().nbytes()
    return by_role


@pytest.mark.parametrize("s", [40, 48, 64, 100])
def test_saved_bias_and_logsumexp_are_the_terms(s: int) -> None:
    b, a, d = 2, 3, 8
    model = get_model("qwen-7b").model_copy(update={"num_heads": a, "num_kv_heads": a, "hidden_size": a * d,
                                                     "head_dim": None})
    training = TrainingSpec(attention_kernel=AttentionKernel.sdpa_masked)
    terms = attention_core_terms(model, training, s, b)
    saved = _saved_by_efficient_attention(b, a, s, d)
    assert saved["bias"] == terms["attention_bias"] == 2 * b * a * s * 16 * ceil(s / 16)
    assert saved["logsumexp"] == terms["logsumexp"] == 4 * b * a * 32 * ceil(s / 32)
    assert "softmax_output" not in terms


def test_qwen_7b_keeps_256_mib_a_layer_at_2048() -> None:
    request = _request("--framework hf --torch-release 2.1 --attention sdpa-masked --seq-len 2048")
    terms = layer_terms(request.model, request.training, 2048, 1)
    assert terms["attention_bias"] == 256 * 2**20
    assert terms["softmax_output"] == 0


@pytest.mark.parametrize("flags", ["--framework hf --torch-release 2.4", "--framework hf",
                                   "--framework zeroplan --torch-release 2.1"])
def test_refused_outside_torch_2_1_under_hf(flags: str) -> None:
    with pytest.raises(ZeroplanError, match="sdpa-masked"):
        _request(f"{flags} --attention sdpa-masked")
