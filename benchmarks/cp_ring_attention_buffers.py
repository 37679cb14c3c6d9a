"""What torch's ring attention (context parallelism over SDPA) allocates, counted on torch's own
code on fake tensors.

torchtitan 9dec370 (the published CP rows' release, benchmarks/published_memory/rows.csv
titan-*-cp*) runs context parallelism as torch's ring attention over SDPA: train.py enters
utils.create_context_parallel_ctx, whose context_parallel() makes DTensor dispatch
aten._scaled_dot_product_flash_attention and its backward to _templated_ring_attention and
_templated_ring_attention_backward (torch/distributed/tensor/experimental/_context_parallel/
_attention.py in torch 2.13), with the KV rotation its config names (9dec370
config_manager.py experimental.context_parallel_rotate_method, default "allgather") and load
balancing on. Each rank of a fake process group of ``cp`` ranks runs both functions on its own
q, k, v (b, heads, s / cp, head_dim in bf16, as 9dec370's model.py calls SDPA after repeat_kv:
k and v with every query head) with the flash op's meta kernels, and every storage they make is
recorded (zeroplan.simulate.alloc_trace); the peak of the live bytes beyond the inputs is
printed in units of X, one local q's bytes, beside the plain flash op's (the same call with no
context parallelism: the forward's output and logsumexp, the backward's dq, dk, dv).

    python benchmarks/cp_ring_attention_buffers.py [--cp 2 4 8 16] [--seq-local 4096] [--heads 16]

Measured (torch 2.13, any local length and head count; the largest over the ranks): backward peak
30.5, 34.5, 42.5, 58.5 X (and 1.5 fp32 logsumexps) at cp 2, 4, 8, 16 = (2 cp + 26.5) X. At cp 8
the peak holds the all-gathered K and V (2 cp X = 16 X, the rotation's one all-gather, kept to
the end), two fp32 dK/dV concatenations (the one sent round the ring by all-to-all and the one
received, 4 X each), four fp32 X-sized tensors (2 X each: the dq, dk and dv accumulators and the
round-robin half-update's concatenation), ten of X bytes (among them the K/V concatenation and
the flash backward's dq, dk, dv) and one of X / 2, on rank 0. The plain op's backward makes
3 X (dq, dk, dv). Forward peak (2 cp + 11) X: 15.0, 19.0, 27.0, 43.0 X; plain 1.0 X and the
logsumexp. c10d's wait_tensor returns its input on a GPU; its fake kernel a new tensor, which
the run undoes (WaitReturnsItsInput).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from zeroplan.allocator.trace import AllocEvent  # noqa: E402
from zeroplan.simulate.alloc_trace import recording_storages  # noqa: E402
from zeroplan.simulate.fake_world import fake_process_group  # noqa: E402

aten = torch.ops.aten


def peak_bytes(events) -> int:
    """The largest sum of live bytes over a recorded trace."""
    live: dict[int, int] = {}
    now = best = 0
    for event in events:
        if isinstance(event, AllocEvent):
            live[event.id] = event.size_bytes
            now += event.size_bytes
            best = max(best, now)
        else:
            now -= live.pop(event.id)
    return best


class WaitReturnsItsInput(TorchDispatchMode):
    """c10d's wait_tensor returns the tensor it waits on (torch/csrc/distributed/c10d/Functional.cpp
    wait_tensor); its fake-tensor kernel returns a new one, which would count every all-gathered
    or permuted buffer twice at its wait."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]
        return func(*args, **(kwargs or {}))


def measure(cp: int, rank: int, heads: int, seq_local: int, head_dim: int = 128) -> tuple[int, int, int]:
    """(X, forward peak, backward peak) in bytes on ``rank`` of ``cp``; cp 1: the plain op."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    with fake_process_group(cp, rank), FakeTensorMode():
        group = dist.group.WORLD
        q, k, v = (torch.empty(1, heads, seq_local, head_dim, dtype=torch.bfloat16) for _ in range(3))
        with recording_storages() as forward, WaitReturnsItsInput():
            if cp == 1:
                out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)
            else:
                out, lse, *rest = _attention._templated_ring_attention(
                    group, 2, aten._scaled_dot_product_flash_attention, q, k, v, is_causal=True)
        grad_out = torch.empty_like(out)
        kwargs = dict(cum_seq_q=rest[0], cum_seq_k=rest[1], max_q=rest[2], max_k=rest[3], dropout_p=0.0,
                      is_causal=True, philox_seed=rest[4], philox_offset=rest[5], scale=None)
        with recording_storages() as backward, WaitReturnsItsInput():
            if cp == 1:
                aten._scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, lse, **kwargs)
            else:
                _attention._templated_ring_attention_backward(
                    group, 2, aten._scaled_dot_product_flash_attention_backward.default, grad_out=grad_out,
                    grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, **kwargs)
        return q.numel() * q.element_size(), peak_bytes(forward.events), peak_bytes(backward.events)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--seq-local", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    options = parser.parse_args(argv)
    print(f"torch {torch.__version__}; local q: 1 x {options.heads} x {options.seq_local} x 128 bf16 = X")
    x, forward, backward = measure(1, 0, options.heads, options.seq_local)
    print(f"plain flash attention: forward {forward / x:.3f} X, backward {backward / x:.3f} X")
    for cp in options.cp:
        readings = [measure(cp, rank, options.heads, options.seq_local) for rank in range(cp)]
        print(f"cp {cp:2d}: forward peak {max(r[1] for r in readings) / x:.3f} X, backward peak "
              f"{max(r[2] for r in readings) / x:.3f} X (largest over its {cp} ranks; smallest backward "
              f"{min(r[2] for r in readings) / x:.3f} X)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
