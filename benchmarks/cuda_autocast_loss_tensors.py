"""The tensors torch's cross-entropy allocates under CUDA autocast, reproduced on the CPU: the loss
configurations the planner models under autocast, each run as the ops CUDA's autocast dispatch
turns it into, with CPU tensors of the dtypes that dispatch produces (a CPU build cannot run CUDA
autocast, and CPU autocast casts otherwise). Prints, per configuration, what autograd saves
(saved_tensors_hooks) and every tensor alive at the loss's largest moment (the profiler's
allocator events, zeroplan.harness.allocator_trace), in units of one fp32 logit row block.

    python benchmarks/cuda_autocast_loss_tensors.py

Dispatch, torch 2.13 (the installed build's dispatcher: torch._C._dispatch_dump; torch 2.1's
autocast_mode.cpp registers the same CUDA lists):
- aten::cross_entropy_loss has an AutocastCPU kernel (autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten,
  AutocastCPU): KERNEL_CPU(cross_entropy_loss, fp32)) and no AutocastCUDA one, so on CUDA it falls
  through to its composite, LossNLL.cpp cross_entropy_loss_symint:
  ``at::nll_loss_nd_symint(at::log_softmax(self, class_dim, self.scalar_type()), ...)``.
- log_softmax.int is on AT_FORALL_FP32_SET_OPT_DTYPE (autocast_mode.h), whose wrapper passes
  ``set_opt_dtype(at::kFloat, dtype)``: "If the user has explicitly specified a dtype, respect it"
  (``dtype.has_value() ? dtype : to_type``), so the log-probabilities keep the logits' dtype.
- nll_loss is on AT_FORALL_FP32: ``cached_cast(at::kFloat, self)`` makes an fp32 copy of a 16-bit
  input (``arg.to(at::kFloat)``; only leaves that require grad are cached), and nll_loss_forward's
  backward (NllLossBackward0) saves that copy.
So the CUDA order of an uncast 16-bit loss is ``nll_loss(log_softmax(x, 1, x.dtype).float())``,
which this script runs explicitly, next to CPU autocast's own order (the gloo records').
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from zeroplan.harness.allocator_trace import AllocatorTrace  # noqa: E402

V, S = 4096, 64
"""Vocabulary and sequence length: one fp32 row block (b x s x V) is b MiB."""


def cuda_uncast(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy on 16-bit logits as CUDA autocast dispatches it (module doc)."""
    log_probs = torch.log_softmax(logits, 1, dtype=logits.dtype)  # fp32_set_opt_dtype: explicit dtype kept
    return F.nll_loss(log_probs.to(torch.float32), labels)        # fp32 list: cached_cast's copy


