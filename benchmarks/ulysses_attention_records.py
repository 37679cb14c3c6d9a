"""Measure DeepSpeed-Ulysses' DistributedAttention on gloo ranks: what autograd saves and what
each all-to-all holds while it runs, in units of one local q (tests/test_ulysses.py reads them):

    python benchmarks/ulysses_attention_records.py [OUT_FILE]
        (default benchmarks/ulysses-records/records.json)

Each case spawns P CPU processes on one gloo group and runs deepspeed/sequence/layer.py's own
DistributedAttention (the installed DeepSpeed) as Megatron-DeepSpeed's flash path calls it
(megatron/model/transformer.py:835-846 at f4157be: q, k, v rearranged to contiguous [b, s/P, h, d],
gather_idx 1, batch_dim_idx 0) around a plain math attention (softmax(q k^T / sqrt(d)) v, causal;
it stands for the core attention: the all-to-alls and their buffers do not depend on it). On every
rank, inside a dispatch mode that counts each storage made and still alive (the measurement of
tests/live_storages.py):

- saved_bytes: the storages autograd's saved_tensors_hooks see packed during the forward, the
  all-to-alls' and the core attention's, beside local_saved_bytes, the same math attention called
  alone on fresh [b, s, h/P, d] q, k, v (what it would save with no all-to-all around it);
- per all-to-all call (deepspeed.sequence.layer.single_all_to_all, wrapped): the phase, the
  scatter index, whether its input is contiguous, the most bytes of the storages the call made
  alive at once (peak_own_bytes: its buffers and its result) and its result's bytes. That peak
  moves with when gloo's worker threads make and drop their own buffers (reruns have read it
  above and below the committed one); the committed records are one run's, every other field
  the same on every run (tests/test_ulysses.py).

The output is rearranged to [s/P, b, h d] as the fork does (transformer.py:846) before backward,
so the output all-to-all's backward receives the permuted gradient the fork's does.

X is one local q's bytes, b (s/P) h d e. The process count is small (2 and 4 ranks, seconds each).

Measured (torch 2.13 CPU, deepspeed 0.19.8, bf16; every rank alike): the forward saves exactly what
the math attention alone saves on [b, s, h/P, d] (7.25 X at P 2, 23 X at P 4): the all-to-alls save
nothing. Each call holds, of its own storages, its output and the pre-exchange
permute's copy (2 X), plus the post-exchange permute's copy when the batch is above 1 (a permute
of a batch of 1 is a view): 3 X at b 2, 2 X at b 1; a non-contiguous input's extra copy
(pre_all2all_fun's reshape().contiguous()) is freed once the permute's copy is made, so it adds
to the peak only where that permute is a view (b 1, the gathering direction: 3 X).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroplan.harness.ports import free_local_port  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "ulysses-records" / "records.json"
CASES = ({"sp": 2, "batch": 2, "seq": 64, "heads": 8, "head_dim": 16},
         {"sp": 4, "batch": 1, "seq": 128, "heads": 8, "head_dim": 8})
DTYPE = "bfloat16"


def math_attention(q, k, v):  # type: ignore[no-untyped-def]
    """Causal softmax attention on [b, s, heads, d] tensors, returning [b, s, heads, d]."""
    import torch

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    scores = qt @ kt.transpose(-2, -1) / (q.shape[-1] ** 0.5)
    s = q.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return (probs @ vt).transpose(1, 2).contiguous()


def saved_storages(run):  # type: ignore[no-untyped-def]
    """The distinct storages autograd saves while ``run()`` runs: {pointer: bytes}."""
    import torch

    saved: dict[int, int] = {}

    def pack(tensor):  # type: ignore[no-untyped-def]
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return saved, out


def measure_rank(rank: int, case: dict, port: int) -> dict:
    """One rank's record."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(case["sp"]),
                      LOCAL_RANK=str(rank))
    import torch

    import deepspeed
    import deepspeed.comm as dist
    import deepspeed.sequence.layer as layer
    from einops import rearrange

    from tests.live_storages import live_storage_tracker

    torch.manual_seed(rank)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    sp, b, s, h, d = case["sp"], case["batch"], case["seq"], case["heads"], case["head_dim"]
    dtype = getattr(torch, DTYPE)
    x = b * (s // sp) * h * d * dtype.itemsize
    group = dist.new_group(list(range(sp)))
    attention = layer.DistributedAttention(math_attention, group, scatter_idx=2, gather_idx=1)

    tracker = live_storage_tracker(set())
    state: dict = {"phase": "forward", "peak": 0, "before": None}
    calls: list[dict] = []

    def probe() -> None:
        # Only the storages the running call made: gloo's worker threads drop an earlier call's
        # buffers whenever they finish with them, which a sum of everything alive would mix in.
        if state["before"] is not None:
            own = sum(size for key, size in tracker.live.items() if key not in state["before"])
            state["peak"] = max(state["peak"], own)

    tracker.probe = probe
    plain = layer.single_all_to_all

    def recorded(input, scatter_idx, gather_idx, batch_dim_idx, group, *args, **kwargs):  # type: ignore[no-untyped-def]
        state["before"], state["peak"] = set(tracker.live), 0
        result = plain(input, scatter_idx, gather_idx, batch_dim_idx, group, *args, **kwargs)
        state["before"] = None
        calls.append({"phase": state["phase"], "scatter_idx": scatter_idx, "input_shape": list(input.shape),
                      "input_contiguous": input.is_contiguous(),
                      "result_shape": list(result.shape),
                      "peak_own_bytes": state["peak"],
                      "result_bytes": result.untyped_storage().nbytes()})
        return result

    layer.single_all_to_all = recorded
    with tracker:
        # Made inside the tracker: a view of a storage made outside it would count as new.
        q, k, v = (torch.randn(b, s // sp, h, d, dtype=dtype, requires_grad=True) for _ in range(3))
        saved, out = saved_storages(lambda: attention(q, k, v, 0))
        # transformer.py:846: the fork rearranges the context to [s, b, h d] (a copy), so the
        # gradient reaching the output all-to-all in backward is a permuted, non-contiguous view.
        context = rearrange(out, "b s h d -> s b (h d)").contiguous()
        state["phase"] = "backward"
        context.backward(torch.randn_like(context))
    layer.single_all_to_all = plain
    local = [torch.randn(b, s, h // sp, d, dtype=dtype, requires_grad=True) for _ in range(3)]
    local_saved, _ = saved_storages(lambda: math_attention(*local))
    dist.destroy_process_group()
    return {"rank": rank, "x_bytes": x, "output_shape": list(out.shape), "saved_bytes": sum(saved.values()),
            "local_saved_bytes": sum(local_saved.values()), "all_to_all_calls": calls}


def _worker(rank: int, case: dict, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    queue.put(measure_rank(rank, case, port))


def measure(case: dict) -> dict:
    """The case's record, its ranks' in order."""
    import deepspeed
    import torch
    import torch.multiprocessing as mp

    port = free_local_port()  # not bind(0): see zeroplan/harness/ports.py
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, case, port, queue)) for rank in range(case["sp"])]
    for process in processes:
        process.start()
    ranks = sorted((queue.get(timeout=300) for _ in processes), key=lambda r: r["rank"])
    for process in processes:
        process.join()
    return {**case, "dtype": DTYPE, "torch": torch.__version__, "deepspeed": deepspeed.__version__, "ranks": ranks}


def main() -> None:
    from benchmarks.script_args import checked_argv
    from zeroplan.atomic import write_text_atomic

    argv = checked_argv(sys.argv[1:], __doc__)
    out = Path(argv[0]) if argv else DEFAULT_OUT
    records = [measure(case) for case in CASES]
    out.parent.mkdir(parents=True, exist_ok=True)
    how = __doc__.strip().splitlines()[0] + " (benchmarks/ulysses_attention_records.py)"
    write_text_atomic(out, json.dumps({"how": how, "records": records}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
