"""Real per-rank allocator peaks for an N-way shard of a ~1B model, on ONE CUDA GPU.

A fake process group (torch.testing._internal.distributed.fake_pg, backend "fake") makes this
single process act as rank 0 of N: every collective returns at once without moving data, but
all tensors are real CUDA tensors of the sizes rank 0 would hold, so torch.cuda.max_memory_
allocated is the real peak of that rank (the parameter values are meaningless). Each
strategy runs in a fresh subprocess so allocator statistics start clean.

    python benchmarks/gpu_measure.py --world-size 8 --out "$OUT"          # on a GPU machine
    python benchmarks/gpu_measure.py --device cpu --model micro-llama ...  # tiny smoke run

Writes <out>/<strategy>-<engine>/rank00000.json (zeroplan.harness.record.RankRecord). On CUDA
the records state ``kernels: cuda`` (the runner records the device it ran on), so `zeroplan
validate <out>` compares them with the planner's cuda figures (the fused RMSNorm among them).
No NCCL runs here (the fake group moves nothing), so these records have no ``nccl_log``: the
NCCL-log cross-check (zeroplan/harness/nccl_log.py) applies to real multi-GPU torchrun runs
(``zeroplan measure`` / ``python -m zeroplan.harness`` with the NCCL backend) only.
Budget: about 1 minute per strategy for the 1B model on an H100/H200, < 8 minutes in total.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CASES = "zero1:zeroplan,zero2:zeroplan,zero3:zeroplan,fsdp-full-shard:torch,fsdp-shard-grad-op:torch"


def llama_1b():  # type: ignore[no-untyped-def]
    """A Llama-3.2-1B-shaped model (h=2048, L=16, 32 heads, 8 KV heads, f=8192), V=32000: ~1.1B."""
    from zeroplan.specs import ModelSpec

    return ModelSpec(name="llama-1b-like", vocab_size=32000, hidden_size=2048, num_layers=16,
                     num_heads=32, num_kv_heads=8, ffn_hidden_size=8192, max_positions=4096)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=8, help="N: ranks the fake group pretends to have")
    parser.add_argument("--model", default="llama-1b-like", help="llama-1b-like or a harness preset")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated strategy:engine pairs")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2, help="step 0 is the warm-up")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-measurements")))
    parser.add_argument("--timeout-s", type=float, default=150, help="per case")
    parser.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: one case
    return parser


def _run_single(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zeroplan.harness.engines import EngineKind
    from zeroplan.harness.presets import HARNESS_PRESETS
    from zeroplan.harness.runner import RunConfig, run_rank
    from zeroplan.specs import BatchSpec, Kernels, StrategyKind, TrainingSpec

    strategy, engine = args.single.split(":")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    else:
        # run_rank places tensors on CUDA whenever it is available; hide it for the smoke run.
        torch.cuda.is_available = lambda: False
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    spec = llama_1b() if args.model == "llama-1b-like" else HARNESS_PRESETS[args.model]
    config = RunConfig(model=spec, strategy=StrategyKind(strategy), engine=EngineKind(engine),
                       training=TrainingSpec(precision=args.precision, kernels=Kernels(args.device)),
                       batch=BatchSpec(micro_batch_size=args.micro_batch, seq_len=args.seq_len),
                       steps=args.steps, run_id=f"fake-pg-{args.world_size}")
    record, _ = run_rank(config, args.out / f"{strategy}-{engine}", gather_full=False)
    last = record.steps[-1]
    print(f"{strategy}:{engine} N={args.world_size} model states {last.model_state.total_bytes / 2**20:.1f} MiB, "
          f"tracked peak {(last.memory.peak_bytes or 0) / 2**20:.1f} MiB, "
          f"cuda max allocated {(last.memory.cuda_max_allocated_bytes or 0) / 2**20:.1f} MiB")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.single:
        _run_single(args)
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    failures = 0
    for case in args.cases.split(","):
        start = time.perf_counter()
        command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--single", case]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout_s)
            lines = (done.stdout.strip() or done.stderr.strip() or "no output").splitlines()
            print(lines[-1] if done.returncode == 0 else f"{case}: FAILED: {lines[-1]}", flush=True)
            failures += done.returncode != 0
        except subprocess.TimeoutExpired:
            print(f"{case}: timed out after {args.timeout_s:g} s", flush=True)
            failures += 1
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