def cpu_autocast_uncast(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy on 16-bit logits under CPU autocast (cross_entropy_loss on its fp32 list)."""
    with torch.autocast("cpu", torch.bfloat16):
        return F.cross_entropy(logits, labels)


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The explicit upcast (the reference model's, transformers' from 4.49): ``.float()`` is no
    autocast op, and nll_loss's cast of an fp32 input copies nothing, so CUDA's order is this."""
    return F.cross_entropy(logits.float(), labels)


def shifted_before_449(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers before 4.49 (4.46-4.48 loss_utils.py ForCausalLMLoss; LlamaForCausalLM.forward
    before 4.46, on logits it upcast itself): ``logits = logits.float()``, ``shift_logits =
    logits[..., :-1, :].contiguous()``, ``shift_logits.view(-1, V)``, then the loss on b x (s - 1)
    rows."""
    upcast = logits.float()
    shift_logits = upcast[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))


CASES = {
    "reference, bf16 logits": (reference, torch.bfloat16, False),
    "uncast, CUDA autocast order, bf16": (cuda_uncast, torch.bfloat16, False),
    "uncast, CUDA autocast order, fp16": (cuda_uncast, torch.float16, False),
    "uncast, CPU autocast (the gloo records' order)": (cpu_autocast_uncast, torch.bfloat16, False),
    "uncast, no autocast, bf16": (F.cross_entropy, torch.bfloat16, False),
    "transformers < 4.49, b x s x V": (shifted_before_449, torch.bfloat16, True),
}


def run(name: str, b: int) -> dict:
    """The case's saved tensors and the live tensors (bytes, allocating op) at its largest moment
    of the backward, beside the logits the loop holds."""
    loss_fn, dtype, three_d = CASES[name]
    torch.manual_seed(0)
    shape = (b, S, V) if three_d else (b * S, V)
    logits = torch.randn(*shape, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, shape[:-1])
    saved: list[tuple[str, tuple[int, ...]]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append((str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
        return tensor

    with AllocatorTrace() as trace:
        with trace.step(0):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = loss_fn(logits, labels)
        with trace.step(1):
            loss.backward()
    peak = trace.peaks()[1]
    unit = 4 * b * S * V
    # Every tensor of a logit block's order alive at the backward's peak, the logits included.
    live = sorted(((size / unit, op) for op, size in peak.live_bytes_by_operator.items() if size >= unit // 8),
                  key=lambda item: -item[0])
    # The backward's allocations in order, from nll_loss_backward's on (its forward's before).
    events = trace.events()
    first = next(i for i, e in enumerate(events) if "backward" in e.operator.lower())
    made = [(e.size_bytes / unit, e.operator) for e in events[first:] if e.size_bytes >= unit // 8]
    return {"saved": [s for s in saved if len(s[1]) > 1 and s[1][-1] == V], "live": live, "made": made}


HIDDEN = 16
"""The lm_head's input width in ordered_before_446: its weight's gradient (V x 16 x 2 bytes) stays
below the quarter of a logit block the sequence keeps."""


def ordered_before_446(b: int, dtype: torch.dtype = torch.float16) -> list[tuple[int, float]]:
    """transformers 4.31-4.45's LlamaForCausalLM loss as the Trainer runs it (4.40.0
    modeling_llama.py:1227-1241, trainer.py:3161-3186): lm_head's 16-bit logits, ``.float()``, the
    shifted ``.contiguous()`` copy and CrossEntropyLoss inside the forward, which returns only the
    loss (the output object goes with compute_loss), then backward through lm_head. Every
    allocation and free of a quarter of an fp32 b x s x V block or more, in order: (tensor number,
    size in fp32 blocks) for an allocation, (tensor number, 0.0) for its free."""
    torch.manual_seed(0)
    hidden = torch.randn(b, S, HIDDEN, dtype=dtype).requires_grad_()
    head = torch.nn.Linear(HIDDEN, V, bias=False).to(dtype)
    labels = torch.randint(0, V, (b, S))

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaForCausalLM.forward's head and loss: (loss, logits), the output object."""
        logits = head(hidden)
        logits = logits.float()
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1)), logits

    def compute_loss() -> torch.Tensor:
        """The Trainer's compute_loss: the loss alone leaves it."""
        outputs = forward()
        return outputs[0]

    with AllocatorTrace() as trace:
        loss = compute_loss()
        loss.backward()
    unit = 4 * b * S * V
    numbers: dict[int, int] = {}
    out: list[tuple[int, float]] = []
    for event in trace.events():
        if event.size_bytes >= unit // 4:
            numbers[event.ptr] = made = len(out) and 1 + max(number for number, _ in out)
            out.append((made, round(event.size_bytes / unit, 3)))
        elif event.size_bytes < 0 and event.ptr in numbers:
            out.append((numbers.pop(event.ptr), 0.0))
    return out


def main() -> None:
    for name in CASES:
        for b in ((1, 2) if CASES[name][2] else (2,)):
            result = run(name, b)
            print(f"{name}, b {b}:")
            print("  saved:", result["saved"])
            print("  alive at the backward's peak, by allocating op (fp32 b s V blocks):",
                  ", ".join(f"{size:.3f} {op}" for size, op in result["live"]))
            print("  the backward's allocations in order:", ", ".join(f"{size:.3f} {op}" for size, op in result["made"]))
    for b in (1, 2):
        print(f"transformers < 4.46 (fp16 lm_head, Trainer's compute_loss), b {b}: every allocation (tensor, fp32 "
              f"blocks) and free (tensor, 0) in order:", ordered_before_446(b))


if __name__ == "__main__":
    main()
