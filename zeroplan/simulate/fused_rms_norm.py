"""Opt-in: let a CPU run (real or fake tensors) save what torch's fused CUDA RMSNorm saves.

torch 2.13 aten/src/ATen/native/layer_norm.cpp ``rms_norm_symint`` calls ``at::_fused_rms_norm``
whenever input and weight dtypes match; native_functions.yaml gives that operator kernels for
CUDA, MPS and XPU only and makes it ``rms_norm_composite`` (CompositeImplicitAutograd) on every
other backend, so on the CPU autograd records the composite's own ops (two fp32 tensors saved).
Registering a CPU kernel for it makes the dispatcher send AutogradCPU to the operator's own
autograd formula (tools/autograd/derivatives.yaml, ``_fused_rms_norm``: saves input, weight and
the rstd ``result1``), as AutogradCUDA does, and the backward call
``_fused_rms_norm_backward`` (CUDA and XPU only) gets a CPU kernel and a Meta one (fake tensors).
Under FakeTensorMode the forward itself still decomposes to the composite below autograd, which
changes no saved tensor. The kernels compute the norm (Zhang and Sennrich 2019, eq. 4) in fp32
for 16-bit inputs, as the CUDA kernel accumulates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from zeroplan.simulate import _torch_private as private


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _normalised_dims(x: torch.Tensor, normalized_shape: list[int]) -> tuple[int, ...]:
    return tuple(range(x.dim() - len(normalized_shape), x.dim()))


def fused_rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                   eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, rstd): rstd = 1/sqrt(mean(x^2) + eps) per row, in the accumulation dtype."""
    acc = _accumulation_dtype(x.dtype)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    x_acc = x.to(acc)
    rstd = torch.rsqrt(x_acc.pow(2).mean(_normalised_dims(x, normalized_shape), keepdim=True) + eps)
    out = (x_acc * rstd).to(x.dtype)
    return (out * weight if weight is not None else out), rstd


def fused_rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], rstd: torch.Tensor,
                            weight: torch.Tensor | None, output_mask: list[bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of input and weight from the saved input and rstd (x_hat = x * rstd)."""
    dims = _normalised_dims(x, normalized_shape)
    x_hat = x.to(rstd.dtype) * rstd
    grad_acc = grad_out.to(rstd.dtype)
    grad_x_hat = grad_acc * weight.to(rstd.dtype) if weight is not None else grad_acc
    grad_input = grad_weight = None
    if output_mask[0]:
        grad_input = (rstd * (grad_x_hat - x_hat * (grad_x_hat * x_hat).mean(dims, keepdim=True))).to(x.dtype)
    if output_mask[1] and weight is not None:
        grad_weight = (grad_acc * x_hat).sum(tuple(range(x.dim() - len(normalized_shape)))).to(weight.dtype)
    return grad_input, grad_weight


def _fused_rms_norm_backward_meta(grad_out, x, normalized_shape, rstd, weight, output_mask):  # noqa: ANN001, ANN202
    grad_input = torch.empty_like(x) if output_mask[0] else None
    grad_weight = torch.empty_like(weight) if output_mask[1] and weight is not None else None
    return grad_input, grad_weight


@contextlib.contextmanager
def cuda_rms_norm_formula() -> Iterator[None]:
    """While entered, every F.rms_norm with matching input and weight dtypes on the CPU saves
    what the CUDA kernel's autograd formula saves: its input and an fp32 rstd per row."""
    with private.aten_kernels({
        ("_fused_rms_norm", "CPU"): fused_rms_norm,
        ("_fused_rms_norm_backward", "CPU"): fused_rms_norm_backward,
        ("_fused_rms_norm_backward", "Meta"): _fused_rms_norm_backward_meta,
    }):
        yield
